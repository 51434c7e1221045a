"""The bare step and its protocol, against the hand-written reference loop."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    Net,
    as_dict,
    assert_params_equal,
    classify,
    clone_setup,
    make_batch,
    token_loss,
)
from reference import reference_update
from tensordict import TensorDict
from torch import nn

import accelfn as af


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 1e-4}),
    (torch.optim.AdamW, {"lr": 1e-2}),
])
def test_plain_step_equals_reference_bitwise(net, opt_cls, kwargs):
    (m1, o1), (m2, o2) = clone_setup(net, opt_cls, **kwargs)
    s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=2, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=2, gamma=0.5)
    step = af.lift(classify)
    state = af.TrainState(m1, o1, scheduler=s1)
    for i in range(5):
        batch = make_batch(seed=i)
        metrics = step(state, batch)
        ref = reference_update(m2, o2, as_dict(batch), classify, scheduler=s2)
        assert torch.equal(metrics["loss"], ref["losses"][0])
    assert_params_equal(m1, m2)
    assert s1.get_last_lr() == s2.get_last_lr()
    assert state.step == 5


def test_metrics_are_detached_device_tensordict(net):
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    metrics = af.lift(classify)(state, make_batch())
    assert isinstance(metrics, TensorDict)
    assert set(metrics.keys()) == {"loss", "accuracy", "lr", "skipped"}
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad
        assert value.device == torch.device("cpu")
    assert metrics["lr"] == pytest.approx(0.1)
    assert metrics["skipped"] == 0


def test_plain_loss_tensor_and_dict_batch(net):
    def loss_only(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    (m1, o1), (m2, o2) = clone_setup(net)
    state = af.TrainState(m1, o1)
    batch = make_batch(td=False)
    metrics = af.lift(loss_only)(state, batch)
    ref = reference_update(m2, o2, batch, loss_only)
    assert torch.equal(metrics["loss"], ref["losses"][0])
    assert_params_equal(m1, m2)


def test_evaluate_no_grad_eval_mode_and_no_update(net):
    seen = []

    def fn(model, batch):
        seen.append((model.training, torch.is_grad_enabled()))
        return classify(model, batch)

    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before = [p.clone() for p in net.parameters()]
    metrics = af.with_accumulation(2)(fn).evaluate(state, make_batch())
    assert seen == [(False, False), (False, False)]
    assert net.training
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    with torch.no_grad():
        full = classify(net.eval(), make_batch())
    net.train()
    torch.testing.assert_close(metrics["loss"], full["loss"])
    assert state.step == 0


def test_evaluate_restores_each_modules_own_mode():
    """A submodule the user keeps in eval mode (a frozen BatchNorm while fine-tuning) is in
    eval mode again after ``evaluate``, and the next update leaves its statistics alone."""
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model[1].eval().requires_grad_(False)
    state = af.TrainState(model, torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.1))
    step = af.lift(classify)
    step(state, make_batch())
    modes = [m.training for m in model.modules()]
    statistics = model[1].running_mean.clone()
    step.evaluate(state, make_batch(seed=1))
    assert [m.training for m in model.modules()] == modes
    step(state, make_batch(seed=2))
    assert torch.equal(model[1].running_mean, statistics)


def test_describe_shows_stack_outermost_first():
    step = af.compiled(af.with_amp(af.with_accumulation(4)(af.with_clipping(max_norm=1.0)(
        classify))))
    text = af.describe(step)
    assert text == ("compiled ∘ with_amp(auto) ∘ with_accumulation(4) ∘ "
                    "with_clipping(max_norm=1) ∘ classify")
    assert repr(step) == text
    assert repr(af.with_amp(dtype=torch.float16)(classify)).startswith("with_amp(fp16)")


def test_same_transform_twice_is_an_error():
    with pytest.raises(ValueError, match="with_amp is applied twice"):
        af.with_amp(af.with_clipping(af.with_amp(classify)))
    with pytest.raises(ValueError, match="with_accumulation is applied twice"):
        af.with_accumulation(2)(af.with_accumulation(2)(classify))


def test_options_are_keyword_only_and_checked_at_build():
    with pytest.raises(TypeError, match="keyword only"):
        af.with_clipping(1.0)
    with pytest.raises(ValueError, match="max_norm"):
        af.with_clipping(max_norm=-1.0)
    with pytest.raises(ValueError, match="n >= 1"):
        af.with_accumulation(0)
    with pytest.raises(TypeError, match="int"):
        af.with_accumulation(2.5)
    with pytest.raises(ValueError, match="mode"):
        af.compiled(mode="fastest")
    with pytest.raises(ValueError, match="dtype"):
        af.with_amp(dtype=torch.float64)
    with pytest.raises(ValueError, match="strategy"):
        af.distributed(strategy="zero3")
    with pytest.raises(ValueError, match="policy"):
        af.with_nonfinite(policy="ignore")


def grad_noise(std: float, seed: int = 0) -> af.GradientTransform:
    """A user gradient transform: Gaussian gradient noise, its generator's state its state."""

    def init(params):
        return {"rng": torch.Generator().manual_seed(seed).get_state()}

    def add_noise(grads, params, state):
        gen = torch.Generator()
        gen.set_state(state["rng"])
        for g in grads:
            g.add_(torch.randn(g.shape, generator=gen) * std)
        return {"rng": gen.get_state()}

    return af.GradientTransform("gradient_noise", add_noise, init)


