"""Sharded Muon's optimizer step against AdamW's, under FSDP2 on 4 CPU processes (gloo).

One ``torchrun --nproc_per_node=4`` launch (127.0.0.1, one thread per process). Each process
builds the same GPT (``benchmarks/gpt2.py``'s) twice and shards each with
``af.distributed(strategy="fsdp")``:

* ``adamw``: ``torch.optim.AdamW`` over every parameter (fp32, foreach);
* ``muon``: ``torch.optim.Muon`` over the blocks' matrices and AdamW over the rest (the
  embeddings, the head, biases and norms), the recipe Muon is meant for; its step is the
  sharded one (each matrix's update gathered to its owner, orthogonalised there by torch's
  Newton-Schulz, scattered back).

Measured per update: the optimizer step (from the first optimizer's step pre-hook to the last
one's post-hook: what Muon adds over AdamW, collectives included) and the whole update
(``step(state, batch)``: forward, backward, reduction, clipping, optimizer). Every update
starts after a barrier and counts as its slowest process' time. The sides alternate in
rounds (``adamw`` then ``muon``, then the other way round), so load on the machine falls on
both alike; each figure is the median over the rounds of a round's median. The ratios are
``muon / adamw``; the target is at most 1.3 for the optimizer step.

    python benchmarks/sharded_muon.py [--out FILE] [--rounds 5] [--steps 3] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2 import GPT, GPTConfig, lm_loss, token_batches

import accelfn as af
from accelfn.core import compat
from accelfn.observe.timing import environment

WORLD = 4
MODEL = GPTConfig(vocab=2048, seq=128, layers=4, dim=256, heads=4)
TINY = GPTConfig(vocab=256, seq=16, layers=2, dim=32, heads=2)
BATCH = 4  # sequences per process
TARGET = 1.3


def _matrix(name: str, p: nn.Parameter) -> bool:
    return name.startswith("blocks.") and p.ndim == 2


def _optimizers(model: nn.Module, side: str) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    if side == "adamw":
        return [torch.optim.AdamW([p for _, p in named], lr=3e-4, weight_decay=0.1)]
    return [torch.optim.Muon([p for n, p in named if _matrix(n, p)], lr=0.02),
            torch.optim.AdamW([p for n, p in named if not _matrix(n, p)], lr=3e-4,
                              weight_decay=0.1)]


class _Clock:
    """The optimizer step's time: from the first optimizer's pre-hook to the last's
    post-hook."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.start = 0.0
        self.seconds = 0.0
        optimizers[0].register_step_pre_hook(self._begin)
        optimizers[-1].register_step_post_hook(self._end)

    def _begin(self, *_: Any) -> None:
        self.start = time.perf_counter()

    def _end(self, *_: Any) -> None:
        self.seconds = time.perf_counter() - self.start


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def worker(out: str, config: GPTConfig, rounds: int, steps: int) -> None:
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    af.init_distributed()
    rank = dist.get_rank()
    batches = token_batches(config, BATCH, steps * rounds * 2 + 2, torch.device("cpu"),
                            seed=rank)
    sides: dict[str, Any] = {}
    for side in ("adamw", "muon"):
        torch.manual_seed(0)
        model = GPT(config)
        optimizers = _optimizers(model, side)
        state = af.TrainState(model, optimizers)
        step = af.with_clipping(max_norm=1.0)(af.distributed(strategy="fsdp")(lm_loss))
        clock = _Clock(optimizers)
        step(state, batches[0])  # warm-up: shards the model, makes the state and Muon's plan
        sides[side] = (state, step, clock)
    times: dict[str, dict[str, list[float]]] = {
        s: {"optimizer": [], "update": []} for s in sides}
    at = 1
    for r in range(rounds):
        order = ["adamw", "muon"] if r % 2 == 0 else ["muon", "adamw"]
        for side in order:
            state, step, clock = sides[side]
            optimizer, update = [], []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                step(state, batches[at % len(batches)])
                update.append(_slowest(time.perf_counter() - start))
                optimizer.append(_slowest(clock.seconds))
                at += 1
            times[side]["optimizer"].append(statistics.median(optimizer))
            times[side]["update"].append(statistics.median(update))
    if rank == 0:
        model = sides["muon"][0].model
        matrices = [p for n, p in model.named_parameters() if _matrix(n, p)]
        result = {
            "benchmark": "sharded_muon", "processes": WORLD, "backend": "gloo",
            "model": {"layers": config.layers, "dim": config.dim, "vocab": config.vocab,
                      "seq": config.seq, "batch_per_process": BATCH,
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "muon_matrices": len(matrices),
                      "muon_parameters": sum(p.numel() for p in matrices)},
            "rounds": rounds, "updates_per_round": steps,
            "cpu_bf16_native": compat.cpu_bf16_native(),
            "seconds": {side: {kind: statistics.median(values)
                               for kind, values in kinds.items()}
                        for side, kinds in times.items()},
            "rounds_seconds": times,
            "environment": environment("cpu"),
        }
        s = result["seconds"]
        result["ratio_optimizer_step"] = s["muon"]["optimizer"] / s["adamw"]["optimizer"]
        result["ratio_update"] = s["muon"]["update"] / s["adamw"]["update"]
        result["target_optimizer_step_ratio"] = TARGET
        result["meets_target"] = result["ratio_optimizer_step"] <= TARGET
        Path(out).write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed updates per round")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer toy (checks)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", nargs=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = TINY if args.tiny else MODEL
    if args.worker:
        worker(args.worker[0], config, args.rounds, args.steps)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
               "--master_addr=127.0.0.1", f"--master_port={_port()}", __file__,
               "--worker", result_file, "--rounds", str(args.rounds), "--steps",
               str(args.steps), *(["--tiny"] if args.tiny else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
            return proc.returncode
        text = Path(result_file).read_text()
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
