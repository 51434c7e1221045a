"""The ``accelfn`` command line.

``accelfn`` alone prints the help; ``accelfn --version`` the installed version.
``accelfn doctor [--json] [--num-workers N] [--memory SCRIPT]`` checks the machine (and
estimates a script's peak memory per update; see
:mod:`accelfn.observe.environment`); ``accelfn doctor --hang DIR`` names the collective a
run hung in and the ranks that never entered it, from the Flight Recorder dumps in ``DIR``
(see :mod:`accelfn.observe.hang_dumps`); ``accelfn bench`` runs the staged case study (see
:mod:`accelfn.cli.bench`); ``accelfn launch <torchrun arguments>`` is torchrun whose exit
status is 75 when the workers saved on preemption (see :mod:`accelfn.cli.launch`).

Each subcommand is one ``add_<name>(subparsers)`` function that builds its parser and sets
``func`` (taking the parsed arguments, returning the exit status); :data:`COMMANDS` lists
them, so a new subcommand is one function and one entry.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .. import __version__
from .bench import add_bench
from .launch import add_launch

__all__ = ["COMMANDS", "build_parser", "main"]


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer >= 0 (a usage error, exit status 2, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _run_hang(args: argparse.Namespace) -> int:
    """``accelfn doctor --hang DIR``: 1 when a rank is named, 0 when none is missing."""
    import json

    from ..observe.findings import format_findings, worst_severity
    from ..observe.hang_dumps import analyse

    try:
        findings = analyse(args.hang)
    except (OSError, ValueError) as error:
        print(f"accelfn doctor: error: --hang {args.hang}: {error}", file=sys.stderr)
        return 2
    print(json.dumps([f.to_dict() for f in findings], indent=2) if args.json
          else format_findings(findings))
    return 1 if worst_severity(findings) == "error" else 0


def _run_doctor(args: argparse.Namespace) -> int:
    from ..observe.environment import doctor

    if args.hang is not None:
        return _run_hang(args)

    report = doctor(num_workers=args.num_workers)
    if args.json and args.memory is None:
        print(report.to_json())
    elif not args.json:
        print(report)
    if args.memory is not None:  # the script's update, estimated before it trains
        import dataclasses
        import json

        from ..observe.memory import estimate_script, format_estimate

        if not os.path.isfile(args.memory):
            print(f"accelfn doctor: error: --memory {args.memory}: no such file",
                  file=sys.stderr)
            return 2
        try:
            estimate = estimate_script(args.memory)
        except Exception as error:  # the script's own failure too: said, not a traceback
            print(f"accelfn doctor: error: --memory {args.memory}: "
                  f"{type(error).__name__}: {error}", file=sys.stderr)
            return 2
        if args.json:  # one JSON object: the report and the estimate under "memory"
            print(json.dumps({**report.to_dict(), "memory": dataclasses.asdict(estimate)},
                             indent=2, default=str))
        else:
            print(format_estimate(estimate))
    return 0 if report.ok else 1


def add_doctor(subparsers: Any) -> None:
    """``accelfn doctor``: versions, CUDA, driver, GPUs, settings; each problem with its fix."""
    p = subparsers.add_parser(
        "doctor", help="check torch, CUDA, cuDNN, driver and GPUs; print fixes",
        description="Check this machine for training: versions, CUDA runtime and driver, "
                    "GPUs, bf16/TF32 support and settings, CPU cores against workers. "
                    "Exits 1 when a finding is an error.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--num-workers", type=non_negative_int, default=None, metavar="N",
                   help="data-loader workers you plan to use, checked against the CPU cores")
    p.add_argument("--memory", default=None, metavar="SCRIPT",
                   help="also estimate one update's peak memory by kind for a training script "
                        "defining memory_case() -> (step, state, batch), without training")
    p.add_argument("--hang", default=None, metavar="DIR",
                   help="instead, name the collective a run hung in and the ranks that never "
                        "entered it, from the Flight Recorder dumps in DIR (the hang_dir "
                        "given to accelfn.init_distributed)")
    p.set_defaults(func=_run_doctor)


COMMANDS: list[Callable[[Any], None]] = [add_doctor, add_bench, add_launch]


def build_parser() -> argparse.ArgumentParser:
    """The ``accelfn`` parser with every subcommand in :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="accelfn", description="accelfn: composable transforms that make a pure "
                                    "PyTorch step function train fast.")
    parser.add_argument("--version", action="version", version=f"accelfn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``accelfn`` console script; returns the exit status.

    Without a subcommand it prints the help (to stdout) and returns 0.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
