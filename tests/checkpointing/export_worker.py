"""Exports from 2 gloo processes, for test_exporting.py.

    torchrun --nproc_per_node=2 export_worker.py OUT

A small language model whose output layer is tied to its embedding, with BatchNorm buffers,
trained a few updates under FSDP2 (``distributed(strategy="fsdp")``, a ``fully_shard`` per
block and on the root), HSDP (FSDP2 over a 2-D mesh) and DDP, each with ``with_ema``; then
exported (weights, EMA, bfloat16). Rank 0 keeps what the shards hold, gathered another way
(``DTensor.full_tensor``, the EMA slot's own tensors), as the reference the files are
compared with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from helpers import save_rank_results

import accelfn as af
from accelfn.checkpointing.exporting import export

VOCAB, DIM, STEPS, BATCH = 16, 8, 3, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm = nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.up(x)))


class TiedLM(nn.Module):
    """Embedding -> blocks -> output layer sharing the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(h)
        return logits


def lm_loss(model: nn.Module, batch: TensorDict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def data() -> TensorDict:
    """Every update's global batch: STEPS x (2 ranks x BATCH) samples."""
    g = torch.Generator().manual_seed(7)
    n = STEPS * 2 * BATCH
    return TensorDict({"x": torch.randint(0, VOCAB, (n,), generator=g),
                       "y": torch.randint(0, VOCAB, (n,), generator=g)}, batch_size=[n])


def full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def run(strategy: str, out: Path, rank: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = TiedLM()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # the default buffers="average": under FSDP2 the (unsharded) BatchNorm buffers are
    # averaged beside the sharded parameters (a foreach call each)
    options = {"strategy": "hsdp", "replicate": 1} if strategy == "hsdp" else \
        {"strategy": strategy}  # HSDP: a 2-D mesh (1 copy, sharded over 2 processes)
    step = af.with_ema(decay=0.5)(af.distributed(**options)(lm_loss))
    batches = data()
    for i in range(STEPS):
        start = (2 * i + rank) * BATCH
        step(state, batches[start: start + BATCH])
    plain = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    weights = {k: full(v) for k, v in plain.state_dict(keep_vars=True).items()}
    slot = state.slots["with_ema"]
    names = [n.removeprefix("module.") for n in [*slot.names, *slot.buffer_names]]
    averaged = dict(zip(names, map(full, slot.values)))
    averaged["head.weight"] = averaged["embed.weight"]  # tied: one average
    before = [full(p) for p in state.model.parameters()]
    files = {"weights": export(out / f"{strategy}", state),
             "ema": export(out / f"{strategy}-ema", state, ema=True),
             "bf16": export(out / f"{strategy}-bf16", state, dtype=torch.bfloat16)}
    untouched = all(torch.equal(a, full(p)) for a, p in zip(before, state.model.parameters()))
    return {"files": {k: str(v) for k, v in files.items()}, "weights": weights,
            "ema": {k: averaged.get(k, v) for k, v in weights.items()}, "untouched": untouched,
            "sharded": hasattr(next(iter(state.model.parameters())), "full_tensor")}


def main(out: Path) -> None:
    af.init_distributed()
    rank = dist.get_rank()
    results = {strategy: run(strategy, out, rank) for strategy in ("fsdp", "hsdp", "ddp")}
    save_rank_results(out, results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
