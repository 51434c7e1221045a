"""How a TrainState's schedulers are told of progress: stepped per update, told the update
count and the epoch (timm's), or stepped per epoch; and the check that a schedule moving per
epoch hears of each epoch.

A schedule that moves only in ``state.end_epoch()`` (a timm scheduler counting epochs, or any
under ``scheduler_every="epoch"``) stays at its first rate in a loop that never calls it, and
nothing else would say so. ``accelfn.data``'s loader records, at each batch it gives the loop,
which loader it is and how many epochs it began ([`LAST_BATCH`][]); after each update the
state compares that with the batch of the first update since ``end_epoch()``: a later epoch
of the same loader warns, once. Batches of another loader (an evaluation in the middle of an
epoch) do not count. Tested in tests/core/test_timm_schedulers.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["LAST_BATCH", "EpochCheck", "mark", "per_update"]

#: ``(id of the loader, epochs it began)`` of the batch a loader last gave the loop, set by
#: ``accelfn.data``'s loader at each batch.
LAST_BATCH: list[tuple[int, int] | None] = [None]


def mark(scheduler: Any) -> Any:
    """How many times ``scheduler`` was stepped (host state): its ``last_epoch``, or for a
    ``ChainedScheduler`` (which has none) its first scheduler's."""
    chained = getattr(scheduler, "_schedulers", None) or [None]
    last = getattr(scheduler, "last_epoch", None)
    return last if last is not None or chained[0] is None else mark(chained[0])


def per_update(scheduler: Any) -> bool:
    """Whether ``scheduler`` is told the update count (timm's ``step_update(num_updates)``,
    and ``step(epoch)`` after each epoch) instead of being stepped once per update."""
    return callable(getattr(scheduler, "step_update", None))


def _per_epoch(scheduler: Any, every: int | str) -> bool:
    """Whether ``scheduler`` moves only in ``end_epoch()``: a timm scheduler counting epochs
    (``t_in_epochs``, timm's default), or any with ``scheduler_every="epoch"``."""
    if scheduler is None:
        return False
    if per_update(scheduler):
        return bool(getattr(scheduler, "t_in_epochs", True))
    return every == "epoch"


class EpochCheck:
    """Warns once when a per-epoch schedule was not told an epoch of its loader ended."""

    __slots__ = ("active", "first")

    def __init__(self, schedulers: Sequence[Any], every: int | str) -> None:
        self.active = any(_per_epoch(s, every) for s in schedulers)
        self.first: tuple[int, int] | None = None  # LAST_BATCH at the epoch's first update

    def after_update(self, warn_once: Callable[[str, str], None]) -> None:
        """After each real update: warn (``warn_once(key, message)``, the state's) if its
        batch came from a later epoch of the loader that gave the first update since
        ``end_epoch()``."""
        if not self.active:
            return
        seen, first = LAST_BATCH[0], self.first
        if seen is None or first is None or first[0] != seen[0]:
            self.first = seen  # the first update since end_epoch(), or another loader
        elif seen[1] != first[1]:
            warn_once(
                "end_epoch",
                "the loader began another epoch but state.end_epoch() was not called since "
                "the last: this TrainState's scheduler moves once per epoch (a timm scheduler "
                "with t_in_epochs, or scheduler_every='epoch') and stays at its rate until "
                "told. Call state.end_epoch() after each pass over the loader.")

    def ended(self) -> None:
        """``end_epoch()`` was called: the next update starts the count again."""
        self.first = None
