"""The step hands the function the user's own model: how the function reaches it (its
``forward``, a submodule, a method) changes neither the update nor what the techniques keep
about the model (EMA weights, checkpoints, the exported weights)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import as_dict, assert_params_equal, make_batch
from reference import reference_update
from trunk_models import TrunkNet, via_forward, via_method, via_submodule

import accelfn as af
from accelfn import checkpointing
from accelfn.checkpointing.exporting import export

FUNCTIONS = (via_forward, via_submodule, via_method)


def _stack(fn):
    return af.with_ema(decay=0.9)(af.with_accumulation(2)(af.with_clipping(max_norm=0.05)(
        af.checkpointed(fn))))


def _train(fn, base, tmp_path):
    model = copy.deepcopy(base)
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    step = _stack(fn)
    for i in range(3):
        step(state, make_batch(seed=i))
    checkpointing.save(tmp_path / fn.__name__ / "ckpt", state, step=step)
    export(tmp_path / fn.__name__ / "export", state)
    return model, state


def test_how_the_function_reaches_the_model_changes_nothing_kept(tmp_path):
    torch.manual_seed(0)
    base = TrunkNet()
    trained = {fn.__name__: _train(fn, base, tmp_path) for fn in FUNCTIONS}
    model, state = trained["via_forward"]
    ema = af.ema_state_dict(state)
    for name in ("via_submodule", "via_method"):
        other, other_state = trained[name]
        assert_params_equal(other, model)  # bitwise: the same computation
        for key, value in af.ema_state_dict(other_state).items():
            assert torch.equal(value, ema[key]), (name, key)
        assert (tmp_path / name / "export").exists()
    # a checkpoint written through a method loads into a state trained through forward
    fresh = TrunkNet()
    loaded = af.TrainState(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    checkpointing.load(tmp_path / "via_method" / "ckpt", loaded, step=_stack(via_forward))
    assert_params_equal(fresh, model)
    assert loaded.step == 3


@pytest.mark.parametrize("fn", [via_submodule, via_method])
def test_amp_and_accumulation_through_a_submodule_equal_the_plain_loop(fn):
    torch.manual_seed(0)
    base = TrunkNet()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    seen = []

    def spy(model, batch):
        seen.append(model is m1 and type(model) is TrunkNet)
        return fn(model, batch)

    state = af.TrainState(m1, o1)
    step = af.with_amp(dtype=torch.bfloat16)(af.with_accumulation(2)(
        af.with_clipping(max_norm=0.05)(spy)))
    for i in range(3):
        batch = make_batch(seed=i)
        step(state, batch)
        reference_update(m2, o2, as_dict(batch), fn, micro=2, max_norm=0.05,
                         amp_dtype=torch.bfloat16)
    assert all(seen) and len(seen) == 6
    assert_params_equal(m1, m2)
