"""Gradient transforms checked (accelfn/step/chain.py): after each of the user's transforms,
before anything of the optimizers changes, every gradient has its parameter's shape, dtype
and device, and no parameter was written; otherwise the call fails naming the transform and
applies nothing (the gradients cleared, parameters, optimizer state, scheduler and the
transforms' states as they were), and the next call is a clean update."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Net, as_dict, assert_params_equal, classify, make_batch

import accelfn as af
from accelfn.step.chain import GradientTransformError

BATCHES = [make_batch(seed=i) for i in range(4)]


def _counter(name="counter"):
    """A well-behaved stateful transform: halves the gradients and counts its updates."""

    def update(grads, params, state):
        for g in grads:
            g.mul_(0.5)
        return {"updates": state["updates"] + 1}

    return af.GradientTransform(name, update, init=lambda params: {"updates": 0})


def _breaking(name, break_it):
    """A transform that calls ``break_it(grads, params)`` while ``armed["on"]``."""
    armed = {"on": False}

    def update(grads, params, state):
        if armed["on"]:
            break_it(grads, params)

    return af.GradientTransform(name, update), armed


def _wrong_shape(grads, params):
    grads[-1].set_(torch.zeros(2))  # the head's bias gradient, now of 2 elements, not 4


def _wrong_dtype(grads, params):
    grads[0].data = grads[0].data.double()


def _writes_detached(grads, params):
    params[0].detach().mul_(0.999)  # a decay of the weights: the optimizer's job


def _writes_under_no_grad(grads, params):
    with torch.no_grad():
        params[1].add_(1.0)


def _setup():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return af.TrainState(model, optimizer, scheduler=scheduler)


def _snapshot(state):
    return copy.deepcopy(state.state_dict())


def _assert_same_tensors(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_tensors(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tensors(x, y, f"{where}/{i}")
    else:
        assert a == b, where


BROKEN = {
    "wrong_shape": (_wrong_shape, r"gradient of shape \(2,\).*parameter 'head\.bias'.*\(4,\)"),
    "wrong_dtype": (_wrong_dtype, r"torch\.float64.*parameter 'inp\.weight'.*torch\.float32"),
}
WRITES = {
    "detached": (_writes_detached, r"wrote into the parameter 'inp\.weight'"),
    "no_grad": (_writes_under_no_grad, r"wrote into the parameter 'inp\.bias'"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_gradient_unlike_its_parameter_fails_naming_the_transform_and_changes_nothing(kind):
    """Today a wrong-shape gradient reaches the optimizer, whose foreach step moves every
    momentum buffer before it fails on the shape (and a float64 gradient is applied and
    turns the momentum buffer into float64), and the error names no transform."""
    break_it, message = BROKEN[kind]
    bad, armed = _breaking("bad", break_it)
    step = bad(_counter()(classify))  # the counter runs first: its new state must not stay
    state = _setup()
    twin = _setup()
    for batch in BATCHES[:2]:  # momentum buffers, a stepped scheduler, a counter at 2
        step(state, batch)
        step(twin, batch)
    before = _snapshot(state)
    params = [p.detach().clone() for p in state.model.parameters()]

    armed["on"] = True
    with pytest.raises(GradientTransformError, match=rf"gradient transform 'bad'.*{message}"):
        step(state, BATCHES[2])
    armed["on"] = False

    assert all(p.grad is None for p in state.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(params, state.model.parameters()))
    _assert_same_tensors(before, _snapshot(state))  # optimizer, scheduler, slots, step count
    assert state.state_dict()["slots"]["gradients.counter"]["updates"] == 2
    assert state.step == 2
    for batch in BATCHES[2:]:  # the next calls are clean updates, as if it never came
        step(state, batch)
        step(twin, batch)
    assert_params_equal(state.model, twin.model)
    _assert_same_tensors(_snapshot(twin), _snapshot(state))


def test_the_error_is_a_runtime_error_that_says_what_to_do():
    bad, armed = _breaking("bad", _wrong_shape)
    armed["on"] = True
    with pytest.raises(RuntimeError) as caught:
        bad(classify)(_setup(), BATCHES[0])
    text = str(caught.value)
    assert "in place" in text and "no update was applied" in text


@pytest.mark.parametrize("how", sorted(WRITES))
def test_a_transform_writing_into_a_parameter_is_refused_naming_it(how):
    """Today the write goes undetected: with a NaN loss the update is skipped, and the model
    changes all the same."""
    write, message = WRITES[how]
    bad, armed = _breaking("decay", write)
    step = bad(_counter()(classify))
    state = _setup()
    step(state, BATCHES[0])
    before = _snapshot(state)
    armed["on"] = True
    with pytest.raises(GradientTransformError,
                       match=rf"gradient transform 'decay' {message}.*after_step"):
        step(state, BATCHES[1])
    armed["on"] = False
    assert all(p.grad is None for p in state.model.parameters())
    after = _snapshot(state)
    # the write itself stays (the engine cannot undo it, and says so); nothing else moved
    model_keys = [k for k in before["model"] if k in ("inp.weight", "inp.bias")]
    for key in before["model"]:
        if key not in model_keys:
            assert torch.equal(before["model"][key], after["model"][key]), key
    _assert_same_tensors({k: v for k, v in before.items() if k != "model"},
                         {k: v for k, v in after.items() if k != "model"})
    assert state.step == 1
    step(state, BATCHES[2])
    assert state.step == 2


def test_a_write_into_a_parameter_is_caught_before_a_skip_for_nan_hides_it():
    bad, armed = _breaking("decay", _writes_detached)

    def nan_loss(model, batch):
        out = classify(model, batch)
        return {**out, "loss": out["loss"] * float("nan")}

    state = _setup()
    armed["on"] = True
    with pytest.raises(GradientTransformError, match="decay"):
        bad(nan_loss)(state, BATCHES[0])


def test_the_second_transform_of_a_chain_is_the_one_named():
    bad, armed = _breaking("second", _wrong_shape)
    step = af.chain(_counter("first"), bad)(classify)
    state = _setup()
    armed["on"] = True
    with pytest.raises(GradientTransformError, match="'second'") as caught:
        step(state, BATCHES[0])
    assert "'first'" not in str(caught.value)
    assert state.get_slot("gradients.first").value["updates"] == 0  # made by init, not moved


def test_well_behaved_transforms_pass_the_checks_under_amp_accumulation_and_clipping():
    """No false alarm: fp16 unscaling, micro-batch weighting and clipping around a
    transform that edits its gradients in place, equal to the plain loop."""
    step = af.with_amp(dtype=torch.float16)(af.with_accumulation(2)(
        af.with_clipping(max_norm=0.5)(_counter()(classify))))
    state = _setup()
    for batch in BATCHES:
        metrics = step(state, batch)
        assert metrics["skipped"] == 0
    assert state.state_dict()["slots"]["gradients.counter"]["updates"] == len(BATCHES)


def test_the_checks_read_the_parameters_only_when_there_are_gradient_transforms(monkeypatch):
    """The hot path without user transforms is untouched: no version counter is read."""
    from accelfn.step import chain

    calls = []
    real = chain._check
    monkeypatch.setattr(chain, "_check", lambda *a: calls.append(1) or real(*a))
    state = _setup()
    af.with_clipping(max_norm=0.5)(classify)(state, BATCHES[0])
    assert calls == []
    _counter()(classify)(state, BATCHES[1])
    assert calls == [1]


def test_a_fused_optimizer_fails_the_same_way():
    bad, armed = _breaking("bad", _wrong_shape)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    state = af.TrainState(model, optimizer)
    step = bad(classify)
    step(state, BATCHES[0])
    buffers = {k: v["momentum_buffer"].clone() for k, v in optimizer.state_dict()["state"].items()}
    armed["on"] = True
    with pytest.raises(GradientTransformError, match="'bad'"):
        step(state, BATCHES[1])
    armed["on"] = False
    for k, v in optimizer.state_dict()["state"].items():
        assert torch.equal(v["momentum_buffer"], buffers[k])
    step(state, BATCHES[2])
    state.sync()
    assert state.step == 2


def test_the_plain_loop_reference_of_the_clean_updates():
    """The clean updates around a refused call equal the plain loop that never saw it."""
    bad, armed = _breaking("bad", _wrong_shape)
    state = _setup()
    step = bad(classify)
    torch.manual_seed(0)
    plain = Net()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for i, batch in enumerate(BATCHES):
        if i == 2:
            armed["on"] = True
            with pytest.raises(GradientTransformError):
                step(state, batch)
            armed["on"] = False
        step(state, batch)
        classify(plain, as_dict(batch))["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    assert_params_equal(state.model, plain)


def test_a_gradient_on_another_device_is_named_too():
    """A gradient moved in place to another device (``g.data = g.data.to("cuda:1")`` on a
    machine with two GPUs) fails the same comparison; on the CPU the check is fed a
    parameter's device as if it were elsewhere."""
    from types import SimpleNamespace

    from accelfn.step import chain

    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    expected = [(p.shape, p.dtype, p.device) for p in params]
    expected[2] = (params[2].shape, params[2].dtype, torch.device("meta"))
    ctx = SimpleNamespace(state=SimpleNamespace(model=model))
    bad = af.GradientTransform("mover", lambda g, p, s: None)
    with pytest.raises(GradientTransformError,
                       match=r"'mover' left a gradient of shape .* on cpu for the parameter "
                             r"'blocks\.0\.norm\.weight' .* on meta"):
        chain._check(bad, grads, params, [p._version for p in params], expected, ctx)
