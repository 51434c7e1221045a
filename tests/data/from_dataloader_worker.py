"""Run under torchrun (2 gloo processes) by tests/data/test_from_dataloader.py.

Each rank wraps stock DataLoaders over the samples ``0 .. n-1`` with ``from_dataloader`` and
records which samples it read, epoch by epoch: one built before the process group is set up
(its share comes from torchrun's environment), one after (from the group), a sequential one,
one over a dataset that does not divide evenly, and a ``StatefulDataLoader`` whose position,
taken mid-epoch, resumes in a new adapter; then DDP trains on a sharded DataLoader. Saves
``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
if TESTS not in sys.path:  # under torchrun: conftest sits in tests/
    sys.path.insert(0, TESTS)

from helpers import roundtrip, save_rank_results  # noqa: E402

import accelfn.data as ad  # noqa: E402

EPOCHS = 3
BATCH = 4


def samples(n: int) -> TensorDataset:
    """Sample ``i`` is ``(i, 10 * i)``: a batch's ``x`` names the samples it holds."""
    return TensorDataset(torch.arange(n), 10 * torch.arange(n))


def read(train: ad.DataLoaderAdapter, epochs: int = EPOCHS) -> list[list[int]]:
    return [torch.cat([b["x"] for b in train]).tolist() for _ in range(epochs)]


def resume(n: int) -> dict[str, list[int]]:
    """An epoch, then 2 batches of the next, a position; the rest read by a new adapter."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def build() -> ad.DataLoaderAdapter:
        return ad.from_dataloader(StatefulDataLoader(samples(n), batch_size=BATCH,
                                                     shuffle=True), keys=("x", "y"))

    train = build()
    first = torch.cat([b["x"] for b in train]).tolist()
    it = iter(train)
    head = [next(it)["x"] for _ in range(2)]
    position = roundtrip(train.state_dict())
    tail = torch.cat([b["x"] for b in it]).tolist()
    following = torch.cat([b["x"] for b in train]).tolist()
    again = build()
    again.load_state_dict(position)
    resumed = torch.cat([b["x"] for b in again]).tolist()
    resumed_following = torch.cat([b["x"] for b in again]).tolist()
    return {"first": first, "head": torch.cat(head).tolist(), "tail": tail,
            "following": following, "resumed": resumed,
            "resumed_following": resumed_following}


def regression(model, batch):
    """A tiny regression on the numbered samples (plain PyTorch: the test's reference uses it)."""
    x = batch["x"].float().unsqueeze(1) / 24
    return (model(x) - batch["y"].float().unsqueeze(1) / 240).pow(2).mean()


def trained(epochs: int = 2) -> dict[str, torch.Tensor]:
    """DDP fed by a sharded DataLoader: ``epochs`` epochs of updates, the final weights."""
    import accelfn as af

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = af.distributed(regression)
    train = ad.from_dataloader(DataLoader(samples(24), batch_size=BATCH, shuffle=True),
                               keys=("x", "y"))
    for _ in range(epochs):
        for batch in train:
            step(state, batch)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def worker(out_dir: str) -> None:
    # built before the process group exists: torchrun's RANK / WORLD_SIZE say the share
    early = ad.from_dataloader(DataLoader(samples(24), batch_size=BATCH, shuffle=True),
                               keys=("x", "y"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = {
        "early": read(early),
        "shuffled": read(ad.from_dataloader(
            DataLoader(samples(24), batch_size=BATCH, shuffle=True), keys=("x", "y"))),
        "seeded": read(ad.from_dataloader(
            DataLoader(samples(24), batch_size=BATCH, shuffle=True), keys=("x", "y"),
            seed=3)),
        "sequential": read(ad.from_dataloader(
            DataLoader(samples(24), batch_size=BATCH), keys=("x", "y"))),
        "uneven": read(ad.from_dataloader(
            DataLoader(samples(23), batch_size=BATCH, shuffle=True), keys=("x", "y"))),
        "unsharded": read(ad.from_dataloader(
            DataLoader(samples(24), batch_size=BATCH), keys=("x", "y"), shard=False), 1),
        "resume": resume(22),
        "trained": trained(),
    }
    save_rank_results(out_dir, results)


if __name__ == "__main__":
    worker(sys.argv[1])
