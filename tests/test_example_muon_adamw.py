"""examples/muon_adamw.py: one TrainState with Muon and AdamW equals the plain loop bitwise.

The reference loop imports nothing from accelfn: the batch in two micro-batches, each loss
divided by two before ``backward()``, ``clip_grad_norm_`` over all the parameters, both
optimizers stepped and cleared, both schedules stepped, Muon's momentum written into its
groups before each update (as nanochat's base training does).
"""

from __future__ import annotations

import copy

import pytest
import torch
from example_modules import load_example
from tensordict import TensorDict

import accelfn as af
from accelfn import checkpointing

example = load_example("muon_adamw")
SEQ, BATCH, UPDATES, MICRO = 16, 8, 5, 2


def small_gpt():
    torch.manual_seed(0)
    return example.GPT(dim=32, depth=2, heads=4, seq_len=SEQ)


def batches():
    rows = example.text_sequences(SEQ)["tokens"]
    return [rows[i * BATCH:(i + 1) * BATCH] for i in range(UPDATES)]


def accelfn_side(model, *, max_norm=1.0):
    muon, adamw = example.optimizers(model)
    state = af.TrainState(model, [muon, adamw], scheduler=example.schedules(muon, adamw, UPDATES))
    step = af.with_accumulation(MICRO)(af.with_clipping(max_norm=max_norm)(example.lm_loss))
    return state, step, muon, adamw


def test_muon_and_adamw_in_one_state_equal_the_plain_loop_bitwise():
    model = small_gpt()
    plain = copy.deepcopy(model)
    state, step, muon, _ = accelfn_side(model)
    p_muon, p_adamw = example.optimizers(plain)  # the plain loop's own two optimizers
    p_schedules = example.schedules(p_muon, p_adamw, UPDATES)
    assert [len(g["params"]) for g in p_muon.param_groups] == [8]  # 4 matrices per block
    assert all(p.ndim == 2 for g in p_muon.param_groups for p in g["params"])
    rates = []
    for tokens in batches():
        for group in muon.param_groups:
            group["momentum"] = example.muon_momentum(state.step)
        metrics = step(state, TensorDict({"tokens": tokens}, batch_size=[BATCH]))
        rates.append((metrics["lr"], metrics["lr/muon"], metrics["lr/adamw"]))

        lr = (p_muon.param_groups[0]["lr"], p_adamw.param_groups[0]["lr"])  # the plain loop
        for group in p_muon.param_groups:
            group["momentum"] = example.muon_momentum(len(rates) - 1)
        for micro in tokens.chunk(MICRO):
            loss = example.lm_loss(plain, {"tokens": micro})
            (loss / MICRO).backward()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        p_muon.step()
        p_adamw.step()
        p_muon.zero_grad(set_to_none=True)
        p_adamw.zero_grad(set_to_none=True)
        for schedule in p_schedules:
            schedule.step()
        assert torch.equal(metrics["grad_norm"], norm)
        assert torch.equal(metrics["lr/muon"], torch.tensor(lr[0]))  # the rates it used
        assert torch.equal(metrics["lr"], metrics["lr/muon"])  # the first optimizer's
        assert torch.equal(metrics["lr/adamw"], torch.tensor(lr[1]))
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    for key in ("momentum_buffer",):  # Muon's state too
        for p, q in zip(muon.param_groups[0]["params"], p_muon.param_groups[0]["params"]):
            assert torch.equal(muon.state[p][key], p_muon.state[q][key])
    adamw_rates = [float(r[2]) for r in rates]  # warmed up, then decayed along the cosine
    assert adamw_rates[0] < adamw_rates[1] > adamw_rates[2] > adamw_rates[3] > adamw_rates[4]
    assert muon.param_groups[0]["lr"] == p_muon.param_groups[0]["lr"] == 0.0  # run's end


