"""Weights & Biases and MLflow sinks with the real packages: W&B offline, read back from the
run directories it writes; MLflow on a local file store, read back with its own client."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Net, classify, make_batch
from monitor_runs import crash_and_resume, expected_losses, train

import accelfn as af
from accelfn.observe.monitor import Monitor
from accelfn.observe.monitor.trackers import MlflowSink, WandbSink

ROOT = Path(__file__).resolve().parents[3]


# -- W&B: the offline run directory ------------------------------------------------------------

def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``run-<id>.wandb`` file (W&B's LevelDB-style log: a 7-byte
    header, then 32 KiB blocks of chunks with a crc32c, a length and a type each)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, block, out, pending = 7, 32 * 1024, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # a full record
            out.append(chunk)
        elif kind == 2:  # first, middle and last chunks of a long one
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    return [pb.Record.FromString(b) for b in out]


def wandb_runs(root: Path) -> list[dict[str, Any]]:
    """Each offline run under ``root`` in start order: its id, config, history, summary."""
    import wandb

    wandb.teardown()  # W&B's service writes the run files out when it stops
    runs = []
    for path in root.glob("wandb/offline-run-*/run-*.wandb"):
        run: dict[str, Any] = {"history": [], "summary": {}, "axes": {}}
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run["id"] = rec.run.run_id
                run["start"] = rec.run.start_time.ToNanoseconds()
                run["config"] = {u.key: json.loads(u.value_json) for u in rec.run.config.update}
            elif kind == "history":
                run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in rec.history.item})
            elif kind == "summary":
                for u in rec.summary.update:
                    run["summary"][u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
            elif kind == "metric" and rec.metric.name:  # define_metric: the chart's x-axis
                run["axes"][rec.metric.name] = rec.metric.step_metric
        runs.append(run)
    return sorted(runs, key=lambda r: r["start"])


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    return tmp_path


def test_wandb_offline_run_continues_at_the_resumed_step(wandb_offline: Path) -> None:
    def sink() -> WandbSink:  # each process builds its own
        return WandbSink(project="accelfn-tests", id="digits-1", config={"lr": 0.1})

    ckpt = wandb_offline / "ckpt"
    first = train(ckpt, until=12, seed=1, save_at=6, crash_at=9, sinks=[sink()])
    second = train(ckpt, until=12, seed=2, resume=True, sinks=[sink()])
    runs = wandb_runs(wandb_offline)
    assert [r["id"] for r in runs] == ["digits-1", "digits-1"]  # one run, resumed
    assert runs[0]["config"]["lr"] == 0.1
    assert [h["_step"] for h in runs[0]["history"]] == list(range(1, 10))
    assert [h["_step"] for h in runs[1]["history"]] == list(range(7, 13))
    assert [h["loss"] for h in runs[0]["history"]] == [r["loss"] for r in first]
    assert [h["loss"] for h in runs[1]["history"]] == [r["loss"] for r in second]
    assert [h["lr"] for h in runs[1]["history"]] == [r["lr"] for r in second]
    assert "verdict:" in runs[1]["summary"]["report"]


def test_one_wandb_sink_serves_two_monitors(wandb_offline: Path) -> None:
    first, second = crash_and_resume(wandb_offline / "ckpt",
                                     sinks=[WandbSink(project="accelfn-tests", id="again")])
    runs = wandb_runs(wandb_offline)
    assert [[h["_step"] for h in r["history"]] for r in runs] == [list(range(1, 10)),
                                                                  list(range(7, 13))]
    assert [h["loss"] for h in runs[1]["history"]] == expected_losses(first, second)[6:]


def test_wandb_rewind_truncates_at_the_resumed_step(wandb_offline: Path) -> None:
    ckpt = wandb_offline / "ckpt"
    train(ckpt, until=12, seed=1, save_at=6, crash_at=9,
          sinks=[WandbSink(project="accelfn-tests", id="digits-2", prefix="train/")])
    second = train(ckpt, until=12, seed=2, resume=True,
                   sinks=[WandbSink(project="accelfn-tests", id="digits-2", prefix="train/",
                                    rewind=True)])
    first_run, resumed = wandb_runs(wandb_offline)
    assert resumed["config"]["_wandb"]["branch_point"] == {"run_id": "digits-2", "step": 6}
    assert [h["_step"] for h in resumed["history"]] == list(range(7, 13))
    assert [h["train/loss"] for h in resumed["history"]] == [r["loss"] for r in second]
    assert [h["_step"] for h in first_run["history"]] == list(range(1, 10))


def test_wandb_into_a_run_of_your_own_is_left_open(wandb_offline: Path) -> None:
    import wandb

    run = wandb.init(project="accelfn-tests", id="mine")
    rows = train(wandb_offline / "ckpt", until=3, seed=0, log_every=1,
                 sinks=[WandbSink(run=run)])
    run.log({"eval/accuracy": 0.5}, step=4)  # still open: the user's code logs on
    run.finish()
    (only,) = wandb_runs(wandb_offline)
    assert [h["_step"] for h in only["history"]] == [1, 2, 3, 4]
    assert [h["loss"] for h in only["history"][:3]] == [r["loss"] for r in rows]
    with pytest.raises(ValueError, match=r"an existing run or wandb\.init arguments"):
        WandbSink(run=run, project="x")
    with pytest.raises(ValueError, match=r"rewind=True\) needs id"):
        WandbSink(project="x", rewind=True)


def calls_run(sink: WandbSink, *, start: int = 0, calls: int = 6) -> list[dict[str, Any]]:
    """``calls`` calls of ``with_accumulation(2, mode="calls")`` from update ``start`` on (as
    resumed from a checkpoint there) under a Monitor writing to ``sink``; its rows."""
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state.step = start
    step = af.with_accumulation(2, mode="calls")(classify)
    mon = Monitor(state=state, progress=False, sync_check=None, warmup=0, log_every=3,
                  sinks=[sink])
    with mon:
        for i in range(calls):
            mon.step(step(state, make_batch(seed=100 * start + i)))
    return mon.rows


def test_wandb_keeps_every_call_of_an_accumulation_window(wandb_offline: Path) -> None:
    """mode="calls": the calls of one update share its step, yet each is a W&B row, drawn
    against the optimizer update (a custom x-axis) as the other sinks keep them."""
    rows = calls_run(WandbSink(project="accelfn-tests", id="calls-1", prefix="train/"))
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3]
    (only,) = wandb_runs(wandb_offline)
    history = only["history"]
    assert [h["train/loss"] for h in history] == [r["loss"] for r in rows]
    assert [h["train/update"] for h in history] == [1, 1, 2, 2, 3, 3]
    assert [h["_step"] for h in history] == list(range(1, 7))  # W&B's step counts the calls
    assert only["axes"]["train/loss"] == only["axes"]["train/iter_s"] == "train/update"


def test_wandb_calls_resumed_in_the_same_run_go_on_after_what_it_holds(
        wandb_offline: Path) -> None:
    """A run that holds updates 1..3 (six calls), resumed after update 1: updates 2 and 3 keep
    their first rows, update 4's calls follow at the next W&B steps."""
    import wandb

    run = wandb.init(project="accelfn-tests", id="calls-2")
    first = calls_run(WandbSink(run=run))
    second = calls_run(WandbSink(run=run), start=1)
    run.finish()
    assert [r["step"] for r in second] == [2, 2, 3, 3, 4, 4]
    (only,) = wandb_runs(wandb_offline)
    history = only["history"]
    assert [h["update"] for h in history] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert [h["_step"] for h in history] == list(range(1, 9))
    assert [h["loss"] for h in history] == [r["loss"] for r in first + second[4:]]


