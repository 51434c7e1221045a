"""Memory per process and step time of a GPT of over 100M parameters on 4 CPU processes, under
each data-parallel strategy of ``af.distributed``, against plain torch DDP and FSDP2.

Every side is one fresh ``torchrun --nproc_per_node=4`` launch (gloo on 127.0.0.1, one thread
per process), so each process' peak resident memory is that side's alone. Each process builds
the same GPT (``benchmarks/gpt2.py``'s: 14 blocks, 768 wide, vocabulary 8192, tied head:
105.5M parameters) with AdamW in fp32 and trains on its own small batch of random tokens:

* ``plain_ddp``: ``DistributedDataParallel(model, gradient_as_bucket_view=True)`` and AdamW,
  a hand-written loop (what a competent user writes without accelfn);
* ``plain_fsdp``: FSDP2 ``fully_shard`` on each block, then on the root, AdamW built on the
  sharded parameters, a hand-written loop;
* ``ddp``, ``fsdp``, ``hsdp`` (``replicate=2``: 2 replicas, each sharded over 2 processes)
  and ``fsdp_offload`` (``offload="cpu"``): ``af.distributed(...)(af.lift(lm_loss))``.

Per process, after the warm-up updates (the first one wraps the model and creates the
optimizer state): the peak resident memory over the timed updates (``VmHWM`` after resetting
it through ``/proc/self/clear_refs``), the lifetime peak (``getrusage``'s ``ru_maxrss``: it
includes building the whole model before sharding), the resident memory of a process that
has imported torch and joined the group but built nothing (subtracted to give what the
training holds), and the bytes of the tensors the update keeps (parameters, gradients and
optimizer state held by the process: what ``16N``, ``16N/W`` and ``16N*R/W`` predict).
Before the peak is reset, glibc's ``malloc_trim`` hands back the heap memory that building
the whole model left free (else the sharded sides would show it as resident). Step
time: each update starts after a barrier, its time is the slowest process', and the figure
is the median over the timed updates. On a CPU the "device" and the host are the same
memory: offloading moves nothing out of it (it adds copies).

    python benchmarks/scale_out.py [--out FILE] [--steps 3] [--warmup 1] [--tiny]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
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

from gpt2 import GPT, GPTConfig, lm_loss

import accelfn as af
from accelfn.observe.timing import environment

MODEL = GPTConfig(vocab=8192, seq=64, layers=14, dim=768, heads=12)
TINY = GPTConfig(vocab=256, seq=16, layers=2, dim=32, heads=2)
WORLD = 4
REPLICATE = 2
MIB = 2**20
# side -> (what runs, the docs' bytes per process for N parameters on W processes)
SIDES: dict[str, str] = {
    "plain_ddp": "DistributedDataParallel(model, gradient_as_bucket_view=True), hand-written",
    "ddp": 'af.distributed(strategy="ddp")',
    "plain_fsdp": "fully_shard per block and on the root, hand-written",
    "fsdp": 'af.distributed(strategy="fsdp")',
    "hsdp": f'af.distributed(strategy="hsdp", replicate={REPLICATE})',
    "fsdp_offload": 'af.distributed(strategy="fsdp", offload="cpu")',
}


def formula_bytes(side: str, n: int) -> tuple[str, float]:
    """The docs' memory per process (weights, gradients and AdamW state: 16 bytes each)."""
    if side in ("plain_ddp", "ddp"):
        return "16N", 16 * n
    if side == "hsdp":
        return "16N*R/W", 16 * n * REPLICATE / WORLD
    if side == "fsdp_offload":
        return "host: 16N/W (device: blocks in flight; on a CPU both are this memory)", \
            16 * n / WORLD
    return "16N/W", 16 * n / WORLD


# ---------------------------------------------------------------- one process of a launch


