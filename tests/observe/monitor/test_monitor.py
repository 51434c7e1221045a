"""The monitor's numbers against loops with known sleeps and known FLOPs (CPU)."""

from __future__ import annotations

import csv
import io
import json
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from machine import idle_machine  # noqa: F401  (autouse: an idle machine)
from torch import nn

from accelfn.observe.diagnostics import Diagnostics
from accelfn.observe.flops import count_flops, peak_flops, training_flops
from accelfn.observe.monitor import (
    CsvSink,
    GPUSampling,
    JsonlSink,
    Monitor,
    SyncCheck,
    TensorBoardSink,
    Throughput,
)
from accelfn.observe.monitor.progress_bars import progress
from accelfn.observe.monitor.report import Thresholds
from accelfn.observe.sync_probe import SyncProbe


def fake_pynvml(util: int) -> types.ModuleType:
    """A stand-in ``pynvml`` for one 80 GiB H100 at ``util`` percent, 20 GiB used, 300 W."""
    m = types.ModuleType("pynvml")
    m.nvmlInit = m.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    m.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    m.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(  # type: ignore[attr-defined]
        gpu=util, memory=10)
    m.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(  # type: ignore[attr-defined]
        total=80 * 2**30, used=20 * 2**30)
    m.nvmlDeviceGetPowerUsage = lambda h: 300_000  # milliwatts  # type: ignore[attr-defined]
    return m

DATA_S, STEP_S, BATCH = 0.010, 0.030, 8
# What the sleeps really took: a loaded machine oversleeps, so the monitor is compared with
# these measured durations, not with the nominal ones.
ACTUAL: dict[str, list[float]] = {"wait": [], "step": []}


def _sleep(seconds: float, kind: str) -> None:
    t0 = time.perf_counter()
    time.sleep(seconds)
    ACTUAL[kind].append(time.perf_counter() - t0)


def slow_loader(n: int, wait: float = DATA_S) -> Iterator[dict[str, torch.Tensor]]:
    ACTUAL["wait"].clear()
    for i in range(n):
        _sleep(wait, "wait")
        yield {"x": torch.randn(BATCH, 4), "label": torch.full((BATCH,), i % 3)}


def sleepy_step(batch: dict[str, torch.Tensor], i: int, compute: float = STEP_S) -> dict:
    if i == 0:
        ACTUAL["step"].clear()
    _sleep(compute, "step")
    return {"loss": torch.tensor(float(i)), "lr": torch.tensor(0.5)}


def actual(kind: str, skip: int) -> float:
    """Mean measured duration of the sleeps after the first ``skip`` (the warm-up)."""
    values = ACTUAL[kind][skip:]
    return sum(values) / len(values)


def quiet(**kw: object) -> Monitor:
    kw.setdefault("progress", False)
    kw.setdefault("sync_check", None)
    return Monitor(**kw)  # type: ignore[arg-type]


def test_data_wait_share_matches_known_sleeps() -> None:
    mon = quiet(log_every=4, warmup=2)
    with mon:
        for i, batch in enumerate(mon.iterate(slow_loader(14))):
            mon.step(sleepy_step(batch, i))
    r = mon.report()
    wait, step = actual("wait", 2), actual("step", 2)  # nominally 10 ms and 30 ms: 25%
    assert r.steps == 14 and r.measured_steps == 12
    assert r.data_wait_share == pytest.approx(wait / (wait + step), abs=0.03)
    assert r.data_wait_s == pytest.approx(wait, rel=0.1, abs=0.001)
    assert r.step_time_s == pytest.approx(wait + step, rel=0.1)
    assert r.samples_per_s == pytest.approx(BATCH / (wait + step), rel=0.1)
    assert r.verdict.startswith("input-bound")
    (wait,) = [f for f in r.findings if f.check == "data_wait"]
    assert wait.severity == "warning" and "pin_memory=True" in (wait.fix or "")
    assert r.metrics["lr"] == pytest.approx(0.5)
    assert r.metrics["loss"] == pytest.approx(sum(range(2, 14)) / 12)  # warm-up left out


def test_fast_loader_is_not_the_bottleneck() -> None:
    mon = quiet(log_every=100, warmup=1)
    with mon:
        for i, batch in enumerate(mon.iterate(slow_loader(8, wait=0.001))):
            mon.step(sleepy_step(batch, i))
    r = mon.report()
    wait, step = actual("wait", 1), actual("step", 1)
    assert r.data_wait_share == pytest.approx(wait / (wait + step), abs=0.03)
    assert [f.severity for f in r.findings if f.check == "data_wait"] == ["ok"]
    assert r.verdict.startswith("compute-bound on cpu")


