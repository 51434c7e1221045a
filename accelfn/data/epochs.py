"""The epoch and position protocol of accelfn's torchdata nodes, and the mark of a read start.

Written here because torchdata's ``BaseNode`` leaves its state to each node. Every node that
decides batches or seeds draws by epoch and position keeps the same protocol:

* ``reset(state)`` resumes exactly at a saved position (the epoch and the counters restored);
  the position is inside its epoch, so the next bare ``reset()`` starts the next one;
* a bare ``reset()`` starts the next epoch with the counters at 0, unless nothing was drawn
  since the last reset (so a loader's extra resets do not skip epochs);
* ``mark_started()`` counts the epoch in progress as begun (``BatchLoader`` calls it when a
  position is read before the first batch); a node's ``next()`` sets ``_started`` for the
  same.

Two bases keep it: [`EpochSource`][] for a node that decides batches from nothing but its
settings and a position (the index sampler, the token windows, the packed rows), and
[`EpochCounting`][] for a node over a source whose counters seed its draws (the iterable
collator, the seeded batch transform).

A loader asked for its position before its first ``iter()`` starts its nodes only to read
their state: it does so inside [`reading_state`][], and nodes that draw random numbers at a
start (``DataLoaderRNG``, a wrapped DataLoader) ask [`is_reading_state`][] to put every
generator back and record that the real start must draw.

This module imports nothing of accelfn, so every node module and the loader can import it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, ClassVar, TypeVar

from torchdata.nodes import BaseNode

__all__ = ["EpochCounting", "EpochSource", "is_reading_state", "reading_state"]

T = TypeVar("T")

_reading = threading.local()


@contextlib.contextmanager
def reading_state() -> Iterator[None]:
    """Mark a start of the nodes made only to read their state (``state_dict()`` before the
    first ``iter()``): nodes that draw random numbers at a start (``DataLoaderRNG``, a wrapped
    DataLoader) put every generator back as it was and record that the real start must draw.
    """
    _reading.active = True
    try:
        yield
    finally:
        _reading.active = False


def is_reading_state() -> bool:
    """Whether the calling thread is inside :func:`reading_state`."""
    return bool(getattr(_reading, "active", False))


class EpochSource(BaseNode[T]):  # type: ignore[misc]  # torchdata: untyped
    """A source node with ``epoch`` and ``_batches`` (given so far in the epoch), restored by
    ``reset(state)`` and advanced by a bare ``reset()`` as the module says. Subclasses
    implement ``check_state`` (returning ``(epoch, batches)`` or raising ``ValueError``),
    ``next`` (setting ``self._started = True`` first) and ``get_state``, and may override
    ``_resume`` and ``_begin_epoch``."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self._batches = 0
        self._started = False

    def check_state(self, state: Any) -> tuple[int, int]:
        """``(epoch, batches)`` of a saved state, checked against this node.

        Raises:
            ValueError: not a position of this node.
        """
        raise NotImplementedError

    def _resume(self, state: dict[str, Any]) -> None:
        """Restore what the node holds beyond its counters (they are set already)."""

    def _begin_epoch(self) -> None:
        """Prepare epoch ``self.epoch`` from its start (the counters are set already)."""

    def mark_started(self) -> None:
        """Count the epoch in progress as begun (the next bare ``reset()`` starts the next)."""
        self._started = True

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.epoch, self._batches = self.check_state(initial_state)
            # a restored position is inside an epoch: the next reset() starts a new one
            self._started = True
            self._resume(initial_state)
        else:
            if self._started:
                self.epoch += 1
            self._batches, self._started = 0, False
            self._begin_epoch()


class EpochCounting(BaseNode[T]):  # type: ignore[misc]  # torchdata: untyped
    """A node over ``source`` keeping ``epoch`` (as ``_epoch``) and the counters named in
    ``COUNTERS`` (as ``_<name>``) with its source's state, restored by ``reset(state)`` and
    advanced by a bare ``reset()`` as the module says (resetting its source alike).
    Subclasses set ``self._started = True`` when they draw."""

    COUNTERS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, source: BaseNode[Any]) -> None:
        super().__init__()
        self.source = source
        self._epoch = 0
        self._started = False
        for name in self.COUNTERS:
            setattr(self, f"_{name}", 0)

    def mark_started(self) -> None:
        """Count the epoch in progress as begun (the next bare ``reset()`` starts the next)."""
        self._started = True

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.source.reset(initial_state["source"])
            self._epoch = int(initial_state["epoch"])
            counts = {name: int(initial_state[name]) for name in self.COUNTERS}
            self._started = True
        else:
            self.source.reset()
            if self._started:
                self._epoch += 1
            counts = dict.fromkeys(self.COUNTERS, 0)
            self._started = False
        for name, value in counts.items():
            setattr(self, f"_{name}", value)

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "epoch": self._epoch,
                **{name: getattr(self, f"_{name}") for name in self.COUNTERS}}
