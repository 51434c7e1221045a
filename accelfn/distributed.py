"""distributed: DDP or FSDP2 under torchrun; a no-op in a single process."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase
from torch import Tensor, nn

from .checkpoint import find_blocks
from .state import TrainState
from .step import Prepared, StepContext, configurable

__all__ = [
    "distributed",
    "init_distributed",
    "is_main_process",
    "reduce_metrics",
    "scale_lr",
    "world_size",
]

_STRATEGIES = ("ddp", "fsdp")
_COMPRESSION = (None, "fp16", "bf16", "powersgd")


def world_size() -> int:
    """Number of training processes (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0, or in a single process: the one that prints and saves."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def init_distributed(backend: str | None = None) -> torch.device:
    """Set up the process group from torchrun's environment and return this process' device.

    Equivalent to ``dist.init_process_group(backend)`` with ``nccl`` on GPUs and ``gloo`` on
    CPUs, plus ``torch.cuda.set_device(LOCAL_RANK)``. Without torchrun's variables (a plain
    ``python`` run) it initialises nothing and returns the default device.
    """
    cuda = torch.cuda.is_available()
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if env_world <= 1 or (dist.is_available() and dist.is_initialized()):
        return device
    if "MASTER_ADDR" not in os.environ or "RANK" not in os.environ:
        raise RuntimeError(
            f"WORLD_SIZE={env_world} but RANK/MASTER_ADDR are not set; start the script with "
            "torchrun --nproc_per_node=N script.py"
        )
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not (cuda and dist.is_nccl_available()):
        raise RuntimeError("backend 'nccl' needs CUDA GPUs and an NCCL build; use 'gloo' on CPUs")
    device_id = device if backend == "nccl" else None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend=backend, device_id=device_id)
        return device
    # torchrun keeps one store for the whole job: without a per-restart prefix a restarted
    # worker can read the address its peer published before the restart and fail to connect.
    from torch.distributed.rendezvous import rendezvous

    store, rank, world = next(rendezvous("env://"))
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"restart-{restart}/", store),
                            rank=rank, world_size=world, device_id=device_id)
    return device


def reduce_metrics(metrics: Mapping[str, Tensor] | TensorDictBase, *,
                   op: str = "mean") -> TensorDict:
    """Equivalent to ``dist.all_reduce`` of every metric (divided by the world size for
    ``"mean"``), done as one collective on one stacked tensor.

    Call it when you read metrics (every N steps), not every step. In a single process it
    returns the metrics unchanged (as float32 values).
    """
    if op not in ("mean", "sum", "max", "min"):
        raise ValueError(f"reduce_metrics(op={op!r}) must be 'mean', 'sum', 'max' or 'min'")
    keys = [k for k in metrics.keys() if isinstance(metrics[k], Tensor)]
    if not keys:
        return TensorDict({}, batch_size=[])
    values = torch.stack([metrics[k].detach().float().reshape(()) for k in keys])
    world = world_size()
    if world > 1:
        reduce_op = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
                     "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(values, op=reduce_op)
        if op == "mean":
            values = values / world
    return TensorDict({k: values[i] for i, k in enumerate(keys)}, batch_size=[])


def scale_lr(base_lr: float, batch_size: int, base_batch_size: int = 256) -> float:
    """The linear scaling rule: ``base_lr * global_batch / base_batch_size``.

    ``batch_size`` is the per-process batch; the global batch multiplies it by the world size.
    """
    if batch_size < 1 or base_batch_size < 1:
        raise ValueError("scale_lr needs positive batch sizes")
    return base_lr * batch_size * world_size() / base_batch_size


