"""distributed: DDP, FSDP2, HSDP or FSDP2 with tensor parallelism under torchrun; a no-op in a
single process (``accelfn.parts.sharding``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

from ...parts.distributed import ft
from ...parts.sharding import Sharding
from ...step.engine import LossFn, Step
from ...step.extension import Transform, configure

__all__ = ["distributed"]


@overload
def distributed(fn: LossFn | Step, /) -> Step: ...
@overload
def distributed(*, strategy: str = "ddp", static_graph: bool = False,
                compression: str | None = None, sync_batchnorm: bool = False,
                bucket_cap_mb: float | None = None, fsdp_sync: str = "every",
                find_unused_parameters: bool = False, replicate: int | None = None,
                tp: int = 1, tensor_parallel: Mapping[str, Any] | None = None,
                offload: str | None = None,
                reshard_after_forward: bool | int | None = None,
                fault_tolerance: ft.FaultTolerance | bool | None = None) -> Transform: ...
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
    replicate: int | None = None,
    tp: int = 1,
    tensor_parallel: Mapping[str, Any] | None = None,
    offload: str | None = None,
    reshard_after_forward: bool | int | None = None,
    fault_tolerance: ft.FaultTolerance | bool | None = None,
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

    ``strategy="hsdp"`` is FSDP2 over a 2-D mesh ``(replicate, shard)``: ``replicate`` copies
    of the model (default: one per node), each sharded over ``world / replicate`` processes.
    ``tp=k`` with ``tensor_parallel={"blocks.*.up": ColwiseParallel(), ...}`` (fnmatch
    patterns over module names to torch ParallelStyles) shards those layers over groups of
    ``k`` consecutive ranks with ``parallelize_module`` (the mesh's innermost dimension),
    then FSDP2 over the rest; the ``k`` processes of a group must be fed the same batch (shard
    the data by ``rank // k`` of ``world // k``). ``offload="cpu"`` is FSDP2's
    ``CPUOffloadPolicy``; ``reshard_after_forward`` is passed to ``fully_shard``. A
    ``ZeroRedundancyOptimizer`` (ZeRO-1) goes with ``strategy="ddp"``.

    ``fault_tolerance=FaultTolerance(lighthouse=...)`` (or ``True``: its defaults) makes
    each torchrun job one replica group of torchft (DDP, or FSDP2 with ``strategy="fsdp"``,
    over its processes, one process included: HSDP whose replicate dimension is torchft's):
    at each update the group joins a quorum of the live groups at the lighthouse, heals from
    a live peer when it is behind (the whole state sent), sums its gradients with theirs and
    applies the update only if ``Manager.should_commit()`` agrees; a group that dies leaves
    the others training (see ``accelfn.parts.distributed.ft``).
    """
    options = Sharding(strategy, static_graph, compression, sync_batchnorm, bucket_cap_mb,
                       fsdp_sync, find_unused_parameters, replicate, tp, tensor_parallel,
                       offload, reshard_after_forward,
                       ft.FaultTolerance() if fault_tolerance is True else fault_tolerance or None)
    return configure("distributed", fn, Transform(
        "distributed", options, options=options.values(), label=repr(options)))
