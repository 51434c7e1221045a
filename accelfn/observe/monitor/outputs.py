"""Where a monitor's rows go: the sinks it is given, its progress bar and its closing plot,
all on rank 0 only.

[`Monitor`][accelfn.Monitor] measures; this is its output side: opened at
its start, written at each flush, closed (and the plot drawn) at its close.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from ..logs import get_logger
from .progress_bars import Bar, make_bar, row_postfix
from .report import MonitorReport
from .sinks import JsonlSink, Sink, close_sinks, open_sinks, write_sinks

__all__ = ["Outputs"]

_log = get_logger("observe")


class Outputs:
    """A monitor's sinks, bar and plot (see [`Monitor`][accelfn.Monitor]'s
    ``sinks``, ``progress``, ``desc``, ``file``, ``total``, ``initial`` and ``plot``);
    ``main``: this process is rank 0, the only one that writes."""

    def __init__(self, *, main: bool, sinks: Iterable[Sink], progress: bool, desc: str,
                 file: IO[str] | None, total: int | None, initial: int,
                 plot: str | Path | None) -> None:
        self._given = list(sinks)
        for sink in self._given:
            if not isinstance(sink, Sink):
                raise TypeError(
                    f"Monitor(sinks=[...]): {type(sink).__name__} is not a sink: it needs "
                    "open(start_step), write(rows) and close(report) methods (see "
                    "accelfn.observe.monitor.sinks.Sink), e.g. af.JsonlSink(path)")
        self.main, self.plot_path = main, plot
        #: the first JSONL sink's file: the history a resumed run's plot is drawn from
        self.history: Path | None = next(
            (s.path for s in self._given if isinstance(s, JsonlSink)), None)
        #: the sinks opened (rank 0, once started): those written and closed
        self.sinks: list[Sink] = []
        self._want_progress, self._desc, self._file = progress, desc, file
        self._total, self._initial = total, initial
        self.bar: Bar | None = None
        #: where [`close`][] wrote the plot (``None``: not asked for, or not written)
        self.plot_file: Path | None = None

    def open(self, start_step: int, initial: int | None = None) -> None:
        """Open the sinks at ``start_step`` (the first row's) and show the bar (rank 0), at
        ``initial`` when given. One sink failing to open closes those opened and raises:
        nothing is left running."""
        if not self.main:
            return
        open_sinks(self._given, start_step)
        self.sinks = self._given
        if initial is not None:
            self._initial = initial
        if self._want_progress:
            self.bar = make_bar(self._total, self._desc, self._file, initial=self._initial)
        _log.info("monitor: rows from step %d to %s", start_step,
                  ", ".join(type(s).__name__ for s in self.sinks) or "no sink")

    def advance(self) -> None:
        """One more step on the bar."""
        if self.bar is not None:
            self.bar.update(1)

    def write(self, rows: Sequence[dict[str, Any]], last: dict[str, Any] | None) -> None:
        """Write ``rows`` to every sink (one failing: the others still get them, then its
        error is raised) and show ``last``, the latest training row, on the bar."""
        failed = write_sinks(self.sinks, rows)
        if self.bar is not None and last is not None:
            self.bar.set_postfix_str(row_postfix(last))
        if failed is not None:
            raise failed

    def close(self, report: MonitorReport, *, failed_loop: bool,
              history: str | Path | None) -> Exception | None:
        """Close the sinks with ``report`` (as a failed run's under ``failed_loop``) and the
        bar, then draw the plot (of ``history``, a metrics file, when given); returns the
        first sink's error instead of raising it."""
        failed = close_sinks(self.sinks, str(report), failed_loop)
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        _log.info("monitor: %s", report.verdict)
        if self.plot_path is not None and self.main and report.rows:
            try:
                self.plot_file = report.plot(self.plot_path, history=history)
                _log.info("monitor: plot written to %s", self.plot_file)
            except ImportError as exc:
                warnings.warn(f"Monitor(plot=...): {exc}; no plot written", stacklevel=3)
        return failed
