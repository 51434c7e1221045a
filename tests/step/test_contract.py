"""The transform algebra's contract: values, places, gradient transforms, the guard, recovery.

Each test reproduces one way the contract used to leak (a stack mutating another, a
malformed extension passing, order mattering, the guard missing late writes, fp16 wedging, a
swapped model being ignored, clipping differing from clip_grad_norm_, accumulation and the
guard not being replaceable, erased types, no public contract kit).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import typing

import pytest
import torch
import torch.nn.functional as F
from halving import halve, halved, loss_fn
from helpers import Net, as_dict, assert_params_equal, classify, make_batch
from torch import nn

import accelfn as af
from accelfn.testing import check_transform, plain_update


def _state(model=None, opt=torch.optim.SGD, **kwargs):
    if model is None:
        torch.manual_seed(0)
        model = Net()
    kwargs = {"lr": 0.1, **kwargs}
    return af.TrainState(model, opt(model.parameters(), **kwargs))


def _poison_grads(value: float) -> af.GradientTransform:
    def poison(grads, params, state):
        grads[0].fill_(value)

    return af.GradientTransform("poison", poison)


# ------------------------------------------------------------------- 1. steps are values
def test_building_a_stack_never_changes_another_stack_or_transform():
    fsdp = af.distributed(strategy="fsdp")
    s1 = fsdp(classify)
    before = (s1.transforms, copy.copy(s1.transforms[0].options))
    s2 = af.with_amp(dtype=torch.float16)(s1)
    assert s1.transforms == before[0] and s1.transforms[0].options == before[1]
    assert s1.transforms[0] is fsdp and s2.transforms[0] is fsdp
    with pytest.raises(dataclasses.FrozenInstanceError):
        fsdp.label = "changed"  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        s1.transforms = ()  # type: ignore[misc]
    assert af.with_clipping(max_norm=1.0) == af.with_clipping(max_norm=1.0)
    assert af.with_clipping(max_norm=1.0) != af.with_clipping(max_norm=2.0)


def test_one_step_in_two_stacks_and_two_states_behaves_as_if_built_alone():
    torch.manual_seed(0)
    base = Net()
    inner = af.with_accumulation(2)(classify)
    outer = af.with_amp(af.with_clipping(max_norm=0.1)(inner))
    a, b = _state(copy.deepcopy(base)), _state(copy.deepcopy(base))
    for i in range(3):  # interleaved: neither use disturbs the other
        inner(a, make_batch(seed=i))
        outer(b, make_batch(seed=i))
    alone_a, alone_b = _state(copy.deepcopy(base)), _state(copy.deepcopy(base))
    fresh_inner = af.with_accumulation(2)(classify)
    fresh_outer = af.with_amp(af.with_clipping(max_norm=0.1)(af.with_accumulation(2)(classify)))
    for i in range(3):
        fresh_inner(alone_a, make_batch(seed=i))
    for i in range(3):
        fresh_outer(alone_b, make_batch(seed=i))
    assert_params_equal(a.model, alone_a.model)
    assert_params_equal(b.model, alone_b.model)


def test_stacks_sharing_a_state_share_equal_preparations_and_refuse_other_sharding(
        monkeypatch):
    state = _state()
    log = []

    def count(options, prepared, st):
        log.append(1)
        return prepared

    from accelfn.parts import activation_checkpointing  # its preparation, counted

    monkeypatch.setattr(activation_checkpointing, "wrap", count)
    counted = af.checkpointed(blocks=torch.nn.Linear)
    counted(classify)(state, make_batch())
    af.with_clipping(counted(classify))(state, make_batch())  # equal preparation: shared
    assert log == [1]
    af.lift(classify)(state, make_batch())  # prepares nothing: its own, raw preparation
    with pytest.raises(ValueError, match="shards the model differently"):
        af.distributed(strategy="fsdp")(classify)(state, make_batch())


# ------------------------------------------------- 2. extensions are checked when built
def test_a_malformed_gradient_transform_is_a_type_error_saying_the_signature():
    with pytest.raises(TypeError, match=r"update must take 3 positional argument\(s\) "
                                        r"\(grads, params, state\)"):
        af.GradientTransform("mine", lambda grads: None)
    with pytest.raises(TypeError, match=r"init must take 1 positional"):
        af.GradientTransform("mine", lambda g, p, s: None, init=lambda: {})
    with pytest.raises(TypeError, match="update must be a function"):
        af.GradientTransform("mine", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="identifier"):
        af.GradientTransform("not a name", lambda g, p, s: None)
    with pytest.raises(TypeError, match="identifier"):
        af.Transform("not a name", None)
    with pytest.raises(TypeError, match=r"fills no place of the update.*GradientTransform"):
        af.Transform("mine", object())(classify)


def test_only_transform_records_are_transforms():
    class Lookalike:
        name = "with_amp"

    assert not isinstance(Lookalike(), af.Transform)
    with pytest.raises(TypeError, match="not a transform"):
        af.lift(classify).with_transform(Lookalike())  # type: ignore[arg-type]


# -------------------------------------------------- 3. the same transforms in any order
def _scale(name: str, factor: float) -> af.GradientTransform:
    def scale(grads, params, state):
        for g in grads:
            g.mul_(factor).add_(0.001)  # affine: the two orders do not commute mathematically

    return af.GradientTransform(name, scale)


def _by_hand(edits, batches):
    """The plain loop: the gradient edits in the order given, then clipping."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches:
        classify(model, as_dict(batch))["loss"].backward()
        for factor in edits:
            for p in model.parameters():
                p.grad.mul_(factor).add_(0.001)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def test_user_gradient_transforms_run_in_stacking_order_among_builtins_in_any_order():
    """b(a(fn)) runs a then b (innermost first, as optax.chain(a, b)), whatever the
    built-ins' order around and between them; the built-ins keep their places."""
    a, b = _scale("first", 0.5), _scale("second", 2.0)
    batches = [make_batch(seed=i) for i in range(2)]
    expected = {("first", "second"): _by_hand([0.5, 2.0], batches),
                ("second", "first"): _by_hand([2.0, 0.5], batches)}
    assert not torch.equal(*(next(m.parameters()) for m in expected.values()))
    for order in itertools.permutations([a, b, af.with_clipping(max_norm=0.05)]):
        step = classify
        for t in order:
            step = t(step)
        state = _state()
        for batch in batches:
            step(state, batch)
        users = tuple(t.name for t in order if t.name in ("first", "second"))
        assert_params_equal(state.model, expected[users])


