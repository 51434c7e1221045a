"""with_amp(fp16) with absolutely weighted accumulation keeps the plain loop's loss scale.

Calls mode and a returned "weight" weight each micro-batch by its sample (or token) count and
divide the gradients by the window's total after the backward. Under loss scaling the
objective is first divided by a power of two near the window's weight, so the backward carries
the magnitudes of the plain loop's ``scaler.scale(loss / n).backward()``: the scaler does not
overflow where the plain loop does not, and the gradients are those of the exact weighting
(a power of two divides exactly).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import Net, assert_params_equal, classify, clone_setup, make_batch, roundtrip

import accelfn as af
from accelfn.core.plan import Plan

CALLS, ROWS = 4, 64


def _fp16(model, batch):
    with torch.autocast("cpu", dtype=torch.float16):
        return classify(model, batch)["loss"]


def _plain_calls_window(model, optimizer, scaler, batches):
    """What a competent fp16 user writes for a window of equal calls."""
    for batch in batches:
        scaler.scale(_fp16(model, batch) / len(batches)).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def test_calls_mode_fp16_skips_no_update_the_plain_loop_does_not(net):
    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.SGD, momentum=0.9)
    state = af.TrainState(m1, o1)
    step = af.with_amp(dtype=torch.float16)(af.with_accumulation(CALLS, mode="calls")(classify))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000)
    for update in range(3):
        batches = [make_batch(ROWS, seed=update * CALLS + i) for i in range(CALLS)]
        for batch in batches:
            metrics = step(state, batch)
        scale = scaler.get_scale()
        _plain_calls_window(m2, o2, scaler, [dict(b.items()) for b in batches])
        assert scaler.get_scale() == scale  # the plain loop overflows nowhere
        assert metrics["skipped"] == 0
        assert metrics["loss_scale"] == 2.0**16
    # equal calls: 64 / 256 is the plain loop's 1 / 4, exactly
    assert_params_equal(m1, m2)


def _token_loss(model, batch):
    logits = model(batch["x"])
    per = F.cross_entropy(logits, batch["y"], reduction="none")
    mask = batch["mask"].float()
    tokens = mask.sum() * 512  # every row stands for 512 tokens: weights in the thousands
    return {"loss": (per * mask).sum() * 512 / tokens, "weight": tokens}


@pytest.mark.parametrize("mode", ["split", "calls"])
def test_token_weights_fp16_keep_the_scale_and_the_weighted_gradient(mode):
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(Net(), torch.optim.SGD)
    state = af.TrainState(m1, o1)
    step = af.with_amp(dtype=torch.float16)(af.with_accumulation(2, mode=mode)(_token_loss))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000)
    for update in range(2):
        batch = make_batch(2 * ROWS, seed=update)
        halves = [batch[:ROWS], batch[ROWS:]]
        if mode == "split":
            metrics = step(state, batch)
        else:
            for half in halves:
                metrics = step(state, half)
        # the plain loop: each micro-batch's mean loss times its share of the tokens
        with torch.autocast("cpu", dtype=torch.float16):
            outs = [_token_loss(m2, dict(h.items())) for h in halves]
        total = sum(o["weight"] for o in outs)
        for out in outs:
            scaler.scale(out["loss"] * out["weight"] / total).backward()
        scaler.step(o2)
        scaler.update()
        o2.zero_grad(set_to_none=True)
        assert scaler.get_scale() == 2.0**16
        assert metrics["skipped"] == 0, f"update {update}"
        assert metrics["loss_scale"] == 2.0**16
    # fp16 rounds the two scalings differently (~1e-5 here); a wrong weighting is ~1e-2
    assert_params_equal(m1, m2, exact=False, atol=1e-4, rtol=1e-4)


def _unit(state):
    return float(1 / state.slots["weight_unit"].inverse)


def test_the_weight_unit_is_agreed_once_and_kept_across_a_checkpoint(net):
    """A resumed run counts in the unit the run agreed on, not one from its first batch."""
    step = af.with_amp(dtype=torch.float16)(af.with_accumulation(2, mode="calls")(classify))
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for i in range(2):
        step(state, make_batch(ROWS, seed=i))
    assert _unit(state) == 128  # 64 rows x 2 calls
    saved = roundtrip(state.state_dict())
    torch.manual_seed(0)
    other = Net()
    resumed = af.TrainState(other, torch.optim.SGD(other.parameters(), lr=0.1))
    resumed.load_state_dict(saved)
    for s in (state, resumed):
        step(s, make_batch(3, seed=5))  # a small first call after the resume
        step(s, make_batch(3, seed=6))
        assert _unit(s) == 128
    assert_params_equal(net, other)


def test_a_fresh_state_agrees_on_its_first_weight_and_bad_weights_count_in_ones():
    torch.manual_seed(0)
    for rows, unit in ((3, 4), (64, 128)):
        model = Net()
        state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        step = af.with_amp(dtype=torch.float16)(af.with_accumulation(2, mode="calls")(classify))
        step(state, make_batch(rows))
        assert _unit(state) == unit

    def zero_weight(model, batch):
        return {"loss": classify(model, batch)["loss"], "weight": torch.zeros(())}

    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    af.with_amp(dtype=torch.float16)(af.with_accumulation(2)(zero_weight))(state, make_batch(8))
    assert _unit(state) == 1


def test_without_loss_scaling_weights_are_not_rescaled(net):
    step = af.with_amp(dtype=torch.bfloat16)(af.with_accumulation(2, mode="calls")(classify))
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    step(state, make_batch(ROWS))
    assert "weight_unit" not in state.slots


def test_a_plan_spanning_no_calls_is_refused():
    with pytest.raises(ValueError, match="calls"):
        Plan((make_batch(),), calls=0)


def _overflows(model, batches, divisor, scale):
    """Whether a window of ``batches``, each scaled as ``loss / divisor``, overflows fp16's
    backward at the loss scale ``scale`` (the scaler then halves it and skips the update)."""
    probe = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=2000)
    optimizer = torch.optim.SGD(probe.parameters(), lr=0.1)
    for batch in batches:
        scaler.scale(_fp16(probe, batch) / divisor).backward()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() < scale


def test_a_flushed_short_window_is_scaled_in_the_runs_unit_not_its_own_length(net):
    """The page's claim: a flushed window of one call is scaled as ``loss / n`` (the unit the
    run agreed on), where a loop dividing by the window's real length (timm's) scales it as
    ``loss / 1``: at a loss scale where that overflows, the loop skips the update and accelfn
    applies it, and the gradients applied are the exact weighting's (the plain loop's at a
    scale where nothing overflows)."""
    full = [make_batch(ROWS, seed=i) for i in range(CALLS)]
    last = [make_batch(ROWS, seed=CALLS)]
    plain = [[dict(b.items()) for b in w] for w in (full, last)]
    after = copy.deepcopy(net)  # the weights the short window meets (no overflow before it)
    first = torch.optim.SGD(after.parameters(), lr=0.1, momentum=0.9)
    _plain_calls_window(after, first, torch.amp.GradScaler("cpu", init_scale=1.0), plain[0])
    scale = next(2.0**k for k in range(8, 40)  # the smallest at which loss / 1 overflows
                 if _overflows(after, plain[1], 1, 2.0**k))
    assert not _overflows(net, plain[0], CALLS, scale)
    assert not _overflows(after, plain[1], CALLS, scale)

    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.SGD, momentum=0.9)
    m3 = copy.deepcopy(m2)
    o3 = torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9)
    state = af.TrainState(m1, o1)
    step = af.with_amp(dtype=torch.float16, init_scale=scale)(
        af.with_accumulation(CALLS, mode="calls")(classify))
    for batch in full + last:
        step(state, batch)
    metrics = step.flush(state)
    assert metrics is not None
    assert metrics["skipped"] == 0 and metrics["loss_scale"] == scale  # applied

    timm = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=2000)
    for window in plain:  # scaled by the window's real length, as timm's loop does
        _plain_calls_window(m2, o2, timm, window)
    assert timm.get_scale() == scale / 2  # that loop skipped the short window's update

    exact = torch.amp.GradScaler("cpu", init_scale=scale / 2**8, growth_interval=2000)
    for window in plain:  # the same maths at a scale where nothing overflows
        _plain_calls_window(m3, o3, exact, window)
    assert exact.get_scale() == scale / 2**8
    assert_params_equal(m1, m3)
