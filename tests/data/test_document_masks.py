"""Document masks: attention over a packed row equals attention over each document alone.

fp32, within 1e-6: with ``scaled_dot_product_attention`` and the boolean mask, with
``flex_attention`` and the block mask (eager), and a small model under ``accelfn.compiled``
(its compiled forward, position by position, against each document run alone, eagerly).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from document_pieces import segments
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

import accelfn as af
import accelfn.data as ad
from accelfn.core import compat

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def packed_batch(tmp_path, seq_len: int = 40, rows: int = 3):
    """Rows from the best-fit packer, the last ones padded (drop_last=False)."""
    rng = np.random.default_rng(0)
    stream = np.concatenate([np.append(rng.integers(0, 50, size=int(rng.integers(1, 30))), 99)
                             for _ in range(12)])
    path = ad.write_tokens(tmp_path / "m.bin", stream)
    batches = list(ad.token_loader(path, batch_size=1, seq_len=seq_len,
                                   packing="best-fit", eot=99, drop_last=False,
                                   shuffle=False))
    batch = torch.cat(batches[-rows:])  # the last row holds the end of the data, padded
    assert (batch["document_ids"] == -1).any() and (batch["document_ids"].amax(1) > 0).any()
    return batch


def qkv(batch, heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(1)
    shape = (batch.shape[0], heads, batch["inputs"].shape[1], dim)
    return [torch.randn(shape, generator=g) for _ in range(3)]


def alone(q, k, v, document_ids):
    """Each document's causal attention on its own, written back in place."""
    out = torch.zeros_like(q)
    for r, a, b in segments(document_ids):
        out[r, :, a:b] = F.scaled_dot_product_attention(q[r:r + 1, :, a:b], k[r:r + 1, :, a:b],
                                                        v[r:r + 1, :, a:b], is_causal=True)[0]
    return out


def real(document_ids):
    return (document_ids >= 0)[:, None, :, None]


def test_sdpa_with_the_boolean_mask_equals_each_document_alone(tmp_path):
    batch = packed_batch(tmp_path)
    ids = batch["document_ids"]
    q, k, v = qkv(batch)
    mask = ad.document_causal_mask(ids)
    assert mask.shape == (3, 1, 40, 40) and mask.dtype == torch.bool
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected = alone(q, k, v, ids)
    torch.testing.assert_close(out * real(ids), expected, rtol=0, atol=1e-6)
    assert out.isfinite().all()  # padding attends to itself: no empty row, no NaN
    unmasked = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (unmasked - expected).abs().amax() > 1e-2  # without the mask documents mix


def test_flex_attention_with_the_block_mask_equals_each_document_alone(tmp_path):
    batch = packed_batch(tmp_path)
    ids = batch["document_ids"]
    q, k, v = qkv(batch)
    block_mask = ad.document_block_mask(ids, block_size=16)
    out = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(out * real(ids), alone(q, k, v, ids), rtol=0, atol=1e-6)


def test_masks_refuse_other_shapes():
    with pytest.raises(ValueError, match="batch, seq_len"):
        ad.document_causal_mask(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, seq_len"):
        ad.document_block_mask(torch.zeros(1, 2, 3, dtype=torch.long))


class FlexLM(nn.Module):
    """Embeddings with positions that restart per document, one flex-attention layer."""

    def __init__(self, vocab: int = 100, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, document_ids, positions):
        b, t = ids.shape
        h = self.embed(ids) + self.pos(positions)
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = flex_attention(q, k, v, block_mask=ad.document_block_mask(document_ids,
                                                                       block_size=16))
        return self.head(h + y.transpose(1, 2).reshape(b, t, -1))


def lm_loss(model, batch):
    logits = model(batch["inputs"], batch["document_ids"], batch["positions"])
    count = (batch["targets"] != -100).sum()
    total = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="sum")
    return {"loss": total / count, "weight": count}


@pytest.mark.compile
def test_under_accelfn_compiled_each_document_is_computed_alone(tmp_path):
    batch = packed_batch(tmp_path)
    torch.manual_seed(0)
    model = FlexLM()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.0))
    step = af.compiled(lm_loss)
    compiled_model = step.prepare(state).model
    assert compiled_model is model and compat.is_compiled(model)  # compiled in place
    with torch.no_grad():
        out = compiled_model(batch["inputs"], batch["document_ids"], batch["positions"])
        for r, a, b in segments(batch["document_ids"]):
            one = model.forward(  # the document on its own, eager (its forward, not its call)
                batch["inputs"][r:r + 1, a:b], torch.zeros(1, b - a, dtype=torch.long),
                torch.arange(b - a)[None])
            torch.testing.assert_close(out[r:r + 1, a:b], one, rtol=0, atol=1e-6)
    # the step's own forward, compiled (torch 2.14 has no flex-attention backward on the CPU:
    # training with it needs a GPU; on the CPU train with document_causal_mask)
    metrics = step.evaluate(state, batch)
    with torch.no_grad():
        torch.testing.assert_close(metrics["loss"], lm_loss(model, batch)["loss"], rtol=0,
                                   atol=1e-6)
