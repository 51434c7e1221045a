"""Sharded model and optimizer state through ``torch.distributed.checkpoint`` (DCP), safely.

FSDP2 parameters are DTensors: every process writes its own shards with ``dcp.save`` and DCP
can load them on another number of processes. DCP reads its metadata with ``pickle.load``;
here it is read with torch's weights-only unpickler instead (and rewritten at save time with
a protocol that unpickler reads), so loading never runs pickled code.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import compat
from ..core.state import TrainState
from .files import digest_file, write_bytes
from .format import ONE, SHARDED_DIR, CheckpointError, is_checkpoint_file

__all__ = ["Part", "check_metadata", "initialise", "load_sharded", "parse_metadata",
           "rewrite_metadata", "save_sharded", "shard_owner", "sharded_state", "start_sharded",
           "verify_shards", "wait_sharded"]

_ITEM_OVERHEAD = 1 << 20  # torch.save's zip records around a chunk's bytes (about 2 KB)


# ------------------------------------------------------------------------------ metadata
def _safe_globals() -> list[Any]:
    from torch.distributed.checkpoint import metadata as md

    return [md.Metadata, md.TensorStorageMetadata, md.BytesStorageMetadata,
            md.ChunkStorageMetadata, md.TensorProperties, md.MetadataIndex, md.StorageMeta,
            *compat.dcp_private_metadata_classes()]


def _load_metadata(data: bytes) -> Any:
    """DCP metadata through torch's weights-only unpickler (DCP itself uses ``pickle.load``)."""
    with torch.serialization.safe_globals(_safe_globals()):
        return compat.weights_only_unpickle(data)


def rewrite_metadata(path: Path) -> None:
    """Re-pickle the metadata DCP just wrote with protocol 2 (what the safe unpickler reads)."""
    meta_path = path / ".metadata"
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)  # our own file, written a moment ago by dcp.save
    metadata.storage_meta = None  # it records the temporary directory's path
    buffer = io.BytesIO()
    pickle.dump(metadata, buffer, protocol=2)
    _load_metadata(buffer.getvalue())  # it must read back safely, or the save fails
    tmp = meta_path.with_suffix(".rewrite")
    write_bytes(tmp, buffer.getvalue())
    os.replace(tmp, meta_path)


def parse_metadata(data: bytes, where: Path) -> Any:
    """The DCP metadata in ``data`` (the verified bytes of ``where``), read safely."""
    try:
        return _load_metadata(data)
    except Exception as error:
        raise CheckpointError(
            f"the sharded checkpoint's metadata {where} is not plain data "
            f"({type(error).__name__}: {error}); refusing to unpickle it"
        ) from error