def _rss_peak_reset() -> bool:
    """Reset this process' peak resident memory (``VmHWM``) to its current value."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _trim_heap() -> bool:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``), so that
    what building the whole model left free in the allocator is not counted as resident."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) >= 0)
    except (OSError, AttributeError):
        return False


def _status_mib(key: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the storages of this process' parameters, gradients and optimizer state."""
    seen: dict[int, int] = {}
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()
                                                  if p.grad is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = _local(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def worker(side: str, cfg: GPTConfig, batch: int, warmup: int, steps: int, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gc.collect()
    base_mib = _status_mib("VmRSS")
    torch.manual_seed(0)
    model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    data = {"input": tokens[:, :-1], "target": tokens[:, 1:]}

    def adamw(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.1)

    if side.startswith("plain_"):
        if side == "plain_ddp":
            from torch.nn.parallel import DistributedDataParallel

            wrapped: nn.Module = DistributedDataParallel(model, gradient_as_bucket_view=True)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)  # in place: the model is now the root FSDP module
            wrapped = model
        optimizer = adamw(model)

        def one() -> None:
            lm_loss(wrapped, data).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        stack = SIDES[side]
    else:
        options: dict[str, Any] = {"strategy": "hsdp" if side == "hsdp" else side[:4]}
        if side == "hsdp":
            options["replicate"] = REPLICATE
        if side == "fsdp_offload":
            options["offload"] = "cpu"
        step = af.distributed(**options)(af.lift(lm_loss))
        optimizer = adamw(model)
        state = af.TrainState(model, optimizer)

        def one() -> None:
            step(state, data)

        stack = af.describe(step)
    measured: dict[str, int] = {}

    def after_update(opt: torch.optim.Optimizer, *_: Any) -> None:
        if counting:  # the gradients are still there: zero_grad comes after the step
            measured["state"] = state_bytes(model, opt)

    optimizer.register_step_post_hook(after_update)
    counting = True
    for _ in range(warmup):
        one()
    counting = False
    gc.collect()
    trimmed = _trim_heap()
    lifetime_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    reset = _rss_peak_reset()  # getrusage's peak follows the reset: read it before
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        one()
        times.append(time.perf_counter() - start)
    peak_steps = _status_mib("VmHWM") if reset else None
    if not side.startswith("plain_"):
        state.sync()
    mine = {"rank": rank, "step_s": times, "base_rss_mib": base_mib,
            "peak_rss_steps_mib": peak_steps, "heap_trimmed": trimmed,
            "ru_maxrss_mib": max(lifetime_mib, peak_steps or 0.0,
                                 resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "state_mib": measured["state"] / MIB if "state" in measured else None}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        out.write_text(json.dumps({"side": side, "stack": stack, "parameters": params,
                                   "world": world, "ranks": gathered}))
    dist.destroy_process_group()


# ---------------------------------------------------------------- the launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def launch(side: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    out = folder / f"{side}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", __file__,
           "--worker", side, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch-size", str(args.batch_size), "--result", str(out)]
    if args.tiny:
        cmd.append("--tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not out.exists():
        return {"side": side, "status": "error", "seconds": round(wall, 1),
                "reason": (proc.stdout[-1000:] + proc.stderr[-3000:]).strip()}
    r: dict[str, Any] = json.loads(out.read_text())
    ranks = r.pop("ranks")
    per_step = [max(rk["step_s"][i] for rk in ranks) for i in range(args.steps)]
    n = r["parameters"]
    name, formula = formula_bytes(side, n)

    def most(key: str) -> float | None:
        vals = [rk[key] for rk in ranks if rk[key] is not None]
        return round(max(vals), 1) if vals else None

    peak, base = most("peak_rss_steps_mib"), most("base_rss_mib")
    r.update(status="ok", seconds=round(wall, 1), what=SIDES[side],
             step_ms=statistics.median(per_step) * 1e3,
             step_ms_all=[round(t * 1e3, 1) for t in per_step],
             peak_rss_steps_mib=peak, ru_maxrss_mib=most("ru_maxrss_mib"),
             base_rss_mib=base, state_mib=most("state_mib"),
             training_mib=None if peak is None or base is None else round(peak - base, 1),
             formula=name, formula_mib=round(formula / MIB, 1),
             per_rank=ranks)
    return r


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = TINY if args.tiny else MODEL
    n = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"GPT: {n / 1e6:.1f}M parameters ({cfg.layers} blocks, {cfg.dim} wide, vocabulary "
          f"{cfg.vocab}, {cfg.seq} tokens x {args.batch_size} per process), {WORLD} processes",
          file=sys.stderr, flush=True)
    machine = environment(torch.device("cpu"))
    sides: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for side in args.sides:
            r = launch(side, args, Path(tmp))
            sides.append(r)
            print(f"  {side}: " + (f"{r['step_ms']:,.0f} ms/step, peak {r['peak_rss_steps_mib']}"
                                    f" MiB, state {r['state_mib']} MiB (formula "
                                    f"{r['formula_mib']}), {r['seconds']} s"
                                    if r["status"] == "ok" else f"error {r['reason'][-800:]}"),
                  file=sys.stderr, flush=True)
    machine["load_average_end"] = environment(torch.device("cpu")).get("load_average")
    ok = {s["side"]: s for s in sides if s["status"] == "ok"}
    ratios: dict[str, float] = {}
    if "ddp" in ok:
        for s in ok.values():
            ratios[f"{s['side']}/ddp"] = s["step_ms"] / ok["ddp"]["step_ms"]
    for kind in ("ddp", "fsdp"):
        if kind in ok and f"plain_{kind}" in ok:
            ratios[f"{kind}/plain_{kind}"] = ok[kind]["step_ms"] / ok[f"plain_{kind}"]["step_ms"]
    return {
        "benchmark": "scale_out",
        "command": "python benchmarks/scale_out.py " + " ".join(args.argv),
        "machine": machine,
        "model": {"vocab": cfg.vocab, "seq": cfg.seq, "layers": cfg.layers, "dim": cfg.dim,
                  "heads": cfg.heads, "parameters": n, "tied_head": True},
        "world": WORLD, "replicate": REPLICATE, "batch_size": args.batch_size,
        "steps": args.steps, "warmup": args.warmup, "optimizer": "AdamW, fp32",
        "sides": sides, "step_time_ratios": ratios,
        "notes": [
            "one fresh torchrun launch per side, in the order listed (not interleaved: a "
            "fresh process per side is what gives each its own peak); the load average is "
            "given at the start and the end",
            "peak_rss_steps_mib: the largest process' peak resident memory over the timed "
            "updates (VmHWM reset after the warm-up, once malloc_trim has handed the heap's "
            "free memory back to the system); base_rss_mib: a process with torch "
            "imported and the group joined, before the model; training_mib = peak - base",
            "ru_maxrss_mib: the lifetime peak, which includes building the whole model in "
            "every process before it is wrapped or sharded",
            "state_mib: storages of the process' parameters, gradients and AdamW state "
            "(DDP's gradient buckets included), against the docs' formula",
            "on a CPU the device and the host are the same memory: offload='cpu' moves "
            "nothing out of it and adds copies",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None,
                   help="write the JSON here (default: stdout)")
    p.add_argument("--steps", type=int, default=3, help="timed updates per side")
    p.add_argument("--warmup", type=int, default=1, help="untimed updates first (>= 1)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per process")
    p.add_argument("--sides", default=",".join(SIDES),
                   help=f"comma-separated, from {', '.join(SIDES)}")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-block, 32-wide toy (checks the code paths in seconds)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = [a for a in argv]
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown:
        p.error(f"unknown side(s) {unknown}: choose from {', '.join(SIDES)}")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the first update wraps the model)")
    if args.worker:
        worker(args.worker, TINY if args.tiny else MODEL, args.batch_size, args.warmup,
               args.steps, args.result)
        return 0
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 1 if any(s["status"] != "ok" for s in result["sides"]) else 0


if __name__ == "__main__":
    sys.exit(main())
