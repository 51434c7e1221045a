"""Pipelines: torchdata nodes from a source to device-side TensorDict batches, and the loader.

The graph that :func:`loader` builds (each stage a ``torchdata.nodes.BaseNode``)::

    IndexBatchSampler            shuffle (seed, epoch), shard by rank, batch the indices
      -> Mapper / PoolMapper (threads or processes) over TensorDictGather | SampleCollator
         (or IterableWrapper -> IterableBatcher for iterables)
      -> CatchErrors             an exception becomes an item holding it, to cross threads
      -> Prefetcher              batches prepared ahead in a background thread
      -> PinMemory               page-locked host memory (only when CUDA is there)
      -> RaiseErrors             raises that exception object, as the dataset raised it
      -> ToDevice                non-blocking copy on a side stream, overlapping compute
      -> ApplyTransform          GPU-side batch transform, seeded per (epoch, batch)

(when batches stay on the host, ApplyTransform runs before the Prefetcher instead, so the
transform overlaps the loop's compute; its seeds, hence its output, are the same)

and a :class:`~accelfn.data.BatchLoader` iterates it, epoch after epoch, with an exact
``state_dict()`` and a record of how long the loop waited for each batch. The nodes live in
``sampling`` (the sampler), ``gather`` and ``collate`` (the sources), ``workers`` (the
persistent pool), ``stages`` (``ToDevice``, ``ApplyTransform``, ``CatchErrors``,
``RaiseErrors``) and ``batch_loader``.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torchdata.nodes import BaseNode, IterableWrapper, Mapper

from .batch_loader import BatchLoader
from .collate import IterableBatcher, SampleCollator
from .gather import TensorDictGather
from .gpu import host_keys
from .sampling import DataLoaderDrawsNode, DataLoaderRNG, IndexBatchSampler, resolve_shard
from .stages import ApplyTransform, ToDevice, in_threads, resolve_device
from .workers import PoolMapper

__all__ = ["loader"]


def _columns(
    source: Mapping[Any, Any], sizes: dict[Any, int], prefix: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A dict source as a dict of tensors (NumPy arrays converted without a copy, nested dicts
    kept nested), with each leaf's first dimension in ``sizes``; anything else is refused,
    naming the key."""
    out: dict[str, Any] = {}
    for k, value in source.items():
        if not isinstance(k, str):
            raise TypeError(
                f"dict source: keys must be strings (the batch's keys), got {k!r} "
                f"({type(k).__name__}); a map-style dataset keyed by index is a dict whose "
                "keys are all ints"
            )
        key: Any = (*prefix, k) if prefix else k
        if isinstance(value, Mapping):
            out[k] = _columns(value, sizes, (*prefix, k))
            continue
        if isinstance(value, torch.Tensor):
            column = value
        elif type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
            try:
                column = torch.as_tensor(value)
            except TypeError as e:
                raise TypeError(
                    f"dict source: key {key!r} holds a NumPy array of dtype {value.dtype}, "
                    f"which has no torch dtype ({e}); store numbers (e.g. indices into a list "
                    "kept aside), or use a map-style dataset (__getitem__ and __len__) for "
                    "other values"
                ) from None
        else:
            what = "a list" if isinstance(value, (list, tuple)) else (
                f"a value of type {type(value).__name__}"
            )
            raise TypeError(
                f"dict source: key {key!r} holds {what}; a dict source holds one tensor (or "
                "NumPy array) per key, with one row per sample along dim 0: convert numbers "
                "with torch.as_tensor(...), and for other values (file names, strings) use a "
                "map-style dataset (__getitem__ and __len__) that loads each sample"
            )
        if column.dim() == 0:
            raise TypeError(
                f"dict source: key {key!r} holds a 0-dim tensor; a dict source holds one row "
                "per sample along dim 0 (a constant belongs outside the dataset)"
            )
        out[k] = column
        sizes[key] = column.shape[0]
    return out


