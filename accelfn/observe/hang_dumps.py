"""Hung collectives named from torch's Flight Recorder dumps (``accelfn doctor --hang DIR``).

Each process of a run started with ``init_distributed(hang_dir=DIR)`` dumps its Flight
Recorder to ``DIR/rank_<r>`` when a collective fails (NCCL's watchdog on a timeout, accelfn
on gloo's timeout or lost connection; see `accelfn.core.hangs`). A dump lists the latest
collectives that process called, each with its process group and sequence number. Put
together, for each process group: the collective with the highest sequence number is the
one the run hung in, the ranks whose last collective is that one entered it, and the other
ranks of the group did not: either behind, at an earlier collective (their dump says
which), or with no dump at all (stuck outside any collective, or dead, so that they never
wrote one). [`analyse`][] says so as findings; the files are read with the reader of torch's
own analyser (``torchfrtrace``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import compat_distributed
from .findings import Finding

__all__ = ["GroupHang", "analyse", "find_hangs", "read_dumps"]

_RANKED = re.compile(r"^(.*?)(\d+)$")


def read_dumps(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """The dumps in ``directory`` by rank (files ``<prefix><rank>``, one prefix for all, as
    torch's analyser infers it)."""
    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such directory; give the hang_dir the run "
                                "passed to init_distributed (or TORCH_FR_DUMP_TEMP_FILE's)")
    files = {p: m.group(1) for p in sorted(folder.iterdir())
             if p.is_file() and (m := _RANKED.match(p.name))}
    prefixes = set(files.values())
    if not files:
        raise ValueError(f"{folder}: no Flight Recorder dumps (files named rank_<r>); they are "
                         "written when a collective fails under init_distributed(hang_dir=...)")
    if len(prefixes) > 1:
        raise ValueError(f"{folder}: dumps of several prefixes {sorted(prefixes)}: keep one "
                         "run's dumps per directory")
    prefix = prefixes.pop()
    dumps = {}
    for path in files:
        try:
            dump = compat_distributed.read_dump(prefix, path)
        except Exception as error:
            raise ValueError(f"{path}: not a Flight Recorder dump ({error})") from error
        dumps[int(dump["rank"])] = dump
    return dumps


@dataclass(frozen=True)
class GroupHang:
    """Where one process group stopped: collective ``seq`` (``op``, ``sizes``) that the
    ``entered`` ranks called; of its ``ranks``, those ``behind`` (rank -> their last sequence
    number) and those with ``no_dump`` did not."""

    group: str
    ranks: list[int]
    seq: int
    op: str
    sizes: list[Any]
    entered: list[int]
    behind: dict[int, int] = field(default_factory=dict)
    no_dump: list[int] = field(default_factory=list)

    @property
    def missing(self) -> list[int]:
        """The ranks of the group that never entered the collective."""
        return sorted([*self.behind, *self.no_dump])

    def finding(self) -> Finding:
        """This group's account: an error naming the missing ranks, or info when all came."""
        what = (f"collective #{self.seq} ({self.op}, sizes {self.sizes}) of process group "
                f"{self.group!r} (ranks {self.ranks})")
        entered = f"rank{'s' if len(self.entered) > 1 else ''} {_join(self.entered)} entered it"
        if not self.missing:
            return Finding("hang", "info", f"{what}: every rank of the group entered it; none "
                           "is missing there", "read each process's own error: a collective "
                           "that failed for all (a mismatch, a lost network) is in their output")
        parts = [f"rank {r} did not (still at collective #{s})"
                 for r, s in sorted(self.behind.items())]
        if self.no_dump:
            parts.append(f"rank{'s' if len(self.no_dump) > 1 else ''} {_join(self.no_dump)} "
                         "did not and left no dump (stuck outside any collective, or dead)")
        return Finding("hang", "error", f"{what}: {entered}; {'; '.join(parts)}",
                       f"look at what rank {_join(self.missing)} was doing: its own output "
                       "(an error, a kill), its stack while stuck (py-spy dump --pid), a "
                       "branch that skips the collective on that rank only, or uneven data")


def _join(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _members(dumps: dict[int, dict[str, Any]], group: str) -> list[int]:
    """The global ranks of ``group`` as the dumps' process-group configs say (gloo records
    the default group under an empty name: a single config stands for it)."""
    for dump in dumps.values():
        config = dump.get("pg_config") or {}
        pg = config.get(group) or (next(iter(config.values())) if len(config) == 1 else None)
        if pg is not None:
            try:
                return sorted(int(r) for r in json.loads(str(pg.get("ranks", "[]"))))
            except ValueError:
                break
    return sorted(dumps)


def find_hangs(dumps: dict[int, dict[str, Any]]) -> list[GroupHang]:
    """For each process group in ``dumps`` (rank -> dump), where it stopped."""
    last: dict[str, dict[int, dict[str, Any]]] = {}
    names: dict[str, str] = {}
    for rank, dump in dumps.items():
        for entry in dump.get("entries", []):
            if entry.get("is_p2p"):
                continue
            group, desc = [*entry.get("process_group", ("", "")), "", ""][:2]
            names[group] = desc or group
            mine = last.setdefault(group, {})
            if rank not in mine or entry["collective_seq_id"] > mine[rank]["collective_seq_id"]:
                mine[rank] = entry
    hangs = []
    for group, by_rank in sorted(last.items()):
        members = _members(dumps, group)
        seq = max(e["collective_seq_id"] for e in by_rank.values())
        entered = sorted(r for r, e in by_rank.items() if e["collective_seq_id"] == seq)
        at = by_rank[entered[0]]
        behind = {r: int(e["collective_seq_id"]) for r, e in by_rank.items() if r not in entered}
        behind.update({r: 0 for r in members if r in dumps and r not in by_rank})
        no_dump = [r for r in members if r not in dumps]
        hangs.append(GroupHang(group=names[group], ranks=members, seq=int(seq),
                               op=str(at.get("profiling_name", "?")),
                               sizes=list(at.get("input_sizes", [])), entered=entered,
                               behind=behind, no_dump=no_dump))
    return hangs


def analyse(directory: str | os.PathLike[str]) -> list[Finding]:
    """The findings of the dumps in ``directory``: per process group, the collective it hung
    in and the ranks that did not enter it (see [`accelfn.observe.hang_dumps`][])."""
    dumps = read_dumps(directory)
    hangs = find_hangs(dumps)
    found = [Finding("hang_dumps", "info", f"{len(dumps)} dump(s), of rank "
                     f"{_join(sorted(dumps))}, in {directory}")]
    if not hangs:
        found.append(Finding("hang", "info", "the dumps hold no collective (the Flight "
                             "Recorder was off: TORCH_FR_BUFFER_SIZE=0)"))
    return found + [h.finding() for h in hangs]
