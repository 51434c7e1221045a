"""The sink protocol, and JSONL/CSV/TensorBoard histories that continue across a resume."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Net, classify, make_batch
from monitor_runs import crash_and_resume, expected_losses, train

import accelfn as af
from accelfn.observe.monitor import Monitor
from accelfn.observe.monitor.sinks import CsvSink, JsonlSink, Row, Sink, TensorBoardSink


class Recorder:
    """A user's sink: keeps what the monitor hands it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def open(self, start_step: int) -> None:
        self.calls.append(("open", start_step))

    def write(self, rows: Sequence[Row]) -> None:
        self.calls.append(("write", [r["step"] for r in rows]))

    def close(self, report: str | None = None) -> None:
        self.calls.append(("close", report))


def test_a_user_sink_gets_open_rows_in_order_and_the_report() -> None:
    sink = Recorder()
    assert isinstance(sink, Sink)
    mon = Monitor(sinks=[sink], progress=False, sync_check=None, log_every=2)
    with mon:
        for i in range(5):
            mon.step({"loss": torch.tensor(float(i))}, samples=1)
    assert sink.calls[0] == ("open", 1)  # rows as state.step counts: the first step is 1
    assert sink.calls[1:-1] == [("write", [1, 2]), ("write", [3, 4]), ("write", [5])]
    kind, report = sink.calls[-1]
    assert kind == "close" and report == str(mon.report()) and "verdict:" in report


def test_a_non_sink_is_refused_with_what_it_lacks() -> None:
    class WriteOnly:
        def write(self, rows: Sequence[Row]) -> None: ...

    with pytest.raises(TypeError, match=r"WriteOnly is not a sink: it needs open\(start_step\)"):
        Monitor(sinks=[WriteOnly()])  # type: ignore[list-item]


def test_rows_are_numbered_by_the_train_state() -> None:
    """Given the state, a row's step is state.step as its update makes it (the update of
    step 41 is row 41); without it, from 1."""
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state.step = 40  # as after loading a checkpoint of update 40
    step = af.with_accumulation(2, mode="calls")(classify)
    mon = Monitor(state=state, progress=False, sync_check=None, warmup=1)
    with mon:
        for i in range(6):
            mon.step(step(state, make_batch(seed=i)))
    # two calls per update in mode="calls": each pair shares the update's step
    assert [r["step"] for r in mon.rows] == [41, 41, 42, 42, 43, 43]
    assert state.step == 43
    assert mon.report().measured_steps == 5  # warm-up counts rows of this run, not steps


def test_resume_continues_jsonl_csv_and_tensorboard(tmp_path: Path) -> None:
    out = {"jsonl": tmp_path / "log" / "metrics.jsonl", "csv": tmp_path / "log" / "metrics.csv",
           "tensorboard": tmp_path / "tb"}
    sinks = [af.JsonlSink(out["jsonl"]), af.CsvSink(out["csv"]),
             af.TensorBoardSink(out["tensorboard"])]
    ckpt = tmp_path / "ckpt"
    first = train(ckpt, until=12, seed=1, save_at=6, crash_at=9, sinks=sinks)
    # killed while writing a row: a torn last line in both files
    with open(out["jsonl"], "a") as f:
        f.write('{"step": 9, "loss": 0.')
    with open(out["csv"], "a") as f:
        f.write("9,0.1")
    second = train(ckpt, until=12, seed=2, resume=True, sinks=sinks)
    assert [r["step"] for r in first] == list(range(1, 10))
    assert [r["step"] for r in second] == list(range(7, 13))
    losses = expected_losses(first, second)

    rows = [json.loads(line) for line in out["jsonl"].read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))  # each step once, in order
    assert [r["loss"] for r in rows] == losses
    assert [r["lr"] for r in rows] == [r["lr"] for r in first[:6] + second]

    table = list(csv.DictReader(out["csv"].open(newline="")))
    assert [int(r["step"]) for r in table] == list(range(1, 13))
    assert [float(r["loss"]) for r in table] == losses
    assert out["csv"].read_text().count("step,") == 1  # one header, the first run's

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out["tensorboard"]))
    events.Reload()
    scalars = events.Scalars("accelfn/loss")
    assert [e.step for e in scalars] == list(range(1, 13))
    assert [e.value for e in scalars] == pytest.approx(losses, rel=1e-6)
    assert "accelfn/report/text_summary" in events.Tags()["tensors"]