def test_wandb_rewind_under_calls_says_what_the_run_lost(wandb_offline: Path) -> None:
    calls_run(WandbSink(project="accelfn-tests", id="calls-3"))
    with pytest.warns(UserWarning, match=r"rewound the run to W&B step 1, but W&B's steps "
                                         r"count calls"):
        calls_run(WandbSink(project="accelfn-tests", id="calls-3", rewind=True), start=1)
    wandb_runs(wandb_offline)  # the service stopped

# -- MLflow: a local file store read back through MlflowClient --------------------------------

@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for the opt-in
    return (tmp_path / "mlruns").as_uri()


def test_mlflow_run_continues_at_the_resumed_step(mlflow_store: str, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    def sink() -> MlflowSink:
        return MlflowSink(tracking_uri=mlflow_store, experiment="digits", run_name="run-1",
                          tags={"model": "Net"})

    ckpt = tmp_path / "ckpt"
    first = train(ckpt, until=12, seed=1, save_at=6, crash_at=9, sinks=[sink()])
    second = train(ckpt, until=12, seed=2, resume=True, sinks=[sink()])
    client = MlflowClient(tracking_uri=mlflow_store)
    experiment = client.get_experiment_by_name("digits")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])  # resumed, not a second run
    assert run.info.run_name == "run-1" and run.data.tags["model"] == "Net"
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 13))  # each step once, in order
    # steps 7-9 were logged by the first run: an MLflow history is append-only
    assert [m.value for m in history] == [r["loss"] for r in first] + \
        [r["loss"] for r in second[3:]]
    lr = client.get_metric_history(run.info.run_id, "lr")
    assert [m.step for m in lr] == list(range(1, 13))
    assert {"step_s", "data_wait_s", "iter_s", "accuracy", "grad_norm"} <= set(run.data.metrics)
    assert "step" not in run.data.metrics and "probed" not in run.data.metrics
    report = Path(client.download_artifacts(run.info.run_id, "accelfn_report.txt",
                                            str(tmp_path / "dl")))
    assert "verdict:" in report.read_text()


