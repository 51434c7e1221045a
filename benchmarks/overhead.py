"""Step overhead: a stacked accelfn step against the same loop written by hand.

Both sides do identical work per update on the same TensorDict batch: bf16 autocast forward,
2 micro-batches weighted by
samples, backward, global-norm clipping, a non-finite check of loss and gradient norm with one
host read, SGD step, zero_grad(set_to_none=True), scheduler step, and the same TensorDict of
detached metrics (loss, accuracy, grad_norm, lr, skipped). Runs are
interleaved step by step in one process, alternating which side goes first; medians of
the per-step times are compared.

    python benchmarks/overhead.py [--pairs 8] [--steps 400] [--hidden 512] [--batch 256]

Prints JSON: median step time of each side, the ratio, and microseconds added per step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

import accelfn as af


def model_fn(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                         nn.Linear(hidden, 10))


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = F.cross_entropy(logits, batch["y"])
    return {"loss": loss, "accuracy": (logits.argmax(-1) == batch["y"]).float().mean()}


def hand_written_step(model, optimizer, scheduler, batch):
    """The equivalent loop body, written out."""
    n = len(batch)
    half = (n + 1) // 2
    loss_sum = acc_sum = 0.0
    for lo, hi in ((0, half), (half, n)):  # the same TensorDict batch, sliced by hand
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = loss_fn(model, batch[lo:hi])
        share = (hi - lo) / n
        (out["loss"] * share).backward()
        loss_sum = loss_sum + out["loss"].detach() * share
        acc_sum = acc_sum + out["accuracy"].detach() * share
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    lr = torch.full((), optimizer.param_groups[0]["lr"])
    bad = ~torch.isfinite(torch.stack([loss_sum, norm]))
    skip = any(bad.tolist())
    if not skip:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return TensorDict({"loss": loss_sum, "accuracy": acc_sum, "grad_norm": norm.detach(),
                       "lr": lr, "skipped": bad.any().float()}, batch_size=[])


def interleaved(a, b, steps: int) -> tuple[list[float], list[float]]:
    """Per-step times of ``a`` and ``b``, alternating which runs first at every step."""
    ta, tb = [], []
    # CPU time of this thread: with one intra-op thread every op runs here, and time spent
    # descheduled by other processes on a shared machine is not counted
    clock = time.thread_time
    for i in range(steps):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        t0 = clock()
        first()
        t1 = clock()
        second()
        t2 = clock()
        da, db = (t1 - t0, t2 - t1) if i % 2 == 0 else (t2 - t1, t1 - t0)
        ta.append(da)
        tb.append(db)
    return ta, tb


def one_pair(args: argparse.Namespace, td: TensorDict, hand_first: bool) -> dict:
    """Fresh, identical models for both sides (created in the given order), timed together."""
    base = model_fn(args.hidden)
    copies = [copy.deepcopy(base), copy.deepcopy(base)]
    m_hand, m_af = copies if hand_first else copies[::-1]
    o_af = torch.optim.SGD(m_af.parameters(), lr=1e-3, momentum=0.9)
    o_hand = torch.optim.SGD(m_hand.parameters(), lr=1e-3, momentum=0.9)
    s_af = torch.optim.lr_scheduler.StepLR(o_af, 10_000)
    s_hand = torch.optim.lr_scheduler.StepLR(o_hand, 10_000)
    state = af.TrainState(m_af, o_af, scheduler=s_af)
    step = af.with_amp(af.with_accumulation(2)(af.with_clipping(max_norm=1.0)(loss_fn)))

    run_af = lambda: step(state, td)
    run_hand = lambda: hand_written_step(m_hand, o_hand, s_hand, td)
    for _ in range(20):  # warm up both
        run_af()
        run_hand()
    t_af, t_hand = interleaved(run_af, run_hand, args.steps)
    return {
        "stack": repr(step),
        "af": statistics.median(t_af),
        "hand": statistics.median(t_hand),
        "same": all(torch.equal(a, b) for a, b in zip(m_af.parameters(), m_hand.parameters())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="interleaved steps per pair")
    parser.add_argument("--pairs", type=int, default=8, help="fresh model pairs")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 64, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    td = TensorDict({"x": x, "y": y}, batch_size=[args.batch])

    pairs = [one_pair(args, td, hand_first=i % 2 == 0) for i in range(args.pairs)]
    med_af = statistics.median(p["af"] for p in pairs)
    med_hand = statistics.median(p["hand"] for p in pairs)
    added = statistics.median(p["af"] - p["hand"] for p in pairs)
    print(json.dumps({
        "benchmark": "overhead",
        "stack": pairs[0]["stack"],
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "hidden": args.hidden,
        "pairs": args.pairs,
        "steps_per_pair": args.steps,
        "timing": "per-step thread CPU time, interleaved with alternating order, in fresh "
                  "model pairs created in alternating order; medians",
        "hand_written_step_ms": round(med_hand * 1e3, 4),
        "accelfn_step_ms": round(med_af * 1e3, 4),
        "ratio": round(med_af / med_hand, 4),
        "added_us_per_step": round(added * 1e6, 2),
        "added_us_per_pair": [round((p["af"] - p["hand"]) * 1e6, 1) for p in pairs],
        "parameters_bitwise_equal": all(p["same"] for p in pairs),
        "targets": {"ratio_max": 1.01, "added_us_max": 20},
    }, indent=2))


if __name__ == "__main__":
    main()
