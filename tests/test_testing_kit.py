"""The contract kit (accelfn.testing) refuses broken transforms and accepts correct ones."""

from __future__ import annotations

import contextlib
import weakref

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


# ------------------------------------------------------------- mutants of the contract
# Each transform below breaks one property the kit promises to check; a warm-up that halves
# the gradients of a state's first update is the transform they get wrong.
def _warmup(name, updates_of):
    """A transform halving the gradients while ``updates_of(ctx)`` (a counter) is 0."""
    def gradients(ctx):
        counter = updates_of(ctx)
        if counter["updates"] == 0:
            halve(ctx)
        counter["updates"] += 1

    return af.Transform(name, af.Hooks(gradients=gradients), preserves_finite=True)


@pytest.fixture
def reference():
    """The warm-up by hand, for one run: its first update has the gradients halved."""
    updates = []

    def halve_first(model):
        if not updates:
            for p in model.parameters():
                p.grad.mul_(0.5)
        updates.append(1)

    def by_hand(model, optimizer, batch):
        plain_update(model, optimizer, batch, loss_fn, edit_grads=halve_first)

    return by_hand


def test_a_warmup_counting_updates_in_its_slot_passes(reference):
    warmup = _warmup("warmup", lambda ctx: ctx.state.slot("warmup", lambda: {"updates": 0}))
    report = check_transform(warmup, reference=reference, loss_fn=loss_fn)
    assert report.passed == ALL


def test_catches_state_kept_in_a_closure_across_states(reference):
    counter = {"updates": 0}  # shared by every state the step ever trains
    with pytest.raises(AssertionError, match="trained twice on fresh states"):
        check_transform(_warmup("warmup", lambda ctx: counter), reference=reference,
                        loss_fn=loss_fn)


def test_catches_state_kept_in_a_closure_for_the_last_state_seen(reference):
    last = {"state": None, "updates": 0}  # reset for a new state: right one state at a time

    def updates_of(ctx):
        if last["state"] is not ctx.state:
            last.update(state=ctx.state, updates=0)
        return last

    with pytest.raises(AssertionError, match="two states trained in turn"):
        check_transform(_warmup("warmup", updates_of), reference=reference, loss_fn=loss_fn)


def test_catches_state_kept_per_state_outside_the_train_state(reference):
    per_state = weakref.WeakKeyDictionary()  # never checkpointed

    def updates_of(ctx):
        return per_state.setdefault(ctx.state, {"updates": 0})

    with pytest.raises(AssertionError, match="resume from state_dict"):
        check_transform(_warmup("warmup", updates_of), reference=reference, loss_fn=loss_fn)


class _Counter(dict):
    """A slot whose state_dict leaves out the counter the transform reads."""

    def __init__(self):
        super().__init__(updates=0)

    def state_dict(self):
        return {}

    def load_state_dict(self, saved):
        pass


def test_catches_a_state_dict_leaving_out_a_counter(reference):
    warmup = _warmup("warmup", lambda ctx: ctx.state.slot("warmup", _Counter))
    with pytest.raises(AssertionError, match="resume from state_dict"):
        check_transform(warmup, reference=reference, loss_fn=loss_fn)


def test_catches_noise_drawn_from_the_global_generator():
    def noise(grads):
        for g in grads:
            g.add_(torch.randn(g.shape), alpha=0.01)

    def by_hand(model, optimizer, batch):  # the same draws: make_model seeds the generator
        plain_update(model, optimizer, batch, loss_fn,
                     edit_grads=lambda m: noise([p.grad for p in m.parameters()]))

    broken = af.Transform("noisy", af.Hooks(gradients=lambda ctx: noise(ctx.grads())))
    with pytest.raises(AssertionError, match="two states trained in turn"):
        check_transform(broken, reference=by_hand, loss_fn=loss_fn)


@pytest.mark.parametrize("read", [lambda g: g.sum().item(), lambda g: g.cpu(),
                                  lambda g: bool(g.sum()), lambda g: g.tolist(),
                                  lambda g: g.numpy(), lambda g: g[g > 0]],
                         ids=["item", "cpu", "bool", "tolist", "numpy", "mask"])
def test_catches_a_host_sync_on_every_update(read):
    broken = af.Transform("peek", af.Hooks(gradients=lambda ctx: read(ctx.grads()[0])),
                          commutes=True)
    with pytest.raises(AssertionError, match="adds host syncs"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)


def test_catches_a_host_sync_on_a_states_first_update_only():
    def record(ctx):  # reads the first gradient norm to the host once, when the slot is new
        first = ctx.state.slot("first_norm", lambda: {"norm": None})
        if first["norm"] is None:
            first["norm"] = float(ctx.grads()[0].norm())

    broken = af.Transform("first_norm", af.Hooks(gradients=record), commutes=True)
    with pytest.raises(AssertionError, match="adds host syncs"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)


def test_catches_a_gradient_edit_one_rounding_away_from_the_reference():
    def almost(ctx):
        for g in ctx.grads():
            g.mul_(1 + 1e-7)  # one float32 ulp: the kit compares bitwise

    broken = af.Transform("almost", af.Hooks(gradients=almost), preserves_finite=True)
    with pytest.raises(AssertionError, match=r"against the reference: model .* differs"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)


def test_catches_an_abort_undoing_work_its_call_never_did():
    def count(ctx):  # counts updates where the call has reached them
        ctx.state.slot("updates", lambda: {"n": 0})["n"] += 1

    def abort(ctx):  # ...but undoes one on any failure, the loss function's included
        ctx.state.slot("updates", lambda: {"n": 0})["n"] -= 1

    broken = af.Transform("updates", af.Hooks(gradients=count, abort=abort), commutes=True,
                          preserves_finite=True)
    with pytest.raises(AssertionError, match=r"failed call: state\['slots'\]\['updates'\]"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)


def test_catches_a_step_that_changes_its_batch_in_place():
    def shrink(ctx, batch):  # trains on x / 2, and leaves the caller's batch halved
        batch["x"].mul_(0.5)
        return af.Plan((batch,))

    broken = af.Transform("shrink", af.Hooks(split=shrink))
    # before, the reference ran on the halved batches and passed; purity then blamed the step
    with pytest.raises(AssertionError, match=r"batch in place.*: batches\[0\]\['x'\] differs"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)

