"""Saving and resuming: atomic checkpoints of a TrainState (whole or sharded), RNG, preemption.

    from accelfn import checkpointing

    if checkpointing.latest("runs/x") is not None:                  # resume if there is one
        checkpointing.load("runs/x", state, loader=train, step=step)
    for batch in train:
        step(state, batch)
        if state.step % 500 == 0:
            checkpointing.save("runs/x", state, loader=train, step=step, keep=3)

Several states (a GAN's generator and discriminator) are one checkpoint:
``save("runs/gan", {"generator": state_g, "discriminator": state_d}, step={"generator":
g_step, "discriminator": d_step})`` and the same mapping to ``load``; a state with several
optimizers (``TrainState(model, [muon, adamw], scheduler=[...])``) is saved and resumed like
one with one.

The package by concern: ``format`` (names, errors, plain data), ``files`` (atomic files,
digests, listing and rotation), ``lock`` (one writer per folder), ``checks`` (what a
checkpoint must match), ``states`` (one state or several by name, one optimizer or several
each), ``dcp`` (sharded state through torch.distributed.checkpoint), ``rng``
(RNG states), ``collective`` (agreeing across processes), ``saving`` and ``loading`` (the two
calls), ``background`` (asynchronous saves), ``preemption``, ``runs`` (a run's folder:
checkpoints, metrics, resuming the newest run) and ``exporting`` (weights for other tools).
"""

from .background import AsyncSave
from .exporting import export
from .files import checkpoints, latest
from .format import CheckpointError, CheckpointInfo
from .loading import load
from .lock import CheckpointLockedError
from .preemption import EXIT_PREEMPTED, PreemptionGuard
from .rng import rng_state, set_rng_state
from .runs import PlanMismatchError, RunFolder, RunFolderError
from .saving import save

__all__ = [
    "EXIT_PREEMPTED",
    "AsyncSave",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointLockedError",
    "PlanMismatchError",
    "PreemptionGuard",
    "RunFolder",
    "RunFolderError",
    "checkpoints",
    "export",
    "latest",
    "load",
    "rng_state",
    "save",
    "set_rng_state",
]
