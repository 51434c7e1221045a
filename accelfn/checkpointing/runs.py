"""A run's folder: where one training run keeps its checkpoints, metrics and plot, and how a
script starts it, refuses to mix two runs in it, and continues it on ``--resume``.

    parser = argparse.ArgumentParser()
    RunFolder.add_arguments(parser)            # --out, --resume, --overwrite, --allow-resharding
    args = parser.parse_args()
    device = af.init_distributed()
    run = RunFolder.from_args(args, "digits")  # every process gets the same folder
    ...                                        # build state, loader and step
    run.resume(state, loader=train, step=step, plan={"total_steps": total})
    monitor = af.Monitor(state=state, sinks=[af.JsonlSink(run.metrics_file)], plot=run.plot_file)
    with monitor, PreemptionGuard() as guard:
        for batch in monitor.iterate(train):
            monitor.step(step(state, batch))
            guard.exit_if_requested(run.path, state, loader=train, step=step, extra=run.extra)
    run.save(state, loader=train, step=step)

Each run writes into a folder of its own: ``<root>/<name>/<date>-<time>`` unless ``out``
names one. A folder that holds another run's checkpoints is refused (its checkpoints would
mix with this run's) unless ``overwrite`` deletes them or ``resume`` continues that run.
``resume`` takes a checkpoint, a run folder (its newest checkpoint) or ``<root>/<name>`` (the
run whose newest checkpoint is newest); the resumed run keeps writing into its own folder.

What is checked before anything is loaded, so that a refused resume changes nothing: the
run's plan (values such as the number of updates its learning-rate schedule spans, stored
with every checkpoint), and the number of processes (another one needs
``allow_resharding``: weights, optimizer, schedule and transform state carry over, the RNG
states and the loader position do not). Errors are [`RunFolderError`][], whose message names
the option (``--resume`` from [`RunFolder.from_args`][], ``resume=`` otherwise) that fixes
the call. The decision is taken on the first process and the same folder, or the same
error, reaches every process.

Written here rather than taken from a library: the launchers' and trainers' run folders
(Lightning's ``version_N``, Accelerate's project configuration) come with their trainers;
this one is the folder logic alone over [`save`][accelfn.checkpointing.save] and
[`load`][accelfn.checkpointing.load].
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

from .collective import rank_world
from .files import checkpoints, is_committed, latest
from .format import META_FILE, CheckpointError, CheckpointInfo
from .loading import load
from .saving import save

__all__ = ["PlanMismatchError", "RunFolder", "RunFolderError"]

T = TypeVar("T")

#: accelfn.checkpointing's logger (routed and filtered as accelfn.observe.logs describes; only
#: rank 0 logs here)
_log = logging.getLogger("accelfn.checkpointing")

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "run.png"


class RunFolderError(ValueError):
    """A run folder or a resume that does not fit this run; the message says what to pass."""


class PlanMismatchError(RunFolderError):
    """A resumed checkpoint was planned with another value of ``key`` (``saved``) than this
    run's (``wanted``), e.g. another number of updates for its learning-rate schedule."""

    def __init__(self, message: str, key: str, saved: Any, wanted: Any) -> None:
        super().__init__(message)
        self.key, self.saved, self.wanted = key, saved, wanted


def _on_rank0(decide: Callable[[], T]) -> T:
    """``decide()`` on the first process; its result, or its error, on every process."""
    rank, world = rank_world()
    if world == 1:
        return decide()
    box: list[Any] = [None]
    if rank == 0:
        try:
            box = [("ok", decide())]
        except PlanMismatchError as error:
            box = [("plan", (str(error), error.key, error.saved, error.wanted))]
        except RunFolderError as error:
            box = [("refused", str(error))]
        except Exception as error:  # the other processes must hear of it too
            box = [("error", f"{type(error).__name__}: {error}")]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "plan":
        raise PlanMismatchError(*value)
    if kind == "refused":
        raise RunFolderError(value)
    if kind == "error":
        raise RuntimeError(f"run folder: on the first process: {value}")
    result: T = value
    return result


def _planned(checkpoint: Path) -> Any:
    """The ``extra`` a checkpoint was saved with, read without loading its tensors (None when
    it cannot be read this way; [`load`][] then reports it)."""
    try:
        payload = torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=True,
                             mmap=True)
    except Exception:
        return None
    return payload.get("extra") if isinstance(payload, dict) else None


