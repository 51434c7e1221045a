"""Sharded Muon's optimizer step against AdamW's under FSDP2 on 4 CPU processes (gloo) or
on the GPUs (NCCL, one process per GPU, up to 4), and against one-process Muon's: what
Newton-Schulz costs, and what sharding adds.

One ``torchrun`` launch (127.0.0.1, one thread per process). The same GPT
(``benchmarks/gpt2.py``'s), four ways:

* ``adamw``: ``torch.optim.AdamW`` over every parameter (fp32, foreach), sharded with
  ``af.distributed(strategy="fsdp")`` over the 4 processes;
* ``muon``: ``torch.optim.Muon`` over the blocks' matrices and AdamW over the rest (the
  embeddings, the head, biases and norms), the recipe Muon is meant for, sharded the same
  way; its step is the sharded one (each matrix's update gathered to its owner,
  orthogonalised there, scattered back);
* ``muon_one`` and ``adamw_one``: the same two recipes in one process (rank 0, the others
  waiting at a barrier), no ``distributed``, on the global batch (the 4 processes' rows):
  torch's own ``Muon.step``, what a user without sharding pays.

Measured per update: the optimizer step (from the first optimizer's step pre-hook to the last
one's post-hook: collectives included) and the whole update (``step(state, batch)``), and,
for the Muon sides, the time in Newton-Schulz (accelfn's on each owner, torch's in one
process: wall time, the slowest process'; CPU time, summed over the processes and the
busiest process', which shows how evenly the owners share the work whatever the load). A
sharded update starts after a barrier and counts as its slowest process' time. The sides
alternate in rounds (the order reversed every other round), so load on the machine falls
on all alike; each figure is the median over the rounds of a round's median. The ratios:
``muon / adamw`` (the target is at most 1.3 for the optimizer step), ``muon_one / adamw``,
``muon / muon_one``, and the sharded step less its slowest Newton-Schulz (all the rest: the
exchange, the momentum and the update on the shards, AdamW over the other parameters), and
Muon's own step (``first_optimizer``: its pre-hook to its post-hook) less it: what sharding
adds to Muon.

On GPUs (``--device cuda``) every clock reading waits for the device first
(``torch.cuda.synchronize``), the model and batches live on each process' GPU, and the CPU
times count the host's side only (launches and waits). With one GPU the
"sharded" sides run one process: the ratio is then Muon's step against AdamW's on that GPU
with no exchange, and the JSON says so (``processes``).

    python benchmarks/sharded_muon.py [--out FILE] [--rounds 3] [--steps 2] [--tiny]
                                      [--device cpu|cuda] [--nproc N]
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
from accelfn.parts.distributed import muon as sharded_muon

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


def _now() -> float:
    """``time.perf_counter()`` once the device has finished what it was given (on a GPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


class _Clock:
    """The optimizer step's time: from the first optimizer's pre-hook to the last's
    post-hook."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.start = 0.0
        self.seconds = 0.0
        optimizers[0].register_step_pre_hook(self._begin)
        optimizers[-1].register_step_post_hook(self._end)

    def _begin(self, *_: Any) -> None:
        self.start = _now()

    def _end(self, *_: Any) -> None:
        self.seconds = _now() - self.start


def _collective_device() -> torch.device:
    """Where the process group's tensors live: this process' GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _total(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t)
    return float(t[0])


class _NSTimer:
    """Newton-Schulz's wall and CPU (this thread's) seconds since ``reset``: wraps accelfn's
    (the sharded step's) and torch's (one-process Muon's) by their module names."""

    def __init__(self) -> None:
        import torch.optim._muon as private

        self.wall = self.cpu = 0.0
        for module, name in ((sharded_muon, "newton_schulz"),
                             (private, "_zeropower_via_newtonschulz")):
            setattr(module, name, self._wrap(getattr(module, name)))

    def _wrap(self, inner: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = _now(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.wall += _now() - wall
                self.cpu += time.thread_time() - cpu
        return timed

    def reset(self) -> None:
        self.wall = self.cpu = 0.0


SHARDED = ("adamw", "muon")
ONE = ("adamw_one", "muon_one")


def worker(out: str, config: GPTConfig, rounds: int, steps: int, cuda: bool) -> None:
    from datetime import timedelta

    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=1800))
    device = af.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    load_start = [round(x, 2) for x in os.getloadavg()]
    count = steps * rounds * 2 + 2
    batches = token_batches(config, BATCH, count, device, seed=rank)
    # one process' batch: every process' rows (the same global batch)
    everyone = [token_batches(config, BATCH, count, device, seed=r) for r in range(world)]
    whole = [torch.cat([b[i] for b in everyone]) for i in range(count)]
    ns = _NSTimer()
    sides: dict[str, Any] = {}
    for side in SHARDED + (ONE if rank == 0 else ()):
        torch.manual_seed(0)
        model = GPT(config).to(device)
        optimizers = _optimizers(model, side.removesuffix("_one"))
        state = af.TrainState(model, optimizers)
        inner = lm_loss if side in ONE else af.distributed(strategy="fsdp")(lm_loss)
        step = af.with_clipping(max_norm=1.0)(inner)
        clock = _Clock(optimizers), _Clock(optimizers[:1])
        step(state, (whole if side in ONE else batches)[0])  # warm-up: shards, states, plan
        sides[side] = (state, step, clock)
    kinds = ("optimizer", "first_optimizer", "update", "ns_wall", "ns_cpu", "ns_cpu_slowest")
    times: dict[str, dict[str, list[float]]] = {
        s: {k: [] for k in kinds} for s in SHARDED + ONE}
    at = 1
    for r in range(rounds):
        order = ["adamw", "muon", "muon_one", "adamw_one"]
        for side in order if r % 2 == 0 else order[::-1]:
            got: dict[str, list[float]] = {k: [] for k in kinds}
            for i in range(steps):
                batch = at + i
                if side in SHARDED:
                    state, step, clock = sides[side]
                    dist.barrier()
                    ns.reset()
                    start = _now()
                    step(state, batches[batch % count])
                    got["update"].append(_slowest(_now() - start))
                    got["optimizer"].append(_slowest(clock[0].seconds))
                    got["first_optimizer"].append(_slowest(clock[1].seconds))
                    got["ns_wall"].append(_slowest(ns.wall))
                    got["ns_cpu"].append(_total(ns.cpu))
                    got["ns_cpu_slowest"].append(_slowest(ns.cpu))
                elif rank == 0:  # one process; the others wait at the barrier below
                    state, step, clock = sides[side]
                    ns.reset()
                    start = _now()
                    step(state, whole[batch % count])
                    got["update"].append(_now() - start)
                    got["optimizer"].append(clock[0].seconds)
                    got["first_optimizer"].append(clock[1].seconds)
                    got["ns_wall"].append(ns.wall)
                    got["ns_cpu"].append(ns.cpu)
                    got["ns_cpu_slowest"].append(ns.cpu)
            dist.barrier()
            for k in kinds:
                if got[k]:
                    times[side][k].append(statistics.median(got[k]))
        at += steps
    if rank == 0:
        model = sides["muon"][0].model
        matrices = [p for n, p in model.named_parameters() if _matrix(n, p)]
        med = {side: {k: statistics.median(v) for k, v in ks.items()}
               for side, ks in times.items()}
        opt = {side: med[side]["optimizer"] for side in med}
        result = {
            "benchmark": "sharded_muon", "processes": world,
            "backend": "nccl" if cuda else "gloo", "device": device.type,
            "model": {"layers": config.layers, "dim": config.dim, "vocab": config.vocab,
                      "seq": config.seq, "batch_per_process": BATCH,
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "muon_matrices": len(matrices),
                      "muon_parameters": sum(p.numel() for p in matrices),
                      "muon_shapes": sorted({tuple(p.shape) for p in matrices})},
            "rounds": rounds, "updates_per_round": steps,
            "cpu_bf16_native": None if cuda else compat.cpu_bf16_native(),
            "seconds": med,
            "rounds_seconds": times,
            "ratio_optimizer_step": opt["muon"] / opt["adamw"],
            "ratio_optimizer_step_one_process_muon_to_sharded_adamw":
                opt["muon_one"] / opt["adamw"],
            "ratio_optimizer_step_one_process_muon_to_one_process_adamw":
                opt["muon_one"] / opt["adamw_one"],
            "ratio_optimizer_step_sharded_to_one_process_muon": opt["muon"] / opt["muon_one"],
            "ratio_update": med["muon"]["update"] / med["adamw"]["update"],
            "sharded_step_less_newton_schulz_seconds": opt["muon"] - med["muon"]["ns_wall"],
            "sharded_muon_step_less_newton_schulz_seconds":
                med["muon"]["first_optimizer"] - med["muon"]["ns_wall"],
            "newton_schulz_share_of_sharded_step": med["muon"]["ns_wall"] / opt["muon"],
            "target_optimizer_step_ratio": TARGET,
            "environment": {**environment(device.type), "load_average_start": load_start},
        }
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed updates per round")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer toy (checks)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: NCCL, one process per GPU")
    parser.add_argument("--nproc", type=int, default=None,
                        help=f"processes (default {WORLD} on the CPU, one per GPU up to "
                             f"{WORLD} on cuda)")
    parser.add_argument("--worker", nargs=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = TINY if args.tiny else MODEL
    cuda = args.device == "cuda"
    if args.worker:
        worker(args.worker[0], config, args.rounds, args.steps, cuda)
        return 0
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here; run on the CPU (the default)")
    gpus = torch.cuda.device_count() if cuda else 0
    nproc = args.nproc or (min(WORLD, gpus) if cuda else WORLD)
    if nproc < 1 or (cuda and nproc > gpus):
        parser.error(f"--nproc {nproc}: give 1 to {gpus if cuda else 'the cores'} processes "
                     "(NCCL runs one process per GPU)")
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               "--master_addr=127.0.0.1", f"--master_port={_port()}", __file__,
               "--worker", result_file, "--rounds", str(args.rounds), "--steps",
               str(args.steps), "--device", args.device, *(["--tiny"] if args.tiny else [])]
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
    r = json.loads(text)
    env = r["environment"]
    print(f"{env['date']} {env['cpu']} ({env['cpu_cores']} cores), load "
          f"{env['load_average_start']} -> {env['load_average']}: optimizer step sharded Muon / "
          f"AdamW x{r['ratio_optimizer_step']:.2f}, one-process Muon / AdamW "
          f"x{r['ratio_optimizer_step_one_process_muon_to_sharded_adamw']:.2f}, sharded / "
          f"one-process Muon x{r['ratio_optimizer_step_sharded_to_one_process_muon']:.2f}; "
          f"Newton-Schulz {r['newton_schulz_share_of_sharded_step']:.0%} of the sharded step",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
