"""Run under torchrun (2 gloo processes) by tests/data/test_token_batches.py.

Each rank builds token loaders without ``rank=`` / ``world_size=`` (so they come from
torch.distributed), reads an epoch of windows and of best-fit packed rows, resumes a position
taken after 3 batches, and makes one DDP update with accumulation on its last packed batch
(rows padded at the end of the data). Also imported by the tests for the shared pieces.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import accelfn as af
import accelfn.data as ad

EOT = 999
VOCAB = 1000


def corpus_path(folder) -> str:
    """The test corpus in ``folder`` (written once, by the test, before the launch)."""
    path = os.path.join(str(folder), "corpus.bin")
    if not os.path.exists(path):
        rng = np.random.default_rng(7)
        docs = [np.append(rng.integers(0, EOT, size=int(rng.integers(1, 50))), EOT)
                for _ in range(165)]  # 143 rows: a final round of 7 rows of 8
        ad.write_tokens(path, np.concatenate(docs))
    return path


def make_loader(path, packing: str, *, rank=None, world_size=None, batch_size: int = 4,
                drop_last: bool = True) -> ad.BatchLoader:
    extra = {"eot": EOT} if packing != "windows" else {}
    return ad.token_loader(path, batch_size=batch_size, seq_len=32, packing=packing, seed=5,
                           rank=rank, world_size=world_size, drop_last=drop_last, **extra)


class TinyLM(nn.Module):
    """Embeddings, one attention layer masked by documents, a head."""

    def __init__(self, dim: int = 16, bias: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(64, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, VOCAB, bias=bias)

    def features(self, ids, document_ids, positions):
        """The inputs of the head."""
        h = self.embed(ids) + self.pos(positions)
        q, k, v = self.qkv(h).unsqueeze(1).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v,
                                           attn_mask=ad.document_causal_mask(document_ids))
        return h + y.squeeze(1)

    def forward(self, ids, document_ids, positions):
        return self.head(self.features(ids, document_ids, positions))


def lm_loss(model, batch):
    """The mean cross-entropy over real targets; their count is the weight."""
    logits = model(batch["inputs"], batch["document_ids"], batch["positions"])
    targets = batch["targets"]
    count = (targets != -100).sum()
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
    return {"loss": total / count.clamp(min=1), "weight": count}


def last_batch(path, **kw):
    batches = list(make_loader(path, "best-fit", drop_last=False, **kw))
    return batches[-1]


def reference_update(path, *, by_rank: bool = False) -> dict:
    """One SGD update, by hand, on the whole final round of packed rows: the token mean (or,
    ``by_rank``, the mean of the two ranks' token means: what weighting by tokens avoids)."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = last_batch(path, rank=0, world_size=1, batch_size=8)
    if by_rank:
        loss = sum(lm_loss(model, batch[r::2])["loss"] for r in range(2)) / 2
    else:
        loss = lm_loss(model, batch)["loss"]
    loss.backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def main(out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    af.init_distributed()
    rank = dist.get_rank()
    path = corpus_path(out)
    result: dict = {"rank": rank, "world_size": af.world_size()}
    for packing in ("windows", "best-fit"):
        loader = make_loader(path, packing)
        result[packing] = [{k: v.clone() for k, v in b.items()} for b in loader]
        first = make_loader(path, packing)
        it = iter(first)
        for _ in range(3):
            next(it)
        state = first.state_dict()
        first.close()
        resumed = make_loader(path, packing)
        resumed.load_state_dict(state)
        result[packing + "_resumed"] = [{k: v.clone() for k, v in b.items()} for b in resumed]
        loader.close()
        resumed.close()
    torch.manual_seed(0)
    model = TinyLM()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.distributed(af.with_accumulation(2)(lm_loss))
    step(state, last_batch(path, batch_size=4))  # this rank's rows of the final round
    result["params"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