def test_measure_context_counts_time_between_steps_as_data_wait() -> None:
    mon = quiet(warmup=1)
    ACTUAL["wait"].clear()
    with mon:
        for i in range(8):
            _sleep(DATA_S, "wait")  # "loading" outside the measured step
            with mon.measure(samples=BATCH) as rec:
                rec.record(sleepy_step({}, i))
    r = mon.report()
    wait, step = actual("wait", 1), actual("step", 1)
    assert r.data_wait_share == pytest.approx(wait / (wait + step), abs=0.03)
    assert r.samples_per_s == pytest.approx(BATCH / (wait + step), rel=0.15)


def test_loader_reported_wait_and_iterate_without_step() -> None:
    mon = quiet(warmup=0)
    with mon:
        for i in range(3):
            mon.step(None, samples=4, tokens=40, data_wait=0.002 * i)
    assert [r["data_wait_s"] for r in mon.rows] == [0.0, 0.002, 0.004]
    assert mon.report().tokens_per_s is not None

    mon = quiet(warmup=0)
    with mon:
        for _ in mon.iterate(slow_loader(5, wait=0.0)):
            pass  # no mon.step(): each batch is one step
    assert mon.report().steps == 5
    assert all(r["samples"] == BATCH for r in mon.rows)


def test_metrics_are_read_lazily_and_written_to_jsonl_and_csv(tmp_path: Path) -> None:
    mon = quiet(log_every=5,
                sinks=[JsonlSink(tmp_path / "m" / "metrics.jsonl"), CsvSink(tmp_path / "m.csv")])
    with mon:
        for i in range(3):
            mon.step({"loss": torch.tensor(float(i))}, samples=2)
        assert mon.rows == []  # nothing read before log_every steps
        with SyncProbe(mode="emulate") as probe:
            mon.step({"loss": torch.tensor(3.0), "acc": torch.tensor(0.5)}, samples=2)
        assert probe.syncs == []  # recording a step never reads a tensor on the host
        mon.step({"loss": torch.tensor(4.0)}, samples=2)
        assert [r["loss"] for r in mon.rows] == [0.0, 1.0, 2.0, 3.0, 4.0]
        for i in range(5, 7):
            mon.step({"loss": torch.tensor(float(i))}, samples=2)
    lines = (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in lines] == [float(i) for i in range(7)]
    assert json.loads(lines[3])["acc"] == 0.5
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert [float(r["loss"]) for r in rows] == [float(i) for i in range(7)]
    assert {"step", "step_s", "data_wait_s", "samples_per_s", "mem_gib"} <= set(rows[0])


def test_known_flops_and_mfu() -> None:
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    x = torch.randn(16, 64)
    # first layer: 2*B*i*o forward + 2*B*i*o weight grad (its input needs no grad);
    # second layer: forward, input grad and weight grad, 3 * 2*B*i*o
    expected = 2 * (2 * 16 * 64 * 128) + 3 * (2 * 16 * 128 * 32)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    assert training_flops(model, x) == expected
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))  # restored
    assert model[2].weight.grad is None
    assert count_flops(model, x) == 2 * 16 * 64 * 128 + 2 * 16 * 128 * 32  # forward only

    peak = 1e9
    mon = quiet(warmup=1, throughput=Throughput(peak_flops=peak))
    assert mon.count_flops(model, x) == expected
    with mon:
        for i in range(6):
            mon.step(sleepy_step({}, i, compute=0.02), samples=16)
    r = mon.report()
    assert r.flops_per_step == expected
    assert r.mfu == pytest.approx(expected / actual("step", 1) / peak, rel=0.15)
    assert "MFU" in str(r)


def test_peak_flops_table() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "tf32") == 378e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA A10") == 125e12
    assert peak_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None
    assert peak_flops("Tesla V100-SXM2-16GB", torch.float16) == 125e12
    assert peak_flops("Some CPU") is None


def test_sync_probe_finds_planted_item() -> None:
    def run(planted: bool) -> Monitor:
        # data wait never decides the verdict here: only the sync probe does
        mon = quiet(warmup=0, sync_check=SyncCheck(step=1),
                    thresholds=Thresholds(data_wait_share=1.01))
        w = torch.ones(4, requires_grad=True)
        with mon:
            for batch in mon.iterate(slow_loader(4, wait=0.0)):
                loss = (batch["x"] @ w).pow(2).mean()
                loss.backward()
                if planted:
                    _ = loss.item()  # the planted sync
                mon.step({"loss": loss.detach()})
        return mon

    report = run(planted=True).report()
    (sync,) = report.syncs or []
    assert sync.op.startswith("Tensor.item") and "loss.item()" in (sync.code or "")
    assert "test_monitor.py" in sync.location
    assert report.verdict.startswith("sync-bound")
    assert [r.get("probed", False) for r in report.rows] == [False, True, False, False]
    assert report.measured_steps == 3  # the probed step is left out of timing

    clean = run(planted=False).report()
    assert clean.syncs == []
    assert [f.severity for f in clean.findings if f.check == "host_syncs"] == ["ok"]