def test_user_transform_composes_with_builtins(net):
    (m1, o1), (m2, o2) = clone_setup(net)
    step = af.with_clipping(max_norm=0.5)(grad_noise(0.01)(classify))
    assert repr(step) == "with_clipping(max_norm=0.5) ∘ gradient_noise ∘ classify"
    state = af.TrainState(m1, o1)
    gen = torch.Generator().manual_seed(0)
    batch = make_batch()
    step(state, batch)
    # by hand: backward, user gradient transforms, then clipping, then step
    out = classify(m2, as_dict(batch))
    out["loss"].backward()
    for p in m2.parameters():
        p.grad.add_(torch.randn(p.grad.shape, generator=gen) * 0.01)
    torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.5)
    o2.step()
    o2.zero_grad(set_to_none=True)
    assert_params_equal(m1, m2)
    assert isinstance(grad_noise(0.1).transform(), af.Transform)
    # its state is the TrainState's: a second update draws on from where the first stopped
    batch = make_batch(seed=1)
    step(state, batch)
    classify(m2, as_dict(batch))["loss"].backward()
    for p in m2.parameters():
        p.grad.add_(torch.randn(p.grad.shape, generator=gen) * 0.01)
    torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.5)
    o2.step()
    assert_params_equal(m1, m2)
    assert set(state.state_dict()["slots"]["gradients.gradient_noise"]) == {"rng"}


def test_not_a_transform_is_refused():
    with pytest.raises(TypeError, match="not a transform"):
        af.lift(classify).with_transform(object())


# ----------------------------------------------------------------------------- bad input
def _state():
    torch.manual_seed(0)
    model = Net()
    return af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _snapshot(state):
    return ([p.detach().clone() for p in state.model.parameters()],
            repr(state.optimizer.state_dict()["state"]))


def _assert_untouched(before, state):
    """Parameters and optimizer state as in ``before`` (a ``_snapshot``), no gradient left."""
    after = _snapshot(state)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert before[1] == after[1]
    assert all(p.grad is None for p in state.model.parameters())


@pytest.mark.parametrize("batch,error,match", [
    ([1, 2, 3], TypeError, "TensorDict or a mapping"),
    ({"x": torch.randn(4, 6), "y": [0, 1, 2, 3]}, TypeError, "not a tensor"),
    ({"x": torch.randn(4, 6), "y": torch.zeros(3, dtype=torch.long)}, ValueError, "disagree"),
    ({"x": torch.randn(0, 6), "y": torch.zeros(0, dtype=torch.long)}, ValueError, "empty"),
    ({}, ValueError, "empty mapping"),
    ({"x": torch.randn(4, 6), "y": torch.zeros(4, dtype=torch.long, device="meta")},
     ValueError, "several devices"),
    ({"x": torch.randn(4, 6)}, KeyError, "y"),
])
def test_bad_batches_fail_before_any_state_change(batch, error, match):
    state = _state()
    step = af.with_amp(af.with_clipping(classify))
    step(state, make_batch())  # optimizer has state now
    before = _snapshot(state)
    with pytest.raises(error, match=match):
        step(state, batch)
    _assert_untouched(before, state)


def test_a_batch_smaller_than_the_micro_batch_count_is_one_update_of_single_samples():
    """(It used to raise; the warning naming mode='calls' is tests/transforms/
    test_accumulation.py's.)"""
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        af.with_accumulation(4)(classify)(state, make_batch(3))
    assert state.step == 1


