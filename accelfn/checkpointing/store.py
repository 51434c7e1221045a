"""Checkpoints: one call saves, one call restores everything a run needs to continue exactly.

    from accelfn import checkpointing

    if checkpointing.latest("runs/x") is not None:                  # resume if there is one
        checkpointing.load("runs/x", state, loader=train, step=step)
    for batch in train:
        step(state, batch)
        if state.step % 500 == 0:
            checkpointing.save("runs/x", state, loader=train, step=step, keep=3)

A checkpoint is a directory ``<dir>/step-000000500`` holding::

    state.pt        TrainState: model, optimizer, scheduler, step counter, transform slots,
                    and ``extra`` (model and optimizer are in sharded/ when sharded)
    sharded/        torch.distributed.checkpoint (DCP) shards of model and optimizer (FSDP2)
    rank-00000.pt   per process: RNG states (Python, NumPy, torch CPU, CUDA), loader position
    meta.json       format, step, world size, parameter names/shapes/dtypes, transform stack
    COMMITTED       written last: size and SHA-256 of every file; without it, ignored

Writes are atomic: everything goes to a hidden temporary directory, is fsynced, the directory
is renamed, and the ``COMMITTED`` marker is written last; :func:`latest` and :func:`load`
never use a directory without it, and rotation (``keep``) deletes old checkpoints only after
the new one is committed. Every file loads with ``torch.load(weights_only=True)`` (DCP's
metadata with the same restricted unpickler), so loading never runs pickled code.

Under ``torchrun`` every process calls :func:`save` and :func:`load` (they are collective):
with DDP, rank 0 writes the replicated state and every rank its own RNG states and loader
position; with FSDP2 (DTensor parameters) model and optimizer are written by all ranks
through DCP, which can load them on another number of processes. The directory must be on a
filesystem that every process sees, and belongs to one run.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import pickle
import random
import re
import secrets
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..core.engine import Step, describe
from ..core.state import TrainState

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "checkpoints",
    "latest",
    "load",
    "rng_state",
    "save",
    "set_rng_state",
]

FORMAT = "accelfn.checkpoint/1"
MARKER = "COMMITTED"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
SHARDED_DIR = "sharded"
_NAME = re.compile(r"^step-(\d+)(?:\.(\d+))?$")
_TMP_PREFIX = ".tmp-"
_LOADER_FORMAT = "accelfn.data.loader/1"
_META_KEYS = {"format", "step", "world_size", "sharded", "optimizer_sharded", "created",
              "model", "optimizer", "scheduler", "stack", "loader"}

# Test-only hook: parts named here are left out when a checkpoint is restored, to show that
# resuming without them is not exact. Set it with ``_dropping(...)``; never in real code.
_DROPPED: frozenset[str] = frozenset()
PARTS = ("optimizer", "scheduler", "step", "rng.python", "rng.numpy", "rng.torch", "rng.cuda",
         "data")  # plus "slot:<name>" for each transform slot


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run: incomplete, corrupt or mismatched."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load` restored, and the checkpoint's metadata."""

    path: Path
    step: int
    world_size: int
    sharded: bool
    created: float
    stack: str | None
    extra: Any
    restored: tuple[str, ...]


# ------------------------------------------------------------------------------ processes
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _anyone(flag: bool) -> bool:
    """Whether ``flag`` is set on any process (one all-reduce of an int; local otherwise)."""
    if _rank_world()[1] == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every process."""
    if _rank_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=_collective_device())
    return box[0]


def _agree(error: BaseException | None, what: str) -> None:
    """Raise on every process if any process failed ``what`` (its own error where it failed)."""
    if _anyone(error is not None):
        if error is not None:
            raise error
        raise CheckpointError(f"{what} failed on another process; see that process' error")


# ------------------------------------------------------------------------------ plain data
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _check_plain(obj: Any, where: str) -> None:
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
            _check_plain(value, f"{where}[{key!r}]")
        return
    if type(obj) in (list, tuple):  # not named tuples
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {type(obj).__name__}, which cannot be loaded with "
        "torch.load(weights_only=True); store tensors and plain data (numbers, strings, "
        "lists, dicts) instead"
    )


def _clone(obj: Any) -> Any:
    """A deep copy with tensors cloned (CUDA tensors copied to the host)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda and not hasattr(obj, "to_local"):
            return obj.detach().to("cpu", copy=True)
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = _clone(value)
        return out
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_clone(v) for v in obj)
    return copy.deepcopy(obj)


