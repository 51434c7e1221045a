"""The monitor's PNG: loss and learning-rate panels first, then throughput, wait, memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import Net, classify, make_batch

import accelfn as af
from accelfn.observe.monitor import Monitor
from accelfn.observe.monitor.plots import figure
from accelfn.observe.monitor.report import Thresholds

pytest.importorskip("matplotlib")  # the plot extra; installed by the test extra


def monitored(steps: int, *, start: int = 0, **kw: object) -> Monitor:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    state = af.TrainState(model, opt, scheduler=sched)
    state.step = start
    step = af.with_clipping(max_norm=1.0)(classify)
    mon = Monitor(state=state, progress=False, sync_check=None, log_every=4,
                  **kw)  # type: ignore[arg-type]
    with mon:
        for i in range(steps):
            mon.step(step(state, make_batch(seed=i)), samples=10)
    return mon


def titles(fig: object) -> list[str]:
    return [ax.get_title() for ax in fig.axes]  # type: ignore[attr-defined]


def test_loss_and_learning_rate_come_first(tmp_path: Path) -> None:
    mon = monitored(60, plot=tmp_path / "run" / "run.png")
    assert mon.plot_file == tmp_path / "run" / "run.png"
    assert mon.plot_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = mon.report()
    fig = figure(report)
    assert titles(fig)[:3] == ["training loss", "learning rate", "throughput per step"]
    assert titles(fig)[3].startswith("iteration and data wait") and titles(fig)[4] == "memory"
    loss_ax, lr_ax = fig.axes[0], fig.axes[1]
    raw, smooth = loss_ax.get_lines()
    assert list(raw.get_ydata()) == [r["loss"] for r in report.rows]
    assert smooth.get_label() == "mean of 2 steps"
    assert list(smooth.get_ydata())[1] == pytest.approx(
        (report.rows[0]["loss"] + report.rows[1]["loss"]) / 2)
    (lr,) = lr_ax.get_lines()
    assert list(lr.get_ydata()[:6]) == pytest.approx([0.1] * 5 + [0.05])  # StepLR halves


def test_a_resumed_run_is_drawn_at_its_steps() -> None:
    report = monitored(6, start=40, warmup=2).report()
    fig = figure(report)
    (raw,) = fig.axes[0].get_lines()  # six points: no moving mean
    assert list(raw.get_xdata()) == [41, 42, 43, 44, 45, 46]
    warm = fig.axes[0].patches[0]  # warm-up: the first two rows of this run
    x0, x1 = warm.get_x(), warm.get_x() + warm.get_width()
    assert (x0, x1) == (40.5, 42.5)


def test_without_lr_the_panels_close_up() -> None:
    mon = Monitor(progress=False, sync_check=None, warmup=0,
                  thresholds=Thresholds(data_wait_share=0.5))
    with mon:
        for i in range(3):
            mon.step({"loss": torch.tensor(float(i))}, samples=1)
    fig = figure(mon.report())
    assert titles(fig)[0] == "training loss" and "learning rate" not in titles(fig)
    assert len(fig.axes) == 4  # loss, throughput, wait, memory
    assert "target < 50%" in titles(fig)[2]  # the monitor's own thresholds
    mon = Monitor(progress=False, sync_check=None)
    with mon:
        mon.step(None, samples=1)
    assert "training loss" not in titles(figure(mon.report()))


def test_a_long_verdict_is_wrapped_inside_the_figure() -> None:
    import dataclasses
    report = monitored(6).report()
    long = "; ".join(f"finding {i}: the data loader waited for the disk, raise num_workers"
                     for i in range(6))
    fig = figure(dataclasses.replace(report, verdict=long))
    heading = fig._suptitle  # type: ignore[attr-defined]
    lines = heading.get_text().splitlines()
    assert len(lines) > 1 and " ".join(lines) == f"verdict: {long}"
    fig.canvas.draw()
    box = heading.get_window_extent()
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width  # no character cut off at either side
