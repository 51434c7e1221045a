"""The contract kit (accelfn.testing) refuses broken transforms and accepts correct ones."""

from __future__ import annotations

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
    halving = af.GradientTransform("halve_grads", halve)
    report = check_transform(halving, reference=halved, loss_fn=loss_fn,
                             make_model=make_batchnorm_net)
    assert report.passed == ALL


def test_catches_a_transform_that_changes_the_parameters_itself():
    def decay(grads, params, state):  # edits the weights instead of the gradients
        for p in params:
            p.detach().mul_(0.999)

    broken = af.GradientTransform("decay_weights", decay)
    with pytest.raises(AssertionError, match="against the reference"):
        check_transform(broken, reference=plain, loss_fn=loss_fn, make_model=make_batchnorm_net)


def test_catches_a_builtin_part_that_changes_the_optimizer_state(monkeypatch):
    def reset_momentum(options, ctx, skipped):
        for s in ctx.state.optimizer.state.values():
            s["momentum_buffer"].mul_(0.5)

    from accelfn.parts import averaging  # a broken EMA: its update halves the momentum

    monkeypatch.setattr(averaging, "update", reset_momentum)
    broken = af.with_ema(decay=0.9)
    with pytest.raises(AssertionError, match="against the reference"):
        check_transform(broken, reference=plain, loss_fn=loss_fn, steps=2)


def _counting(in_place):
    def count(grads, params, state):
        if in_place:  # writes to the state it was given: a failed call keeps the count
            state["calls"] += 1
            return None
        return {"calls": state["calls"] + 1}

    return af.GradientTransform("counting", count, init=lambda params: {"calls": 0})


def test_catches_state_written_in_place_before_a_failed_optimizer_step():
    with pytest.raises(AssertionError, match="optimizer step failed"):
        check_transform(_counting(in_place=True), reference=plain, loss_fn=loss_fn)


def test_a_transform_returning_its_new_state_passes():
    report = check_transform(_counting(in_place=False), reference=plain, loss_fn=loss_fn)
    assert report.passed == ALL


def test_catches_a_host_sync_made_on_some_updates_only():
    def every_other(grads, params, state):  # e.g. logging every N updates
        if state["n"] % 2 == 0:
            float(grads[0].sum())
        return {"n": state["n"] + 1}

    broken = af.GradientTransform("every_other", every_other, init=lambda params: {"n": 0})
    with pytest.raises(AssertionError, match="host syncs"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)


@pytest.mark.parametrize("steps", [3, 4])
def test_the_calls_mode_accumulation_passes(steps):
    # a window is open after an odd number of calls: the kit saves at a window boundary
    report = check_transform(af.with_accumulation(2, mode="calls"), loss_fn=loss_fn,
                             steps=steps)
    assert report.passed == ALL[1:]


def test_a_check_that_could_not_run_fails():
    """Every stacking order refused: the orders check ran nothing, which is no pass."""
    with pytest.raises(AssertionError, match=r"no stacking order .* could run"):
        check_transform(af.with_clipping(max_norm=0.5), loss_fn=loss_fn,
                        builtins=[af.with_clipping(max_norm=1.0)])


def test_an_unseeded_make_model_is_named_as_the_cause():
    halving = af.GradientTransform("halve_grads", halve)
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
    """A gradient transform halving the gradients while ``updates_of(params, state)`` (a
    counter) is 0; the counter is its state when ``updates_of`` returns the state."""
    def update(grads, params, state):
        counter = updates_of(params, state)
        if counter["updates"] == 0:
            halve(grads, params, None)
        if counter is state:
            return {"updates": counter["updates"] + 1}
        counter["updates"] += 1
        return None

    return af.GradientTransform(name, update, init=lambda params: {"updates": 0})


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


def test_a_warmup_counting_updates_in_its_state_passes(reference):
    warmup = _warmup("warmup", lambda params, state: state)
    report = check_transform(warmup, reference=reference, loss_fn=loss_fn)
    assert report.passed == ALL


