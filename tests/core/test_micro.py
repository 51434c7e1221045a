"""accelfn.core.micro: the forward and backward of a call's micro-batches."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from helpers import Net, classify, make_batch

import accelfn as af
from accelfn.core import micro
from accelfn.core.contexts import CallContext
from accelfn.core.plan import Plan


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


def test_nothing_of_the_scopes_is_left_entered_after_a_failing_function():
    entered = []

    @contextlib.contextmanager
    def scope(ctx):
        entered.append(True)
        try:
            yield
        finally:
            entered.pop()

    from accelfn.core.places import Checkpointing

    step = af.Transform("checkpointed", Checkpointing(lambda p, s: p, scope))(
        lambda model, batch: 1 / 0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ZeroDivisionError):
        step(state, make_batch())
    assert entered == []