def test_one_non_finite_decision_skips_both_optimizers_and_both_schedules():
    """A NaN in one AdamW gradient only (the loss and Muon's gradients finite) skips both."""
    model = small_gpt()
    state, step, *_ = accelfn_side(model)
    tokens = batches()
    step(state, TensorDict({"tokens": tokens[0]}, batch_size=[BATCH]))
    before = copy.deepcopy(state.state_dict())
    hook = model.head.weight.register_hook(lambda g: g * float("nan"))  # AdamW's head only
    metrics = step(state, TensorDict({"tokens": tokens[1]}, batch_size=[BATCH]))
    hook.remove()
    assert float(metrics["skipped"]) == 1 and torch.isfinite(metrics["loss"])
    after = state.state_dict()
    for key, value in before["model"].items():  # no parameter moved
        assert torch.equal(value, after["model"][key]), key
    assert len(after["optimizer"]) == 2
    for saved, now in zip(before["optimizer"], after["optimizer"]):  # neither optimizer
        for i, entry in saved["state"].items():
            for name, value in entry.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(now["state"][i][name]))
    assert after["scheduler"] == before["scheduler"]  # neither schedule stepped
    assert [s.last_epoch for s in state.schedulers] == [1, 1]
    assert all(p.grad is None for p in model.parameters())
    metrics = step(state, TensorDict({"tokens": tokens[2]}, batch_size=[BATCH]))
    assert float(metrics["skipped"]) == 0  # the next update applies to both
    assert not torch.equal(model.head.weight, before["model"]["head.weight"])
    assert not torch.equal(model.blocks[0].qkv.weight, before["model"]["blocks.0.qkv.weight"])


@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**20])  # 2**20: the first two overflow
def test_fp16_one_grad_scaler_for_both_optimizers_equals_the_plain_loop_bitwise(init_scale):
    """One GradScaler: unscaled into each optimizer, one overflow decision skips both."""
    model = small_gpt()
    plain = copy.deepcopy(model)
    muon, adamw = example.optimizers(model)
    state = af.TrainState(model, [muon, adamw])
    step = af.with_amp(dtype=torch.float16, init_scale=init_scale)(
        af.with_clipping(max_norm=1.0)(example.lm_loss))
    p_muon, p_adamw = example.optimizers(plain)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    skipped = []
    for tokens in batches():
        metrics = step(state, TensorDict({"tokens": tokens}, batch_size=[BATCH]))
        skipped.append(float(metrics["skipped"]))
        assert float(metrics["loss_scale"]) == scaler.get_scale()  # the scale it used
        with torch.autocast("cpu", dtype=torch.float16):  # the plain loop
            loss = example.lm_loss(plain, {"tokens": tokens})
        scaler.scale(loss).backward()
        scaler.unscale_(p_muon)
        scaler.unscale_(p_adamw)
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        scaler.step(p_muon)
        scaler.step(p_adamw)
        scaler.update()
        p_muon.zero_grad(set_to_none=True)
        p_adamw.zero_grad(set_to_none=True)
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name
    assert [n for n in state.slots if n == "with_amp"] == ["with_amp"]  # one scaler
    assert skipped == ([0.0] * 5 if init_scale == 2.0**16 else [1.0, 1.0, 0.0, 0.0, 0.0])


@pytest.mark.slow
def test_muon_example_learns_and_resumes_exactly(tmp_path):
    small = ["--steps", "8", "--batch-size", "8", "--seq-len", "16", "--log-every", "4"]
    straight = str(tmp_path / "straight")
    report = example.main([*small, "--out", straight])
    assert report["updates"] == 8
    assert report["val_bits_per_byte"] < 8.0  # uniform over 256 bytes is 8 bits
    assert report["lr/muon"] == 0.01  # the last update: halfway down Muon's warmdown
    split = str(tmp_path / "split")
    example.main([*small, "--stop-at", "3", "--out", split])
    example.main([*small, "--resume", split])
    a = torch.load(checkpointing.latest(straight) / "state.pt", weights_only=True)
    b = torch.load(checkpointing.latest(split) / "state.pt", weights_only=True)
    for key, value in a["state"]["model"].items():
        assert torch.equal(value, b["state"]["model"][key]), key


def test_a_state_with_two_optimizers_checkpoints_and_resumes_exactly(tmp_path):
    """accelfn.checkpointing.save/load of a TrainState holding [muon, adamw]."""
    def fresh():
        model = small_gpt()
        return accelfn_side(model)

    tokens = [TensorDict({"tokens": t}, batch_size=[BATCH]) for t in batches()]
    state, step, *_ = fresh()
    for batch in tokens:
        step(state, batch)
    first, step1, *_ = fresh()
    for batch in tokens[:2]:
        step(first, batch)
    path = checkpointing.save(tmp_path, first, step=step1)
    resumed, step2, *_ = fresh()
    checkpointing.load(path, resumed, step=step2)
    for batch in tokens[2:]:
        step2(resumed, batch)
    for a, b in zip(state.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