def test_gpu_sampling_with_faked_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(util=50))
    mon = quiet(warmup=0, gpu=GPUSampling(index=0, interval=0.005))
    with mon:
        for i in range(6):
            mon.step(sleepy_step({}, i, compute=0.01), samples=1)
    r = mon.report()
    assert r.device_name == "NVIDIA H100 80GB HBM3" and len(r.gpu_samples) >= 3
    assert r.gpu_util == 50 and r.gpu_power_w == 300 and r.gpu_memory_gib == 20
    (busy,) = [f for f in r.findings if f.check == "gpu_busy"]
    assert busy.severity == "warning" and "GPU busy 50%" in busy.message
    assert r.verdict.startswith("GPU underused")

    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(util=97))
    mon = quiet(warmup=0, gpu=GPUSampling(index=0, interval=0.005))
    with mon:
        for i in range(4):
            mon.step(sleepy_step({}, i, compute=0.01), samples=1)
    assert mon.report().verdict == "compute-bound: GPU busy 97%"

    monkeypatch.setitem(sys.modules, "pynvml", None)
    mon = quiet(gpu=GPUSampling(index=0))
    with mon:
        mon.step()
    r = mon.report()
    assert r.gpu_util is None and "pynvml is not installed" in (r.gpu_note or "")
    assert "not sampled: pynvml is not installed" in str(r)


def test_progress_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the built-in bar
    out = io.StringIO()
    assert list(progress(range(5), desc="work", file=out)) == [0, 1, 2, 3, 4]
    assert "work 5/5 [####################] 100%" in out.getvalue()
    out = io.StringIO()
    mon = Monitor(total=3, file=out, log_every=1, sync_check=None)
    with mon:
        for i in range(3):
            mon.step({"loss": torch.tensor(float(i))}, samples=1)
    assert "train 3/3" in out.getvalue() and "loss=2" in out.getvalue()
    out = io.StringIO()
    assert list(progress([1, 2], disable=True, file=out)) == [1, 2] and out.getvalue() == ""


def test_plot_and_missing_optional_packages(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    mon = quiet(warmup=1)
    with mon:
        for i, batch in enumerate(mon.iterate(slow_loader(4, wait=0.001))):
            mon.step(sleepy_step(batch, i, compute=0.001))
    report = mon.report()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"accelfn\[plot\]"):
            report.plot(tmp_path / "run.png")
    else:
        png = report.plot(tmp_path / "run.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"pip install 'accelfn\[plot\]'"):
        report.plot(tmp_path / "other.png")
    mon = quiet(plot=tmp_path / "auto.png")
    with pytest.warns(UserWarning, match="no plot written"), mon:
        mon.step()
    assert not (tmp_path / "auto.png").exists()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"accelfn\[tensorboard\]"):
        TensorBoardSink(tmp_path / "tb")


def test_diagnostics_and_thresholds_plug_in() -> None:
    model = nn.Linear(4, 3)
    diag = Diagnostics(model, every=2)
    mon = quiet(warmup=0, diagnostics=diag, thresholds=Thresholds(data_wait_share=0.9))
    with mon:
        for batch in mon.iterate(slow_loader(4, wait=0.005)):
            nn.functional.cross_entropy(model(batch["x"] * 300), batch["label"]).backward()
            model.zero_grad(set_to_none=True)
            _sleep(0.005, "step")  # as long as the data wait: a share near 50%, far below 90%
            mon.step()
    r = mon.report()
    assert r.verdict.startswith("compute-bound")  # 0.9 threshold: data wait is fine
    assert diag.report().labels == {0: 8, 2: 8}  # steps 0 and 2 sampled with their batches
    assert any(f.check == "gradients" for f in r.findings)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="log_every=0"):
        Monitor(log_every=0)
    with pytest.raises(ValueError, match="warmup=-1"):
        Monitor(warmup=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_events_sync_debug_mode_and_pynvml() -> None:
    model = nn.Linear(1024, 1024).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(512, 1024, device="cuda")

    def run(planted: bool) -> Monitor:
        mon = Monitor(progress=False, warmup=1, log_every=4,
                      throughput=Throughput(peak_dtype=torch.float32), sync_check=SyncCheck(step=2),
                      thresholds=Thresholds(data_wait_share=1.01))
        mon.count_flops(model, x)
        with mon:
            for batch in mon.iterate([x] * 12):
                loss = model(batch).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if planted:
                    _ = loss.item()  # planted sync
                mon.step({"loss": loss.detach()})
        return mon

    report = run(planted=True).report()
    assert report.device.startswith("cuda") and report.device_name
    assert any("test_monitor.py" in s.location for s in report.syncs or [])
    assert report.verdict.startswith("sync-bound") and "stall the GPU" in report.verdict
    clean = run(planted=False).report()
    assert clean.syncs == [], [str(s) for s in clean.syncs or []]
    assert all(r["step_s"] > 0 for r in clean.rows)
    assert clean.peak_memory_gib and clean.peak_memory_gib > 0
    assert clean.metrics["loss"] > 0
    if clean.peak_flops:
        assert clean.mfu is not None and 0 < clean.mfu < 1
