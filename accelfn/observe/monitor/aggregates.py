"""What the monitor's report and plot need of a run, in memory bounded whatever its length.

A run of a million updates must not keep a million rows: [`RunningSummary`][] keeps the
report's sums, counts and step-time quantiles as running aggregates (the step times exactly
up to ``exact`` of them, then in a histogram of relative width ``1e-3``: quantiles within
0.05%), and [`History`][] keeps the plot's per-step series as at most ``max_points``
points, each the mean of a run of consecutive rows (one row a point until the limit, then
two, four, ...). A history can also be read back from a metrics JSONL file
([`read_history`][]), so a plot can show the whole run on disk, earlier runs of a resumed
one included. Written here because the statistics libraries at hand keep every value.
"""

from __future__ import annotations

import json
import math
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["History", "Quantiles", "RunBook", "RunningSummary", "Totals", "read_history"]

#: fields of a training row that tell it from a row of logged values (see Monitor.log)
TRAINING_FIELD = "iter_s"


_NUMBERS = (int, float)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Quantiles:
    """Quantiles of a stream of positive numbers: exact (numpy's linear interpolation) for
    the first ``exact`` values, then from a histogram of bins ``rel`` wide (relative)."""

    def __init__(self, exact: int = 65536, rel: float = 1e-3) -> None:
        self.exact, self._log_base = exact, math.log1p(rel)
        self.values: array[float] | None = array("d")
        self.bins: dict[int, int] = {}
        self.n = 0

    def add(self, x: float) -> None:
        self.n += 1
        if self.values is not None:
            self.values.append(x)
            if len(self.values) > self.exact:
                for v in self.values:
                    self._bin(v)
                self.values = None
            return
        self._bin(x)

    def _bin(self, x: float) -> None:
        key = math.floor(math.log(x) / self._log_base) if x > 0 else -(2**62)
        self.bins[key] = self.bins.get(key, 0) + 1

    def quantile(self, q: float) -> float | None:
        if not self.n:
            return None
        if self.values is not None:
            xs = sorted(self.values)
            pos = q * (len(xs) - 1)
            lo = int(pos)
            hi = min(lo + 1, len(xs) - 1)
            return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
        rank, seen = q * (self.n - 1), 0
        for key in sorted(self.bins):
            seen += self.bins[key]
            if seen > rank:
                return 0.0 if key == -(2**62) else math.exp((key + 0.5) * self._log_base)
        return None  # not reached


@dataclass
class Totals:
    """Sums over the measured rows (past the warm-up, not probed) of a run."""

    n: int = 0
    step: float = 0.0
    iter: float = 0.0
    wait: float = 0.0
    samples: float = 0.0
    samples_n: int = 0
    samples_step: float = 0.0  # the step time of the rows that counted samples
    tokens: float = 0.0
    tokens_n: int = 0
    tokens_step: float = 0.0
    first: Mapping[str, Any] | None = None
    last: Mapping[str, Any] | None = None
    times: Quantiles = field(default_factory=Quantiles)
    #: metric -> [sum of finite values, finite count, count of numbers]
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def add(self, row: Mapping[str, Any], metric_keys: Iterable[str]) -> None:
        self.n += 1
        self.step += float(row["step_s"])
        self.iter += row["iter_s"]
        self.wait += row["data_wait_s"]
        if row["samples"]:
            self.samples += row["samples"]
            self.samples_n += 1
            self.samples_step += float(row["step_s"])
        if row["tokens"]:
            self.tokens += row["tokens"]
            self.tokens_n += 1
            self.tokens_step += float(row["step_s"])
        self.times.add(float(row["step_s"]))
        self.first = self.first or row
        self.last = row
        for k in metric_keys:
            v = row[k]
            if isinstance(v, (int, float)):  # as the report always read them
                acc = self.metrics.setdefault(k, [0.0, 0, 0])
                acc[2] += 1
                if math.isfinite(v):
                    acc[0] += v
                    acc[1] += 1

    def metric_means(self) -> dict[str, float]:
        """Each metric's mean over its finite values (NaN when none was finite)."""
        return {k: s / n if n else math.nan for k, (s, n, count) in self.metrics.items()
                if count}