# ------------------------------------------------------------------------------ RNG states
def rng_state() -> dict[str, Any]:
    """Equivalent to ``random.getstate()``, ``np.random.get_state()``, ``torch.get_rng_state()``
    and ``torch.cuda.get_rng_state_all()``, as tensors and plain data (this process' RNGs)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return {
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss},
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def _rng_setters(saved: Any, parts: frozenset[str]) -> list[tuple[str, Callable[[], None]]]:
    """Validated setters for the RNG states in ``saved`` (nothing is set yet)."""
    try:
        py = saved["python"]
        internal = tuple(int(v) for v in py["state"].tolist())
        gauss = py["gauss_next"]
        python_state = (int(py["version"]), internal, None if gauss is None else float(gauss))
        if len(internal) != len(random.getstate()[1]):
            raise ValueError("Python random state has the wrong length")
        npy = saved["numpy"]
        keys = npy["keys"].numpy().astype(np.uint32)
        numpy_state = (str(npy["kind"]), keys, int(npy["pos"]), int(npy["has_gauss"]),
                       float(npy["cached_gaussian"]))
        if keys.shape != np.random.get_state(legacy=True)[1].shape:
            raise ValueError("NumPy random state has the wrong length")
        cpu = saved["torch"]
        if not isinstance(cpu, torch.Tensor) or cpu.shape != torch.get_rng_state().shape:
            raise ValueError("torch CPU RNG state has the wrong size")
        cuda = saved["cuda"]
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise CheckpointError(f"the checkpoint's RNG states are malformed ({error})") from error
    setters: list[tuple[str, Callable[[], None]]] = [
        ("rng.python", lambda: random.setstate(python_state)),
        ("rng.numpy", lambda: np.random.set_state(numpy_state)),
        ("rng.torch", lambda: torch.set_rng_state(cpu)),
    ]
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise CheckpointError(
                f"the checkpoint holds CUDA RNG states of {len(cuda)} device(s), this process "
                f"sees {torch.cuda.device_count()}; run with the same visible devices (or "
                "allow_resharding=True to resume without RNG states)"
            )
        setters.append(("rng.cuda", lambda: torch.cuda.set_rng_state_all(cuda)))
    return [(name, fn) for name, fn in setters if name not in parts]


# ------------------------------------------------------------------------------ files
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open directories (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _digest(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _digest_file(path: Path) -> dict[str, Any]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def _write_torch(path: Path, obj: Any) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    _write_bytes(path, data)
    return _digest(data)


def _write_json(path: Path, obj: Any) -> dict[str, Any]:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    _write_bytes(path, data)
    return _digest(data)


def _read_verified(root: Path, rel: str, files: Mapping[str, Any]) -> bytes:
    """The bytes of ``root/rel``, checked against the digest the commit marker recorded."""
    try:
        data = (root / rel).read_bytes()
    except OSError as error:
        raise CheckpointError(f"{root} is damaged: {rel} cannot be read ({error}); load an "
                              "earlier checkpoint") from error
    if _digest(data) != files.get(rel):
        raise CheckpointError(
            f"{root} is damaged: {rel} does not match the checksum recorded when it was "
            "saved (changed or corrupted since); load an earlier checkpoint"
        )
    return data


def _read_torch(root: Path, rel: str, files: Mapping[str, Any]) -> Any:
    data = _read_verified(root, rel, files)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"{root / rel} cannot be read safely ({type(error).__name__}: {error}); the "
            "checkpoint is corrupt or not an accelfn checkpoint"
        ) from error


def _shard_owner(rel: str, world: int) -> int:
    """Which process checks a DCP file: its writer (files ``__<rank>_<n>.distcp``), else 0."""
    match = re.match(r"^" + SHARDED_DIR + r"/__(\d+)_\d+\.distcp$", rel)
    owner = int(match.group(1)) if match else 0
    return owner if owner < world else 0


def _parse(name: str) -> tuple[int, int] | None:
    match = _NAME.match(name)
    return None if match is None else (int(match.group(1)), int(match.group(2) or 0))


def _is_committed(path: Path) -> bool:
    return (path / MARKER).is_file()


def checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Equivalent to the ``step-*`` directories with a commit marker, oldest first (by step)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        key = _parse(entry.name)
        if key is not None and entry.is_dir() and _is_committed(entry):
            found.append((key, entry))
    return [path for _, path in sorted(found)]


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint in ``directory``, or None: equivalent to
    ``checkpoints(directory)[-1]`` (directories without a commit marker are never returned)."""
    found = checkpoints(directory)
    return found[-1] if found else None


def _final_name(root: Path, step: int) -> Path:
    base = f"step-{step:09d}"
    candidate, i = root / base, 0
    while candidate.exists():
        i += 1
        candidate = root / f"{base}.{i}"
    return candidate


