"""The transform algebra's contract: values, declared hooks, phases, the guard, recovery.

Each test reproduces one way the contract used to leak (a stack mutating another, a
misspelled hook passing, order mattering, the guard missing late writes, fp16 wedging, a
swapped model being ignored, clipping differing from clip_grad_norm_, accumulation and the
guard not being transforms, erased types, no public contract kit).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import typing

import pytest
import torch
import torch.nn.functional as F
from conftest import Net, as_dict, assert_params_equal, classify, make_batch
from halving import halve, halved, loss_fn
from torch import nn

import accelfn as af
from accelfn.testing import check_transform, plain_update


def _state(model=None, opt=torch.optim.SGD, **kwargs):
    if model is None:
        torch.manual_seed(0)
        model = Net()
    kwargs = {"lr": 0.1, **kwargs}
    return af.TrainState(model, opt(model.parameters(), **kwargs))


def _poison_grads(value: float) -> af.Transform:
    def poison(ctx):
        ctx.grads()[0].fill_(value)

    return af.Transform("poison", af.Hooks(gradients=poison))


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


def test_stacks_sharing_a_state_share_equal_preparations_and_refuse_other_sharding():
    state = _state()
    log = []

    def count(prepared, st):
        log.append(1)
        return prepared

    counted = af.Transform("counted", af.Hooks(checkpoint=count))
    counted(classify)(state, make_batch())
    af.with_clipping(counted(classify))(state, make_batch())  # equal preparation: shared
    assert log == [1]
    af.lift(classify)(state, make_batch())  # prepares nothing: its own, raw preparation
    fsdp = af.Transform("fake_fsdp", af.Hooks(shard=count))
    with pytest.raises(ValueError, match="shards the model differently"):
        fsdp(classify)(state, make_batch())


# ---------------------------------------------------------------- 2. hooks are declared
def test_an_unknown_hook_is_a_type_error_listing_the_valid_hooks():
    with pytest.raises(TypeError, match=r"unknown hook 'on_grad'.*gradients"):
        af.Transform("mine", af.Hooks(on_grad=lambda ctx: None))  # type: ignore[typeddict-unknown-key]
    with pytest.raises(TypeError, match=r"'gradients' must take 1 positional"):
        af.Transform("mine", af.Hooks(gradients=lambda: None))  # type: ignore[typeddict-item]
    with pytest.raises(TypeError, match="identifier"):
        af.Transform("not a name")


def test_only_transform_records_are_transforms():
    class Lookalike:
        name = "with_amp"

    assert not isinstance(Lookalike(), af.Transform)
    with pytest.raises(TypeError, match="not a transform"):
        af.lift(classify).with_transform(Lookalike())  # type: ignore[arg-type]


# -------------------------------------------------- 3. the same transforms in any order
def _scale(name: str, factor: float, commutes: bool) -> af.Transform:
    def scale(ctx):
        for g in ctx.grads():
            g.mul_(factor).add_(0.001)  # affine: the two orders do not commute mathematically

    return af.Transform(name, af.Hooks(gradients=scale), commutes=commutes)


def test_two_user_gradient_transforms_must_declare_that_they_commute():
    a, b = _scale("first", 0.5, False), _scale("second", 2.0, False)
    with pytest.raises(ValueError, match="first and second both have a 'gradients' hook"):
        a(b(classify))
    with pytest.raises(ValueError, match="first and second both have"):
        b(a(classify))


def test_declared_commuting_transforms_give_the_same_parameters_in_every_order():
    a, b = _scale("first", 0.5, True), _scale("second", 2.0, True)
    results = []
    for order in itertools.permutations([a, b, af.with_clipping(max_norm=0.05),
                                         af.with_accumulation(2)]):
        step = classify
        for t in order:
            step = t(step)
        state = _state()
        for i in range(2):
            step(state, make_batch(seed=i))
        results.append(state.model)
    for model in results[1:]:
        assert_params_equal(model, results[0])


def test_exclusive_phases_take_one_transform():
    def split(ctx, batch):
        return af.Plan((batch,))

    mine = af.Transform("my_split", af.Hooks(split=split))
    with pytest.raises(ValueError, match="both fill the 'split' phase"):
        mine(af.with_accumulation(2)(classify))


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


# ------------------------------ 8. accumulation and the guard are ordinary transforms
def test_accumulation_and_the_guard_are_transforms_users_can_replace():
    assert isinstance(af.with_accumulation(2), af.Transform)
    assert isinstance(af.with_nonfinite(), af.Transform)
    assert "split" in af.with_accumulation(2).hooks and "decide" in af.with_nonfinite().hooks

    def halves(ctx, batch):  # a user split: two halves, weighted by samples
        n = batch.batch_size[0]
        return af.Plan((batch[: n // 2], batch[n // 2:]))

    def never_skip(ctx):
        return af.Decision(checked=False)

    mine = af.Transform("halves", af.Hooks(split=halves))
    lenient = af.Transform("lenient", af.Hooks(decide=never_skip))
    state = _state()
    metrics = lenient(mine(classify))(state, make_batch(n=10))
    ref_state = _state()
    af.with_accumulation(2)(classify)(ref_state, make_batch(n=10))
    assert_params_equal(state.model, ref_state.model)
    assert "skipped" not in metrics.keys()  # nothing was checked

    def sized(ctx, batch):  # the same split, saying its sizes: the same update
        n = batch.batch_size[0]
        return af.Plan((batch[: n // 2], batch[n // 2:]), sizes=(n // 2, n - n // 2))

    sized_state = _state()
    af.Transform("sized", af.Hooks(split=sized))(classify)(sized_state, make_batch(n=10))
    assert_params_equal(sized_state.model, ref_state.model)

    def miscounted(ctx, batch):
        return af.Plan((batch[:5], batch[5:]), sizes=(10,))

    bad_state = _state()
    before = [p.detach().clone() for p in bad_state.model.parameters()]
    with pytest.raises(ValueError, match="2 micro-batches but 1 sizes"):
        af.Transform("miscounted", af.Hooks(split=miscounted))(classify)(bad_state,
                                                                         make_batch(n=10))
    assert all(torch.equal(a, b) for a, b in zip(before, bad_state.model.parameters()))


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
    halving = af.Transform("halve_grads", af.Hooks(gradients=halve), preserves_finite=True)
    report = check_transform(halving, reference=halved, loss_fn=loss_fn)
    assert report.passed == ["reference", "purity", "orders", "resume", "no host sync",
                             "bad input"]
    assert report.orders == 24


def test_check_transform_catches_a_wrong_reference_and_a_host_sync():
    halving = af.Transform("halve_grads", af.Hooks(gradients=halve))
    with pytest.raises(AssertionError, match="against the reference"):
        check_transform(halving, reference=lambda m, o, b: plain_update(
            m, o, b, lambda mm, bb: F.cross_entropy(mm(bb["x"]), bb["y"])))

    def peek(ctx):
        if ctx.grads()[0].abs().sum() > 1e9:  # a data-dependent branch: a host sync
            pass

    with pytest.raises(AssertionError, match="host syncs"):
        check_transform(af.Transform("peek", af.Hooks(gradients=peek), commutes=True))
