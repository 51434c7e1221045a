"""distributed: DDP, FSDP2, HSDP, or FSDP2 with tensor parallelism under torchrun; a no-op in a
single process.

``transform`` holds the public constructor; the mechanism is ``accelfn.parts.sharding`` over
``accelfn.parts.distributed`` (wrapping, the process layout, errors, fault tolerance, sharded
Muon). ``plans`` (tensor-parallel plans, ``plans.llama()``) is re-exported here for users:
``from accelfn.transforms.distributed import plans``.
"""

from ...parts.distributed import plans
from ...parts.distributed.errors import DistributedError
from ...parts.distributed.ft import FaultTolerance, fault_tolerance_report
from .transform import distributed

__all__ = ["DistributedError", "FaultTolerance", "distributed", "fault_tolerance_report",
           "plans"]
