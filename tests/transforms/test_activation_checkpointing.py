"""checkpointed: identical gradients to no checkpointing, fewer saved activations."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import Block, Net, as_dict, assert_params_equal, classify, clone_setup, make_batch
from reference import reference_update
from torch import nn

import accelfn as af


class DropNet(Net):
    """Net with dropout inside blocks: recomputation must replay the same random mask."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = self.drop(block(h))
        return self.head(h)


@pytest.mark.parametrize("options", [
    {}, {"every": 2}, {"blocks": (Block,)}, {"blocks": lambda n, m: n == "blocks.1"},
    {"selective": True}, {"selective": [torch.ops.aten.addmm.default]},
])
def test_gradients_identical_to_no_checkpointing(options):
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(DropNet())
    step = af.checkpointed(**options)(classify)
    state = af.TrainState(m1, o1)
    for i in range(3):
        batch = make_batch(seed=i)
        torch.manual_seed(100 + i)
        step(state, batch)
        torch.manual_seed(100 + i)
        reference_update(m2, o2, as_dict(batch), classify)
    assert_params_equal(m1, m2)


def test_checkpointing_saves_fewer_activations():
    def saved_bytes(model):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        batch = make_batch(n=64)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            classify(model, as_dict(batch))["loss"]
        return total[0]

    torch.manual_seed(0)
    model = Net(dim=64, depth=4)
    plain = saved_bytes(model)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    af.checkpointed(classify).prepare(state)
    assert saved_bytes(model) < plain / 2


def test_find_blocks_resnet_and_transformer():
    resnet = torchvision.models.resnet18()
    names = [n for n, _ in af.find_blocks(resnet)]
    assert names == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
                                    num_layers=3, enable_nested_tensor=False)
    assert [n for n, _ in af.find_blocks(encoder)] == ["layers.0", "layers.1", "layers.2"]
    assert [n for n, _ in af.find_blocks(Net())] == ["blocks.0", "blocks.1", "blocks.2"]


def test_resnet_checkpointed_equals_plain_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4)
    (m1, o1), (m2, o2) = clone_setup(model)

    def fn(model, batch):
        return F.cross_entropy(model(batch["image"]), batch["label"])

    batch = {"image": torch.randn(2, 3, 32, 32), "label": torch.tensor([0, 3])}
    state = af.TrainState(m1, o1)
    af.checkpointed(fn)(state, batch)
    reference_update(m2, o2, batch, fn)
    # BatchNorm statistics are updated once more by recomputation: compare parameters only
    assert_params_equal(m1, m2)


def test_wrap_keeps_state_dict_and_deepcopy_runs_its_own_weights():
    torch.manual_seed(0)
    model = Net()
    keys = list(model.state_dict())
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_amp(fp32=Block)(af.checkpointed(classify))
    step(state, make_batch())
    assert list(model.state_dict()) == keys
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = make_batch()["x"]
    assert torch.all(twin(x) == 0)
    assert not torch.all(model(x) == 0)


def test_no_block_found_is_a_clear_error():
    model = nn.Linear(6, 4)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="found no block"):
        af.checkpointed(classify)(state, make_batch())


def test_bad_options():
    with pytest.raises(ValueError, match="every"):
        af.checkpointed(every=0)
    with pytest.raises(ValueError, match="blocks"):
        af.checkpointed(blocks="all")