def _as_source(source: Any) -> tuple[str, Any]:
    if isinstance(source, TensorDictBase):
        return "tensordict", source
    if isinstance(source, Mapping) and any(isinstance(k, str) for k in source):
        # A dict of columns (a map-style dataset as a dict is keyed by index, not by name).
        sizes: dict[Any, int] = {}
        columns = _columns(source, sizes)
        if not sizes:
            raise ValueError("the dict source holds no tensor (only empty dicts)")
        n = next(iter(sizes.values()))
        if any(size != n for size in sizes.values()):
            raise ValueError(
                f"a dict of tensors is used as a dataset with one row per sample along dim 0, "
                f"but the tensors have different first dimensions: {sizes}"
            )
        return "tensordict", TensorDict(columns, batch_size=[n])
    if isinstance(source, torch.utils.data.IterableDataset):
        return "iterable", source
    if hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        return "map", source
    if isinstance(source, Iterable):
        return "iterable", source
    raise TypeError(
        f"cannot load from {type(source).__name__}: pass a TensorDict (in memory or memory-"
        "mapped), a dict of tensors, a map-style dataset (__getitem__ and __len__) or an iterable"
    )


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _check_bool(name: str, value: Any, *, none: bool = False) -> None:
    if isinstance(value, bool) or (none and value is None):
        return
    expected = "True, False or None" if none else "True or False"
    raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            f"seed must be an int, got {seed!r} ({type(seed).__name__}); pass an integer such "
            "as seed=0 (a float is not rounded for you, and None does not mean random)"
        )
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must be in [-2**63, 2**63) (an int64), got {seed}")
    return seed


def _check_keys(name: str, keys: Any) -> None:
    if keys is None:
        return
    if isinstance(keys, (str, bytes)):
        # A string is a sequence of one-letter keys: refused rather than taken as one key, so
        # that there is a single spelling (a list, whatever the number of keys) and a string
        # meant as a list of keys ("image,label") is not read as one key either.
        raise TypeError(
            f"{name}={keys!r} is a string; pass a list or tuple of keys, e.g. "
            f"{name}=[{keys!r}] for one key"
        )
    if not isinstance(keys, Sequence):
        raise TypeError(
            f"{name} must be a list or tuple of keys, got {keys!r} ({type(keys).__name__})"
        )
    if name == "keys" and len(keys) == 0:
        raise ValueError(
            "keys=[] names no key, so batches would hold nothing; pass the keys to load, "
            "or keys=None for all of them"
        )


