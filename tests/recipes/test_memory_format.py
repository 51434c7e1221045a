"""channels_last: conv models and image batches converted, everything else left alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from helpers import Net
from tensordict import TensorDict
from torch import nn

import accelfn as af
from accelfn.recipes.memory_format import channels_last, is_channels_last

CL = torch.channels_last


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


def test_conv_model_is_converted_in_place_with_the_same_outputs():
    model = torchvision.models.resnet18(num_classes=10).eval()
    reference = copy.deepcopy(model)
    assert not is_channels_last(model)
    assert channels_last(model) is model
    assert is_channels_last(model)
    assert all(p.is_contiguous(memory_format=CL) for p in model.parameters() if p.dim() == 4)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        out = model(channels_last(x))
        torch.testing.assert_close(out, reference(x), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name  # same values, other strides


def test_models_without_2d_convolutions_are_left_alone():
    net = Net()
    strides = [p.stride() for p in net.parameters()]
    assert channels_last(net) is net
    assert [p.stride() for p in net.parameters()] == strides
    assert not is_channels_last(net)
    conv3d = nn.Sequential(nn.Conv3d(2, 4, 3), nn.Conv2d(4, 4, 1))
    channels_last(conv3d)  # 5-D weights are not touched (model.to(channels_last) would fail)
    assert conv3d[0].weight.is_contiguous()
    assert conv3d[1].weight.is_contiguous(memory_format=CL)


def test_tensors_and_batches():
    image = torch.randn(2, 3, 5, 5)
    assert channels_last(image).is_contiguous(memory_format=CL)
    assert torch.equal(channels_last(image), image)
    tokens = torch.randn(2, 7, 16)
    assert channels_last(tokens) is tokens
    batch = TensorDict({"image": image, "label": torch.tensor([0, 1]), "mask": tokens},
                       batch_size=[2])
    out = channels_last(batch)
    assert out["image"].is_contiguous(memory_format=CL)
    assert out["label"] is batch["label"] and out["mask"] is batch["mask"]
    assert not batch["image"].is_contiguous(memory_format=CL)  # the input batch is unchanged
    text = TensorDict({"tokens": torch.zeros(2, 8, dtype=torch.long)}, batch_size=[2])
    assert channels_last(text) is text
    with pytest.raises(TypeError, match="model, a tensor or a TensorDict"):
        channels_last([image])


def test_training_in_channels_last_matches_nchw():
    def fn(model, batch):
        return F.cross_entropy(model(channels_last(batch["image"])), batch["label"])

    a = small_cnn()
    b = channels_last(copy.deepcopy(a))
    sa = af.TrainState(a, torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9))
    sb = af.TrainState(b, torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9))
    step = af.lift(fn)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = TensorDict({"image": torch.randn(4, 3, 8, 8, generator=g),
                            "label": torch.randint(0, 4, (4,), generator=g)}, batch_size=[4])
        la, lb = step(sa, batch)["loss"], step(sb, batch)["loss"]
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    assert is_channels_last(b)  # the optimizer kept the format
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
