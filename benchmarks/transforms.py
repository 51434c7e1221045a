"""Each transform's cost and benefit, as ratios against hand-written loops in the same run.

On a compact GPT (``benchmarks/gpt2.py``; a 4-layer, 128-wide one on a CPU, GPT-2 small on a
GPU), each section trains several *sides* from the same initial weights, on the same device
batches, with per-step times interleaved (the order rotated every step) and medians compared:

* ``amp``: fp32 by hand (the baseline) and by accelfn; bf16 autocast by hand and
  ``af.with_amp(dtype=torch.bfloat16)``; on a GPU also fp16 (autocast + ``GradScaler`` by hand,
  and ``af.with_amp(dtype=torch.float16)``). Speed and memory.
* ``accumulation``: one update on the same global batch, whole (n=1) or in 4 micro-batches
  (n=4), by hand and with ``af.with_accumulation``: the time an update costs more, and the
  activation memory it saves.
* ``checkpoint``: no checkpointing (baseline), ``af.checkpointed`` (every block),
  ``af.checkpointed(selective=True)``, and ``torch.utils.checkpoint`` by hand: activation
  memory saved against time added.
* ``compile``: ``af.compiled`` against eager, steady-state speedup, and the compile time with
  a cold cache and again with the warm cache (two fresh processes sharing one
  ``TORCHINDUCTOR_CACHE_DIR``; the first starts from an empty one).

Memory: ``activation_mib`` is the peak of what autograd holds for the backward (exact on any
device, parameters excluded, see :class:`accelfn.observe.timing.SavedActivations`); on CUDA also
``peak_step_mib``, the allocator's peak during one step above what was allocated before it.

    python benchmarks/transforms.py [--only amp,checkpoint] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2 import SMALL, TINY, GPTConfig, lm_loss, make_model, make_optimizer, token_batches

import accelfn as af
from accelfn.observe.timing import (
    SavedActivations,
    environment,
    interleaved,
    resolve_device,
    sync,
)

SECTIONS = ("amp", "accumulation", "checkpoint", "compile")

Side = tuple[nn.Module, Callable[[], Any]]


def _sizes(args: argparse.Namespace, device: torch.device) -> tuple[GPTConfig, int]:
    if args.quick:
        return copy.deepcopy(TINY), 8
    if device.type == "cuda":
        return GPTConfig(), 8
    return copy.deepcopy(SMALL), 8


def _peak_step_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def measure(sides: dict[str, Side], baseline: str, steps: int, device: torch.device,
            warmup: int = 2) -> dict[str, Any]:
    """Interleaved per-step medians of each side, memory, and ratios to ``baseline``."""
    fns = [fn for _, fn in sides.values()]
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync(device)
    times = interleaved(fns, steps, device)
    out: dict[str, Any] = {}
    for (name, (model, fn)), t in zip(sides.items(), times):
        with SavedActivations(model) as acts:
            fn()
        sync(device)
        out[name] = {"step_ms": statistics.median(t) * 1e3, "activation_mib": acts.mib,
                     "peak_step_mib": _peak_step_mib(fn, device)}
    base = out[baseline]
    for entry in out.values():
        entry["time_ratio"] = entry["step_ms"] / base["step_ms"]
        entry["speedup"] = base["step_ms"] / entry["step_ms"]
        entry["activation_ratio"] = (entry["activation_mib"] / base["activation_mib"]
                                     if base["activation_mib"] else None)
        if entry["peak_step_mib"] is not None and base["peak_step_mib"]:
            entry["peak_step_ratio"] = entry["peak_step_mib"] / base["peak_step_mib"]
    return {"baseline": baseline, "steps": steps, "sides": _round(out)}


def _round(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _round(v) for k, v in d.items()}
    if isinstance(d, float):
        return round(d, 4)
    return d


def _hand_side(model: nn.Module, batches: list[TensorDict], *, dtype: torch.dtype | None,
               device: torch.device, micro: int = 1, ckpt: bool = False) -> Side:
    """The hand-written update: autocast (and GradScaler for fp16), micro-batches weighted by
    size, optional ``torch.utils.checkpoint`` per block, fused AdamW."""
    opt = make_optimizer(model)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    counter = iter(range(10**9))

    def forward(idx: torch.Tensor) -> torch.Tensor:
        if not ckpt:
            return model(idx)
        m: Any = model
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = m.wte(idx) + m.wpe(pos)
        for block in m.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return m.head(m.ln_f(x))

    def fn() -> None:
        batch = batches[next(counter) % len(batches)]
        n = batch.batch_size[0]
        for part in batch.split(-(-n // micro)):
            with (torch.autocast(device.type, dtype=dtype) if dtype is not None
                  else contextlib.nullcontext()):
                logits = forward(part["input"])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), part["target"].flatten())
            loss = loss * (part.batch_size[0] / n)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    return model, fn


def _af_side(model: nn.Module, batches: list[TensorDict], step: Any) -> Side:
    state = af.TrainState(model, make_optimizer(model))
    counter = iter(range(10**9))

    def fn() -> None:
        step(state, batches[next(counter) % len(batches)])

    return model, fn


def _working_dtype(device: torch.device) -> torch.dtype | None:
    """Precision of the non-AMP sections: bf16 autocast on a GPU, fp32 on a CPU."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return None


