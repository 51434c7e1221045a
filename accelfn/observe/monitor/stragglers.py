"""Stragglers: a process slower than the others, found when the monitor reads its records.

Under synchronous data parallelism every process waits for the slowest at each gradient
all-reduce, so every process's *iteration* time is the straggler's: the slowness shows in
when each process *arrives* at the collectives. [`Stragglers`][] puts the two together, per
process, over the updates read since its last look:

* the process's mean step time (the monitor's rows, already on the host);
* when it called each collective of the default process group since the last check, from
  torch's Flight Recorder (``time_created_ns`` of each entry; ``init_distributed`` turns the
  recorder on), summed relative to the end of the previous check (after which every process
  leaves at once), so that the processes' clocks need not agree.

Where one process arrives last at the collectives, the others wait for it: the difference
between the latest sum of arrivals and a process's own, per update, is how long that
process waited. Its **own time** is its step time less that wait; a process whose own time
is at least ``slower`` (20%) above the median of all processes' is flagged, naming its rank
and the ratio. Without collectives in the step (or with the Flight Recorder off) the own
time is the step time.

One ``all_gather`` of 7 numbers per process at each check, at the monitor's read interval
(every ``log_every`` updates, 50 by default), every process at the same update; never inside
a step. Every process must run the monitor (as for any collective): one process alone
would wait for the others, until the process group's timeout names the collective.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ...core import compat_distributed, hangs
from ...core.processes import is_main_process, world_size
from ..findings import Finding

__all__ = ["Stragglers", "judge"]

_FIX = ("find what slows that process: its data loading (compare its data wait), a slower, "
        "throttled or shared device or CPU (other jobs on its machine), or more data than "
        "the others (shard the batches evenly)")


def judge(own_s: list[float], *, slower: float = 0.2) -> dict[int, float]:
    """The ranks whose own time is at least ``1 + slower`` times the median of ``own_s``
    (one per rank), with their ratio."""
    if len(own_s) < 2:
        return {}
    median = statistics.median(own_s)
    if median <= 0:
        return {}
    return {rank: t / median for rank, t in enumerate(own_s) if t / median >= 1 + slower}


class Stragglers:
    """The monitor's straggler check (see [`accelfn.observe.monitor.stragglers`][]).

    ``enabled``: ``None`` turns it on under a process group of several processes (as it is
    at each check: a monitor made before ``init_distributed`` checks too).
    ``warmup``: leading rows left out (compilation, start-up). Feed it the rows the monitor
    reads ([`add`][]), call [`check`][] on every process at the same update; the flagged
    ranks are [`findings`][] (and warned once each on the main process).
    """

    def __init__(self, enabled: bool | None = None, *, warmup: int = 0,
                 slower: float = 0.2) -> None:
        if not slower > 0:
            raise ValueError(f"Stragglers(slower={slower}): give the share above the median "
                             "that flags a process, e.g. 0.2 for 20% slower")
        self.enabled = enabled
        self.slower, self._skip = slower, warmup
        self._steps: list[float] = []
        self._updates = 0  # training rows since the last check, warm-up included
        self._first: int | None = None
        self._last: int | None = None
        self._seq: int | None = None  # the default group's sequence number at the last check
        self._base_ns = 0  # this process's wall clock when the last check ended
        if enabled is not False and world_size() > 1:
            self._arrivals()  # the collectives before this monitor are not its own
        self.checks = 0
        #: rank -> (worst ratio, own time s, median own time s, first and last update)
        self.flagged: dict[int, tuple[float, float, float, int, int]] = {}

    def add(self, rows: Iterable[dict[str, Any]]) -> None:
        """Take the step times of the monitor's training rows (host numbers)."""
        for row in rows:
            if "iter_s" not in row:
                continue
            self._updates += 1
            if row.get("probed"):
                continue
            if self._skip > 0:
                self._skip -= 1
                continue
            self._steps.append(float(row.get("step_s") or row["iter_s"]))
            self._first = row["step"] if self._first is None else self._first
            self._last = row["step"]

    def _arrivals(self) -> tuple[float, float, float, float]:
        """(first and last sequence number, summed arrival in s after the last check, count)
        of the default group's collectives since the last check, from the Flight Recorder;
        when its ring buffer no longer holds them all, the sum of those it holds scaled up to
        all of them (the same on every process: they ran the same collectives)."""
        try:
            entries = compat_distributed.flight_recorder_entries()
        except Exception:
            return 0.0, 0.0, 0.0, 0.0
        world = [e for e in entries if e.get("pg_id") == 0 and not e.get("is_p2p")]
        since = self._seq or 0
        new = [e for e in world if e["collective_seq_id"] > since]
        if world:
            self._seq = max(e["collective_seq_id"] for e in world)
        if not new:
            return 0.0, 0.0, 0.0, 0.0
        seqs = [e["collective_seq_id"] for e in new]
        total = sum((e["time_created_ns"] - self._base_ns) / 1e9 for e in new)
        ran = max(seqs) - since  # collectives in the window, held or not
        return float(min(seqs)), float(max(seqs)), total * ran / len(new), float(len(new))

    def check(self) -> None:
        """One ``all_gather`` of every process's step and arrival times since the last
        check; flag the processes at least ``slower`` above the median own time."""
        if self.enabled is False or world_size() < 2:
            return
        steps, self._steps = self._steps, []
        first, last, self._first, self._last = self._first, self._last, None, None
        updates, self._updates = self._updates, 0
        mine = [statistics.fmean(steps) if steps else 0.0, float(len(steps)),
                *self._arrivals(), float(updates)]
        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        local = torch.tensor(mine, dtype=torch.float64, device=device)
        gathered = [torch.empty_like(local) for _ in range(world_size())]
        try:
            dist.all_gather(gathered, local)
        except RuntimeError as error:
            hangs.raise_named(error, "Monitor's straggler check (every process must run the "
                                     "monitor, to the same update)")
            raise
        self._base_ns = time.time_ns()
        if self._seq is not None:
            self._seq += 1  # this gather's own entry: not in the next window
        table = torch.stack(gathered).cpu().tolist()
        self.checks += 1
        if any(row[1] == 0 for row in table) or first is None or last is None:
            return  # a process read no rows yet (its device had not finished them)
        own = [row[0] for row in table]
        same = len({(row[2], row[3], row[5]) for row in table}) == 1 and table[0][5] > 0
        if same:  # the same collectives on every process: take out each one's wait
            latest = max(row[4] for row in table)
            own = [row[0] - (latest - row[4]) / max(row[6], 1.0) for row in table]
        median = statistics.median(own)
        for rank, ratio in judge(own, slower=self.slower).items():
            known = self.flagged.get(rank)
            start = known[3] if known else first
            if known is None or ratio > known[0]:
                self.flagged[rank] = (ratio, own[rank], median, start, last)
            else:
                self.flagged[rank] = (*known[:4], last)
            if known is None and is_main_process():
                warnings.warn(f"accelfn Monitor: {self._message(rank)}", stacklevel=3)

    def _message(self, rank: int) -> str:
        ratio, own, median, first, last = self.flagged[rank]
        return (f"rank {rank} is a straggler: its step takes {ratio:.2f}x the median of the "
                f"{world_size()} processes ({own * 1e3:.1f} ms of its own against "
                f"{median * 1e3:.1f} ms; updates {first}-{last})")

    def findings(self) -> list[Finding]:
        """A warning per flagged rank, else one ``ok`` (nothing when it never checked)."""
        if not self.checks:
            return []
        if not self.flagged:
            return [Finding("stragglers", "ok", f"no process {self.slower:.0%} or more above "
                                                "the median step time")]
        return [Finding("stragglers", "warning", self._message(rank), _FIX)
                for rank in sorted(self.flagged)]
