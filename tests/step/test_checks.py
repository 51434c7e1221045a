"""The out-of-memory messages of accelfn.step.checks: they keep the allocator's own text
("Tried to allocate ...") and advise only what can still help."""

from __future__ import annotations

import pytest
import torch
from helpers import Net, classify, make_batch
from torch import nn

import accelfn as af

ALLOCATOR = "CUDA out of memory. Tried to allocate 2.00 GiB"


class Limited(nn.Module):
    """Net that runs out of memory, as CUDA's allocator words it, above ``limit`` samples per
    micro-batch."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.net = Net()
        self.limit = limit

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(ALLOCATOR)
        return self.net(x)


def _state(model):
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_forward_oom_message_keeps_the_allocators_text():
    state = _state(Limited(limit=4))
    with pytest.raises(torch.OutOfMemoryError) as raised:
        af.with_accumulation(2)(classify)(state, make_batch(n=16))
    text = str(raised.value)
    assert f"({ALLOCATOR})" in text and "{error}" not in text
    assert "with_accumulation(4)" in text


def test_the_optimizer_oom_message_keeps_the_allocators_text():
    from accelfn.step import checks

    text = str(checks.optimizer_out_of_memory("f", torch.OutOfMemoryError(ALLOCATOR), True))
    assert f"({ALLOCATOR})" in text and "{error}" not in text


def test_after_one_sample_per_micro_batch_more_micro_batches_are_not_advised():
    state = _state(Limited(limit=0))
    with pytest.raises(torch.OutOfMemoryError) as raised:
        af.with_accumulation(2, adaptive=True)(classify)(state, make_batch(n=4))
    text = str(raised.value)
    assert "with_accumulation(4)" not in text and "with_accumulation(2)" not in text
    assert "one sample" in text and "4 micro-batches" in text
    assert "a smaller batch" not in text  # one sample each: the batch size is not the cause
    assert "checkpointed" in text and f"({ALLOCATOR})" in text
