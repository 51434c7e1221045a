"""Steps of different compiled(regional=...) options on one TrainState: blocks compiled
in place hold one compiled function, so a step that would compile them otherwise is refused
before anything changes. Preparation only: nothing here compiles."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import Net, classify

import accelfn as af


def _state():
    model = Net()
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _blocks_as_prepared(model):
    return [(b.__dict__.get("_accelfn_tags"), b.__dict__.get("_accelfn_compiled"))
            for b in model.blocks]


@pytest.mark.parametrize(("first", "second"), [
    ({"regional": True}, {"regional": "nested"}),               # in place, then nested
    ({"regional": "nested"}, {"regional": True}),               # nested, then in place
    ({"regional": "nested", "backend": "eager"},                # nested falls back to in place,
     {"regional": "nested", "backend": "aot_eager"}),           # then nested
    ({"regional": True}, {"regional": True, "fullgraph": True}),  # in place, other options
])
def test_a_step_compiling_the_blocks_otherwise_is_refused_before_anything_changes(first,
                                                                                   second):
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager backend's note: blocks in place
        af.compiled(**{"backend": "aot_eager", **first})(classify).prepare(state)
    before, preparations = _blocks_as_prepared(state.model), len(state.preparations)
    other = af.checkpointed(af.compiled(**{"backend": "aot_eager", **second})(classify))
    with pytest.raises(ValueError, match=r"compiled\(.*regional.*\) .*compiled\(.*regional"
                                         r".*same compiled\(regional=\.\.\."):
        other.prepare(state)
    assert _blocks_as_prepared(state.model) == before  # no checkpoint wrap, nothing replaced
    assert len(state.preparations) == preparations


def test_steps_with_the_same_regional_options_or_nested_regions_share_a_state():
    state = _state()
    af.compiled(regional=True, backend="aot_eager")(classify).prepare(state)
    af.checkpointed(af.compiled(regional=True, backend="aot_eager")(classify)).prepare(state)
    nested = _state()  # nested regions hold no options: each whole-model compile has its own
    af.compiled(regional="nested")(classify).prepare(nested)
    af.compiled(regional="nested", backend="aot_eager", mode=None, dynamic=False)(
        classify).prepare(nested)
    assert len(state.preparations) == len(nested.preparations) == 2