def check_metadata(metadata: Any, listed: Mapping[str, Any], where: Path,
                   memory: int | None) -> None:
    """Every storage path in the DCP metadata names one of the checkpoint's own shard files
    (listed, checksummed, in sharded/), every item lies inside its file, every file is
    exactly what its items fill, and no item is larger than its tensor (or than memory)."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{where} is not DCP metadata")
    ends: dict[str, int] = {}
    for index, rel_path, offset, length in compat.dcp_storage_entries(metadata):
        rel = f"{SHARDED_DIR}/{rel_path}"
        if not isinstance(rel_path, str) or not is_checkpoint_file(rel) or rel not in listed \
                or rel == f"{SHARDED_DIR}/.metadata":
            raise CheckpointError(
                f"{where} names the storage path {rel_path!r} for {index.fqn}, which is not one "
                "of this checkpoint's shard files: DCP would read a file outside the checkpoint "
                "that no checksum covers; it is forged or damaged"
            )
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0
                and length >= 0 and offset + length <= listed[rel]["size"]):
            raise CheckpointError(f"{where}: the item {index.fqn} lies outside its storage path "
                                  f"{rel_path!r}; it is forged or damaged")
        entry = metadata.state_dict_metadata.get(index.fqn)
        if isinstance(entry, TensorStorageMetadata):
            chunk = next((c for c in entry.chunks if c.offsets == index.offset), None)
            itemsize = torch.empty((), dtype=entry.properties.dtype).element_size()
            bound = None if chunk is None else chunk.sizes.numel() * itemsize + _ITEM_OVERHEAD
        else:
            bound = memory
        if bound is not None and length > bound:
            raise CheckpointError(f"{where}: the item {index.fqn} has {length} bytes, more "
                                  f"than it can hold ({bound}); it is forged or damaged")
        ends[rel] = max(ends.get(rel, 0), offset + length)
    for rel, entry in listed.items():
        if rel.startswith(SHARDED_DIR + "/") and rel != f"{SHARDED_DIR}/.metadata" \
                and entry["size"] != ends.get(rel, 0):
            raise CheckpointError(
                f"{where}: {rel} has {entry['size']} bytes, its items fill {ends.get(rel, 0)}; "
                "it is forged or damaged"
            )


def _reader(path: Path, verified: Any) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            metadata: Metadata = verified  # what load() read, checked, before anything changed
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            assert metadata.storage_meta is not None
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _planner() -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                compat.set_nested_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafePlanner()


# ------------------------------------------------------------------------------ save, load
def _first_failure(error: Any) -> BaseException | None:
    for failure in error.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        return exc if isinstance(exc, BaseException) else None
    return None


def _failures(error: Any) -> str:
    """``rank r: Type: message`` for each process DCP reports a failure of."""
    parts = []
    for rank, failure in sorted(error.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    return "; ".join(parts) or str(error)


@dataclass
class Part:
    """One state's share of a sharded checkpoint: the state, per optimizer whether DCP holds
    its state (one without any state is in state.pt), and the slots' sharded tensors by
    path (those [`split_refs`][] took out of state.pt)."""

    state: TrainState
    held: tuple[bool, ...]
    slots: dict[str, Tensor]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose state DCP holds."""
        return [o for o, held in zip(self.state.optimizers, self.held) if held]


@torch.no_grad()
def initialise(optimizers: list[torch.optim.Optimizer]) -> None:
    """Give each optimizer that has no state yet its state, before DCP loads a checkpoint's
    into it: a step over zero gradients at a zero learning rate, as DCP's own
    ``_init_optim_state`` takes, but called as ``step()`` (DCP calls ``step(closure=None)``,
    which an optimizer whose ``step()`` takes no closure refuses) and whatever gradients the
    parameters hold (DCP skips an optimizer then, and loads none of its state); the
    gradients and learning rates are put back after."""
    for index, optimizer in enumerate(optimizers):
        if optimizer.state:
            continue
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        rates = [group.get("lr") for group in optimizer.param_groups]
        try:
            for p in params:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            for group in optimizer.param_groups:
                if "lr" in group:
                    group["lr"] = (torch.tensor(0.0) if isinstance(group["lr"], Tensor)
                                   else 0.0)
            optimizer.step()
        finally:
            for group, rate in zip(optimizer.param_groups, rates):
                if "lr" in group:
                    group["lr"] = rate
            for p, grad in zip(params, grads):
                p.grad = grad
        if not optimizer.state:
            raise CheckpointError(
                f"the checkpoint holds the state of a {type(optimizer).__name__} (optimizer "
                f"{index} of those it sharded), but this one makes no state in a step, so "
                "torch.distributed.checkpoint has nothing to load it into; build the "
                "optimizer as the checkpointed run did")


def _state(parts: dict[str, Part]) -> dict[str, Any]:
    """DCP's state dicts of each state's model (and the optimizers it holds), and the slots'
    sharded tensors: ``{"model", "optimizer", "slots"}`` for one state, under each state's
    name for several."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    tree: dict[str, Any] = {}
    for name, part in parts.items():
        held = part.optimizers
        if held:  # each with state: DCP initialises none (see initialise)
            model_sd, optim_sd = get_state_dict(part.state.model, held)
            out: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        else:
            out = {"model": get_model_state_dict(part.state.model)}
        if part.slots:
            out["slots"] = part.slots
        tree[name] = out
    return tree[ONE] if ONE in tree else tree


_SINGLE_SAVE = ".*assuming the intent is to save in a single process.*"


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) "
                                "in a single process.*")
        yield


def _group_up() -> bool:
    return dist.is_available() and dist.is_initialized()  # type: ignore[no-untyped-call]


def _write_error(error: BaseException, path: Path) -> OSError:
    """DCP's ``CheckpointException`` (a BaseException) as the OSError ``save()`` raises."""
    first = _first_failure(error)
    code = first.errno if isinstance(first, OSError) else None
    return OSError(code, f"writing the sharded checkpoint into {path} failed "
                         f"({_failures(error)})")


