"""examples/gpt.py: its model on packed rows equals each document alone; one validation set.

The reference runs each document of a packed row alone, as a row of its own from position 0
with plain causal attention, and takes its cross-entropy with ``F.cross_entropy``: the
example's model with the document mask, restarting positions and the loss over real targets
(``af.linear_cross_entropy`` in its ``forward``) gives the same logits, loss and gradients in
fp32. The validation loss is measured on every held-out document whatever the batch size and
the packing, so that runs of both layouts are compared on the same targets.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from document_pieces import segments
from example_modules import load_example

import accelfn.data as ad

gpt = load_example("gpt")
SEQ = 48


def packed_batch(tmp_path):
    """Two rows the best-fit packer fills with several documents each (ids < 256, EOT)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=int(n)) for n in rng.integers(3, 30, size=12)]
    stream = np.concatenate([np.append(d, gpt.EOT) for d in docs])
    path = ad.write_tokens(tmp_path / "docs.bin", stream, dtype="uint16")
    loader = ad.token_loader(path, batch_size=2, seq_len=SEQ, packing="best-fit", eot=gpt.EOT,
                             shuffle=False)
    batch = next(iter(loader))
    loader.close()
    assert (batch["document_ids"].amax(1) >= 2).all()  # several documents a row
    return batch


def test_the_model_on_packed_rows_equals_each_document_alone(tmp_path):
    batch = packed_batch(tmp_path)
    torch.manual_seed(0)
    model = gpt.GPT(dim=32, depth=2, seq_len=SEQ, attention="documents")
    model.eval()  # no dropout anyway; fp32 throughout
    logits = model(batch["inputs"], batch["document_ids"], batch["positions"])
    loss, count = model(batch["inputs"], batch["document_ids"], batch["positions"],
                        targets=batch["targets"])
    loss.mul(count).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # the reference: each document alone, positions from 0, plain causal attention
    model.attention = "causal"
    total = torch.zeros(())
    tokens = 0
    for r, a, b in segments(batch["document_ids"]):
        ids = batch["inputs"][r:r + 1, a:b]
        assert torch.equal(batch["positions"][r, a:b], torch.arange(b - a))
        alone = model(ids)  # positions 0.. and is_causal=True
        torch.testing.assert_close(logits[r:r + 1, a:b], alone, rtol=0, atol=1e-5)
        total = total + F.cross_entropy(alone[0], batch["targets"][r, a:b], reduction="sum")
        tokens += b - a
    assert int(count) == tokens == int((batch["targets"] != -100).sum())
    torch.testing.assert_close(loss, total / tokens, rtol=1e-6, atol=1e-6)
    total.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_validation_rows_are_every_held_out_document_whatever_the_batch(tmp_path):
    """Runs with other batch sizes and layouts are measured on the same targets: every
    held-out byte of every held-out document (its end-of-text id included)."""
    common = ["--text-bytes", "30000", "--seq-len", "32", "--dim", "32", "--depth", "2",
              "--steps", "1", "--quiet"]
    _, held_out = gpt.split(gpt.stdlib_text(30000))
    expected = sum(len(d) for d in held_out)  # each document's pairs: its bytes, then EOT
    reports = [gpt.main([*common, "--batch-size", str(b), "--packing", packing,
                         "--out", str(tmp_path / f"{packing}-{b}")])
               for b, packing in ((4, "pad"), (8, "best-fit"))]
    assert [r["val_tokens"] for r in reports] == [expected, expected]


def test_the_validation_loss_in_chunks_is_the_mean_over_every_real_target(monkeypatch):
    """Chunks of uneven real-target counts (the last one short), each weighted by its targets:
    the mean over all real targets at once, as ``F.cross_entropy`` gives it."""
    import accelfn as af

    _, held_out = gpt.split(gpt.stdlib_text(30000))
    rows = gpt.validation_rows(held_out, 32)
    assert len(rows) % 5 and (rows["targets"] == -100).any()
    torch.manual_seed(0)
    model = gpt.GPT(dim=32, depth=2, seq_len=32, attention="documents")
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_clipping(max_norm=1.0)(gpt.lm_step)
    monkeypatch.setattr(gpt, "EVAL_POSITIONS", 5 * 32)  # chunks of 5 rows
    loss = gpt.validation_loss(step, state, rows)
    with torch.no_grad():
        logits = model(rows["inputs"])  # one document a row: plain causal attention
        expected = F.cross_entropy(logits.flatten(0, 1), rows["targets"].flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
