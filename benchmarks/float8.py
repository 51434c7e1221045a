"""Float8 against bf16 training throughput on GPTs 4096 and 2048 wide, both compiled (CUDA),
and per Linear shape: where float8 wins, against with_float8's shape rule.

**Models** (``--widths``, default ``4096,2048``; the first one's figures are the JSON's top
level, every one's are under ``widths``): two accelfn steps train the same GPT (vocabulary
50304, tied embeddings, 2048 tokens) on random tokens held on the GPU:

* width 4096: 4 blocks, 32 heads, batch 4 (8192 tokens a step); 1.0B parameters; target 1.2x;
* width 2048: 8 blocks, 16 heads, batch 8 (16384 tokens a step); 507M parameters; target 1.1x
  (issue 42: +10-15% is what torchao and torchtitan publish at this width);
* ``bf16``: ``af.compiled(af.with_amp(lm_loss))``;
* ``float8``: ``af.compiled(af.with_amp(af.with_float8(predicate=not the head)(lm_loss)))``:
  torchao's float8 (``--recipe``) in the Linear layers that with_float8's shape rule chooses
  (``layers="auto"``; the tied output head stays in bf16, as torchtitan leaves its output
  layer). The JSON lists the layers converted and left out, with why.

After each side's warm-up (compilation included, timed as ``first_step_s``), the two are timed
call by call in turn (which goes first rotates every step, each call synchronised), so drifts
of the GPU's clocks hit both alike. tokens/s is tokens per step over the median call time;
``speedup`` is float8 over bf16.

**Shapes** (``--shapes``, or ``--shapes-only``): one ``nn.Linear(K, N, bias=False)`` (float32
weights, bf16 autocast, as in the models), its forward and backward on an ``(M, K)`` bf16
input, compiled, bf16 against float8 (the recipe), for every ``(M, K, N)`` of ``--m``, ``--k``
and ``--n`` (by default around the rule's boundaries). Each call runs the layer several times
(``reps``, about 2 ms of work) and the two sides alternate, ``--rounds`` times; medians per
layer call. The result says which shapes float8 wins, where with_float8's rule disagrees
(``rule_converts_but_loses``: the rule should leave these out; ``rule_leaves_out_but_wins``:
gains it misses) and ``measured_boxes``, per M: the (K, N) pairs a rule must leave out to keep
every losing shape in bf16 (ready for ``SHAPE_RULES[recipe].measured`` in
``accelfn/parts/float8.py``). ``--budget-s`` stops the sweep when that many seconds have run
(the shapes left are listed as not measured).

The JSON goes to stdout, and to ``--json PATH`` after each model and at the end (so that a run
cut short keeps what it finished); progress goes to stderr.

    python benchmarks/float8.py                      # on a GPU with float8 (H100, H200, L4)
    python benchmarks/float8.py --widths 2048 --shapes --budget-s 200
    python benchmarks/float8.py --shapes-only --m 8192 --k 1024,4096 --n 1024,4096
    python benchmarks/float8.py --dry-run --shapes   # tiny models and shapes, CPU, emulated
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2 import GPTConfig, lm_loss, make_model, make_optimizer, token_batches

import accelfn as af
from accelfn.observe.timing import PeakMemory, environment, interleaved, sync
from accelfn.parts.float8 import SHAPE_RULES, Float8
from accelfn.transforms.float8 import float8_layers


class Preset(NamedTuple):
    """One model of the comparison: its sizes, batch and target speedup."""

    config: GPTConfig
    batch_size: int
    target: float


PRESETS = {
    4096: Preset(GPTConfig(vocab=50304, seq=2048, layers=4, dim=4096, heads=32), 4, 1.2),
    2048: Preset(GPTConfig(vocab=50304, seq=2048, layers=8, dim=2048, heads=16), 8, 1.1),
}
TINY = {  # the dry run's stand-ins, by the width they stand for
    4096: Preset(GPTConfig(vocab=512, seq=64, layers=2, dim=128, heads=4), 2, 1.2),
    2048: Preset(GPTConfig(vocab=512, seq=64, layers=2, dim=64, heads=4), 4, 1.1),
}
MODEL = PRESETS[2048].config  # the 507M GPT of issue 15
SIDES = ("bf16", "float8")
# The shape grid: K and N on each side of the rules' thresholds (tensorwise: K 4096, N 1024;
# rowwise: N 2048 and 4096, K 1024 and 2048), M a micro-batch of the 4096-wide model.
GRID_M, GRID_K, GRID_N = (8192,), (1024, 2048, 4096, 8192), (1024, 2048, 4096, 8192)
TINY_M, TINY_K, TINY_N = (32,), (16, 32), (16, 32)


def not_the_head(name: str, module: nn.Module) -> bool:
    """The float8 filter: every block's Linear layers, not the (tied) output head."""
    return name != "head"