def save_sharded(path: Path, parts: dict[str, Part]) -> None:
    """``dcp.save`` of each state's model (and optimizers, and the slots' sharded tensors)
    into the directory ``path`` (collective)."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    try:
        with _quiet_single_process():
            state_dict_saver.save(_state(parts),
                                  storage_writer=FileSystemWriter(path, sync_files=True),
                                  no_dist=not _group_up())
    except CheckpointException as error:  # a BaseException: never let it escape as one
        raise _write_error(error, path) from error


def sharded_state(parts: dict[str, Part]) -> dict[str, Any]:
    """What [`save_sharded`][] writes: DCP's state dicts of each state's model (and
    optimizers), and the slots' sharded tensors."""
    return _state(parts)


class _Staged:
    """An ``AsyncStager`` for a state dict that is already a staged host copy (nothing to do)."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def start_sharded(path: Path, staged: dict[str, Any], group: Any) -> Future[Any]:
    """``dcp.async_save`` of ``staged`` (a host copy from [`sharded_state`][]) into ``path``:
    DCP plans and writes in its own thread (collective over ``group``); the Future is done
    when every shard is written (fsynced) and the metadata too."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    if not _group_up():  # DCP's save warns of it from its own thread, where no
        warnings.filterwarnings("ignore", message=_SINGLE_SAVE)  # catch_warnings reaches
    future = state_dict_saver.async_save(
        staged, storage_writer=FileSystemWriter(path, sync_files=True), async_stager=_Staged(),
        process_group=group, no_dist=not _group_up())
    if not isinstance(future, Future):  # an AsyncSaveResponse (only with a staging Future)
        future = future.upload_completion
    return future


def wait_sharded(future: Future[Any], path: Path) -> None:
    """Wait for [`start_sharded`][]'s write; raise OSError if it failed."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        future.result()
    except CheckpointException as error:  # a BaseException: never let it escape as one
        raise _write_error(error, path) from error


def load_sharded(path: Path, parts: dict[str, Part], metadata: Any) -> None:
    """``dcp.load`` into each state's model (and the optimizers DCP holds, and the tensors of
    its ``slots``: the slots' sharded tensors by path) from the directory ``path``
    (collective), with the ``metadata`` read and checked before."""
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    for part in parts.values():
        initialise(part.optimizers)
    target = _state(parts)
    try:
        with _quiet_single_process():
            state_dict_loader.load(target, storage_reader=_reader(path, metadata),
                                   planner=_planner(), no_dist=not _group_up())
    except CheckpointException as error:  # a BaseException: never let it escape as one
        raise CheckpointError(f"torch.distributed.checkpoint could not load {path} "
                              f"({_failures(error)})") from error
    for name, part in parts.items():
        loaded = target if name == ONE else target[name]
        held = part.optimizers
        if held:
            set_state_dict(part.state.model, held, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optimizer"])
        else:
            set_model_state_dict(part.state.model, loaded["model"])


# ------------------------------------------------------------------------------ digests
def shard_owner(rel: str, world: int) -> int:
    """Which process checks a DCP file: its writer (files ``__<rank>_<n>.distcp``), else 0."""
    match = re.match(r"^" + SHARDED_DIR + r"/__(\d+)_\d+\.distcp$", rel)
    owner = int(match.group(1)) if match else 0
    return owner if owner < world else 0


def verify_shards(path: Path, files: Mapping[str, Any], rank: int, world: int,
                  saved_world: int) -> None:
    """Checksum the DCP files this process wrote (all of them on rank 0 after resharding)."""
    for rel in sorted(files):
        if not rel.startswith(SHARDED_DIR + "/") or rel == f"{SHARDED_DIR}/.metadata":
            continue
        owner = shard_owner(rel, world) if world == saved_world else 0
        if owner == rank and digest_file(path / rel) != files[rel]:
            raise CheckpointError(
                f"{path} is damaged: {rel} does not match the checksum recorded when it was "
                "saved (changed or corrupted since); load an earlier checkpoint"
            )
