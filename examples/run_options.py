"""The command-line options every example shares: where a run writes, and resuming it.

    parser = argparse.ArgumentParser()
    run_options.add_arguments(parser)
    args = parser.parse_args()
    device = af.init_distributed()
    out = run_options.run_folder(args, "digits")      # every process gets the same folder
    ...                                               # build state, loader and step
    info = run_options.resume(args, state, loader=train, step=step)

Each run writes into a folder of its own: ``runs/<name>/<date>-<time>`` unless ``--out``
names one. A folder that holds another run's checkpoints is refused (its checkpoints would
mix with this run's) unless ``--overwrite`` deletes them or ``--resume`` continues that run.
``--resume`` takes a checkpoint, a run folder (its newest checkpoint) or ``runs/<name>`` (the
run whose newest checkpoint is newest); the resumed run keeps writing into its own folder.
A checkpoint written by another number of processes needs ``--allow-resharding``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist

import accelfn as af
from accelfn import checkpointing

T = TypeVar("T")


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
    parser.add_argument("--out", default=None,
                        help="the run's folder for checkpoints, logs and plots (default: a new "
                             "runs/<name>/<date>-<time>; with --resume, the resumed run's)")
    parser.add_argument("--resume", default=None,
                        help="continue a run: a checkpoint, a run folder (its newest "
                             "checkpoint) or runs/<name> (its newest run)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into --out although it holds another run's checkpoints "
                             "(they are deleted first)")
    parser.add_argument("--allow-resharding", action="store_true",
                        help="resume a checkpoint written by another number of processes: "
                             "weights, optimizer, schedule and transform state carry over; "
                             "RNG states and the loader position do not (the data start a "
                             "new epoch)")


def _on_rank0(decide: Callable[[], T]) -> T:
    """``decide()`` on the first process, its result (or its SystemExit) on every process."""
    if af.world_size() == 1:
        return decide()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", decide())]
        except SystemExit as stop:  # refuse() printed it here; the others only exit
            box = [("exit", str(stop))]
        except Exception as error:  # the other processes must hear of it too
            box = [("error", f"{type(error).__name__}: {error}")]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "exit":
        raise UsageError(value)
    if kind == "error":
        raise RuntimeError(f"on the first process: {value}")
    result: T = value
    return result


def find_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run folder, checkpoint) named by ``--resume``; SystemExit if there is none."""
    path = Path(path)
    if path in checkpointing.checkpoints(path.parent):
        return path.parent, path
    newest = checkpointing.latest(path)
    if newest is not None:
        return path, newest
    runs = [(found, run) for run in (sorted(path.iterdir()) if path.is_dir() else [])
            if run.is_dir() and (found := checkpointing.latest(run)) is not None]
    if runs:
        found, run = max(runs, key=lambda pair: pair[0].stat().st_mtime)
        return run, found
    refuse(f"--resume {path}: no complete checkpoint there, nor in a run folder under "
                     "it; pass a run folder (it holds step-* folders) or one of its checkpoints")


def _new_folder(root: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        candidate = root / (stamp if i == 0 else f"{stamp}-{i}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    refuse(f"cannot make a new run folder under {root}; pass --out")


def run_folder(args: argparse.Namespace, name: str) -> str:
    """The run's folder, the same on every process (call after ``af.init_distributed()``).

    Sets ``args.resume`` to the checkpoint it names. SystemExit, with what to pass, when the
    folder holds another run's checkpoints.
    """

    def decide() -> tuple[str, str | None]:
        resumed: Path | None = None
        checkpoint: str | None = None
        if args.resume:
            resumed, found = find_checkpoint(args.resume)
            checkpoint = str(found)
        if args.out:
            out = Path(args.out)
            if out.exists() and not out.is_dir():  # else the run would fail when it saves
                refuse(f"--out {out}: is a file, not a folder; pass a folder (a new one is "
                       "made) or drop --out")
        elif resumed is not None:
            out = resumed
        else:
            out = _new_folder(Path("runs") / name)
        if resumed is None or out.resolve() != resumed.resolve():
            others = checkpointing.checkpoints(out)
            if others and not args.overwrite:
                refuse(
                    f"{out} holds the checkpoints of another run ({others[-1].name}): pass "
                    f"--resume {out} to continue it, --overwrite to delete them and start "
                    "again there, or drop --out (each run then gets a new folder of its own)")
            for old in others:
                shutil.rmtree(old)
        return str(out), checkpoint

    out, args.resume = _on_rank0(decide)
    return out


def _mismatch(checkpoint: Path, error: Exception) -> str:
    """The line for a checkpoint that does not fit this run (another example's, or one
    written with other options): what differs, as checkpointing.load says, and what to do."""
    return (f"--resume {checkpoint} does not fit this run: {str(error).rstrip('.')}. Resume it "
            "with the example and the options that wrote it, or start a new run (without "
            "--resume)")


def resume(args: argparse.Namespace, state: af.TrainState, *, loader: Any | None,
           step: af.Step) -> checkpointing.CheckpointInfo | None:
    """``checkpointing.load`` of ``--resume`` (after [`run_folder`][]), or None without it.

    With the processes that wrote it the resume is exact (loader position and RNG states
    included). Another number of processes needs ``--allow-resharding``, and then restores
    everything but those.
    """
    if not args.resume:
        return None
    checkpoint = Path(args.resume)
    meta = json.loads((checkpoint / "meta.json").read_text())  # see accelfn.checkpointing.format
    saved, world = int(meta["world_size"]), af.world_size()
    if saved == world:
        try:
            return checkpointing.load(checkpoint, state, loader=loader, step=step)
        except checkpointing.CheckpointError as error:  # every process raises it
            refuse(_mismatch(checkpoint, error))
    if not args.allow_resharding:
        refuse(
            f"{checkpoint} was written by {saved} process(es) and this run has {world}: pass "
            "--allow-resharding to resume it anyway (weights, optimizer, schedule and transform "
            "state carry over; the RNG states and the loader position do not, so the data "
            f"start a new epoch), or resume with torchrun --nproc_per_node={saved}")
    try:
        info = checkpointing.load(checkpoint, state, loader=None, step=step,
                                  allow_resharding=True)
    except checkpointing.CheckpointError as error:
        refuse(_mismatch(checkpoint, error))
    if af.is_main_process():
        print(f"resumed {checkpoint}, written by {saved} process(es), in {world}: the RNG "
              "states and the loader position were left behind; the data start a new epoch")
    return info


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


def check_plan(info: checkpointing.CheckpointInfo | None, total: int) -> None:
    """SystemExit when the resumed run was planned for another number of updates than
    ``total`` (its learning-rate schedule spans the planned ones)."""
    extra = info.extra if info is not None else None
    planned = extra.get("total_steps") if isinstance(extra, dict) else None
    if info is not None and planned is not None and int(planned) != total:
        refuse(
            f"{info.path} belongs to a run of {planned} updates (its "
            f"learning-rate schedule spans them) and this one asks for {total}: resume with "
            f"--steps {planned}, or start a new run (without --resume) with --steps {total}")


def nothing_to_train(out: str, done: int, stop: int, total: int, longer: str) -> str:
    """The line that says why a resumed run trains no further, and what to pass."""
    if done >= total:
        return (f"{out}: the run already reached its last update ({done} of {total}); "
                f"nothing to train. {longer}")
    return (f"{out}: already at --stop-at {stop} ({done} of {total} updates); raise --stop-at "
            "or leave it out to continue")


if __name__ == "__main__":
    sys.exit("run_options is imported by the examples; run one of them instead")
