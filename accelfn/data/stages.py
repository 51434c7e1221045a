"""Pipeline stages after loading: the copy to the device and the seeded batch transform.

* :class:`ToDevice` copies batches to the device without blocking, on a side stream.
* :class:`ApplyTransform` applies a batch transform with a generator seeded per batch from
  ``(seed, rank, epoch, batch_number)``, in the loop's thread or in worker threads.
* :func:`in_threads` puts the prefetching and pinning threads over a node so that an exception
  raised below them reaches the loop as raised (:class:`CatchErrors` and
  :class:`RaiseErrors`), not rebuilt by torch's ``ExceptionWrapper``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from torchdata.nodes import BaseNode, Mapper, PinMemory, Prefetcher

from .epochs import EpochCounting
from .gpu import accepts_generator, host_keys
from .rng import seeded_draws
from .sampling import mix_seed
from .workers import PoolMapper

__all__ = ["ApplyTransform", "CatchErrors", "RaiseErrors", "ToDevice", "in_threads"]


class ToDevice(BaseNode[TensorDictBase]):  # type: ignore[misc]  # torchdata: untyped
    """Move TensorDict batches to ``device`` with non-blocking copies.

    On CUDA the copy of the next ``lookahead`` batches is issued on a side stream while the
    current one is being used; the consumer's stream waits for it on the GPU (no host sync)
    and the tensors are marked as used by that stream. Keys in ``keep_on_host`` stay where
    they are (e.g. encoded bytes for [`DecodeJPEG`][]). Its state is the
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
        # (moved batch, its copy's event on CUDA, the host batch kept alive until then, state)
        self._queue: deque[
            tuple[TensorDictBase, torch.cuda.Event | None, TensorDictBase | None, dict[str, Any]]
        ] = deque()
        self._state: dict[str, Any] | None = None
        self._exhausted = False

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._queue.clear()
        self._exhausted = False
        self.source.reset(None if initial_state is None else initial_state["source"])
        self._state = self.source.state_dict()
        if self._cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

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
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
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


class _TagSeeds(EpochCounting[tuple[Any, int]]):
    """Pair each batch with its seed ``mix_seed(seed, rank, epoch, batch_number)``."""

    COUNTERS = ("batches",)
    _batches: int

    def __init__(self, source: BaseNode[Any], seed: int, rank: int) -> None:
        super().__init__(source)
        self.seed = seed
        self.rank = rank

    def next(self) -> tuple[Any, int]:
        self._started = True
        batch = next(self.source)
        seed = mix_seed(self.seed, self.rank, self._epoch, self._batches)
        self._batches += 1
        return batch, seed


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
        # one per thread and device
        cache: dict[torch.device, torch.Generator] = self._local.__dict__.setdefault(
            "generators", {}
        )
        g = cache.get(device)
        if g is None:
            g = cache[device] = torch.Generator(device=device)
        g.manual_seed(seed)
        return g

    def __call__(self, item: tuple[TensorDictBase, int]) -> TensorDictBase:
        batch, seed = item
        if self.takes_generator:
            out = self.transform(batch, generator=self._generator(batch, seed))
        else:  # its draws from torch's default generators are seeded with the batch's seed
            with seeded_draws(seed):
                out = self.transform(batch)
        if not isinstance(out, TensorDictBase):
            raise TypeError(
                f"the batch transform {self.transform!r} returned {type(out).__name__}; it "
                "must return the (new) TensorDict batch"
            )
        return out


