"""An interrupt at any line of a call: a deterministic injector raises KeyboardInterrupt at
the k-th line the engine (and the torch calls it makes through ``compat``, the clip) runs, for
every k; the call leaves no gradients, no half-applied update and autograd enabled, and the
next call is clean.

"No half-applied update": the parameters, the optimizers' state and ``state.step`` are either
all as before the call, or all as after the update (the interrupt came after the optimizer
step, which cannot be undone; the error's note says what did not run).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from helpers import Net, classify, make_batch

import accelfn as af
from accelfn.core import compat, optimizers
from accelfn.parts import clipping
from accelfn.step import chain, engine, micro

FILES = {os.path.abspath(m.__file__) for m in (engine, micro, chain, optimizers, compat, clipping)}


_OURS: dict[str, bool] = {}  # a code object's file name -> whether it is one of FILES


class Injector:
    """Raise KeyboardInterrupt at the ``at``-th line event of the engine's files."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.lines = 0

    def __enter__(self) -> Injector:
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)

    def _global(self, frame, event, arg):
        name = frame.f_code.co_filename  # called for every frame: a dict lookup, no abspath
        ours = _OURS.get(name)
        if ours is None:
            ours = _OURS[name] = os.path.abspath(name) in FILES
        return self._local if ours else None

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                raise KeyboardInterrupt(f"injected at line event {self.at}")
        return self._local


def _snapshot(state):
    optimizer_state = state.optimizer.state_dict()["state"]
    return ([p.detach().clone() for p in state.model.parameters()],
            {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in optimizer_state.items()}, state.step)


def _same(a, b):
    params_a, opt_a, step_a = a
    params_b, opt_b, step_b = b
    return (step_a == step_b and all(torch.equal(x, y) for x, y in zip(params_a, params_b))
            and opt_a.keys() == opt_b.keys()
            and all(opt_a[i].keys() == opt_b[i].keys() and all(
                torch.equal(v, opt_b[i][k]) if isinstance(v, torch.Tensor) else v == opt_b[i][k]
                for k, v in opt_a[i].items()) for i in opt_a))


def scalar_loss(model, batch):
    """classify's loss alone: a window of plain losses is summed once, without autograd."""
    return classify(model, batch)["loss"]


STACKS = {
    "plain": lambda: af.lift(classify),
    "scalar_loss_accumulate_clip": lambda: af.with_clipping(max_norm=0.5)(
        af.with_accumulation(2)(scalar_loss)),
    "accumulate_clip": lambda: af.with_clipping(max_norm=0.5)(af.with_accumulation(2)(classify)),
    "fp16_gradient_transform": lambda: af.with_amp(dtype=torch.float16)(af.GradientTransform(
        "halve", lambda grads, params, state: [g.mul_(0.5) for g in grads] and None)(
            af.with_accumulation(2)(classify))),
}


@pytest.mark.slow
@pytest.mark.parametrize("stack", list(STACKS))
def test_an_interrupt_at_any_line_leaves_no_gradients_and_no_half_update(stack):
    """...and autograd enabled: a Ctrl-C between switching it off and the ``try`` that
    switches it back would leave every later step failing ("does not require grad")."""
    build = STACKS[stack]
    batches = [make_batch(seed=seed) for seed in range(3)]
    counting = Injector(at=0)  # counts the line events of one clean call
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    step = build()
    step(state, batches[0])  # prepared, optimizer state built
    with counting:
        step(state, batches[1])
    total = counting.lines
    assert total > 50
    interrupted_after = 0
    for at in range(1, total + 1):
        torch.manual_seed(0)
        model = Net()
        state = af.TrainState(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        step(state, batches[0])
        before = _snapshot(state)
        try:
            with Injector(at):
                step(state, batches[1])
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError(f"line event {at} of {total}: no interrupt raised")
        grad_enabled = torch.is_grad_enabled()
        torch.set_grad_enabled(True)  # the next iterations and tests run with autograd on
        assert grad_enabled, f"autograd left off by an interrupt at line event {at}"
        assert all(p.grad is None for p in model.parameters()), f"gradients left at {at}"
        now = _snapshot(state)
        if not _same(before, now):  # then the update was applied whole, and counted
            interrupted_after += 1
            assert now[2] == before[2] + 1, f"line {at}: parameters moved, step not counted"
            assert not any(torch.equal(a, b) for a, b in zip(before[0], now[0])), at
        metrics = step(state, batches[2])  # the next call works
        assert torch.isfinite(metrics["loss"])
    assert 0 < interrupted_after < total
