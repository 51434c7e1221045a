"""Where the monitor writes its per-step rows: JSONL, CSV and TensorBoard.

Each sink takes lists of rows (``{field: value}``, one per step) as they complete, and is
closed once with the report's text.
"""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path
from typing import IO, Any, Protocol

__all__ = ["CsvSink", "JsonlSink", "Sink", "TensorBoardSink"]


class Sink(Protocol):
    """A destination for the monitor's rows."""

    def write(self, rows: list[dict[str, Any]]) -> None:
        """Write the rows of newly completed steps."""

    def close(self, report: str | None = None) -> None:
        """Flush and close; ``report`` is the final report as text (kept where it fits)."""


def _open(path: str | Path) -> IO[str]:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return open(p, "w", newline="")


class CsvSink:
    """One row per step in a CSV file; its columns are those of the first rows written."""

    def __init__(self, path: str | Path) -> None:
        self.file = _open(path)
        self.writer: csv.DictWriter[str] | None = None
        self.warned = False

    def write(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        if self.writer is None:
            fields = list(dict.fromkeys(k for r in rows for k in r))
            self.writer = csv.DictWriter(self.file, fieldnames=fields, extrasaction="ignore")
            self.writer.writeheader()
        extra = {k for r in rows for k in r} - set(self.writer.fieldnames)
        if extra and not self.warned:
            self.warned = True
            warnings.warn(f"Monitor CSV: new metric(s) {sorted(extra)} after the header was "
                          "written are only in the JSONL output", stacklevel=3)
        self.writer.writerows(rows)
        self.file.flush()

    def close(self, report: str | None = None) -> None:
        self.file.close()


class JsonlSink:
    """One JSON object per step and line."""

    def __init__(self, path: str | Path) -> None:
        self.file = _open(path)

    def write(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.file.write(json.dumps(r) + "\n")
        self.file.flush()

    def close(self, report: str | None = None) -> None:
        self.file.close()


class TensorBoardSink:
    """Every numeric field as a scalar ``accelfn/<field>`` at its step; the report as text."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "Monitor(tensorboard=...) needs the tensorboard package: "
                "pip install 'accelfn[tensorboard]' (or leave tensorboard=None)") from exc
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            for k, v in r.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(f"accelfn/{k}", v, r["step"])

    def close(self, report: str | None = None) -> None:
        if report:
            self.writer.add_text("accelfn/report", f"```\n{report}\n```")
        self.writer.close()
