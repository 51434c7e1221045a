"""A scheduler stepped by the loop as well as by the state is said once, whatever its kind
(one with ``last_epoch``, a ``ChainedScheduler`` without one), and left as stepped: the
learning rates equal a plain loop that steps the scheduler twice per update. Loops that step
it only through the state say nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import Net, classify, make_batch
from torch.optim import lr_scheduler as ls

import accelfn as af

UPDATES = 4

SCHEDULERS = {
    "step": lambda o: ls.StepLR(o, step_size=1, gamma=0.5),
    "onecycle": lambda o: ls.OneCycleLR(o, max_lr=0.1, total_steps=100),
    "sequential": lambda o: ls.SequentialLR(
        o, [ls.LinearLR(o, start_factor=0.5, total_iters=3), ls.StepLR(o, 1, 0.5)],
        milestones=[3]),
    "chained": lambda o: ls.ChainedScheduler(
        [ls.LinearLR(o, start_factor=0.5, total_iters=3), ls.ExponentialLR(o, 0.9)]),
}


def _model_and_optimizer():
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def plain_rates(make, steps_per_update: int) -> list[float]:
    """The learning rate after each update of a plain loop stepping the scheduler
    ``steps_per_update`` times per update."""
    model, opt = _model_and_optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's step-order warning
        sched = make(opt)
        rates = []
        for i in range(UPDATES):
            batch = make_batch(seed=i)
            loss = classify(model, batch)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
            for _ in range(steps_per_update):
                sched.step()
            rates.append(opt.param_groups[0]["lr"])
    return rates


def accelfn_rates(make, wrap, *, user_steps: bool):
    model, opt = _model_and_optimizer()
    sched = make(opt)
    state = af.TrainState(model, opt, scheduler=sched)
    step = wrap(classify)
    rates = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(UPDATES):
            step(state, make_batch(seed=i))
            if user_steps:
                sched.step()  # the mistake: the state steps it already
            rates.append(opt.param_groups[0]["lr"])
    said = [w for w in caught if "stepped outside the step" in str(w.message)]
    return rates, said


WRAPS = {
    "lift": af.lift,
    "accumulation": lambda f: af.with_accumulation(2)(f),
}


@pytest.mark.parametrize("kind", SCHEDULERS)
@pytest.mark.parametrize("wrap", WRAPS)
def test_a_scheduler_also_stepped_by_the_loop_is_said_once(kind, wrap):
    rates, said = accelfn_rates(SCHEDULERS[kind], WRAPS[wrap], user_steps=True)
    assert len(said) == 1, [str(w.message) for w in said]
    assert issubclass(said[0].category, RuntimeWarning)
    assert "1 extra time(s)" in str(said[0].message)
    assert rates == pytest.approx(plain_rates(SCHEDULERS[kind], 2), rel=1e-6)  # told, not changed


@pytest.mark.parametrize("kind", SCHEDULERS)
@pytest.mark.parametrize("wrap", WRAPS)
def test_a_scheduler_stepped_only_by_the_state_is_silent(kind, wrap):
    rates, said = accelfn_rates(SCHEDULERS[kind], WRAPS[wrap], user_steps=False)
    assert said == []
    assert rates == pytest.approx(plain_rates(SCHEDULERS[kind], 1), rel=1e-6)
