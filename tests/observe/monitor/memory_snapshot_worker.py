"""Run under torchrun by tests/observe/monitor/test_monitor_memory.py: every rank runs out of memory
at its second update under ``Monitor(memory_snapshot=OUT/oom.json)``; each saves the notes
its error got (``OUT/notes<rank>.txt``)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import accelfn as af
from accelfn.observe.monitor import Monitor

FITS = 4  # samples a micro-batch may hold


def fitting_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    if batch["x"].shape[0] > FITS:
        raise torch.OutOfMemoryError("out of memory (test)")
    return F.cross_entropy(model(batch["x"]), batch["y"])


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.lift(fitting_loss)
    mon = Monitor(memory_snapshot=os.path.join(out, "oom.json"), progress=False,
                  sync_check=None, device="cpu")
    try:
        with mon:
            for n in (FITS, FITS + 1 + rank):
                batch = {"x": torch.randn(n, 8), "y": torch.randint(0, 2, (n,))}
                mon.step(step(state, batch))
    except torch.OutOfMemoryError as error:
        with open(os.path.join(out, f"notes{rank}.txt"), "w", encoding="utf-8") as file:
            file.write("\n".join(error.__notes__))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