def _remove_checkpoint(path: Path) -> None:
    marker = path / MARKER
    if marker.exists():  # uncommit first: a crash mid-delete leaves an ignored directory
        marker.unlink()
        _fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def _rotate(root: Path, keep: int | None, newest: Path) -> None:
    """Delete checkpoints beyond the newest ``keep`` and leftovers of crashed saves."""
    for entry in root.iterdir():
        if entry == newest or not entry.is_dir():
            continue
        if entry.name.startswith(_TMP_PREFIX) or (
                _parse(entry.name) is not None and not _is_committed(entry)):
            shutil.rmtree(entry, ignore_errors=True)
    if keep is not None:
        committed = [p for p in checkpoints(root) if p != newest]
        for old in committed[: max(0, len(committed) - (keep - 1))]:
            _remove_checkpoint(old)
    _fsync_dir(root)


# ------------------------------------------------------------------------------ signatures
def _model_signature(model: nn.Module) -> dict[str, list[Any]]:
    return {name: [list(t.shape), str(t.dtype).replace("torch.", "")]
            for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}


def _stack(step: Step | None) -> dict[str, Any] | None:
    if step is None:
        return None
    if not isinstance(step, Step):
        raise TypeError(f"step= takes the accelfn Step being trained, got {type(step).__name__}")
    # Stacking order never changes the result, so it is not part of the fingerprint.
    return {"transforms": sorted(repr(t) for t in step.transforms), "describe": describe(step)}


def _is_sharded(model: nn.Module) -> bool:
    return any(hasattr(p, "to_local") and hasattr(p, "device_mesh") for p in model.parameters())


def _optimizer_signature(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"class": type(optimizer).__name__,
            "groups": [len(g["params"]) for g in optimizer.param_groups]}


# ------------------------------------------------------------------------------ DCP, safely
def _dcp_safe_globals() -> list[Any]:
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return [md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata,
            md.ChunkStorageMetadata, md.TensorProperties, md.MetadataIndex, md.StorageMeta,
            md._MEM_FORMAT_ENCODING, _StorageInfo]


def _load_dcp_metadata(data: bytes) -> Any:
    """DCP metadata through torch's weights-only unpickler (DCP itself uses ``pickle.load``)."""
    from torch import _weights_only_unpickler

    with torch.serialization.safe_globals(_dcp_safe_globals()):
        return _weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="ASCII").load()


def _rewrite_dcp_metadata(path: Path) -> None:
    """Re-pickle the metadata DCP just wrote with protocol 2 (what the safe unpickler reads)."""
    meta_path = path / ".metadata"
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)  # our own file, written a moment ago by dcp.save
    metadata.storage_meta = None  # it records the temporary directory's path
    buffer = io.BytesIO()
    pickle.dump(metadata, buffer, protocol=2)
    _load_dcp_metadata(buffer.getvalue())  # it must read back safely, or the save fails
    tmp = meta_path.with_suffix(".rewrite")
    _write_bytes(tmp, buffer.getvalue())
    os.replace(tmp, meta_path)


def _read_dcp_metadata(path: Path) -> Any:
    with open(path / ".metadata", "rb") as f:
        data = f.read()
    try:
        return _load_dcp_metadata(data)
    except Exception as error:
        raise CheckpointError(
            f"the sharded checkpoint's metadata in {path} is not plain data "
            f"({type(error).__name__}: {error}); refusing to unpickle it"
        ) from error


def _dcp_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = _read_dcp_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _dcp_planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafePlanner()


def _dcp_state(state: TrainState, with_optimizer: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if with_optimizer:
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}
    return {"model": get_model_state_dict(state.model)}


def _dcp_save(path: Path, state: TrainState, with_optimizer: bool) -> None:
    import torch.distributed.checkpoint as dcp

    group_up = dist.is_available() and dist.is_initialized()
    with _quiet_single_process():
        dcp.save(_dcp_state(state, with_optimizer),
                 storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                 no_dist=not group_up)


def _dcp_load(path: Path, state: TrainState, with_optimizer: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    target = _dcp_state(state, with_optimizer)
    group_up = dist.is_available() and dist.is_initialized()
    with _quiet_single_process():
        dcp.load(target, storage_reader=_dcp_reader(path), planner=_dcp_planner(),
                 no_dist=not group_up)
    if with_optimizer:
        set_state_dict(state.model, state.optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])
    else:
        set_model_state_dict(state.model, target["model"])


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) "
                                "in a single process.*")
        yield


