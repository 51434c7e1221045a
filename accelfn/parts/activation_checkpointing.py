"""Activation checkpointing per block, optionally selective (op-level), or activation
offload to the host (kept, not recomputed): ``checkpointed``'s options and its calls (the
blocks wrapped in place when preparing; the scope of a call of the step function, in which
the blocks run with this step's settings, whichever submodule or method the function calls).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)
from torch.utils.checkpoint import (
    checkpoint as torch_checkpoint,
)

from ..core.contexts import CallContext, Prepared
from ..core.modules import find_blocks, running_stat_modules, wrap_forward
from ..core.state import TrainState

__all__ = ["COMPUTE_INTENSIVE_OPS", "BlockSpec", "Checkpointing", "Offload", "check", "scope",
           "wrap"]

_SLOT = "checkpointed"

BlockSpec = str | tuple[type, ...] | type | Callable[[str, nn.Module], bool]
Offload = Literal["cpu"]

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps ("compute"): recomputing them costs most.
COMPUTE_INTENSIVE_OPS = (
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
)


def _select(model: nn.Module, blocks: BlockSpec) -> list[tuple[str, nn.Module]]:
    if blocks == "auto":
        return find_blocks(model)
    chosen: list[tuple[str, nn.Module]]
    if isinstance(blocks, (type, tuple)):
        types_ = blocks if isinstance(blocks, tuple) else (blocks,)
        chosen = [(n, m) for n, m in model.named_modules()
                  if n and any(isinstance(m, t) for t in types_)]
    elif callable(blocks):
        predicate: Callable[[str, nn.Module], bool] = blocks
        chosen = [(n, m) for n, m in model.named_modules() if n and predicate(n, m)]
    else:
        raise ValueError(f"checkpointed(blocks={blocks!r}) is not understood")
    names = [n for n, _ in chosen]
    return [(n, m) for n, m in chosen if not any(n.startswith(o + ".") for o in names if o != n)]


def _ops(selective: Iterable[Any]) -> tuple[Any, ...]:
    """The op overloads of ``selective``: an overload as given (``torch.ops.aten.mm.default``),
    every overload of a packet (``torch.ops.aten.mm``: the policy is asked about overloads, so
    a packet would never match)."""
    if isinstance(selective, (str, bytes)) or not isinstance(selective, Iterable):
        raise TypeError(f"checkpointed(selective={selective!r}) takes True, False or a list of "
                        "ops to keep, e.g. selective=[torch.ops.aten.mm.default]")
    ops: list[Any] = []
    for op in selective:
        if hasattr(op, "overloadpacket"):
            ops.append(op)
        elif callable(getattr(op, "overloads", None)) and hasattr(op, "default"):
            ops.extend(getattr(op, name) for name in op.overloads())
        else:
            raise TypeError(f"checkpointed(selective=[..., {op!r}, ...]): {op!r} is not an op; "
                            "give torch ops, e.g. [torch.ops.aten.mm.default, "
                            "torch.ops.aten.addmm]")
    return tuple(ops)


def _policy(save: Iterable[Any]) -> Callable[..., CheckpointPolicy]:
    keep = frozenset(save)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _KeepRunningStats:
    """The recompute context: the running statistics a recompute's training-mode forward
    updates a second time are put back as the original forward left them. ``__exit__`` runs
    also when the recompute stops early (torch raises inside it once it has every saved
    tensor). Re-enterable: a graph kept with ``retain_graph`` recomputes once per backward.
    ``inner`` (selective checkpointing's recompute mode) is entered inside, so the copies made
    here are not seen as recomputed ops."""

    def __init__(self, modules: tuple[nn.Module, ...],
                 inner: contextlib.AbstractContextManager[Any] | None = None) -> None:
        self.modules = modules
        self.inner = inner
        self.saved: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def __enter__(self) -> None:
        with torch.no_grad():
            self.saved.append([(buf, buf.clone()) for m in self.modules if m.training
                               for buf in m.buffers(recurse=False)])
        if self.inner is not None:
            try:
                self.inner.__enter__()
            except BaseException:
                self.saved.pop()
                raise

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.inner is not None:
                self.inner.__exit__(*exc)
        finally:
            with torch.no_grad():
                for buf, value in self.saved.pop():
                    buf.copy_(value)


def _bound(forward: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``forward`` with the block's keyword arguments bound, so that none of them (``debug``,
    ``context_fn``, ``determinism_check``...) is taken by ``torch.utils.checkpoint`` itself."""
    return functools.partial(forward, **kwargs) if kwargs else forward


class _Running:
    """The key of the checkpointed options whose step's model is running (None: no step's)."""

    def __init__(self) -> None:
        self.key: int | None = None  # an instance attribute from the start: dynamo guards it


_RUNNING = _Running()
# checkpointed options -> their key: equal options, one key (compiled code is reused)
_KEYS: dict[Any, int] = {}
_UNHASHABLE = itertools.count(-1, -1)  # keys of options that cannot be a dict key


def _key(options: tuple[Any, ...]) -> int:
    try:
        return _KEYS.setdefault(options, len(_KEYS) + 1)
    except TypeError:  # an unhashable blocks predicate: a key of its own
        return next(_UNHASHABLE)


class _Scope:
    """The scope of one call of a checkpointed step's function: this preparation is the one
    running, so that each block's wrapper runs with the settings of this step's
    ``checkpointed(...)`` whichever submodule or method of the model the function calls
    (steps of other options on the same state, or none, keep theirs)."""

    __slots__ = ("key", "previous")

    def __init__(self, key: int) -> None:
        self.key = key
        self.previous: int | None = None

    def __enter__(self) -> None:
        self.previous = _RUNNING.key
        _RUNNING.key = self.key

    def __exit__(self, *exc: object) -> None:
        _RUNNING.key = self.previous


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (a Linear saves ``weight.t()``): on the device anyway."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _offloaded(module: nn.Module, forward: Callable[..., Any], *args: Any,
               **kwargs: Any) -> Any:
    """``forward`` under ``torch.autograd.graph.save_on_cpu``: what its ops save for the
    backward is copied to the host (pinned, asynchronously, from an accelerator) and back in
    the backward. Parameters are kept as they are: they stay on the device anyway."""
    device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)),
                  None)
    if device is None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
    # pin_memory=True on every device: on an accelerator the copies are asynchronous (an
    # unpinned one is a host sync); on the CPU (device_type "cuda": pinned only where CUDA is)
    # the same copies are made, so CPU tests run the accelerator's code
    hooks = torch.autograd.graph.save_on_cpu(
        pin_memory=True, device_type="cuda" if device.type == "cpu" else device.type)
    pack, unpack = hooks.pack_hook, hooks.unpack_hook

    def pack_activation(tensor: torch.Tensor) -> tuple[bool, Any]:
        return (True, tensor) if _is_parameter(tensor) else (False, pack(tensor))

    def unpack_activation(packed: tuple[bool, Any]) -> torch.Tensor:
        kept, value = packed
        return value if kept else unpack(value)  # type: ignore[no-any-return]

    with torch.autograd.graph.saved_tensors_hooks(pack_activation, unpack_activation):
        return forward(*args, **kwargs)


