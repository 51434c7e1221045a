"""Saving and resuming: atomic checkpoints of a TrainState (whole or sharded), RNG, preemption.

    af.checkpointing.save(directory, state, loader=loader)
    info = af.checkpointing.load(directory, state, loader=loader)
"""

from .preemption import EXIT_PREEMPTED, PreemptionGuard
from .store import (
    CheckpointError,
    CheckpointInfo,
    checkpoints,
    latest,
    load,
    rng_state,
    save,
    set_rng_state,
)

__all__ = [
    "EXIT_PREEMPTED",
    "CheckpointError",
    "CheckpointInfo",
    "PreemptionGuard",
    "checkpoints",
    "latest",
    "load",
    "rng_state",
    "save",
    "set_rng_state",
]
