"""The checkpoint format: its names, its errors, and what may be stored in it.

A checkpoint is a directory ``<dir>/step-000000500`` holding::

    state.pt        TrainState: model, optimizer, scheduler, step counter, transform slots,
                    and ``extra`` (model and optimizer are in sharded/ when sharded)
    sharded/        torch.distributed.checkpoint (DCP) shards of model and optimizer (FSDP2),
                    and of the DTensors in transform slots (with_ema's average)
    rank-00000.pt   per process: RNG states (Python, NumPy, torch CPU, CUDA), loader position
    meta.json       format, step, world size, parameter names/shapes/dtypes, transform stack
    COMMITTED       written last: size and SHA-256 of every file; without it, ignored

A TrainState with several optimizers keeps a list of their states and of their schedulers'
(in state.pt) and of their signatures and scheduler names (in meta.json), in order; one
optimizer's are not in a list. A checkpoint of several states (``save(dir, {name: state})``)
keeps each state under its name: ``"states": {name: ...}`` in state.pt and meta.json, and
``<name>.model``, ``<name>.optimizer``, ... in sharded/; the RNG states and the loader
position are the run's, one per process, as for one state.

Everything stored is tensors and plain data (``check_plain()``), so that every file loads
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "COMMON_META_KEYS",
    "FORMAT",
    "LOADER_FORMAT",
    "MARKER",
    "META_FILE",
    "META_KEYS",
    "ONE",
    "PARTS",
    "SHARDED_DIR",
    "STATE_FILE",
    "STATE_META_KEYS",
    "TMP_PREFIX",
    "CheckpointError",
    "CheckpointInfo",
    "check_marker",
    "check_meta",
    "check_plain",
    "clone",
    "fill_refs",
    "is_checkpoint_file",
    "is_ref",
    "loads_json",
    "parse_name",
    "rank_file",
    "refs_in",
    "split_refs",
    "states_meta",
    "tensors_at",
]

FORMAT = "accelfn.checkpoint/1"
MARKER = "COMMITTED"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
SHARDED_DIR = "sharded"
TMP_PREFIX = ".tmp-"
ONE = ""  # inside, a checkpoint of one state is {ONE: state}; several are {name: state}
LOADER_FORMAT = "accelfn.data.loader/1"
COMMON_META_KEYS = frozenset({"format", "step", "world_size", "sharded", "created", "loader"})
STATE_META_KEYS = frozenset({"optimizer_sharded", "model", "optimizer", "scheduler", "stack"})
META_KEYS = COMMON_META_KEYS | STATE_META_KEYS  # a checkpoint of one state
PARTS = ("optimizer", "scheduler", "step", "rng.python", "rng.numpy", "rng.torch", "rng.cuda",
         "data")  # what a restore covers, plus "slot:<name>" for each transform slot
_NAME = re.compile(r"^step-(\d+)(?:\.(\d+))?$")
_FILE = re.compile(r"^(?:state\.pt|meta\.json|rank-\d{5}\.pt|sharded/(?!\.\.?$)[^/\\\x00]+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_JSON_BYTES = 256 << 20  # a marker or meta.json is never near this (a few MB at most)
MAX_JSON_DEPTH = 16  # their deepest nesting is 4 (meta.json's model shapes)


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
    states: tuple[str, ...] = ()
    """The names of the states of a checkpoint of several (``save(dir, {name: state})``);
    empty for a checkpoint of one state. Their parts in ``restored`` are ``<name>/model``,
    ``<name>/optimizer``, ...; ``stack`` is ``"<name>: <stack>; ..."``."""


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


# ------------------------------------------------- sharded tensors of the transform slots
# A DTensor in a transform slot's state (with_ema's average of FSDP2's parameters) is written
# by torch.distributed.checkpoint with the model; state.pt holds a reference in its place.
_REF = "__accelfn_sharded__"


def is_ref(obj: Any) -> bool:
    """Whether ``obj`` is the reference [`split_refs`][] left in place of a sharded tensor."""
    return type(obj) is dict and set(obj) == {_REF}


def _walk(obj: Any, key: str, leaf: Callable[[Any, str], Any]) -> Any:
    """``obj`` rebuilt with every non-container value replaced by ``leaf(value, key)``, where
    ``key`` is the value's path (``name/sub/...``)."""
    if type(obj) in (dict, OrderedDict) and not is_ref(obj):
        return type(obj)((k, _walk(v, f"{key}/{k}", leaf)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_walk(v, f"{key}/{i}", leaf) for i, v in enumerate(obj))
    return leaf(obj, key)


def split_refs(slots: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``slots`` with each sharded tensor (DTensor) replaced by a reference, and the sharded
    tensors by their path."""
    found: dict[str, torch.Tensor] = {}

    def leaf(value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor) and hasattr(value, "to_local"):
            found[key] = value
            return {_REF: key}
        return value

    return {k: _walk(v, k, leaf) for k, v in slots.items()}, found


def tensors_at(slots: dict[str, Any], keys: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of ``slots`` at the paths ``keys`` (sharded or not)."""
    found: dict[str, torch.Tensor] = {}

    def leaf(value: Any, key: str) -> Any:
        if key in keys and isinstance(value, torch.Tensor):
            found[key] = value
        return value

    for k, v in slots.items():
        _walk(v, k, leaf)
    return found


def refs_in(slots: dict[str, Any]) -> set[str]:
    """The paths of the references in ``slots`` (a checkpoint's transform slots)."""
    found: set[str] = set()

    def leaf(value: Any, key: str) -> Any:
        if is_ref(value):
            found.add(key)
        return value

    for k, v in slots.items():
        _walk(v, k, leaf)
    return found


def fill_refs(slots: dict[str, Any], loaded: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``slots`` with each reference replaced by the tensor ``loaded`` holds for its path."""
    return {k: _walk(v, k, lambda value, key: loaded[key] if is_ref(value) else value)
            for k, v in slots.items()}


# ------------------------------------------------------------------------------ validation
def is_checkpoint_file(rel: str) -> bool:
    """Whether ``rel`` is a name a checkpoint's files have: state.pt, meta.json, rank-NNNNN.pt,
    or a plain file name inside sharded/ (never a path leading elsewhere)."""
    return _FILE.match(rel) is not None


def _depth(obj: Any) -> int:
    deepest, todo = 0, [(obj, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                 else item))
    return deepest


def loads_json(data: bytes, where: str) -> Any:
    """``json.loads(data)``, or CheckpointError for what a checkpoint's JSON never is: invalid,
    deeper than ``MAX_JSON_DEPTH``, larger than ``MAX_JSON_BYTES``."""
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(f"{where} has {len(data)} bytes, more than a checkpoint's "
                              f"metadata ever has ({MAX_JSON_BYTES}); it is forged or damaged")
    try:
        obj = json.loads(data)
    except RecursionError as error:
        raise CheckpointError(f"{where} is nested too deeply to be a checkpoint's metadata; "
                              "it is forged or damaged") from error
    except ValueError as error:
        raise CheckpointError(f"{where} is unreadable ({error})") from error
    if _depth(obj) > MAX_JSON_DEPTH:
        raise CheckpointError(f"{where} is nested more deeply than a checkpoint's metadata "
                              f"ever is ({_depth(obj)} levels); it is forged or damaged")
    return obj


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_marker(marker: Any, where: str) -> dict[str, Any]:
    """The commit marker, checked: format, step, and a digest per checkpoint file name."""
    if not isinstance(marker, dict) or marker.get("format") != FORMAT \
            or not isinstance(marker.get("files"), dict) or not _is_int(marker.get("step")):
        raise CheckpointError(f"{where} is not the commit marker of an {FORMAT} checkpoint")
    for rel, entry in marker["files"].items():
        if not is_checkpoint_file(rel):
            raise CheckpointError(f"{where} lists {rel!r}, which is not a checkpoint file (a "
                                  "checkpoint holds only its own files); it is forged or damaged")
        if not (isinstance(entry, dict) and set(entry) == {"size", "sha256"}
                and _is_int(entry["size"]) and isinstance(entry["sha256"], str)
                and _SHA256.match(entry["sha256"])):
            raise CheckpointError(f"{where} records no valid size and SHA-256 for {rel}")
    for rel in (STATE_FILE, META_FILE):
        if rel not in marker["files"]:
            raise CheckpointError(f"{where} does not list {rel}; it is forged or damaged")
    return marker


def _optimizer_ok(optimizer: Any) -> bool:
    names = optimizer.get("names") if isinstance(optimizer, dict) else None
    return (isinstance(optimizer, dict) and isinstance(optimizer.get("class"), str)
            and isinstance(optimizer.get("groups"), list)
            and all(_is_int(n) for n in optimizer["groups"])
            and (names is None or (isinstance(names, list) and all(
                isinstance(g, list) and all(isinstance(n, str) for n in g) for g in names))))


def _state_meta_ok(meta: Any) -> bool:
    """One state's record: model, optimizer(s), scheduler(s), stack, optimizer_sharded."""
    if not isinstance(meta, dict) or not STATE_META_KEYS <= set(meta):
        return False
    optimizer, scheduler, model, stack = (meta["optimizer"], meta["scheduler"], meta["model"],
                                          meta["stack"])
    several = isinstance(optimizer, list)  # one optimizer's signature, or a list of several
    optimizers, schedulers = (optimizer, scheduler) if several else ([optimizer], [scheduler])
    return (isinstance(meta["optimizer_sharded"], bool)
            and (not several or len(optimizer) > 1) and isinstance(schedulers, list)
            and len(schedulers) == len(optimizers)
            and all(s is None or isinstance(s, str) for s in schedulers)
            and all(_optimizer_ok(o) for o in optimizers)
            and isinstance(model, dict)
            and all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], list)
                    and all(_is_int(d) for d in v[0]) and isinstance(v[1], str)
                    for v in model.values())
            and (stack is None or (isinstance(stack, dict)
                                   and isinstance(stack.get("describe"), str)
                                   and isinstance(stack.get("transforms"), list)
                                   and all(isinstance(t, str) for t in stack["transforms"]))))


