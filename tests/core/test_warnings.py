"""Mistakes a step cannot refuse but must say, once: a scheduler stepped twice per update,
trainable parameters the optimizer does not hold."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import Net, classify, make_batch

import accelfn as af


def _state(with_scheduler: bool = True):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if with_scheduler \
        else None
    return af.TrainState(model, opt, scheduler=sched)


def test_a_loop_that_also_steps_the_scheduler_is_told_once():
    state = _state()
    step = af.lift(classify)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(4):
            step(state, make_batch(seed=i))
            state.scheduler.step()  # the mistake: the step steps it already
    found = [w for w in caught if "stepped outside the step" in str(w.message)]
    assert len(found) == 1 and issubclass(found[0].category, RuntimeWarning)
    assert "1 extra time(s)" in str(found[0].message)
    assert state.scheduler.last_epoch == 8  # told, not changed: 4 updates and 4 extra steps


def test_the_normal_loop_and_a_resume_are_silent():
    state = _state()
    step = af.with_accumulation(2)(classify)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            step(state, make_batch(seed=i))
        saved = state.state_dict()
        other = _state()
        other.load_state_dict(saved)
        step(other, make_batch(seed=5))


def test_trainable_parameters_missing_from_the_optimizer_are_named_once():
    torch.manual_seed(0)
    model = Net()
    held = [p for n, p in model.named_parameters() if not n.startswith("head")]
    state = af.TrainState(model, torch.optim.SGD(held, lr=0.1))
    with pytest.warns(RuntimeWarning, match=r"2 trainable parameter\(s\).*head\.weight, "
                                            r"head\.bias.*freeze them"):
        af.lift(classify)(state, make_batch())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        af.lift(classify)(state, make_batch(seed=1))  # once per state
