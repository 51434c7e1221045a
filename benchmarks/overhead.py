"""Step overhead: accelfn's default stack against the loop users really write.

The baseline is the plain loop with nothing added: raw tensors, ``x.chunk(n)``/``y.chunk(n)``,
``torch.autocast`` when AMP is on (no context in fp32), ``(loss / n).backward()``,
``clip_grad_norm_``,
``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``. The accelfn side is
``[with_amp ∘] with_accumulation(4) ∘ with_clipping(max_norm=1.0)`` over a TensorDict batch,
with the non-finite guard on, as users get it. A second line compares the loop written by hand
with the same features (TensorDict slices, weighted metrics in a TensorDict, a finite check of
loss and gradient norm with a host read); Lightning Fabric and HF Accelerate run the same step
when installed (``pip install accelfn[peers]``). A control runs the plain loop again on its own
copy of the model: its ratio to the plain loop (1.000 if the machine were perfectly steady)
is the noise floor the other ratios are read against.

accelfn makes the plain loop's own torch calls (``loss.backward()``, ``clip_grad_norm_``,
``optimizer.step()``, ``zero_grad(set_to_none=True)``): what it adds over the plain loop is
its bookkeeping (TensorDict split, metrics, the non-finite guard) alone.

AdamW, one intra-op thread; every side runs the same number of updates on the same batch.
Rounds interleave the sides, rotating which goes first; each round gives each side's median
thread CPU time per update; the figures are medians over rounds of the per-round ratios.

Every run also counts the ATen operators each side dispatches per update (a dispatch mode
around five updates): a count that is the same on any machine, with the operators whose
counts differ from the plain loop's.

``--instructions`` also counts each side's instructions per update with valgrind's callgrind
(plain loop, accelfn, the same features by hand; the tiny model unless
``--instruction-models`` says otherwise): a figure that, unlike time, does not move with the
machine's load (repeated runs agree within about 2%).

    python benchmarks/overhead.py [--rounds 15] [--steps 30] [--out FILE] [--instructions]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

import accelfn as af
from accelfn.core import compat

MODELS = {"tiny": (64, 64), "medium": (512, 256)}  # hidden width, batch
MICRO = 4


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, 10))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


# ------------------------------------------------------------------------------ the sides
def plain_side(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
               bf16: bool) -> Callable[[], None]:
    """The loop people write: nothing added."""
    optimizer = make_optimizer(model)

    def step() -> None:
        for xc, yc in zip(x.chunk(MICRO), y.chunk(MICRO)):
            loss = F.cross_entropy(model(xc), yc)
            (loss / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def amp_step() -> None:
        for xc, yc in zip(x.chunk(MICRO), y.chunk(MICRO)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(xc), yc)
            (loss / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return amp_step if bf16 else step


def accelfn_side(model: nn.Module, batch: TensorDict, bf16: bool) -> Callable[[], Any]:
    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b["x"]), b["y"])

    step: Any = af.with_accumulation(MICRO)(af.with_clipping(max_norm=1.0)(loss_fn))
    if bf16:
        step = af.with_amp(dtype=torch.bfloat16)(step)
    state = af.TrainState(model, make_optimizer(model))
    return lambda: step(state, batch)


def same_features_side(model: nn.Module, batch: TensorDict, bf16: bool) -> Callable[[], Any]:
    """The hand-written loop doing what accelfn's step does besides the update."""
    optimizer = make_optimizer(model)
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    n = batch.batch_size[0]
    bounds = [(i * n // MICRO, (i + 1) * n // MICRO) for i in range(MICRO)]

    def step() -> TensorDict:
        loss_sum = None
        for lo, hi in bounds:
            with amp():
                loss = F.cross_entropy(model(batch[lo:hi]["x"]), batch[lo:hi]["y"])
            weighted = loss * ((hi - lo) / n)
            weighted.backward()
            loss_sum = weighted.detach() if loss_sum is None else loss_sum + weighted.detach()
        assert loss_sum is not None
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        values = torch.stack([loss_sum, norm]).tolist()
        skip = not all(map(lambda v: v == v and abs(v) != float("inf"), values))
        lr = optimizer.param_groups[0]["lr"]
        if not skip:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return TensorDict({"loss": loss_sum, "grad_norm": norm, "lr": torch.scalar_tensor(lr),
                           "skipped": torch.scalar_tensor(float(skip))}, batch_size=[])

    return step


def fabric_side(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                bf16: bool) -> Callable[[], None] | None:
    try:
        from lightning.fabric import Fabric
    except ImportError:
        return None
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed" if bf16 else "32-true")
    model, optimizer = fabric.setup(model, make_optimizer(model))

    def step() -> None:
        for xc, yc in zip(x.chunk(MICRO), y.chunk(MICRO)):
            loss = F.cross_entropy(model(xc), yc)
            fabric.backward(loss / MICRO)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def accelerate_side(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                    bf16: bool) -> Callable[[], None] | None:
    try:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
    except ImportError:
        return None
    AcceleratorState._reset_state(reset_partial_state=True)  # one precision per process else
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if bf16 else "no")
    model, optimizer = accelerator.prepare(model, make_optimizer(model))

    def step() -> None:  # prepare() already runs the model's forward under autocast
        for xc, yc in zip(x.chunk(MICRO), y.chunk(MICRO)):
            loss = F.cross_entropy(model(xc), yc)
            accelerator.backward(loss / MICRO)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# ------------------------------------------------------------------------------ timing
def make_sides(name: str, bf16: bool, peers: bool = True
               ) -> tuple[dict[str, nn.Module], dict[str, Callable[[], Any]]]:
    """Each side's model (copies of one) and its update, on the same batch."""
    hidden, batch_size = MODELS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 32, generator=g)
    y = torch.randint(0, 10, (batch_size,), generator=g)
    batch = TensorDict({"x": x, "y": y}, batch_size=[batch_size])
    base = make_model(hidden)
    models = {side: copy.deepcopy(base) for side in
              ("plain", "plain_again", "accelfn", "same_features", "fabric", "accelerate")}
    sides: dict[str, Callable[[], Any] | None] = {
        "plain": plain_side(models["plain"], x, y, bf16),
        # the control: the same plain loop on its own copy of the model, whose ratio to the
        # plain loop is the measurement's noise floor (placement in memory, the machine)
        "plain_again": plain_side(models["plain_again"], x, y, bf16) if peers else None,
        "accelfn": accelfn_side(models["accelfn"], batch, bf16),
        "same_features": same_features_side(models["same_features"], batch, bf16),
        "fabric": fabric_side(models["fabric"], x, y, bf16) if peers else None,
        "accelerate": accelerate_side(models["accelerate"], x, y, bf16) if peers else None,
    }
    return models, {k: v for k, v in sides.items() if v is not None}