class _Distributed:
    name = "distributed"
    prepare_order = 30
    grads_order = 5

    def __init__(self, strategy: str, static_graph: bool, compression: str | None,
                 sync_batchnorm: bool, bucket_cap_mb: float | None, fsdp_sync: str,
                 find_unused_parameters: bool) -> None:
        self.strategy = strategy
        self.static_graph = static_graph
        self.compression = compression
        self.sync_batchnorm = sync_batchnorm
        self.bucket_cap_mb = bucket_cap_mb
        self.fsdp_sync = fsdp_sync
        self.find_unused_parameters = find_unused_parameters
        self._amp_dtype: torch.dtype | None = None

    def __repr__(self) -> str:
        parts = [self.strategy]
        if self.compression:
            parts.append(f"compression={self.compression}")
        if self.static_graph:
            parts.append("static_graph")
        if self.sync_batchnorm:
            parts.append("sync_batchnorm")
        return f"distributed({', '.join(parts)})"

    def validate(self, transforms: tuple[Any, ...]) -> None:
        for t in transforms:
            if getattr(t, "name", None) == "with_amp":
                self._amp_dtype = getattr(t, "dtype", None) or torch.bfloat16

    def prepare(self, prepared: Prepared, state: TrainState) -> None:
        init_distributed()
        if world_size() == 1:
            return
        device = state.device
        expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        if device.type != expected.type or (device.type == "cuda" and device != expected):
            raise ValueError(
                f"the model is on {device} but this process trains on {expected}; move it "
                "with model.to(accelfn.init_distributed()) before building the TrainState"
            )
        model = prepared.model
        if self.sync_batchnorm:
            if device.type != "cuda":
                raise ValueError(
                    "distributed(sync_batchnorm=True) needs CUDA devices: SyncBatchNorm has no "
                    "CPU implementation; leave it off when training on CPUs"
                )
            converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            if converted is not model:
                raise ValueError("sync_batchnorm cannot convert a model that is itself a BatchNorm")
        if self.strategy == "ddp":
            prepared.model = self._ddp(model, device)
        else:
            self._fsdp(model, state)
        prepared.process_group = dist.group.WORLD

    def _ddp(self, model: nn.Module, device: torch.device) -> nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        kwargs: dict[str, Any] = {"gradient_as_bucket_view": True,
                                  "static_graph": self.static_graph,
                                  "find_unused_parameters": self.find_unused_parameters}
        if device.type == "cuda":
            kwargs["device_ids"] = [device.index]
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        ddp = DistributedDataParallel(model, **kwargs)
        if self.compression == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.compression == "bf16":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif self.compression == "powersgd":
            hook_state = powerSGD_hook.PowerSGDState(process_group=None,
                                                    matrix_approximation_rank=1,
                                                    start_powerSGD_iter=2)
            ddp.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
        return ddp

    def _fsdp(self, model: nn.Module, state: TrainState) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        before = {id(p): name for name, p in model.named_parameters()}
        policy = MixedPrecisionPolicy(param_dtype=self._amp_dtype, reduce_dtype=torch.float32)
        for _, block in find_blocks(model):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        after = dict(model.named_parameters())
        # fully_shard swaps parameters for DTensor ones: point the optimizer at them.
        optimizer = state.optimizer
        if optimizer.state:
            raise ValueError("distributed(strategy='fsdp') must shard the model before the "
                             "optimizer has state; build the step before loading a checkpoint")
        for group in optimizer.param_groups:
            group["params"] = [after[before[id(p)]] for p in group["params"]]

    def micro_context(self, ctx: StepContext, index: int, sync: bool) -> Any:
        model = ctx.model
        if sync or ctx.distributed is None:
            if self.strategy == "fsdp" and ctx.distributed is not None:
                _root(model).set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if self.strategy == "ddp":
            return model.no_sync()
        if self.fsdp_sync == "once":
            _root(model).set_requires_gradient_sync(False)
        return contextlib.nullcontext()

    def on_grads(self, ctx: StepContext) -> None:
        # Processes averaged sum(coef * grad) over the world; the engine divides by the local
        # weight. Make the divisor global weight / world, so the result is the exact
        # full-batch gradient over all processes' samples (or tokens).
        if ctx.distributed is None or ctx.grad_divisor is None:
            return
        total = ctx.grad_divisor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.distributed)
        ctx.weight_total = total
        ctx.grad_divisor = total / world_size()


def _root(model: nn.Module) -> Any:
    return getattr(model, "_orig_mod", model)


def _build_distributed(
    *,
    strategy: str = "ddp",
    static_graph: bool = False,
    compression: str | None = None,
    sync_batchnorm: bool = False,
    bucket_cap_mb: float | None = None,
    fsdp_sync: str = "every",
    find_unused_parameters: bool = False,
) -> _Distributed:
    """Equivalent to ``DistributedDataParallel(model, gradient_as_bucket_view=True)`` (or
    FSDP2 ``fully_shard`` on each repeated block and on the root) under torchrun, with
    ``no_sync()`` on every micro-batch but the last; a no-op in a single process.

    The update equals single-process training on all processes' batches together: micro-batch
    weights (samples, or the returned ``"weight"``) are summed across processes on the device.
    ``compression`` registers DDP's ``fp16``/``bf16`` compression or ``powersgd`` hook;
    ``sync_batchnorm`` converts BatchNorm layers to SyncBatchNorm. With FSDP2,
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
    if strategy == "fsdp" and (compression or static_graph):
        raise ValueError("compression and static_graph are DDP options; FSDP2 takes neither")
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError("distributed(bucket_cap_mb=...) must be > 0")
    return _Distributed(strategy, static_graph, compression, sync_batchnorm, bucket_cap_mb,
                        fsdp_sync, find_unused_parameters)


distributed = configurable("distributed", _build_distributed)