def build_step(side: str, recipe: str, layers: str, backend: str) -> Any:
    """The accelfn step of ``side`` (``"bf16"`` or ``"float8"``)."""
    step: Any = af.lift(lm_loss)
    if side == "float8":
        step = af.with_float8(recipe=recipe, layers=layers, predicate=not_the_head)(step)
    return af.compiled(backend=backend)(af.with_amp(dtype=torch.bfloat16)(step))


# --------------------------------------------------------------------------------- models
def run_model(width: int, args: argparse.Namespace, device: torch.device,
              log: Callable[[str], None]) -> dict[str, Any]:
    """float8 against bf16 on the GPT ``width`` wide (a tiny stand-in in a dry run)."""
    preset = (TINY if args.dry_run else PRESETS)[width]
    c = dataclasses.replace(preset.config)
    for key in ("seq", "layers"):
        if getattr(args, key):
            setattr(c, key, getattr(args, key))
    batch_size = args.batch_size or preset.batch_size
    layers = "all" if args.dry_run else "auto"  # the tiny layers are all under the rule
    batches = token_batches(c, batch_size, 2, device, args.seed)
    states: dict[str, af.TrainState] = {}
    calls: dict[str, Callable[[], None]] = {}
    sides: dict[str, dict[str, Any]] = {}
    chosen: dict[str, Any] = {}
    params = 0
    for side in SIDES:
        model = make_model(c, device, args.seed)
        params = sum(p.numel() for p in model.parameters())
        state = af.TrainState(model, make_optimizer(model))
        step = build_step(side, args.recipe, layers, args.compile_backend)
        cursor = iter(range(10**9))

        def one(step: Any = step, state: af.TrainState = state, cursor: Any = cursor) -> None:
            step(state, batches[next(cursor) % len(batches)])

        log(f"width {width}, {side}: warm-up ({args.warmup} steps, compilation included): "
            f"{af.describe(step)}")
        with PeakMemory(device) as memory:
            first = interleaved([one], 1, device)[0][0]
            for _ in range(args.warmup - 1):
                one()
            sync(device)
        converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        if side == "float8":
            log(af.describe(step, state))
            found = float8_layers(model)
            assert found is not None
            chosen = {"converted": list(found.converted),
                      "left_out": {name: why for name, (_, why) in found.left_out.items()}}
        sides[side] = {"name": side, "stack": af.describe(step), "first_step_s": first,
                       "converted_layers": converted, "peak_memory_mib": memory.peak_mib}
        states[side], calls[side] = state, one
    times = interleaved([calls[s] for s in SIDES], args.steps, device)
    tokens = batch_size * c.seq
    for side, per_call in zip(SIDES, times):
        median = statistics.median(per_call)
        loss = _loss(states[side], batches[0])
        sides[side].update(tokens_per_s=tokens / median, step_ms=median * 1e3,
                           step_ms_all=[t * 1e3 for t in per_call], eval_loss=loss)
        log(f"  {side}: {tokens / median:,.0f} tokens/s ({median * 1e3:.1f} ms/step), "
            f"loss {loss:.3f}")
    speedup = sides["float8"]["tokens_per_s"] / sides["bf16"]["tokens_per_s"]
    log(f"width {width}: float8 / bf16 {speedup:.3f}x (target {preset.target}x)")
    return {
        "width": width,
        "model": {**asdict(c), "parameters": params},
        "batch_size": batch_size,
        "tokens_per_step": tokens,
        "float8": {"recipe": args.recipe, "layers": layers, "emulated": device.type != "cuda",
                   "left_in_bf16": list(chosen["left_out"]), **chosen},
        "sides": [sides[s] for s in SIDES],
        "speedup": speedup,
        "target": preset.target,
        "meets_target": None if args.dry_run else speedup >= preset.target,
    }


def _loss(state: af.TrainState, batch: Any) -> float:
    """The loss of the trained model on ``batch`` (eager, bf16 autocast, no gradients)."""
    with torch.no_grad(), torch.autocast(state.device.type, dtype=torch.bfloat16):
        return float(lm_loss(state.model, batch))


