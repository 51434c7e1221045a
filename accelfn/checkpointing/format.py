"""The checkpoint format: its names, its errors, and what may be stored in it.

A checkpoint is a directory ``<dir>/step-000000500`` holding::

    state.pt        TrainState: model, optimizer, scheduler, step counter, transform slots,
                    and ``extra`` (model and optimizer are in sharded/ when sharded)
    sharded/        torch.distributed.checkpoint (DCP) shards of model and optimizer (FSDP2)
    rank-00000.pt   per process: RNG states (Python, NumPy, torch CPU, CUDA), loader position
    meta.json       format, step, world size, parameter names/shapes/dtypes, transform stack
    COMMITTED       written last: size and SHA-256 of every file; without it, ignored

Everything stored is tensors and plain data (:func:`check_plain`), so that every file loads
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "LOADER_FORMAT",
    "MARKER",
    "META_FILE",
    "META_KEYS",
    "PARTS",
    "SHARDED_DIR",
    "STATE_FILE",
    "TMP_PREFIX",
    "CheckpointError",
    "CheckpointInfo",
    "check_plain",
    "clone",
    "parse_name",
    "rank_file",
]

FORMAT = "accelfn.checkpoint/1"
MARKER = "COMMITTED"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
SHARDED_DIR = "sharded"
TMP_PREFIX = ".tmp-"
LOADER_FORMAT = "accelfn.data.loader/1"
META_KEYS = frozenset({"format", "step", "world_size", "sharded", "optimizer_sharded", "created",
                       "model", "optimizer", "scheduler", "stack", "loader"})
PARTS = ("optimizer", "scheduler", "step", "rng.python", "rng.numpy", "rng.torch", "rng.cuda",
         "data")  # what a restore covers, plus "slot:<name>" for each transform slot
_NAME = re.compile(r"^step-(\d+)(?:\.(\d+))?$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run: incomplete, corrupt or mismatched."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What [`load`][] restored, and the checkpoint's metadata."""

    path: Path
    step: int
    world_size: int
    sharded: bool
    created: float
    stack: str | None
    extra: Any
    restored: tuple[str, ...]


def parse_name(name: str) -> tuple[int, int] | None:
    """``(step, n)`` of a checkpoint directory named ``step-<step>[.<n>]``, else None."""
    match = _NAME.match(name)
    return None if match is None else (int(match.group(1)), int(match.group(2) or 0))


def rank_file(rank: int) -> str:
    """The name of process ``rank``'s file (RNG states and loader position)."""
    return f"rank-{rank:05d}.pt"


_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def check_plain(obj: Any, where: str) -> None:
    """Raise TypeError unless ``obj`` loads with ``torch.load(weights_only=True)``."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local") or hasattr(obj, "local_shards"):
            raise TypeError(
                f"{where} is a sharded tensor ({type(obj).__name__}); FSDP state is saved with "
                "sharded=True (the default when parameters are DTensors)"
            )
        return
    if type(obj) in _PLAIN or isinstance(obj, (torch.dtype, torch.device)):
        return
    if type(obj) in (dict, OrderedDict):  # not subclasses: defaultdict does not load
        for key, value in obj.items():
            if type(key) not in (str, int):
                raise TypeError(f"{where} has a key {key!r}; use str or int keys")
            check_plain(value, f"{where}[{key!r}]")
        return
    if type(obj) in (list, tuple):  # not named tuples
        for i, value in enumerate(obj):
            check_plain(value, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {type(obj).__name__}, which cannot be loaded with "
        "torch.load(weights_only=True); store tensors and plain data (numbers, strings, "
        "lists, dicts) instead"
    )


def clone(obj: Any) -> Any:
    """A deep copy with tensors cloned (CUDA tensors copied to the host)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda and not hasattr(obj, "to_local"):
            return obj.detach().to("cpu", copy=True)
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = clone(value)
        return out
    if isinstance(obj, list):
        return [clone(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(clone(v) for v in obj)
    return copy.deepcopy(obj)
