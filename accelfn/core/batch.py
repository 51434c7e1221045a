"""Batches: validation, size and splitting of TensorDict or mapping batches."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal, overload

import torch
from tensordict import TensorDict, TensorDictBase

from . import compat

Batch = Any  # a TensorDict, or a mapping of names to tensors sharing their first dimension

__all__ = ["Batch", "batch_size", "check_batch", "split_batch", "split_checked"]


def check_batch(batch: Any) -> None:
    """Raise a clear error unless ``batch`` is a non-empty TensorDict or mapping of tensors."""
    if type(batch) is TensorDict or isinstance(batch, TensorDictBase):
        shape = batch.batch_size
        if not shape:
            raise ValueError(
                "the batch TensorDict has no batch dimension (batch_size=[]); build it with "
                "batch_size=[n] so accelfn knows how many samples it holds"
            )
        if shape[0] == 0:
            raise ValueError("the batch is empty (batch_size[0] == 0); skip empty batches")
        if batch.device is not None:  # a TensorDict with a device holds nothing elsewhere
            return
        devices = {value.device for value in batch.values()}
        if len(devices) == 1 and None not in devices:
            return
        # nested entries (or non-tensor data) without a device of their own: every leaf
        devices = {t.device for t in batch.values(include_nested=True, leaves_only=True)}
    elif isinstance(batch, Mapping):
        if not batch:
            raise ValueError("the batch is an empty mapping; it must hold at least one tensor")
        sizes = {}
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"batch[{key!r}] is a {type(value).__name__}, not a tensor; put only tensors "
                    "in a batch (or use a TensorDict, which can hold non-tensor data)"
                )
            if value.dim() == 0:
                raise ValueError(
                    f"batch[{key!r}] is a 0-d tensor; every batch entry needs a leading "
                    "sample dimension"
                )
            sizes[key] = value.shape[0]
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"batch entries disagree on the number of samples: {sizes}; every tensor's "
                "first dimension must be the batch size"
            )
        if next(iter(sizes.values())) == 0:
            raise ValueError("the batch is empty (0 samples); skip empty batches")
        devices = {t.device for t in batch.values()}
    else:
        raise TypeError(
            f"a batch must be a TensorDict or a mapping of tensors, got {type(batch).__name__}; "
            "wrap it, e.g. TensorDict({'x': x, 'y': y}, batch_size=[len(x)])"
        )
    if len(devices) > 1:
        raise ValueError(
            f"the batch holds tensors on several devices {sorted(map(str, devices))}; "
            "move it with batch.to(device) first"
        )


def batch_size(batch: Any, dim: int = 0) -> int:
    """Number of samples in a (checked) batch, counted along its batch dimension ``dim``."""
    if type(batch) is TensorDict or isinstance(batch, TensorDictBase):
        return int(batch.batch_size[dim])
    return int(next(iter(batch.values())).shape[dim])


def check_batch_dim(batch: Any, dim: int) -> None:
    """Raise a clear error unless every tensor of ``batch`` has the batch dimension ``dim``
    and they agree on its size (``dim=1``: time-major ``(time, batch, ...)`` layouts)."""
    if dim == 0:
        return
    if isinstance(batch, TensorDictBase):
        if batch.batch_dims <= dim:
            raise ValueError(
                f"with_accumulation(..., dim={dim}) splits batch dimension {dim}, but the "
                f"TensorDict has batch_size={list(batch.batch_size)}; build it with both "
                f"leading dimensions, e.g. batch_size=[bptt, batch] for (time, batch) tensors")
        return
    sizes = {key: (value.shape[dim] if value.dim() > dim else None)
             for key, value in batch.items()}
    if None in sizes.values() or len(set(sizes.values())) > 1:
        raise ValueError(
            f"with_accumulation(..., dim={dim}) needs every tensor's dimension {dim} to be the "
            f"batch, got sizes {sizes}; lay tensors out as (time, batch, ...) or use dim=0")


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous chunks of ``total`` samples, the first ones larger by one."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@functools.lru_cache(maxsize=256)
def _layout(shape: torch.Size, parts: int, dim: int) -> tuple[tuple[int, ...], list[torch.Size]]:
    """The sizes of ``parts`` micro-batches of a TensorDict of batch size ``shape`` split along
    ``dim``, and their batch sizes (cached: a run sees few batch shapes; callers do not
    mutate them)."""
    sizes = split_sizes(shape[dim], parts)
    return tuple(sizes), [torch.Size([*shape[:dim], size, *shape[dim + 1:]]) for size in sizes]


@overload
def split_batch(batch: Any, parts: int, dim: int = 0) -> list[Any]: ...
@overload
def split_batch(batch: Any, parts: int, dim: int = 0, *,
                with_sizes: Literal[True]) -> tuple[list[Any], tuple[int, ...]]: ...
def split_batch(batch: Any, parts: int, dim: int = 0, *,
                with_sizes: bool = False) -> list[Any] | tuple[list[Any], tuple[int, ...]]:
    """Split a batch along its batch dimension ``dim`` into ``parts`` micro-batches (uneven
    sizes allowed, the first ones larger by one); ``with_sizes`` also returns their sizes."""
    check_batch_dim(batch, dim)
    total = batch_size(batch, dim)
    if parts > total:
        raise ValueError(
            f"cannot split a batch of {total} samples into {parts} micro-batches; use a batch "
            f"of at least {parts} samples or with_accumulation(n) with n <= {total}"
        )
    micros, sizes = split_checked(batch, parts, dim)
    return (micros, sizes) if with_sizes else micros


def split_checked(batch: Any, parts: int, dim: int) -> tuple[list[Any], tuple[int, ...]]:
    """:func:`split_batch` with its sizes, for a caller that checked ``dim`` and that the
    batch has at least ``parts`` samples along it."""
    if type(batch) is TensorDict:
        sizes, shapes = _layout(batch.batch_size, parts, dim)
        micros = _split_flat(batch, sizes, shapes, dim)
        if micros is not None:
            return micros, sizes
    else:
        sizes = tuple(split_sizes(batch_size(batch, dim), parts))
    if isinstance(batch, TensorDictBase):
        return list(batch.split(list(sizes), dim=dim)), sizes
    chunks = {key: torch.split(value, list(sizes), dim=dim) for key, value in batch.items()}
    return [{key: chunks[key][i] for key in batch} for i in range(parts)], sizes


def _split_flat(batch: TensorDict, sizes: tuple[int, ...], shapes: list[torch.Size],
                dim: int) -> list[Any] | None:
    """``batch.split(sizes, dim)`` for a TensorDict of plain tensors without dimension names,
    built from each entry's ``split_with_sizes`` (a third of the time ``TensorDict.split``
    takes, which handles every kind of entry); None for any other TensorDict."""
    if compat.tensordict_has_names(batch):
        return None
    keys = []
    pieces = []
    for key, value in batch.items():
        if type(value) is not torch.Tensor:  # nested, non-tensor data, or a tensor subclass
            return None
        keys.append(key)
        pieces.append(value.split_with_sizes(sizes, dim) if dim else value.split_with_sizes(sizes))
    return compat.tensordicts_unchecked(keys, zip(*pieces), shapes, batch.device)