@pytest.mark.parametrize("fn,error,match", [
    (lambda m, b: m(b["x"]), ValueError, "scalar"),
    (lambda m, b: F.cross_entropy(m(b["x"]), b["y"]).detach(), ValueError, "require grad"),
    (lambda m, b: {"accuracy": torch.tensor(1.0)}, KeyError, "without 'loss'"),
    (lambda m, b: (F.cross_entropy(m(b["x"]), b["y"]),), TypeError, "returned a tuple"),
    (lambda m, b: {"loss": F.cross_entropy(m(b["x"]), b["y"]), "acc": m(b["x"])},
     ValueError, "'acc' must be a scalar"),
])
def test_bad_step_function_outputs(fn, error, match):
    state = _state()
    before = _snapshot(state)
    with pytest.raises(error, match=match):
        af.with_accumulation(2)(fn)(state, make_batch())
    assert all(torch.equal(a, b) for a, b in zip(before[0], _snapshot(state)[0]))
    assert all(p.grad is None for p in state.model.parameters())


def test_bad_train_state():
    model = Net()
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        af.TrainState(model, object())
    frozen = Net().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        af.TrainState(frozen, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    with pytest.raises(ValueError, match="not the model's"):
        af.TrainState(model, torch.optim.SGD(Net().parameters(), lr=0.1))
    with pytest.raises(TypeError, match="step\\(state, batch\\)"):
        af.lift(classify)(model, make_batch())


def test_out_of_memory_leaves_state_intact_and_says_what_helps():
    state = _state()
    step = af.with_amp(af.with_accumulation(2)(classify))
    step(state, make_batch())
    before = _snapshot(state)
    calls = {"n": 0}

    def hungry(model, batch):
        calls["n"] += 1
        out = classify(model, batch)
        if calls["n"] == 2:  # the second micro-batch runs out of memory
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return out

    with pytest.raises(torch.OutOfMemoryError, match=r"with_accumulation\(4\).*checkpointed"):
        af.with_amp(af.with_accumulation(2)(hungry))(state, make_batch())
    _assert_untouched(before, state)


def test_misuse_errors_name_the_fix():
    state = _state()

    def calls_backward(model, batch):
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match=r"called backward\(\) itself: return the loss"):
        af.lift(calls_backward)(state, make_batch())
    assert all(p.grad is None for p in state.model.parameters())

    def item_metric(model, batch):
        logits = model(batch["x"])
        return {"loss": F.cross_entropy(logits, batch["y"]),
                "accuracy": (logits.argmax(-1) == batch["y"]).float().mean().item()}

    with pytest.raises(ValueError, match=r"'accuracy' is a Python float: return the tensor, "
                                         r"not \.item\(\)"):
        af.lift(item_metric)(state, make_batch())
    with pytest.raises(ValueError, match=r"returned a Python float: return the loss tensor"):
        af.lift(lambda m, b: F.cross_entropy(m(b["x"]), b["y"]).item())(state, make_batch())
    af.lift(classify)(state, make_batch())  # the next step works


@pytest.mark.parametrize("n", [1, 3])
def test_the_update_reports_the_weight_the_step_function_returned(n):
    # the token count of the update: what the monitor counts tokens/s from
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = make_batch(n=12)
    step = af.lift(token_loss) if n == 1 else af.with_accumulation(n)(token_loss)
    metrics = step(state, batch)
    assert metrics["weight"].item() == batch["mask"].sum().item()
    assert "weight" not in af.lift(classify)(state, batch).keys()


def test_an_update_the_sharding_does_not_commit_is_skipped_whole(monkeypatch):
    """Fault tolerance's vote (``sharding.commit``): an update the replica groups do not
    commit changes no parameter, optimizer state nor schedule, reports ``skipped`` and is
    counted, as a skipped non-finite update; a committed one is the plain update."""
    from accelfn.parts import sharding  # the replica groups' vote, pretended

    votes = iter([True, False, True])
    monkeypatch.setattr(sharding, "commit", lambda options, ctx: next(votes))
    fake = af.distributed()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    step = fake(classify)
    assert step(state, make_batch(seed=0))["skipped"].item() == 0
    before = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    metrics = step(state, make_batch(seed=1))
    assert metrics["skipped"].item() == 1 and state.step == 2
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(m, optimizer.state[p]["momentum_buffer"])
               for m, p in zip(momentum, model.parameters()))
    assert scheduler.last_epoch == 1 and all(p.grad is None for p in model.parameters())
    assert step(state, make_batch(seed=2))["skipped"].item() == 0
    assert scheduler.last_epoch == 2