def _with_working_amp(step: Any, device: torch.device) -> Any:
    dtype = _working_dtype(device)
    return step if dtype is None else af.with_amp(dtype=dtype)(step)


def bench_amp(c: GPTConfig, batch: int, steps: int, device: torch.device) -> dict[str, Any]:
    batches = token_batches(c, batch, 2, device)
    init = make_model(c, device)

    def fresh() -> nn.Module:
        return copy.deepcopy(init)

    sides: dict[str, Side] = {
        "fp32_hand": _hand_side(fresh(), batches, dtype=None, device=device),
        "fp32_accelfn": _af_side(fresh(), batches, af.lift(lm_loss)),
        "bf16_hand": _hand_side(fresh(), batches, dtype=torch.bfloat16, device=device),
        "bf16_accelfn": _af_side(fresh(), batches, af.with_amp(dtype=torch.bfloat16)(lm_loss)),
    }
    if device.type == "cuda":
        sides["fp16_hand"] = _hand_side(fresh(), batches, dtype=torch.float16, device=device)
        sides["fp16_accelfn"] = _af_side(fresh(), batches,
                                         af.with_amp(dtype=torch.float16)(lm_loss))
    result = measure(sides, "fp32_hand", steps, device)
    result["note"] = ("speedup and activation_ratio against fp32 by hand; *_accelfn against "
                      "*_hand is the transform's own overhead")
    return result


def bench_accumulation(c: GPTConfig, batch: int, steps: int,
                       device: torch.device) -> dict[str, Any]:
    batches = token_batches(c, batch, 2, device)
    init = make_model(c, device)
    dtype = _working_dtype(device)
    step1 = _with_working_amp(af.lift(lm_loss), device)
    step4 = _with_working_amp(af.with_accumulation(4)(lm_loss), device)
    sides: dict[str, Side] = {
        "n1_hand": _hand_side(copy.deepcopy(init), batches, dtype=dtype, device=device),
        "n1_accelfn": _af_side(copy.deepcopy(init), batches, step1),
        "n4_hand": _hand_side(copy.deepcopy(init), batches, dtype=dtype, device=device, micro=4),
        "n4_accelfn": _af_side(copy.deepcopy(init), batches, step4),
    }
    result = measure(sides, "n1_hand", steps, device)
    s = result["sides"]
    result["global_batch"] = batch
    result["n4_over_n1_time"] = round(s["n4_accelfn"]["step_ms"] / s["n1_accelfn"]["step_ms"], 4)
    result["n4_over_n1_activation"] = round(
        s["n4_accelfn"]["activation_mib"] / s["n1_accelfn"]["activation_mib"], 4)
    result["note"] = "one update on the same global batch: whole (n1) or in 4 micro-batches (n4)"
    return result


def bench_checkpoint(c: GPTConfig, batch: int, steps: int,
                     device: torch.device) -> dict[str, Any]:
    batches = token_batches(c, batch, 2, device)
    init = make_model(c, device)
    dtype = _working_dtype(device)
    sides: dict[str, Side] = {
        "none_hand": _hand_side(copy.deepcopy(init), batches, dtype=dtype, device=device),
        "none_accelfn": _af_side(copy.deepcopy(init), batches,
                                 _with_working_amp(af.lift(lm_loss), device)),
        "checkpointed": _af_side(copy.deepcopy(init), batches,
                                 _with_working_amp(af.checkpointed(lm_loss), device)),
        "checkpointed_selective": _af_side(
            copy.deepcopy(init), batches,
            _with_working_amp(af.checkpointed(selective=True)(lm_loss), device)),
        "checkpoint_hand": _hand_side(copy.deepcopy(init), batches, dtype=dtype, device=device,
                                      ckpt=True),
    }
    with warnings.catch_warnings():  # SAC's notice that its saved tensors bypass the hooks
        warnings.simplefilter("ignore", FutureWarning)
        result = measure(sides, "none_hand", steps, device)
    s = result["sides"]
    # Selective checkpointing keeps its saved tensors out of saved_tensors_hooks, so the hooks
    # see only the block inputs: no exact activation figure for it (peak_step_mib on CUDA).
    s["checkpointed_selective"]["activation_mib"] = None
    s["checkpointed_selective"]["activation_ratio"] = None
    saved = s["none_accelfn"]["activation_mib"] - s["checkpointed"]["activation_mib"]
    added = s["checkpointed"]["step_ms"] - s["none_accelfn"]["step_ms"]
    result["activation_saved_mib"] = round(saved, 3)
    result["time_added_ms"] = round(added, 3)
    result["time_added_ratio"] = round(added / s["none_accelfn"]["step_ms"], 4)
    result["note"] = ("activation_mib counts what is held between forward and backward; the "
                      "recomputation's transient memory shows only in peak_step_mib (CUDA); "
                      "selective checkpointing's saved tensors bypass saved_tensors_hooks, so "
                      "its activation_mib is not measured")
    return result


