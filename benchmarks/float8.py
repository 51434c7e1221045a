"""Float8 against bf16 training throughput on a GPT of 500M parameters, both compiled (CUDA).

Two accelfn steps train the same GPT (8 blocks, 2048 wide, 16 heads, 2048 tokens, vocabulary
50304, tied embeddings; 507M parameters) on random tokens held on the GPU:

* ``bf16``: ``af.compiled(af.with_amp(lm_loss))``;
* ``float8``: ``af.compiled(af.with_amp(af.with_float8(predicate=not the head)(lm_loss)))``:
  torchao's tensorwise float8 in every block's Linear layers (the tied output head stays in
  bf16, as torchtitan leaves its output layer).

After each side's warm-up (compilation included, timed as ``first_step_s``), the two are timed
call by call in turn (which goes first rotates every step, each call synchronised), so drifts
of the GPU's clocks hit both alike. tokens/s is tokens per step over the median call time;
``speedup`` is float8 over bf16, against the target of 1.2 (issue 15). The JSON goes to
stdout (and to ``--json PATH``); progress goes to stderr.

    python benchmarks/float8.py                 # on a GPU with float8 (H100, H200, L4, ...)
    python benchmarks/float8.py --dry-run       # a tiny GPT on the CPU, float8 emulated
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2 import GPTConfig, lm_loss, make_model, make_optimizer, token_batches

import accelfn as af
from accelfn.observe.timing import PeakMemory, environment, interleaved, sync

MODEL = GPTConfig(vocab=50304, seq=2048, layers=8, dim=2048, heads=16)
TINY = GPTConfig(vocab=512, seq=64, layers=2, dim=64, heads=4)
TARGET = 1.2
SIDES = ("bf16", "float8")


def not_the_head(name: str, module: nn.Module) -> bool:
    """The float8 filter: every block's Linear layers, not the (tied) output head."""
    return name != "head"


def build_step(side: str, min_features: int, backend: str) -> Any:
    """The accelfn step of ``side`` (``"bf16"`` or ``"float8"``)."""
    step: Any = af.lift(lm_loss)
    if side == "float8":
        step = af.with_float8(min_features=min_features, predicate=not_the_head)(step)
    return af.compiled(backend=backend)(af.with_amp(dtype=torch.bfloat16)(step))


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    c = TINY if args.dry_run else MODEL
    for key in ("seq", "layers", "dim"):
        if getattr(args, key):
            setattr(c, key, getattr(args, key))
    min_features = 16 if args.dry_run else 1024
    env = environment(device)
    batches = token_batches(c, args.batch_size, 2, device, args.seed)
    states: dict[str, af.TrainState] = {}
    calls: dict[str, Callable[[], None]] = {}
    sides: dict[str, dict[str, Any]] = {}
    params = 0
    for side in SIDES:
        model = make_model(c, device, args.seed)
        params = sum(p.numel() for p in model.parameters())
        state = af.TrainState(model, make_optimizer(model))
        step = build_step(side, min_features, args.compile_backend)
        cursor = iter(range(10**9))

        def one(step: Any = step, state: af.TrainState = state, cursor: Any = cursor) -> None:
            step(state, batches[next(cursor) % len(batches)])

        log(f"{side}: warm-up ({args.warmup} steps, compilation included): {af.describe(step)}")
        with PeakMemory(device) as memory:
            first = interleaved([one], 1, device)[0][0]
            for _ in range(args.warmup - 1):
                one()
            sync(device)
        converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        sides[side] = {"name": side, "stack": af.describe(step), "first_step_s": first,
                       "converted_layers": converted, "peak_memory_mib": memory.peak_mib}
        states[side], calls[side] = state, one
    times = interleaved([calls[s] for s in SIDES], args.steps, device)
    tokens = args.batch_size * c.seq
    for side, per_call in zip(SIDES, times):
        median = statistics.median(per_call)
        loss = _loss(states[side], batches[0])
        sides[side].update(tokens_per_s=tokens / median, step_ms=median * 1e3,
                           step_ms_all=[t * 1e3 for t in per_call], eval_loss=loss)
        log(f"  {side}: {tokens / median:,.0f} tokens/s ({median * 1e3:.1f} ms/step), "
            f"loss {loss:.3f}")
    speedup = sides["float8"]["tokens_per_s"] / sides["bf16"]["tokens_per_s"]
    log(f"float8 / bf16: {speedup:.3f}x (target {TARGET}x)")
    return {
        "benchmark": "float8",
        "dry_run": args.dry_run,
        "machine": env,
        "model": {**asdict(c), "parameters": params},
        "batch_size": args.batch_size,
        "tokens_per_step": tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "compile_backend": args.compile_backend,
        "float8": {"recipe": "tensorwise", "min_features": min_features,
                   "emulated": device.type != "cuda", "left_in_bf16": ["head"]},
        "sides": [sides[s] for s in SIDES],
        "speedup": speedup,
        "target": TARGET,
        "meets_target": None if args.dry_run else speedup >= TARGET,
        "notes": ["tokens/s = batch x seq / the median of the interleaved, synchronised calls",
                  "peak_memory_mib: the warm-up's peak, with the other side's model resident "
                  "when it was built first (bf16 is built first)",
                  "eval_loss: the eager model's loss on the first batch after the timed steps "
                  "(both sides trained on the same batches: the figures should be close)"],
    }


def _loss(state: af.TrainState, batch: Any) -> float:
    """The loss of the trained model on ``batch`` (eager, bf16 autocast, no gradients)."""
    with torch.no_grad(), torch.autocast(state.device.type, dtype=torch.bfloat16):
        return float(lm_loss(state.model, batch))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="a 2-layer, 64-wide GPT on the CPU with float8 emulated, compiled "
                        "with the 'eager' backend unless --compile-backend (checks the code)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dim", type=int, default=None, help="model width")
    p.add_argument("--steps", type=int, default=None, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per side (>= 2)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default: inductor; eager in a dry run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks/float8.py measures float8 matmuls on a CUDA GPU and there is none "
              "here; run it on a GPU with compute capability 8.9+ (H100, H200, L4), or check "
              "the code on this machine with --dry-run", file=sys.stderr)
        return 2
    args.compile_backend = args.compile_backend or ("eager" if args.dry_run else "inductor")
    args.batch_size = args.batch_size or (4 if args.dry_run else 8)
    args.steps = args.steps or (3 if args.dry_run else 12)
    args.warmup = args.warmup or (2 if args.dry_run else 3)
    if args.warmup < 2 or args.steps < 1:
        p.error("--warmup must be >= 2 (the first step compiles) and --steps >= 1")

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    result = run(args, log)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
