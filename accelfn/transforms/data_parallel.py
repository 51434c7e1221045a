"""distributed: DDP or FSDP2 under torchrun; a no-op in a single process."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import nn

from ..core import compat
from ..core.engine import LossFn, Step
from ..core.modules import find_blocks
from ..core.places import Sharding
from ..core.processes import init_distributed, world_size
from ..core.protocol import CallContext, Prepared, Transform, UpdateContext, configure
from ..core.state import TrainState

__all__ = ["distributed"]

_STRATEGIES = ("ddp", "fsdp")
_COMPRESSION = (None, "fp16", "bf16", "powersgd")


def _ddp(model: nn.Module, device: torch.device, static_graph: bool,
         compression: str | None, bucket_cap_mb: float | None,
         find_unused_parameters: bool) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    kwargs: dict[str, Any] = {"gradient_as_bucket_view": True, "static_graph": static_graph,
                              "find_unused_parameters": find_unused_parameters}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    ddp = DistributedDataParallel(model, **kwargs)
    _no_buffer_sync_without_grad(ddp)
    if compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif compression == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif compression == "powersgd":
        hook_state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                start_powerSGD_iter=2)
        ddp.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
    return ddp


def _no_buffer_sync_without_grad(ddp: nn.Module) -> None:
    """DDP broadcasts rank 0's buffers (BatchNorm statistics) before a forward that follows a
    training forward, evaluation included: a collective that evaluating on the main process
    only waits for forever. A forward without gradients skips it, and leaves DDP's flag as
    it found it, so the next training forward synchronises on every process alike."""
    saved: list[bool] = []

    def before(module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            saved.append(bool(getattr(module, "require_forward_param_sync")))  # noqa: B009
            setattr(module, "require_forward_param_sync", False)  # noqa: B010

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if saved:
            setattr(module, "require_forward_param_sync", saved.pop())  # noqa: B010

    ddp.register_forward_pre_hook(before)
    ddp.register_forward_hook(after, always_call=True)


def _fsdp(model: nn.Module, state: TrainState, param_dtype: torch.dtype | None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    before = {id(p): name for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for _, block in find_blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    after = dict(model.named_parameters())
    # fully_shard swaps parameters for DTensor ones: point the optimizer at them.
    for optimizer in state.optimizers:
        for group in optimizer.param_groups:
            group["params"] = [after[before[id(p)]] for p in group["params"]]


def _check_fsdp_optimizers(state: TrainState) -> None:
    """Refuse what FSDP2's sharded parameters cannot train correctly, before any change."""
    for optimizer in state.optimizers:
        if optimizer.state:
            raise ValueError("distributed(strategy='fsdp') must shard the model before the "
                             "optimizer has state; build the step before loading a checkpoint")
        muon = getattr(torch.optim, "Muon", None)
        if muon is not None and isinstance(optimizer, muon):
            raise ValueError(
                "torch.optim.Muon cannot train FSDP2-sharded parameters: its Newton-Schulz "
                "orthogonalisation needs each whole matrix, and each process holds a shard of "
                "it. Use distributed(strategy='ddp') with Muon, or AdamW for sharded training")


