"""Hangs named: a collective that timed out, or lost a process, said with its rank and op.

A collective waits for every process of its group. When one never comes (stuck in a loop, a
deadlock, a sleep, or dead), the others wait until the process group's timeout (torch's
default is 30 minutes on gloo, 10 on NCCL; ``init_distributed(timeout=...)`` sets it) and
gloo raises "Timed out waiting 3000ms for recv operation to complete", which names neither
the collective nor the missing process. Two of torch's own mechanisms fill that in:

* the **Flight Recorder**: every process group records its latest collectives (sequence
  number, op such as ``gloo:all_reduce``, sizes, state) in a ring buffer of
  ``TORCH_FR_BUFFER_SIZE`` entries, which :func:`record_collectives` turns on (256 entries)
  before the group exists. NCCL's watchdog dumps it to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` on
  a timeout; gloo has no watchdog, so :func:`name_hang` writes the same dump (torch's own
  pickle, the file torch's ``torchfrtrace`` and ``accelfn doctor --hang`` read) on the
  survivor's failure path;
* the **store** of the default group, which still answers once a collective failed: each
  survivor leaves its last collective there and waits a short grace for the others; the
  ranks of the group that left nothing are the ones that never arrived.

:func:`name_hang` runs once per process, on the failure path only (never in a step).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import compat_distributed

__all__ = ["DUMP_PREFIX", "Hang", "HangError", "is_hang_error", "name_hang", "raise_named",
           "record_collectives"]

#: dump files are ``<dir>/rank_<global rank>``, as torch's analyser infers them
DUMP_PREFIX = "rank_"
_ENTRIES = "256"  # when the user set no size: the latest collectives name a hang, and a
# dump of 256 takes milliseconds (the monitor's straggler check reads it every log_every)
_KEY = "accelfn/hang/"
#: torch's texts for a collective that timed out, and for a peer whose connection closed
TIMEOUT_TEXTS = ("Timed out waiting", "timed out after", "Watchdog caught collective "
                 "operation timeout", "Socket Timeout", "wait timeout after")
LOST_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")

_dump_dir: Path | None = None
_named: Hang | None = None


def record_collectives(dump_dir: str | os.PathLike[str] | None, *, size: bool = True) -> None:
    """Before the process group exists (``size``): turn torch's Flight Recorder on (unless the
    user sized it with ``TORCH_FR_BUFFER_SIZE`` or ``TORCH_NCCL_TRACE_BUFFER_SIZE``); with
    ``dump_dir``, send its dumps there (NCCL's on a timeout, and :func:`name_hang`'s)."""
    global _dump_dir
    if size and "TORCH_FR_BUFFER_SIZE" not in os.environ and \
            "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ["TORCH_FR_BUFFER_SIZE"] = _ENTRIES
    if dump_dir is None:
        return
    _dump_dir = Path(dump_dir)
    _dump_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(_dump_dir / DUMP_PREFIX)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def is_hang_error(error: BaseException) -> bool:
    """True for torch's error of a collective that timed out or lost a process."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        pattern in text for pattern in TIMEOUT_TEXTS + LOST_TEXTS)


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@dataclass(frozen=True)
class Hang:
    """What one process knows of a hung collective: its own ``rank`` and the ``collective``
    it was in (its Flight Recorder entry: ``seq``, ``op``, ``group``, ``ranks``, ``sizes``),
    the ranks of that group that ``absent`` (left no word within ``grace_s``: stuck
    elsewhere or dead), those ``behind`` at an earlier collective (rank -> its sequence
    number), those ``elsewhere``: at the same number in another collective (rank -> its op
    and sizes), and where this process's Flight Recorder ``dump`` went."""

    rank: int
    collective: dict[str, Any] | None
    absent: list[int] = field(default_factory=list)
    behind: dict[int, int] = field(default_factory=dict)
    elsewhere: dict[int, str] = field(default_factory=dict)
    grace_s: float = 0.0
    dump: str | None = None
    note: str | None = None

    def describe(self) -> str:
        """One paragraph: the collective, the ranks that did not arrive, the dump."""
        c = self.collective
        what = (f"collective #{c['seq']} ({c['op']}, process group {c['group']!r} of ranks "
                f"{c['ranks']}, sizes {c['sizes']})" if c else
                "a collective (no Flight Recorder entry: TORCH_FR_BUFFER_SIZE is 0)")
        parts = [f"rank {self.rank} was in {what}"]
        if self.absent:
            who = ", ".join(map(str, self.absent))
            parts.append(f"rank{'s' if len(self.absent) > 1 else ''} {who} never arrived (no "
                         f"word within {self.grace_s:g} s of this failure: stuck outside "
                         "the collective, or dead)")
        for rank, seq in sorted(self.behind.items()):
            parts.append(f"rank {rank} was still at collective #{seq}")
        for rank, theirs in sorted(self.elsewhere.items()):
            parts.append(f"rank {rank} was in {theirs} as its collective #{c['seq'] if c else '?'}"
                         ": the processes ran different collectives (a different number of "
                         "micro-batches or of steps, or a collective some processes skip)")
        if not self.absent and not self.behind and not self.elsewhere and self.note is None:
            parts.append("every rank of the group reached it")
        if self.note:
            parts.append(self.note)
        if self.dump:
            parts.append(f"Flight Recorder dump: {self.dump}; once every process ended, "
                         f"`accelfn doctor --hang {Path(self.dump).parent}` names the "
                         "stuck rank from all the dumps")
        return "; ".join(parts) + "."


