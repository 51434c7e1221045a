"""accelfn: composable transforms that make a pure PyTorch step function train fast.

    step = af.compiled(af.with_amp(af.with_accumulation(4)(af.with_clipping(my_step))))
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    for batch in loader:
        metrics = step(state, batch)

This module only re-exports the public API, grouped by layer.
"""

from . import checkpointing, data

# checkpointing
from .checkpointing import (
    EXIT_PREEMPTED,
    CheckpointError,
    CheckpointInfo,
    CheckpointLockedError,
    PreemptionGuard,
)

# core: TrainState, processes, modules
from .core.hangs import HangError
from .core.modules import find_blocks
from .core.processes import (
    init_distributed,
    is_main_process,
    reduce_metrics,
    scale_lr,
    world_size,
)
from .core.state import TrainState

# data
from .data import datasets

# observe
from .observe.diagnostics import Diagnostics
from .observe.environment import doctor
from .observe.flops import training_flops
from .observe.logs import configure_logging
from .observe.memory import MemoryEstimate, estimate_memory, estimate_script, format_estimate
from .observe.memory_snapshots import MemorySnapshot, memory_snapshot
from .observe.monitor import (
    CsvSink,
    GPUSampling,
    JsonlSink,
    MlflowSink,
    Monitor,
    Sink,
    SyncCheck,
    TensorBoardSink,
    Throughput,
    WandbSink,
)
from .observe.profiling import Profiler, profiled
from .observe.sync_probe import SyncProbe

# parts: the built-ins' errors
from .parts.nonfinite import NonFiniteError

# recipes
from .recipes.batch_norm import untracked_batchnorm
from .recipes.early_stopping import EarlyStopping
from .recipes.hyperparameters import Schedule, schedule
from .recipes.losses import linear_cross_entropy
from .recipes.memory_format import channels_last, is_channels_last
from .recipes.param_groups import (
    NO_DECAY_TYPES,
    freeze,
    is_norm_layer,
    no_decay_names,
    param_groups,
    unfreeze,
)
from .recipes.schedules import (
    WarmupPlateau,
    one_cycle,
    warmup_cosine,
    warmup_linear,
    warmup_plateau,
    warmup_stable_decay,
)

# step: the step, the transform types, the chain
from .step.chain import chain
from .step.engine import Step, apply_transform, describe, lift
from .step.extension import GradientTransform, Transform

# transforms
from .transforms.accumulation import with_accumulation
from .transforms.activation_checkpointing import checkpointed
from .transforms.adaptive_clipping import adaptive_clipping
from .transforms.amp import with_amp
from .transforms.captured import captured
from .transforms.clipping import with_clipping
from .transforms.compile import compiled
from .transforms.distributed import (
    DistributedError,
    FaultTolerance,
    distributed,
    fault_tolerance_report,
)
from .transforms.ema import ema_state_dict, ema_weights, with_ema
from .transforms.float8 import with_float8
from .transforms.nonfinite import with_nonfinite

__version__ = "0.1.0"

__all__ = [
    "EXIT_PREEMPTED",
    "NO_DECAY_TYPES",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointLockedError",
    "CsvSink",
    "Diagnostics",
    "DistributedError",
    "EarlyStopping",
    "FaultTolerance",
    "GPUSampling",
    "GradientTransform",
    "HangError",
    "JsonlSink",
    "MemoryEstimate",
    "MemorySnapshot",
    "MlflowSink",
    "Monitor",
    "NonFiniteError",
    "PreemptionGuard",
    "Profiler",
    "Schedule",
    "Sink",
    "Step",
    "SyncCheck",
    "SyncProbe",
    "TensorBoardSink",
    "Throughput",
    "TrainState",
    "Transform",
    "WandbSink",
    "WarmupPlateau",
    "adaptive_clipping",
    "apply_transform",
    "captured",
    "chain",
    "channels_last",
    "checkpointed",
    "checkpointing",
    "compiled",
    "configure_logging",
    "data",
    "datasets",
    "describe",
    "distributed",
    "doctor",
    "ema_state_dict",
    "ema_weights",
    "estimate_memory",
    "estimate_script",
    "fault_tolerance_report",
    "find_blocks",
    "format_estimate",
    "freeze",
    "init_distributed",
    "is_channels_last",
    "is_main_process",
    "is_norm_layer",
    "lift",
    "linear_cross_entropy",
    "memory_snapshot",
    "no_decay_names",
    "one_cycle",
    "param_groups",
    "profiled",
    "reduce_metrics",
    "scale_lr",
    "schedule",
    "training_flops",
    "unfreeze",
    "untracked_batchnorm",
    "warmup_cosine",
    "warmup_linear",
    "warmup_plateau",
    "warmup_stable_decay",
    "with_accumulation",
    "with_amp",
    "with_clipping",
    "with_ema",
    "with_float8",
    "with_nonfinite",
    "world_size",
]