# ------------------------------------------------------------------------------ save
def save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    loader: Any | None = None,
    step: Step | None = None,
    keep: int | None = None,
    extra: Any = None,
    sharded: bool | None = None,
) -> Path:
    """Equivalent to ``torch.save`` of the whole run (state, RNG states, loader position), atomic.

    That is ``torch.save({"state": state.state_dict(), "loader": loader.state_dict(),
    "rng": <every RNG's state>}, path)``, where the checkpoint appears as
    ``directory/step-<state.step>`` only once it is complete (see the module docstring); the
    path is returned.
    Saving reads no random number generator, so it does not change the run.

    Args:
        directory: the run's checkpoint folder (created if needed).
        state: the :class:`~accelfn.TrainState` to save (``state.sync()`` is applied).
        loader: anything with ``state_dict()``, e.g. an ``accelfn.data`` loader: its position,
            so that a resumed run continues with the next batch (saved per process).
        step: the :class:`~accelfn.Step` being trained: its transform stack is recorded and
            :func:`load` refuses another one.
        keep: keep only the newest ``keep`` checkpoints (older ones are deleted after this one
            is committed); None keeps all.
        extra: plain data to store along (e.g. ``{"epoch": 3, "best": 0.91}``), returned by
            :func:`load` as ``info.extra``.
        sharded: write model and optimizer with ``torch.distributed.checkpoint``; the default
            when the parameters are DTensors (FSDP2).

    Raises:
        TypeError: ``extra`` or a state entry is not tensors and plain data.
        ValueError: ``keep < 1``.
        RuntimeError: a transform refuses to be saved now (an open accumulation window).
        OSError: writing failed; nothing was committed and earlier checkpoints are intact.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"save() takes an accelfn.TrainState, got {type(state).__name__}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep={keep!r}: give the number of checkpoints to keep (>= 1) or None")
    if loader is not None and not callable(getattr(loader, "state_dict", None)):
        raise TypeError(f"loader={type(loader).__name__} has no state_dict(); pass an "
                        "accelfn.data loader or another object with state_dict()")
    rank, world = _rank_world()
    root = Path(directory)
    sharded = _is_sharded(state.model) if sharded is None else bool(sharded)

    # 1. Gather and check everything on every process before anything is written.
    error: BaseException | None = None
    tmp: Path | None = None
    try:
        stack = _stack(step)
        full = state.state_dict()
        optimizer_in_dcp = sharded and bool(state.optimizer.state)
        saved_state = dict(full)
        if sharded:
            saved_state["model"] = None
            if optimizer_in_dcp:
                saved_state["optimizer"] = None
        payload = {"format": FORMAT, "state": saved_state, "extra": extra}
        per_rank = {"format": FORMAT, "rank": rank, "world_size": world, "rng": rng_state(),
                    "loader": None if loader is None else loader.state_dict()}
        _check_plain(extra, "extra")
        if rank == 0:
            _check_plain(saved_state, "the training state")
        _check_plain(per_rank["loader"], "the loader state")
        meta = {
            "format": FORMAT,
            "step": state.step,
            "world_size": world,
            "sharded": sharded,
            "optimizer_sharded": optimizer_in_dcp,
            "created": time.time(),
            "torch": torch.__version__,
            "model": _model_signature(state.model),
            "optimizer": _optimizer_signature(state.optimizer),
            "scheduler": None if state.scheduler is None else type(state.scheduler).__name__,
            "stack": stack,
            "loader": loader is not None,
        }
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f"{_TMP_PREFIX}step-{state.step:09d}-{secrets.token_hex(4)}"
            tmp.mkdir()
    except BaseException as exc:  # every process must hear of it
        error = exc
    try:
        _agree(error, "preparing the checkpoint")
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp = Path(_from_rank0(str(tmp)))

    # 2. Write into the hidden temporary directory (every process its own files).
    digests: dict[str, Any] = {}
    try:
        if rank == 0:
            digests[STATE_FILE] = _write_torch(tmp / STATE_FILE, payload)
        digests[f"rank-{rank:05d}.pt"] = _write_torch(tmp / f"rank-{rank:05d}.pt", per_rank)
    except BaseException as exc:
        error = exc
    if sharded and not _anyone(error is not None):
        try:  # collective: every process writes its shards, then checksums them
            _dcp_save(tmp / SHARDED_DIR, state, optimizer_in_dcp)
            for file in sorted((tmp / SHARDED_DIR).iterdir()):
                rel = f"{SHARDED_DIR}/{file.name}"
                if file.name != ".metadata" and _shard_owner(rel, world) == rank:
                    digests[rel] = _digest_file(file)
        except BaseException as exc:
            error = exc
    try:
        _agree(error, "writing the checkpoint")
        if world > 1:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, digests)
            digests = {k: v for part in gathered for k, v in part.items()}
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    # 3. Commit: rename the complete directory, then write the marker (rank 0).
    final: Path | None = None
    if rank == 0:
        try:
            final = _commit(root, tmp, state.step, meta, sharded, digests)
        except BaseException as exc:
            error = exc
            shutil.rmtree(tmp, ignore_errors=True)
    _agree(error, "committing the checkpoint")
    final = Path(_from_rank0(str(final)))

    # 4. Only now: delete what is beyond `keep`, and leftovers of crashed saves.
    if rank == 0:
        try:
            _rotate(root, keep, final)
        except OSError as exc:  # the new checkpoint is committed; do not fail the save
            import warnings

            warnings.warn(f"checkpoint rotation in {root} failed: {exc}", stacklevel=2)
    if world > 1:
        dist.barrier()  # nobody returns (and reads the directory) before rotation is done
    return final


def _commit(root: Path, tmp: Path, step: int, meta: dict[str, Any], sharded: bool,
            digests: dict[str, Any]) -> Path:
    files = dict(digests)
    if sharded:
        _rewrite_dcp_metadata(tmp / SHARDED_DIR)
        for file in (tmp / SHARDED_DIR).iterdir():
            rel = f"{SHARDED_DIR}/{file.name}"
            if rel not in files:
                files[rel] = _digest_file(file)
    files[META_FILE] = _write_json(tmp / META_FILE, meta)
    _fsync_dir(tmp)
    final = _final_name(root, step)
    os.replace(tmp, final)
    _fsync_dir(root)
    try:
        marker_tmp = final / (MARKER + ".tmp")
        _write_json(marker_tmp, {"format": FORMAT, "step": step, "files": files})
        os.replace(marker_tmp, final / MARKER)
        _fsync_dir(final)
    except BaseException:
        _remove_checkpoint(final)  # never committed: nobody may take it for a checkpoint
        raise
    return final


# ------------------------------------------------------------------------------ load
def _resolve(path: Path) -> Path:
    if _is_committed(path):
        return path
    if _parse(path.name) is not None and path.is_dir():
        raise CheckpointError(
            f"{path} has no {MARKER} marker: its save did not complete (the process died "
            f"while writing it); load the previous one, e.g. latest({str(path.parent)!r})"
        )
    found = latest(path)
    if found is None:
        raise FileNotFoundError(
            f"no complete checkpoint in {path}; check the path (start from scratch when "
            "latest(directory) is None)"
        )
    return found


def _check_files(path: Path) -> dict[str, Any]:
    """The commit marker, after checking that every file it lists is there, full size."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"the commit marker of {path} is unreadable ({error})") from error
    if not isinstance(marker, dict) or marker.get("format") != FORMAT \
            or not isinstance(marker.get("files"), dict):
        raise CheckpointError(f"{path} is not an {FORMAT} checkpoint")
    for rel, digest in marker["files"].items():
        file = path / rel
        if not file.is_file():
            raise CheckpointError(f"{path} is damaged: {rel} is missing; load an earlier "
                                  "checkpoint")
        size = digest.get("size") if isinstance(digest, dict) else None
        if file.stat().st_size != size:
            raise CheckpointError(
                f"{path} is damaged: {rel} has {file.stat().st_size} bytes, {size} were "
                "written; load an earlier checkpoint"
            )
    return marker


