"""Run folders under torchrun with 2 gloo processes, for test_run_folder.py.

    torchrun --nproc_per_node=2 run_folder_worker.py ROOT

Both processes open a new run folder under ROOT (they must get the same one), train a few
DDP updates with a plan that depends on the number of processes (as a schedule over
``epochs * len(loader)`` does), save there, and both see the same refusal when a second run
asks for that folder without --resume or --overwrite. What each rank saw goes to
``ROOT/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from helpers import Net, classify, make_batch, save_rank_results

import accelfn as af
from accelfn.checkpointing.runs import RunFolder, RunFolderError

SAMPLES = 24
STEPS = 2


def planned_updates(world: int) -> int:
    """Updates of one epoch of SAMPLES in batches of 4 per process."""
    return SAMPLES // (4 * world)


def main(root: Path) -> None:
    af.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    run = RunFolder("tiny", root=root)
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.distributed(classify)
    assert run.resume(state, step=step, plan={"total_steps": planned_updates(world)}) is None
    batch = make_batch(SAMPLES, seed=1)
    for i in range(STEPS):
        step(state, batch[4 * (world * i + rank): 4 * (world * i + rank + 1)])
    saved = run.save(state, step=step)
    try:
        RunFolder("tiny", out=run.path, root=root)
        refused = ""
    except RunFolderError as error:
        refused = str(error)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_rank_results(root, {"path": str(run.path), "saved": str(saved), "refused": refused,
                             "weights": weights})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
