"""Asynchronous checkpoints: how long ``save(..., asynchronous=True)`` blocks the loop, against
the synchronous ``save``.

The state is a stack of ``Linear(4096, 4096)`` layers (6 of them: 100.7M parameters, 403 MB in
fp32) with SGD, on the CPU. Each round saves once synchronously and once asynchronously (the
order alternating), into one folder with ``keep=1``; the blocking time is how long the call
takes to return (the synchronous save returns once committed, the asynchronous one once the
state is staged in host memory). The asynchronous save is then waited for, outside the
timing, and its time to the commit is recorded too. One warm-up save of each kind first;
the figures are medians over rounds. Target: asynchronous blocking <= 0.25x synchronous.

    python benchmarks/checkpoint.py [--layers 6] [--width 4096] [--rounds 5] [--dir DIR]
                                    [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import accelfn as af
from accelfn import checkpointing

TARGET = 0.25


def make_state(layers: int, width: int) -> af.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def timed_sync(folder: Path, state: af.TrainState) -> float:
    state.step += 1
    start = time.perf_counter()
    checkpointing.save(folder, state, keep=1)
    return time.perf_counter() - start


def timed_async(folder: Path, state: af.TrainState) -> tuple[float, float]:
    """(blocking time, time from the call to the commit)."""
    state.step += 1
    start = time.perf_counter()
    handle = checkpointing.save(folder, state, keep=1, asynchronous=True)
    blocking = time.perf_counter() - start
    handle.wait()
    return blocking, time.perf_counter() - start


def measure(folder: Path, layers: int, width: int, rounds: int) -> dict[str, Any]:
    state = make_state(layers, width)
    params = sum(p.numel() for p in state.model.parameters())
    timed_sync(folder, state)  # warm-up: page cache, allocator, imports
    timed_async(folder, state)
    sync: list[float] = []
    blocking: list[float] = []
    commit: list[float] = []
    for r in range(rounds):
        order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
        for kind in order:
            if kind == "sync":
                sync.append(timed_sync(folder, state))
            else:
                b, c = timed_async(folder, state)
                blocking.append(b)
                commit.append(c)
    ratio = statistics.median(blocking) / statistics.median(sync)
    return {
        "parameters": params,
        "bytes": sum(p.numel() * p.element_size() for p in state.model.parameters()),
        "model": f"{layers} x Linear({width}, {width}), SGD, fp32, CPU",
        "rounds": rounds,
        "sync_blocking_s": round(statistics.median(sync), 4),
        "async_blocking_s": round(statistics.median(blocking), 4),
        "async_time_to_commit_s": round(statistics.median(commit), 4),
        "ratio": round(ratio, 4),
        "target": TARGET,
        "meets_target": ratio <= TARGET,
        "sync_s_each": [round(x, 4) for x in sync],
        "async_blocking_s_each": [round(x, 4) for x in blocking],
        "async_time_to_commit_s_each": [round(x, 4) for x in commit],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write the checkpoints (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = measure(Path(tmp) / "run", args.layers, args.width, args.rounds)
    full = {
        "benchmark": "checkpoint",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   "CPU only",
        "load_average": {"before": [round(v, 2) for v in load_before],
                         "after": [round(v, 2) for v in os.getloadavg()]},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": "python benchmarks/checkpoint.py "
                   f"--layers {args.layers} --width {args.width} --rounds {args.rounds}",
        "timing": "wall time of the save() call (blocking); the asynchronous save is waited "
                  "for outside the timing; medians over rounds alternating the order",
        **result,
    }
    text = json.dumps(full, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
