"""The captured step against eager: speed where launches dominate, cost where they do not,
and equality.

Three sides train the same GPT (benchmarks/gpt2.py's model) on the same random tokens
held on the device, interleaved round by round, each timed over ``--steps`` updates (the
device synchronised before and after), the median round reported:

* ``hand``: the plain loop a competent user writes without accelfn (bf16 autocast,
  ``clip_grad_norm_``, fused AdamW, ``zero_grad(set_to_none=True)``): the baseline;
* ``eager``: the same update as an accelfn step (``with_amp``, ``with_clipping``, the
  non-finite check on the device);
* ``captured``: that step under ``af.captured``: recorded once as CUDA graphs, replayed.

Models: ``launch_bound``, a GPT 256 wide with 4 layers at batch 8 (128 tokens, a 4096-token
vocabulary), where the host's launches are the step's time and capture should pay at least
x1.3; and ``gpt2``, GPT-2 small (124M) at batch 8 compiled (``--gpt2-compile``), where the
device is busy and capture should cost at most 1% (``captured / eager >= 0.99``).

Equality: ``--check-steps`` fp32 updates of the launch-bound GPT, eager step against
captured, with the math attention (deterministic): the largest parameter difference
(target 1e-6; 0 is bitwise).

On the CPU (``--dry-run``), the recorder is ``accelfn.testing.TapeRecorder`` on tiny sizes:
it checks the benchmark's paths; its times say nothing about a GPU.

    python benchmarks/captured.py --json out.json          # on a GPU
    python benchmarks/captured.py --dry-run                 # the paths, on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2 import GPTConfig, attention, lm_loss, make_model, token_batches

import accelfn as af
from accelfn.observe.timing import environment, resolve_device, sync

LAUNCH_BOUND = GPTConfig(vocab=4096, seq=128, layers=4, dim=256, heads=4)
GPT2 = GPTConfig()
DRY = GPTConfig(vocab=256, seq=32, layers=2, dim=32, heads=2)
MAX_NORM = 1.0


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)


def _recorder(device: torch.device) -> Any:
    if device.type == "cuda":
        return None
    from accelfn.testing import TapeRecorder
    return TapeRecorder


def hand_side(c: GPTConfig, device: torch.device, dtype: torch.dtype | None,
              compile_: bool) -> Callable[[Any], None]:
    """One update of the plain loop: nothing of accelfn's."""
    model = make_model(c, device)
    if compile_:
        model.compile()
    optimizer = _optimizer(model)

    def one(batch: Any) -> None:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(batch["input"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return one


def accelfn_step(dtype: torch.dtype | None, compile_: bool, capture: bool,
                 device: torch.device, warmup: int = 3) -> af.Step:
    step = af.with_clipping(max_norm=MAX_NORM)(lm_loss)
    if dtype is not None:
        step = af.with_amp(dtype=dtype)(step)
    if compile_:
        step = af.compiled(step)
    if capture:
        step = af.captured(warmup=warmup, recorder=_recorder(device))(step)
    return step


def accelfn_side(c: GPTConfig, device: torch.device, dtype: torch.dtype | None,
                 compile_: bool, capture: bool) -> Callable[[Any], None]:
    model = make_model(c, device)
    state = af.TrainState(model, _optimizer(model))
    step = accelfn_step(dtype, compile_, capture, device)
    return lambda batch: step(state, batch)


def measure(c: GPTConfig, batch: int, device: torch.device, dtype: torch.dtype | None,
            compile_: bool, rounds: int, steps: int, warmup: int) -> dict[str, Any]:
    """Median seconds per update of each side, interleaved rounds; ratios in the same run."""
    batches = token_batches(c, batch, 4, device)
    sides = {"hand": hand_side(c, device, dtype, compile_),
             "eager": accelfn_side(c, device, dtype, compile_, capture=False),
             "captured": accelfn_side(c, device, dtype, compile_, capture=True)}
    for one in sides.values():  # compile, the warm-up calls and the recording
        for i in range(warmup):
            one(batches[i % len(batches)])
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, one in sides.items():
            sync(device)
            t0 = time.perf_counter()
            for i in range(steps):
                one(batches[i % len(batches)])
            sync(device)
            times[name].append((time.perf_counter() - t0) / steps)
    median = {name: statistics.median(values) for name, values in times.items()}
    tokens = batch * c.seq
    return {
        "config": vars(c), "batch": batch, "dtype": str(dtype), "compiled": compile_,
        "rounds": rounds, "steps_per_round": steps,
        "ms_per_update": {k: round(v * 1e3, 4) for k, v in median.items()},
        "tokens_per_s": {k: round(tokens / v) for k, v in median.items()},
        "speedup_captured_vs_hand": round(median["hand"] / median["captured"], 4),
        "speedup_captured_vs_eager": round(median["eager"] / median["captured"], 4),
        "eager_vs_hand": round(median["hand"] / median["eager"], 4),
    }


def equality(c: GPTConfig, batch: int, device: torch.device, steps: int) -> dict[str, Any]:
    """fp32: the eager step against the captured one, parameter by parameter."""
    batches = token_batches(c, batch, steps, device, seed=1)
    models = []
    for capture in (False, True):
        model = make_model(c, device)
        state = af.TrainState(model, _optimizer(model))
        step = accelfn_step(None, False, capture, device, warmup=2)
        if not capture:  # the same rates as the captured step's: device tensors
            for group in state.optimizer.param_groups:
                group["lr"] = torch.tensor(group["lr"], device=device)
        # the math attention: the others' backward may add in another order each run
        with attention("MATH" if device.type == "cuda" else None):
            for b in batches:
                step(state, b)
        state.sync()
        models.append(model)
    diff = max((a - b).abs().max().item() for a, b in zip(models[0].parameters(),
                                                         models[1].parameters()))
    return {"steps": steps, "max_abs_param_diff": diff, "bitwise": diff == 0.0,
            "within_1e-6": diff <= 1e-6}


def run(args: argparse.Namespace,
        emit: Callable[[dict[str, Any]], None] = lambda out: None) -> dict[str, Any]:
    """Every section in turn; ``emit`` gets the figures so far after each one, and a section
    that fails records its error and the next one runs (one GPU slot is not lost to one
    failure)."""
    device = resolve_device("cpu" if args.dry_run else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    small = DRY if args.dry_run else LAUNCH_BOUND
    out: dict[str, Any] = {"benchmark": "captured", "dry_run": args.dry_run,
                           "environment": environment(device)}
    sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("equality", lambda: equality(small, 2 if args.dry_run else 8, device,
                                      args.check_steps)),
        ("launch_bound", lambda: measure(small, 2 if args.dry_run else 8, device, dtype,
                                         False, args.rounds, args.steps, args.warmup))]
    if not args.dry_run and "gpt2" in args.models:
        sections.append(("gpt2", lambda: measure(
            GPT2, args.gpt2_batch, device, dtype, args.gpt2_compile, args.rounds,
            max(2, args.steps // 4), args.warmup + 2)))
    for name, section in sections:
        try:
            out[name] = section()
        except Exception as error:  # recorded in the figures; the next section runs
            out[name] = {"error": f"{type(error).__name__}: {error}"}
        emit(out)
    launch, gpt, same = (out.get(k) or {} for k in ("launch_bound", "gpt2", "equality"))
    out["targets"] = {"launch_bound_captured_vs_hand": ">= 1.3",
                      "gpt2_captured_vs_eager": ">= 0.99", "max_abs_param_diff": "<= 1e-6"}
    out["met"] = {
        "launch_bound_captured_vs_hand": None if "error" in launch or not launch
        else launch["speedup_captured_vs_hand"] >= 1.3,
        "gpt2_captured_vs_eager": None if "error" in gpt or not gpt
        else gpt["speedup_captured_vs_eager"] >= 0.99,
        "max_abs_param_diff": None if "error" in same or not same else same["within_1e-6"]}
    emit(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CPU with the tape recorder (paths only)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--check-steps", type=int, default=10)
    parser.add_argument("--models", default="launch_bound,gpt2")
    parser.add_argument("--gpt2-batch", type=int, default=8)
    parser.add_argument("--gpt2-compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.rounds, args.steps, args.warmup, args.check_steps = 2, 3, 4, 5
    def emit(out: dict[str, Any]) -> None:  # the figures so far, after each section
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=2) + "\n")

    result = run(args, emit)
    print(json.dumps(result, indent=2))
    return 0 if all(not isinstance(v, dict) or "error" not in v for v in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
