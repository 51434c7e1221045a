"""A tiny training run under ``python -m accelfn.cli.launch`` (torchrun), for
test_preemption_torchrun.py.

    python -m accelfn.cli.launch --nproc_per_node=2 preempt_launch_worker.py MODE OUT

MODE ``wait``: train until a preemption signal, then checkpoint into OUT/run and exit 75
(each rank writes OUT/pid-<rank> and, after its third step, OUT/ready-<rank>). ``finish``:
train 4 steps and return. ``crash``: rank 1 raises at its fourth step while rank 0 waits
for a signal.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

import accelfn as af
from accelfn.checkpointing import PreemptionGuard


def loss_fn(model: nn.Module, batch: TensorDict) -> dict[str, torch.Tensor]:
    return {"loss": F.mse_loss(model(batch["x"]), batch["y"])}


def main(mode: str, out: Path) -> None:
    af.init_distributed()
    rank = torch.distributed.get_rank()
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.01))
    step = af.distributed(af.lift(loss_fn))
    batch = TensorDict({"x": torch.randn(8, 4), "y": torch.randn(8, 1)}, batch_size=[8])
    deadline = time.monotonic() + 120  # never wait for ever
    with PreemptionGuard(check_every=1) as guard:
        for i in range(100_000):
            step(state, batch)
            if i == 2:
                (out / f"ready-{rank}").write_text("")
            if mode == "finish" and i == 3:
                break
            if mode == "crash" and rank == 1 and i == 3:
                raise RuntimeError("rank 1 crashed")
            guard.exit_if_requested(out / "run", state)
            if time.monotonic() > deadline:
                raise TimeoutError("no signal came")
            time.sleep(0.05)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
