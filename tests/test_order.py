"""Properties over the registry of transforms: every stacking order gives the same update."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from conftest import Net, as_dict, assert_params_equal, classify, make_batch
from reference import reference_update

import accelfn as af

REGISTRY = {
    "amp": af.with_amp,
    "accumulation": af.with_accumulation(3),
    "clipping": af.with_clipping(max_norm=0.05),
    "nonfinite": af.with_nonfinite(policy="skip", max_consecutive=5),
    "checkpointed": af.checkpointed,
}


def _stack(names):
    step = classify
    for name in names:
        step = REGISTRY[name](step)
    return step


def _train(names, model):
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    step = _stack(names)
    out = [step(state, make_batch(n=10, seed=i)) for i in range(2)]
    return model, out


def test_every_order_gives_the_same_update_bitwise():
    torch.manual_seed(0)
    base = Net()
    names = list(REGISTRY)
    reference_model, reference_metrics = _train(names, copy.deepcopy(base))
    orders = list(itertools.permutations(names))
    assert len(orders) == 120
    for order in orders:
        model, metrics = _train(order, copy.deepcopy(base))
        assert_params_equal(model, reference_model)
        for a, b in zip(metrics, reference_metrics):
            assert set(a.keys()) == set(b.keys())
            for key in a.keys():
                assert torch.equal(a[key], b[key]), (order, key)


def test_stack_equals_hand_written_amp_accumulation_clipping_loop():
    torch.manual_seed(0)
    base = Net()
    model, _ = _train(["clipping", "amp", "accumulation", "checkpointed"], copy.deepcopy(base))
    ref = copy.deepcopy(base)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i in range(2):
        reference_update(ref, opt, as_dict(make_batch(n=10, seed=i)), classify, micro=3,
                         amp_dtype=torch.bfloat16, max_norm=0.05)
    assert_params_equal(model, ref)


class Spy:
    def __init__(self, name, order, log):
        self.name, self.prepare_order, self.log = name, order, log

    def __repr__(self):
        return self.name

    def prepare(self, prepared, state):
        self.log.append(self.name)


@pytest.mark.parametrize("order", list(itertools.permutations([0, 1, 2])))
def test_preparation_happens_once_in_canonical_order(order):
    log = []
    spies = [Spy("wrap", 10, log), Spy("shard", 30, log), Spy("compile", 40, log)]
    step = af.lift(classify)
    for i in order:
        step = step.with_transform(spies[i])
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        step(state, make_batch())
    step.evaluate(state, make_batch())
    assert log == ["wrap", "shard", "compile"]


def test_builtin_prepare_order_is_checkpoint_then_distribute_then_compile():
    orders = {t: REGISTRY_T[t].prepare_order for t in REGISTRY_T}
    assert orders["with_amp"] < orders["checkpointed"] < orders["distributed"] \
        < orders["compiled"]


REGISTRY_T = {
    s.transforms[0].name: s.transforms[0]
    for s in (af.with_amp(classify), af.checkpointed(classify), af.distributed(classify),
              af.compiled(classify))
}