def test_catches_state_kept_in_a_closure_across_states(reference):
    counter = {"updates": 0}  # shared by every state the step ever trains
    with pytest.raises(AssertionError, match="trained twice on fresh states"):
        check_transform(_warmup("warmup", lambda params, state: counter), reference=reference,
                        loss_fn=loss_fn)


def test_catches_state_kept_in_a_closure_for_the_last_model_seen(reference):
    last = {"param": None, "updates": 0}  # reset for a new model: right one at a time

    def updates_of(params, state):
        if last["param"] is not params[0]:
            last.update(param=params[0], updates=0)
        return last

    with pytest.raises(AssertionError, match="two states trained in turn"):
        check_transform(_warmup("warmup", updates_of), reference=reference, loss_fn=loss_fn)


def test_catches_state_kept_per_model_outside_the_train_state(reference):
    def updates_of(params, state):  # kept on the model's first parameter: never checkpointed
        if not hasattr(params[0], "_warmup_counter"):
            params[0]._warmup_counter = {"updates": 0}
        return params[0]._warmup_counter

    with pytest.raises(AssertionError, match="resume from state_dict"):
        check_transform(_warmup("warmup", updates_of), reference=reference, loss_fn=loss_fn)


class _Counter(dict):
    """A state whose state_dict leaves out the counter the transform reads."""

    def __init__(self):
        super().__init__(updates=0)

    def state_dict(self):
        return {}

    def load_state_dict(self, saved):
        pass


def test_catches_a_state_dict_leaving_out_a_counter(reference):
    def update(grads, params, state):
        if state["updates"] == 0:
            halve(grads, params, None)
        state["updates"] += 1

    warmup = af.GradientTransform("warmup", update, init=lambda params: _Counter())
    with pytest.raises(AssertionError, match="resume from state_dict"):
        check_transform(warmup, reference=reference, loss_fn=loss_fn)


def test_catches_noise_drawn_from_the_global_generator():
    def noise(grads):
        for g in grads:
            g.add_(torch.randn(g.shape), alpha=0.01)

    def by_hand(model, optimizer, batch):  # the same draws: make_model seeds the generator
        plain_update(model, optimizer, batch, loss_fn,
                     edit_grads=lambda m: noise([p.grad for p in m.parameters()]))

    broken = af.GradientTransform("noisy", lambda grads, params, state: noise(grads))
    with pytest.raises(AssertionError, match="two states trained in turn"):
        check_transform(broken, reference=by_hand, loss_fn=loss_fn)


@pytest.mark.parametrize("read", [lambda g: g.sum().item(), lambda g: g.cpu(),
                                  lambda g: bool(g.sum()), lambda g: g.tolist(),
                                  lambda g: g.numpy(), lambda g: g[g > 0]],
                         ids=["item", "cpu", "bool", "tolist", "numpy", "mask"])
def test_catches_a_host_sync_on_every_update(read):
    broken = af.GradientTransform("peek", lambda grads, params, state: read(grads[0]))
    with pytest.raises(AssertionError, match="adds host syncs"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)


def test_catches_a_host_sync_on_a_states_first_update_only():
    def record(grads, params, state):  # reads the first gradient norm to the host once
        if state["norm"] is None:
            return {"norm": float(grads[0].norm())}
        return None

    broken = af.GradientTransform("first_norm", record, init=lambda params: {"norm": None})
    with pytest.raises(AssertionError, match="adds host syncs"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)


def test_catches_a_gradient_edit_one_rounding_away_from_the_reference():
    def almost(grads, params, state):
        for g in grads:
            g.mul_(1 + 1e-7)  # one float32 ulp: the kit compares bitwise

    broken = af.GradientTransform("almost", almost)
    with pytest.raises(AssertionError, match=r"against the reference: model .* differs"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)


def test_catches_a_step_that_changes_its_batch_in_place():
    def shrink(batch, n):  # trains on x / 2, and leaves the caller's batch halved
        batch["x"].mul_(0.5)
        return [batch]

    broken = af.with_accumulation(1, split=shrink)
    # before, the reference ran on the halved batches and passed; purity then blamed the step
    with pytest.raises(AssertionError, match=r"batch in place.*: batches\[0\]\['x'\] differs"):
        check_transform(broken, reference=plain, loss_fn=loss_fn)