def _collective(trace: dict[str, Any]) -> dict[str, Any] | None:
    """The latest collective this process entered, from its Flight Recorder trace."""
    entries = [e for e in trace.get("entries", []) if not e.get("is_p2p")]
    if not entries:
        return None
    e = max(entries, key=lambda e: e.get("record_id", 0))
    group, desc = [*e.get("process_group", ("", "")), "", ""][:2]
    config = trace.get("pg_config", {})
    pg = config.get(group) or (next(iter(config.values())) if len(config) == 1 else {})
    try:
        ranks = [int(r) for r in json.loads(str(pg.get("ranks", "[]")))]
    except ValueError:
        ranks = []
    return {"seq": int(e.get("collective_seq_id", 0)), "op": e.get("profiling_name", "?"),
            "group": desc or group, "group_id": group, "ranks": ranks,
            "sizes": e.get("input_sizes", []), "timeout_ms": e.get("timeout_ms")}


def _grace(collective: dict[str, Any] | None) -> float:
    """A tenth of the group's timeout, between 1 and 10 seconds: the survivors of one hang
    time out within a step of each other."""
    timeout_ms = (collective or {}).get("timeout_ms") or 30_000
    return min(10.0, max(1.0, timeout_ms / 1000 / 10))


def _exchange(rank: int, collective: dict[str, Any] | None, ranks: list[int],
              grace_s: float) -> tuple[list[int], dict[int, int], dict[int, str], str | None]:
    """Leave this rank's collective in the store; wait up to ``grace_s`` for the other
    ``ranks``; return those absent, those behind (at an earlier sequence number) and those
    in another collective at the same number."""
    try:
        store = compat_distributed.default_store()
        store.set_timeout(timedelta(seconds=grace_s))
        c = collective or {}
        mine = {"seq": c.get("seq"), "group": c.get("group_id"), "op": c.get("op"),
                "sizes": c.get("sizes")}
        store.set(f"{_KEY}{rank}", json.dumps(mine))
        others = [r for r in ranks if r != rank]
        deadline = time.monotonic() + grace_s
        while others and not store.check([f"{_KEY}{r}" for r in others]) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        absent, behind, elsewhere = [], {}, {}
        for r in others:
            if not store.check([f"{_KEY}{r}"]):
                absent.append(r)
                continue
            theirs = json.loads(store.get(f"{_KEY}{r}"))
            if not collective or theirs.get("group") != mine["group"] or \
                    theirs.get("seq") is None:
                continue
            if theirs["seq"] < collective["seq"]:
                behind[r] = int(theirs["seq"])
            elif theirs["seq"] == collective["seq"] and \
                    (theirs.get("op"), theirs.get("sizes")) != (mine["op"], mine["sizes"]):
                elsewhere[r] = f"{theirs.get('op')} (sizes {theirs.get('sizes')})"
        return absent, behind, elsewhere, None
    except Exception as error:  # the store's host may be the one that died
        return [], {}, {}, f"the store could not be asked which ranks arrived ({error})"


def name_hang(*, dump: bool = True) -> Hang | None:
    """This process's account of the collective that just failed (None without a process
    group); the first call writes its Flight Recorder dump (with ``dump`` and a dump
    directory) and asks the store, later calls return the same account."""
    global _named
    if _named is not None:
        return _named
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        trace = compat_distributed.flight_recorder_trace()
    except Exception:
        trace = {}
    collective = _collective(trace)
    path = None
    if dump and _dump_dir is not None:
        path = str(_dump_dir / f"{DUMP_PREFIX}{rank}")
        try:
            Path(path).write_bytes(compat_distributed.flight_recorder_dump())
        except Exception:
            path = None
    ranks = (collective or {}).get("ranks") or list(range(world))
    grace = _grace(collective)
    absent, behind, elsewhere, note = _exchange(rank, collective, ranks, grace)
    _named = Hang(rank=rank, collective=collective, absent=absent, behind=behind,
                  elsewhere=elsewhere, grace_s=grace, dump=path, note=note)
    return _named


class HangError(RuntimeError):
    """A collective that timed out or lost a process, explained; ``hang`` is the
    :class:`Hang` account and torch's error the ``__cause__``."""

    def __init__(self, message: str, hang: Hang) -> None:
        super().__init__(message)
        self.hang = hang


def raise_named(error: BaseException, where: str) -> None:
    """Raise :class:`HangError` ``from error`` when ``error`` is a hung collective's (torch's
    text for a timeout or a lost process) under a process group; return otherwise."""
    if not is_hang_error(error):
        return
    hang = name_hang()
    if hang is None:
        return
    raise HangError(f"{where}: a collective failed waiting for the other processes "
                    f"({_first_line(error)}); {hang.describe()}", hang) from error
