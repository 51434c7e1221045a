"""The command-line options every example shares, over ``accelfn.checkpointing.RunFolder``.

    parser = argparse.ArgumentParser()
    run_options.add_arguments(parser)
    args = parser.parse_args()
    device = af.init_distributed()
    out = run_options.run_folder(args, "digits")      # every process gets the same folder
    ...                                               # build state, loader and step
    info = run_options.resume(args, state, loader=train, step=step, total=total)

The run folder itself (a new ``runs/<name>/<date>-<time>``, ``--out``, ``--resume`` of a
checkpoint, a run folder or ``runs/<name>``, ``--overwrite``, ``--allow-resharding``, the
checks made before anything is loaded) is ``accelfn.checkpointing.RunFolder``; this module
turns its errors into usage errors (exit status 2, the message after ``<script>: error:``),
prints what a resumed run left behind, and holds the argparse types and messages the
examples share. A resumed run's picture needs nothing here: ``af.Monitor(state=state,
sinks=[af.JsonlSink(run.metrics_file)], plot=run.plot_file, total=..., initial=state.step)``
continues the progress bar from the resumed step and draws ``run.png`` from the whole
``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import accelfn as af
from accelfn.checkpointing import CheckpointInfo, PlanMismatchError, RunFolder, RunFolderError


class UsageError(SystemExit):
    """A command-line mistake: exit status 2 (as argparse's own errors), the message in
    ``str(error)``; :func:`refuse` prints it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = 2


def refuse(message: str) -> NoReturn:
    """Print ``<script>: error: message`` (on the first process) and exit with status 2."""
    if af.is_main_process():
        print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr, flush=True)
    raise UsageError(message)


def _number(text: str, kind: Callable[[str], Any], low: float, strict: bool) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (else a usage error saying so)."""
    value: int = _number(text, int, 1, strict=False)
    return value


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer >= 0."""
    value: int = _number(text, int, 0, strict=False)
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a number > 0."""
    value: float = _number(text, float, 0.0, strict=True)
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--out``, ``--resume``, ``--overwrite`` and ``--allow-resharding`` to ``parser``."""
    RunFolder.add_arguments(parser)


def open_run(args: argparse.Namespace, name: str) -> RunFolder:
    """The run's [`RunFolder`][accelfn.checkpointing.RunFolder] (call after
    ``af.init_distributed()``); a usage error, with what to pass, when it does not fit.
    Sets ``args.resume`` to the checkpoint it resumes, and keeps the folder in ``args``."""
    try:
        run = RunFolder.from_args(args, name)
    except RunFolderError as error:
        refuse(str(error))
    args.resume = None if run.checkpoint is None else str(run.checkpoint)
    args.run_folder = run
    return run


def run_folder(args: argparse.Namespace, name: str) -> str:
    """The path of [`open_run`][]'s folder, the same on every process."""
    return str(open_run(args, name).path)


def _planned_steps(checkpoint: Path | None, saved: Any, total: Any) -> str:
    return (f"{checkpoint} belongs to a run of {saved} updates (its learning-rate schedule "
            f"spans them) and this one asks for {total}: resume with --steps {saved}, or "
            f"start a new run (without --resume) with --steps {total}")


def resume(args: argparse.Namespace, state: Any, *, loader: Any | None, step: Any,
           total: int | None = None, announce: bool = True) -> CheckpointInfo | None:
    """The run folder's resume of ``--resume`` (after [`run_folder`][]), or None without it.

    ``total``: the updates this run's schedule spans; a checkpoint planned for another
    number is refused before anything is loaded (as [`check_plan`][] does after). With the
    processes that wrote it the resume is exact; another number of processes needs
    ``--allow-resharding``, and then a line says what was left behind: printed here, or by
    [`announce_resumed`][] with ``announce=False`` (when the script checks more first).
    """
    run: RunFolder | None = getattr(args, "run_folder", None)
    if run is None:
        run = open_run(args, "run")
    try:
        info = run.resume(state, loader=loader, step=step,
                          plan=None if total is None else {"total_steps": total})
    except PlanMismatchError as error:
        if error.key == "total_steps":
            refuse(_planned_steps(run.checkpoint, error.saved, error.wanted))
        refuse(str(error))
    except RunFolderError as error:
        refuse(str(error))
    args.resumed_line = None
    if info is not None and run.resharded_from is not None:
        args.resumed_line = (
            f"resumed {info.path}, written by {run.resharded_from} process(es), in "
            f"{af.world_size()}: the RNG states and the loader position were left behind; "
            "the data start a new epoch")
    if announce:
        announce_resumed(args)
    return info


def announce_resumed(args: argparse.Namespace) -> None:
    """Print (on the first process) what a resume in another number of processes left
    behind, once; nothing after an exact resume or none."""
    line = getattr(args, "resumed_line", None)
    if line and af.is_main_process():
        print(line)
    args.resumed_line = None


def check_plan(info: CheckpointInfo | None, total: int) -> None:
    """Usage error when the resumed run was planned for another number of updates than
    ``total`` (its learning-rate schedule spans the planned ones). ``resume(...,
    total=total)`` makes this check before anything is loaded and printed."""
    extra = info.extra if info is not None else None
    planned = extra.get("total_steps") if isinstance(extra, dict) else None
    if info is not None and planned is not None and int(planned) != total:
        refuse(_planned_steps(info.path, planned, total))


def check_batch(batch_size: int, samples: int, accumulation: int = 1) -> None:
    """Refuse (exit status 2) a ``--batch-size`` larger than each process's share of the
    ``samples`` training samples, or an ``--accumulation`` that cannot split it."""
    world = af.world_size()
    if batch_size > samples // world:
        refuse(f"--batch-size {batch_size} is larger than the {samples // world} training samples "
               f"of each of the {world} process(es): lower --batch-size")
    if accumulation > batch_size:
        refuse(f"--accumulation {accumulation} cannot split a batch of {batch_size} samples into "
               f"{accumulation} micro-batches: use --accumulation {batch_size} or less, or a "
               "larger --batch-size")


def nothing_to_train(out: str, done: int, stop: int, total: int, longer: str) -> str:
    """The line that says why a resumed run trains no further, and what to pass."""
    if done >= total:
        return (f"{out}: the run already reached its last update ({done} of {total}); "
                f"nothing to train. {longer}")
    return (f"{out}: already at --stop-at {stop} ({done} of {total} updates); raise --stop-at "
            "or leave it out to continue")


if __name__ == "__main__":
    sys.exit("run_options is imported by the examples; run one of them instead")