def test_a_place_takes_one_transform_and_a_name_one_transform():
    with pytest.raises(ValueError, match="with_accumulation is applied twice"):
        af.with_accumulation(4)(af.with_accumulation(2)(classify))
    mine = af.Transform("my_split", af.parts.accumulation.Accumulation(3))
    with pytest.raises(ValueError, match="with_accumulation and my_split both fill the "
                                         "'accumulation' place"):
        mine(af.with_accumulation(2)(classify))
    with pytest.raises(ValueError, match="first is applied twice"):
        _scale("first", 0.5)(_scale("first", 2.0)(classify))


# -------------------------------------- 4. the guard decides on the gradients it applies
@pytest.mark.parametrize("stack", ["clipping", "fp16", "fp16+clipping"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_guard_sees_gradients_made_nonfinite_after_clipping_or_unscaling(stack, value):
    step = _poison_grads(value)(classify)
    if "clipping" in stack:
        step = af.with_clipping(max_norm=1.0)(step)
    if "fp16" in stack:
        step = af.with_amp(dtype=torch.float16)(step)
    state = _state()
    before = [p.detach().clone() for p in state.model.parameters()]
    metrics = step(state, make_batch())
    assert metrics["skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))
    assert state.get_slot("nonfinite").skipped == 1


# --------------------------------------------- 5. any error leaves the next step working
def _fp16_reference(base, batches, skip):
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for i, batch in enumerate(batches):
        if i == skip:
            continue
        with torch.autocast("cpu", dtype=torch.float16):
            loss = classify(model, as_dict(batch))["loss"]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model, scaler


@pytest.mark.parametrize("failure", ["nonfinite", "user", "oom"])
def test_fp16_recovers_from_an_error_and_equals_a_run_that_skipped_that_batch(failure):
    torch.manual_seed(0)
    base = Net()
    batches = [make_batch(seed=i) for i in range(11)]
    bad = 3

    def fn(model, batch):
        out = classify(model, batch)
        if batch is batches[bad] or torch.equal(batch["x"], batches[bad]["x"]):
            if failure == "nonfinite":
                return {**out, "loss": out["loss"] * float("nan")}
            if failure == "user":
                raise RuntimeError("a bug in the step function")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return out

    step = af.with_nonfinite(policy="raise")(af.with_amp(dtype=torch.float16,
                                                          init_scale=2.0**8)(fn))
    state = _state(copy.deepcopy(base))
    for i, batch in enumerate(batches):
        if i == bad:
            with pytest.raises((af.NonFiniteError, RuntimeError, torch.OutOfMemoryError)):
                step(state, batch)
            continue
        step(state, batch)
    ref, scaler = _fp16_reference(base, batches, bad)
    assert_params_equal(state.model, ref)
    assert state.get_slot("with_amp").get_scale() == scaler.get_scale()


def test_skip_past_the_limit_raises_and_the_same_state_trains_on():
    torch.manual_seed(0)
    base = Net()
    state = _state(copy.deepcopy(base))

    def nan_loss(model, batch):
        return classify(model, batch)["loss"] * float("nan")

    amp = af.with_amp(dtype=torch.float16)
    guard = af.with_nonfinite(max_consecutive=2)
    guard(amp(nan_loss))(state, make_batch())  # skipped: the scale backs off once
    with pytest.raises(af.NonFiniteError, match="2 updates in a row"):
        guard(amp(nan_loss))(state, make_batch())  # aborted: the scaler is left as it was
    good = guard(amp(classify))
    for i in range(5):
        good(state, make_batch(seed=i))
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for i in range(-1, 5):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = classify(ref, as_dict(make_batch(seed=max(i, 0))))["loss"]
        scaler.scale(loss * float("nan") if i < 0 else loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    assert_params_equal(state.model, ref)
    assert state.get_slot("with_amp").get_scale() == scaler.get_scale()


# ------------------------------------------------------- 6. model and optimizer are fixed
def test_replacing_the_model_or_optimizer_is_refused_with_the_fix():
    state = _state()
    af.lift(classify)(state, make_batch())
    with pytest.raises(AttributeError, match=r"Build a new TrainState\(model, optimizer\)"):
        state.model = Net()  # type: ignore[misc]
    with pytest.raises(AttributeError, match="Build a new TrainState"):
        state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)  # type: ignore[misc]


# --------------------------------------------- 7. clipping is clip_grad_norm_ bitwise
class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList([nn.Linear(6, 64), nn.LayerNorm(64), nn.Linear(64, 64),
                                     nn.LayerNorm(64), nn.Linear(64, 4)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _groups(model):
    """No-decay parameters first: the optimizer's order is not the model's."""
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.1}]


def test_clipping_equals_clip_grad_norm_of_model_parameters_bitwise_with_groups():
    a, b = Wide(), Wide()
    oa = torch.optim.AdamW(_groups(a), lr=1e-2)
    ob = torch.optim.AdamW(_groups(b), lr=1e-2)
    state = af.TrainState(a, oa)
    step = af.with_clipping(max_norm=0.5)(classify)
    differs = False
    for i in range(20):
        batch = make_batch(n=32, seed=i)
        metrics = step(state, batch)
        plain = classify(b, as_dict(batch))
        plain["loss"].backward()
        grads_in_optimizer_order = [p.grad for g in ob.param_groups for p in g["params"]]
        other = torch.nn.utils.get_total_norm(grads_in_optimizer_order)
        norm = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
        differs |= not torch.equal(other, norm)
        assert torch.equal(metrics["grad_norm"], norm), i
        ob.step()
        ob.zero_grad(set_to_none=True)
    assert differs, "the example must be one where the summation order changes the norm"
    assert_params_equal(a, b)


def test_value_clipping_equals_clip_grad_value_bitwise():
    a, b = Wide(), Wide()
    state = af.TrainState(a, torch.optim.SGD(_groups(a), lr=0.1))
    ob = torch.optim.SGD(_groups(b), lr=0.1)
    step = af.with_clipping(max_value=0.01)(classify)
    for i in range(5):
        batch = make_batch(n=16, seed=i)
        step(state, batch)
        plain_update(b, ob, as_dict(batch), classify,
                     edit_grads=lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.01))
    assert_params_equal(a, b)


# -------------------- 8. the split and the non-finite decision are options users replace
def test_a_custom_split_and_a_custom_skip_verdict_are_options_of_their_builtins():
    def halves(batch, n):  # a user split: two uneven halves, weighted by samples
        return [batch[:3], batch[3:]]

    state = _state()
    af.with_accumulation(2, split=halves)(classify)(state, make_batch(n=10))
    ref = copy.deepcopy(_state().model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batch = as_dict(make_batch(n=10))
    for lo, hi in ((0, 3), (3, 10)):
        micro = {k: v[lo:hi] for k, v in batch.items()}
        (classify(ref, micro)["loss"] * ((hi - lo) / 10)).backward()
    opt.step()
    assert_params_equal(state.model, ref)
    with pytest.raises(ValueError, match="non-empty list of micro-batches"):
        af.with_accumulation(2, split=lambda b, n: [])(classify)(_state(), make_batch())
    with pytest.raises(ValueError, match=r"split=.*mode=.split."):
        af.with_accumulation(2, mode="calls", split=halves)

    # a loss-spike verdict of the user's, decided on the device with the non-finite checks
    spiky = af.with_nonfinite(skip_if=lambda loss, grads: loss > 0.5)(classify)
    state = _state()
    before = [p.detach().clone() for p in state.model.parameters()]
    metrics = spiky(state, make_batch())
    assert metrics["skipped"] == 1 and state.get_slot("nonfinite").skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))
    assert af.with_nonfinite(skip_if=lambda loss, grads: loss > 1e9)(classify)(
        state, make_batch())["skipped"] == 0
    with pytest.raises(af.NonFiniteError, match=r"skip_if\(loss, grads\) true at update"):
        af.with_nonfinite(policy="raise", skip_if=lambda loss, grads: loss > 0.5)(classify)(
            state, make_batch())
    with pytest.raises(TypeError, match="one-element device tensor"):
        af.with_nonfinite(skip_if=lambda loss, grads: True)(classify)(state, make_batch())


# ---------------------------------------------------------------- 9. types are kept
@pytest.mark.parametrize("name", ["with_amp", "with_clipping", "compiled", "checkpointed",
                                  "distributed", "with_ema", "with_nonfinite"])
def test_bare_and_configured_forms_are_real_overloads(name):
    fn = getattr(af, name)
    overloads = typing.get_overloads(fn)
    assert len(overloads) == 2
    assert not hasattr(fn, "__signature__")
    assert isinstance(fn(), af.Transform)
    assert isinstance(fn(classify), af.Step)


# ----------------------------------------------------------- 10. the public contract kit
def test_check_transform_passes_a_correct_user_transform():
    halving = af.GradientTransform("halve_grads", halve)
    report = check_transform(halving, reference=halved, loss_fn=loss_fn)
    assert report.passed == ["reference", "purity", "orders", "resume", "no host sync",
                             "bad input"]
    assert report.orders == 24


def test_check_transform_catches_a_wrong_reference_and_a_host_sync():
    halving = af.GradientTransform("halve_grads", halve)
    with pytest.raises(AssertionError, match="against the reference"):
        check_transform(halving, reference=lambda m, o, b: plain_update(
            m, o, b, lambda mm, bb: F.cross_entropy(mm(bb["x"]), bb["y"])))

    def peek(grads, params, state):
        if grads[0].abs().sum() > 1e9:  # a data-dependent branch: a host sync
            pass

    with pytest.raises(AssertionError, match="host syncs"):
        check_transform(af.GradientTransform("peek", peek))


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("fp16", [False, True])
def test_value_clipping_does_not_hide_an_infinite_gradient_from_the_guard(value, fp16):
    """clip_grad_value_ turns an Inf gradient into max_value: the update went through."""

    class Poison(torch.autograd.Function):  # identity forward, a bad gradient backward
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return torch.full_like(grad, value)

    def poisoned(model, batch):  # a finite loss; the head's weight gradient all Inf or NaN
        h = model.inp(batch["x"])
        for block in model.blocks:
            h = block(h)
        logits = F.linear(h, Poison.apply(model.head.weight), model.head.bias)
        return F.cross_entropy(logits, batch["y"])

    step = af.with_clipping(max_value=0.1)(poisoned)
    if fp16:
        step = af.with_amp(dtype=torch.float16)(step)
    state = _state()
    before = [p.detach().clone() for p in state.model.parameters()]
    metrics = step(state, make_batch())
    assert torch.isfinite(metrics["loss"])
    assert metrics["skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))
