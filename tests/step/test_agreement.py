"""accelfn.step.agreement: adaptive accumulation's agreement across processes (the two-process
runs are in tests/transforms/test_accumulation_adaptive.py; here what needs no process group)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from helpers import Net, classify, make_batch

import accelfn as af
from accelfn.step import agreement


def test_one_process_or_a_fixed_count_needs_no_agreement():
    adaptive = af.with_accumulation(2, adaptive=True)(classify)
    assert not agreement.needed(adaptive, SimpleNamespace(distributed=None))
    grouped = af.distributed()
    assert not agreement.needed(grouped(af.with_accumulation(2)(classify)),
                                SimpleNamespace(distributed="group"))
    assert agreement.needed(grouped(adaptive), SimpleNamespace(distributed="group"))


@pytest.mark.parametrize("grouped, words", [
    (af.distributed(strategy="fsdp"), "got FSDP2 (strategy='fsdp')"),
    (af.distributed(static_graph=True), "got DDP (static_graph=True)"),
    (None, "got a sharding that cannot run its backward unsynced"),  # a group, no distributed
])
def test_a_sharding_that_cannot_skip_the_sync_is_refused_naming_it(grouped, words):
    step = af.with_accumulation(2, adaptive=True)(classify)
    step = step if grouped is None else grouped(step)
    with pytest.raises(ValueError, match="needs distributed\\(\\) with DDP") as error:
        agreement.needed(step, SimpleNamespace(distributed="group"))
    assert words in str(error.value) and "with_accumulation(n)" in str(error.value)


def test_an_agreed_pass_synchronises_no_micro_batch(monkeypatch):
    """While the processes agree on each pass, no micro-batch's backward synchronises (the
    update's reduction all-reduces the gradients once); otherwise the last one does."""
    from accelfn.parts import sharding

    seen = []
    monkeypatch.setattr(sharding, "micro", lambda options, ctx, index, sync: (
        seen.append(sync), contextlib.nullcontext())[1])
    step = af.distributed()(af.with_accumulation(2)(classify))
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step(state, make_batch())
    assert seen == [False, True]
    seen.clear()
    monkeypatch.setattr(agreement, "needed", lambda step, ctx: True)
    monkeypatch.setattr(agreement, "agree", lambda step, ctx, error: True)
    step(state, make_batch())
    assert seen == [False, False]
