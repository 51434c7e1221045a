"""Regional compilation: the code of the model's repeated blocks (found by [`find_blocks`][],
as ``checkpointed`` and FSDP2 find them) compiled once, so compile time does not grow with
depth. Two ways, both torch's own:

* **In place** (``regional=True``, torch's *regional compilation* recipe): each block's forward
  is compiled where it sits, inside the wrappers and per-block hooks that activation
  checkpointing and sharding put there, and the rest of the model (embeddings, final norm,
  head) runs eager. All blocks run through one compiled function whose code dynamo caches once
  for every block of a class. The cheapest compile: only a block's graph is compiled.
* **Nested** (``regional="nested"``, torch's *hierarchical compilation*): the whole model is
  compiled, every block a ``torch.compiler.nested_compile_region`` traced and compiled once and
  called for each block, so the step runs as one graph at the whole model's speed; the compile
  also covers the rest of the model and the regions' bookkeeping. Under DDP or FSDP2 (a
  compile of a sharded whole model traces the sharding's hooks), with a backend that does not
  compile through AOTAutograd (``"eager"``: torch's invoke_subgraph, run as traced, traces its
  region again at every call to build its schema) and for blocks that update running
  statistics in training (BatchNorm's: torch's nested regions refuse their buffer updates),
  the blocks are compiled in place instead, with a note saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from ..core.modules import find_blocks, inner_forward, running_stat_modules, wrap_forward
from ..core.state import TrainState

__all__ = ["Regional", "check", "in_place_reason", "wrap_blocks"]

# What compiled(regional=...) takes: False, True (in place) or "nested".
Regional = bool | Literal["nested"]
# The backends that compile a nested region once (AOTAutograd's); others: blocks in place.
_NESTING = frozenset({"inductor", "aot_eager", "aot_eager_decomp_partition"})


def _call_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The region compiled for each block: its forward, with the wrappers of earlier phases
    (activation checkpointing) inside it and its module hooks (FSDP2's) outside."""
    return forward(*args, **kwargs)


def _run_compiled(module: nn.Module, forward: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> Any:
    return module.__dict__["_accelfn_compiled"](forward, *args, **kwargs)


def _block_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The nested region: ``module``'s forward with the wrappers of earlier phases inside,
    reached through ``module`` so that each block's parameters are the region's inputs (a
    forward bound to one block would be replayed with that block's weights for all)."""
    return inner_forward(module, "compile")(*args, **kwargs)


# Hierarchical compilation: inside a whole-model torch.compile, every block runs through this
# one nested compile region, traced and compiled once and called for each block.
_NESTED = torch.compiler.nested_compile_region(_block_forward)


def _run_nested(module: nn.Module, forward: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    return _NESTED(module, *args, **kw)


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks a regional compile compiles, refused with the fix when there are none."""
    found = find_blocks(model)
    if not found:
        raise ValueError(
            f"compiled(regional=...) found no repeated blocks in {type(model).__name__} "
            "(children of an nn.ModuleList or nn.Sequential that share a class and have "
            "parameters); use compiled() to compile the whole model")
    return found


def in_place_reason(model: nn.Module, mode: Regional, sharded: bool,
                    backend: str) -> str | None:
    """Why ``model``'s blocks are compiled in place under ``regional=mode`` ("" when that is
    what was asked for), or None when they become nested regions."""
    if mode is True:
        return ""
    if sharded:
        return ("the model is sharded (DDP/FSDP2), and a whole-model compile would trace the "
                "sharding's hooks")
    if backend not in _NESTING:
        return (f"backend={backend!r} does not compile through AOTAutograd, so a nested region "
                "would be traced again at every call")
    if any(running_stat_modules(b) for _, b in blocks(model)):
        return ("the blocks update running statistics in training (BatchNorm), which torch's "
                "nested regions refuse")
    return None


def wrap_blocks(model: nn.Module, kwargs: dict[str, Any], done: tuple[Any, ...]) -> None:
    """Each block compiled in place when ``done[0]`` (inside its wrappers and hooks),
    otherwise marked as the nested compile region of a whole-model compile."""
    # One compiled function for all blocks: dynamo keys its code on _call_forward's code and
    # guards on the block's class, not on the block, so blocks of a class share one graph.
    compiled_call = torch.compile(_call_forward, **kwargs) if done[0] else None
    for _, block in blocks(model):
        block.__dict__["_accelfn_regional"] = done
        if compiled_call is not None:
            block.__dict__["_accelfn_compiled"] = compiled_call
        wrap_forward(block, "compile", _run_compiled if done[0] else _run_nested)


def check(state: TrainState, mode: Regional, backend: str, options: str, label: str) -> None:
    """Refuse a regional compile of blocks an earlier step compiled otherwise (in place, they
    hold one compiled function; nested regions hold no options, each step's compile has)."""
    found = blocks(state.model)
    in_place, sharded, before, by = found[0][1].__dict__.get("_accelfn_regional", (None,) * 4)
    if in_place is None:
        return
    here = in_place_reason(state.model, mode, sharded, backend) is not None
    if here != in_place or (here and options != before):
        where = ("as nested regions", "in place")
        raise ValueError(
            f"{label} would compile the blocks {where[here]}, but another step on this "
            f"TrainState compiled them {where[in_place]} with {by} (in place: one compiled "
            "function for every step); use the same compiled(regional=...) options in "
            "every step of a state, or build a new TrainState")
