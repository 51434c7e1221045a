"""Updates that fail after the gradients are ready: in the optimizer step, the scheduler step
or an after-update hook; and the truncated-BPTT carry of failed and skipped updates.

Each is compared with the hand-written loop: after a failure the next call is a clean update.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import as_dict, assert_params_equal, classify, make_batch
from torch import nn

import accelfn as af


class Flaky:
    """Mixin: the optimizer's step raises ``error`` the first time (``partial``: after
    allocating part of its state, as an OOM in Adam's lazy state initialisation does)."""

    fail = 0
    error: BaseException = torch.OutOfMemoryError("simulated OOM allocating optimizer state")
    partial = False

    def step(self, closure=None):
        if self.fail:
            self.fail -= 1
            if self.partial:  # the first parameter's state, half built
                p = self.param_groups[0]["params"][0]
                self.state[p]["step"] = torch.tensor(0.0)
            raise self.error
        return super().step(closure)


class FlakyAdam(Flaky, torch.optim.Adam):
    pass


class FlakyFusedAdamW(Flaky, torch.optim.AdamW):
    pass


def _grads(model):
    return [p.grad for p in model.parameters() if p.grad is not None]


def _clean_update(net, batch, opt_cls=torch.optim.Adam, amp=False, **kw):
    """A fresh copy of ``net`` after one plain update on ``batch``."""
    ref = copy.deepcopy(net)
    opt = opt_cls(ref.parameters(), lr=1e-2, **kw)
    if amp:
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = classify(ref, as_dict(batch))["loss"]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        classify(ref, as_dict(batch))["loss"].backward()
        opt.step()
    return ref


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("partial", [False, True], ids=["before-state", "half-built-state"])
def test_optimizer_step_out_of_memory_cleans_up_and_next_update_is_clean(net, amp, partial):
    start = copy.deepcopy(net)
    opt = FlakyAdam(net.parameters(), lr=1e-2)
    state = af.TrainState(net, opt)
    step = af.with_amp(dtype=torch.float16)(classify) if amp else af.lift(classify)
    opt.fail, opt.partial = 1, partial
    with pytest.raises(torch.OutOfMemoryError, match=r"optimizer step.*foreach=False"):
        step(state, make_batch(seed=1))
    assert _grads(net) == []
    assert_params_equal(net, start)
    assert state.step == 0 and len(opt.state) == 0
    metrics = step(state, make_batch(seed=2))  # a clean first update on batch 2
    assert state.step == 1
    if amp:
        assert metrics["skipped"] == 0
    assert_params_equal(net, _clean_update(start, make_batch(seed=2), amp=amp))


def test_optimizer_step_other_error_propagates_after_cleanup(net):
    opt = FlakyAdam(net.parameters(), lr=1e-2)
    state = af.TrainState(net, opt)
    step = af.with_amp(dtype=torch.float16)(af.with_clipping(classify))
    step(state, make_batch(seed=0))
    opt.fail, opt.error = 1, ValueError("bad hyper-parameter")
    with pytest.raises(ValueError, match="bad hyper-parameter"):
        step(state, make_batch(seed=1))
    assert _grads(net) == []
    assert state.step == 1
    assert step(state, make_batch(seed=2))["skipped"] == 0


def test_fused_optimizer_step_failure_does_not_settle_as_an_update(net):
    """A fused optimizer's skip decision is deferred; a failed step must not leave it pending
    (it would step the scheduler and count at the next update)."""
    start = copy.deepcopy(net)
    opt = FlakyFusedAdamW(net.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = af.TrainState(net, opt, scheduler=sched)
    step = af.lift(classify)
    opt.fail = 1
    with pytest.raises(torch.OutOfMemoryError):
        step(state, make_batch(seed=1))
    assert state.slots["nonfinite"]._pending is None
    step(state, make_batch(seed=2))
    state.sync()
    ref = copy.deepcopy(start)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    classify(ref, as_dict(make_batch(seed=2)))["loss"].backward()
    ref_opt.step()
    ref_sched.step()
    assert_params_equal(net, ref)
    assert sched.get_last_lr() == ref_sched.get_last_lr()
    assert state.slots["nonfinite"].skipped == 0


class FlakyScheduler(torch.optim.lr_scheduler.StepLR):
    fail = 0

    def step(self, *args, **kwargs):
        if self.fail:
            self.fail -= 1
            raise RuntimeError("scheduler failed")
        return super().step(*args, **kwargs)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "fp16"])