# --------------------------------------------------------------------------------------------
# compile: probes in fresh processes, cold then warm cache
# --------------------------------------------------------------------------------------------


def compile_probe(args: argparse.Namespace) -> dict[str, Any]:
    """Run in a fresh process: first compiled step (compile time), then eager vs compiled."""
    device = resolve_device(args.device)
    c = copy.deepcopy(TINY if device.type != "cuda" else GPTConfig(layers=args.compile_layers))
    if device.type != "cuda":
        c.layers = args.compile_layers
    batch = 4 if device.type != "cuda" else 8
    batches = token_batches(c, batch, 2, device)
    init = make_model(c, device)
    dtype = _working_dtype(device)
    eager = _af_side(copy.deepcopy(init), batches, _with_working_amp(af.lift(lm_loss), device))
    comp = _af_side(copy.deepcopy(init), batches,
                    _with_working_amp(af.compiled(backend=args.compile_backend)(lm_loss), device))
    t0 = time.perf_counter()
    comp[1]()
    sync(device)
    first = time.perf_counter() - t0
    for _ in range(2):
        eager[1]()
        comp[1]()
    sync(device)
    t_eager, t_comp = interleaved([eager[1], comp[1]], args.steps, device)
    e, k = statistics.median(t_eager), statistics.median(t_comp)
    return {"first_step_s": first, "compile_s": first - k, "eager_step_ms": e * 1e3,
            "compiled_step_ms": k * 1e3, "speedup": e / k, "layers": c.layers,
            "dtype": "fp32" if dtype is None else str(dtype).replace("torch.", "")}


def bench_compile(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="accelfn-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
               "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
        runs = {}
        for name in ("cold", "warm"):
            cmd = [sys.executable, __file__, "--compile-probe", "--device", str(device),
                   "--steps", str(args.steps), "--compile-layers", str(args.compile_layers),
                   "--compile-backend", args.compile_backend]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                                  timeout=args.compile_timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{name} compile probe failed: {proc.stderr[-2000:]}")
            runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[name]["process_s"] = time.perf_counter() - t0
    cold, warm = runs["cold"], runs["warm"]
    return _round({
        "backend": args.compile_backend,
        "cold": cold, "warm": warm,
        "speedup": statistics.mean([cold["speedup"], warm["speedup"]]),
        "compile_s_cold": cold["compile_s"], "compile_s_warm": warm["compile_s"],
        "warm_over_cold": warm["compile_s"] / cold["compile_s"] if cold["compile_s"] else None,
        "note": "compile_s = first compiled step - steady compiled step; two fresh processes "
                "sharing one TORCHINDUCTOR_CACHE_DIR (empty for the cold one); speedup = eager "
                "/ compiled steady step (accelfn steps both), mean of the two processes",
    })


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections of {SECTIONS}")
    p.add_argument("--device", default="auto")
    p.add_argument("--quick", action="store_true",
                   help="a 2-layer toy, few steps; compile only with --compile")
    p.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="include the compile section (default: on unless --quick)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--steps", type=int, default=None, help="interleaved steps per side")
    p.add_argument("--compile-layers", type=int, default=None,
                   help="layers of the model the compile section compiles (default 2 on a "
                        "CPU, 4 on a GPU: compile time grows with them)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend ('eager' only traces: checks the code quickly)")
    p.add_argument("--compile-timeout", type=float, default=300.0)
    p.add_argument("--compile-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="write the result here (default: stdout)")
    args = p.parse_args(argv)
    device = resolve_device(args.device)
    if args.steps is None:
        args.steps = 5 if args.quick else (20 if device.type == "cuda" else 15)
    if args.compile_layers is None:
        args.compile_layers = 4 if device.type == "cuda" else 2
    if args.compile_probe:
        print(json.dumps(compile_probe(args)))
        return 0
    if args.compile is None:
        args.compile = not args.quick
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; use {SECTIONS}")

    c, batch = _sizes(args, device)
    result: dict[str, Any] = {
        "benchmark": "transforms",
        "machine": environment(device),
        "model": {"layers": c.layers, "dim": c.dim, "heads": c.heads, "seq": c.seq,
                  "vocab": c.vocab, "batch": batch},
        "timing": "per-step times interleaved across sides, order rotated; medians",
    }
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "amp": lambda: bench_amp(c, batch, args.steps, device),
        "accumulation": lambda: bench_accumulation(c, batch, args.steps, device),
        "checkpoint": lambda: bench_checkpoint(c, batch, args.steps, device),
        "compile": lambda: bench_compile(args, device),
    }
    failed = False
    for name in SECTIONS:
        if name not in only:
            continue
        if name == "compile" and not args.compile:
            result[name] = {"status": "skipped",
                            "reason": "--quick leaves compile out; add --compile"}
            continue
        t0 = time.perf_counter()
        print(f"transforms: {name} ...", file=sys.stderr, flush=True)
        try:
            result[name] = runners[name]()
            result[name]["seconds"] = round(time.perf_counter() - t0, 1)
        except Exception as exc:  # one section failing does not hide the others
            failed = True
            result[name] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:2000]}
        if device.type == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()
    result["machine"]["load_average_end"] = environment(device).get("load_average")
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