def run_config(name: str, bf16: bool, rounds: int, steps: int) -> dict[str, Any]:
    hidden, batch_size = MODELS[name]
    models, active = make_sides(name, bf16)
    for fn in active.values():  # warm up: the same number of updates for every side
        for _ in range(5):
            fn()
    names = list(active)
    per_round: dict[str, list[float]] = {k: [] for k in names}
    clock = time.thread_time  # this thread's CPU time: descheduled time is not counted
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        times: dict[str, list[float]] = {k: [] for k in names}
        for _ in range(steps):
            for k in order:
                t0 = clock()
                active[k]()
                times[k].append(clock() - t0)
        for k in names:
            per_round[k].append(statistics.median(times[k]))
    plain = per_round["plain"]
    out: dict[str, Any] = {
        "model": f"MLP 32-{hidden}-{hidden}-10", "batch": batch_size, "micro_batches": MICRO,
        "precision": "bf16 autocast" if bf16 else "fp32",
        "plain_step_us": round(statistics.median(plain) * 1e6, 1),
    }
    for k in names[1:]:
        ratios = [a / b for a, b in zip(per_round[k], plain)]
        added = [a - b for a, b in zip(per_round[k], plain)]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        out[k] = {"ratio": round(statistics.median(ratios), 4),
                  "ratio_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)],
                  "added_us": round(statistics.median(added) * 1e6, 1),
                  "step_us": round(statistics.median(per_round[k]) * 1e6, 1)}
    out["accelfn_vs_same_features"] = round(statistics.median(
        [a / b for a, b in zip(per_round["accelfn"], per_round["same_features"])]), 4)
    out["parameters_bitwise_equal_to_plain"] = all(
        torch.equal(a, b) for a, b in zip(models["accelfn"].parameters(),
                                          models["plain"].parameters()))
    return out


# ------------------------------------------------------------------------------ operators
COUNTED = ("plain", "accelfn", "same_features")


def count_operators(name: str, bf16: bool, updates: int = 5) -> dict[str, Any]:
    """ATen operators dispatched per update by each side (a count, not a time: the same on
    any machine at any load), and the ones whose counts differ from the plain loop's."""
    _, sides = make_sides(name, bf16, peers=False)
    counts: dict[str, dict[str, int]] = {}
    for side in COUNTED:
        for _ in range(3):
            sides[side]()
        seen: dict[str, int] = {}

        def note(op: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 seen: dict[str, int] = seen) -> None:
            seen[op] = seen.get(op, 0) + 1

        with compat.aten_observer(note):
            for _ in range(updates):
                sides[side]()
        counts[side] = seen
    total = {side: sum(c.values()) / updates for side, c in counts.items()}
    plain = counts["plain"]
    differ = {op: [plain.get(op, 0) / updates, counts["accelfn"].get(op, 0) / updates]
              for op in sorted(set(plain) | set(counts["accelfn"]))
              if plain.get(op, 0) != counts["accelfn"].get(op, 0)}
    hidden, batch_size = MODELS[name]
    return {"model": f"MLP 32-{hidden}-{hidden}-10", "batch": batch_size,
            "precision": "bf16 autocast" if bf16 else "fp32",
            "operators_per_update": total,
            "accelfn_ratio": round(total["accelfn"] / total["plain"], 4),
            "same_features_ratio": round(total["same_features"] / total["plain"], 4),
            "accelfn_differs_from_plain": differ}


