"""A stack whose preparation would be refused changes nothing: every transform's 'check'
hook runs before the first prepare phase (a float8 conversion, fp32 islands, a scaler)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.float8.float8_linear import Float8Linear

import accelfn as af


class Wide(nn.Module):
    """No repeated blocks; two Linear layers float8 converts (min_features=16)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def ce(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def _batch():
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(8, 32, generator=g), "y": torch.randint(0, 16, (8,), generator=g)}


class Missing(nn.Module):
    pass


F8 = af.with_float8(min_features=16)
REFUSED = [
    (af.checkpointed(blocks=(Missing,)), "found no block"),
    (af.compiled(regional=True, backend="eager"), "found no repeated blocks"),
    (af.with_amp(dtype=torch.float16, fp32=("nope",)), "matched no module"),
]


@pytest.mark.parametrize(("refused", "match"), REFUSED)
@pytest.mark.parametrize("f8_inside", [True, False])
def test_a_refused_preparation_changes_nothing(refused, match, f8_inside):
    torch.manual_seed(0)
    model = Wide()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forwards = {name: m.forward for name, m in model.named_modules()}
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = refused(F8(ce)) if f8_inside else F8(refused(ce))
    with pytest.raises(ValueError, match=match):
        step(state, _batch())
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    assert {name: m.forward for name, m in model.named_modules()} == forwards
    assert state.slots == {} and state.step == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the step the user meant, without the refused transform, runs on the same state
    F8(ce)(state, _batch())
    assert state.step == 1
    assert any(isinstance(m, Float8Linear) for m in model.modules())