def _all_reduce_grads(model: nn.Module, group: Any) -> None:
    """Average the gradients over the processes, as DDP's synced backward does, for
    gradients accumulated under ``no_sync`` that no synced backward followed (a window that
    ``step.flush`` closes). One all-reduce; a gradient that no process has stays None."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    device = params[0].device
    flat = torch.cat([*[(p.grad if p.grad is not None else torch.zeros_like(p))
                        .detach().reshape(-1).to(torch.float32) for p in params],
                      torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                                   device=device)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    world = dist.get_world_size(group)
    total = sum(p.numel() for p in params)
    present = flat[total:].tolist()  # one host read, at a flush only
    offset = 0
    for p, has in zip(params, present):
        n = p.numel()
        if has:
            grad = flat[offset:offset + n].view_as(p).div_(world).to(p.dtype)
            if p.grad is not None:
                p.grad.copy_(grad)  # in place: DDP's bucket views stay views
            else:
                p.grad = grad
        offset += n


def _distributed(strategy: str, static_graph: bool, compression: str | None,
                 sync_batchnorm: bool, bucket_cap_mb: float | None, fsdp_sync: str,
                 find_unused_parameters: bool) -> Transform:
    # models whose last backward ran without gradient synchronisation (no_sync): an update
    # that follows it without a synced backward (step.flush) must reduce them itself
    unsynced: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

    def shard(prepared: Prepared, state: TrainState) -> Prepared:
        init_distributed()
        if world_size() == 1:
            return prepared
        device = prepared.device
        expected = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
        if device.type != expected.type or (device.type == "cuda" and device != expected):
            raise ValueError(
                f"the model is on {device} but this process trains on {expected}; move it "
                "with model.to(accelfn.init_distributed()) before building the TrainState")
        model = prepared.model
        if sync_batchnorm:
            if device.type != "cuda":
                raise ValueError(
                    "distributed(sync_batchnorm=True) needs CUDA devices: SyncBatchNorm has no "
                    "CPU implementation; leave it off when training on CPUs")
            converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
            if converted is not model:
                raise ValueError("sync_batchnorm cannot convert a model that is itself a "
                                 "BatchNorm")
        if strategy == "ddp":
            model = _ddp(model, device, static_graph, compression, bucket_cap_mb,
                         find_unused_parameters)
        else:  # the islands phase (with_amp) set the compute dtype: FSDP's parameter dtype
            _check_fsdp_optimizers(state)
            _fsdp(model, state, prepared.compute_dtype)
        return dataclasses.replace(prepared, model=model, process_group=dist.group.WORLD)

    def micro_context(ctx: CallContext, index: int,
                      sync: bool) -> contextlib.AbstractContextManager[Any]:
        model = ctx.model
        if sync or ctx.distributed is None:
            if strategy == "fsdp" and ctx.distributed is not None:
                _root(model).set_requires_gradient_sync(True)
            unsynced.pop(model, None)
            return contextlib.nullcontext()
        if strategy == "ddp":
            if static_graph:  # torch's static graph breaks under no_sync (an internal
                # assert, then gradients never reduced): all-reduce every micro-batch, exact
                # too (what is reduced already is equal on every process)
                return contextlib.nullcontext()
            unsynced[model] = True
            no_sync: contextlib.AbstractContextManager[Any] = getattr(model, "no_sync")()  # noqa: B009
            return no_sync
        if fsdp_sync == "once":
            unsynced[model] = True
            _root(model).set_requires_gradient_sync(False)
        return contextlib.nullcontext()

    def reduce(ctx: UpdateContext) -> None:
        # Processes averaged sum(coef * grad) over the world; the engine divides by the local
        # weight. Make the divisor global weight / world, so the result is the exact
        # full-batch gradient over all processes' samples (or tokens).
        if ctx.distributed is None:
            return
        if unsynced.pop(ctx.model, False):  # step.flush of a window's unsynced gradients
            if strategy == "fsdp":
                raise ValueError(
                    "step.flush(state) cannot apply this window: distributed(strategy='fsdp', "
                    "fsdp_sync='once') left its gradients unsharded and unreduced. Use "
                    "fsdp_sync='every' with with_accumulation(n, mode='calls')")
            _all_reduce_grads(ctx.state.model, ctx.distributed)
        if ctx.divisor is None:
            return
        total = ctx.divisor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.distributed)
        ctx.weight_total = total
        ctx.divisor = total / world_size()

    def abort(ctx: CallContext) -> None:
        # A failed call: the engine cleared the gradients the optimizer holds. FSDP2 also
        # keeps the unreduced gradients of micro-batches that skipped reduce-scatter
        # (fsdp_sync='once') on its unsharded parameters: drop them too, or they would join
        # the next update. Failure path only: nothing on the hot path, no host read.
        if ctx.distributed is None:
            return
        unsynced.pop(ctx.model, None)
        root = _root(ctx.model)
        compat.fsdp_drop_unreduced_grads(root)
        root.set_requires_gradient_sync(True)

    # DDP keeps nothing the engine's zero_grad does not clear
    part = Sharding(shard, micro_context, reduce, abort=abort if strategy == "fsdp" else None)

    parts = [strategy]
    if compression:
        parts.append(f"compression={compression}")
    if static_graph:
        parts.append("static_graph")
    if sync_batchnorm:
        parts.append("sync_batchnorm")
    return Transform(
        "distributed", part,
        options=(("strategy", strategy), ("static_graph", static_graph),
                 ("compression", compression), ("sync_batchnorm", sync_batchnorm),
                 ("bucket_cap_mb", bucket_cap_mb), ("fsdp_sync", fsdp_sync),
                 ("find_unused_parameters", find_unused_parameters)),
        label=f"distributed({', '.join(parts)})")


def _root(model: nn.Module) -> Any:
    return compat.unwrap_compiled(model)


@overload
def distributed(fn: LossFn | Step, /) -> Step: ...
@overload
def distributed(*, strategy: str = "ddp", static_graph: bool = False,
                compression: str | None = None, sync_batchnorm: bool = False,
                bucket_cap_mb: float | None = None, fsdp_sync: str = "every",
                find_unused_parameters: bool = False) -> Transform: ...
def distributed(
    fn: LossFn | Step | None = None,
    /,
    *,
    strategy: str = "ddp",
    static_graph: bool = False,
    compression: str | None = None,
    sync_batchnorm: bool = False,
    bucket_cap_mb: float | None = None,
    fsdp_sync: str = "every",
    find_unused_parameters: bool = False,
) -> Step | Transform:
    """Equivalent to ``DistributedDataParallel(model, gradient_as_bucket_view=True)`` (or
    FSDP2 ``fully_shard`` on each repeated block and on the root) under torchrun, with
    ``no_sync()`` on every micro-batch but the last; a no-op in a single process.

    The update equals single-process training on all processes' batches together: micro-batch
    weights (samples, or the returned ``"weight"``) are summed across processes on the device.
    ``compression`` registers DDP's ``fp16``/``bf16`` compression or ``powersgd`` hook;
    ``sync_batchnorm`` converts BatchNorm layers to SyncBatchNorm. ``static_graph`` all-reduces
    every micro-batch (DDP's static graph does not support ``no_sync``). With FSDP2,
    ``fsdp_sync="every"`` reduce-scatters each micro-batch (least memory) and ``"once"``
    only the last (least communication); ``with_amp``'s dtype becomes the parameter dtype,
    with reductions in fp32.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"distributed(strategy={strategy!r}) is unknown; use one of "
                         f"{_STRATEGIES}")
    if compression not in _COMPRESSION:
        raise ValueError(f"distributed(compression={compression!r}) is unknown; use one of "
                         f"{_COMPRESSION}")
    if fsdp_sync not in ("every", "once"):
        raise ValueError(f"distributed(fsdp_sync={fsdp_sync!r}) must be 'every' or 'once'")
    if strategy == "fsdp":
        given = [name for name, value in (
            ("compression", compression), ("static_graph", static_graph),
            ("bucket_cap_mb", bucket_cap_mb),
            ("find_unused_parameters", find_unused_parameters)) if value]
        if given:
            raise ValueError(f"{', '.join(given)}: DDP options, which FSDP2 does not take; "
                             "leave them out with strategy='fsdp'")
    elif fsdp_sync != "every":
        raise ValueError(f"distributed(fsdp_sync={fsdp_sync!r}) is an FSDP2 option; pass "
                         "strategy='fsdp' with it (DDP synchronises once per update)")
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError("distributed(bucket_cap_mb=...) must be > 0")
    return configure("distributed", fn, _distributed(
        strategy, static_graph, compression, sync_batchnorm, bucket_cap_mb, fsdp_sync,
        find_unused_parameters))
