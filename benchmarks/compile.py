"""Regional compilation and the compile cache file, as ratios measured in one run.

On a 12-block GPT (``benchmarks/gpt2.py``'s model; 64 wide on a CPU, GPT-2 small's width on
a GPU), every compile is timed in a fresh process whose ``TORCHINDUCTOR_CACHE_DIR`` and
``TMPDIR`` are new, empty directories (a fresh machine):

* ``regional``: the cold compile time of ``af.compiled(regional=True)`` (each block compiled
  in place, one compiled code for all twelve, the rest eager) and of
  ``af.compiled(regional="nested")`` (the whole model with each block a nested compile region)
  against ``af.compiled()`` (the whole model), and the steady step time of the three, of
  eager and of torch's regional recipe by hand (``block.compile()`` on every block)
  interleaved in one process, medians. Targets (``regional=True``): compile time <= 0.5x of
  the whole model's, steady step within 5%.
* ``cache``: the time to the first compiled step of a resumed job, cold (torch.compile, no
  cache file) and from the cache file that a cold job with ``af.compiled(cache=...)`` wrote,
  each in a fresh process with an empty inductor cache. Target: <= 0.2x of cold.
* ``prepared``: the three cold compiles of ``regional`` again, each in a fresh process on a
  machine that has compiled something else before (a copy of directories where a small,
  unrelated function was compiled): inductor's one-time work on a machine (probing the CPU's
  vector instructions, precompiling its C++ header) is done, so what remains is the model's
  own compile time, the part that grows with depth.
* ``depth``: the cold compiles of ``prepared`` at several depths (``--depths``), and the
  straight line through each side's times: its slope is the compile time each block adds,
  its intercept the time a compile costs whatever the depth. Regional compilation's claim is
  a slope near zero.

``compile_s`` is the first step's time less a steady step's. The machine's load average is
recorded at the start and the end of every process (timings on a shared machine vary).

    python benchmarks/compile.py [--json out.json] [--quick] [--repeats N]
                                 [--only regional,cache,prepared,depth] [--depths 3,6,12,24]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2 import GPTConfig, lm_loss, make_model, make_optimizer, token_batches

import accelfn as af
from accelfn.core import compat
from accelfn.observe.timing import environment, interleaved, resolve_device, sync

SECTIONS = ("regional", "cache", "prepared", "depth")
# The cold compiles timed: probe name -> compiled(regional=...)
REGIONAL: dict[str, bool | str] = {"whole": False, "regional": True, "nested": "nested"}
SIDES = tuple(REGIONAL)
TARGETS = {"regional_compile": 0.5, "regional_steady": 0.05, "cache": 0.2}


def _config(args: argparse.Namespace, device: torch.device) -> GPTConfig:
    if args.quick:
        c = GPTConfig(vocab=256, seq=32, layers=4, dim=32, heads=2)
    elif device.type == "cuda":
        c = GPTConfig(layers=12)
    else:
        c = GPTConfig(vocab=512, seq=64, layers=12, dim=64, heads=4)
    if args.layers:
        c.layers = args.layers
    return c


def _load() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def _counters() -> dict[str, int]:
    c = compat.compile_counters()
    return {"graphs": c.get("stats", {}).get("unique_graphs", 0),
            "ops_traced": c.get("stats", {}).get("calls_captured", 0),
            "fxgraph_cache_hit": c.get("inductor", {}).get("fxgraph_cache_hit", 0),
            "fxgraph_cache_miss": c.get("inductor", {}).get("fxgraph_cache_miss", 0),
            "autograd_cache_hit": c.get("aot_autograd", {}).get("autograd_cache_hit", 0)}


# ----------------------------------------------------------------------- one fresh process
def probe(args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: the first compiled step (cold or from the cache file), then steady
    steps; for ``regional``, steady steps of whole-model, regional and eager interleaved."""
    load = _load()
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe == "prepare":  # a machine's one-time work, on code unrelated to the model
        x = torch.randn(64, device=device, requires_grad=True)
        torch.compile(lambda t: (t.sin() * 2).sum(), backend=args.backend)(x).backward()
        sync(device)
        return {"probe": "prepare", "load_average": load, "load_average_end": _load()}
    c = _config(args, device)
    batches = token_batches(c, args.batch_size, 4, device)
    cursor = iter(range(10**9))

    def side(regional: bool | str | None, cache: str | None = None,
             by_hand: bool = False) -> Any:
        model = make_model(c, device)
        step: Any = af.lift(lm_loss)
        if regional is not None:  # False: the whole model; True: in place; "nested"
            step = af.compiled(regional=regional, cache=cache, backend=args.backend)(step)
        if by_hand:  # torch's regional compilation recipe, the step otherwise eager
            for block in model.blocks:
                block.compile(backend=args.backend)
        state = af.TrainState(model, make_optimizer(model))
        return lambda: step(state, batches[next(cursor) % len(batches)])

    kind = args.probe
    one = side(REGIONAL.get(kind, False), args.cache_file)
    t0 = time.perf_counter()
    one()
    sync(device)
    first = time.perf_counter() - t0
    counters = _counters()
    out: dict[str, Any] = {"probe": kind, "first_step_s": first, **counters,
                           "torch_threads": torch.get_num_threads()}
    if kind == "regional" and not args.first_only:
        # the steady comparison: compile the others in this process too
        # (the whole model twice, on two model copies: the control, its ratio the noise)
        whole, again, nested = side(False), side(False), side("nested")
        eager, by_hand = side(None), side(None, by_hand=True)
        for fn in (whole, again, nested, eager, by_hand):
            fn()
        sync(device)
        t_whole, t_regional, t_nested, t_again, t_eager, t_hand = interleaved(
            [whole, one, nested, again, eager, by_hand], args.steps, device)
        ratios = [r / w for r, w in zip(t_regional, t_whole, strict=True)]
        nested_ratios = [r / w for r, w in zip(t_nested, t_whole, strict=True)]
        out.update(whole_step_ms=statistics.median(t_whole) * 1e3,
                   regional_step_ms=statistics.median(t_regional) * 1e3,
                   nested_step_ms=statistics.median(t_nested) * 1e3,
                   nested_steady_ratio=statistics.median(nested_ratios),
                   whole_again_step_ms=statistics.median(t_again) * 1e3,
                   eager_step_ms=statistics.median(t_eager) * 1e3,
                   block_compile_step_ms=statistics.median(t_hand) * 1e3,
                   steady_ratio=statistics.median(ratios),
                   steady_ratio_quartiles=statistics.quantiles(ratios, n=4),
                   control_ratio=statistics.median(
                       a / w for a, w in zip(t_again, t_whole, strict=True)))
        steady = statistics.median(t_regional)
    else:
        steady = statistics.median(interleaved([one], max(3, args.steps // 4), device)[0])
        out["step_ms"] = steady * 1e3
    out["compile_s"] = first - steady
    if args.cache_file and os.path.exists(args.cache_file):
        out["cache_file_mib"] = os.path.getsize(args.cache_file) / 2**20
    out["load_average"], out["load_average_end"] = load, _load()
    return out


def _run_probe(args: argparse.Namespace, kind: str, cache_file: str | None, log: Any,
               machine: str | None = None, first_only: bool = False,
               layers: int | None = None) -> dict[str, Any]:
    """``kind`` in a fresh process on a fresh machine: empty ``TORCHINDUCTOR_CACHE_DIR`` and
    ``TMPDIR`` (inductor keeps its precompiled C++ headers under the temporary directory),
    unless ``machine`` is given (then its directories, as a restart on that machine finds
    them)."""
    with contextlib.ExitStack() as stack:
        if machine is None:
            machine = stack.enter_context(tempfile.TemporaryDirectory(prefix="accelfn-machine-"))
        for sub in ("inductor", "tmp"):
            os.makedirs(os.path.join(machine, sub), exist_ok=True)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(machine, "inductor"),
               "TMPDIR": os.path.join(machine, "tmp")}
        cmd = [sys.executable, __file__, "--probe", kind, "--device", args.device,
               "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--backend", args.backend]
        if layers:
            cmd += ["--layers", str(layers)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.quick:
            cmd.append("--quick")
        if cache_file:
            cmd += ["--cache-file", cache_file]
        if first_only:
            cmd.append("--first-only")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                              timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the {kind} probe failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - t0
    load = result["load_average"][0] if result["load_average"] else "?"
    done = (f"first step {result['first_step_s']:.1f} s" if "first_step_s" in result
            else f"done in {result['process_s']:.1f} s")
    depth = f" ({layers} block{'s' if layers > 1 else ''})" if layers else ""
    log(f"  {kind}{depth}: {done} (load {load})")
    return result


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


def _median_ratio(tops: list[dict[str, Any]], bottoms: list[dict[str, Any]],
                  key: str) -> tuple[float, list[float]]:
    """The median of the per-repeat ratios ``top[key] / bottom[key]`` (each pair measured
    back to back), and the ratios."""
    ratios = [t[key] / b[key] for t, b in zip(tops, bottoms, strict=True)]
    return statistics.median(ratios), ratios


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def bench_regional(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """``runs``: each side's cold compiles (the repeats of a side in order, side by side back
    to back); the first regional run also timed the steady steps."""
    wholes, regionals, nesteds = (runs[side] for side in SIDES)
    regional = regionals[0]  # the one that also timed the steady steps
    compile_ratio, ratios = _median_ratio(regionals, wholes, "compile_s")
    nested_ratio, nested_ratios = _median_ratio(nesteds, wholes, "compile_s")
    steady = regional["steady_ratio"]
    return {
        "whole": wholes[0], "regional": regional, "nested": nesteds[0],
        "repeats": len(wholes),
        **{f"{side}_compile_s": [r["compile_s"] for r in runs[side]] for side in SIDES},
        **{f"{side}_compile_s_median": _median(runs[side], "compile_s") for side in SIDES},
        "compile_ratio": compile_ratio,
        "compile_ratios": ratios,
        "steady_ratio": steady,
        "steady_ratio_quartiles": regional["steady_ratio_quartiles"],
        "control_ratio": regional["control_ratio"],
        "nested_compile_ratio": nested_ratio,
        "nested_compile_ratios": nested_ratios,
        "nested_steady_ratio": regional["nested_steady_ratio"],
        "speedup_vs_eager": {
            "whole": regional["eager_step_ms"] / regional["whole_step_ms"],
            "regional": regional["eager_step_ms"] / regional["regional_step_ms"],
            "nested": regional["eager_step_ms"] / regional["nested_step_ms"],
            "block_compile_by_hand": regional["eager_step_ms"]
            / regional["block_compile_step_ms"]},
        "regional_over_block_compile_by_hand": regional["regional_step_ms"]
        / regional["block_compile_step_ms"],
        "targets": {"compile_ratio": f"<= {TARGETS['regional_compile']}",
                    "steady_ratio": f"within {TARGETS['regional_steady']:.0%} of 1"},
        "met": {"compile_ratio": compile_ratio <= TARGETS["regional_compile"],
                "steady_ratio": abs(steady - 1) <= TARGETS["regional_steady"]},
        "nested_met": {
            "compile_ratio": nested_ratio <= TARGETS["regional_compile"],
            "steady_ratio": abs(regional["nested_steady_ratio"] - 1)
            <= TARGETS["regional_steady"]},
        "note": "regional = compiled(regional=True) (blocks compiled in place, the rest "
                "eager), nested = compiled(regional='nested') (the whole model, each block a "
                "nested compile region), whole = compiled(); compile_ratio = the median over "
                "repeats of regional / whole-model cold compile_s (nested_compile_ratio: "
                "nested / whole), the sides of a repeat run back to back, each in a fresh "
                "process with an empty TORCHINDUCTOR_CACHE_DIR and TMPDIR; steady_ratio = the "
                "median of per-step regional / whole-model ratios (nested_steady_ratio: "
                "nested / whole), interleaved in the first regional probe's process with the "
                "whole model again on another model copy (the control: its ratio is the "
                "noise), eager and torch's recipe by hand (block.compile() on every block)",
    }


def bench_cache(colds: list[dict[str, Any]], warms: list[dict[str, Any]],
                local: dict[str, Any], writer: dict[str, Any]) -> dict[str, Any]:
    ratio, ratios = _median_ratio(warms, colds, "first_step_s")
    cold = _median(colds, "first_step_s")
    return {
        "cold": colds[0], "warm": warms[0], "same_machine": local, "writer": writer,
        "repeats": len(warms),
        "writer_extra_s": writer["first_step_s"] - cold,
        "cold_first_step_s": [c["first_step_s"] for c in colds],
        "warm_first_step_s": [w["first_step_s"] for w in warms],
        "cold_first_step_s_median": cold,
        "warm_first_step_s_median": _median(warms, "first_step_s"),
        "first_step_ratio": ratio,
        "first_step_ratios": ratios,
        "compile_ratio": _median_ratio(warms, colds, "compile_s")[0],
        "same_machine_ratio": local["first_step_s"] / cold,
        "target": f"first_step_ratio <= {TARGETS['cache']}",
        "met": ratio <= TARGETS["cache"],
        "note": "time to the first compiled step (whole model) of a resumed job; each in a "
                "fresh process with an empty TORCHINDUCTOR_CACHE_DIR and TMPDIR (a fresh "
                "machine); cold is torch.compile without a cache file (the regional "
                "section's whole-model processes), warm loads the file that a cold job with "
                "af.compiled(cache=...) wrote (writer, run once before the repeats; "
                "writer_extra_s = its first step less the median cold one: writing the file "
                "and noise); first_step_ratio = the median over repeats of warm / cold, the "
                "two of a repeat run back to back. same_machine: a restart without the file "
                "that finds the writer's own TORCHINDUCTOR_CACHE_DIR and TMPDIR (compiled "
                "C++ kernels, ISA probes and precompiled headers included), against the "
                "median cold, for comparison",
    }


def _prepared_runs(args: argparse.Namespace, log: Any, depths: list[int | None],
                   repeats: int) -> dict[int | None, dict[str, list[dict[str, Any]]]]:
    """Each side's cold compile, the sides back to back, each in a fresh process on a copy of
    one prepared machine: ``repeats`` rounds at each depth."""
    runs: dict[int | None, dict[str, list[dict[str, Any]]]] = {
        d: {side: [] for side in SIDES} for d in depths}
    with tempfile.TemporaryDirectory(prefix="accelfn-machines-") as root:
        template = os.path.join(root, "prepared")
        _run_probe(args, "prepare", None, log, machine=template)
        for i in range(repeats):
            for depth in depths:
                for side in SIDES:
                    machine = os.path.join(root, f"{side}-{depth}-{i}")
                    shutil.copytree(template, machine, symlinks=True)
                    runs[depth][side].append(_run_probe(
                        args, side, None, log, machine=machine, first_only=True,
                        layers=depth))
                    shutil.rmtree(machine, ignore_errors=True)
    return runs


def bench_prepared(args: argparse.Namespace, fresh_wholes: list[dict[str, Any]],
                   log: Any) -> dict[str, Any]:
    runs = _prepared_runs(args, log, [None], args.repeats)[None]
    wholes, regionals, nesteds = (runs[side] for side in SIDES)
    ratio, ratios = _median_ratio(regionals, wholes, "compile_s")
    nested_ratio, nested_ratios = _median_ratio(nesteds, wholes, "compile_s")
    return {
        "whole": wholes[0], "regional": regionals[0], "nested": nesteds[0],
        "repeats": len(wholes),
        **{f"{side}_compile_s_median": _median(runs[side], "compile_s") for side in SIDES},
        "compile_ratio": ratio, "compile_ratios": ratios,
        "nested_compile_ratio": nested_ratio, "nested_compile_ratios": nested_ratios,
        "target": f"compile_ratio <= {TARGETS['regional_compile']}",
        "met": ratio <= TARGETS["regional_compile"],
        "machine_one_time_s": _median(fresh_wholes, "compile_s")
        - _median(wholes, "compile_s"),
        "note": "the median over repeats of regional (and nested) / whole-model cold "
                "compile_s, each in a fresh process with an empty inductor cache on a machine "
                "that compiled an unrelated function before (a copy of its "
                "TORCHINDUCTOR_CACHE_DIR and TMPDIR: the CPU's vector instruction probes and "
                "inductor's precompiled C++ header are there); machine_one_time_s = the fresh "
                "machines' median whole-model compile_s less this one's",
    }


def _line(depths: list[int], times: list[float]) -> dict[str, float]:
    fit = statistics.linear_regression(depths, times)
    return {"s_per_block": fit.slope, "intercept_s": fit.intercept}


def bench_depth(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    depths = sorted({int(d) for d in args.depths.split(",")})
    runs = _prepared_runs(args, log, list(depths), args.depth_repeats)
    times = {side: [_median(runs[d][side], "compile_s") for d in depths] for side in SIDES}
    lines = {side: _line(depths, times[side]) for side in SIDES}
    return {
        "depths": depths, "repeats": args.depth_repeats,
        **{f"{side}_compile_s": times[side] for side in SIDES},
        "compile_ratio_by_depth": [r / w for r, w in zip(
            times["regional"], times["whole"], strict=True)],
        "nested_compile_ratio_by_depth": [r / w for r, w in zip(
            times["nested"], times["whole"], strict=True)],
        "fit": lines,
        "per_block_ratio": lines["regional"]["s_per_block"] / lines["whole"]["s_per_block"],
        "nested_per_block_ratio": lines["nested"]["s_per_block"]
        / lines["whole"]["s_per_block"],
        "note": "cold compile_s (medians over repeats) at each depth, each in a fresh process "
                "on a copy of one machine that compiled an unrelated function before, the "
                "sides of a depth back to back; fit = the least-squares line through each "
                "side's times against the number of blocks: s_per_block is what each block "
                "adds to the compile, intercept_s what the compile costs at any depth; "
                "per_block_ratio = regional's slope / the whole model's (nested_per_block_"
                "ratio: nested's)",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SECTIONS))
    p.add_argument("--device", default="auto")
    p.add_argument("--quick", action="store_true", help="a 4-block toy: checks the script")
    p.add_argument("--steps", type=int, default=100, help="steady steps timed per side")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1,
                   help="cold compiles (and restarts) per side, each pair back to back; "
                        "ratios are the medians of the pairs'")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads in each process (default: torch's; 1 steadies step "
                        "times on a shared CPU)")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend ('eager' traces without generating code: "
                        "checks the script in seconds, its times are not compile times)")
    p.add_argument("--depths", default="3,6,12,24",
                   help="the depth section's numbers of blocks (at least two)")
    p.add_argument("--depth-repeats", type=int, default=1,
                   help="cold compiles per side at each depth in the depth section")
    p.add_argument("--layers", type=int, default=None,
                   help="blocks in the GPT (default: 12, 4 with --quick)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per process")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--probe", choices=(*SIDES, "warm", "prepare"),
                   help=argparse.SUPPRESS)
    p.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args)))
        return 0
    device = resolve_device(args.device)
    args.device = str(device)
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        p.error(f"--only {unknown}: the sections are {', '.join(SECTIONS)}")
    if args.repeats < 1 or args.depth_repeats < 1:
        p.error("--repeats and --depth-repeats must be at least 1")
    if "depth" in only:
        try:
            depths = {int(d) for d in args.depths.split(",")}
        except ValueError:
            depths = set()
        if len(depths) < 2 or min(depths) < 2:
            p.error(f"--depths {args.depths!r}: give at least two different numbers of "
                    "blocks, each at least 2 (a block must repeat to be compiled once), "
                    "comma-separated, e.g. 3,6,12,24")
    if "cache" in only and args.backend != "inductor":
        p.error("the cache section measures inductor's compiled code: leave --backend out "
                "or pass --only regional,prepared")
    c = _config(args, device)

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "benchmark": "compile", "machine": environment(device),
        "model": {**copy.deepcopy(vars(c)), "batch": args.batch_size},
        "backend": args.backend,
        "command": " ".join(["python", "benchmarks/compile.py", *(argv or sys.argv[1:])]),
    }
    with tempfile.TemporaryDirectory(prefix="accelfn-ckpt-") as ckpt, \
            tempfile.TemporaryDirectory(prefix="accelfn-machine-") as machine:
        cache_file = os.path.join(ckpt, "compile-cache.bin")  # beside the checkpoints
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        warms: list[dict[str, Any]] = []
        writer = None
        if "cache" in only:  # a cold job with cache=: writes the file, on a kept machine
            log("cold, writing the cache file:")
            writer = _run_probe(args, "whole", cache_file, log, machine=machine)
            if not os.path.exists(cache_file):
                raise RuntimeError("the cold probe wrote no compile cache file")
        fresh = {"regional", "cache", "prepared"} & set(only)  # cold on fresh machines
        for i in range(args.repeats if fresh else 0):  # each repeat's probes back to back
            log(f"repeat {i + 1} of {args.repeats}:")
            runs["whole"].append(_run_probe(args, "whole", None, log))  # plain: no cache file
            if "regional" in only:
                runs["regional"].append(_run_probe(args, "regional", None, log,
                                                   first_only=i > 0))
                runs["nested"].append(_run_probe(args, "nested", None, log, first_only=True))
            if "cache" in only:
                warms.append(_run_probe(args, "warm", cache_file, log))
        wholes = runs["whole"]
        if "regional" in only:
            result["regional"] = bench_regional(runs)
        if "cache" in only:
            log("restart on the same machine:")
            local = _run_probe(args, "warm", None, log, machine=machine)
            assert writer is not None
            result["cache"] = bench_cache(wholes, warms, local, writer)
        if "prepared" in only:
            log("prepared machines:")
            result["prepared"] = bench_prepared(args, wholes, log)
        if "depth" in only:
            log("depths, on prepared machines:")
            result["depth"] = bench_depth(args, log)
    result["machine"]["load_average_end"] = _load()
    text = json.dumps(_round(result), indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
