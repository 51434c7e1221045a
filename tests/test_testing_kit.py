"""The contract kit (accelfn.testing) refuses broken transforms and accepts correct ones."""

from __future__ import annotations

import contextlib

import pytest
import torch
from halving import halve, halved, loss_fn
from torch import nn

import accelfn as af
from accelfn.testing import check_transform, plain_update


def plain(model, optimizer, batch):
    plain_update(model, optimizer, batch, loss_fn)


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


def make_batchnorm_net():
    torch.manual_seed(0)
    return BatchNormNet()


ALL = ["reference", "purity", "orders", "resume", "no host sync", "bad input"]


def test_a_correct_transform_on_a_model_with_buffers_passes():
    halving = af.Transform("halve_grads", af.Hooks(gradients=halve), preserves_finite=True)
    report = check_transform(halving, reference=halved, loss_fn=loss_fn,
                             make_model=make_batchnorm_net)
    assert report.passed == ALL


def test_catches_a_transform_that_changes_the_model_buffers():
    def halve_buffers(ctx, skipped):  # outside its slot; the parameters stay right
        for b in ctx.state.model.buffers():
            if b.is_floating_point():
                b.mul_(0.5)

    broken = af.Transform("halve_buffers", af.Hooks(after_update=halve_buffers), commutes=True)
    with pytest.raises(AssertionError, match="against the reference"):
        check_transform(broken, reference=plain, loss_fn=loss_fn, make_model=make_batchnorm_net)


def test_catches_a_transform_that_changes_the_optimizer_state():
    def reset_momentum(ctx, skipped):
        for s in ctx.state.optimizer.state.values():
            s["momentum_buffer"].mul_(0.5)

    broken = af.Transform("reset_momentum", af.Hooks(after_update=reset_momentum),
                          commutes=True)
    with pytest.raises(AssertionError, match="against the reference"):
        check_transform(broken, reference=plain, loss_fn=loss_fn, steps=2)


def _counting(undo):
    def micro_context(ctx, index, sync):
        ctx.state.slot("counting", lambda: {"calls": 0})["calls"] += 1
        return contextlib.nullcontext()

    def abort(ctx):
        ctx.state.slot("counting", lambda: {"calls": 0})["calls"] -= 1

    hooks = af.Hooks(micro_context=micro_context)
    if undo:
        hooks["abort"] = abort
    return af.Transform("counting", hooks)


def test_catches_state_left_changed_by_a_failed_call():
    with pytest.raises(AssertionError, match="failed call"):
        check_transform(_counting(undo=False), reference=plain, loss_fn=loss_fn)


def test_a_transform_undoing_its_work_on_a_failed_call_passes():
    report = check_transform(_counting(undo=True), reference=plain, loss_fn=loss_fn)
    assert report.passed == ALL


def test_catches_a_host_sync_made_on_some_updates_only():
    def every_other(ctx):  # e.g. logging every N updates
        if ctx.state.step % 2 == 0:
            float(ctx.grads()[0].sum())

    broken = af.Transform("every_other", af.Hooks(gradients=every_other), commutes=True)
    with pytest.raises(AssertionError, match="host syncs"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)


@pytest.mark.parametrize("steps", [3, 4])
def test_the_calls_mode_accumulation_passes(steps):
    # a window is open after an odd number of calls: the kit saves at a window boundary
    report = check_transform(af.with_accumulation(2, mode="calls"), loss_fn=loss_fn,
                             steps=steps)
    assert report.passed == ALL[1:]


def test_an_unseeded_make_model_is_named_as_the_cause():
    halving = af.Transform("halve_grads", af.Hooks(gradients=halve), preserves_finite=True)
    with pytest.raises(AssertionError, match="make_model"):
        check_transform(halving, reference=halved, loss_fn=loss_fn,
                        make_model=lambda: nn.Linear(6, 4))


@pytest.mark.parametrize("steps", [0, 1, 2.0, True])
def test_too_few_steps_to_check_a_resume_are_refused(steps):
    # with one step the resume check had no step after the resume: it passed vacuously
    with pytest.raises(ValueError, match="steps"):
        check_transform(af.with_clipping(max_norm=0.5), loss_fn=loss_fn, steps=steps)
