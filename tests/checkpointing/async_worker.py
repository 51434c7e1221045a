"""Processes that save asynchronously, for test_async.py.

    python async_worker.py kill RUN OUT whole|sharded|unpaused
        a large state (34M parameters, 134 MB): a synchronous save at step 1 (its parameter
        digests in OUT/committed.json), one more update, then save(asynchronous=True); prints
        "returned <done>" once save() returned. whole/sharded: the background write of state.pt
        stops half-way and prints "writing" (the test SIGKILLs the process then); unpaused:
        nothing stops it, the test SIGKILLs the process as soon as save() returned
    torchrun --nproc_per_node=2 async_worker.py dist RUN OUT
        DDP and FSDP2 (gloo): train, save(asynchronous=True), keep training (the loop's
        all-reduces run while the background thread talks over its own group), wait; the
        parameters at the save and those loaded back go to OUT
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import torch
from torch import nn

import accelfn as af
from accelfn import checkpointing
from accelfn.checkpointing import files, format

WORKER = Path(__file__).resolve()
WIDTH, DEPTH = 2048, 8  # 8 x 4.2M = 34M parameters, 134 MB


def big_state() -> af.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def digests(model: nn.Module) -> dict[str, str]:
    return {name: hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()
            for name, t in model.state_dict().items()}


def update(state: af.TrainState) -> None:
    """One update that changes every parameter (no step function needed for this)."""
    with torch.no_grad():
        for p in state.model.parameters():
            p.mul_(0.5).add_(1.0)
    state.step += 1


def say(line: str) -> None:
    """One whole line in one write: the main thread and the background write both speak."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def stop_half_way_through_state_pt() -> None:
    real = files.write_bytes

    def write_bytes(path: Path, data: bytes) -> None:
        if path.name == format.STATE_FILE and path.parent.name.startswith(format.TMP_PREFIX):
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            say("writing")
            time.sleep(600)
        real(path, data)

    files.write_bytes = write_bytes


def kill(run: Path, out: Path, how: str) -> None:
    state = big_state()
    sharded = how == "sharded"
    update(state)
    checkpointing.save(run, state, sharded=sharded)
    (out / "committed.json").write_text(json.dumps(digests(state.model)))
    update(state)
    if how != "unpaused":
        stop_half_way_through_state_pt()
    handle = checkpointing.save(run, state, sharded=sharded, asynchronous=True)
    say(f"returned {handle.done()}")
    time.sleep(600)


def dist_main(run: Path, out: Path) -> None:
    import resume_worker as rw
    import torch.distributed as dist

    af.init_distributed()
    rank = dist.get_rank()
    result: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        state, loader, step = rw.build(strategy)
        it = rw.batches(loader)
        rw.train(state, it, step, 2, [], 10)
        at_save = rw.full_params(state.model)  # collective under FSDP: on every rank
        handle = checkpointing.save(run / strategy, state, loader=loader, step=step,
                                    asynchronous=True)
        rw.train(state, it, step, 6, [], 10)  # DDP/FSDP collectives while it writes
        path = handle.wait()
        after = rw.full_params(state.model)
        again = checkpointing.save(run / strategy, state, loader=loader, step=step,
                                   asynchronous=True)
        fresh, fresh_loader, fresh_step = rw.build(strategy)
        info = checkpointing.load(run / strategy, fresh, loader=fresh_loader, step=fresh_step)
        loaded_latest = rw.full_params(fresh.model)
        checkpointing.load(path, fresh, loader=fresh_loader, step=fresh_step)
        result[strategy] = {"at_save": at_save, "loaded": rw.full_params(fresh.model),
                            "after": after, "loaded_latest": loaded_latest,
                            "latest_step": info.step, "again": str(again.wait()),
                            "sharded": info.sharded}
    torch.save(result, out / f"dist-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, run_dir, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    if mode == "kill":
        kill(run_dir, out_dir, sys.argv[4])
    elif mode == "dist":
        dist_main(run_dir, out_dir)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