# --------------------------------------------------------------------------------- shapes
def _linear_call(k: int, n: int, x: torch.Tensor, grad: torch.Tensor, float8: bool,
                 args: argparse.Namespace) -> tuple[Callable[[int], None], float]:
    """A function running ``reps`` compiled forward-and-backward passes of one Linear(k, n)
    (float8 or bf16 autocast) on ``x``, and the seconds its first call took (compilation)."""
    import torchao.float8 as torchao_float8

    torch.manual_seed(args.seed)
    layer: nn.Module = nn.Linear(k, n, bias=False, device=x.device)
    if float8:
        config = torchao_float8.Float8LinearConfig.from_recipe_name(args.recipe)
        config = dataclasses.replace(config, emulate=x.device.type != "cuda")
        layer = torchao_float8.convert_to_float8_training(nn.Sequential(layer),
                                                          config=config)[0]
    compiled = torch.compile(layer, backend=args.compile_backend)
    weight = layer.weight

    def run(reps: int) -> None:
        for _ in range(reps):
            weight.grad = x.grad = None  # as zero_grad(set_to_none=True) leaves them
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                out = compiled(x)
            out.backward(grad)

    t0 = time.perf_counter()
    run(1)
    sync(x.device)
    return run, time.perf_counter() - t0


def _boxes(losing: Sequence[tuple[int, int]]) -> list[list[int]]:
    """The fewest (K, N) pairs whose boxes (K <= k and N <= n) cover every losing (K, N): the
    losing shapes not inside another's box, largest K first."""
    kept = [s for s in set(losing)
            if not any(o != s and s[0] <= o[0] and s[1] <= o[1] for o in losing)]
    return [list(s) for s in sorted(kept, reverse=True)]


def run_shapes(args: argparse.Namespace, device: torch.device,
               log: Callable[[str], None]) -> dict[str, Any]:
    """bf16 against float8 on one compiled Linear per (M, K, N) of the grid."""
    rule = Float8(recipe=args.recipe)
    grid = [(m, k, n) for m in args.m for k in args.k for n in args.n]
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    left: list[list[int]] = []
    for m, k, n in grid:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            left.append([m, k, n])
            continue
        torch._dynamo.reset()  # each shape compiled afresh and static (no recompile limit)
        g = torch.Generator(device="cpu").manual_seed(args.seed)
        x = torch.randn(m, k, generator=g).to(device, torch.bfloat16).requires_grad_()
        grad = torch.randn(m, n, generator=g).to(device, torch.bfloat16)
        bf16, bf16_first = _linear_call(k, n, x, grad, False, args)
        f8, f8_first = _linear_call(k, n, x, grad, True, args)
        # reps: about 2 ms of work per timed call (a call is synchronised at its end)
        once = statistics.median(interleaved([lambda f=bf16: f(1)], 3, device)[0])
        reps = 1 if args.dry_run else max(1, min(200, round(2e-3 / max(once, 1e-6))))
        times = interleaved([lambda f=bf16, r=reps: f(r), lambda f=f8, r=reps: f(r)],
                            args.rounds, device)
        bf16_ms, f8_ms = (statistics.median(t) / reps * 1e3 for t in times)
        speedup = bf16_ms / f8_ms
        converts = rule.left_out_by_shape(k, n) is None
        rows.append({"M": m, "K": k, "N": n, "bf16_ms": bf16_ms, "float8_ms": f8_ms,
                     "speedup": speedup, "float8_wins": speedup > 1.0,
                     "rule_converts": converts, "reps": reps,
                     "first_call_s": {"bf16": bf16_first, "float8": f8_first}})
        log(f"  M={m} K={k} N={n}: bf16 {bf16_ms:.3f} ms, float8 {f8_ms:.3f} ms, "
            f"x{speedup:.3f} ({'converted' if converts else 'left out'} by the rule)")
    by_m: dict[str, list[list[int]]] = {}
    for m in args.m:
        losing = [(r["K"], r["N"]) for r in rows if r["M"] == m and not r["float8_wins"]]
        by_m[str(m)] = _boxes(losing)
    return {
        "recipe": args.recipe,
        "rule": rule.rule,
        "grid": {"M": list(args.m), "K": list(args.k), "N": list(args.n)},
        "rounds": args.rounds,
        "shapes": rows,
        "wins": [[r["M"], r["K"], r["N"]] for r in rows if r["float8_wins"]],
        "rule_converts_but_loses": [[r["M"], r["K"], r["N"]] for r in rows
                                    if r["rule_converts"] and not r["float8_wins"]],
        "rule_leaves_out_but_wins": [[r["M"], r["K"], r["N"]] for r in rows
                                     if not r["rule_converts"] and r["float8_wins"]],
        "measured_boxes": by_m,
        "not_measured": left,
        "seconds": time.perf_counter() - start,
        "notes": ["speedup = bf16 ms / float8 ms per forward and backward of the layer "
                  "(medians of the interleaved calls); float8_wins: speedup > 1",
                  "measured_boxes[M]: a layer with K <= k and N <= n for one pair lost at "
                  "that M (assuming smaller layers lose more): the rule's boxes, measured"],
    }


