"""A tiny complete run under torchrun, for test_exit_clean.py: DDP (gloo) steps over a
prefetching loader, a checkpoint, the loader closed and the process group destroyed, then
the interpreter exits.

    torchrun --nproc_per_node=2 exit_clean_worker.py OUT
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

import accelfn as af
from accelfn import checkpointing, data


def loss_fn(model: nn.Module, batch: TensorDict) -> dict[str, torch.Tensor]:
    return {"loss": F.cross_entropy(model(batch["x"]), batch["y"])}


def main(out: str) -> None:
    device = af.init_distributed()
    torch.manual_seed(0)
    samples = TensorDict({"x": torch.randn(64, 8), "y": torch.randint(0, 3, (64,))}, [64])
    train = data.loader(samples, batch_size=8, device=device, prefetch=2)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3)).to(device)
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    step = af.distributed(af.with_accumulation(2)(loss_fn))
    for _ in range(2):
        for batch in train:
            step(state, batch)
    checkpointing.save(out, state, step=step, keep=1)
    train.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
