"""distributed: DDP, FSDP2, HSDP, or FSDP2 with tensor parallelism under torchrun; a no-op in a
single process.

Modules: ``transform`` (the transform and its place in the update), ``mesh`` (the process
layout and its checks), ``plans`` (tensor-parallel plans), ``ddp`` and ``fsdp`` (wrapping),
``errors`` (torch.distributed's failures said in accelfn's terms: ``DistributedError``),
``ft`` (replica groups made fault tolerant by torchft: ``FaultTolerance``).
"""

from .errors import DistributedError
from .ft import FaultTolerance, fault_tolerance_report
from .transform import distributed

__all__ = ["DistributedError", "FaultTolerance", "distributed", "fault_tolerance_report"]
