"""The monitor fed what real loops feed it: token counts as tensors, wide integers, NaN
losses, odd metric names, failing sinks, a closed monitor. Every number it writes is the
step's own, and bad input is refused with what to do instead."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from accelfn.observe.monitor import GPUSampling, JsonlSink, Monitor
from accelfn.observe.monitor.gpu_sampler import GPUSampler
from accelfn.observe.monitor.report import Thresholds
from accelfn.observe.monitor.verdict import summarise
from accelfn.observe.sync_probe import SyncProbe


def quiet(**kw: Any) -> Monitor:
    kw.setdefault("sync_check", None)
    return Monitor(progress=False, **kw)


# -- what a step hands over ---------------------------------------------------------------------

def test_token_and_sample_counts_given_as_tensors_are_read_with_the_metrics(
        tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    mon = quiet(warmup=0, log_every=100, sinks=[JsonlSink(path)])  # read once, at close
    masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])] * 2
    with mon:
        for mask in masks:
            with SyncProbe(mode="emulate") as probe:  # the count is not read per step
                mon.step({"loss": torch.tensor(1.0)}, tokens=mask.sum(),
                         samples=(mask[:, 0] > 0).sum())
            assert probe.syncs == []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["tokens"] for r in rows] == [3, 5, 3, 5]
    assert [r["samples"] for r in rows] == [2, 2, 2, 2]
    assert all(r["tokens_per_s"] == r["tokens"] / r["step_s"] for r in rows)
    report = mon.report()
    total = sum(r["step_s"] for r in rows)
    assert report.tokens_per_s == pytest.approx(16 / total)
    assert report.samples_per_s == pytest.approx(8 / total)


def test_samples_per_second_counts_the_time_of_the_steps_that_counted_samples() -> None:
    # a step given no count is no step of zero samples: its time is left out of the rate
    mon = quiet(warmup=0)
    with mon:
        for i in range(6):
            mon.step({"loss": torch.tensor(1.0)}, **({"samples": 4, "tokens": 64} if i % 2
                                                     else {}))
    rows = mon.rows
    counted = [r for r in rows if r["samples"]]
    assert len(counted) == 3 and all(r["samples"] is None for r in rows if r not in counted)
    report = mon.report()
    assert report.samples_per_s == pytest.approx(12 / sum(r["step_s"] for r in counted))
    assert report.tokens_per_s == pytest.approx(192 / sum(r["step_s"] for r in counted))


def test_a_metric_that_is_not_one_number_is_refused_by_name() -> None:
    mon = quiet()
    with mon:
        with pytest.raises(ValueError, match=r"metric 'loss' is a tensor of shape \[4\].*"
                                             r"\.mean\(\)"):
            mon.step({"loss": torch.ones(4), "acc": torch.tensor(0.5)})
        with pytest.raises(ValueError, match=r"tokens=.*shape \[2\]"):
            mon.step({"loss": torch.tensor(1.0)}, tokens=torch.ones(2))
        mon.step({"loss": torch.tensor(2.0)})  # the monitor goes on after a refused step
    assert [r["loss"] for r in mon.rows] == [2.0]


def test_integer_and_double_metrics_keep_their_digits() -> None:
    mon = quiet(warmup=0)
    with mon:
        mon.step({"loss": torch.tensor(1 + 1e-9, dtype=torch.float64),
                  "tokens_seen": torch.tensor(16_777_217),
                  "seen": torch.tensor(2**40 + 1, dtype=torch.int64)})
    (row,) = mon.rows
    assert row["loss"] == 1 + 1e-9
    assert row["tokens_seen"] == 16_777_217 and row["seen"] == 2**40 + 1


def test_a_nan_step_does_not_turn_the_reported_mean_into_nan() -> None:
    mon = quiet(warmup=0)
    with mon:
        for v in [1.0, float("nan"), 3.0, float("inf")]:
            mon.step({"loss": torch.tensor(v), "acc": torch.tensor(0.5)})
    report = mon.report()
    assert report.metrics == {"loss": 2.0, "acc": 0.5}  # over the finite values
    (bad,) = [f for f in report.findings if f.check == "nonfinite"]
    assert bad.severity == "warning"
    assert "'loss' was NaN or Inf at 2 of 4 steps (first at step 2)" in bad.message
    assert "loss 2" in str(report)


# -- outputs ------------------------------------------------------------------------------------

class _Rows:
    def __init__(self) -> None:
        self.rows: list[int] = []
        self.closed = 0

    def open(self, start_step: int) -> None:
        pass

    def write(self, rows: Sequence[Any]) -> None:
        self.rows += [r["step"] for r in rows]

    def close(self, report: str | None = None) -> None:
        self.closed += 1


class _Down(_Rows):
    def write(self, rows: Sequence[Any]) -> None:
        raise ConnectionError("tracking server down")


def test_a_sink_failing_mid_run_loses_no_row_for_the_others(tmp_path: Path) -> None:
    down, good = _Down(), _Rows()
    mon = quiet(warmup=0, log_every=2, sinks=[JsonlSink(tmp_path / "m.jsonl"), down, good])
    with pytest.raises(ConnectionError, match="tracking server down"), mon:
        mon.step(torch.tensor(0.0))
        with pytest.raises(ConnectionError, match="tracking server down"):
            mon.step(torch.tensor(1.0))  # the flush: every sink got the rows first
        assert good.rows == [1, 2]
        mon.step(torch.tensor(2.0))  # and the loop can go on; close raises it again
    assert good.closed == 1 and good.rows == [1, 2, 3]
    assert [r["step"] for r in mon.rows] == [1, 2, 3]
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


class _NoServer(_Rows):
    def open(self, start_step: int) -> None:
        raise ConnectionError("wandb.init timed out")


def test_a_sink_failing_to_open_closes_what_was_opened(tmp_path: Path) -> None:
    jsonl, first, bad = JsonlSink(tmp_path / "m.jsonl"), _Rows(), _NoServer()
    mon = quiet(sinks=[jsonl, first, bad])
    with pytest.raises(ConnectionError, match=r"wandb\.init timed out"):
        with mon:
            pass
    assert first.closed == 1  # the run it opened is not left running
    assert jsonl.file is not None and jsonl.file.closed
    bad.open = lambda start_step: None  # type: ignore[method-assign]  # the server is back
    with mon:
        mon.step(torch.tensor(1.0))
    assert first.rows == [1] and mon.report().steps == 1
    assert json.loads((tmp_path / "m.jsonl").read_text())["step"] == 1


def test_mlflow_gets_metric_names_it_refuses_under_a_name_it_takes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from accelfn.observe.monitor.trackers import MlflowSink

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    mon = quiet(warmup=0, log_every=1,
                sinks=[MlflowSink(tracking_uri=uri, experiment="e", run_name="r")])
    with pytest.warns(UserWarning) as warned, mon:
        for i in range(3):
            mon.step({"loss": torch.tensor(float(i)), "acc@1": torch.tensor(0.5),
                      "top-1 (%)": torch.tensor(60.0), "train/ω loss": torch.tensor(1.0)})
    said = [str(w.message) for w in warned]
    assert [m for m in said if "'acc@1'; it is logged as 'acc_1'" in m]
    assert [m for m in said if "'top-1 (%)'; it is logged as 'top-1 ___'" in m]
    assert len(said) == 2  # once per name, not once per step
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("e")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["acc_1"] == 0.5 and run.data.metrics["top-1 ___"] == 60.0
    assert run.data.metrics["train/ω loss"] == 1.0
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]


def test_a_closed_monitor_refuses_more_steps(tmp_path: Path) -> None:
    mon = quiet(log_every=1, sinks=[JsonlSink(tmp_path / "m.jsonl")])
    with mon:
        mon.step(torch.tensor(1.0))
    for feed in (lambda: mon.step(torch.tensor(2.0)),
                 lambda: next(iter(mon.iterate([1, 2]))),
                 lambda: mon.measure().__enter__()):
        with pytest.raises(RuntimeError, match=r"after close\(\).*new Monitor"):
            feed()
    assert mon.close().steps == 1  # closing again is fine: the same report


# -- GPU sampling --------------------------------------------------------------------------------

def test_gpu_busy_counts_only_the_samples_of_measured_steps() -> None:
    rows, t = [], 0.0
    for i in range(4):
        t += 0.5
        rows.append({"step": i, "time_s": t, "iter_s": 0.5, "step_s": 0.5,
                     "data_wait_s": 0.0, "data_share": 0.0, "samples": 4, "tokens": None,
                     "samples_per_s": 8.0, "tokens_per_s": None, "mem_gib": None})
    # busy while the steps ran (0-2 s), idle for the checkpoint saved after the last one
    samples = [(0.1 * k, 95.0, 10.0, 300.0) for k in range(20)]
    samples += [(2.0 + 0.1 * k, 0.0, 10.0, 60.0) for k in range(1, 40)]
    report = summarise(rows, warmup=1, device=torch.device("cuda"), device_name="H100",
                       flops_per_step=None, peak=None, peak_memory_gib=None,
                       gpu_samples=samples, gpu_note=None, syncs=[], probe_mode="cuda",
                       th=Thresholds())
    assert report.gpu_util == 95.0 and report.gpu_power_w == 300.0
    assert report.verdict == "compute-bound: GPU busy 95%"


def test_a_sampling_interval_that_is_not_positive_is_refused() -> None:
    for bad in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"GPUSampling\(interval=.*seconds > 0"):
            GPUSampling(interval=bad)
        with pytest.raises(ValueError, match=r"interval=.*seconds > 0"):
            GPUSampler(0, interval=bad)