def test_crash_and_resume_without_torn_lines_keeps_rows_before_the_checkpoint(
        tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    first, second = crash_and_resume(tmp_path / "ckpt", sinks=[af.JsonlSink(path)], log_every=4)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["loss"] for r in rows] == expected_losses(first, second)


def test_a_fresh_run_starts_the_files_again(tmp_path: Path) -> None:
    jsonl, table = tmp_path / "m.jsonl", tmp_path / "m.csv"
    for _ in range(2):  # the same run twice from the start: no rows kept from the first
        mon = Monitor(sinks=[af.JsonlSink(jsonl), af.CsvSink(table)], sync_check=None,
                      progress=False)
        with mon:
            for i in range(3):
                mon.step({"loss": torch.tensor(float(i))}, samples=1)
    assert [json.loads(x)["step"] for x in jsonl.read_text().splitlines()] == [1, 2, 3]
    assert [r["step"] for r in csv.DictReader(table.open(newline=""))] == ["1", "2", "3"]


def test_file_sinks_cut_at_the_first_row_from_the_start_step(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n"
                            for s in range(5)) + "not json\n")
    sink = JsonlSink(path)
    sink.open(3)
    sink.write([{"step": 3, "loss": 9.0}])
    sink.close()
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 0, "loss": 0.0}, {"step": 1, "loss": 0.1}, {"step": 2, "loss": 0.2},
        {"step": 3, "loss": 9.0}]

    table = tmp_path / "m.csv"
    table.write_text("step,loss\n1,1.0\n2,2.0\n3,3.0\n")
    sink2 = CsvSink(table)
    sink2.open(2)
    sink2.write([{"step": 2, "loss": 5.0, "new_metric": 1.0}])  # the header widens
    sink2.write([{"step": 3, "loss": 6.0}])
    sink2.close()
    assert table.read_text() == "step,loss,new_metric\n1,1.0,\n2,5.0,1.0\n3,6.0,\n"
    for fresh in (JsonlSink(path), CsvSink(table)):  # opened at step 1: a fresh run
        fresh.open(1)  # drops every row, a step-0 one (a loss logged before training) too
        fresh.close()
        assert path.read_text() == "" if isinstance(fresh, JsonlSink) else \
            table.read_text() == ""
    table.write_text("step,loss\n")  # a header and no rows: a new header from new rows
    sink3 = CsvSink(table)
    sink3.open(4)
    sink3.write([{"step": 4, "acc": 0.5}])
    sink3.close()
    assert table.read_text().splitlines() == ["step,acc", "4,0.5"]


def test_sinks_used_before_open_say_so(tmp_path: Path) -> None:
    for sink in (JsonlSink(tmp_path / "a.jsonl"), CsvSink(tmp_path / "a.csv"),
                 TensorBoardSink(tmp_path / "tb")):
        with pytest.raises(RuntimeError, match=r"open\(start_step\) first"):
            sink.write([{"step": 0}])


def test_every_sink_is_closed_when_one_fails_to_close(tmp_path: Path) -> None:
    class Broken(Recorder):
        def close(self, report: str | None = None) -> None:
            raise OSError("disk full")

    after = Recorder()
    mon = Monitor(sinks=[af.JsonlSink(tmp_path / "m.jsonl"), Broken(), after], sync_check=None,
                  progress=False)
    mon.start()
    mon.step()
    with pytest.raises(OSError, match="disk full"):
        mon.close()
    assert after.calls[-1][0] == "close"