# ------------------------------------------------------------------------------ instructions


def count_child(name: str, bf16: bool, steps: int) -> None:
    """Under callgrind (collection off at start): count each side's updates alone, after a
    warm-up, by switching collection on and off around them and dumping one file per side."""
    pid = str(os.getpid())

    def control(*flags: str) -> None:
        subprocess.run(["callgrind_control", *flags, pid], check=True, capture_output=True)

    _, sides = make_sides(name, bf16, peers=False)
    for fn in sides.values():
        for _ in range(5):
            fn()
    for side in COUNTED:
        control("-z")
        control("-i", "on")
        for _ in range(steps):
            sides[side]()
        control("-i", "off")
        control("-d", side)


def count_instructions(name: str, bf16: bool, steps: int) -> dict[str, Any]:
    """Instructions per update of each side, counted by valgrind's callgrind: unlike time,
    the count does not move with the machine's load (the same run gives the same figure)."""
    with tempfile.TemporaryDirectory(prefix="accelfn-callgrind-") as tmp:
        out = os.path.join(tmp, "cg.out")
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                        f"--callgrind-out-file={out}", sys.executable, __file__, "--count-child",
                        name, "bf16" if bf16 else "fp32", "--steps", str(steps)],
                       check=True, capture_output=True, env={**os.environ,
                                                             "OMP_NUM_THREADS": "1"})
        per_update = {}
        for dump in Path(tmp).glob("cg.out.*"):
            text = dump.read_text()
            side = re.search(r"^desc: Trigger: .*dump (\w+)", text, re.M)
            total = re.search(r"^totals: (\d+)", text, re.M)
            if side and total and side.group(1) in COUNTED:
                per_update[side.group(1)] = int(total.group(1)) / steps
    plain = per_update["plain"]
    hidden, batch_size = MODELS[name]
    return {"model": f"MLP 32-{hidden}-{hidden}-10", "batch": batch_size,
            "precision": "bf16 autocast" if bf16 else "fp32", "updates_counted": steps,
            "instructions_per_update": {k: round(v) for k, v in per_update.items()},
            "accelfn_ratio": round(per_update["accelfn"] / plain, 4),
            "same_features_ratio": round(per_update["same_features"] / plain, 4),
            "accelfn_added": round(per_update["accelfn"] - plain),
            "same_features_added": round(per_update["same_features"] - plain)}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30, help="updates per side per round")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per update with valgrind's callgrind")
    parser.add_argument("--instruction-models", nargs="+", default=["tiny"],
                        choices=list(MODELS),
                        help="models to count (default tiny: under valgrind the medium one "
                             "takes over 15 minutes per precision on a 2-core CPU)")
    parser.add_argument("--count-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.count_child:
        count_child(args.count_child[0], args.count_child[1] == "bf16", args.steps)
        return
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind (apt install valgrind)")
    load_before = os.getloadavg()
    configs = [run_config(name, bf16, args.rounds, args.steps)
               for name in args.models for bf16 in (False, True)]
    result = {
        "benchmark": "overhead",
        "baseline": "plain loop: raw tensors, chunk, autocast in bf16 only, (loss/n).backward(), "
                    "clip_grad_norm_, step, zero_grad(set_to_none=True)",
        "accelfn": "[with_amp ∘] with_accumulation(4) ∘ with_clipping(max_norm=1.0), "
                   "TensorDict batch, non-finite guard on",
        "timing": f"{args.rounds} rounds x {args.steps} updates per side, interleaved with "
                  "rotating order; thread CPU time; medians of per-round ratios",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average": [round(v, 2) for v in (*load_before, *os.getloadavg())],
        "threads": torch.get_num_threads(),
        "versions": {p: _version(p) for p in ("torch", "tensordict", "accelfn", "lightning",
                                               "accelerate")},
        "targets": {"tiny": 1.01, "medium": 1.01, "operators": 1.02},
        "configs": configs,
        "operators": [count_operators(name, bf16) for name in args.models
                      for bf16 in (False, True)],
    }
    if args.instructions:  # the medium model's matmuls take minutes per update under valgrind
        result["instructions"] = [count_instructions(name, bf16, 50)
                                  for name in args.instruction_models for bf16 in (False, True)]
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
