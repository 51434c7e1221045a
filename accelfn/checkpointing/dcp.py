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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..core import compat
from ..core.state import TrainState
from .files import digest_file, write_bytes
from .format import SHARDED_DIR, CheckpointError, is_checkpoint_file

__all__ = ["check_metadata", "load_sharded", "parse_metadata", "rewrite_metadata", "save_sharded",
           "shard_owner", "sharded_state", "start_sharded", "verify_shards", "wait_sharded"]

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


def _state(state: TrainState, with_optimizer: bool,
           slots: dict[str, Tensor]) -> dict[str, Any]:
    """DCP's state dicts of the model (and optimizer), and the transform slots' sharded
    tensors by their path (``slots``: those [`split_refs`][] took out of state.pt)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if with_optimizer:
        model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
        out: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    else:
        out = {"model": get_model_state_dict(state.model)}
    if slots:
        out["slots"] = slots
    return out


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


def save_sharded(path: Path, state: TrainState, with_optimizer: bool,
                 slots: dict[str, Tensor]) -> None:
    """``dcp.save`` of the model (and optimizer, and the slots' sharded tensors) into the
    directory ``path`` (collective)."""
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    try:
        with _quiet_single_process():
            state_dict_saver.save(_state(state, with_optimizer, slots),
                                  storage_writer=FileSystemWriter(path, sync_files=True),
                                  no_dist=not _group_up())
    except CheckpointException as error:  # a BaseException: never let it escape as one
        raise _write_error(error, path) from error


def sharded_state(state: TrainState, with_optimizer: bool,
                  slots: dict[str, Tensor]) -> dict[str, Any]:
    """What [`save_sharded`][] writes: DCP's state dicts of the model (and optimizer), and
    the slots' sharded tensors."""
    return _state(state, with_optimizer, slots)


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


def load_sharded(path: Path, state: TrainState, with_optimizer: bool, metadata: Any,
                 slots: dict[str, Tensor]) -> None:
    """``dcp.load`` into the model (and optimizer, and the tensors ``slots``: the slots'
    sharded tensors by path) from the directory ``path`` (collective), with the ``metadata``
    read and checked before."""
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    target = _state(state, with_optimizer, slots)
    try:
        with _quiet_single_process():
            state_dict_loader.load(target, storage_reader=_reader(path, metadata),
                                   planner=_planner(), no_dist=not _group_up())
    except CheckpointException as error:  # a BaseException: never let it escape as one
        raise CheckpointError(f"torch.distributed.checkpoint could not load {path} "
                              f"({_failures(error)})") from error
    if with_optimizer:
        set_state_dict(state.model, state.optimizer, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])
    else:
        set_model_state_dict(state.model, target["model"])


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
