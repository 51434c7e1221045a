"""untracked_batchnorm: batch statistics inside, running statistics left alone, every flag
restored as it was (on exceptions and nested blocks too), refusals before any change."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import accelfn as af


class Norms(nn.Module):
    """Every kind of BatchNorm, one built without running statistics, and a lazy one."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm1d(3)
        self.bn2 = nn.BatchNorm2d(3, momentum=None)  # cumulative average: num_batches_tracked
        self.bn3 = nn.BatchNorm3d(3)
        self.sync = nn.SyncBatchNorm(3)  # one process: torch's batch_norm
        self.lazy = nn.LazyBatchNorm1d()
        self.plain = nn.BatchNorm1d(3, track_running_stats=False)

    def forward(self, x):  # x: (N, 3, 2, 2, 2)
        h = self.bn3(x).mean(-1)
        h = self.sync(self.bn2(h)).mean(-1)
        return self.plain(self.lazy(self.bn1(h))).sum(-1)


def model_and_input():
    torch.manual_seed(0)
    model = Norms()
    model(torch.randn(5, 3, 2, 2, 2))  # the lazy layer takes its shape; statistics move
    return model, torch.randn(6, 3, 2, 2, 2, requires_grad=True)


def flags(model):
    return [m.track_running_stats for m in model.modules() if isinstance(m, nn.BatchNorm1d)
            or isinstance(m, (nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm))]


def test_batch_statistics_inside_running_statistics_untouched_flags_restored():
    model, x = model_and_input()
    outside = copy.deepcopy(model)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    assert flags(model) == [True, True, True, True, True, False]
    with af.untracked_batchnorm(model) as same:
        assert same is model and flags(model) == [False] * 6
        out = model(x)
        with af.untracked_batchnorm(model):  # nested: changes and restores nothing
            model(x)
        assert flags(model) == [False] * 6
    assert flags(model) == [True, True, True, True, True, False]
    for k, v in model.state_dict().items():
        assert torch.equal(v, buffers[k]), k
    expected = outside(x)  # a training forward outside: the same output, bitwise
    assert torch.equal(out, expected)
    (g,) = torch.autograd.grad(out.sum(), x)
    (h,) = torch.autograd.grad(expected.sum(), x)
    assert torch.equal(g, h)
    moved = outside.state_dict()
    assert all(not torch.equal(moved[k], buffers[k]) for k in buffers if "running" in k
               or "num_batches" in k)  # outside, every tracking layer counted the batch
    model(x)
    assert torch.equal(model.state_dict()["bn1.running_mean"], moved["bn1.running_mean"])


def test_an_exception_inside_restores_the_flags_and_propagates():
    model, _ = model_and_input()
    with pytest.raises(KeyError, match="inside"), af.untracked_batchnorm(model):
        raise KeyError("inside")
    assert flags(model) == [True, True, True, True, True, False]


@pytest.mark.parametrize("layer, error", [
    (nn.InstanceNorm1d(3, track_running_stats=True), "InstanceNorm updates them in training mode"),
    (nn.LazyBatchNorm1d(), "has not run yet"),
])
def test_refuses_layers_it_cannot_keep_from_updating_before_changing_anything(layer, error):
    model = nn.Sequential(nn.BatchNorm1d(3), layer)
    with pytest.raises(ValueError, match=error), af.untracked_batchnorm(model):
        pass
    assert model[0].track_running_stats
    with pytest.raises(TypeError, match="takes a module"), af.untracked_batchnorm(
            torch.zeros(1)):  # type: ignore[type-var]
        pass
