"""accelfn: composable transforms that make a pure PyTorch step function train fast.

    step = af.compiled(af.with_amp(af.with_accumulation(4)(af.with_clipping(my_step))))
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    for batch in loader:
        metrics = step(state, batch)
"""

from . import checkpointing, data, datasets, preemption
from .accumulation import with_accumulation
from .amp import with_amp
from .checkpoint import checkpointed, find_blocks
from .checkpointing import CheckpointError, CheckpointInfo
from .clipping import with_clipping
from .compile import compiled
from .diagnostics import Diagnostics, SyncProbe
from .distributed import (
    distributed,
    init_distributed,
    is_main_process,
    reduce_metrics,
    scale_lr,
    world_size,
)
from .doctor import doctor
from .early_stopping import EarlyStopping
from .ema import ema_state_dict, ema_weights, with_ema
from .memory_format import channels_last, is_channels_last
from .monitor import Monitor, training_flops
from .nonfinite import with_nonfinite
from .params import NO_DECAY_TYPES, freeze, no_decay_names, param_groups, unfreeze
from .preemption import EXIT_PREEMPTED, PreemptionGuard
from .profiling import Profiler, profiled
from .schedules import WarmupPlateau, one_cycle, warmup_cosine, warmup_linear, warmup_plateau
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
    "EXIT_PREEMPTED",
    "NO_DECAY_TYPES",
    "CheckpointError",
    "CheckpointInfo",
    "Diagnostics",
    "EarlyStopping",
    "Monitor",
    "NonFiniteError",
    "PreemptionGuard",
    "Prepared",
    "Profiler",
    "Step",
    "StepContext",
    "SyncProbe",
    "TrainState",
    "Transform",
    "WarmupPlateau",
    "apply_transform",
    "channels_last",
    "checkpointed",
    "checkpointing",
    "compiled",
    "configurable",
    "data",
    "datasets",
    "describe",
    "distributed",
    "doctor",
    "ema_state_dict",
    "ema_weights",
    "find_blocks",
    "freeze",
    "init_distributed",
    "is_channels_last",
    "is_main_process",
    "lift",
    "no_decay_names",
    "one_cycle",
    "param_groups",
    "preemption",
    "profiled",
    "reduce_metrics",
    "scale_lr",
    "training_flops",
    "unfreeze",
    "warmup_cosine",
    "warmup_linear",
    "warmup_plateau",
    "with_accumulation",
    "with_amp",
    "with_clipping",
    "with_ema",
    "with_nonfinite",
    "world_size",
]