def test_scheduler_failure_after_the_update_says_so_and_next_call_works(net, amp):
    start = copy.deepcopy(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    sched = FlakyScheduler(opt, step_size=1, gamma=0.5)
    state = af.TrainState(net, opt, scheduler=sched)
    step = af.with_amp(dtype=torch.float16)(classify) if amp else af.lift(classify)
    sched.fail = 1
    with pytest.raises(RuntimeError, match="scheduler failed") as info:
        step(state, make_batch(seed=1))
    assert any("parameters were updated" in note for note in info.value.__notes__)
    assert _grads(net) == []
    assert state.step == 1  # the update was applied: it counts
    assert_params_equal(net, _clean_update(start, make_batch(seed=1), amp=amp))
    metrics = step(state, make_batch(seed=2))  # no "unscale_() has already been called"
    if amp:
        assert metrics["skipped"] == 0
    assert state.step == 2


def test_after_update_failure_clears_gradients_and_loss_scaler(net, monkeypatch):
    """The EMA's update, after the optimizer step, fails once: the update counts, the next
    call works (the loss scaler was reset, nothing is left in .grad)."""
    from accelfn.parts import averaging as ema

    calls = {"n": 0}
    real = ema._EmaWeights.update

    def update(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("after-update failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ema._EmaWeights, "update", update)
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    step = af.with_ema(decay=0.9)(af.with_amp(dtype=torch.float16)(classify))
    with pytest.raises(RuntimeError, match="after-update failed") as info:
        step(state, make_batch(seed=1))
    assert any("parameters were updated" in note for note in info.value.__notes__)
    assert _grads(net) == []
    assert state.step == 1
    assert step(state, make_batch(seed=2))["skipped"] == 0
    assert calls["n"] == 2


# ------------------------------------------------------------------ the truncated-BPTT carry
class RNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.RNNCell(4, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x, h):
        h = self.cell(x, h)
        return self.out(h), h


def lm_step(model, batch, carry):
    logits, h = model(batch["x"], carry)
    return {"loss": F.cross_entropy(logits, batch["y"]), "carry": h}


def _rnn_batch(seed, poison=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=g)
    if poison:
        x[0, 0] = float("nan")
    return {"x": x, "y": torch.randint(0, 2, (5,), generator=g)}


def _reference_bptt(model, opt, batches):
    """The hand-written loop: a skipped (non-finite) update drops its batch's carry too."""
    h = None
    for b in batches:
        logits, new = model(b["x"], h)
        loss = F.cross_entropy(logits, b["y"])
        loss.backward()
        finite = loss.isfinite() and all(p.grad.isfinite().all() for p in model.parameters())
        if finite:
            opt.step()
            h = new.detach()
        opt.zero_grad(set_to_none=True)
    return h


def test_refused_update_leaves_the_carry_and_next_calls_work():
    model = RNN()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_nonfinite(policy="raise")(lm_step)
    step(state, _rnn_batch(0))
    before = state.slots["carry"].values["train"][0].clone()
    with pytest.raises(af.NonFiniteError):
        step(state, _rnn_batch(1, poison=True))
    assert torch.equal(state.slots["carry"].values["train"][0], before)
    for s in range(2, 5):
        step(state, _rnn_batch(s))
    ref = RNN()
    h = _reference_bptt(ref, torch.optim.SGD(ref.parameters(), lr=0.1),
                        [_rnn_batch(s) for s in (0, 2, 3, 4)])
    assert_params_equal(model, ref)
    assert torch.equal(state.slots["carry"].values["train"][0], h)


@pytest.mark.parametrize("fused", [False, True], ids=["host", "device"])
def test_skipped_update_keeps_the_carry_it_started_from(fused):
    model = RNN()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1))
    state = af.TrainState(model, opt)
    step = af.lift(lm_step)
    batches = [_rnn_batch(0), _rnn_batch(1, poison=True), *(_rnn_batch(s) for s in range(2, 5))]
    skipped = [step(state, b)["skipped"].item() for b in batches]
    assert skipped == [0, 1, 0, 0, 0]
    state.sync()
    ref = RNN()
    ref_opt = (torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True) if fused
               else torch.optim.SGD(ref.parameters(), lr=0.1))
    h = _reference_bptt(ref, ref_opt, batches)
    assert_params_equal(model, ref)
    assert torch.equal(state.slots["carry"].values["train"][0], h)
    assert state.slots["nonfinite"].skipped == 1


def test_skipped_first_update_on_the_device_leaves_zeros_for_no_carry():
    model = RNN()
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    assert af.lift(lm_step)(state, _rnn_batch(1, poison=True))["skipped"] == 1
    kept = state.slots["carry"].values["train"][0]
    assert torch.equal(kept, torch.zeros(5, 6))  # what nn.RNNCell takes None for


# ------------------------------------------- any exit between the backward and the update
def test_losses_of_mismatched_shapes_leave_no_gradients_and_the_next_call_is_clean(net):
    """A loss of shape [] in the first micro-batch and [1] in the next failed when the
    metrics were summed, after the backwards: the gradients stayed in .grad and the next
    update silently added them to its own."""
    calls = {"n": 0}

    def shapes(model, batch):
        calls["n"] += 1
        loss = classify(model, batch)["loss"]
        return loss if calls["n"] % 2 else loss.reshape(1)

    start = copy.deepcopy(net)
    state = af.TrainState(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        af.with_accumulation(2)(shapes)(state, make_batch(seed=0))
    assert _grads(net) == [] and state.step == 0 and not state.optimizer.state
    af.lift(classify)(state, make_batch(seed=1))
    assert_params_equal(net, _clean_update(start, make_batch(seed=1)))


@pytest.mark.parametrize("window", ["split", "calls"])
def test_an_interrupt_while_the_metrics_are_summed_leaves_no_gradients(net, monkeypatch,
                                                                       window):
    from accelfn.core import plan

    real = plan.Sums.result
    armed = {"on": True}

    def interrupted(self, divide):
        if armed["on"]:
            armed["on"] = False
            raise KeyboardInterrupt
        return real(self, divide)

    monkeypatch.setattr(plan.Sums, "result", interrupted)
    start = copy.deepcopy(net)
    state = af.TrainState(net, torch.optim.Adam(net.parameters(), lr=1e-2))
    step = af.with_accumulation(2, mode=window)(classify)
    with pytest.raises(KeyboardInterrupt):
        step(state, make_batch(seed=0))
    assert _grads(net) == [] and state.step == 0 and state.at_update_boundary
    step = af.lift(classify)
    step(state, make_batch(seed=1))
    assert_params_equal(net, _clean_update(start, make_batch(seed=1)))
