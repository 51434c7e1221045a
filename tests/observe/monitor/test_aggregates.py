"""The monitor in bounded memory: a long run's report and plot from running aggregates and a
bounded picture, checked against the same numbers computed from every row."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
from machine import idle_machine  # noqa: F401  (autouse: an idle machine)

from accelfn.observe.monitor import JsonlSink, Monitor
from accelfn.observe.monitor.aggregates import History, Quantiles, read_history

TRAINING = ("step_s", "iter_s", "data_wait_s", "loss", "mem_gib", "samples_per_s")


def quantile(xs: list[float], q: float) -> float:
    """numpy's default quantile: linear between order statistics."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def block_means(rows: list[dict[str, Any]], size: int) -> list[dict[str, Any]]:
    """The reference picture: the mean of each ``size`` consecutive rows, at the first step."""
    out = []
    for i in range(0, len(rows), size):
        block = rows[i:i + size]
        point: dict[str, Any] = {"step": block[0]["step"]}
        for k in TRAINING:
            values = [r[k] for r in block if isinstance(r.get(k), (int, float))]
            if values:
                point[k] = sum(values) / len(values)
        out.append(point)
    return out


def rss() -> int:
    """This process's resident memory in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def feed(mon: Monitor, start: int, stop: int) -> None:
    for i in range(start, stop):
        mon.step({"loss": 1.0 / (1 + i % 977)}, samples=8, data_wait=1e-6 * (i % 7))


@pytest.mark.slow
def test_a_100k_update_run_keeps_memory_bounded_and_its_report_exact(tmp_path: Path) -> None:
    n, warmup = 100_000, 2
    mon = Monitor(progress=False, sinks=[JsonlSink(tmp_path / "metrics.jsonl")], sync_check=None,
                  warmup=warmup, log_every=1000)
    with mon:
        feed(mon, 0, 20_000)
        before = rss()
        feed(mon, 20_000, n)
        grown = rss() - before
    # every row held in memory grew the process by about 0.8 KB an update: 64 MB here
    assert grown < 8 * 2**20, f"resident memory grew {grown / 2**20:.1f} MiB in 80,000 updates"
    assert len(mon.rows) == 1000  # the latest rows only

    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == n
    sel = rows[warmup:]
    report = mon.report()
    assert report.steps == n and report.measured_steps == n - warmup
    times = [r["step_s"] for r in sel]
    assert report.step_time_s == pytest.approx(sum(times) / len(times), rel=1e-9)
    assert report.step_time_median_s == pytest.approx(quantile(times, 0.5), rel=1e-3)
    assert report.step_time_p90_s == pytest.approx(quantile(times, 0.9), rel=1e-3)
    share = sum(r["data_wait_s"] for r in sel) / sum(r["iter_s"] for r in sel)
    assert report.data_wait_share == pytest.approx(share, rel=1e-9)
    assert report.samples_per_s == pytest.approx(8 * len(sel) / sum(times), rel=1e-9)
    assert report.metrics["loss"] == pytest.approx(sum(r["loss"] for r in sel) / len(sel))
    assert report.wall_s == rows[-1]["time_s"]

    # the plot's picture: at most 2048 points, each the mean of 64 consecutive steps
    assert report.rows_per_point == 64 and len(report.rows) == math.ceil(n / 64)
    for got, want in zip(report.rows, block_means(rows, 64), strict=True):
        assert got["step"] == want["step"]
        for k in TRAINING:
            assert got[k] == pytest.approx(want[k], rel=1e-9), k
    # read back from the file, the same picture
    training, logged = read_history(tmp_path / "metrics.jsonl")
    assert logged.rows() == [] and len(training.rows()) == len(report.rows)
    for from_file, in_memory in zip(training.rows(), report.rows, strict=True):
        assert from_file == pytest.approx(in_memory, rel=1e-9)


def test_quantiles_are_exact_then_within_the_bin_width() -> None:
    rng = random.Random(0)
    xs = [rng.lognormvariate(-4, 1) for _ in range(5000)]
    exact, binned = Quantiles(), Quantiles(exact=100)
    for x in xs:
        exact.add(x)
        binned.add(x)
    for q in (0.0, 0.1, 0.5, 0.9, 1.0):
        assert exact.quantile(q) == quantile(xs, q)
        assert binned.quantile(q) == pytest.approx(quantile(xs, q), rel=1e-3)
    assert Quantiles().quantile(0.5) is None


def test_history_points_are_block_means_of_whole_powers_of_two() -> None:
    rows = [{"step": i, "loss": float(i * i), "step_s": 1.0 + i % 3, "probed": i == 5}
            for i in range(50)]
    history = History(max_points=8)
    for r in rows:
        history.add(r)
    assert history.rows_per_point == 8 and history.count == 50
    got = history.rows()
    want = [{"step": i, "loss": sum(r["loss"] for r in rows[i:i + 8]) / len(rows[i:i + 8]),
             "step_s": sum(r["step_s"] for r in rows[i:i + 8]) / len(rows[i:i + 8])}
            for i in range(0, 50, 8)]
    assert [{k: v for k, v in g.items() if k != "probed"} for g in got] == want
    assert [g.get("probed", False) for g in got] == [True] + [False] * 6  # any in the block
    with pytest.raises(ValueError, match=r"max_points=1\): must be >= 2"):
        History(max_points=1)


def test_a_plot_can_be_drawn_from_the_whole_metrics_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from accelfn.observe.monitor.plots import figure

    path = tmp_path / "metrics.jsonl"
    earlier = [{"step": s, "time_s": 0.1 * s, "iter_s": 0.1, "step_s": 0.1,
                "data_wait_s": 0.0, "data_share": 0.0, "samples": 8, "tokens": None,
                "samples_per_s": 80.0, "tokens_per_s": None, "mem_gib": 1.0, "loss": 10.0 - s}
               for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in earlier)
                    + json.dumps({"step": 5, "val_loss": 3.0}) + "\n")

    class State:  # resumed at step 5: the monitor appends to the file
        step = 5

    mon = Monitor(progress=False, sinks=[JsonlSink(path)], sync_check=None, warmup=0, state=State())
    with mon:
        for _ in range(3):
            State.step += 1  # the update, then what the monitor records of it
            mon.step({"loss": 1.0}, samples=8)
    report = mon.report()
    assert [r["step"] for r in report.rows] == [6, 7, 8]  # this run's rows
    out = report.plot(tmp_path / "run.png", history=path)
    assert out.read_bytes()[:4] == b"\x89PNG"
    training, logged = read_history(path)
    whole = report.__class__(**{**report.__dict__, "rows": training.rows(),
                                "logged_rows": logged.rows()})
    fig = figure(whole)
    loss_ax = fig.axes[0]
    assert loss_ax.get_title() == "training loss and val_loss"
    lines = {line.get_label(): line for line in loss_ax.get_lines()}
    assert list(lines["training loss"].get_xdata()) == list(range(1, 9))  # the whole history
    assert list(lines["training loss"].get_ydata()) == [9.0, 8.0, 7.0, 6.0, 5.0, 1, 1, 1]
    assert list(lines["val_loss"].get_xdata()) == [5]
