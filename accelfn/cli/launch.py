"""``accelfn launch``: torchrun whose exit status says "preempted, requeue" (75).

    python -m accelfn.cli.launch --nproc_per_node=2 train.py --epochs 10
    status=$?; [ $status -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"

Takes torchrun's arguments unchanged and runs torchrun's own agent in this process
(``torch.distributed.run``), so rendezvous, restarts, logs and the workers' environment are
torchrun's. Only the exit status differs: torchrun exits 1 when a worker exits with any
non-zero status, so a run whose workers checkpointed and exited ``EXIT_PREEMPTED`` (75, see
``accelfn.checkpointing.PreemptionGuard``) looks like a crash to the job script. Here:

* 75 when the workers were preempted: at least one wrote the preemption marker (each
  worker's ``PreemptionGuard.checkpoint_and_exit`` writes one into the folder this command
  names in ``ACCELFN_PREEMPTED_DIR``, after its checkpoint is saved), and no worker failed
  otherwise (the others exited 0 or 75, or were stopped by the agent with a signal);
* 0 when every worker succeeded;
* 1 for any other failure, as torchrun (a worker that crashed, even while others saved);
* 128 + the signal when the agent itself was signalled (SIGTERM from the scheduler) and no
  worker saved a preemption checkpoint.

The agent forwards a SIGTERM it receives to the workers and waits for them (torchrun's grace
period, 30 s) before killing them, so SIGTERM to the agent, to one worker or to all of them
ends in the same checkpoint and status 75. Keep ``--max-restarts=0`` (the default): with
restarts, torchrun restarts the workers of a failed group, a preempted one too.

Written here because torchrun has no option mapping a worker's exit status to its own; the
marker (rather than the failures torchrun reports) covers the agent's own shutdown, after
which torchrun reports no worker status.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from ..checkpointing.preemption import EXIT_PREEMPTED, MARKER_ENV

__all__ = ["add_launch", "launch", "main"]


def _preempted(folder: str) -> int | None:
    """The status the workers that saved on preemption exit with (from their markers), or
    None when none did."""
    codes = set()
    try:
        for name in os.listdir(folder):
            if name.startswith("rank-"):
                with open(os.path.join(folder, name)) as f:
                    codes.add(int(f.readline()))
    except (OSError, ValueError):
        pass
    return codes.pop() if len(codes) == 1 else (EXIT_PREEMPTED if codes else None)


def _only_stopped_or_preempted(failures: dict[Any, Any], code: int) -> bool:
    """Whether every failed worker exited ``code`` or was stopped by a signal (the agent
    stops the others once one exits)."""
    return all(f.exitcode == code or f.exitcode < 0 for f in failures.values())


def launch(torchrun_args: Sequence[str]) -> int:
    """Run ``torchrun *torchrun_args`` in this process; return the exit status (see the
    module's docstring: 75 preempted, 0 success, 1 failure, 128 + signal)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    args = parse_args(list(torchrun_args))  # type: ignore[no-untyped-call]  # torch: untyped
    folder = tempfile.mkdtemp(prefix="accelfn-launch-")
    previous = os.environ.get(MARKER_ENV)
    os.environ[MARKER_ENV] = folder  # the workers inherit the agent's environment
    try:
        try:
            torchrun(args)  # type: ignore[no-untyped-call]  # torch: untyped
        except ChildFailedError as error:
            code = _preempted(folder)
            if code is not None and _only_stopped_or_preempted(error.failures, code):
                print(f"accelfn launch: the workers were preempted and saved; exiting with "
                      f"status {code}", file=sys.stderr, flush=True)
                return code
            print(f"accelfn launch: {error}", file=sys.stderr, flush=True)
            return 1
        except SignalException as error:
            code = _preempted(folder)
            if code is not None:
                print(f"accelfn launch: stopped by {signal.Signals(error.sigval).name}; the "
                      f"workers saved; exiting with status {code}", file=sys.stderr,
                      flush=True)
                return code
            return 128 + int(error.sigval)
        code = _preempted(folder)
        return 0 if code is None else code
    finally:
        if previous is None:
            os.environ.pop(MARKER_ENV, None)
        else:
            os.environ[MARKER_ENV] = previous
        shutil.rmtree(folder, ignore_errors=True)


def _run_launch(args: argparse.Namespace) -> int:
    return launch(args.torchrun_args)


def add_launch(subparsers: Any) -> None:
    """``accelfn launch``: torchrun, exiting 75 when the workers were preempted."""
    p = subparsers.add_parser(
        "launch", help="torchrun, exiting 75 when the workers checkpointed on preemption",
        description="Run torchrun with these arguments; exit 75 when the workers saved on a "
                    "preemption signal (PreemptionGuard), 0 on success, 1 on a failure.",
        prefix_chars="+", add_help=False)  # every argument is torchrun's, --help included
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run_launch)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m accelfn.cli.launch [torchrun arguments]``; returns the exit status."""
    return launch(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
