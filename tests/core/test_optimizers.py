"""accelfn.core.optimizers: the update's optimizer calls are torch's own (``optimizer.step()``,
``zero_grad(set_to_none=True)``), so that what hooks onto them (step hooks, the profiler's
labels, a scheduler's call tracking, a ``step`` replaced on the instance) sees every update."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from tensordict import TensorDict
from torch import nn

import accelfn as af
from accelfn.core import optimizers


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))


def _grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def test_stepper_runs_every_optimizers_step_with_its_hooks_in_order() -> None:
    model = _model()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.AdamW(model[2].parameters(), lr=0.1)
    calls: list[str] = []
    handles = [
        first.register_step_pre_hook(lambda *a: calls.append("first pre")),
        first.register_step_post_hook(lambda *a: calls.append("first post")),
        second.register_step_pre_hook(lambda *a: calls.append("second pre")),
        optimizer_module.register_optimizer_step_post_hook(
            lambda *a: calls.append("global post")),
    ]
    try:
        _grads(model, 0)
        optimizers.stepper((first, second))()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["first pre", "first post", "global post", "second pre", "global post"]
    assert second.state  # stepped


def test_stepper_calls_a_step_replaced_on_the_instance_after_it_was_built() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = optimizers.stepper((optimizer,))
    calls: list[int] = []
    original = optimizer.step
    optimizer.step = lambda closure=None: calls.append(1) or original(closure)  # type: ignore[method-assign]
    _grads(model, 0)
    step()
    assert calls == [1]


def test_clear_grads_sets_them_to_none_and_calls_nothing_when_none_is_there() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)  # not model[2]'s
    _grads(model, 0)
    optimizers.clear_grads((optimizer,))
    assert [p.grad is None for p in model.parameters()] == [True, True, False, False]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        optimizers.clear_grads((optimizer,))  # nothing to clear: no call
        model[0].weight.grad = torch.ones_like(model[0].weight)
        optimizers.clear_grads((optimizer,))  # torch's call, with its profiler label
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.zero_grad#SGD.zero_grad") == 1
    assert model[0].weight.grad is None


def test_clear_grads_calls_an_optimizers_own_zero_grad_always() -> None:
    class Own(torch.optim.SGD):
        calls = 0

        def zero_grad(self, set_to_none: bool = True) -> None:
            Own.calls += 1
            super().zero_grad(set_to_none)

    model = _model()
    optimizers.clear_grads((Own(model.parameters(), lr=0.1),))
    assert Own.calls == 1


def _step_and_state(scheduler: bool = False):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1) if scheduler else None
    state = af.TrainState(model, optimizer, scheduler=lr_scheduler)
    step = af.with_clipping(max_norm=0.5)(af.with_accumulation(2)(
        lambda m, b: nn.functional.cross_entropy(m(b["x"]), b["y"])))
    g = torch.Generator().manual_seed(1)
    batch = TensorDict({"x": torch.randn(8, 8, generator=g),
                        "y": torch.randint(0, 3, (8,), generator=g)}, batch_size=[8])
    return step, state, batch


def test_a_steps_update_is_seen_by_the_optimizers_hooks_and_the_profiler() -> None:
    step, state, batch = _step_and_state()
    calls: list[str] = []
    state.optimizer.register_step_pre_hook(lambda *a: calls.append("pre"))
    state.optimizer.register_step_post_hook(lambda *a: calls.append("post"))
    step(state, batch)
    assert calls == ["pre", "post"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(state, batch)
    names = [e.name for e in prof.events()]
    assert names.count("Optimizer.step#AdamW.step") == 1
    assert names.count("Optimizer.zero_grad#AdamW.zero_grad") == 1  # after the update only
    assert calls == ["pre", "post"] * 2


def test_a_scheduler_sees_the_optimizer_step_before_its_own() -> None:
    step, state, batch = _step_and_state(scheduler=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        step(state, batch)
        step(state, batch)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)  # stepped twice
