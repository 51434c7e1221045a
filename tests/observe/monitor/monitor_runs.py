"""A monitored training run that checkpoints, "crashes" and resumes (for the sink tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from helpers import Net, classify, make_batch

import accelfn as af
from accelfn import checkpointing
from accelfn.observe.monitor import Monitor


class Crash(RuntimeError):
    """What the first run dies of."""


def train(ckpt: Path, *, until: int, seed: int, save_at: int | None = None,
          crash_at: int | None = None, resume: bool = False,
          **monitor: Any) -> list[dict[str, Any]]:
    """Train ``Net`` to ``until`` updates under a Monitor given the state; return its rows.

    Batches depend on ``seed`` and the update, so two runs log different losses for the same
    step. ``save_at``: checkpoint into ``ckpt`` after that update; ``crash_at``: raise
    :class:`Crash` after that one (inside the monitor, as a real failure would);
    ``resume``: load the newest checkpoint of ``ckpt`` first.
    """
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    state = af.TrainState(model, opt, scheduler=sched)
    step = af.with_clipping(max_norm=1.0)(classify)
    if resume:
        checkpointing.load(ckpt, state, step=step)
    monitor.setdefault("log_every", 2)
    mon = Monitor(state=state, progress=False, sync_check=None, warmup=0, **monitor)
    try:
        with mon:
            while state.step < until:
                mon.step(step(state, make_batch(seed=1000 * seed + state.step)))
                if state.step == save_at:
                    checkpointing.save(ckpt, state, step=step)
                if state.step == crash_at:
                    raise Crash(f"crashed after update {crash_at}")
    except Crash:
        pass
    return mon.rows


def crash_and_resume(ckpt: Path, **monitor: Any) -> tuple[list[dict[str, Any]],
                                                         list[dict[str, Any]]]:
    """Run 1 checkpoints at update 6 and dies after update 9 (rows 1..9); run 2 resumes
    from the checkpoint and trains to 12 (rows 7..12). Both runs' rows."""
    first = train(ckpt, until=12, seed=1, save_at=6, crash_at=9, **monitor)
    second = train(ckpt, until=12, seed=2, resume=True, **monitor)
    assert [r["step"] for r in first] == list(range(1, 10))
    assert [r["step"] for r in second] == list(range(7, 13))
    return first, second


def expected_losses(first: list[dict[str, Any]],
                    second: list[dict[str, Any]]) -> list[float]:
    """The history a resumed run must leave: run 1's steps up to 6, then run 2's."""
    return [r["loss"] for r in first[:6]] + [r["loss"] for r in second]