class ApplyTransform(BaseNode[TensorDictBase]):  # type: ignore[misc]  # torchdata: untyped
    """Apply a batch transform, giving it a ``torch.Generator`` seeded per batch.

    The generator (on the batch's device) is seeded with ``mix_seed(seed, rank, epoch,
    batch_number)``, so augmentations are reproducible from ``seed``, differ every epoch and
    across ranks, and are reproduced exactly after a resume. Transforms without a
    ``generator`` parameter are called as ``transform(batch)``, with the draws they make from
    torch's default generators (``torch.rand`` without ``generator=``) taken from generators
    seeded with the same seed instead (``accelfn.data.rng.seeded_draws``): never from torch's
    global generators, which the training loop draws from. The plain callables inside a
    [`Compose`][] are seeded likewise, from the generator it is given.

    With ``num_workers > 0`` the transform runs on that many batches at once in worker threads
    (a [`PoolMapper`][], in order): for host (CPU) batches, whose
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
        batch: TensorDictBase = next(self._inner)
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"inner": self._inner.state_dict()}

    def close(self) -> None:
        """Stop the worker threads, if any (a later ``reset()`` starts new ones)."""
        if self._pool is not None:
            self._pool.close()


class _Raised:
    """An exception raised below the threads, carried up as an item (the object itself)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class CatchErrors(BaseNode[Any]):  # type: ignore[misc]  # torchdata: untyped
    """Below a ``Prefetcher`` or ``PinMemory``: an exception of the source is returned as an
    item holding the exception object (for :class:`RaiseErrors` above the threads to raise),
    then the node ends (``StopIteration``) until its next ``reset()``, as the thread would
    stop.

    torchdata's threads send an exception on as torch's ``ExceptionWrapper``, whose
    ``reraise()`` builds a new one from the formatted traceback ("Caught X in
    _populate_queue..."): the message changes, the attributes are lost, and a class whose
    constructor takes other arguments becomes a ``RuntimeError``. Its state is its source's
    (a position is the same with or without it).
    """

    def __init__(self, source: BaseNode[Any]) -> None:
        super().__init__()
        self.source = source
        self._failed = False

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._failed = False
        self.source.reset(initial_state)

    def next(self) -> Any:
        if self._failed:
            raise StopIteration
        try:
            return next(self.source)
        except StopIteration:
            raise
        except Exception as e:
            self._failed = True
            return _Raised(e)

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.source.state_dict()
        return state


class RaiseErrors(BaseNode[Any]):  # type: ignore[misc]  # torchdata: untyped
    """Above the threads: raise the exception object that :class:`CatchErrors` caught below
    them (its type, message, attributes and notes as the source raised it). Its state is
    its source's."""

    def __init__(self, source: BaseNode[Any]) -> None:
        super().__init__()
        self.source = source

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.source.reset(initial_state)

    def next(self) -> Any:
        item = next(self.source)
        if isinstance(item, _Raised):
            raise item.error
        return item

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.source.state_dict()
        return state


def in_threads(node: BaseNode[Any], *, prefetch: int, pin_memory: bool) -> BaseNode[Any]:
    """``node`` behind a ``Prefetcher`` (``prefetch > 0``) and ``PinMemory`` thread, with
    :class:`CatchErrors` below them and :class:`RaiseErrors` above, so that an exception of
    ``node`` reaches the loop as raised; ``node`` itself if neither applies."""
    if prefetch <= 0 and not pin_memory:
        return node
    node = CatchErrors(node)
    if prefetch > 0:
        node = Prefetcher(node, prefetch_factor=prefetch)
    if pin_memory:
        node = PinMemory(node)
    return RaiseErrors(node)


def resolve_device(device: Any, pin_memory: bool | None) -> tuple[torch.device | None, bool]:
    """The batches' device and whether to pin them, checked: pinning defaults to on exactly
    when batches go to a CUDA device, and needs CUDA."""
    dev = None if device is None else torch.device(device)
    cuda_ok = torch.cuda.is_available()
    if dev is not None and dev.type == "cuda" and not cuda_ok:
        raise ValueError(f"device={device!r} but CUDA is not available; use device='cpu' or None")
    if pin_memory is None:
        return dev, cuda_ok and dev is not None and dev.type == "cuda"
    if pin_memory and not cuda_ok:
        raise ValueError(
            "pin_memory=True needs CUDA, which is not available here; leave pin_memory=None "
            "(pins only when batches go to a CUDA device)"
        )
    return dev, bool(pin_memory)
