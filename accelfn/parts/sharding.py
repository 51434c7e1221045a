"""Data and model parallelism under torchrun: ``distributed``'s options and its calls in the
update (the model wrapped in DDP or sharded in place by FSDP2 when preparing; no gradient sync
but on an update's last micro-batch; the cross-process weight at the reduction; what a failed
call leaves dropped; torch.distributed's failures in accelfn's terms; fault tolerance's vote).
The mechanisms are ``accelfn.parts.distributed``'s modules. A no-op in a single process."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core import compat
from ..core.contexts import CallContext, Prepared, UpdateContext
from ..core.processes import init_distributed, ray_train_device, world_size
from ..core.state import TrainState
from .distributed import ft
from .distributed.ddp import Replicated, all_reduce_grads, wrap_ddp
from .distributed.errors import Translating, translate
from .distributed.fsdp import (
    check_optimizers,
    parameter_names,
    repoint_optimizers,
    root_call,
    shard_fsdp,
)
from .distributed.mesh import build_mesh, data_mesh, layout
from .distributed.muon import shard_muon
from .distributed.plans import apply_plan, check_plan, resolve_plan

__all__ = ["Sharding", "abort", "agreed", "commit", "explain", "micro", "reduce", "shard",
           "unsynced_refusal"]

_STRATEGIES = ("ddp", "fsdp", "hsdp")
_COMPRESSION = (None, "fp16", "bf16", "powersgd")
_OFFLOAD = (None, "cpu")


#: models whose last backward ran without gradient synchronisation (no_sync): an update that
#: follows it without a synced backward (step.flush) must reduce them itself
_UNSYNCED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Sharding:
    """``distributed``'s options (see [`distributed`][accelfn.distributed]); checked when
    built, except what needs a process group. The transform compares them by their values
    (a tensor-parallel plan's styles by their class and settings), so steps built alike
    share one preparation."""

    strategy: str = "ddp"
    static_graph: bool = False
    compression: str | None = None
    sync_batchnorm: bool = False
    bucket_cap_mb: float | None = None
    fsdp_sync: str = "every"
    find_unused_parameters: bool = False
    replicate: int | None = None
    tp: int = 1
    plan: Mapping[str, Any] | None = None
    offload: str | None = None
    reshard_after_forward: bool | int | None = None
    fault_tolerance: ft.FaultTolerance | None = None

    def __post_init__(self) -> None:
        if self.plan is not None:
            object.__setattr__(self, "plan", check_plan(self.plan))
        _check(self)

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards the model (``"fsdp"``, ``"hsdp"``), not DDP."""
        return self.strategy != "ddp"

    def values(self) -> tuple[tuple[str, Any], ...]:
        """The options as the transform compares them."""
        return _option_values(self)

    def __repr__(self) -> str:
        return _label(self)


def shard(o: Sharding, prepared: Prepared, state: TrainState) -> Prepared:
    """Prepare: the model wrapped in DDP or sharded in place by FSDP2 (tensor parallel
    first), the optimizers pointed at the shards; nothing in one process."""
    if o.fault_tolerance is not None:
        return _shard_fault_tolerant(o, prepared, state, o.fault_tolerance)
    init_distributed()
    model = prepared.model
    # every refusal first, so that a refused call changes nothing; a plan naming no
    # module is refused in one process too
    resolved = None if o.plan is None else resolve_plan(model, o.plan, o.tp)
    world = world_size()
    if world == 1:
        return prepared
    device = prepared.device
    _check_device(device)
    grid = layout(o.strategy, world, replicate=o.replicate, tp=o.tp,
                  local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    check_optimizers(state.optimizers, o.strategy, o.tp, parameter_names(model))
    if o.sync_batchnorm:
        _sync_batchnorm(model, device)
    with Translating(where=" while the first step wrapped the model"):
        call = _wrap(o, prepared, state, grid, resolved)
    # the model stays the user's: the step function runs as the forward of DDP (over
    # the model) or of the FSDP2 root (the model itself, sharded in place)
    return dataclasses.replace(prepared, call=call, process_group=dist.group.WORLD)


def _wrap(o: Sharding, prepared: Prepared, state: TrainState, grid: Any = None,
          resolved: dict[str, Any] | None = None) -> Any:
    """What runs the step function: DDP over the model, or the model sharded in place by
    FSDP2 (over ``grid``'s data mesh, tensor parallel first with the ``resolved`` plan) and
    run as its root's forward, the optimizers pointed at the shards."""
    model, device = prepared.model, prepared.device
    if not o.fsdp:
        return Replicated(model, lambda: wrap_ddp(
            model, device, o.static_graph, o.compression, o.bucket_cap_mb,
            o.find_unused_parameters))
    # the islands phase (with_amp) set the compute dtype: FSDP's parameter dtype
    before = parameter_names(model)
    mesh = build_mesh(grid, device.type) \
        if grid is not None and (o.strategy == "hsdp" or o.tp > 1) else None
    if resolved is not None:  # tensor parallel first, then FSDP2 over the rest
        assert mesh is not None
        apply_plan(model, mesh["tp"], resolved)
    shard_fsdp(model, None if mesh is None else data_mesh(mesh, grid),
               prepared.compute_dtype, o.offload, o.reshard_after_forward)
    repoint_optimizers(state, model, before)
    shard_muon(state.optimizers)  # Newton-Schulz on whole matrices, one owner each
    return root_call(model)


def _shard_fault_tolerant(o: Sharding, prepared: Prepared, state: TrainState,
                         options: ft.FaultTolerance) -> Prepared:
    # a replica group of torchft: DDP or FSDP2 over this torchrun job's processes (one
    # process included), the gradients (each process' shards) then summed with the same
    # rank of the live groups (ft.Runtime.reduce): HSDP whose replicate dimension is
    # torchft's
    device = prepared.device
    _check_device(device)
    model = prepared.model
    check_optimizers(state.optimizers, o.strategy, o.tp, parameter_names(model))
    ft.check_alone()
    ft.check_lighthouse(options.address(), options.connect_timeout)  # before any change
    init_distributed()
    if not dist.is_initialized():
        ft.one_process_group(device)
        init_distributed()  # the exit-time collection of the group
    if o.sync_batchnorm:
        _sync_batchnorm(model, device)
    with Translating(where=" while the first step wrapped the model"):
        call = _wrap(o, prepared, state)
        runtime = ft.Runtime(options, state, dist.group.WORLD, device)
    ft.RUNTIMES[model] = runtime
    return dataclasses.replace(prepared, call=call, process_group=dist.group.WORLD)


def _micro_context(o: Sharding, ctx: CallContext, index: int,
                   sync: bool) -> contextlib.AbstractContextManager[Any] | None:
    fsdp = o.fsdp
    model = ctx.model
    if index == 0 and not fsdp and ctx.training:  # an update's (or a call's) first
        _replicated(ctx).refresh(window_open=_UNSYNCED.get(model, False))
    if sync:
        if fsdp:
            _fsdp(model).set_requires_gradient_sync(True)
        _UNSYNCED.pop(model, None)
        return None
    if not fsdp:
        if o.static_graph:  # torch's static graph breaks under no_sync (an internal
            # assert, then gradients never reduced): all-reduce every micro-batch, exact
            # too (what is reduced already is equal on every process)
            return None
        _UNSYNCED[model] = True
        no_sync: contextlib.AbstractContextManager[Any] = _ddp(ctx).no_sync()
        return no_sync
    if o.fsdp_sync == "once":  # HSDP: neither reduce-scatter nor all-reduce until then
        _UNSYNCED[model] = True
        _fsdp(model).set_requires_gradient_sync(False)
    return None


def micro(o: Sharding, ctx: CallContext, index: int,
          sync: bool) -> contextlib.AbstractContextManager[Any]:
    """A micro-batch's context: no gradient sync unless ``sync`` (the update's last one);
    fault tolerance's quorum first; torch.distributed's failures explained."""
    if ctx.distributed is None:
        return contextlib.nullcontext()
    if o.fault_tolerance is not None and ctx.training:  # the update's quorum (and heal)
        ft.RUNTIMES[ctx.model].start()
    # torch.distributed's failures in the forward (DDP's unused parameters found at the
    # next forward, FSDP's all-gathers, a timeout) are explained (errors.translate)
    return Translating(_micro_context(o, ctx, index, sync), model=ctx.model,
                       where=" in a micro-batch's forward")


def reduce(o: Sharding, ctx: UpdateContext) -> None:
    """The update's reduction: the divisor made global (and the live replica groups'
    gradients summed); a flushed window's unsynced gradients all-reduced."""
    fsdp = o.fsdp
    # Processes averaged sum(coef * grad) over the data-parallel processes; the engine
    # divides by the local weight. Make the divisor global weight / data-parallel size,
    # so the result is the exact full-batch gradient over all processes' samples (or
    # tokens). The weights are summed over the world: the tp processes of a
    # tensor-parallel group hold the same batch, so the sum is tp times the data's.
    if ctx.distributed is None:
        return
    if _UNSYNCED.pop(ctx.model, False):  # step.flush of a window's unsynced gradients
        if fsdp:
            raise ValueError(
                f"step.flush(state) cannot apply this window: distributed(strategy="
                f"{o.strategy!r}, fsdp_sync='once') left its gradients unsharded and "
                "unreduced. Use fsdp_sync='every' with with_accumulation(n, mode='calls')")
        with Translating(where=" in the all-reduce of a flushed window's gradients"):
            all_reduce_grads(ctx.state.model, ctx.distributed)
    runtime = None if o.fault_tolerance is None else ft.RUNTIMES[ctx.model]
    if ctx.divisor is None:
        if runtime is not None:
            runtime.reduce(ctx, None)
        return
    total = ctx.divisor.clone()
    with Translating(where=" in the all-reduce of the update's sample counts"):
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.distributed)
    if runtime is not None:  # summed with the live replica groups' too
        summed = runtime.reduce(ctx, total)
        assert summed is not None
        total = summed
    world = world_size()
    ctx.weight_total = total / o.tp if o.tp > 1 else total
    divisor = total / world
    if o.offload == "cpu" and divisor.device.type != "cpu":
        divisor = divisor.cpu()  # the gradients are on the host, where the step runs
    ctx.divisor = divisor


def abort(o: Sharding, ctx: CallContext) -> None:
    """After a failed call: what the strategy keeps of it dropped (DDP keeps nothing the
    engine's zero_grad does not clear)."""
    fsdp = o.fsdp
    if not fsdp and o.fault_tolerance is None:
        _UNSYNCED.pop(ctx.model, None)  # the engine discarded the window's gradients
        return
    # A failed call: the engine cleared the gradients the optimizer holds. FSDP2 also
    # keeps the unreduced gradients of micro-batches that skipped reduce-scatter
    # (fsdp_sync='once') on its unsharded parameters: drop them too, or they would join
    # the next update. Failure path only: nothing on the hot path, no host read.
    if ctx.distributed is None:
        return
    _UNSYNCED.pop(ctx.model, None)
    if o.fault_tolerance is not None:
        ft.RUNTIMES[ctx.model].abort()
        if not fsdp:
            return
    root = _fsdp(ctx.model)
    compat.fsdp_drop_unreduced_grads(root)
    root.set_requires_gradient_sync(True)


def explain(o: Sharding, ctx: CallContext, error: BaseException) -> BaseException | None:
    """A failed forward or backward's error in the strategy's terms (None: as it is)."""
    # a failure in a micro-batch's backward (DDP's gradient all-reduce, FSDP's
    # reduce-scatter) in accelfn's terms; the forward's are explained by micro_context
    if ctx.distributed is None:
        return None
    return translate(error, model=ctx.model, where=" in a micro-batch's backward")


def unsynced_refusal(o: Sharding, ctx: CallContext) -> str | None:
    """Adaptive accumulation: why the backward cannot run without collectives until the
    processes agree (None: it can)."""
    fsdp = o.fsdp
    if fsdp or o.static_graph:
        what = f"FSDP2 (strategy={o.strategy!r})" if fsdp else "DDP (static_graph=True)"
        return what
    return None


def agreed(o: Sharding, ctx: CallContext) -> None:
    """After an agreed pass whose gradients the reduction all-reduces once."""
    # as after DDP's synced backward: the next call's first forward broadcasts buffers
    _ddp(ctx).require_forward_param_sync = True


def commit(o: Sharding, ctx: UpdateContext) -> bool:
    """Whether the update is applied: fault tolerance's vote of every live replica group,
    taken in ``reduce`` (always, without fault tolerance)."""
    if o.fault_tolerance is None or ctx.distributed is None:
        return True
    return ft.RUNTIMES[ctx.model].commit


def _check_device(device: torch.device) -> None:
    expected = ray_train_device()  # a Ray Train CPU worker sees the machine's GPUs too
    if expected is None:
        expected = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    if device.type != expected.type or (device.type == "cuda" and device != expected):
        raise ValueError(
            f"the model is on {device} but this process trains on {expected}; move it "
            "with model.to(accelfn.init_distributed()) before building the TrainState")


def _sync_batchnorm(model: nn.Module, device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(
            "distributed(sync_batchnorm=True) needs CUDA devices: SyncBatchNorm has no "
            "CPU implementation; leave it off when training on CPUs")
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # type: ignore[no-untyped-call]
    if converted is not model:
        raise ValueError("sync_batchnorm cannot convert a model that is itself a BatchNorm")


def _style_text(style: Any) -> str:
    """A ParallelStyle as comparable text: its class and settings (two equal plans built
    apart give equal transforms, so steps built alike share one preparation)."""
    return f"{type(style).__qualname__}{sorted(vars(style).items())!r}"


def _option_values(o: Sharding) -> tuple[tuple[str, Any], ...]:
    plan = None if o.plan is None else tuple(
        (pattern, _style_text(style)) for pattern, style in o.plan.items())
    values = [(f.name, getattr(o, f.name)) for f in dataclasses.fields(o) if f.name != "plan"]
    return (*values, ("tensor_parallel", plan))


def _label(o: Sharding) -> str:
    parts = [o.strategy]
    for name, value, default in (("replicate", o.replicate, None), ("tp", o.tp, 1),
                                 ("offload", o.offload, None),
                                 ("reshard_after_forward", o.reshard_after_forward, None),
                                 ("compression", o.compression, None)):
        if value != default:
            parts.append(f"{name}={value}")
    for name, flag in (("static_graph", o.static_graph), ("sync_batchnorm", o.sync_batchnorm),
                       ("fault_tolerant", o.fault_tolerance is not None)):
        if flag:
            parts.append(name)
    return f"distributed({', '.join(parts)})"


def _fsdp(model: nn.Module) -> Any:
    """The model as the FSDP2 root it became in place (``FSDPModule``'s methods)."""
    return model


def _replicated(ctx: CallContext) -> Replicated:
    """What runs the step function under DDP (its ``ddp``, built again when needed)."""
    call = ctx.prepared.call
    assert isinstance(call, Replicated)
    return call


def _ddp(ctx: CallContext) -> nn.parallel.DistributedDataParallel:
    """The DistributedDataParallel that runs the step function as its forward."""
    return _replicated(ctx).ddp  # type: ignore[return-value]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"distributed({name}={value!r}) must be an int >= 1")
    return value


def _check(o: Sharding) -> None:
    """Every refusal that needs no process group, when the transform is built."""
    if o.strategy not in _STRATEGIES:
        zero = str(o.strategy).lower().startswith("zero")
        raise ValueError(f"distributed(strategy={o.strategy!r}) is unknown; use one of "
                         f"{_STRATEGIES}" + (
                             ": ZeRO-1 is strategy='ddp' with torch's ZeroRedundancyOptimizer "
                             "as the optimizer, ZeRO-3 is strategy='fsdp'" if zero else ""))
    if o.compression not in _COMPRESSION:
        raise ValueError(f"distributed(compression={o.compression!r}) is unknown; use one of "
                         f"{_COMPRESSION}")
    if o.fsdp_sync not in ("every", "once"):
        raise ValueError(f"distributed(fsdp_sync={o.fsdp_sync!r}) must be 'every' or 'once'")
    if o.offload not in _OFFLOAD:
        raise ValueError(f"distributed(offload={o.offload!r}) must be None or 'cpu'")
    _positive_int("tp", o.tp)
    if o.replicate is not None:
        _positive_int("replicate", o.replicate)
        if o.strategy != "hsdp":
            raise ValueError(f"distributed(replicate={o.replicate}) is the number of model "
                             "copies of HSDP: pass strategy='hsdp' with it")
    rsf = o.reshard_after_forward
    if rsf is not None and not isinstance(rsf, bool) and (not isinstance(rsf, int) or rsf < 2):
        raise ValueError(f"distributed(reshard_after_forward={rsf!r}) must be True, False or "
                         "an int >= 2 (the group size to reshard to, as in fully_shard)")
    if o.strategy != "ddp":
        given = [name for name, value in (
            ("compression", o.compression), ("static_graph", o.static_graph),
            ("bucket_cap_mb", o.bucket_cap_mb),
            ("find_unused_parameters", o.find_unused_parameters)) if value]
        if given:
            raise ValueError(f"{', '.join(given)}: DDP options, which FSDP2 does not take; "
                             f"leave them out with strategy={o.strategy!r}")
    else:
        given = [name for name, value in (
            ("fsdp_sync", o.fsdp_sync != "every"), ("offload", o.offload),
            ("reshard_after_forward", o.reshard_after_forward is not None),
            ("tp", o.tp > 1), ("tensor_parallel", o.plan is not None)) if value]
        if given:
            raise ValueError(
                f"distributed({', '.join(given)}=...): FSDP2 option(s); pass strategy='fsdp' "
                "(or 'hsdp') with them (DDP replicates whole parameters and synchronises once "
                "per update)")
    if o.tp > 1 and o.plan is None:
        raise ValueError(
            f"distributed(tp={o.tp}) needs tensor_parallel=plan, the layers to shard: "
            "{'blocks.*.up': ColwiseParallel(), 'blocks.*.down': RowwiseParallel()} "
            "(torch.distributed.tensor.parallel)")
    if o.plan is not None and o.tp == 1:
        raise ValueError("distributed(tensor_parallel=...) needs tp=k > 1, the number of "
                         "processes each layer of the plan is sharded over")
    if o.bucket_cap_mb is not None and o.bucket_cap_mb <= 0:
        raise ValueError("distributed(bucket_cap_mb=...) must be > 0")
    if o.fault_tolerance is not None:
        if not isinstance(o.fault_tolerance, ft.FaultTolerance):
            raise TypeError(f"distributed(fault_tolerance={o.fault_tolerance!r}) takes "
                            "accelfn.FaultTolerance(lighthouse=..., ...) or True (its defaults)")
        if o.strategy == "hsdp" or o.tp > 1 or o.offload is not None:
            which = "strategy='hsdp'" if o.strategy == "hsdp" else (
                f"tp={o.tp}" if o.tp > 1 else f"offload={o.offload!r}")
            raise ValueError(
                f"distributed({which}, fault_tolerance=...): the replica groups of fault "
                "tolerance are HSDP's replicate dimension (each torchrun job one group): use "
                "strategy='fsdp' (FSDP2 within each group, HSDP across them) or 'ddp'; tensor "
                "parallelism and CPU offload are not supported with it")
        ft.check_installed()
        o.fault_tolerance.address()  # a lighthouse named (reached at the first step)


