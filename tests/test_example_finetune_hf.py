"""examples/finetune_hf.py: a transformers LlamaForCausalLM trained by the example's step
(checkpointed decoder layers, clipping, accumulation) equals the plain loop with either loss;
the example learns, resumes exactly, exports a folder ``from_pretrained`` reloads with the
same held-out loss, and fine-tunes from that folder with ``--from``.

The reference loop imports nothing from accelfn: ``model(ids, labels=ids).loss`` on each of
two micro-batches, halved, ``backward()``, ``clip_grad_norm_``, AdamW, its schedule.
"""

from __future__ import annotations

import math

import pytest
import torch
from example_modules import load_example
from tensordict import TensorDict

import accelfn as af
from accelfn import checkpointing

example = load_example("finetune_hf")
SEQ, BATCH, UPDATES, MICRO = 16, 8, 3, 2
TINY = ["--batch-size", "8", "--seq-len", "16", "--dim", "32", "--quiet"]


def batches() -> list[torch.Tensor]:
    rows = example.text_rows("argparse", SEQ)["ids"]
    return [rows[i * BATCH:(i + 1) * BATCH] for i in range(UPDATES)]


def fresh():
    torch.manual_seed(0)
    model = example.tiny_llama(32, 2, SEQ)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    return model, optimizer, af.warmup_cosine(optimizer, warmup_steps=1, total_steps=UPDATES)


@pytest.mark.parametrize("loss", ["hidden", "labels"])
def test_the_examples_step_equals_the_plain_loop(loss):
    model, optimizer, scheduler = fresh()
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    step = af.with_accumulation(MICRO)(af.with_clipping(max_norm=1.0)(
        af.checkpointed(blocks="auto")(example.LOSSES[loss])))
    plain, p_optimizer, p_scheduler = fresh()
    for ids in batches():
        metrics = step(state, TensorDict({"ids": ids}, batch_size=[BATCH]))
        for micro in ids.chunk(MICRO):  # the plain loop
            (plain(micro, labels=micro).loss / MICRO).backward()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        p_optimizer.step()
        p_optimizer.zero_grad(set_to_none=True)
        p_scheduler.step()
        torch.testing.assert_close(metrics["grad_norm"], norm, atol=1e-6, rtol=1e-5)
    # the hidden-state loss rounds differently (linear_cross_entropy's chunks) and AdamW
    # divides by each gradient's own scale: 5e-6 apart after three updates at lr 3e-3
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_the_example_learns_resumes_exactly_exports_and_fine_tunes_from_its_export(tmp_path):
    straight = str(tmp_path / "straight")
    report = example.main([*TINY, "--steps", "6", "--out", straight])
    assert report["updates"] == 6
    assert report["val_loss"] < math.log(256)  # uniform over the 256 bytes
    assert report["reloaded_val_loss"] == report["val_loss"]  # the export is the model
    split = str(tmp_path / "split")
    example.main([*TINY, "--steps", "6", "--stop-at", "3", "--out", split])
    resumed = example.main([*TINY, "--steps", "6", "--resume", split])
    assert resumed["updates"] == 6 and resumed["val_loss"] == report["val_loss"]
    a = torch.load(checkpointing.latest(straight) / "state.pt", weights_only=True)
    b = torch.load(checkpointing.latest(split) / "state.pt", weights_only=True)
    for key, value in a["state"]["model"].items():
        assert torch.equal(value, b["state"]["model"][key]), key

    tuned = example.main([*TINY, "--steps", "2", "--from", report["export"], "--text",
                          "textwrap", "--loss", "labels", "--out", str(tmp_path / "tuned")])
    assert tuned["updates"] == 2 and tuned["reloaded_val_loss"] == tuned["val_loss"]
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(report["export"]).state_dict()
    end = torch.load(checkpointing.latest(tmp_path / "tuned") / "state.pt",
                     weights_only=True)["state"]["model"]
    assert sorted(start) == sorted(end)  # the same model, trained on from the export
    assert not torch.equal(start["lm_head.weight"], end["lm_head.weight"])