def test_mlflow_fresh_runs_and_the_active_run(mlflow_store: str, tmp_path: Path) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store)
    for _ in range(2):  # a fresh run (from step 1) never continues an earlier run of that name
        train(tmp_path / "ckpt", until=2, seed=0,
              sinks=[MlflowSink(tracking_uri=mlflow_store, run_name="again")])
    assert len(client.search_runs(["0"])) == 2

    mlflow.set_tracking_uri(mlflow_store)
    try:
        with mlflow.start_run() as active:
            rows = train(tmp_path / "ckpt2", until=3, seed=0, sinks=[MlflowSink()])
            assert mlflow.active_run() is not None  # the sink leaves the user's run open
            mlflow.log_metric("eval_accuracy", 0.5)
        history = client.get_metric_history(active.info.run_id, "loss")
        assert [m.value for m in history] == [r["loss"] for r in rows]
    finally:
        mlflow.set_tracking_uri(None)


def test_mlflow_continues_a_run_given_by_id(mlflow_store: str, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    sink = MlflowSink(tracking_uri=mlflow_store)
    first = train(tmp_path / "ckpt", until=12, seed=1, save_at=6, crash_at=9, sinks=[sink])
    assert sink.run_id is not None
    second = train(tmp_path / "ckpt", until=12, seed=2, resume=True,
                   sinks=[MlflowSink(tracking_uri=mlflow_store, run_id=sink.run_id)])
    history = MlflowClient(tracking_uri=mlflow_store).get_metric_history(sink.run_id, "loss")
    assert [m.step for m in history] == list(range(1, 13))
    assert [m.value for m in history][:9] == [r["loss"] for r in first]
    assert [m.value for m in history][9:] == [r["loss"] for r in second[3:]]
    assert expected_losses(first, second)[:6] == [m.value for m in history][:6]


# -- without the packages ----------------------------------------------------------------------

def test_missing_packages_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install 'accelfn\[wandb\]'"):
        WandbSink(project="x")
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"pip install 'accelfn\[mlflow\]'"):
        MlflowSink()


@pytest.mark.slow
def test_accelfn_works_without_wandb_and_mlflow(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['wandb'] = sys.modules['mlflow'] = None  # as if not installed\n"
        "import accelfn, torch\n"
        "from accelfn.observe.monitor import trackers\n"
        "from accelfn.observe.monitor import Monitor\n"
        f"mon = Monitor(progress=False, sinks=[accelfn.JsonlSink({str(tmp_path / 'm.jsonl')!r})])\n"
        "with mon:\n"
        "    mon.step({'loss': torch.tensor(1.0)})\n"
        "try:\n"
        "    trackers.WandbSink(project='x')\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "pip install 'accelfn[wandb]'" in out.stdout
    assert json.loads((tmp_path / "m.jsonl").read_text())["loss"] == 1.0


def test_a_run_that_dies_in_the_loop_is_marked_failed(mlflow_store: str,
                                                      wandb_offline: Path) -> None:
    from mlflow.tracking import MlflowClient

    ml = MlflowSink(tracking_uri=mlflow_store, experiment="digits", run_name="dies")
    wb = WandbSink(project="accelfn-tests", id="dies-1")
    train(wandb_offline / "ckpt", until=6, seed=1, crash_at=3, sinks=[ml, wb])
    assert ml.run_id is not None
    run = MlflowClient(tracking_uri=mlflow_store).get_run(ml.run_id)
    assert run.info.status == "FAILED"  # not FINISHED: the training raised
    assert [m.step for m in MlflowClient(tracking_uri=mlflow_store).get_metric_history(
        ml.run_id, "loss")] == [1, 2, 3]
    import wandb

    wandb.teardown()  # the run's files are complete once W&B's service stops
    (path,) = wandb_offline.glob("wandb/offline-run-*/run-*.wandb")
    exits = [r.exit.exit_code for r in wandb_records(path) if r.WhichOneof("record_type")
             == "exit"]
    assert exits and exits[-1] != 0
    (only,) = wandb_runs(wandb_offline)
    assert [h["_step"] for h in only["history"]] == [1, 2, 3]
    assert "verdict:" in only["summary"]["report"]


def test_a_run_that_ends_normally_is_finished(mlflow_store: str, wandb_offline: Path) -> None:
    from mlflow.tracking import MlflowClient

    ml = MlflowSink(tracking_uri=mlflow_store, experiment="digits", run_name="ends")
    wb = WandbSink(project="accelfn-tests", id="ends-1")
    train(wandb_offline / "ckpt", until=3, seed=1, sinks=[ml, wb])
    assert ml.run_id is not None
    assert MlflowClient(tracking_uri=mlflow_store).get_run(ml.run_id).info.status == "FINISHED"
    import wandb

    wandb.teardown()  # the run's files are complete once W&B's service stops
    (path,) = wandb_offline.glob("wandb/offline-run-*/run-*.wandb")
    exits = [r.exit.exit_code for r in wandb_records(path) if r.WhichOneof("record_type")
             == "exit"]
    assert exits == [0]
