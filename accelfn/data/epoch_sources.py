"""A torchdata source node that numbers its epochs and counts the batches given in each.

Written here because torchdata's ``BaseNode`` leaves its state to each node. The nodes that
decide batches from nothing but their settings and a position (the index sampler, the token
windows, the packed rows) keep the same protocol, and keep it in this one base:

* ``reset(state)`` resumes exactly at a saved position: ``check_state(state)`` validates it
  and gives ``(epoch, batches)``, then ``_resume(state)`` restores what else it holds;
* a bare ``reset()`` starts the next epoch with the batch count at 0, unless nothing was
  drawn since the last reset (so a loader's extra resets do not skip epochs), then
  ``_begin_epoch()`` prepares it;
* ``mark_started()`` counts the epoch in progress as begun (``BatchLoader`` calls it when a
  position is read before the first batch); ``next()`` sets ``_started`` for the same.

``accelfn.data.epochs.EpochCounting`` is the same protocol for a node over a source.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torchdata.nodes import BaseNode

__all__ = ["EpochSource"]

T = TypeVar("T")


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
