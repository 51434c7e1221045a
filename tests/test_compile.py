"""compiled: torch.compile of the model (and optimizer step) without recompiling."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Net, as_dict, assert_params_equal, classify, make_batch
from reference import reference_update

import accelfn as af
from accelfn.core import compat


@pytest.fixture
def no_recompile():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


@pytest.mark.compile
def test_compiled_stack_matches_eager_reference_without_recompiling(no_recompile):
    torch.manual_seed(0)
    base = Net()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    step = af.compiled(af.with_accumulation(2)(af.with_clipping(max_norm=0.05)(classify)))
    state = af.TrainState(m1, o1)
    for i in range(3):
        batch = make_batch(n=10, seed=i)  # micro-batches of 5: equal shapes every step
        step(state, batch)
        reference_update(m2, o2, as_dict(batch), classify, micro=2, max_norm=0.05)
    assert_params_equal(m1, m2, exact=False, atol=1e-5, rtol=1e-4)
    with torch._dynamo.config.patch(error_on_recompile=False):
        metrics = step.evaluate(state, make_batch(n=10))  # no_grad and eval mode: new graph
    assert torch.isfinite(metrics["loss"])
    # compiled in place: the function receives the model itself, whose call is compiled
    assert step.prepare(state).model is m1
    assert type(m1) is Net and compat.is_compiled(m1)


@pytest.mark.compile
def test_compiled_optimizer_with_scheduler_does_not_recompile(no_recompile):
    torch.manual_seed(0)
    base = Net()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    # fused: the non-finite guard skips on the device inside the compiled optimizer step
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2, fused=True)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    s1 = torch.optim.lr_scheduler.LambdaLR(o1, lambda i: 1.0 / (1 + i))
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, lambda i: 1.0 / (1 + i))
    step = af.compiled(optimizer=True)(classify)
    state = af.TrainState(m1, o1, scheduler=s1)
    lrs = []
    for i in range(4):
        batch = make_batch(seed=i)
        lrs.append(float(step(state, batch)["lr"]))
        reference_update(m2, o2, as_dict(batch), classify, scheduler=s2)
    assert lrs == pytest.approx([1e-2, 5e-3, 1e-2 / 3, 2.5e-3])
    state.sync()
    assert float(s1.get_last_lr()[0]) == pytest.approx(s2.get_last_lr()[0])
    assert isinstance(o1.param_groups[0]["lr"], torch.Tensor)
    assert_params_equal(m1, m2, exact=False, atol=1e-5, rtol=1e-4)


def test_compile_options_are_checked():
    with pytest.raises(ValueError, match="unknown"):
        af.compiled(mode="turbo")
    with pytest.raises(ValueError, match="backend"):
        af.compiled(backend="nonexistent")
    with pytest.raises(ValueError, match="not both"):
        af.compiled(mode="default", options={"epilogue_fusion": True})
    assert repr(af.compiled(mode="max-autotune", fullgraph=True)(classify)).startswith(
        "compiled(max-autotune, fullgraph)")


@pytest.mark.compile
def test_compiled_optimizer_after_loading_a_plain_checkpoint_does_not_recompile(no_recompile):
    """optimizer.load_state_dict puts back the float learning rates of a plain run's
    checkpoint; the compiled optimizer step holds them as tensors again, so the schedule
    still changes the rate without recompiling."""
    torch.manual_seed(0)
    base = Net()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    s1 = torch.optim.lr_scheduler.LambdaLR(o1, lambda i: 1.0 / (1 + i))
    s2 = torch.optim.lr_scheduler.LambdaLR(o2, lambda i: 1.0 / (1 + i))
    step = af.compiled(optimizer=True, backend="eager")(classify)
    state = af.TrainState(m1, o1, scheduler=s1)
    step(state, make_batch(seed=0))
    reference_update(m2, o2, as_dict(make_batch(seed=0)), classify, scheduler=s2)
    o1.load_state_dict(copy.deepcopy(o2.state_dict()))  # a plain run's: float rates
    for i in range(1, 4):
        batch = make_batch(seed=i)
        step(state, batch)
        reference_update(m2, o2, as_dict(batch), classify, scheduler=s2)
    assert isinstance(o1.param_groups[0]["lr"], torch.Tensor)
    assert_params_equal(m1, m2, exact=False, atol=1e-6, rtol=1e-5)
