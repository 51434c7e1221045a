"""``Monitor.log``: evaluation values beside the training rows, in every sink, read back from
what each sink wrote (JSONL and CSV files, TensorBoard event files, the W&B offline run file,
the MLflow file store), against a plain PyTorch loop that computes the same numbers."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_trackers import mlflow_store, wandb_offline, wandb_runs  # noqa: F401  (fixtures)
from torch import nn

from accelfn.observe.monitor import CsvSink, JsonlSink, Monitor, TensorBoardSink
from accelfn.observe.monitor.trackers import MlflowSink, WandbSink
from accelfn.observe.sync_probe import SyncProbe

STEPS, EVERY = 9, 3


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True)


def reference() -> tuple[list[float], dict[int, float]]:
    """The plain loop: training losses, and the validation loss after every third update, by
    the update's number (from 1, as state.step counts them)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xv, yv = data(1000)
    train, val = [], {}
    for i in range(STEPS):
        x, y = data(i)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        train.append(loss.item())
        if (i + 1) % EVERY == 0:
            with torch.no_grad():
                val[i + 1] = F.mse_loss(model(xv), yv).item()
    return train, val


def monitored(**outputs: Any) -> Monitor:
    """The same loop under a Monitor: the validation loss given to ``log`` as a tensor, the
    epoch as a Python number at an explicit step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xv, yv = data(1000)
    mon = Monitor(progress=False, log_every=4, warmup=0, sync_check=None, **outputs)
    with mon:
        for i in range(STEPS):
            x, y = data(i)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mon.step({"loss": loss.detach()}, samples=8)
            if (i + 1) % EVERY == 0:
                with torch.no_grad():
                    val = F.mse_loss(model(xv), yv)
                mon.log({"val_loss": val, "val": {"batches": 1}})
        mon.log({"epoch": 1}, step=STEPS)
    return mon


def test_logged_values_reach_jsonl_csv_and_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, val = reference()
    mon = monitored(sinks=[JsonlSink(tmp_path / "m.jsonl"), CsvSink(tmp_path / "m.csv"),
                           TensorBoardSink(tmp_path / "tb")])
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lines if "iter_s" in r] == pytest.approx(train, rel=1e-6)
    logged = [r for r in lines if "iter_s" not in r]
    assert logged[:-1] == [{"step": s, "val_loss": pytest.approx(v, rel=1e-6),
                            "val.batches": 1.0} for s, v in val.items()]
    assert logged[-1] == {"step": STEPS, "epoch": 1.0}
    # in call order: each validation row right after the training row of its step
    order = [(r["step"], "iter_s" in r) for r in lines]
    assert order.index((3, False)) == order.index((3, True)) + 1

    table = list(csv.DictReader((tmp_path / "m.csv").open(newline="")))
    assert {"val_loss", "val.batches", "epoch"} <= set(table[0])  # the header widened
    val_rows = [r for r in table if r["val_loss"]]
    assert [int(r["step"]) for r in val_rows] == list(val)
    assert [float(r["val_loss"]) for r in val_rows] == pytest.approx(list(val.values()))
    assert all(r["iter_s"] == "" for r in val_rows)
    assert [float(r["loss"]) for r in table if r["iter_s"]] == pytest.approx(train, rel=1e-6)

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tb_val = events.Scalars("accelfn/val_loss")
    assert [e.step for e in tb_val] == list(val)
    assert [e.value for e in tb_val] == pytest.approx(list(val.values()), rel=1e-6)
    assert [e.step for e in events.Scalars("accelfn/loss")] == list(range(1, STEPS + 1))
    assert [e.step for e in events.Scalars("accelfn/epoch")] == [STEPS]

    report = mon.report()
    assert report.logged == {"val_loss": pytest.approx(val[STEPS], rel=1e-6),
                             "val.batches": 1.0, "epoch": 1.0}
    assert "logged (last)   val_loss" in str(report)
    assert report.steps == STEPS  # logged rows are no training steps
    assert report.metrics["loss"] == pytest.approx(sum(train) / STEPS, rel=1e-6)


def test_logged_values_reach_wandb(wandb_offline: Path) -> None:  # noqa: F811
    train, val = reference()
    monitored(sinks=[WandbSink(project="accelfn-tests", id="val-1")])
    (run,) = wandb_runs(wandb_offline)
    rows = run["history"]
    assert [h["loss"] for h in rows if "loss" in h] == pytest.approx(train, rel=1e-6)
    got = [(h["update"], h["val_loss"]) for h in rows if "val_loss" in h]
    assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in val.items()]
    assert run["axes"]["val_loss"] == "update"  # charted against the update, as the loss


def test_logged_values_reach_mlflow(mlflow_store: str) -> None:  # noqa: F811
    from mlflow.tracking import MlflowClient

    train, val = reference()
    monitored(sinks=[MlflowSink(tracking_uri=mlflow_store, run_name="val-1")])
    client = MlflowClient(tracking_uri=mlflow_store)
    (run,) = client.search_runs(["0"])
    history = client.get_metric_history(run.info.run_id, "val_loss")
    assert [(m.step, m.value) for m in history] == [
        (s, pytest.approx(v, rel=1e-6)) for s, v in val.items()]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == \
        pytest.approx(train, rel=1e-6)


def test_log_reads_no_tensor_on_the_host() -> None:
    mon = Monitor(progress=False, sync_check=None)
    with mon:
        mon.step({"loss": torch.tensor(1.0)})
        with SyncProbe(mode="emulate") as probe:
            mon.log({"val_loss": torch.tensor(0.5), "acc": torch.tensor(3, dtype=torch.int64)})
        assert probe.syncs == []
    assert mon.report().logged == {"val_loss": 0.5, "acc": 3.0}


def test_the_default_step_is_the_latest_training_rows() -> None:
    class State:  # what the monitor reads of a TrainState: its step
        step = 40

    mon = Monitor(progress=False, sync_check=None, state=State())  # type: ignore[arg-type]
    with mon:
        mon.log({"before": 1.0})  # before any step: the first step, 41
        State.step = 41  # the update, then what the monitor records of it
        mon.step({"loss": torch.tensor(1.0)})
        mon.log({"after": 2.0})
    rows = mon.report().logged_rows
    assert [(r["step"], set(r) - {"step"}) for r in rows] == [(41, {"before"}), (41, {"after"})]


def test_bad_values_are_refused_before_anything_is_recorded() -> None:
    mon = Monitor(progress=False, sync_check=None)
    with mon:
        with pytest.raises(TypeError, match=r"'name' is str, not a number"):
            mon.log({"ok": 1.0, "name": "x"})
        with pytest.raises(ValueError, match=r"shape \[3\], not one number"):
            mon.log({"v": torch.ones(3)})
        with pytest.raises(ValueError, match=r"'step_s' is a field of the training rows"):
            mon.log({"step_s": 1.0})
        with pytest.raises(ValueError, match=r"step=-1\): a step is an int >= 0"):
            mon.log({"v": 1.0}, step=-1)
        with pytest.raises(TypeError, match=r"give a mapping of names to numbers"):
            mon.log(torch.tensor(1.0))  # type: ignore[arg-type]
    assert mon.report().logged == {} and mon.report().logged_rows == []
    with pytest.raises(RuntimeError, match=r"Monitor.log\(\) after close"):
        mon.log({"v": 1.0})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_log_never_waits_for_the_device(tmp_path: Path) -> None:
    x = torch.randn(2048, 2048, device="cuda")
    mon = Monitor(progress=False, sinks=[JsonlSink(tmp_path / "m.jsonl")], sync_check=None,
                  log_every=1000)
    with mon:
        mon.step({"loss": (x @ x).mean()})
        val = x
        for _ in range(20):  # device work still queued when log() returns
            val = val @ x / 50
        torch.cuda.set_sync_debug_mode("error")  # any host wait raises
        try:
            mon.log({"val_loss": val.abs().mean(), "n": torch.tensor(7, device="cuda")})
        finally:
            torch.cuda.set_sync_debug_mode(0)
        want = val.abs().mean().item()
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[-1] == {"step": 0, "val_loss": pytest.approx(want, rel=1e-6), "n": 7.0}


class _Clock:
    """``time.perf_counter`` that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_evaluation_logged_between_steps_is_not_the_next_steps_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from accelfn.observe.monitor import monitor as monitor_module
    clock = _Clock()
    monkeypatch.setattr(monitor_module.time, "perf_counter", clock)
    mon = Monitor(progress=False, log_every=1, warmup=0, sync_check=None)
    with mon:
        for i in range(4):
            clock.now += 0.25  # the training step
            mon.step(samples=8)
            if i == 1:
                clock.now += 10.0  # an evaluation, then its loss logged
                mon.log({"val_loss": 1.0})
        # logged inside a step (before step()): the step's own time stays its own
        clock.now += 0.25
        with mon.measure(samples=8):
            clock.now += 0.25
            mon.log({"inside": 2.0})
            clock.now += 0.25
    steps = [r for r in mon.rows if "iter_s" in r]
    assert [r["iter_s"] for r in steps[:4]] == [0.25] * 4
    assert steps[4]["iter_s"] == 0.75 and steps[4]["data_wait_s"] == 0.25
