"""with_clipping: clip_grad_norm_ / clip_grad_value_ on unscaled, accumulated gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import as_dict, assert_params_equal, classify, clone_setup, make_batch
from reference import reference_update

import accelfn as af


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_norm_clipping_equals_reference_bitwise(net, norm_type):
    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.SGD, momentum=0.9)
    step = af.with_clipping(max_norm=0.05, norm_type=norm_type)(classify)
    state = af.TrainState(m1, o1)
    for i in range(3):
        batch = make_batch(seed=i)
        metrics = step(state, batch)
        ref = reference_update(m2, o2, as_dict(batch), classify, max_norm=0.05,
                               norm_type=norm_type)
        assert torch.equal(metrics["grad_norm"], ref["grad_norm"])
        assert metrics["grad_norm"] > 0.05  # really clipped
    assert_params_equal(m1, m2)


def test_value_clipping_and_pre_clip_norm(net):
    (m1, o1), (m2, o2) = clone_setup(net)
    step = af.with_clipping(max_value=0.01)(classify)
    state = af.TrainState(m1, o1)
    batch = make_batch()
    out = classify(m2, as_dict(batch))
    out["loss"].backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in m2.parameters()])
    m2.zero_grad(set_to_none=True)
    metrics = step(state, batch)
    reference_update(m2, o2, as_dict(batch), classify, max_value=0.01)
    assert torch.equal(metrics["grad_norm"], norm)
    assert_params_equal(m1, m2)


def test_bare_clipping_is_unit_norm(net):
    (m1, o1), (m2, o2) = clone_setup(net)
    state = af.TrainState(m1, o1)
    batch = make_batch()
    af.with_clipping(classify)(state, batch)
    reference_update(m2, o2, as_dict(batch), classify, max_norm=1.0)
    assert_params_equal(m1, m2)


def test_clipping_sees_unscaled_accumulated_fp16_gradients(net):
    (m1, o1), (m2, o2) = clone_setup(net)
    state = af.TrainState(m1, o1)
    scaler = torch.amp.GradScaler("cpu")
    batch = make_batch(n=10)
    # clipping placed innermost: the engine still clips after unscale and accumulation
    step = af.with_amp(dtype=torch.float16)(af.with_accumulation(3)(
        af.with_clipping(max_norm=0.05)(classify)))
    metrics = step(state, batch)
    ref = reference_update(m2, o2, as_dict(batch), classify, micro=3, amp_dtype=torch.float16,
                           scaler=scaler, max_norm=0.05)
    assert torch.equal(metrics["grad_norm"], ref["grad_norm"])
    assert metrics["grad_norm"] < 100  # an unscaled norm, not 65536 times it
    assert_params_equal(m1, m2)


@pytest.mark.parametrize("kwargs,match", [
    ({"max_norm": 0.0}, "max_norm"),
    ({"max_norm": math.inf}, "max_norm"),
    ({"max_value": -1}, "max_value"),
    ({"max_norm": 1.0, "max_value": 1.0}, "not both"),
    ({"norm_type": -2}, "norm_type"),
])
def test_bad_clipping_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        af.with_clipping(**kwargs)


def test_clipping_norms_over_parameters_added_to_the_model_after_the_first_update():
    # the model's parameter order is walked once per preparation; a layer added later, and
    # handed to the optimizer (a growing model), is in the next update's norm
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p_opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b["x"]), b["y"])

    step = af.with_clipping(max_norm=0.01)(loss_fn)
    state = af.TrainState(model, opt)
    for i in range(3):
        if i == 1:  # grow a layer and hand it to the optimizers
            torch.manual_seed(1)
            model.append(torch.nn.Linear(4, 4))
            plain.append(copy.deepcopy(model[2]))
            opt.add_param_group({"params": list(model[2].parameters())})
            p_opt.add_param_group({"params": list(plain[2].parameters())})
        g = torch.Generator().manual_seed(i)
        batch = {"x": torch.randn(6, 8, generator=g), "y": torch.randint(0, 4, (6,), generator=g)}
        metrics = step(state, batch)
        loss_fn(plain, batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)
        p_opt.step()
        p_opt.zero_grad(set_to_none=True)
        assert torch.equal(metrics["grad_norm"], norm)
    assert_params_equal(model, plain)


class _MixedDtypes(torch.nn.Module):
    """A float32 layer and a float64 scale: gradients of two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.scale = torch.nn.Parameter(torch.full((4,), 3.0, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).double() * self.scale


def test_clipping_gradients_of_two_dtypes_equals_clip_grad_norm_bitwise():
    torch.manual_seed(0)
    model = _MixedDtypes()
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p_opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b["x"]), b["y"])

    step = af.with_clipping(max_norm=0.01)(loss_fn)
    state = af.TrainState(model, opt)
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        batch = {"x": torch.randn(6, 8, generator=g), "y": torch.randint(0, 4, (6,), generator=g)}
        metrics = step(state, batch)
        loss_fn(plain, batch).backward()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)
        p_opt.step()
        p_opt.zero_grad(set_to_none=True)
        assert norm > 0.01  # really clipped
        assert torch.equal(metrics["grad_norm"], norm)
    assert_params_equal(model, plain)
