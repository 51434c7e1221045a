"""accelfn.step.spec: each built-in fills one place of the update; a step's Spec."""

from __future__ import annotations

import pytest
import torch
from helpers import Net, classify

import accelfn as af
from accelfn.parts.activation_checkpointing import Checkpointing
from accelfn.parts.clipping import Clipping
from accelfn.parts.nonfinite import Decision
from accelfn.step.spec import Spec, spec_of


def _text() -> str:
    return "the stack"


def test_spec_of_puts_each_builtin_in_its_place_and_user_transforms_in_order():
    a = af.Transform("a", update=lambda g, p, s: None)
    b = af.Transform("b", update=lambda g, p, s: None)
    step = af.with_clipping(max_norm=1.0)(b(af.with_amp(a(classify))))
    spec = step.spec
    assert spec.clipping is step.transforms[-1].part
    assert spec.precision is not None and spec.sharding is None
    assert [g.name for g in spec.gradients] == ["a", "b"]


def test_a_builtin_twice_and_two_of_one_place_are_refused_naming_them():
    clip = af.with_clipping(max_norm=1.0)
    with pytest.raises(ValueError, match="with_clipping is applied twice in the stack"):
        spec_of((clip, clip), _text)
    other = af.Transform("my_clip", Clipping(max_norm=2.0))
    with pytest.raises(ValueError, match="with_clipping and my_clip both fill the 'clipping'"):
        spec_of((clip, other), _text)


def test_a_part_of_no_place_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="fills no place"):
        spec_of((af.Transform("odd", object()),), _text)


def test_checks_and_after_update_list_what_the_places_hold_in_order():
    spec = Spec(checkpointing=Checkpointing(blocks=(torch.nn.LSTM,)))
    [check] = spec.checks
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="found no block to checkpoint in Net"):
        check(state)
    assert Spec().after_update == [] and Spec().checks == []


def test_a_decision_left_to_the_device_needs_its_flags():
    with pytest.raises(ValueError, match="needs the device flags"):
        Decision(None)
    assert Decision().skip is False and Decision().checked
