"""``accelfn bench`` on the command line: its options, the run, the output files."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import MODELS, BenchConfig
from .report import format_table, plot_bench
from .stages import ddp_worker, run_bench

__all__ = ["DEFAULT_OUT", "DESCRIPTION", "add_bench", "main"]

#: Where ``accelfn bench`` writes ``bench.json`` and ``bench.png`` unless told otherwise.
DEFAULT_OUT = "runs/bench"

DESCRIPTION = (
    "Reproduce the staged ResNet-50 case study (published on one V100: 312 -> 387 -> 542 -> 798 "
    "images/s) on this machine: a hand-written DataLoader baseline, then the accelfn data "
    "pipeline, AMP, torch.compile, channels_last and DDP, each added to the previous; "
    "samples/s, speedups, peak memory, MFU, and accelfn's per-step overhead against the same "
    "loop written by hand. Prints a table and writes DIR/bench.json and DIR/bench.png (--out).")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=MODELS, default=None,
                   help="resnet50 (default), resnet18, cnn (tiny; --quick's default) or mlp")
    p.add_argument("--steps", type=int, default=None, help="timed steps per stage")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before them (the first one, compile included, is "
                        "reported as first_step_s)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per device (default 256 on a GPU, 32 on a CPU)")
    p.add_argument("--image-size", type=int, default=None,
                   help="pixels (default 224 for ResNets on a GPU, else 32)")
    p.add_argument("--samples", type=int, default=None, help="images preloaded in memory")
    p.add_argument("--data", choices=("synthetic", "digits"), default="synthetic",
                   help="random uint8 images, or the embedded handwritten digits upscaled")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--amp-dtype", choices=("auto", "bf16", "fp16"), default="auto",
                   help="AMP stages' dtype (auto: bf16, fp16 where bf16 is not supported)")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="include the compile stages (default: on, off with --quick)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the compile stages")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode (default, reduce-overhead, max-autotune, ...)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend (default inductor; 'eager' only traces, to check "
                        "the harness quickly)")
    p.add_argument("--workers", type=int, default=None,
                   help="DataLoader workers of the tuned stage (default min(8, cores))")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads per process (default: the free cores, the "
                        "load average taken off, at least 1; the DDP stage divides them "
                        "among its processes)")
    p.add_argument("--overhead-steps", type=int, default=None,
                   help="interleaved steps of the overhead check (0 skips it)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole sequence of stages this many times and report each "
                        "stage's median (steadier figures on a busy machine)")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", default=True,
                   help="skip the DDP stage")
    p.add_argument("--ddp-procs", type=int, default=None, metavar="N",
                   help="processes of the DDP stage (default: every GPU; on a CPU it runs "
                        "only when given, with gloo)")
    p.add_argument("--stages", default=None,
                   help="comma-separated stage names to run (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="tiny CNN, 32 px, a few steps, no compile unless --compile: under a "
                        "minute on a laptop CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"folder of the result files bench.json and bench.png (default "
                        f"{DEFAULT_OUT})")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the JSON result here instead of DIR/bench.json ('-' prints it "
                        "to stdout and writes no file)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write the PNG bar chart here instead of next to the JSON file "
                        "(needs matplotlib: pip install 'accelfn[plot]')")
    p.add_argument("--no-plot", dest="plot", action="store_const", const="",
                   help="write no bar chart")
    p.add_argument("--ddp-worker", default=None, help=argparse.SUPPRESS)


def _config_from_args(args: argparse.Namespace) -> BenchConfig:
    stages = (None if args.stages is None
              else tuple(s.strip() for s in args.stages.split(",") if s.strip()))
    return BenchConfig(
        model=args.model, device=args.device, steps=args.steps, warmup=args.warmup,
        batch_size=args.batch_size, image_size=args.image_size, samples=args.samples,
        data=args.data, amp_dtype=args.amp_dtype, compile=args.compile,
        compile_mode=args.compile_mode, compile_backend=args.compile_backend,
        workers=args.workers, threads=args.threads,
        overhead_steps=args.overhead_steps, repeats=args.repeats, ddp=args.ddp,
        ddp_procs=args.ddp_procs,
        stages=stages, quick=args.quick, seed=args.seed)


def _run(args: argparse.Namespace) -> int:
    cfg = _config_from_args(args)
    if args.ddp_worker:
        return ddp_worker(cfg.resolved(), args.ddp_worker)
    json_path = str(Path(args.out) / "bench.json") if args.json is None else args.json
    plot_path = args.plot
    if plot_path is None:  # next to the JSON file
        plot_path = str(Path(args.out) / "bench.png" if json_path == "-"
                        else Path(json_path).with_suffix(".png"))

    def write(result: dict[str, Any]) -> None:
        if json_path != "-":
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps(result, indent=2) + "\n")

    try:
        result = run_bench(cfg, on_progress=write)
    except ValueError as exc:
        print(f"accelfn bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if json_path == "-":
        print(json.dumps(result, indent=2))
    else:
        write(result)
        print(f"JSON: {json_path}")
    if plot_path:
        saved = plot_bench(result, plot_path)
        if saved is not None:
            print(f"plot: {saved}")
    failed = [s["name"] for s in result["stages"] if s["status"] == "error"]
    return 1 if failed else 0


def add_bench(subparsers: Any) -> None:
    """``accelfn bench``: the staged ResNet-50 case study (baseline to DDP) on this machine."""
    p = subparsers.add_parser(
        "bench", help="the staged speed-up case study (DataLoader baseline -> accelfn data "
                      "-> AMP -> compile -> channels_last -> DDP) on this machine",
        description=DESCRIPTION)
    _add_arguments(p)
    p.set_defaults(func=_run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m accelfn.cli.bench [options]``: the same as ``accelfn bench``."""
    parser = argparse.ArgumentParser(prog="accelfn bench", description=DESCRIPTION)
    _add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    return _run(parser.parse_args(argv))