def _run_checkpointed(module: nn.Module, forward: Callable[..., Any], *args: Any,
                      **kwargs: Any) -> Any:
    # the settings of the running step's preparation (None: it does not checkpoint here)
    settings = module.__dict__["_accelfn_ckpt"].get(_RUNNING.key)
    if settings is None or not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if settings[2] is not None:  # offload: nothing recomputed, running statistics once
        return _offloaded(module, forward, *args, **kwargs)
    save: tuple[Any, ...] | None = settings[0]
    # Under torch.compile the recompute is the partitioner's, inside the graph, which applies
    # buffer mutations once; context_fn must there be a pair of TorchDispatchModes.
    stats: tuple[nn.Module, ...] = () if torch.compiler.is_compiling() else settings[1]
    if save is None and not stats:
        return torch_checkpoint(_bound(forward, kwargs), *args, use_reentrant=False)

    def context_fn() -> tuple[Any, Any]:
        if save is None:
            return contextlib.nullcontext(), _KeepRunningStats(stats)
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
            _policy(save))
        return forward_ctx, (_KeepRunningStats(stats, recompute_ctx) if stats else recompute_ctx)

    return torch_checkpoint(_bound(forward, kwargs), *args, use_reentrant=False,
                            context_fn=context_fn)




@dataclass(frozen=True, slots=True, repr=False)
class Checkpointing:
    """``checkpointed``'s options: the ``blocks`` (``"auto"``, module types or a predicate),
    ``every`` k-th of them, the ops a selective recompute keeps (``save``; None: plain
    checkpointing) or ``offload="cpu"`` (activations kept on the host, none recomputed)."""

    blocks: BlockSpec = "auto"
    every: int = 1
    save: tuple[Any, ...] | None = None
    offload: Offload | None = None
    # the key the blocks keep this preparation's settings under: equal options, one key
    key: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        blocks, every, offload = self.blocks, self.every, self.offload
        if isinstance(blocks, nn.Module):
            raise TypeError(f"checkpointed(blocks=...) got a module instance "
                            f"({type(blocks).__name__}); pass module classes, "
                            "blocks=(MyBlock,), or a predicate(name, module)")
        if not (blocks == "auto" or isinstance(blocks, (type, tuple)) or callable(blocks)):
            raise ValueError(
                f"checkpointed(blocks={blocks!r}) is not understood; use 'auto', module types "
                "or a predicate(name, module)")
        if isinstance(blocks, tuple) and (not blocks
                                          or not all(isinstance(b, type) for b in blocks)):
            raise TypeError("checkpointed(blocks=(...)) takes one or more module classes")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpointed(every={every!r}) must be an int >= 1")
        if offload is not None and offload != "cpu":
            raise ValueError(f"checkpointed(offload={offload!r}) takes 'cpu' (the activations "
                             "of the blocks kept in host memory) or None (recomputed)")
        if offload is not None and self.save is not None:
            raise ValueError("checkpointed(offload='cpu') keeps every activation of the blocks "
                             "on the host and recomputes none, while selective= chooses what a "
                             "recompute keeps; pass one of them")
        object.__setattr__(self, "key", _key((blocks, every, self.save, offload)))

    def __repr__(self) -> str:
        blocks = self.blocks
        parts = [f"blocks={blocks if isinstance(blocks, str) else 'custom'}"]
        if self.every != 1:
            parts.append(f"every={self.every}")
        if self.save is not None:
            parts.append(f"selective={len(self.save)} ops")
        if self.offload is not None:
            parts.append(f"offload={self.offload}")
        return f"checkpointed({', '.join(parts)})"


