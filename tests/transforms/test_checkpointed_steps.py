"""Steps of different checkpointed(...) options on one TrainState: each runs with its own."""

from __future__ import annotations

import pytest
import torch
from helpers import Net, classify, make_batch
from torch.utils._python_dispatch import TorchDispatchMode

import accelfn as af


class _CountMatmuls(TorchDispatchMode):
    """Counts the matmuls (aten.addmm/mm) a step runs: the recompute of checkpointed blocks
    adds their forward's, selective checkpointing keeps them (no recompute of those)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _matmuls(step, state) -> int:
    with _CountMatmuls() as counter:
        step(state, make_batch())
    return counter.count


def _state():
    torch.manual_seed(0)
    model = Net()
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


STEPS = {
    "plain": lambda: af.with_clipping(max_norm=1e6)(classify),
    "full": lambda: af.checkpointed(classify),
    "selective": lambda: af.checkpointed(selective=[torch.ops.aten.addmm.default])(classify),
    "every2": lambda: af.checkpointed(every=2)(classify),
    "block1": lambda: af.checkpointed(blocks=lambda n, m: n == "blocks.1")(classify),
}
PAIRS = [("full", "plain"), ("plain", "full"), ("full", "selective"), ("selective", "full"),
         ("every2", "block1"), ("block1", "full")]


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_two_steps_on_one_state_each_run_with_their_own_options(first, second):
    alone = {}
    for name in (first, second):  # each step's matmul count, alone on its own state
        step, state = STEPS[name](), _state()
        step(state, make_batch())  # prepared; counted from the second call on
        alone[name] = _matmuls(step, state)
    assert alone[first] != alone[second]  # the options differ where it shows
    state = _state()
    a, b = STEPS[first](), STEPS[second]()
    a(state, make_batch())
    b(state, make_batch())
    for _ in range(2):  # alternating, once both are prepared
        assert (_matmuls(a, state), _matmuls(b, state)) == (alone[first], alone[second])


def test_alternating_steps_give_the_gradients_of_each_alone():
    state = _state()
    full, selective = STEPS["full"](), STEPS["selective"]()
    other = _state()
    plain = STEPS["plain"]()
    for i in range(2):
        for step in (full, selective):
            step(state, make_batch(seed=i))
            plain(other, make_batch(seed=i))
    for p, q in zip(state.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(p, q)