def check_meta(meta: Any, marker: dict[str, Any], where: str) -> dict[str, Any]:
    """meta.json, checked against its marker and for the types ``load()`` relies on: one
    state's record at the top (``META_KEYS``), or several states' under ``"states"``."""
    bad = "inconsistent metadata; load an earlier checkpoint"
    several = isinstance(meta, dict) and "states" in meta
    keys = COMMON_META_KEYS | {"states"} if several else META_KEYS
    if not isinstance(meta, dict) or meta.get("format") != FORMAT \
            or meta.get("step") != marker["step"] or not keys <= set(meta):
        raise CheckpointError(f"{where} has {bad}")
    states = meta["states"] if several else {ONE: meta}
    ok = (_is_int(meta["world_size"], 1) and isinstance(meta["sharded"], bool)
          and isinstance(meta["loader"], bool)
          and isinstance(meta["created"], (int, float)) and not isinstance(meta["created"], bool)
          and isinstance(states, dict) and len(states) > 0
          and all(isinstance(name, str) and (not several or (name and _is_int(s.get("step"))))
                  and _state_meta_ok(s) for name, s in states.items()))
    if not ok:
        raise CheckpointError(f"{where} has {bad}")
    sharded = meta["sharded"]
    if rank_file(0) not in marker["files"] or (sharded and
                                               f"{SHARDED_DIR}/.metadata" not in marker["files"]):
        raise CheckpointError(f"{where} has {bad} (files are missing from its marker)")
    return meta


def states_meta(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each state's record in a checked meta.json, by name (``""`` for one state)."""
    return dict(meta["states"]) if "states" in meta else {ONE: meta}