class RunFolder:
    """The folder of one training run: new, chosen, or the one of the run it resumes.

    Args:
        name: the kind of run; new folders are made under ``root/name``.
        out: the folder to write into (made when missing) instead of a new one.
        resume: a checkpoint, a run folder (its newest checkpoint) or ``root/name`` (the
            run whose newest checkpoint is newest) to continue; the run keeps writing into
            that run's folder unless ``out`` names another.
        overwrite: delete the checkpoints of another run found in ``out`` and start there.
        allow_resharding: resume a checkpoint written by another number of processes.
        root: where new run folders are made.
        keep: how many checkpoints [`save`][] keeps.

    Attributes:
        path: the run's folder (checkpoints ``step-*``, ``metrics.jsonl``, ``run.png``).
        checkpoint: the checkpoint [`resume`][] loads (``None``: a new run).
        plan: what checkpoints of this run are saved with and a resumed one must match.
        resharded_from: after [`resume`][], the number of processes that wrote the
            checkpoint when it differs from this run's (else ``None``).

    Raises:
        RunFolderError: ``resume`` names no checkpoint; ``out`` is a file, or holds another
            run's checkpoints without ``overwrite``.

    Call it after ``torch.distributed`` is initialised: the first process decides and every
    process gets the same folder.
    """

    def __init__(self, name: str, *, out: str | Path | None = None,
                 resume: str | Path | None = None, overwrite: bool = False,
                 allow_resharding: bool = False, root: str | Path = "runs", keep: int = 2,
                 _flags: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"RunFolder(keep={keep}): must be >= 1")
        self.name, self.keep = name, keep
        self.allow_resharding = allow_resharding
        self._flags = _flags
        #: what checkpoints of this run are saved with and a resumed one must match
        self.plan: dict[str, Any] = {}
        self._replan: frozenset[str] = frozenset()
        #: the world size of the resumed checkpoint, when it differs from this run's
        self.resharded_from: int | None = None
        path, checkpoint = _on_rank0(lambda: self._decide(out, resume, overwrite, Path(root)))
        #: the run's folder (checkpoints ``step-*``, ``metrics.jsonl``, ``run.png``)
        self.path: Path = Path(path)
        #: the checkpoint [`resume`][] loads (``None``: a new run)
        self.checkpoint: Path | None = None if checkpoint is None else Path(checkpoint)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """Add ``--out``, ``--resume``, ``--overwrite`` and ``--allow-resharding``."""
        parser.add_argument("--out", default=None,
                            help="the run's folder for checkpoints, logs and plots (default: a "
                                 "new runs/<name>/<date>-<time>; with --resume, the resumed "
                                 "run's)")
        parser.add_argument("--resume", default=None,
                            help="continue a run: a checkpoint, a run folder (its newest "
                                 "checkpoint) or runs/<name> (its newest run)")
        parser.add_argument("--overwrite", action="store_true",
                            help="write into --out although it holds another run's "
                                 "checkpoints (they are deleted first)")
        parser.add_argument("--allow-resharding", action="store_true",
                            help="resume a checkpoint written by another number of processes: "
                                 "weights, optimizer, schedule and transform state carry over; "
                                 "RNG states and the loader position do not (the data start a "
                                 "new epoch)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, name: str, *, root: str | Path = "runs",
                  keep: int = 2) -> RunFolder:
        """The run folder of the options [`add_arguments`][] added; errors name the flags."""
        return cls(name, out=args.out, resume=args.resume, overwrite=args.overwrite,
                   allow_resharding=args.allow_resharding, root=root, keep=keep, _flags=True)

    # ----------------------------------------------------------------------------- options
    def _opt(self, option: str, value: Any = None) -> str:
        """How the user spells ``option`` (with ``value``): a flag or a keyword."""
        if self._flags:
            flag = "--" + option.replace("_", "-")
            return flag if value is None else f"{flag} {value}"
        return f"{option}=True" if value is None else f"{option}={str(value)!r}"

    def _refuse(self, message: str) -> NoReturn:
        raise RunFolderError(message)

    # ------------------------------------------------------------------------------ folder
    def _find(self, path: Path) -> tuple[Path, Path]:
        """(run folder, checkpoint) named by ``resume``."""
        if path in checkpoints(path.parent) or (is_committed(path) and not path.is_symlink()):
            return path.parent, path  # a checkpoint, also copied or renamed (best/, abandoned-)
        newest = latest(path)
        if newest is not None:
            return path, newest
        runs = [(found, run) for run in (sorted(path.iterdir()) if path.is_dir() else [])
                if run.is_dir() and (found := latest(run)) is not None]
        if runs:
            found, run = max(runs, key=lambda pair: pair[0].stat().st_mtime)
            return run, found
        self._refuse(f"{self._opt('resume', path)}: no complete checkpoint there, nor in a run "
                     "folder under it; pass a run folder (it holds step-* folders) or one of "
                     "its checkpoints")

    def _new_folder(self, root: Path) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in range(1000):
            candidate = root / (stamp if i == 0 else f"{stamp}-{i}")
            try:
                candidate.mkdir(parents=True)
                return candidate
            except FileExistsError:
                continue
        self._refuse(f"cannot make a new run folder under {root}; pass {self._opt('out', '…')}")

    def _decide(self, out: str | Path | None, resume: str | Path | None, overwrite: bool,
                root: Path) -> tuple[str, str | None]:
        resumed: Path | None = None
        checkpoint: str | None = None
        if resume:
            resumed, found = self._find(Path(resume))
            checkpoint = str(found)
        if out:
            folder = Path(out)
            if folder.exists() and not folder.is_dir():  # else the run would fail when it saves
                self._refuse(f"{self._opt('out', folder)}: is a file, not a folder; pass a "
                             f"folder (a new one is made) or leave {self._opt('out')} out")
        elif resumed is not None:
            folder = resumed
        else:
            folder = self._new_folder(root / self.name)
        if resumed is None or folder.resolve() != resumed.resolve():
            others = checkpoints(folder)
            if others and not overwrite:
                self._refuse(
                    f"{folder} holds the checkpoints of another run ({others[-1].name}): pass "
                    f"{self._opt('resume', folder)} to continue it, {self._opt('overwrite')} "
                    f"to delete them and start again there, or leave {self._opt('out')} out "
                    "(each run then gets a new folder of its own)")
            for old in others:
                shutil.rmtree(old)
            folder.mkdir(parents=True, exist_ok=True)
        return str(folder), checkpoint

    @property
    def metrics_file(self) -> Path:
        """``path/metrics.jsonl``: one JSON row per update (give the monitor
        ``sinks=[af.JsonlSink(run.metrics_file)]`` and its ``state=``, and a resumed run
        continues it)."""
        return self.path / METRICS_FILE

    @property
    def plot_file(self) -> Path:
        """``path/run.png``: where the run's picture goes."""
        return self.path / PLOT_FILE

    @property
    def extra(self) -> dict[str, Any]:
        """What checkpoints of this run are saved with: a copy of ``plan``."""
        return dict(self.plan)

    def history(self) -> list[dict[str, Any]]:
        """The rows of ``metrics.jsonl``, every run of this folder (before a resume and
        after), ordered by step, the last row written for a step kept; ``[]`` when there
        are none. A line that is not a JSON object (a run killed mid-write) is skipped."""
        if not self.metrics_file.is_file():
            return []
        rows: dict[int, dict[str, Any]] = {}
        for n, line in enumerate(self.metrics_file.read_text().splitlines()):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                step = row.get("step")
                rows[step if isinstance(step, int) else -1 - n] = row
        return [rows[k] for k in sorted(rows)]

    # ------------------------------------------------------------------------------ resume
    def resume(self, state: Any, *, loader: Any | None = None, step: Any = None,
               plan: Mapping[str, Any] | None = None,
               replan: tuple[str, ...] = ()) -> CheckpointInfo | None:
        """Load ``checkpoint`` into ``state`` (``None`` for a new run, which loads nothing).

        ``plan``: plain values this run was started with that a resumed run must share
        (e.g. ``{"total_steps": 1000}``: its learning-rate schedule spans them); [`save`][]
        stores them with every checkpoint. Checked, with the number of processes, before
        anything is loaded: a refused resume leaves ``state`` as it was.

        ``replan``: keys of ``plan`` this resumed run changes on purpose; the checkpoints it
        saves hold the new values. Extending a warmup-stable-decay run from its stable phase
        is one: build the schedule with the new total and resume with ``plan={"total_steps":
        new}, replan=("total_steps",)``; [`warmup_stable_decay`][accelfn.warmup_stable_decay]
        refuses a checkpoint whose decay had begun (its rates would differ from the new
        plan's).

        With the processes that wrote it the resume is exact (loader position and RNG
        states included). With another number of processes (``allow_resharding``) everything
        but those is restored and ``resharded_from`` says how many wrote it.

        Raises:
            RunFolderError: the checkpoint was planned otherwise, written by another number
                of processes without ``allow_resharding``, or does not fit ``state`` or
                ``step`` (what differs, as [`load`][accelfn.checkpointing.load] says).
        """
        self.plan = dict(plan or {})
        unknown = sorted(set(replan) - set(self.plan)) if not isinstance(replan, str) else None
        if unknown is None or unknown:
            raise TypeError(f"RunFolder.resume(replan={replan!r}): give a tuple of keys of "
                            f"plan= (here {sorted(self.plan)}) that this run changes on purpose")
        self._replan = frozenset(replan)
        if self.checkpoint is None:
            return None
        checkpoint = self.checkpoint
        saved = _on_rank0(lambda: self._check(checkpoint))
        world = rank_world()[1]
        try:
            if saved == world:
                info = load(checkpoint, state, loader=loader, step=step)
            else:
                info = load(checkpoint, state, loader=None, step=step, allow_resharding=True)
        except CheckpointError as error:  # every process raises it
            self._refuse(f"{self._opt('resume', checkpoint)} does not fit this run: "
                         f"{str(error).rstrip('.')}. Resume it with the script and the "
                         "options that wrote it, or start a new run (without "
                         f"{self._opt('resume')})")
        self._check_plan(info.extra)  # a checkpoint whose plan could not be read before
        self.resharded_from = saved if saved != world else None
        if rank_world()[0] == 0:
            resharded = f", written by {saved} process(es)" if saved != world else ""
            _log.info("resumed from step %d (%s)%s", info.step, info.path, resharded)
        return info

    def _check(self, checkpoint: Path) -> int:
        """The checkpoint's world size, after checking it and the plan against this run."""
        try:
            meta = json.loads((checkpoint / META_FILE).read_text())
            saved = int(meta["world_size"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            self._refuse(f"{self._opt('resume', checkpoint)}: its {META_FILE} cannot be read "
                         f"({error}); resume an earlier checkpoint of the run")
        if self.plan:
            self._check_plan(_planned(checkpoint))
        world = rank_world()[1]
        if saved != world and not self.allow_resharding:
            self._refuse(
                f"{checkpoint} was written by {saved} process(es) and this run has {world}: "
                f"pass {self._opt('allow_resharding')} to resume it anyway (weights, "
                "optimizer, schedule and transform state carry over; the RNG states and the "
                "loader position do not, so the data start a new epoch), or resume with "
                f"torchrun --nproc_per_node={saved}")
        return saved

    def _check_plan(self, extra: Any) -> None:
        if not isinstance(extra, dict):
            return
        for key, wanted in self.plan.items():
            if key in extra and extra[key] != wanted and key not in self._replan:
                without = "--resume" if self._flags else "resume="
                raise PlanMismatchError(
                    f"{self.checkpoint} belongs to a run planned with {key}={extra[key]!r} and "
                    f"this one has {key}={wanted!r}: resume it with the options that wrote "
                    f"it, start a new run (without {without}), or, to change {key} on purpose "
                    f"(e.g. a warmup-stable-decay run extended from its stable phase), pass "
                    f"replan=({key!r},) to RunFolder.resume()",
                    key, extra[key], wanted)

    # -------------------------------------------------------------------------------- save
    def save(self, state: Any, *, loader: Any | None = None, step: Any = None,
             extra: Mapping[str, Any] | None = None) -> Path:
        """[`save`][accelfn.checkpointing.save] into ``path``, keeping the newest ``keep``
        checkpoints, with the run's ``plan`` (and ``extra``) stored along."""
        saved: Path = save(self.path, state, loader=loader, step=step, keep=self.keep,
                           extra={**self.plan, **(extra or {})})
        return saved

    def __repr__(self) -> str:
        resumed = f", resume={str(self.checkpoint)!r}" if self.checkpoint else ""
        return f"RunFolder({str(self.path)!r}{resumed})"
