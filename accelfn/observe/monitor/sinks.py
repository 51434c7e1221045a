"""Where the monitor writes its per-step rows: the [`Sink`][] protocol, and JSONL, CSV and
TensorBoard sinks on it (Weights & Biases and MLflow are in `accelfn.observe.monitor.trackers`).

A row is one step's record, ``{field: value}``: ``step``, ``time_s``, ``iter_s``, ``step_s``,
``data_wait_s``, ``data_share``, ``samples``, ``tokens``, ``samples_per_s``,
``tokens_per_s``, ``mem_gib`` and every scalar metric the step returned (``loss``, ``lr``,
...). Values are ``int``, ``float``, ``bool`` or ``None``.

Values given to ``Monitor.log`` (a validation loss) come as rows of their own among these,
``{"step": ..., name: value}`` with no timing field: a line of the JSONL file, a row of the
CSV file (its header widens to take a new name), a TensorBoard scalar, a W&B or MLflow
metric per name, at that step.

Rows are numbered as ``TrainState.step`` counts the updates: the update that made
``state.step`` 20 is row 20 (the n-th step is row n without a state). A resumed run continues
its history: the monitor opens each sink with the step of its first row
(``TrainState.step + 1`` when it is given the state, else 1), and a sink drops what an earlier
run left at that step or later (the steps run again after the checkpoint) before new rows
come; opened at step 1 (a fresh run) it drops all of it.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

__all__ = ["CsvSink", "JsonlSink", "Row", "Sink", "TensorBoardSink", "close_sinks", "open_sinks",
           "scalars", "write_sinks"]

#: One step's record: field name to an ``int``, ``float``, ``bool`` or ``None``.
Row = Mapping[str, Any]


@runtime_checkable
class Sink(Protocol):
    """A destination for the monitor's rows: ``open`` once, ``write`` many times, ``close``.

    Any object with these three methods is a sink; pass it as ``Monitor(sinks=[...])``. The
    monitor calls them on rank 0 only, from the training thread:

    * ``open(start_step)`` when the monitor starts. ``start_step`` is the step of the first
      row to come (``TrainState.step + 1`` on a resumed run, else 1); rows an earlier run
      wrote at this step or later belong to steps that run again, and should not be kept
      twice (at 1, a fresh run: none of them).
    * ``write(rows)`` every ``log_every`` steps with the rows of newly completed steps, in
      step order.
    * ``close(report)`` once at the end, with the monitor's report as text. A sink may also
      have an ``abort(report)`` method: the monitor calls it instead of ``close`` when the
      loop inside ``with monitor:`` raised (W&B and MLflow mark the run as failed there).

    A sink that prints the loss every time rows arrive:

        class PrintLoss:
            def open(self, start_step: int) -> None:
                print(f"logging from step {start_step}")

            def write(self, rows: Sequence[Row]) -> None:
                for row in rows:
                    print(row["step"], row.get("loss"))

            def close(self, report: str | None = None) -> None:
                pass

        Monitor(sinks=[PrintLoss()], state=state)
    """

    def open(self, start_step: int) -> None:
        """Get ready for rows from ``start_step`` on; drop stale rows at or past it."""

    def write(self, rows: Sequence[Row]) -> None:
        """Write the rows of newly completed steps."""

    def close(self, report: str | None = None) -> None:
        """Flush and close; ``report`` is the final report as text (kept where it fits)."""


def scalars(row: Row, prefix: str = "") -> dict[str, float]:
    """The numeric fields of ``row`` but ``step``, as floats named ``prefix + field``.

    ``None`` and booleans (``probed``) are left out: what trackers plot against the step.
    """
    return {f"{prefix}{k}": float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _keep_before(path: Path, start_step: int, step_of: Callable[[bytes], int | None], *,
                 header: bool = False) -> int:
    """Cut ``path`` at its first row whose step is ``>= start_step`` (every row when
    ``start_step <= 1``: a fresh run); return the rows kept.

    ``step_of`` reads a line's step (``None``: not a row, cut there too). A last line
    without its newline (a write the crash interrupted) is cut as well. With ``header``,
    the first line is kept when any row is, and the file is emptied otherwise.
    """
    if not path.exists():
        return 0
    kept, end = 0, 0
    fresh = start_step <= 1
    with open(path, "r+b") as f:
        lines = iter(f)
        if header:
            first = next(lines, b"")
            if not first.endswith(b"\n"):
                f.truncate(0)
                return 0
            end = len(first)
        for line in lines:
            step = step_of(line) if line.endswith(b"\n") else None
            if fresh or step is None or step >= start_step:
                break
            kept += 1
            end += len(line)
        f.truncate(end if kept or not header else 0)
    return kept


def _open_append(path: str | Path, start_step: int, step_of: Callable[[bytes], int | None],
                 *, header: bool = False) -> tuple[IO[str], int]:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    kept = _keep_before(p, start_step, step_of, header=header)
    return open(p, "a", newline=""), kept


def _not_open(sink: object) -> RuntimeError:
    return RuntimeError(f"{type(sink).__name__}.write before open(): the Monitor opens its "
                        "sinks when it starts; call sink.open(start_step) first when using "
                        "one on its own")


def _jsonl_step(line: bytes) -> int | None:
    try:
        step = json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None
    return int(step) if isinstance(step, (int, float)) else None


class JsonlSink:
    """One JSON object per step and line, appended to ``path``.

    Equivalent to ``f.write(json.dumps(row) + "\\n")`` for each row; ``open(k)`` first cuts
    the file at its first row with ``step >= k`` (all of it when ``k`` is 1: a fresh run).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file: IO[str] | None = None

    def open(self, start_step: int) -> None:
        self.file, _ = _open_append(self.path, start_step, _jsonl_step)

    def write(self, rows: Sequence[Row]) -> None:
        if self.file is None:
            raise _not_open(self)
        for r in rows:
            self.file.write(json.dumps(dict(r)) + "\n")
        self.file.flush()

    def close(self, report: str | None = None) -> None:
        if self.file is not None:
            self.file.close()


