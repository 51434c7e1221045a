"""The loss over real tokens of packed rows, weighted by tokens across micro-batches.

A step returning ``{"loss": token mean, "weight": real tokens}`` on packed rows (the last
ones padded at the end of the data) and accumulated over uneven micro-batches updates the
model as one pass over the whole batch's real tokens does, by hand; the plain mean of the
micro-batches' means does not. The token mean and count come from ``F.cross_entropy`` or
from ``af.linear_cross_entropy(..., return_count=True)`` (no logits in memory). (Across
ranks: tests/data/test_token_batches.py's two-process test.)
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from token_loader_worker import TinyLM, lm_loss

import accelfn as af
import accelfn.data as ad


def padded_rows(tmp_path, rows: int = 7):
    rng = np.random.default_rng(3)
    stream = np.concatenate([np.append(rng.integers(0, 999, size=int(rng.integers(1, 50))), 999)
                             for _ in range(40)])
    path = ad.write_tokens(tmp_path / "a.bin", stream)
    batches = list(ad.token_loader(path, batch_size=1, seq_len=32, packing="best-fit", eot=999,
                                   drop_last=False, shuffle=False))
    batch = torch.cat(batches[-rows:])
    counts = (batch["targets"] != -100).sum(1)
    assert counts[-1] < 32 and (counts[:-1] == 32).all()  # padding only at the end of the data
    return batch


def by_hand(model, batch, *, micro_means: list | None = None) -> None:
    """One SGD update, plain PyTorch: the cross-entropy summed over real targets / their count
    (or, with ``micro_means``, the mean of those micro-batches' own means)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if micro_means is None:
        logits = model(batch["inputs"], batch["document_ids"], batch["positions"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    else:
        loss = sum(lm_loss(model, batch[part])["loss"] for part in micro_means) / len(micro_means)
    loss.backward()
    optimizer.step()


def linear_loss(model, batch):
    """The token mean by ``af.linear_cross_entropy`` (the head's weight, no logits), its count
    as the weight."""
    hidden = model.features(batch["inputs"], batch["document_ids"], batch["positions"])
    loss, count = af.linear_cross_entropy(hidden, model.head.weight, batch["targets"],
                                          return_count=True)
    return {"loss": loss, "weight": count}


@pytest.mark.parametrize("loss_fn", [lm_loss, linear_loss], ids=["cross_entropy", "linear"])
def test_accumulation_over_packed_rows_weighs_by_real_tokens(tmp_path, loss_fn):
    batch = padded_rows(tmp_path)
    torch.manual_seed(0)
    model = TinyLM(bias=loss_fn is lm_loss)  # linear_cross_entropy takes a head without bias
    reference, unweighted, initial = (copy.deepcopy(model) for _ in range(3))
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = af.with_accumulation(3)(loss_fn)  # 7 rows: micro-batches of 3, 2 and 2 rows
    metrics = step(state, batch)
    by_hand(reference, batch)  # F.cross_entropy's mean skips the -100 targets
    by_hand(unweighted, batch, micro_means=[slice(0, 3), slice(3, 5), slice(5, 7)])
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(model.head.weight, unweighted.head.weight, atol=1e-6)
    with torch.no_grad():  # the loss metric is the whole batch's token mean too
        torch.testing.assert_close(metrics["loss"], lm_loss(initial, batch)["loss"], rtol=1e-6,
                                   atol=1e-6)
