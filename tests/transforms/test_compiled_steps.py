"""Steps of different compiled(regional=True, ...) options on one TrainState: blocks compiled
in place hold one compiled function, so a step that would compile them otherwise is refused
before anything changes. Preparation only: nothing here compiles."""

from __future__ import annotations

import pytest
import torch
from conftest import Net, classify

import accelfn as af


def _state():
    model = Net()
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _blocks_as_prepared(model):
    return [(b.__dict__.get("_accelfn_tags"), b.__dict__.get("_accelfn_compiled"))
            for b in model.blocks]


@pytest.mark.parametrize(("first", "second"), [
    ({"backend": "eager"}, {"backend": "aot_eager"}),       # in place, then nested
    ({"backend": "aot_eager"}, {"backend": "eager"}),       # nested, then in place
    ({"backend": "eager"}, {"backend": "eager", "fullgraph": True}),  # in place, other options
])
def test_a_step_compiling_the_blocks_otherwise_is_refused_before_anything_changes(first,
                                                                                   second):
    state = _state()
    af.compiled(regional=True, **first)(classify).prepare(state)
    before, preparations = _blocks_as_prepared(state.model), len(state.preparations)
    other = af.checkpointed(af.compiled(regional=True, **second)(classify))
    with pytest.raises(ValueError, match=r"compiled\(.*regional.*\) .*compiled\(.*regional"
                                         r".*same compiled\(regional=True"):
        other.prepare(state)
    assert _blocks_as_prepared(state.model) == before  # no checkpoint wrap, nothing replaced
    assert len(state.preparations) == preparations


def test_steps_with_the_same_regional_options_or_nested_regions_share_a_state():
    state = _state()
    af.compiled(regional=True, backend="eager")(classify).prepare(state)
    af.checkpointed(af.compiled(regional=True, backend="eager")(classify)).prepare(state)
    nested = _state()  # nested regions hold no options: each whole-model compile has its own
    af.compiled(regional=True)(classify).prepare(nested)
    af.compiled(regional=True, backend="aot_eager", mode=None, dynamic=False)(
        classify).prepare(nested)
    assert len(state.preparations) == len(nested.preparations) == 2