class RunningSummary:
    """A run's rows summarised as they come: `Totals` of the measured rows, the
    warm-up and probed rows themselves (few: the report falls back on them when nothing
    else was measured), non-finite metric counts over every row, and the last row."""

    def __init__(self, warmup: int, row_keys: frozenset[str] | set[str]) -> None:
        self.warmup, self.row_keys = warmup, frozenset(row_keys)
        self.count = 0
        self.totals = Totals()
        self.held: list[tuple[int, dict[str, Any]]] = []  # (index, row): warm-up or probed
        #: metric -> [float values, non-finite count, first non-finite step]
        self.nonfinite: dict[str, list[Any]] = {}
        self.last: Mapping[str, Any] | None = None

    def add(self, row: dict[str, Any]) -> None:
        keys = [k for k in row if k not in self.row_keys]
        for k in keys:
            v = row[k]
            if isinstance(v, float):
                acc = self.nonfinite.setdefault(k, [0, 0, None])
                acc[0] += 1
                if not math.isfinite(v):
                    acc[1] += 1
                    if acc[2] is None:
                        acc[2] = row["step"]
        if self.count < self.warmup or row.get("probed"):
            self.held.append((self.count, row))
        else:
            self.totals.add(row, keys)
        self.count += 1
        self.last = row

    def measured(self) -> tuple[Totals, bool]:
        """The totals of the measured rows; when there are none, of the held rows (those not
        probed, or all), and whether warm-up rows are among them."""
        if self.totals.n or not self.held:
            return self.totals, False
        chosen = [(i, r) for i, r in self.held if not r.get("probed")] or self.held
        out = Totals()
        for _, r in chosen:
            out.add(r, [k for k in r if k not in self.row_keys])
        return out, any(i < self.warmup for i, _ in chosen)


class History:
    """A bounded picture of a run's rows for plots: at most ``max_points`` points, each the
    mean of ``rows_per_point`` consecutive rows (numeric fields; ``step`` the first row's,
    ``probed`` when any was); the limit reached, neighbouring points merge in pairs."""

    def __init__(self, max_points: int = 2048) -> None:
        if max_points < 2:
            raise ValueError(f"History(max_points={max_points}): must be >= 2")
        self.max_points = max_points + max_points % 2  # even: points merge in pairs
        self.rows_per_point = 1
        self._points: list[tuple[int, int, dict[str, list[float]], bool]] = []
        self._open: tuple[int, int, dict[str, list[float]], bool] | None = None
        self.count = 0

    def add(self, row: Mapping[str, Any]) -> None:
        self.count += 1
        step, n, sums, probed = self._open or (int(row["step"]), 0, {}, False)
        for k, v in row.items():
            if type(v) in _NUMBERS and k != "step":  # not bool, not None
                acc = sums.setdefault(k, [0.0, 0])
                acc[0] += v
                acc[1] += 1
        point = (step, n + 1, sums, probed or bool(row.get("probed")))
        if point[1] < self.rows_per_point:
            self._open = point
            return
        self._open = None
        self._points.append(point)
        if len(self._points) >= self.max_points:
            self._points = [self._merge(*self._points[i:i + 2])
                            for i in range(0, len(self._points), 2)]
            self.rows_per_point *= 2

    @staticmethod
    def _merge(*points: tuple[int, int, dict[str, list[float]], bool],
               ) -> tuple[int, int, dict[str, list[float]], bool]:
        sums: dict[str, list[float]] = {}
        for _, _, s, _ in points:
            for k, (total, count) in s.items():
                acc = sums.setdefault(k, [0.0, 0])
                acc[0] += total
                acc[1] += count
        return (points[0][0], sum(p[1] for p in points), sums, any(p[3] for p in points))

    def rows(self) -> list[dict[str, Any]]:
        """The points as rows (the last one may hold fewer rows than the others)."""
        out = []
        for step, _, sums, probed in self._points + ([self._open] if self._open else []):
            row: dict[str, Any] = {"step": step}
            row.update({k: total / count for k, (total, count) in sums.items()})
            if probed:
                row["probed"] = True
            out.append(row)
        return out


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # a write cut short
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and _number(row.get("step")):
                yield row


def read_history(path: str | Path, *, max_points: int = 2048) -> tuple[History, History]:
    """The training rows and the logged rows of a metrics JSONL file, each as a
    [`History`][] (streamed: memory bounded whatever the file's length)."""
    training, logged = History(max_points), History(max_points)
    for row in _lines(Path(path)):
        (training if TRAINING_FIELD in row else logged).add(row)
    return training, logged


class RunBook:
    """What the monitor keeps of the rows it read, all bounded: the latest ``keep_rows``
    rows, their [`RunningSummary`][], the plot's [`History`][] of the training rows and of
    the logged ones, and the last logged value of each name."""

    def __init__(self, warmup: int, row_keys: frozenset[str] | set[str], keep_rows: int) -> None:
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep_rows)
        self.summary = RunningSummary(warmup, row_keys)
        self.history, self.logged = History(), History()
        self.last_logged: dict[str, float] = {}

    def add(self, row: dict[str, Any]) -> None:
        """A training row."""
        self.recent.append(row)
        self.summary.add(row)
        self.history.add(row)

    def add_logged(self, row: dict[str, Any]) -> None:
        """A row of logged values."""
        self.logged.add(row)
        self.last_logged.update((k, v) for k, v in row.items() if k != "step")
