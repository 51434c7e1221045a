"""accelfn.core.compat_optim: the optimizer step and the clip called directly, bitwise
equal to torch's calls, and torch's own calls whenever a hook, a profiler or a replaced
``step`` asks for them."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.optim.optimizer as optimizer_module
from torch import nn

from accelfn.core import compat, compat_optim


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))


def _grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_direct_step_is_bitwise_the_optimizer_step(name: str) -> None:
    a, b = _model(), _model()
    oa, ob = OPTIMIZERS[name](a.parameters()), OPTIMIZERS[name](b.parameters())
    step = compat_optim.direct_step(ob)
    for seed in range(4):
        _grads(a, seed)
        _grads(b, seed)
        oa.step()
        step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert str(oa.state_dict()) == str(ob.state_dict())


def _labels(fn) -> list[str]:
    seen: list[str] = []
    with compat.aten_observer(lambda op, args, kwargs: seen.append(op)):
        fn()
    return seen


def test_direct_step_skips_the_profiling_wrapper_when_nothing_asks_for_it() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _grads(model, 0)
    wrapped = _labels(optimizer.step)
    direct = _labels(compat_optim.direct_step(optimizer))
    assert any("record_function" in op for op in wrapped), wrapped
    assert not any("record_function" in op for op in direct), direct


def test_direct_step_runs_hooks_through_torchs_step() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compat_optim.direct_step(optimizer)
    calls: list[str] = []
    handles = [
        optimizer.register_step_pre_hook(lambda *a: calls.append("pre")),
        optimizer.register_step_post_hook(lambda *a: calls.append("post")),
        optimizer_module.register_optimizer_step_pre_hook(
            lambda *a: calls.append("global pre")),
        optimizer_module.register_optimizer_step_post_hook(
            lambda *a: calls.append("global post")),
    ]
    try:
        _grads(model, 0)
        step()
    finally:
        for handle in handles:
            handle.remove()
    assert calls == ["global pre", "pre", "post", "global post"]
    calls.clear()
    step()  # removed: none runs
    assert calls == []


def test_direct_step_keeps_the_profiler_label_while_profiling() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compat_optim.direct_step(optimizer)
    _grads(model, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    assert any(e.name == "Optimizer.step#SGD.step" for e in prof.events())


def test_direct_step_calls_a_step_replaced_on_the_instance() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []
    original = optimizer.step
    optimizer.step = lambda closure=None: calls.append(1) or original(closure)  # type: ignore[method-assign]
    _grads(model, 0)
    compat_optim.direct_step(optimizer)()
    assert calls == [1]


def test_direct_step_tells_a_scheduler_the_optimizer_stepped() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    assert getattr(optimizer.step, "_wrapped_by_lr_sched", False)  # the tracker we recognise
    step = compat_optim.direct_step(optimizer)
    _grads(model, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
        step()
        scheduler.step()
    assert optimizer._opt_called  # type: ignore[attr-defined]


def test_direct_step_lets_torch_compile_trace_the_optimizer_step(monkeypatch) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = compat_optim.direct_step(optimizer)
    _grads(model, 0)
    monkeypatch.setattr(compat_optim, "_compiling", lambda: True)
    assert any("record_function" in op for op in _labels(step))  # torch's own step


def test_the_private_names_it_uses_exist() -> None:
    step = torch.optim.SGD.step
    assert getattr(step, "hooked", False) and callable(step.__wrapped__)
    assert isinstance(optimizer_module._global_optimizer_pre_hooks, dict)
    assert isinstance(optimizer_module._global_optimizer_post_hooks, dict)
    optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert isinstance(optimizer._optimizer_step_pre_hooks, dict)
    assert isinstance(optimizer._optimizer_step_post_hooks, dict)
    assert "cpu" in compat_optim._foreach_devices


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("scale", [1.0, 10.0], ids=["unclipped", "clipped"])
def test_clip_grad_norm_in_one_call_is_bitwise_torchs(norm_type: float, scale: float) -> None:
    a, b = _model(), _model()
    _grads(a, 4)
    _grads(b, 4)
    for p in [*a.parameters(), *b.parameters()]:
        assert p.grad is not None
        p.grad.mul_(scale)
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.3, norm_type)
    norm = compat_optim.clip_grad_norm_([p.grad for p in b.parameters()], 0.3, norm_type)
    assert norm is not None and torch.equal(norm, expected)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad)


def test_clip_grad_norm_in_one_call_leaves_other_gradients_to_torch() -> None:
    grads = [torch.ones(3), torch.ones(2, dtype=torch.float64)]
    assert not compat_optim._plain(grads)
    assert compat_optim.clip_grad_norm_(grads, 0.1, 2.0) is None
    assert compat_optim.clip_grad_norm_([], 0.1, 2.0) is None
    assert all(torch.equal(g, torch.ones_like(g)) for g in grads)  # nothing changed
