"""The CSV table marks the probed step like the JSONL rows do, without a false warning."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import torch

from accelfn.observe.monitor import CsvSink, Monitor, SyncCheck


def test_the_probed_step_reaches_the_csv_without_a_new_metric_warning(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    mon = Monitor(progress=False, log_every=2, sinks=[CsvSink(path)], sync_check=SyncCheck(step=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "new metric(s) ['probed'] after the header" was one
        with mon:
            for _ in mon.iterate([torch.zeros(2)] * 6):
                mon.step(torch.tensor(1.0))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["probed"] for r in rows] == ["", "", "", "True", "", ""]
    assert [r["loss"] for r in rows] == ["1.0"] * 6
