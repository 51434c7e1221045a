"""A scheduler that raises when the non-finite guard settles a deferred decision.

With a fused optimizer the guard reads update k's skip flag at the next call (or
``state.sync()``) and steps the scheduler then; a scheduler raising there fails that call.
The contract: the failed call applies nothing and changes nothing, update k stays applied and
counted, and calling again with the same batch trains as the plain loop does in which the
scheduler raised after update k and the loop went on.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Net, as_dict, classify, make_batch

import accelfn as af


class Flaky(torch.optim.lr_scheduler.LRScheduler):
    """Halves the learning rate each step; raises (changing nothing) on step ``fail_on``
    (1: the first step after construction)."""

    def __init__(self, optimizer: torch.optim.Optimizer, fail_on: int) -> None:
        self.fail_on, self.real_steps = fail_on, -1
        super().__init__(optimizer)

    def state_dict(self):  # the schedule, not the test's counter of calls
        return {k: v for k, v in super().state_dict().items()
                if k not in ("fail_on", "real_steps")}

    def get_lr(self):
        if self.last_epoch == 0:
            return [g["lr"] for g in self.optimizer.param_groups]
        return [g["lr"] * 0.5 for g in self.optimizer.param_groups]

    def step(self, epoch=None):
        self.real_steps += 1
        if self.real_steps == self.fail_on:
            raise RuntimeError("scheduler broke")
        super().step()


def _reference(model, batches, fail_on):
    """Plain PyTorch: fused AdamW, the scheduler after every update, its error caught."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = Flaky(opt, fail_on)
    for batch in batches:
        classify(model, as_dict(batch))["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        try:
            sched.step()
        except RuntimeError:
            pass
    return sched


def _snapshot(state):
    return ([p.detach().clone() for p in state.model.parameters()],
            copy.deepcopy(state.optimizer.state_dict()), state.scheduler.state_dict(),
            state.step, vars(state.slots["nonfinite"]).copy())


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    sa, sb = a[1]["state"], b[1]["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert a[2:4] == b[2:4]
    assert {k: v for k, v in a[4].items() if k != "_pending"} == \
        {k: v for k, v in b[4].items() if k != "_pending"}


def test_scheduler_raising_at_the_deferred_settle_fails_the_next_call_cleanly():
    torch.manual_seed(0)
    model = Net()
    reference_model = copy.deepcopy(model)
    batches = [make_batch(seed=i) for i in range(5)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    state = af.TrainState(model, opt, scheduler=Flaky(opt, fail_on=2))  # update 1's step
    step = af.lift(classify)
    step(state, batches[0])
    step(state, batches[1])
    assert state.slots["nonfinite"]._pending is not None  # update 1: decided on the device
    before = _snapshot(state)
    with pytest.raises(RuntimeError, match="scheduler broke") as raised:
        step(state, batches[2])  # settles update 1: its scheduler step raises
    note = "\n".join(getattr(raised.value, "__notes__", []))
    assert "scheduler step of update 1" in note and "call it again" in note
    _same(before, _snapshot(state))  # nothing of this call applied, nothing changed
    assert state.slots["nonfinite"]._pending is None  # update 1 settled: counted once
    for batch in batches[2:]:  # again with the same batch, then on
        step(state, batch)
    state.sync()
    sched = _reference(reference_model, batches, fail_on=2)
    assert state.step == 5
    assert state.scheduler.last_epoch == sched.last_epoch == 4  # 5 updates, 1 failed
    assert state.scheduler.get_last_lr() == sched.get_last_lr()
    assert (state.slots["nonfinite"].skipped, state.slots["nonfinite"].consecutive) == (0, 0)
    for a, b in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(a, b)


def test_scheduler_raising_in_sync_settles_once_and_sync_works_again():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    state = af.TrainState(model, opt, scheduler=Flaky(opt, fail_on=1))
    af.lift(classify)(state, make_batch())
    with pytest.raises(RuntimeError, match="scheduler broke") as raised:
        state.sync()
    assert "scheduler step of update 0" in "\n".join(raised.value.__notes__)
    state.sync()  # nothing pending: the decision was counted once, not lost or repeated
    assert state.scheduler.last_epoch == 0 and state.step == 1
    assert state.state_dict()["slots"]["nonfinite"] == {"skipped": 0, "consecutive": 0}
