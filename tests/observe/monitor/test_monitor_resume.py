"""A resumed run's closing plot: with the state and a metrics JSONL file, the Monitor draws
the whole file (the steps before the resume too), in bounded memory however long the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from monitor_runs import crash_and_resume, expected_losses

from accelfn.observe.monitor import JsonlSink, Monitor, plots

pytest.importorskip("matplotlib")  # the plot extra; installed by the test extra


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[list[dict[str, Any]]]:
    """The rows of each plot drawn, in order."""
    seen: list[list[dict[str, Any]]] = []
    plot = plots.plot_report

    def spy(report: Any, path: Any, **kwargs: Any) -> Path:
        seen.append(list(report.rows))
        return plot(report, path, **kwargs)

    monkeypatch.setattr(plots, "plot_report", spy)
    return seen


def test_the_closing_plot_of_a_resumed_run_draws_its_whole_history(
        tmp_path: Path, drawn: list[list[dict[str, Any]]]) -> None:
    out = tmp_path / "run"
    first, second = crash_and_resume(tmp_path / "ckpt", sinks=[JsonlSink(out / "metrics.jsonl")],
                                      plot=out / "run.png")
    # run 1 died after update 9, run 2 resumed update 6: its plot shows steps 1..12, the
    # losses of run 1 up to 6 and of run 2 after (not run 1's dropped 7..9)
    assert [r["step"] for r in drawn[-1]] == list(range(1, 13))
    assert [r["loss"] for r in drawn[-1]] == pytest.approx(expected_losses(first, second))
    assert (out / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_the_state_the_plot_is_of_this_run(
        tmp_path: Path, drawn: list[list[dict[str, Any]]]) -> None:
    path = tmp_path / "metrics.jsonl"
    for run in range(2):  # rows count from 0 in each run: the second replaces the first's
        mon = Monitor(progress=False, sinks=[JsonlSink(path)], sync_check=None, warmup=0,
                      plot=tmp_path / "run.png")
        with mon:
            for i in range(3):
                mon.step({"loss": torch.tensor(10.0 * run + i)}, samples=2)
        assert [r["loss"] for r in drawn[-1]] == [10.0 * run + i for i in range(3)]


def test_a_long_history_is_drawn_as_evenly_averaged_points(
        tmp_path: Path, drawn: list[list[dict[str, Any]]]) -> None:
    """3000 earlier rows and 10 new ones: 1505 points of 2 consecutive steps each, over the
    whole run (the earlier rows followed by the report's own would mix points of 2 steps with
    points of 1)."""
    path = tmp_path / "metrics.jsonl"
    earlier = 3000
    with path.open("w") as f:
        for s in range(1, earlier + 1):
            f.write(json.dumps({"step": s, "time_s": 0.1 * s, "iter_s": 0.1, "step_s": 0.1,
                                "data_wait_s": 0.0, "data_share": 0.0, "mem_gib": 1.0,
                                "loss": float(s)}) + "\n")  # as state.step counts: from 1

    class State:  # resumed at step 3000
        step = earlier

    mon = Monitor(progress=False, sinks=[JsonlSink(path)], sync_check=None, warmup=0, state=State(),
                  plot=tmp_path / "run.png", log_every=5)
    with mon:
        for _ in range(10):
            State.step += 1  # the update, then what the monitor records of it
            mon.step({"loss": torch.tensor(float(State.step))}, samples=2)
    rows = drawn[-1]
    assert len(rows) == (earlier + 10) // 2
    assert [r["step"] for r in rows] == list(range(1, earlier + 11, 2))
    # each point the mean of its two steps' losses (the loss here is the step)
    assert [r["loss"] for r in rows] == [s + 0.5 for s in range(1, earlier + 11, 2)]


class _Steps:
    """A state whose ``step`` the test moves, as updates do."""

    def __init__(self, step: int) -> None:
        self.step = step


def _run(mon: Monitor, state: _Steps | None, updates: list[bool]) -> list[int]:
    with mon:
        for update in updates:
            if state is not None and update:
                state.step += 1  # the update, then what the monitor records of it
            mon.step({"loss": torch.tensor(1.0)}, samples=2)
    return [r["step"] for r in mon.rows]


def test_rows_are_numbered_as_state_step_counts_the_updates(tmp_path: Path) -> None:
    # the update that made state.step 21 is row 21 (a validation loss logged at state.step
    # then shares its row's step)
    state = _Steps(20)
    mon = Monitor(progress=False, sinks=[JsonlSink(tmp_path / "m.jsonl")], sync_check=None,
                  warmup=0, log_every=1, state=state)  # type: ignore[arg-type]
    assert _run(mon, state, [True, True, True]) == [21, 22, 23]
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [21, 22, 23]
    # the calls of an accumulation window (mode="calls") share the step of their update
    state = _Steps(0)
    mon = Monitor(progress=False, sync_check=None, warmup=0, state=state)  # type: ignore[arg-type]
    assert _run(mon, state, [False, True, False, True]) == [1, 1, 2, 2]
    # without a state, the n-th step is row n, as state.step would count it
    mon = Monitor(progress=False, sync_check=None, warmup=0)
    assert _run(mon, None, [True, True, True]) == [1, 2, 3]


def test_the_progress_bar_of_a_resumed_run_continues_from_state_step() -> None:
    import io

    state, out = _Steps(20), io.StringIO()
    mon = Monitor(sync_check=None, warmup=0, total=30, state=state,
                  file=out)  # type: ignore[arg-type]
    _run(mon, state, [True, True, True])
    assert out.getvalue().strip().splitlines()[-1].startswith("train 23/30")
    out = io.StringIO()  # initial= given: it wins
    mon = Monitor(sync_check=None, warmup=0, total=30, state=_Steps(20), file=out,  # type: ignore[arg-type]
                  initial=5)
    _run(mon, None, [True])
    assert out.getvalue().strip().splitlines()[-1].startswith("train 6/30")
