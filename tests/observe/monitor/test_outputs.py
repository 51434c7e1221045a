"""A monitor's outputs: the sinks it is given, the bar, rank 0 only."""

from __future__ import annotations

import io
import json
from pathlib import Path

from accelfn.observe.monitor import JsonlSink, Monitor
from accelfn.observe.monitor.outputs import Outputs


class Listed:
    """A sink that keeps what it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def open(self, start_step: int) -> None:
        self.calls.append(("open", start_step))

    def write(self, rows) -> None:
        self.calls.append(("write", [r["step"] for r in rows]))

    def close(self, report: str | None = None) -> None:
        self.calls.append(("close", "verdict:" in (report or "")))


def _outputs(tmp_path: Path, *, main: bool, sink: Listed, file: io.StringIO) -> Outputs:
    return Outputs(main=main, sinks=[JsonlSink(tmp_path / "m.jsonl"), sink], progress=True,
                   desc="t", file=file, total=4, initial=0, plot=None)


def test_rank_zero_writes_the_rows_to_every_sink_and_shows_the_last_on_the_bar(tmp_path):
    sink, bar = Listed(), io.StringIO()
    out = _outputs(tmp_path, main=True, sink=sink, file=bar)
    out.open(5)
    rows = [{"step": 5, "loss": 1.5, "data_share": 0.5},
            {"step": 6, "loss": 1.25, "data_share": 0.25}]
    out.write(rows, rows[-1])
    for _ in range(4):
        out.advance()
    report = Monitor(progress=False, sync_check=None).close()
    assert out.close(report, failed_loop=False, history=None) is None
    assert sink.calls == [("open", 5), ("write", [5, 6]), ("close", True)]
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [5, 6]
    shown = bar.getvalue()
    assert "4/4" in shown and "loss=1.25" in shown and "wait 25%" in shown
    assert out.bar is None and out.plot_file is None


def test_other_ranks_open_nothing_and_write_nothing(tmp_path):
    sink, bar = Listed(), io.StringIO()
    out = _outputs(tmp_path, main=False, sink=sink, file=bar)
    out.open(0)
    out.write([{"step": 0, "loss": 1.0}], None)
    out.advance()
    report = Monitor(progress=False, sync_check=None).close()
    assert out.close(report, failed_loop=False, history=None) is None
    assert sink.calls == [] and bar.getvalue() == ""
    assert not (tmp_path / "m.jsonl").exists()
