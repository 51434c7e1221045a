"""What ``distributed(fault_tolerance=...)`` adds to an update, one replica group of one process.

A torchft lighthouse is started in this process (torchft's defaults: ``min_replicas=1``, a
100 ms quorum tick); the same small MLP (two blocks of width 64, batches of 32, SGD) is
trained, one state each kept across rounds, by ``af.distributed(my_step)`` (plain: a no-op
in one process) and by ``af.distributed(fault_tolerance=af.FaultTolerance(...))(my_step)``
(DDP over a one-process group, a quorum at the lighthouse, the gradient exchange through
torchft's gloo group of one member, the commit vote). The sides alternate in rounds (plain,
then fault tolerant, then the other way round), so load on the machine falls on both alike;
each figure is the median over rounds of a round's mean per update after warm-up. The ratio
is ``fault_tolerant / plain``: the fixed cost of the quorum and commit round trips on a
model too small to hide them.

    python benchmarks/fault_tolerance.py [--out FILE] [--rounds 4] [--updates 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

import accelfn as af


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                 nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def _state() -> af.TrainState:
    torch.manual_seed(0)
    model = _MLP()
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01))


def _per_update(step: af.Step, state: af.TrainState, updates: int) -> float:
    batch = TensorDict({"x": torch.randn(32, 16), "y": torch.randint(0, 4, (32,))},
                       batch_size=[32])
    for _ in range(5):
        step(state, batch)
    start = time.perf_counter()
    for _ in range(updates):
        step(state, batch)
    return (time.perf_counter() - start) / updates * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--updates", type=int, default=50)
    args = parser.parse_args()
    from torchft.coordination import LighthouseServer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    sides = {"plain": af.distributed(_loss),
             "fault_tolerant": af.distributed(fault_tolerance=af.FaultTolerance(
                 lighthouse=lighthouse.address()))(_loss)}
    states = {name: _state() for name in sides}  # one fault-tolerant state per process
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            times[name].append(_per_update(sides[name], states[name], args.updates))
    ms = {name: statistics.median(values) for name, values in times.items()}
    result = {"benchmark": "fault_tolerance", "device": "cpu",
              "threads": torch.get_num_threads(), "plain_ms": round(ms["plain"], 3),
              "fault_tolerant_ms": round(ms["fault_tolerant"], 3),
              "ratio": round(ms["fault_tolerant"] / ms["plain"], 2),
              "rounds": args.rounds, "updates": args.updates}
    text = json.dumps(result)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.stdout.flush()
    os._exit(0)  # torchft's manager and lighthouse threads need no orderly shutdown here


if __name__ == "__main__":
    main()