def _verify_shards(path: Path, files: Mapping[str, Any], rank: int, world: int,
                   saved_world: int) -> None:
    """Checksum the DCP files this process wrote (all of them on rank 0 after resharding)."""
    for rel in sorted(files):
        if not rel.startswith(SHARDED_DIR + "/") or rel == f"{SHARDED_DIR}/.metadata":
            continue
        owner = _shard_owner(rel, world) if world == saved_world else 0
        if owner == rank and _digest_file(path / rel) != files[rel]:
            raise CheckpointError(
                f"{path} is damaged: {rel} does not match the checksum recorded when it was "
                "saved (changed or corrupted since); load an earlier checkpoint"
            )


def _compare_models(saved: dict[str, list[Any]], here: dict[str, list[Any]]) -> None:
    missing = [k for k in saved if k not in here]
    unexpected = [k for k in here if k not in saved]
    shapes = [f"{k} saved {saved[k][0]} {saved[k][1]}, here {here[k][0]} {here[k][1]}"
              for k in saved if k in here and saved[k] != here[k]]
    if not (missing or unexpected or shapes):
        return
    parts = []
    for label, items in (("in the checkpoint but not in this model", missing),
                         ("in this model but not in the checkpoint", unexpected),
                         ("with another shape or dtype", shapes)):
        if items:
            more = f" (+{len(items) - 4} more)" if len(items) > 4 else ""
            parts.append(f"{len(items)} {label}: {', '.join(items[:4])}{more}")
    raise CheckpointError(
        "the checkpoint comes from a different model: " + "; ".join(parts)
        + ". Build the model exactly as the checkpointed run did (same architecture, sizes "
        "and dtype) before loading"
    )


