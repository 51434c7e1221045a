"""What is left behind when a step, a sink or the loop fails: nothing keeps running."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from accelfn.observe.monitor import Monitor
from accelfn.observe.profiling import Profiler, profiled


def _profiler_on() -> bool:
    return bool(torch._C._autograd._profiler_enabled())  # whether a profiler is recording


def test_a_profiled_step_that_raises_stops_the_profiler(tmp_path: Path) -> None:
    calls = []

    def step(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return (x @ x).sum()

    pstep = profiled(step, dir=tmp_path, wait=0, warmup=0, active=5)
    pstep(torch.ones(4, 4))
    with pytest.raises(RuntimeError, match="boom"):
        pstep(torch.ones(4, 4))
    assert not pstep.profiler.running and not _profiler_on()
    assert pstep.profiler.trace_files  # the cycle cut short is written
    pstep(torch.ones(4, 4))  # later calls run unprofiled
    assert not pstep.profiler.running and not _profiler_on()


class _FailingSink:
    def __init__(self) -> None:
        self.closed = False

    def open(self, start_step: int) -> None:
        pass

    def write(self, rows: Sequence[Any]) -> None:
        raise OSError("disk full")

    def close(self, report: str | None = None) -> None:
        self.closed = True


class _Sink(_FailingSink):
    def write(self, rows: Sequence[Any]) -> None:
        pass


def test_a_sink_failing_to_write_at_close_still_closes_everything(tmp_path: Path) -> None:
    bad, good = _FailingSink(), _Sink()
    prof = Profiler(tmp_path, wait=0, warmup=0, active=100)
    mon = Monitor(progress=False, log_every=100, sinks=[bad, good], profiler=prof,
                  sync_check=None)
    with pytest.raises(OSError, match="disk full"):
        with mon:
            for _ in range(3):
                mon.step(torch.tensor(1.0))
    assert not prof.running and not _profiler_on()
    assert bad.closed and good.closed
    assert mon.close().steps == 3  # closed once, the report kept


def test_an_error_in_the_loop_is_not_hidden_by_a_failing_sink(tmp_path: Path) -> None:
    bad = _FailingSink()
    mon = Monitor(progress=False, log_every=100, sinks=[bad], sync_check=None)
    with pytest.raises(ValueError, match="the step failed"), \
            pytest.warns(UserWarning, match="disk full"):
        with mon:
            mon.step(torch.tensor(1.0))
            raise ValueError("the step failed")
    assert bad.closed