def loader(
    source: Any,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    device: torch.device | str | None = None,
    num_workers: int | None = None,
    worker_type: Literal["thread", "process"] = "thread",
    mp_context: str | None = None,
    transform: Callable[..., TensorDictBase] | None = None,
    sample_transform: Callable[[Any], Any] | None = None,
    keys: Sequence[str] | None = None,
    ragged_keys: Sequence[str] | None = None,
    prefetch: int = 2,
    pin_memory: bool | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    rng: DataLoaderRNG | None = None,
) -> BatchLoader:
    """Build a loader of TensorDict batches from ``source``.

    Sources:

    * a ``TensorDict`` (in memory, memory-mapped with ``TensorDict.load_memmap`` /
      [`accelfn.data.open_preloaded`][], or already on the device) or a dict of tensors:
      each batch is one gather per key, no per-sample Python. The fast path.
    * a map-style dataset (``__getitem__`` / ``__len__``, e.g. a torchvision dataset or
      [`accelfn.data.ImageFiles`][]): samples are loaded one by one in ``num_workers``
      worker threads (default), or worker processes that persist across epochs
      (``worker_type="process"``, for Python-heavy work that holds the GIL), each worker
      producing whole batches. Workers of both kinds persist across epochs.
    * an iterable (incl. ``IterableDataset``): read in order (``shuffle=False`` required),
      sharded by position.

    Batches are TensorDicts with ``batch_size=[batch_size]``, prefetched ``prefetch`` deep in
    a background thread, pinned when CUDA is available (``pin_memory=None``), copied to
    ``device`` without blocking, then passed through ``transform`` there.

    Args:
        source: the data (see above).
        batch_size: samples per batch.
        shuffle: shuffle every epoch with a permutation drawn from ``seed`` and the epoch.
        seed: seed of the shuffle, of the transform's per-batch generators and of the
            per-sample ones (``dataset[i]`` and ``sample_transform`` draw from a generator
            seeded with ``mix_seed(seed, epoch, i)``, never from torch's global one).
        drop_last: drop each epoch's final short batch; without it the last batch is smaller.
        device: where batches go (``None``: stay on the host).
        num_workers: parallel workers; default 0 for TensorDicts (the gather runs in the
            prefetch thread) and ``min(8, cpu_count)`` for map-style datasets. When batches
            stay on the host, ``transform`` also runs on this many batches at once, in threads.
        worker_type: ``"thread"`` or ``"process"`` (map-style datasets only).
        mp_context: start method for worker processes (default: the platform's).
        transform: batch transform run on ``device`` (see [`accelfn.data.gpu`][]); it is
            given a ``generator=`` seeded per batch if it accepts one.
        sample_transform: per-sample function applied in the workers (map-style/iterable),
            e.g. ``torchvision.transforms.v2``; its random draws (and those of
            ``dataset[i]``) are seeded per sample, so runs are reproducible with any
            ``num_workers`` (see ``accelfn.data.rng``).
        keys: keys to load (TensorDict source), or names of tuple fields (other sources): a
            list or tuple, also for one key (``keys=["image"]``; a string is refused).
        ragged_keys: keys holding variable-length 1-D tensors (collated padded, plus
            ``<key>_lengths``); default the dataset's ``ragged_keys`` attribute if any.
        prefetch: batches prepared ahead (0: none, load on demand in the loop's thread).
        pin_memory: page-lock host batches; ``None`` = only when ``device`` is CUDA.
        rank: shard to load; default ``torch.distributed``'s rank when initialised, else 0.
        world_size: number of shards; default ``torch.distributed``'s world size, else 1.
        rng: ``DataLoaderRNG()`` to draw from torch's global generator (or a given one) what
            ``torch.utils.data.DataLoader`` draws at each ``iter()``, and to shuffle in its
            order, so that a loop ported from a DataLoader keeps its random stream (dropout
            masks included) bitwise; see [`DataLoaderRNG`][accelfn.data.DataLoaderRNG].
            Default: draw nothing from global generators, shuffle from ``(seed, epoch)``.

    Raises:
        TypeError / ValueError: with how to fix it, for a bad argument, an empty source,
            ``batch_size`` larger than the (shard of the) dataset with ``drop_last``, or
            (while iterating) a sample whose keys, shape or dtype differ from the first's.
    """
    _check_int("batch_size", batch_size, 1)
    _check_int("prefetch", prefetch, 0)
    _check_seed(seed)
    _check_bool("shuffle", shuffle)
    _check_bool("drop_last", drop_last)
    _check_bool("pin_memory", pin_memory, none=True)
    _check_keys("keys", keys)
    _check_keys("ragged_keys", ragged_keys)
    if num_workers is not None:
        _check_int("num_workers", num_workers, 0)
    if worker_type not in ("thread", "process"):
        raise ValueError(f"worker_type must be 'thread' or 'process', got {worker_type!r}")
    if mp_context is not None:
        methods = multiprocessing.get_all_start_methods()
        if mp_context not in methods:
            raise ValueError(
                f"mp_context={mp_context!r} is not a start method here; pass one of {methods} "
                "(or None for the platform's default)"
            )
        if worker_type != "process":
            raise ValueError(
                f"mp_context={mp_context!r} starts worker processes, but worker_type="
                f"{worker_type!r}: pass worker_type='process' (map-style datasets) to use it, "
                "or leave mp_context=None"
            )
    if sample_transform is not None and not callable(sample_transform):
        raise TypeError(
            f"sample_transform must be callable (a function of one sample), got "
            f"{sample_transform!r}"
        )
    if rng is not None and not isinstance(rng, DataLoaderRNG):
        raise TypeError(
            f"rng={rng!r}: pass accelfn.data.DataLoaderRNG(...) (e.g. DataLoaderRNG() to draw "
            "from torch's global generator as a DataLoader does), or None"
        )
    rank, world_size = resolve_shard(rank, world_size)
    kind, data = _as_source(source)
    dev, pin_memory = resolve_device(device, pin_memory)
    close_fns: list[Callable[[], None]] = []
    num_batches: int | None = None
    on_device_source = False

    config: dict[str, Any] = {
        "source": kind,
        "batch_size": batch_size,
        "shuffle": shuffle,
        "seed": seed,
        "drop_last": drop_last,
        "rank": rank,
        "world_size": world_size,
        "transform": transform is not None,
    }
    if rng is not None:  # absent otherwise, so that positions saved before the option load
        config["rng"] = "dataloader-persistent" if rng.persistent_workers else "dataloader"
        config["rng_generator"] = rng.generator is not None

    if kind in ("tensordict", "map"):
        if kind == "tensordict":
            # Per-sample options would be ignored: the rows are gathered, never loaded one by one.
            if sample_transform is not None:
                raise ValueError(
                    "sample_transform applies to map-style and iterable sources, loaded one "
                    "sample at a time; a TensorDict (or dict of tensors) source is gathered "
                    "whole batches at a time, so it would be ignored: pass a batch transform as "
                    "transform= (e.g. accelfn.data.RandomCrop, or any f(batch) -> batch), or "
                    "wrap the data in a map-style dataset"
                )
            if ragged_keys:
                raise ValueError(
                    f"ragged_keys={list(ragged_keys)!r} applies to samples collated one by one; "
                    "a TensorDict (or dict of tensors) source holds one fixed-shape row per "
                    "sample (pad it, storing the lengths as another key), so leave ragged_keys "
                    "out"
                )
            gather = TensorDictGather(data, keys)
            n = gather.num_samples
            on_device_source = gather.device is not None and gather.device.type != "cpu"
            fetch: Callable[[torch.Tensor], TensorDictBase] = gather
            workers = 0 if num_workers is None else num_workers
            if worker_type == "process":
                raise ValueError(
                    "worker_type='process' is for map-style datasets; a TensorDict source is "
                    "gathered without Python per sample (use threads: num_workers=k)"
                )
        else:
            n = len(data)
            if n == 0:
                raise ValueError("the dataset is empty (len(dataset) == 0)")
            fetch = SampleCollator(
                data,
                keys=keys,
                sample_transform=sample_transform,
                ragged_keys=ragged_keys,
                seed=seed,
            )
            workers = min(8, os.cpu_count() or 1) if num_workers is None else num_workers
        sampler = IndexBatchSampler(
            n,
            batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            rank=rank,
            world_size=world_size,
            rng=rng,
            with_epoch=kind == "map",  # the collator seeds each sample from (seed, epoch, i)
        )
        if sampler.num_batches == 0:
            shard = f" (rank {rank}'s shard of {world_size})" if world_size > 1 else ""
            raise ValueError(
                f"batch_size={batch_size} is larger than the {sampler.shard_size} samples"
                f"{shard} of the dataset ({n} samples) with drop_last=True, so an epoch would "
                "have no batch; lower batch_size or pass drop_last=False"
            )
        num_batches = sampler.num_batches
        # num_workers and worker_type are not part of the checked configuration: the batches
        # do not depend on them, nor does the state (a PoolMapper's has the shape of a
        # Mapper's), so a position resumes with others, e.g. with the default
        # min(8, cpu_count) on a machine with another number of cores.
        config["num_samples"] = n
        node: BaseNode[Any]
        on_host = (dev is None or dev.type == "cpu") and not on_device_source
        if kind == "tensordict" and transform is not None and on_host:
            # A gather takes microseconds: the threads are better spent on the transform.
            node = Mapper(sampler, fetch)
        elif workers == 0:
            node = Mapper(sampler, fetch)
        else:
            pool = PoolMapper(
                sampler, fetch, workers, worker_type=worker_type, mp_context=mp_context
            )
            close_fns.append(pool.close)
            node = pool
        host_workers = workers
    else:
        host_workers = 0
        if shuffle:
            raise ValueError(
                "an iterable source is read in order and cannot be shuffled by the loader: "
                "pass shuffle=False (and shuffle at the source), or use a map-style dataset"
            )
        if num_workers:
            raise ValueError(
                "an iterable source is read by one reader; num_workers applies to map-style "
                "datasets (leave num_workers=None)"
            )
        reader: BaseNode[Any] = IterableWrapper(data)
        if rng is not None:
            reader = DataLoaderDrawsNode(reader, rng)
        node = IterableBatcher(
            reader,
            batch_size,
            drop_last=drop_last,
            keys=keys,
            sample_transform=sample_transform,
            ragged_keys=ragged_keys or (),
            rank=rank,
            world_size=world_size,
            seed=seed,
        )

    # Batches that stay on the host are transformed in the prefetch thread, overlapping the
    # loop's compute; device batches are transformed on the device, in the loop's thread (the
    # kernels are asynchronous). Same seeds either way, so the same batches.
    on_host = (dev is None or dev.type == "cpu") and not on_device_source
    if transform is not None and on_host:
        node = ApplyTransform(node, transform, seed=seed, rank=rank, num_workers=host_workers)
        close_fns.append(node.close)
    if not on_device_source:  # exceptions cross the threads as raised
        node = in_threads(node, prefetch=prefetch, pin_memory=pin_memory)
    if dev is not None:
        node = ToDevice(node, dev, keep_on_host=host_keys(transform))
    if transform is not None and not on_host:
        node = ApplyTransform(node, transform, seed=seed, rank=rank)
    return BatchLoader(node, num_batches=num_batches, config=config, close_fns=close_fns,
                       portable_position=True)
