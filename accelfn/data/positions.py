"""Positions that do not depend on how a pipeline is staged.

A loader's position is its root node's state, nested one level per stage. Some stages only
move batches along — the ``Prefetcher``, ``PinMemory``, ``ToDevice``, the ``Mapper`` or
``PoolMapper`` over the sampler, the ``CatchErrors`` and ``RaiseErrors`` around the threads
(whose state is their source's) — and where the batch transform runs (before the prefetcher
for host batches, after the copy for device ones) depends on ``device``. None of that changes
the batches, so a position saved with one ``prefetch``, ``pin_memory`` or ``device`` must
resume with another (a checkpoint taken on a GPU machine, resumed on a CPU one).

:func:`core_position` reduces a saved state to what determines the batches: the state of the
node that decides them (the sampler, the iterable's batcher, a wrapped DataLoader) and the
batch transform's counters; :func:`staged_position` nests it again for the graph of the
loader that resumes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torchdata.nodes import BaseNode, ParallelMapper, PinMemory, Prefetcher

from .stages import ApplyTransform, CatchErrors, RaiseErrors, ToDevice
from .workers import PoolMapper

__all__ = ["CorePosition", "core_node", "core_position", "staged_position"]

_IT_STATE: str = ParallelMapper.IT_STATE_KEY


class CorePosition(NamedTuple):
    """A position without its staging: the deciding node's state, and the batch transform's
    ``(epoch, batches)`` counters (``None`` without a transform)."""

    core: Any
    transform: tuple[int, int] | None


def _refuse(state: Any, why: str) -> ValueError:
    return ValueError(
        f"the loader position's 'root' entry is not a position of an accelfn loader ({why}; "
        f"got {state!r:.300}); pass what BatchLoader.state_dict() returned"
    )


def core_position(state: Any) -> CorePosition:
    """Strip the staging layers off a saved root state (any staging ``loader()`` builds).

    Raises:
        ValueError: the state is not shaped like a loader's position.
    """
    transform: tuple[int, int] | None = None
    while True:
        if not isinstance(state, dict):
            raise _refuse(state, "a stage's state is not a dict")
        keys = set(state)
        if keys == {"snapshot", "steps_since_snapshot"}:  # Prefetcher, PinMemory
            if state["steps_since_snapshot"] != 0:
                raise _refuse(state, "a prefetched snapshot with steps past it")
            state = state["snapshot"]
        elif keys == {"inner"}:  # ApplyTransform: {"inner": mapper state of _TagSeeds}
            inner = state["inner"]
            tagged = inner.get(_IT_STATE, inner) if isinstance(inner, dict) else None
            tagged = tagged.get("source") if isinstance(tagged, dict) else None
            if (not isinstance(tagged, dict) or "source" not in tagged
                    or not all(isinstance(tagged.get(k), int) for k in ("epoch", "batches"))):
                raise _refuse(state, "the batch transform's counters are missing")
            if transform is not None:
                raise _refuse(state, "two batch transforms")
            transform = (tagged["epoch"], tagged["batches"])
            state = tagged["source"]
        elif keys == {_IT_STATE} or keys == {"source"}:  # Mapper/PoolMapper, ToDevice
            state = state[_IT_STATE] if keys == {_IT_STATE} else state["source"]
        else:
            return CorePosition(state, transform)


def _is_stage(node: BaseNode[Any]) -> bool:
    return isinstance(node, (Prefetcher, PinMemory, ToDevice, ApplyTransform, ParallelMapper,
                             PoolMapper, CatchErrors, RaiseErrors))


def _stages(root: BaseNode[Any]) -> tuple[list[BaseNode[Any]], BaseNode[Any]]:
    """The stages from ``root`` down, and the node below them (the one deciding the batches)."""
    layers: list[BaseNode[Any]] = []
    node = root
    while _is_stage(node):
        layers.append(node)
        node = node.source
    return layers, node


def core_node(root: BaseNode[Any]) -> BaseNode[Any]:
    """The node below ``root``'s stages, whose state :func:`core_position` returns."""
    return _stages(root)[1]


def staged_position(root: BaseNode[Any], position: CorePosition) -> Any:
    """The state of ``root`` for ``position``: the core nested in ``root``'s own stages.

    Raises:
        ValueError: the position has a batch transform's counters and ``root`` no transform,
            or the other way round.
    """
    layers = _stages(root)[0]
    has_transform = any(isinstance(n, ApplyTransform) for n in layers)
    if has_transform != (position.transform is not None):
        raise ValueError(
            "the loader position was saved by a loader "
            f"{'with' if position.transform is not None else 'without'} a batch transform; "
            "build the loader as the saved run did"
        )
    state = position.core
    for layer in reversed(layers):
        if isinstance(layer, (CatchErrors, RaiseErrors)):  # their state is their source's
            continue
        if isinstance(layer, (Prefetcher, PinMemory)):
            state = {"snapshot": state, "steps_since_snapshot": 0}
        elif isinstance(layer, ApplyTransform):
            assert position.transform is not None
            epoch, batches = position.transform
            state = {"inner": {_IT_STATE: {"source": {
                "source": state, "epoch": epoch, "batches": batches}}}}
        elif isinstance(layer, ToDevice):
            state = {"source": state}
        else:  # Mapper / PoolMapper
            state = {_IT_STATE: {"source": state}}
    return state
