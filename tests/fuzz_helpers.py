"""Shared by the hypothesis fuzz tests (core/test_fuzz.py, checkpointing/test_fuzz_checkpoints.py):
a small state with every kind of optimizer and schedule state, and the check that a refused
case left it untouched."""

from __future__ import annotations

import torch
from helpers import Net

import accelfn as af


def fresh_state(seed):
    torch.manual_seed(seed)
    model = Net()
    # SGD: an update proportional to the gradient, so a wrongly scaled gradient shows
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return af.TrainState(model, optimizer, scheduler=scheduler)


def snapshot(state):
    return ([p.detach().clone() for p in state.model.parameters()],
            repr(state.optimizer.state_dict()["state"]), state.scheduler.state_dict())


def assert_untouched(before, state):
    """Parameters, optimizer and scheduler state as in ``before`` (a ``snapshot``), and no
    gradient left behind."""
    params, opt, sched = snapshot(state)
    assert all(torch.equal(a, b) for a, b in zip(before[0], params))
    assert before[1] == opt and before[2] == sched
    assert all(p.grad is None for p in state.model.parameters())
