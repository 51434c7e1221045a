"""Pipelines: torchdata nodes from a source to device-side TensorDict batches, and the loader.

The graph that :func:`loader` builds (each stage a ``torchdata.nodes.BaseNode``)::

    IndexBatchSampler            shuffle (seed, epoch), shard by rank, batch the indices
      -> Mapper / PoolMapper (threads or processes) over TensorDictGather | SampleCollator
         (or IterableWrapper -> IterableBatcher for iterables)
      -> Prefetcher              batches prepared ahead in a background thread
      -> PinMemory               page-locked host memory (only when CUDA is there)
      -> ToDevice                non-blocking copy on a side stream, overlapping compute
      -> ApplyTransform          GPU-side batch transform, seeded per (epoch, batch)

(when batches stay on the host, ApplyTransform runs before the Prefetcher instead, so the
transform overlaps the loop's compute; its seeds, hence its output, are the same)

and :class:`BatchLoader` iterates it, epoch after epoch, with an exact ``state_dict()`` and
a record of how long the loop waited for each batch.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from torchdata.nodes import BaseNode, IterableWrapper, Mapper, PinMemory, Prefetcher

from .gpu import accepts_generator, host_keys
from .sampling import IndexBatchSampler, mix_seed, resolve_shard
from .sources import IterableBatcher, PoolMapper, SampleCollator, TensorDictGather

__all__ = ["ApplyTransform", "BatchLoader", "ToDevice", "loader"]

STATE_FORMAT = "accelfn.data.loader/1"


class ToDevice(BaseNode[TensorDictBase]):
    """Move TensorDict batches to ``device`` with non-blocking copies.

    On CUDA the copy of the next ``lookahead`` batches is issued on a side stream while the
    current one is being used; the consumer's stream waits for it on the GPU (no host sync)
    and the tensors are marked as used by that stream. Keys in ``keep_on_host`` stay where
    they are (e.g. encoded bytes for :class:`~accelfn.data.gpu.DecodeJPEG`). Its state is the
    source's state as of the last batch returned, so look-ahead never skips data on resume.
    """

    def __init__(
        self,
        source: BaseNode[TensorDictBase],
        device: torch.device | str,
        *,
        lookahead: int = 1,
        keep_on_host: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.source = source
        self.device = torch.device(device)
        self.keep_on_host = tuple(keep_on_host)
        self._cuda = self.device.type == "cuda"
        self.lookahead = lookahead if self._cuda else 0
        self._stream: torch.cuda.Stream | None = None
        self._queue: deque[tuple[Any, Any, Any, dict[str, Any]]] = deque()
        self._state: dict[str, Any] | None = None
        self._exhausted = False

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._queue.clear()
        self._exhausted = False
        self.source.reset(None if initial_state is None else initial_state["source"])
        self._state = self.source.state_dict()
        if self._cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)

    def _move(self, batch: TensorDictBase) -> TensorDictBase:
        if self.keep_on_host:
            host = batch.select(*[k for k in self.keep_on_host if k in batch.keys()])
            moved = batch.exclude(*self.keep_on_host).to(self.device, non_blocking=True)
            moved.clear_device_()
            moved.update(host)
            return moved
        return batch.to(self.device, non_blocking=True)

    def _pull(self) -> None:
        try:
            batch = next(self.source)
        except StopIteration:
            self._exhausted = True
            return
        state = self.source.state_dict()
        if self._cuda:
            assert self._stream is not None
            with torch.cuda.stream(self._stream):
                moved = self._move(batch)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._queue.append((moved, event, batch, state))
        else:
            self._queue.append((self._move(batch), None, None, state))

    def next(self) -> TensorDictBase:
        while not self._exhausted and len(self._queue) <= self.lookahead:
            self._pull()
        if not self._queue:
            raise StopIteration
        moved, event, _host, state = self._queue.popleft()
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in moved.values(include_nested=True, leaves_only=True):
                if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                    t.record_stream(current)
        self._state = state
        return moved

    def get_state(self) -> dict[str, Any]:
        return {"source": self._state}


class _TagSeeds(BaseNode[tuple[Any, int]]):
    """Pair each batch with its seed ``mix_seed(seed, rank, epoch, batch_number)``."""

    def __init__(self, source: BaseNode[Any], seed: int, rank: int) -> None:
        super().__init__()
        self.source = source
        self.seed = seed
        self.rank = rank
        self._epoch = 0
        self._batches = 0
        self._started = False

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.source.reset(initial_state["source"])
            self._epoch = int(initial_state["epoch"])
            self._batches = int(initial_state["batches"])
            self._started = True
        else:
            self.source.reset()
            if self._started:
                self._epoch += 1
            self._batches = 0
            self._started = False

    def next(self) -> tuple[Any, int]:
        self._started = True
        batch = next(self.source)
        seed = mix_seed(self.seed, self.rank, self._epoch, self._batches)
        self._batches += 1
        return batch, seed

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "epoch": self._epoch, "batches": self._batches}


class _SeededCall:
    """``(batch, seed) -> transform(batch, generator=<seeded on the batch's device>)``."""

    def __init__(self, transform: Callable[..., TensorDictBase]) -> None:
        self.transform = transform
        self.takes_generator = accepts_generator(transform)
        self.keep = set(host_keys(transform))
        self._local = threading.local()

    def _generator(self, batch: TensorDictBase, seed: int) -> torch.Generator:
        device = batch.device
        if device is None:
            devices = [
                v.device
                for k, v in batch.items(leaves_only=True)
                if k not in self.keep and isinstance(v, torch.Tensor)
            ]
            device = devices[0] if devices else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        cache = self._local.__dict__.setdefault("generators", {})  # one per thread and device
        g = cache.get(device)
        if g is None:
            g = cache[device] = torch.Generator(device=device)
        return g.manual_seed(seed)

    def __call__(self, item: tuple[TensorDictBase, int]) -> TensorDictBase:
        batch, seed = item
        if self.takes_generator:
            out = self.transform(batch, generator=self._generator(batch, seed))
        else:
            out = self.transform(batch)
        if not isinstance(out, TensorDictBase):
            raise TypeError(
                f"the batch transform {self.transform!r} returned {type(out).__name__}; it "
                "must return the (new) TensorDict batch"
            )
        return out


class ApplyTransform(BaseNode[TensorDictBase]):
    """Apply a batch transform, giving it a ``torch.Generator`` seeded per batch.

    The generator (on the batch's device) is seeded with ``mix_seed(seed, rank, epoch,
    batch_number)``, so augmentations are reproducible from ``seed``, differ every epoch and
    across ranks, and are reproduced exactly after a resume. Transforms without a
    ``generator`` parameter are called as ``transform(batch)``.

    With ``num_workers > 0`` the transform runs on that many batches at once in worker threads
    (a :class:`~accelfn.data.sources.PoolMapper`, in order): for host (CPU) batches, whose
    transforms are real work rather than asynchronous kernel launches. Seeds are assigned in order
    before the workers, so the output does not depend on ``num_workers``.
    """

    def __init__(
        self,
        source: BaseNode[TensorDictBase],
        transform: Callable[..., TensorDictBase],
        *,
        seed: int = 0,
        rank: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not callable(transform):
            raise TypeError(f"transform must be callable, got {transform!r}")
        self.source = source
        self.transform = transform
        self.seed = seed
        self.rank = rank
        self.num_workers = num_workers
        tagged = _TagSeeds(source, seed, rank)
        call = _SeededCall(transform)
        self._inner: BaseNode[TensorDictBase]
        self._pool: PoolMapper | None = None
        if num_workers > 0:
            self._pool = PoolMapper(tagged, call, num_workers)
            self._inner = self._pool
        else:
            self._inner = Mapper(tagged, call)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._inner.reset(None if initial_state is None else initial_state["inner"])

    def next(self) -> TensorDictBase:
        return next(self._inner)

    def get_state(self) -> dict[str, Any]:
        return {"inner": self._inner.state_dict()}

    def close(self) -> None:
        """Stop the worker threads, if any (a later ``reset()`` starts new ones)."""
        if self._pool is not None:
            self._pool.close()


class _Iterator(Iterator[TensorDictBase]):
    """The iterator of one epoch of a :class:`BatchLoader`; times each ``next()``."""

    def __init__(self, owner: BatchLoader, generation: int) -> None:
        self._owner = owner
        self._generation = generation

    def __iter__(self) -> _Iterator:
        return self

    def __next__(self) -> TensorDictBase:
        owner = self._owner
        if self._generation != owner._generation:
            raise RuntimeError(
                "this iterator is stale: iter() was called again on its loader, which started "
                "a new epoch; iterate the newest iterator"
            )
        t0 = time.perf_counter()
        try:
            batch = owner._next()
        except StopIteration:
            if owner._last_return is not None:  # the loop's last step, up to the epoch's end
                owner.total_time_s += time.perf_counter() - owner._last_return
            owner._last_return = None
            raise
        t1 = time.perf_counter()
        wait = t1 - t0
        owner.last_wait_s = wait
        owner.total_wait_s += wait
        owner.total_time_s += t1 - owner._last_return if owner._last_return is not None else wait
        owner._last_return = t1
        owner.batches += 1
        return batch


def _stop_threads(root: BaseNode[Any], close_fns: Sequence[Callable[[], None]]) -> None:
    """Stop every background thread of the graph below ``root`` and call ``close_fns``."""
    seen: set[int] = set()
    todo: list[Any] = [root]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        worker = getattr(node, "_it", None)  # Prefetcher / PinMemory thread (torchdata)
        if worker is not None and callable(getattr(worker, "_shutdown", None)):
            worker._shutdown()
        todo.extend(v for v in vars(node).values() if isinstance(v, BaseNode))
    for fn in close_fns:
        fn()


class BatchLoader(Iterable[TensorDictBase]):
    """A re-iterable loader over a ``torchdata.nodes`` graph of TensorDict batches.

    Each ``iter()`` starts the next epoch (or resumes the position given to
    :meth:`load_state_dict`). Built by :func:`loader`; can also wrap any root node you compose
    yourself.

    Data-wait measurement (read by monitors; the clock is ``time.perf_counter``):

    * ``last_wait_s``: seconds the last ``next()`` blocked before returning its batch (queue
      wait, host-side transfer and transform launch; GPU-side work is asynchronous and not
      included).
    * ``total_wait_s``: sum of those waits since construction or :meth:`reset_timing`.
    * ``batches``: batches returned since then.
    * ``total_time_s``: wall time of the loop over those batches: the first wait of each
      epoch, then from each return to the next request's return (or to the end of the epoch),
      i.e. loop time excluding time spent outside iteration between epochs.
    * ``wait_share``: ``total_wait_s / total_time_s``, the fraction of the loop spent waiting
      for data (the seeds' target is under 0.2).

    Args:
        root: the graph's root node, yielding TensorDict batches.
        num_batches: batches per epoch, if known (``len(loader)``).
        config: plain description of the pipeline, stored in the state and checked on load.
        close_fns: called by :meth:`close` (e.g. to stop worker processes).
    """

    def __init__(
        self,
        root: BaseNode[TensorDictBase],
        *,
        num_batches: int | None = None,
        config: Mapping[str, Any] | None = None,
        close_fns: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.root = root
        self.num_batches = num_batches
        self.config = dict(config or {})
        self._close_fns = tuple(close_fns)
        self._pending_state: dict[str, Any] | None = None
        self._peeked: TensorDictBase | None = None
        self._peek_state: dict[str, Any] | None = None
        self._generation = 0
        self._active = False
        self._started_for_state = False
        self.last_wait_s = 0.0
        self.total_wait_s = 0.0
        self.total_time_s = 0.0
        self.batches = 0
        self._last_return: float | None = None
        # Background threads (prefetching, pinning) must stop before the interpreter tears
        # down torch, or a thread still inside an op aborts the process at exit.
        weakref.finalize(self, _stop_threads, root, self._close_fns)

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> _Iterator:
        self._generation += 1
        self._last_return = None
        if self._started_for_state:
            # state_dict() before the first iter() already started this epoch: keep it.
            self._started_for_state = False
            return _Iterator(self, self._generation)
        self._peeked = self._peek_state = None
        state, self._pending_state = self._pending_state, None
        if state is None:
            self.root.reset(None)
        else:
            self.root.reset(state)
            # A position saved right after an epoch's last batch resumes at the next epoch.
            before = self.root.state_dict()
            try:
                self._peeked = next(self.root)
                self._peek_state = before
            except StopIteration:
                self.root.reset(None)
        self._active = True
        return _Iterator(self, self._generation)

    def _next(self) -> TensorDictBase:
        if self._peeked is not None:
            batch, self._peeked, self._peek_state = self._peeked, None, None
            return batch
        return next(self.root)

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("the number of batches per epoch is unknown (iterable source)")
        return self.num_batches

    # -- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch returned, as plain data (ints, strings, dicts).

        Safe to ``torch.save`` and to load with ``torch.load(..., weights_only=True)``. Loading
        it into an identically configured loader and iterating yields exactly the batches an
        uninterrupted run would have yielded next (including the next epoch's, if it was taken
        at the end of an epoch).
        """
        if self._pending_state is not None:
            root = self._pending_state
        elif not self._active:
            # Start the first epoch now (the next iter() continues it, not a new one): the
            # nodes' state only exists once they are reset.
            self.__iter__()
            self._started_for_state = True
            root = self._peek_state if self._peek_state is not None else self.root.state_dict()
        elif self._peek_state is not None:
            root = self._peek_state
        else:
            root = self.root.state_dict()
        return {"format": STATE_FORMAT, "config": dict(self.config), "root": root}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` at the next ``iter()``.

        Raises:
            ValueError: the state is not a loader state, or was saved by a loader with a
                different configuration (dataset size, batch size, seed, sharding, ...).
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not an accelfn.data loader state (expected format {STATE_FORMAT!r}); pass "
                "what BatchLoader.state_dict() returned"
            )
        saved = dict(state.get("config", {}))
        if saved != self.config:
            diff = sorted(
                k for k in set(saved) | set(self.config) if saved.get(k) != self.config.get(k)
            )
            detail = ", ".join(
                f"{k}: saved {saved.get(k)!r}, here {self.config.get(k)!r}" for k in diff
            )
            raise ValueError(
                f"the loader state was saved with a different configuration ({detail}); build "
                "the loader with the same settings to resume"
            )
        self._pending_state = state["root"]
        self._peeked = self._peek_state = None
        self._started_for_state = False

    # -- timing ------------------------------------------------------------------------------

    @property
    def wait_share(self) -> float:
        """Fraction of the loop's wall time spent waiting for data (0 before any batch)."""
        return self.total_wait_s / self.total_time_s if self.total_time_s > 0 else 0.0

    def reset_timing(self) -> None:
        """Zero ``last_wait_s``, ``total_wait_s``, ``total_time_s`` and ``batches``."""
        self.last_wait_s = self.total_wait_s = self.total_time_s = 0.0
        self.batches = 0
        self._last_return = None

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop background threads and persistent worker processes. The loader can still be
        iterated (they restart with the next epoch). Also done at interpreter exit."""
        _stop_threads(self.root, self._close_fns)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"BatchLoader({items})"


# --------------------------------------------------------------------------------------------


def _as_source(source: Any) -> tuple[str, Any]:
    if isinstance(source, TensorDictBase):
        return "tensordict", source
    if isinstance(source, Mapping) and source and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in source.items()
    ):
        sizes = {k: v.shape[0] if v.dim() else None for k, v in source.items()}
        if len(set(sizes.values())) != 1 or None in sizes.values():
            raise ValueError(
                f"a dict of tensors is used as a dataset with one row per sample along dim 0, "
                f"but the tensors have different first dimensions: {sizes}"
            )
        n = next(iter(sizes.values()))
        return "tensordict", TensorDict(dict(source), batch_size=[n])
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
) -> BatchLoader:
    """Build a loader of TensorDict batches from ``source``.

    Sources:

    * a ``TensorDict`` (in memory, memory-mapped with ``TensorDict.load_memmap`` /
      :func:`accelfn.data.open_preloaded`, or already on the device) or a dict of tensors:
      each batch is one gather per key, no per-sample Python. The fast path.
    * a map-style dataset (``__getitem__`` / ``__len__``, e.g. a torchvision dataset or
      :class:`accelfn.data.ImageFiles`): samples are loaded one by one in ``num_workers``
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
        seed: seed of the shuffle and of the transform's per-batch generators.
        drop_last: drop each epoch's final short batch; without it the last batch is smaller.
        device: where batches go (``None``: stay on the host).
        num_workers: parallel workers; default 0 for TensorDicts (the gather runs in the
            prefetch thread) and ``min(8, cpu_count)`` for map-style datasets. When batches
            stay on the host, ``transform`` also runs on this many batches at once, in threads.
        worker_type: ``"thread"`` or ``"process"`` (map-style datasets only).
        mp_context: start method for worker processes (default: the platform's).
        transform: batch transform run on ``device`` (see :mod:`accelfn.data.gpu`); it is
            given a ``generator=`` seeded per batch if it accepts one.
        sample_transform: per-sample function applied in the workers (map-style/iterable).
        keys: keys to load (TensorDict source), or names of tuple fields (other sources).
        ragged_keys: keys holding variable-length 1-D tensors (collated padded, plus
            ``<key>_lengths``); default the dataset's ``ragged_keys`` attribute if any.
        prefetch: batches prepared ahead (0: none, load on demand in the loop's thread).
        pin_memory: page-lock host batches; ``None`` = only when ``device`` is CUDA.
        rank: shard to load; default ``torch.distributed``'s rank when initialised, else 0.
        world_size: number of shards; default ``torch.distributed``'s world size, else 1.

    Raises:
        TypeError / ValueError: with how to fix it, for a bad argument, an empty source,
            ``batch_size`` larger than the (shard of the) dataset with ``drop_last``, or
            (while iterating) a sample whose keys, shape or dtype differ from the first's.
    """
    _check_int("batch_size", batch_size, 1)
    _check_int("prefetch", prefetch, 0)
    if num_workers is not None:
        _check_int("num_workers", num_workers, 0)
    if worker_type not in ("thread", "process"):
        raise ValueError(f"worker_type must be 'thread' or 'process', got {worker_type!r}")
    rank, world_size = resolve_shard(rank, world_size)
    kind, data = _as_source(source)
    dev = None if device is None else torch.device(device)
    cuda_ok = torch.cuda.is_available()
    if dev is not None and dev.type == "cuda" and not cuda_ok:
        raise ValueError(f"device={device!r} but CUDA is not available; use device='cpu' or None")
    if pin_memory is None:
        pin_memory = cuda_ok and dev is not None and dev.type == "cuda"
    elif pin_memory and not cuda_ok:
        raise ValueError(
            "pin_memory=True needs CUDA, which is not available here; leave pin_memory=None "
            "(pins only when batches go to a CUDA device)"
        )
    close_fns: list[Callable[[], None]] = []
    num_batches: int | None = None
    on_device_source = False

    config: dict[str, Any] = {
        "source": kind,
        "batch_size": batch_size,
        "shuffle": bool(shuffle),
        "seed": int(seed),
        "drop_last": bool(drop_last),
        "rank": rank,
        "world_size": world_size,
        "transform": transform is not None,
    }

    if kind in ("tensordict", "map"):
        if kind == "tensordict":
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
                data, keys=keys, sample_transform=sample_transform, ragged_keys=ragged_keys
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
        )
        if sampler.num_batches == 0:
            shard = f" (rank {rank}'s shard of {world_size})" if world_size > 1 else ""
            raise ValueError(
                f"batch_size={batch_size} is larger than the {sampler.shard_size} samples"
                f"{shard} of the dataset ({n} samples) with drop_last=True, so an epoch would "
                "have no batch; lower batch_size or pass drop_last=False"
            )
        num_batches = sampler.num_batches
        config["num_samples"] = n
        config["num_workers"] = workers
        config["worker_type"] = worker_type
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
        node = IterableBatcher(
            IterableWrapper(data),
            batch_size,
            drop_last=drop_last,
            keys=keys,
            sample_transform=sample_transform,
            ragged_keys=ragged_keys or (),
            rank=rank,
            world_size=world_size,
        )

    # Batches that stay on the host are transformed in the prefetch thread, overlapping the
    # loop's compute; device batches are transformed on the device, in the loop's thread (the
    # kernels are asynchronous). Same seeds either way, so the same batches.
    on_host = (dev is None or dev.type == "cpu") and not on_device_source
    if transform is not None and on_host:
        node = ApplyTransform(node, transform, seed=seed, rank=rank, num_workers=host_workers)
        close_fns.append(node.close)
    if prefetch > 0 and not on_device_source:
        node = Prefetcher(node, prefetch_factor=prefetch)
    if pin_memory and not on_device_source:
        node = PinMemory(node)
    if dev is not None:
        node = ToDevice(node, dev, keep_on_host=host_keys(transform))
    if transform is not None and not on_host:
        node = ApplyTransform(node, transform, seed=seed, rank=rank)
    return BatchLoader(node, num_batches=num_batches, config=config, close_fns=close_fns)