def saved_ops(selective: bool | Iterable[Any]) -> tuple[Any, ...] | None:
    """The ops a selective recompute keeps: ``True`` the compute-intensive ones, ``False``
    none (None: plain checkpointing), or the op overloads of the list given."""
    if selective is True:
        return COMPUTE_INTENSIVE_OPS
    if selective is False:
        return None
    return _ops(selective)


def check(options: Checkpointing, state: TrainState) -> list[tuple[str, nn.Module]]:
    """The blocks ``options`` choose in the state's model (refused when there are none)."""
    chosen = _select(state.model, options.blocks)
    if not chosen:
        raise ValueError(
            f"checkpointed(blocks={options.blocks!r}) found no block to checkpoint in "
            f"{type(state.model).__name__}; pass blocks=(MyBlock,) or a "
            "predicate(name, module)")
    return chosen


def wrap(options: Checkpointing, prepared: Prepared, state: TrainState) -> Prepared:
    """Prepare: each chosen block's forward wrapped in place, its settings kept under the
    options' key, so that steps of other ``checkpointed(...)`` options (or none) on the same
    state keep theirs."""
    chosen = check(options, state)[::options.every]
    for _, module in chosen:
        module.__dict__.setdefault("_accelfn_ckpt", {})[options.key] = (
            options.save, running_stat_modules(module), options.offload)
        wrap_forward(module, "checkpoint", _run_checkpointed)
    state.slot(_SLOT, lambda: {"blocks": len(chosen)})
    return prepared


def scope(options: Checkpointing, ctx: CallContext) -> _Scope:
    """The scope of one call of the step function: its blocks run with these settings."""
    return _Scope(options.key)
