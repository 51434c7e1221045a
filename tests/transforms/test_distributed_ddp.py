"""DDP over a channels_last model (2 processes, gloo, CPU): no "Grad strides do not match
bucket view strides" warning.

A 1x1 convolution's weight ``(out, in, 1, 1)`` is contiguous both ways: ``af.channels_last``
(``t.contiguous(memory_format=torch.channels_last)`` of each weight) leaves its strides
``(in, 1, 1, 1)``, while the convolution's backward makes its gradient with channels_last's
own ``(in, 1, in, in)``. DDP builds its bucket views from the parameters' strides, so the
first backward warned (a ResNet's downsampling convolutions: examples/classify_images.py under
``torchrun``) and copied those gradients into their buckets. The DDP wrapping gives such a
weight the strides its gradient has.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=2
test_distributed_ddp.py OUT`` trains two updates on each rank and saves the warnings it saw
and the parameters in ``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
if TESTS not in sys.path:  # under torchrun: helpers sit in tests/
    sys.path.insert(0, TESTS)

from helpers import save_rank_results, torchrun_results  # noqa: E402

import accelfn as af  # noqa: E402
from accelfn.parts.distributed.ddp import match_gradient_strides  # noqa: E402


class ConvNet(nn.Module):
    """A 3x3 convolution, a 1x1 one (a ResNet's downsampling) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.Conv2d(8, 16, 1, stride=2, bias=False)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.down(F.relu(self.conv(x)))
        return self.head(h.mean((2, 3)))


def conv_step(model, batch):
    return F.cross_entropy(model(batch["image"]), batch["label"])


def batches(rank: int, n: int = 2):
    g = torch.Generator().manual_seed(rank)
    return [{"image": torch.randn(4, 3, 8, 8, generator=g).contiguous(
        memory_format=torch.channels_last), "label": torch.randint(0, 4, (4,), generator=g)}
        for _ in range(n)]


def _train(out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    af.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = af.channels_last(ConvNet())  # as examples/classify_images.py
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    step = af.distributed(conv_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches(rank):
            step(state, batch)
    save_rank_results(out, {
        "warnings": [str(w.message) for w in caught if "strides" in str(w.message)],
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "strides": {k: v.stride() for k, v in model.named_parameters()},
    })


pytestmark = pytest.mark.distributed


def test_ddp_over_a_channels_last_model_does_not_warn_of_grad_strides(tmp_path):
    results = torchrun_results(__file__, tmp_path)
    for result in results:
        assert result["warnings"] == []
        assert result["strides"]["down.weight"] == (8, 1, 8, 8)  # channels_last's own
    for name, value in results[0]["params"].items():  # the replicas agree
        torch.testing.assert_close(results[1]["params"][name], value, rtol=0, atol=0)


def test_only_the_weights_of_a_channels_last_model_are_restrided_and_keep_their_values():
    torch.manual_seed(0)
    model = af.channels_last(ConvNet())
    before = copy.deepcopy(model.state_dict())
    parameter = model.down.weight
    assert parameter.stride() == (8, 1, 1, 1)  # contiguous both ways: left as it was
    match_gradient_strides(model)
    assert model.down.weight is parameter and parameter.stride() == (8, 1, 8, 8)
    assert model.conv.weight.stride() == (27, 1, 9, 3)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    plain = ConvNet()  # not channels_last: its 1x1 weight keeps the contiguous strides
    match_gradient_strides(plain)
    assert plain.down.weight.stride() == (8, 1, 1, 1)
    assert plain.conv.weight.is_contiguous()


if __name__ == "__main__":
    _train(sys.argv[1])
