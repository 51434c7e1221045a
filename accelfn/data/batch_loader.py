"""The loader: a re-iterable over a ``torchdata.nodes`` graph, checkpointable and timed.

:class:`BatchLoader` iterates its root node epoch after epoch, with an exact ``state_dict()``
and a record of how long the loop waited for each batch.

A batch whose loading raises (a dataset's ``__getitem__``, a ``sample_transform``, a batch
transform) is retried: the error reaches the loop, the position stays at that batch, and the
next ``next()``, the next ``iter()`` (a ``for batch in loader:`` written again after catching
the error), or an ``iter()`` of a loader resumed there loads it again, so an epoch continued
after an error is whole, never silently short, and never skipped for the next.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from tensordict import TensorDictBase
from torchdata.nodes import BaseNode

from ..core import compat
from ..core.schedulers import LAST_BATCH
from .epochs import reading_state
from .positions import core_node, core_position, staged_position

__all__ = ["STATE_FORMAT", "BatchLoader"]

STATE_FORMAT = "accelfn.data.loader/1"
# no longer part of the checked configuration: the batches do not depend on them
_UNCHECKED = frozenset({"num_workers", "worker_type"})


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
            if owner._closed_at == owner._generation:  # the last change was a close()
                raise RuntimeError(
                    "this iterator is stale: its loader was closed (close() or leaving its "
                    "`with` block) in the middle of the epoch, which stopped its threads and "
                    "workers; call iter(loader) for a new epoch, or close the loader only "
                    "after the epoch"
                )
            raise RuntimeError(
                "this iterator is stale: iter() was called again on its loader, which started "
                "a new epoch; iterate the newest iterator"
            )
        t0 = time.perf_counter()
        try:
            batch = owner._next()
        except StopIteration:
            owner._ended = owner._delivered = True  # the loop heard of the epoch's end
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
        owner._delivered = True
        LAST_BATCH[0] = (id(owner), owner._epochs)  # a per-epoch schedule's check (TrainState)
        return batch


def _nodes(root: BaseNode[Any]) -> Iterator[Any]:
    """Every node of the graph below ``root`` (each once)."""
    seen: set[int] = set()
    todo: list[Any] = [root]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        todo.extend(v for v in vars(node).values() if isinstance(v, BaseNode))


def _stop_threads(root: BaseNode[Any], close_fns: Sequence[Callable[[], None]]) -> None:
    """Stop every background thread of the graph below ``root`` and call ``close_fns``."""
    for node in _nodes(root):
        compat.stop_node_thread(node)
    for fn in close_fns:
        fn()


def _mark_started(root: BaseNode[Any]) -> None:
    """Tell every node of the graph that counts epochs (``mark_started()``) that its epoch
    began, so that the next ``reset()`` starts the next one even if the loop took no batch
    (whether a prefetch thread had pulled one must not decide which epoch comes next)."""
    for node in _nodes(root):
        mark = getattr(node, "mark_started", None)
        if callable(mark):
            mark()


def _finalize(root: BaseNode[Any], close_fns: Sequence[Callable[[], None]]) -> None:
    """:func:`_stop_threads` for a loader that was garbage collected (or at exit).

    The collector runs finalizers in whichever thread allocates at that moment: one of the
    graph's own threads (which cannot join itself), or multiprocessing's resource sharer, whose
    thread hands tensors to worker processes (a pool waiting there for its processes to exit
    would wait for ever). Outside the main thread the stopping is done in a new thread.
    """
    if threading.current_thread() is threading.main_thread():
        _stop_threads(root, close_fns)
        return
    try:
        threading.Thread(target=_stop_threads, args=(root, close_fns),
                         name="accelfn-data-finalize", daemon=True).start()
    except RuntimeError:  # interpreter shutdown: no new threads
        _stop_threads(root, close_fns)


class BatchLoader(Iterable[TensorDictBase]):
    """A re-iterable loader over a ``torchdata.nodes`` graph of TensorDict batches.

    Each ``iter()`` starts the next epoch (or resumes the position given to
    [`load_state_dict`][], or, after a batch failed to load, continues the epoch at that
    batch). Built by [`loader`][]; can also wrap any root node you compose
    yourself.

    Data-wait measurement (read by monitors; the clock is ``time.perf_counter``):

    * ``last_wait_s``: seconds the last ``next()`` blocked before returning its batch (queue
      wait, host-side transfer and transform launch; GPU-side work is asynchronous and not
      included).
    * ``total_wait_s``: sum of those waits since construction or [`reset_timing`][].
    * ``batches``: batches returned since then.
    * ``total_time_s``: wall time of the loop over those batches: the first wait of each
      epoch, then from each return to the next request's return (or to the end of the epoch),
      i.e. loop time excluding time spent outside iteration between epochs.
    * ``wait_share``: ``total_wait_s / total_time_s``, the fraction of the loop spent waiting
      for data (keep it under 0.2: a loop that waits longer is data-bound).

    Args:
        root: the graph's root node, yielding TensorDict batches.
        num_batches: batches per epoch, if known (``len(loader)``).
        config: plain description of the pipeline, stored in the state and checked on load.
        close_fns: called by [`close`][] (e.g. to stop worker processes).
        portable_position: the graph is one that [`loader`][] or [`from_dataloader`][]
            build: a position loads whatever stages carry the batches (``prefetch``,
            ``pin_memory``, ``device``, where the transform runs), and is checked when loaded.
    """

    def __init__(
        self,
        root: BaseNode[TensorDictBase],
        *,
        num_batches: int | None = None,
        config: Mapping[str, Any] | None = None,
        close_fns: Sequence[Callable[[], None]] = (),
        portable_position: bool = False,
    ) -> None:
        self.root = root
        self._portable = portable_position
        self.num_batches = num_batches
        self.config = dict(config or {})
        self._close_fns = tuple(close_fns)
        self._pending_state: dict[str, Any] | None = None
        self._pending_ended = True
        # Whether the current epoch's StopIteration reached the caller; and whether this
        # epoch is a resumed position at an epoch's end that the caller had not heard of
        # (it yields nothing: the loop runs its end-of-epoch code, then the next iter()).
        self._ended = False
        self._empty = False
        # Whether an epoch was begun by iter(), and whether the loop received anything of it.
        self._begun = False
        self._delivered = False
        self._epochs = 0  # epochs begun by a bare iter() (not a resumed or continued one)
        self._closed_at = -1
        self._peeked: TensorDictBase | None = None
        self._peek_state: dict[str, Any] | None = None
        self._generation = 0
        # The root's state before the batch whose loading raised: the position reported,
        # and where the next next() starts again (the nodes may have moved past the batch,
        # or stopped their threads, when it raised).
        self._failed_at: Any = None
        self._active = False
        self._read_start: dict[str, Any] | None = None
        self.last_wait_s = 0.0
        self.total_wait_s = 0.0
        self.total_time_s = 0.0
        self.batches = 0
        self._last_return: float | None = None
        # Background threads (prefetching, pinning) must stop before the interpreter tears
        # down torch, or a thread still inside an op aborts the process at exit.
        weakref.finalize(self, _finalize, root, self._close_fns)

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> _Iterator:
        self._generation += 1
        self._last_return = None
        self._peeked = self._peek_state = None
        self._ended = self._empty = False
        failed, self._failed_at = self._failed_at, None
        state, self._pending_state = self._pending_state, None
        ended, self._pending_ended = self._pending_ended, True
        if state is None and failed is not None:
            # a batch of the epoch in progress failed to load and the loop was written again
            # (`for batch in loader:` after catching the error): continue the epoch there
            state, ended = failed, False
        if state is None and self._read_start is not None:
            # state_dict() started the nodes only to read them: start them for real, at that
            # position (which makes the random draws that the read put back).
            state = self._read_start
        self._read_start = None
        if state is None:
            if self._begun and not self._delivered:
                _mark_started(self.root)
            self.root.reset(None)
            self._epochs += 1
        else:
            self.root.reset(state)
            # A position saved right after an epoch's last batch: if the loop had heard of
            # the epoch's end, resume at the next epoch; if not, this epoch is that end.
            before = self.root.state_dict()
            try:
                self._peeked = next(self.root)
                self._peek_state = before
            except StopIteration:
                if ended:
                    self.root.reset(None)
                else:
                    self._empty = True
                    self._peek_state = before
            except BaseException:
                # the batch at the position failed to load: the next iter() retries it
                self._pending_state, self._pending_ended = state, ended
                raise
        self._active = self._begun = True
        self._delivered = False
        return _Iterator(self, self._generation)

    def _next(self) -> TensorDictBase:
        if self._empty:
            raise StopIteration
        if self._peeked is not None:
            batch, self._peeked, self._peek_state = self._peeked, None, None
            return batch
        if self._failed_at is not None:  # retry the batch whose loading raised
            self.root.reset(self._failed_at)
            self._failed_at = None
        before = self.root.state_dict()
        try:
            out: TensorDictBase = next(self.root)
        except StopIteration:
            raise
        except BaseException:
            self._failed_at = before
            raise
        return out

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("the number of batches per epoch is unknown (iterable source)")
        return self.num_batches

    # -- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch returned, as plain data (ints, strings, dicts).

        (With ``rng=DataLoaderRNG(generator=g)`` it also holds ``g``'s state, a uint8 tensor.)

        ``"ended"`` says whether the epoch's end (its ``StopIteration``) had reached the loop:
        a position taken right after an epoch's last batch, before that, resumes with that
        end (the first ``iter()`` yields no batch, so the loop's end-of-epoch code runs once,
        as it would have); one taken after it resumes at the next epoch.

        Safe to ``torch.save`` and to load with ``torch.load(..., weights_only=True)``. Loading
        it into an identically configured loader and iterating yields exactly the batches an
        uninterrupted run would have yielded next (including the next epoch's, if it was taken
        at the end of an epoch). It is a read: it changes no random number generator, also
        before the first ``iter()`` (when the nodes are started to be read).
        """
        root: Any
        ended = self._ended
        if self._pending_state is not None:
            root, ended = self._pending_state, self._pending_ended
        elif not self._active:
            if self._read_start is None:
                # The nodes' state only exists once they are reset: start them to read it
                # (the next iter() starts them again at this position).
                with reading_state():
                    self.root.reset(None)
                    self._read_start = self.root.state_dict()
            root = self._read_start
        elif self._failed_at is not None:
            root = self._failed_at
        elif self._peek_state is not None:
            root = self._peek_state
        else:
            root = self.root.state_dict()
        return {"format": STATE_FORMAT, "config": dict(self.config), "root": root,
                "ended": ended}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from [`state_dict`][] at the next ``iter()``.

        Raises:
            ValueError: the state is not a loader state, or was saved by a loader with a
                different configuration (dataset size, batch size, seed, sharding, ...).
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not an accelfn.data loader state (expected format {STATE_FORMAT!r}); pass "
                "what BatchLoader.state_dict() returned"
            )
        # positions written before the workers left the checked configuration name them
        saved = {k: v for k, v in dict(state.get("config", {})).items() if k not in _UNCHECKED}
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
        if "root" not in state:
            raise ValueError(
                "the loader state has no 'root' entry; pass what BatchLoader.state_dict() "
                "returned"
            )
        # Positions written before "ended" existed resumed an epoch's end at the next epoch.
        ended = state.get("ended", True)
        if not isinstance(ended, bool):
            raise ValueError(
                f"the loader state's 'ended' entry is {ended!r}; it must be True or False "
                "(whether the epoch's end had reached the loop): pass what "
                "BatchLoader.state_dict() returned"
            )
        root = state["root"]
        if self._portable:
            position = core_position(root)
            check = getattr(core_node(self.root), "check_state", None)
            if callable(check):  # a malformed position is refused now, before anything changes
                check(position.core)
            root = staged_position(self.root, position)
        self._pending_state = root
        self._pending_ended = ended
        self._peeked = self._peek_state = self._failed_at = None
        self._read_start = None

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
        iterated (they restart with the next epoch); an iterator of the epoch in progress is
        stale (its ``next()`` raises). Also done at interpreter exit."""
        self._generation += 1
        self._closed_at = self._generation
        _stop_threads(self.root, self._close_fns)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"BatchLoader({items})"

