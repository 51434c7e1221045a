"""accelfn: composable transforms that make a pure PyTorch step function train fast.

    step = af.compiled(af.with_amp(af.with_accumulation(4)(af.with_clipping(my_step))))
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    for batch in loader:
        metrics = step(state, batch)
"""

from . import data, datasets
from .accumulation import with_accumulation
from .amp import with_amp
from .checkpoint import checkpointed, find_blocks
from .clipping import with_clipping
from .compile import compiled
from .diagnostics import Diagnostics, SyncProbe
from .distributed import distributed, init_distributed, is_main_process, scale_lr, world_size
from .doctor import doctor
from .monitor import Monitor, training_flops
from .nonfinite import with_nonfinite
from .profiling import Profiler, profiled
from .state import TrainState
from .step import (
    NonFiniteError,
    Prepared,
    Step,
    StepContext,
    Transform,
    apply_transform,
    configurable,
    describe,
    lift,
)

__version__ = "0.1.0"

__all__ = [
    "Diagnostics",
    "Monitor",
    "NonFiniteError",
    "Prepared",
    "Profiler",
    "Step",
    "StepContext",
    "SyncProbe",
    "TrainState",
    "Transform",
    "apply_transform",
    "checkpointed",
    "compiled",
    "configurable",
    "data",
    "datasets",
    "describe",
    "distributed",
    "doctor",
    "find_blocks",
    "init_distributed",
    "is_main_process",
    "lift",
    "profiled",
    "scale_lr",
    "training_flops",
    "with_accumulation",
    "with_amp",
    "with_clipping",
    "with_nonfinite",
    "world_size",
]