class CsvSink:
    """One row per step in a CSV file; its columns are those of the rows written.

    Equivalent to ``csv.DictWriter(f, fieldnames).writerows(rows)``. A row with a name the
    header lacks (a value given to ``Monitor.log`` later in the run) widens the header:
    the file is rewritten once with the new column, empty in the earlier rows. ``open(k)``
    cuts the file at its first row with ``step >= k``; when rows are left, the new ones go
    under the existing header, else the file starts again with a new header.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file: IO[str] | None = None
        self.writer: csv.DictWriter[str] | None = None

    def open(self, start_step: int) -> None:
        fields = self._header()
        column = fields.index("step") if "step" in fields else None

        def step_of(line: bytes) -> int | None:
            if column is None:
                return None
            try:
                return int(float(next(csv.reader([line.decode()]))[column]))
            except (ValueError, IndexError, UnicodeDecodeError, StopIteration):
                return None

        self.file, kept = _open_append(self.path, start_step, step_of, header=True)
        self.writer = (csv.DictWriter(self.file, fieldnames=fields, extrasaction="ignore")
                       if kept else None)

    def _header(self) -> list[str]:
        try:
            with open(self.path, newline="") as f:
                line = f.readline()
        except OSError:
            return []
        return next(csv.reader(io.StringIO(line)), []) if line.endswith("\n") else []

    def write(self, rows: Sequence[Row]) -> None:
        if self.file is None:
            raise _not_open(self)
        if not rows:
            return
        if self.writer is None:
            fields = list(dict.fromkeys(k for r in rows for k in r))
            if "probed" not in fields and "mem_gib" in fields:
                # a monitor row field that only the probed step has (often a later write)
                fields.insert(fields.index("mem_gib") + 1, "probed")
            self.writer = csv.DictWriter(self.file, fieldnames=fields, extrasaction="ignore")
            self.writer.writeheader()
        known = set(self.writer.fieldnames)
        extra = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in known]
        if extra:
            self._widen([*self.writer.fieldnames, *extra])
            assert self.writer is not None and self.file is not None
        self.writer.writerows(rows)
        self.file.flush()

    def _widen(self, fields: list[str]) -> None:
        """Give the file the columns ``fields`` (new ones last, empty in the rows so far):
        rewritten once, row by row, through a temporary file that replaces it."""
        assert self.file is not None
        self.file.close()
        tmp = self.path.with_name(self.path.name + ".widen")
        with open(self.path, newline="") as src, open(tmp, "w", newline="") as dst:
            writer = csv.DictWriter(dst, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(csv.DictReader(src))
        os.replace(tmp, self.path)
        self.file = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=fields, extrasaction="ignore")

    def close(self, report: str | None = None) -> None:
        if self.file is not None:
            self.file.close()


class TensorBoardSink:
    """Every numeric field as a scalar ``<prefix><field>`` at its step; the report as text.

    Equivalent to ``SummaryWriter(log_dir, purge_step=k).add_scalar(name, value, step)``:
    opened at step ``k``, TensorBoard hides what earlier runs logged at ``k`` or later (all of
    it when ``k`` is 1: a fresh run).
    """

    def __init__(self, log_dir: str | Path, *, prefix: str = "accelfn/") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "TensorBoardSink needs the tensorboard package: "
                "pip install 'accelfn[tensorboard]' (or leave the sink out)") from exc
        self._make = SummaryWriter
        self.log_dir, self.prefix = str(log_dir), prefix
        self.writer: Any = None

    def open(self, start_step: int) -> None:
        self.writer = self._make(log_dir=self.log_dir,
                                 purge_step=start_step if start_step > 1 else 0)

    def write(self, rows: Sequence[Row]) -> None:
        if self.writer is None:
            raise _not_open(self)
        for r in rows:
            for k, v in scalars(r, self.prefix).items():
                self.writer.add_scalar(k, v, int(r["step"]))

    def close(self, report: str | None = None) -> None:
        if self.writer is None:
            return
        if report:
            self.writer.add_text(f"{self.prefix}report", f"```\n{report}\n```")
        self.writer.close()


def close_sinks(sinks: Sequence[Sink], report: str, failed_loop: bool) -> Exception | None:
    """Close every sink, even after one fails, and return the first error. When the monitored
    loop raised (``failed_loop``), a sink with an ``abort(report)`` method (W&B, MLflow: the
    run marked failed) is aborted instead."""
    failed: Exception | None = None
    for sink in sinks:
        abort = getattr(sink, "abort", None) if failed_loop else None
        try:
            if callable(abort):
                abort(report)
            else:
                sink.close(report)
        except Exception as exc:
            failed = failed or exc
    return failed


def open_sinks(sinks: Sequence[Sink], start_step: int) -> None:
    """Open every sink at ``start_step``. When one fails, the sinks opened so far and the
    failing one are closed as after a failed loop (a tracker's run is not left running, no
    file stays open) and its error is raised."""
    for i, sink in enumerate(sinks):
        try:
            sink.open(start_step)
        except BaseException:
            close_sinks(list(sinks[:i + 1]), "", failed_loop=True)
            raise


def write_sinks(sinks: Sequence[Sink], rows: Sequence[Row]) -> Exception | None:
    """Hand ``rows`` to every sink, even after one fails (the others lose no row); return
    the first error."""
    failed: Exception | None = None
    for sink in sinks:
        try:
            sink.write(rows)
        except Exception as exc:
            failed = failed or exc
    return failed