def _compare_stacks(saved: dict[str, Any] | None, here: dict[str, Any] | None) -> None:
    if saved is None or here is None or saved["transforms"] == here["transforms"]:
        return
    added = sorted(set(here["transforms"]) - set(saved["transforms"]))
    removed = sorted(set(saved["transforms"]) - set(here["transforms"]))
    raise CheckpointError(
        f"the checkpoint was saved by the step {saved['describe']!r}, this step is "
        f"{here['describe']!r} (added: {', '.join(added) or 'none'}; removed: "
        f"{', '.join(removed) or 'none'}): transform state (loss scaler, counters, averages) "
        "would not match. Build the step the checkpointed run used, or pass step=None to "
        "load without this check"
    )


def _check_optimizer(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), dict):
        raise CheckpointError("the checkpoint's optimizer state is malformed")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    if len(ids) != len(params):
        raise CheckpointError(f"the checkpoint's optimizer holds {len(ids)} parameters, this "
                              f"one {len(params)}; build it over the same parameters")
    where = {pid: n for n, pid in enumerate(ids)}
    for pid, entry in saved["state"].items():
        if pid not in where:
            raise CheckpointError(f"the checkpoint's optimizer state names parameter {pid}, "
                                  "which is in none of its groups: the checkpoint is damaged")
        shape = tuple(params[where[pid]].shape)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shape:
                raise CheckpointError(
                    f"optimizer state {key!r} of parameter {where[pid]} has shape "
                    f"{tuple(value.shape)}, the parameter {shape}; build the optimizer over the "
                    "model's parameters in the order the checkpointed run used"
                )


def _check_slots(saved: Any, state: TrainState) -> None:
    if not isinstance(saved, Mapping):
        raise CheckpointError("the checkpoint's transform slots are malformed")
    live = state.slots
    for name, value in saved.items():
        obj = live.get(name)
        if not isinstance(obj, dict):
            continue  # objects with load_state_dict check themselves; rolled back on failure
        if not isinstance(value, Mapping) or set(value) != set(obj):
            keys = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise CheckpointError(
                f"the checkpoint's state of transform slot {name!r} has keys {keys}, this step "
                f"expects {sorted(obj)}: the checkpoint comes from a different transform stack"
            )
        for key, current in obj.items():
            if isinstance(current, torch.Tensor) and (
                    not isinstance(value[key], torch.Tensor) or value[key].shape != current.shape):
                raise CheckpointError(f"slot {name!r} entry {key!r} has another shape than this "
                                      "step's: the checkpoint comes from a different transform "
                                      "stack")


def _check_loader(saved: Any, loader: Any) -> None:
    config = getattr(loader, "config", None)
    if not (isinstance(saved, Mapping) and saved.get("format") == _LOADER_FORMAT
            and isinstance(config, dict)):
        return  # another kind of loader: its load_state_dict checks (rolled back on failure)
    theirs = dict(saved.get("config", {}))
    if theirs != config:
        diff = ", ".join(f"{k}: saved {theirs.get(k)!r}, here {config.get(k)!r}"
                         for k in sorted(set(theirs) | set(config))
                         if theirs.get(k) != config.get(k))
        raise CheckpointError(
            f"the loader position was saved by a loader with another configuration ({diff}); "
            "build the loader with the same settings to resume"
        )


@dataclass
class _Checked:
    meta: dict[str, Any]
    payload: dict[str, Any]
    rank_state: dict[str, Any] | None
    rng_setters: list[tuple[str, Callable[[], None]]]


