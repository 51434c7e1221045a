"""Properties over the registry of transforms: every stacking order gives the same update."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
from helpers import Net, as_dict, assert_params_equal, classify, make_batch
from reference import reference_update

import accelfn as af

REGISTRY = {
    "amp": af.with_amp(dtype=torch.bfloat16),
    "accumulation": af.with_accumulation(3),
    "clipping": af.with_clipping(max_norm=0.05),
    "nonfinite": af.with_nonfinite(policy="skip", max_consecutive=5),
    "checkpointed": af.checkpointed(),
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


def _called(function):
    """What a check or an after-update place calls: a function, or a part's function with
    its options (functools.partial)."""
    return getattr(function, "func", function), getattr(function, "args", ())


def test_every_order_builds_the_same_update():
    """The engine runs one sequence read from the step's function and spec (one part per
    place): all 120 orders of the registry fill every place with the same part, so they run
    the same update. Two orders (the written and the reversed) are trained below."""
    names = list(REGISTRY)
    reference = _stack(names)
    places = [f.name for f in dataclasses.fields(reference.spec)]
    orders = list(itertools.permutations(names))
    assert len(orders) == 120
    filled = {p for p in places if getattr(reference.spec, p) not in (None, ())}
    assert filled == {"precision", "checkpointing", "accumulation", "clipping", "nonfinite"}
    for order in orders:
        step = _stack(order)
        assert step.fn is reference.fn, order
        for place in places:
            assert getattr(step.spec, place) is getattr(reference.spec, place), (order, place)
        assert list(map(_called, step.spec.checks)) == list(
            map(_called, reference.spec.checks)), order
        assert list(map(_called, step.spec.after_update)) == list(
            map(_called, reference.spec.after_update)), order
        assert set(step.transforms) == set(reference.transforms), order


@pytest.mark.parametrize("order", [list(REGISTRY)[::-1], ["checkpointed", "accumulation", "amp",
                                                          "nonfinite", "clipping"]],
                         ids=["reversed", "shuffled"])
def test_another_order_trains_to_the_same_update_bitwise(order):
    torch.manual_seed(0)
    base = Net()
    reference_model, reference_metrics = _train(list(REGISTRY), copy.deepcopy(base))
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


def spy(name, place, log, monkeypatch):
    """A transform filling a preparing place, recording when its preparation runs."""
    from accelfn.parts import activation_checkpointing, compilation, sharding

    def hook(prepared, state):
        log.append(name)
        return prepared

    # a built-in, its preparation spied on where the engine calls it by name
    module, function, transform = {
        "compilation": (compilation, "compile", af.compiled()),
        "checkpointing": (activation_checkpointing, "wrap", af.checkpointed()),
        "sharding": (sharding, "shard", af.distributed()),
    }[place]
    monkeypatch.setattr(module, function, lambda options, prepared, state: hook(prepared, state))
    if hasattr(module, "check"):
        monkeypatch.setattr(module, "check", lambda options, state: None)
    return transform


@pytest.mark.parametrize("order", list(itertools.permutations([0, 1, 2])))
def test_preparation_happens_once_in_canonical_order(order, monkeypatch):
    log = []
    spies = [spy("wrap", "checkpointing", log, monkeypatch),
             spy("shard", "sharding", log, monkeypatch),
             spy("compile", "compilation", log, monkeypatch)]
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


def test_each_preparing_builtin_fills_its_own_place():
    built = {t.name: t for t in (af.with_float8(), af.with_amp(), af.checkpointed(),
                                 af.distributed(), af.compiled(), af.with_ema())}
    places = {name: type(t.part).__name__ for name, t in built.items()}
    assert places == {"with_float8": "Float8", "with_amp": "Precision",
                      "checkpointed": "Checkpointing", "distributed": "Sharding",
                      "compiled": "Compilation", "with_ema": "Averaging"}