# ----------------------------------------------------------------------------------- main
def run(args: argparse.Namespace, log: Callable[[str], None],
        save: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    result: dict[str, Any] = {
        "benchmark": "float8",
        "dry_run": args.dry_run,
        "machine": environment(device),
        "steps": args.steps,
        "warmup": args.warmup,
        "compile_backend": args.compile_backend,
        "widths": [],
        "notes": ["tokens/s = batch x seq / the median of the interleaved, synchronised calls",
                  "peak_memory_mib: the warm-up's peak, with the other side's model resident "
                  "when it was built first (bf16 is built first)",
                  "eval_loss: the eager model's loss on the first batch after the timed steps "
                  "(both sides trained on the same batches: the figures should be close)",
                  "the top level repeats the first width's figures"],
    }
    for width in args.widths:
        torch._dynamo.reset()  # static shapes for this width, not dynamic ones after another's
        one = run_model(width, args, device, log)
        result["widths"].append(one)
        if len(result["widths"]) == 1:  # the headline: the first width's figures
            result.update({k: v for k, v in one.items() if k != "width"})
        save(result)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next width's models start from a clean pool
    if args.shapes:
        log(f"shapes ({args.recipe}): {len(args.m) * len(args.k) * len(args.n)} of them")
        result["per_shape"] = run_shapes(args, device, log)
    save(result)
    return result


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         "integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more integers >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="tiny GPTs and shapes on the CPU with float8 emulated, compiled with "
                        "the 'eager' backend unless --compile-backend (checks the code)")
    p.add_argument("--widths", type=_ints, default=(4096, 2048),
                   help=f"the models to compare, of {sorted(PRESETS)} (default 4096,2048; "
                        "the first is the JSON's top level)")
    p.add_argument("--recipe", default="tensorwise", choices=sorted(SHAPE_RULES),
                   help="torchao's float8 recipe (models and shapes)")
    p.add_argument("--shapes", action="store_true",
                   help="also time one Linear per (M, K, N) of the grid")
    p.add_argument("--shapes-only", action="store_true", help="the shape sweep alone")
    p.add_argument("--m", type=_ints, default=None, help="tokens per micro-batch of the sweep")
    p.add_argument("--k", type=_ints, default=None, help="in features of the sweep")
    p.add_argument("--n", type=_ints, default=None, help="out features of the sweep")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved timed calls per side and shape")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop the sweep after this many seconds (the rest: not_measured)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per side (>= 2)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default: inductor; eager in a dry run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None,
                   help="also write the result here (after each model and at the end)")
    args = p.parse_args(argv)
    unknown = [w for w in args.widths if w not in PRESETS]
    if unknown:
        p.error(f"--widths {unknown}: the models are {sorted(PRESETS)} wide")
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks/float8.py measures float8 matmuls on a CUDA GPU and there is none "
              "here; run it on a GPU with compute capability 8.9+ (H100, H200, L4), or check "
              "the code on this machine with --dry-run", file=sys.stderr)
        return 2
    if args.shapes_only:
        args.shapes, args.widths = True, ()
    args.m = args.m or (TINY_M if args.dry_run else GRID_M)
    args.k = args.k or (TINY_K if args.dry_run else GRID_K)
    args.n = args.n or (TINY_N if args.dry_run else GRID_N)
    args.rounds = args.rounds or (2 if args.dry_run else 10)
    args.compile_backend = args.compile_backend or ("eager" if args.dry_run else "inductor")
    args.steps = args.steps or (3 if args.dry_run else 12)
    args.warmup = args.warmup or (2 if args.dry_run else 3)
    if args.warmup < 2 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup must be >= 2 (the first step compiles), --steps and --rounds >= 1")

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    def save(result: dict[str, Any]) -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")

    result = run(args, log, save)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