def _read_and_check(path: Path, state: TrainState, loader: Any, step: Step | None,
                    allow_resharding: bool, rank: int, world: int,
                    dropped: frozenset[str]) -> _Checked:
    marker = _check_files(path)
    files = marker["files"]
    try:
        meta = json.loads(_read_verified(path, META_FILE, files))
    except ValueError as error:
        raise CheckpointError(f"{path / META_FILE} is unreadable ({error})") from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT \
            or meta.get("step") != marker.get("step") or not _META_KEYS <= set(meta):
        raise CheckpointError(f"{path} has inconsistent metadata; load an earlier checkpoint")
    _compare_models(meta["model"], _model_signature(state.model))
    _compare_stacks(meta["stack"], _stack(step))
    saved_opt, here_opt = meta["optimizer"], _optimizer_signature(state.optimizer)
    if saved_opt != here_opt:
        raise CheckpointError(
            f"the checkpoint's optimizer is {saved_opt['class']} with parameter groups of "
            f"sizes {saved_opt['groups']}, this one is {here_opt['class']} with "
            f"{here_opt['groups']}; build the optimizer (and its parameter groups) as the "
            "checkpointed run did"
        )
    here_sched = None if state.scheduler is None else type(state.scheduler).__name__
    if meta["scheduler"] != here_sched:
        raise CheckpointError(
            f"the checkpoint's scheduler is {meta['scheduler']}, this state's is {here_sched}; "
            "build the state with the scheduler the checkpointed run used"
        )
    if not meta["sharded"] and _is_sharded(state.model):
        raise CheckpointError(
            f"{path} holds an unsharded model but this model's parameters are sharded "
            "(FSDP2); write the checkpoint with save(..., sharded=True) to load it under FSDP"
        )
    same_world = int(meta["world_size"]) == world
    if not same_world and not allow_resharding:
        raise CheckpointError(
            f"the checkpoint was written by {meta['world_size']} process(es), this run has "
            f"{world}: RNG states and loader positions belong to processes and cannot carry "
            "over. Resume with the same number of processes for an exact resume, or pass "
            "allow_resharding=True (and loader=None) to restore everything else"
        )
    if loader is not None:
        if not same_world:
            raise CheckpointError(
                f"the loader positions of {meta['world_size']} process(es) cannot be mapped "
                f"onto {world}; pass loader=None with allow_resharding=True and start the "
                "loader at a new epoch"
            )
        if not meta["loader"]:
            raise CheckpointError(f"{path} was saved without a loader position; pass "
                                  "loader=None, or save with loader= next time")
        if not callable(getattr(loader, "load_state_dict", None)):
            raise TypeError(f"loader={type(loader).__name__} has no load_state_dict()")
    if meta["sharded"]:  # read before anything changes; DCP reads it again while loading
        _read_verified(path, f"{SHARDED_DIR}/.metadata", files)
        _read_dcp_metadata(path / SHARDED_DIR)
        _verify_shards(path, files, rank, world, int(meta["world_size"]))
    payload = _read_torch(path, STATE_FILE, files)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT \
            or not isinstance(payload.get("state"), dict):
        raise CheckpointError(f"{path / STATE_FILE} is not an accelfn checkpoint state")
    saved_state = payload["state"]
    if not {"model", "optimizer", "scheduler", "step", "slots"} <= set(saved_state):
        raise CheckpointError(f"{path / STATE_FILE} lacks parts of the training state")
    if not meta["optimizer_sharded"] and "optimizer" not in dropped:
        _check_optimizer(saved_state.get("optimizer"), state.optimizer)
    _check_slots(saved_state.get("slots"), state)
    rank_state = None
    setters: list[tuple[str, Callable[[], None]]] = []
    if same_world:
        rank_state = _read_torch(path, f"rank-{rank:05d}.pt", files)
        if not isinstance(rank_state, dict) or rank_state.get("format") != FORMAT \
                or rank_state.get("rank") != rank:
            raise CheckpointError(f"{path}/rank-{rank:05d}.pt is not this process' state")
        setters = _rng_setters(rank_state["rng"], dropped)
        if loader is not None:
            _check_loader(rank_state["loader"], loader)
    return _Checked(meta, payload, rank_state, setters)


