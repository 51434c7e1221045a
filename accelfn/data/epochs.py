"""A torchdata node over one source that numbers its epochs and counts within each.

Written here because torchdata's ``BaseNode`` leaves its state to each node: nodes that seed
their random draws by epoch and position (the iterable collator, the seeded batch transform)
must count alike and restore alike, so they share this one base.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from torchdata.nodes import BaseNode

__all__ = ["EpochCounting"]

T = TypeVar("T")


class EpochCounting(BaseNode[T]):  # type: ignore[misc]  # torchdata: untyped
    """Keeps ``epoch`` and the counters named in ``COUNTERS`` (as ``_<name>``) with its
    source's state. ``reset(state)`` restores them exactly; a bare ``reset()`` starts the
    next epoch with the counters at 0, unless nothing was drawn since the last reset (so a
    loader's extra resets do not skip epochs). Subclasses set ``self._started = True`` when
    they draw."""

    COUNTERS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, source: BaseNode[Any]) -> None:
        super().__init__()
        self.source = source
        self._epoch = 0
        self._started = False
        for name in self.COUNTERS:
            setattr(self, f"_{name}", 0)

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

    def mark_started(self) -> None:
        """Count the epoch in progress as begun (the next bare ``reset()`` starts the next)."""
        self._started = True

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "epoch": self._epoch,
                **{name: getattr(self, f"_{name}") for name in self.COUNTERS}}
