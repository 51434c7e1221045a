"""Preemption: SIGTERM/SIGUSR1 turn into a checkpoint at the next step boundary and a clean exit.

    with PreemptionGuard() as guard:
        for batch in loader:
            step(state, batch)
            guard.exit_if_requested("runs/x", state, loader=loader, step=step)

Clusters announce the end of a job with a signal: SLURM sends SIGTERM (and SIGUSR1 ahead of
the time limit with ``--signal=USR1@90``), Kubernetes and torchrun's agent SIGTERM, each
followed by SIGKILL after a grace period (torchrun: 30 s). The handler only sets a flag; the
loop reads it between steps, where the state is consistent, saves with
``accelfn.checkpointing.save()`` and exits with ``EXIT_PREEMPTED`` (75, ``EX_TEMPFAIL``:
"try again"), which a job script can tell apart from success (0) and from a crash (1, or
128 + signal)::

    python train.py; [ $? -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"

Under torchrun, whose own status is 1 whatever its workers' non-zero statuses, launch with
``accelfn launch`` (``python -m accelfn.cli.launch``: torchrun's arguments, the same agent)
instead: it exits 75 when the workers saved on preemption. It tells them apart through a
marker: each process whose [`checkpoint_and_exit`][] saved writes ``rank-<RANK>`` into the
folder named by the environment variable ``ACCELFN_PREEMPTED_DIR`` (when set) just before it
exits. Under plain torchrun (its agent's ``TORCHELASTIC_RUN_ID`` without that folder) the exit
message says so and names ``accelfn launch``.

Under several processes the decision is taken by all of them together: every
``check_every`` boundaries one all-reduce (MAX) of one integer combines the flags, and every
process stops at the same step, so none is left waiting in a collective for one that left.
That all-reduce and its host read are the guard's whole cost; between checks it costs nothing.

With ``with_accumulation(n, mode="calls")`` a checkpoint can only be taken at an update
boundary (an open window's gradients are not saved): given the state, [`should_stop`][] and
[`exit_if_requested`][] say stop only when no window is open, so a signal arriving mid-window
stops the run when that window's update is applied (every process makes the same calls, so
all stop at the same one). Keep ``n`` calls well within the grace period.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterable
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..core.processes import in_ray_train_worker
from .states import States, at_update_boundary, checkpoint_step, named_states

__all__ = ["EXIT_PREEMPTED", "MARKER_ENV", "PreemptionGuard"]

EXIT_PREEMPTED = 75
"""Exit status of a run that checkpointed and stopped because it was asked to (``EX_TEMPFAIL``)."""

MARKER_ENV = "ACCELFN_PREEMPTED_DIR"
"""Environment variable naming a folder where a preempted process that saved writes
``rank-<RANK>`` before exiting, holding its exit status on the first line (set by
``python -m accelfn.cli.launch`` for its workers)."""


def _write_marker(rank: int, code: int, step: int, path: Any) -> None:
    """Say, in the folder ``MARKER_ENV`` names (if any), that this process saved and exits
    preempted. A failure to write it is a warning: the checkpoint is what matters."""
    folder = os.environ.get(MARKER_ENV)
    if not folder:
        return
    try:
        with open(os.path.join(folder, f"rank-{rank}"), "w") as f:
            f.write(f"{code}\nstep {step}: saved {path}\n")
    except OSError as error:
        import warnings

        warnings.warn(f"could not write the preemption marker into {folder} ({error}); the "
                      "launcher will report a failure (exit 1), not a preemption", stacklevel=3)

#: set by torchrun's agent in its workers' environment (``accelfn launch`` runs the same agent)
_TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"


def _plain_torchrun_hint(code: int) -> str:
    """What to add to the exit message under plain torchrun (its agent's environment without
    the marker folder ``accelfn launch`` names): torchrun exits 1 whatever its workers'
    statuses, so the requeue a job script keys on ``code`` never fires. Empty elsewhere."""
    if _TORCHRUN_ENV not in os.environ or os.environ.get(MARKER_ENV):
        return ""
    return (f". torchrun itself will exit 1, not {code} (its status is 1 whatever its "
            f"workers' statuses), so a job script waiting for {code} will not requeue: launch "
            "with `accelfn launch` instead of `torchrun` (the same arguments, e.g. `accelfn "
            f"launch --nproc_per_node=N train.py`), which exits {code} when the workers saved")


_DEFAULT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class PreemptionGuard:
    """Equivalent to a signal handler that sets a flag, and ``if flag: save(); sys.exit(75)``
    between steps, with the flag combined across processes.

    Use it as a context manager (handlers are installed on entry, the previous ones put back
    on exit), or call [`install`][] / [`uninstall`][].

    Args:
        signals: the signals that request a stop (default SIGTERM and SIGUSR1).
        check_every: under several processes, combine the flags every ``check_every`` calls
            of [`should_stop`][] (one all-reduce and one host read each time). In a single
            process the flag is read at every call, for free. Keep ``check_every`` times the
            step time well under the grace period between the signal and SIGKILL.
        time_limit_s: also request a stop this many seconds after [`install`][] (for
            clusters that do not signal before the wall-time limit).
        exit_code: the status [`checkpoint_and_exit`][] exits with.
    """

    def __init__(
        self,
        signals: Iterable[int] = _DEFAULT_SIGNALS,
        *,
        check_every: int = 10,
        time_limit_s: float | None = None,
        exit_code: int = EXIT_PREEMPTED,
    ) -> None:
        self.signals = tuple(signals)
        for sig in self.signals:
            if not isinstance(sig, int) or sig in (getattr(signal, "SIGKILL", -1),
                                                   getattr(signal, "SIGSTOP", -1)):
                raise ValueError(f"PreemptionGuard cannot handle signal {sig!r}; give catchable "
                                 "signals such as signal.SIGTERM or signal.SIGUSR1")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every={check_every!r} must be an int >= 1")
        if time_limit_s is not None and not time_limit_s > 0:
            raise ValueError(f"time_limit_s={time_limit_s!r} must be > 0 seconds (or None)")
        if not isinstance(exit_code, int) or not 0 < exit_code < 256:
            raise ValueError(f"exit_code={exit_code!r} must be an int in 1..255")
        self.check_every = check_every
        self.time_limit_s = time_limit_s
        self.exit_code = exit_code
        self._requested = False
        self._signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._started: float | None = None
        self._calls = 0
        self._agreed = False

    # ----------------------------------------------------------------- handlers
    def install(self) -> PreemptionGuard:
        """Install the signal handlers (from the main thread, as Python requires)."""
        if threading.current_thread() is not threading.main_thread():
            if in_ray_train_worker():
                raise RuntimeError(
                    "PreemptionGuard under Ray Train: the training function runs in a thread "
                    "of the worker, and signal handlers can only be installed from the main "
                    "thread; leave the guard out: Ray's FailureConfig restarts the worker group, "
                    "which resumes from the run's newest checkpoint (docs/ray.md)")
            raise RuntimeError("signal handlers can only be installed from the main thread; "
                               "create the PreemptionGuard in the training script's main thread")
        if self._previous:
            raise RuntimeError("this PreemptionGuard is already installed")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._started = time.monotonic()
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before [`install`][]."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> PreemptionGuard:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._requested = True
        self._signal = signum
        previous = self._previous.get(signum)
        if callable(previous):  # a handler someone installed before: still tell it
            previous(signum, frame)

    # ----------------------------------------------------------------- the flag
    def request(self) -> None:
        """Ask for a stop at the next check, as a signal would (e.g. from a callback)."""
        self._requested = True

    @property
    def requested(self) -> bool:
        """Whether this process was asked to stop (a signal, [`request`][], the time limit).

        Local and free to read; use [`should_stop`][] at step boundaries so that all
        processes stop together.
        """
        if (not self._requested and self.time_limit_s is not None
                and self._started is not None
                and time.monotonic() - self._started >= self.time_limit_s):
            self._requested = True
        return self._requested

    @property
    def signal(self) -> int | None:
        """The last signal received, or None."""
        return self._signal

    def should_stop(self, state: States | None = None) -> bool:
        """Whether to checkpoint and stop now; call it at every step boundary, on every process.

        Single process: [`requested`][]. Several processes: every ``check_every``-th call
        all-reduces the flags (MAX), so all processes agree at the same call; other calls
        do not communicate. Once agreed, it stays agreed. With ``state`` it returns True only
        at an update boundary (``state.at_update_boundary``: no ``mode="calls"``
        accumulation window open), the only place the state can be saved; the agreement
        itself is made as without it, so every process still communicates at the same calls.
        With a mapping of states (``{name: TrainState}``, saved as one checkpoint), when
        every one of them is at an update boundary.
        """
        agreed = self._agree()
        return agreed and at_update_boundary(state)

    def _agree(self) -> bool:
        if self._agreed:
            return True
        self._calls += 1
        if _world() == 1:
            self._agreed = self.requested
            return self._agreed
        if self._calls % self.check_every:
            return False
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        flag = torch.tensor([int(self.requested)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._agreed = bool(flag.item())
        return self._agreed

    # ----------------------------------------------------------------- acting on it
    def checkpoint_and_exit(self, directory: str | os.PathLike[str], state: States,
                            **save_options: Any) -> NoReturn:
        """Save with [`accelfn.checkpointing.save`][] (on every process) and exit.

        Equivalent to ``save(directory, state, **save_options); sys.exit(exit_code)``; the
        process group, if any, is destroyed first. An asynchronous save still running is
        waited for first; if it failed unseen, its error is a warning here (this save is
        what the restart needs), and with ``asynchronous=True`` the save is waited for too.
        """
        from .background import AsyncSave, wait_previous
        from .saving import save

        if not at_update_boundary(state):
            raise RuntimeError(
                "checkpoint_and_exit with an accumulation window open (mode='calls'): its "
                "gradients cannot be saved. Use exit_if_requested(directory, state, ...) or "
                "should_stop(state), which say stop at the window's end")
        try:
            wait_previous("save")
        except Exception as error:
            warnings.warn(f"an earlier asynchronous checkpoint failed ({type(error).__name__}: "
                          f"{error}); saving the preemption checkpoint anyway", stacklevel=2)
        saved = save(directory, state, **save_options)
        path = saved.wait() if isinstance(saved, AsyncSave) else saved
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        at = checkpoint_step(named_states(state, "save"))
        _write_marker(int(os.environ.get("RANK", rank)), self.exit_code, at, path)
        if rank == 0:  # a warning, as the library's messages are: filterable, on stderr
            warnings.warn(f"preempted at step {at}: saved {path}; exiting with status "
                          f"{self.exit_code}{_plain_torchrun_hint(self.exit_code)}",
                          RuntimeWarning, stacklevel=2)
        sys.exit(self.exit_code)

    def exit_if_requested(self, directory: str | os.PathLike[str], state: States,
                          **save_options: Any) -> None:
        """At a step boundary: ``if self.should_stop(state): self.checkpoint_and_exit(...)``
        (so with ``mode="calls"`` accumulation, at the end of the window open at the signal)."""
        if self.should_stop(state):
            self.checkpoint_and_exit(directory, state, **save_options)

    def __repr__(self) -> str:
        names = [signal.Signals(s).name for s in self.signals]
        return (f"PreemptionGuard(signals={names}, check_every={self.check_every}, "
                f"requested={self.requested})")