def load(
    path: str | os.PathLike[str],
    state: TrainState,
    *,
    loader: Any | None = None,
    step: Step | None = None,
    allow_resharding: bool = False,
) -> CheckpointInfo:
    """Equivalent to ``state.load_state_dict``, ``loader.load_state_dict`` and setting every RNG.

    It restores a checkpoint written by :func:`save` whole or not at all. Everything is
    checked before anything changes: the files against the commit marker (sizes and
    SHA-256), the model's parameter names, shapes and dtypes, the optimizer and its
    parameters, the scheduler, the transform stack (when ``step`` is given) and the loader's
    configuration. Should restoring still fail part-way, what was restored is rolled back
    (``load`` keeps a host copy of the state meanwhile) and the error is raised.

    Args:
        path: a checkpoint directory, or a run's folder (then its newest committed one).
        state: the :class:`~accelfn.TrainState` to restore into, built like the saved one.
        loader: the loader whose position was saved.
        step: the step being trained: its transform stack must be the saved one, and it
            prepares ``state`` first (e.g. FSDP2 shards the model before shards are loaded).
        allow_resharding: load a checkpoint written by another number of processes:
            model, optimizer, scheduler and transform state are restored (sharded ones are
            resharded by DCP), RNG states and loader positions are not (they belonged to
            processes that no longer exist); ``loader`` must be None.

    Returns:
        :class:`CheckpointInfo` with the step, ``extra`` and the names of the parts restored.

    Raises:
        FileNotFoundError: no committed checkpoint at ``path``.
        CheckpointError: (a ValueError) an incomplete, damaged or mismatched checkpoint, with
            what differs and how to fix it; ``state`` and ``loader`` are as they were.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"load() takes an accelfn.TrainState, got {type(state).__name__}")
    rank, world = _rank_world()
    error: BaseException | None = None
    resolved: Path | None = None
    if rank == 0:
        try:
            resolved = _resolve(Path(path))
        except BaseException as exc:  # every process must hear of it
            error = exc
    _agree(error, "finding the checkpoint")
    resolved = Path(_from_rank0(str(resolved)))
    dropped = _DROPPED
    checked: _Checked | None = None
    try:
        if step is not None:
            _stack(step)
            step.prepare(state)  # what the first call would do (collective under torchrun)
        checked = _read_and_check(resolved, state, loader, step, allow_resharding, rank, world,
                                  dropped)
    except BaseException as exc:
        error = exc
    _agree(error, "checking the checkpoint")
    assert checked is not None
    meta = checked.meta

    snapshot = _clone(state.state_dict())
    rng_before = rng_state()
    restored: list[str] = []
    try:
        restored += _restore_state(resolved, state, meta, checked.payload["state"], dropped)
        if checked.rank_state is not None:
            for name, setter in checked.rng_setters:
                setter()
                restored.append(name)
    except BaseException as exc:
        error = exc
    failed = _anyone(error is not None)
    if not failed and loader is not None and "data" not in dropped:
        assert checked.rank_state is not None
        try:  # last, and checked above: a BatchLoader refuses before it changes anything
            loader.load_state_dict(checked.rank_state["loader"])
            restored.append("data")
        except BaseException as exc:
            error = exc
        failed = _anyone(error is not None)
    if failed:
        _rollback(state, snapshot, rng_before)
        cause = error if error is not None else CheckpointError("failed on another process")
        if not isinstance(cause, Exception):  # KeyboardInterrupt, SystemExit: as they are
            raise cause
        raise CheckpointError(
            f"restoring {resolved} failed ({type(cause).__name__}: {cause}); nothing was "
            "restored (the state and RNGs were rolled back). Build the state, step and loader "
            "as the checkpointed run did"
        ) from cause
    return CheckpointInfo(
        path=resolved, step=int(meta["step"]), world_size=int(meta["world_size"]),
        sharded=bool(meta["sharded"]), created=float(meta["created"]),
        stack=None if meta["stack"] is None else meta["stack"]["describe"],
        extra=checked.payload.get("extra"), restored=tuple(restored))


def _restore_state(path: Path, state: TrainState, meta: dict[str, Any],
                   saved: dict[str, Any], dropped: frozenset[str]) -> list[str]:
    saved = dict(saved)
    if meta["sharded"]:
        with_optimizer = meta["optimizer_sharded"] and "optimizer" not in dropped
        _dcp_load(path / SHARDED_DIR, state, with_optimizer)
        saved["model"] = state.model.state_dict()  # already restored: load it onto itself
        if with_optimizer:
            saved["optimizer"] = state.optimizer.state_dict()
    if "optimizer" in dropped:
        saved["optimizer"] = state.optimizer.state_dict()
    if "scheduler" in dropped and state.scheduler is not None:
        saved["scheduler"] = state.scheduler.state_dict()
    if "step" in dropped:
        saved["step"] = state.step
    saved["slots"] = {k: v for k, v in saved["slots"].items() if f"slot:{k}" not in dropped}
    state.load_state_dict(saved)
    parts = ["model", "optimizer", "scheduler", "step", *(f"slot:{k}" for k in saved["slots"])]
    return [p for p in parts if p not in dropped]


def _rollback(state: TrainState, snapshot: dict[str, Any], rng: dict[str, Any]) -> None:
    """Put back what a failed :func:`load` changed (the original error is raised after)."""
    pending = getattr(state, "_pending", None)
    with contextlib.suppress(Exception):
        state.load_state_dict(snapshot)
    if isinstance(pending, dict):  # slots the failed load left waiting for their transform
        for name in [k for k in pending if k not in snapshot["slots"]]:
            del pending[name]
    with contextlib.suppress(Exception):
        set_rng_state(rng)


def set_rng_state(saved: dict[str, Any]) -> None:
    """Set every RNG from :func:`rng_state`'s result: equivalent to ``random.setstate``,
    ``np.random.set_state``, ``torch.set_rng_state`` and ``torch.cuda.set_rng_state_all``."""
    for _, setter in _rng_setters(saved, frozenset()):
        setter()


@contextlib.contextmanager
def _dropping(*parts: str) -> Iterator[None]:
    """Test-only: leave ``parts`` (see ``PARTS``, or ``"slot:<name>"``) out of restores."""
    global _DROPPED
    before = _DROPPED
    _DROPPED = frozenset(parts)
    try:
        yield
    finally:
        _DROPPED = before
