"""accelfn.step.micro: the forward and backward of a call's micro-batches.

A micro-batch whose returned weight is 0 (all padding: the empty row that pads the last
batch of ``token_loader(drop_last=False)`` on a rank with fewer rows) contributes nothing:
its loss and metrics (NaN, a mean over no token) are left out of the sums, its gradient is
zero, and the update equals the one over the real rows alone, by hand.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import Net, classify, make_batch

import accelfn as af
from accelfn.core.contexts import CallContext
from accelfn.core.plan import Plan
from accelfn.step import micro

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from token_loader_worker import TinyLM, corpus_path, last_batch


def test_micro_batches_are_weighted_by_their_share_or_counted_absolutely():
    plan = Plan(("a", "b", "c"), sizes=(2, 1, 1))
    assert list(micro._coefficients(plan, absolute=False)) == [0.5, 0.25, 0.25]
    assert list(micro._coefficients(plan, absolute=True)) == [2.0, 1.0, 1.0]
    assert list(micro._coefficients(Plan(("a",), sizes=(4,)), absolute=False)) == [None]
    with pytest.raises(ValueError, match="3 micro-batches but 2 sizes"):
        micro._coefficients(Plan(("a", "b", "c"), sizes=[1, 2]), absolute=False)


def test_forward_runs_the_function_on_the_model_itself_through_the_prepared_call():
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.lift(classify)
    prepared = step.prepare(state)
    calls, seen = [], []

    def call(thunk):  # what DDP's or the FSDP2 root's forward does around the function
        calls.append(1)
        return thunk()

    def fn(model_, batch):
        seen.append(model_)
        return classify(model_, batch)

    ctx = CallContext(state, dataclasses.replace(prepared, call=call))
    out = micro.forward(step.spec, fn, False, ctx, make_batch())
    assert seen == [model] and calls == [1] and out["loss"].requires_grad
    plain = micro.forward(step.spec, fn, False, CallContext(state, prepared), make_batch())
    assert seen == [model, model] and calls == [1]
    torch.testing.assert_close(plain["loss"], out["loss"], rtol=0, atol=0)


def test_a_function_calling_backward_itself_is_told_to_return_the_loss():
    def twice(model, batch):
        out = classify(model, batch)
        out["loss"].backward(retain_graph=False)
        return out

    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="called backward\\(\\) itself"):
        af.lift(twice)(state, make_batch())
    assert all(p.grad is None for p in model.parameters())


def test_nothing_of_the_scopes_is_left_entered_after_a_failing_function(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def scope(options, ctx):
        entered.append(True)
        try:
            yield
        finally:
            entered.pop()

    from accelfn.parts import activation_checkpointing

    monkeypatch.setattr(activation_checkpointing, "scope", scope)
    step = af.checkpointed(blocks=torch.nn.Linear)(lambda model, batch: 1 / 0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ZeroDivisionError):
        step(state, make_batch())
    assert entered == []


def padded_batch(tmp_path):
    """Rank 1's last batch of a 2-process packed token loader: 3 real rows and 1 empty."""
    batch = last_batch(corpus_path(tmp_path), rank=1, world_size=2)
    counts = (batch["targets"] != -100).sum(1)
    assert counts.tolist() == [32, 32, 32, 0]
    return batch


def mean_loss(model, batch):
    """F.cross_entropy's own mean over the real targets: NaN over none (its gradient is 0)."""
    logits = model(batch["inputs"], batch["document_ids"], batch["positions"])
    targets = batch["targets"]
    real = targets != -100
    hit = (logits.argmax(-1) == targets) & real
    return {"loss": F.cross_entropy(logits.flatten(0, 1), targets.flatten()),
            "weight": real.sum(),
            "accuracy": hit.sum() / real.sum()}  # NaN over no token


def linear_loss(model, batch):
    """af.linear_cross_entropy's mean and count."""
    hidden = model.features(batch["inputs"], batch["document_ids"], batch["positions"])
    loss, count = af.linear_cross_entropy(hidden, model.head.weight, batch["targets"],
                                          return_count=True)
    return {"loss": loss, "weight": count}


def by_hand(model, batch, loss_fn) -> torch.Tensor:
    """One SGD update, plain PyTorch, over ``batch`` in one piece; its loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = loss_fn(model, batch)["loss"]
    loss.backward()
    optimizer.step()
    return loss.detach()


@pytest.mark.parametrize("loss_fn", [mean_loss, linear_loss], ids=["cross_entropy", "linear"])
@pytest.mark.parametrize("n", [4, 2])
def test_a_micro_batch_of_weight_zero_contributes_nothing(tmp_path, loss_fn, n):
    batch = padded_batch(tmp_path)
    torch.manual_seed(0)
    model = TinyLM(bias=False)
    reference = copy.deepcopy(model)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))
    metrics = af.with_accumulation(n)(loss_fn)(state, batch)  # the last micro-batch: 0 tokens
    assert metrics["skipped"].item() == 0
    loss = by_hand(reference, batch[:3], loss_fn)  # the real rows alone
    torch.testing.assert_close(metrics["loss"], loss, rtol=1e-5, atol=1e-6)
    if "accuracy" in metrics.keys():
        assert torch.isfinite(metrics["accuracy"])
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_loss_whose_gradient_is_nan_at_zero_tokens_is_still_skipped(tmp_path):
    """What accelfn cannot mend: a masked mean ``(per_token * mask).sum() / mask.sum()``
    differentiates as ``0 / 0`` inside the user's function, before accelfn's zero reaches
    the model (docs/reliability.md says to divide by ``mask.sum().clamp(min=1)``, which
    makes the same update as the real rows')."""
    batch = padded_batch(tmp_path)

    def masked_mean(clamp):
        def loss_fn(model, batch):
            logits = model(batch["inputs"], batch["document_ids"], batch["positions"])
            targets = batch["targets"]
            mask = (targets != -100).float()
            padded = targets.clamp(min=0)  # a pad token's id at padding, and a mask
            per = F.cross_entropy(logits.flatten(0, 1), padded.flatten(), reduction="none")
            count = mask.sum()
            total = (per * mask.flatten()).sum()
            return {"loss": total / (count.clamp(min=1) if clamp else count), "weight": count}
        return loss_fn

    torch.manual_seed(0)
    model = TinyLM(bias=False)
    reference, clamped = copy.deepcopy(model), copy.deepcopy(model)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))
    metrics = af.with_accumulation(4)(masked_mean(False))(state, batch)
    assert metrics["skipped"].item() == 1
    assert torch.isfinite(metrics["loss"])  # the loss of the real rows, all the same
    state = af.TrainState(clamped, torch.optim.SGD(clamped.parameters(), lr=0.5))
    metrics = af.with_accumulation(4)(masked_mean(True))(state, batch)
    assert metrics["skipped"].item() == 0
    by_hand(reference, batch[:3], masked_mean(True))
    for (name, p), q in zip(clamped.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_evaluate_leaves_out_a_micro_batch_of_weight_zero_too(tmp_path):
    batch = padded_batch(tmp_path)
    torch.manual_seed(0)
    model = TinyLM(bias=False)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))
    metrics = af.with_accumulation(4)(mean_loss).evaluate(state, batch)
    with torch.no_grad():
        want = mean_loss(model, batch[:3])
    torch.testing.assert_close(metrics["loss"], want["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["accuracy"], want["accuracy"], rtol=1e-5, atol=1e-6)
