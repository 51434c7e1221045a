"""adaptive_clipping against timm's adaptive_clip_grad, re-implemented from timm's source in
tests/timm_agc.py.

The reference is ``timm/utils/agc.py`` (``unitwise_norm`` and ``adaptive_clip_grad``) and
``timm/models/_helpers.py``'s ``model_parameters`` as timm's ``train.py`` calls them with
``--clip-mode agc`` (``model_parameters(model, exclude_head=True)``: every parameter but the
last two, the classifier's weight and bias), after ``backward`` and before
``optimizer.step()``. timm itself is not a dependency; the reference imports nothing from
accelfn.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from reference import reference_update
from tensordict import TensorDict
from timm_agc import adaptive_clip_grad, model_parameters
from torch import nn

import accelfn as af
from accelfn.testing import check_transform


# --------------------------------------------------------------------------- the fixtures
class ConvNet(nn.Module):
    """Convolution kernels, BatchNorm gains and biases, a 0-d temperature, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, bias=False)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        h = F.relu(self.conv2(F.relu(self.bn(self.conv(x)))))
        return self.head(h.flatten(1)) / self.temperature


def make_model():
    torch.manual_seed(0)
    return ConvNet()


def make_batch(seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"x": torch.randn(8, 3, 6, 6, generator=g),
                       "y": torch.randint(0, 5, (8,), generator=g)}, batch_size=[8])


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def timm_agc(clip_factor=0.01, exclude_head=False, **options):
    return lambda model: adaptive_clip_grad(model_parameters(model, exclude_head), clip_factor,
                                            **options)


def assert_bitwise(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def train_both(transform, edit_grads, steps=3, **plain):
    """``steps`` updates of the step ``transform(loss_fn)`` and of the plain loop with
    ``edit_grads`` after backward; returns both models."""
    model, by_hand = make_model(), make_model()
    state, optimizer = af.TrainState(model, sgd(model)), sgd(by_hand)
    step = transform(loss_fn)
    for i in range(steps):
        step(state, make_batch(i))
        reference_update(by_hand, optimizer, make_batch(i), loss_fn, edit_grads=edit_grads,
                         **plain)
    return model, by_hand


# -------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("options", [{}, {"clip_factor": 0.05, "eps": 1e-2, "norm_type": 1.0},
                                     {"norm_type": math.inf}], ids=["defaults", "l1", "inf"])
def test_equals_timm_adaptive_clip_grad_bitwise_on_crafted_gradients(options):
    """Units far over, under, exactly at their limit, of zero weight (eps), NaN and Inf
    gradients, a 0-d parameter and one in bf16: what timm leaves, bitwise."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, 2, 2, generator=g), torch.zeros(4), torch.randn(5, 7, generator=g),
              torch.tensor(0.7), torch.randn(6, generator=g).bfloat16(),
              torch.randn(3, 2, generator=g)]
    grads = [torch.randn(p.shape, generator=g).to(p.dtype) * 0.02 for p in params]
    grads[0][1] *= 1e3  # one unit far over its limit, one far under
    grads[0][2] *= 1e-6
    grads[2][3] = float("nan")
    grads[5][1, 0] = float("inf")
    factor = options.get("clip_factor", 0.01)
    grads[2][0] = params[2][0] * factor  # exactly at the limit (a unit's norm = its weight's)
    expected = [nn.Parameter(p.clone()) for p in params]
    for e, grad in zip(expected, grads):
        e.grad = grad.clone()
    adaptive_clip_grad(expected, **options)
    got = [grad.clone() for grad in grads]
    af.adaptive_clipping(**options).part.update(got, params, None)
    for i, (e, x) in enumerate(zip(expected, got)):
        assert torch.equal(e.grad.nan_to_num(7.0), x.nan_to_num(7.0)), i
    assert not torch.equal(got[0], grads[0]) and torch.equal(got[0][2], grads[0][2])


def test_a_step_equals_the_plain_loop_with_timms_clipping_bitwise_and_skip_leaves_the_head():
    model, by_hand = train_both(af.adaptive_clipping(0.01), timm_agc(0.01))
    assert_bitwise(model, by_hand)
    unclipped, _ = train_both(af.lift, None)
    assert not torch.equal(model.conv.weight, unclipped.conv.weight)  # it clipped something
    # timm's train.py with --clip-mode agc: the classifier left out; skip=model.head
    model, by_hand = make_model(), make_model()
    state, optimizer = af.TrainState(model, sgd(model)), sgd(by_hand)
    step = af.adaptive_clipping(0.01, skip=model.head)(loss_fn)
    rule = af.adaptive_clipping(0.01, skip=lambda p: p.shape[:1] == (5,))(loss_fn)  # 5 classes
    by_rule = make_model()
    rule_state = af.TrainState(by_rule, sgd(by_rule))
    for i in range(3):
        step(state, make_batch(i))
        rule(rule_state, make_batch(i))
        reference_update(by_hand, optimizer, make_batch(i), loss_fn,
                         edit_grads=timm_agc(0.01, exclude_head=True))
    assert_bitwise(model, by_hand)
    assert_bitwise(by_rule, by_hand)
    assert af.describe(step) == "agc(0.01, skip) ∘ loss_fn"
    other = make_model()
    with pytest.raises(ValueError, match="belongs to another model"):
        af.adaptive_clipping(0.01, skip=model.head)(loss_fn)(af.TrainState(other, sgd(other)),
                                                             make_batch(0))
    for p, q in zip(other.parameters(), make_model().parameters()):  # refused before the
        assert torch.equal(p, q)                                     # optimizer step


def test_chained_before_other_transforms_and_with_clipping_in_written_order():
    """``with_clipping(chain(agc, scale))``: AGC, then the scaling, then the norm clip, as
    the plain loop writes them."""
    def scale(grads, params, state):
        for g in grads:
            g.mul_(30.0)

    def by_hand(model):
        timm_agc(0.01)(model)
        for p in model.parameters():
            p.grad.mul_(30.0)

    chain = af.chain(af.adaptive_clipping(0.01), af.Transform("scale", update=scale))

    def chained(fn):
        return af.with_clipping(max_norm=0.5)(chain(fn))

    model, plain = train_both(chained, by_hand, max_norm=0.5)
    assert_bitwise(model, plain)
    assert af.describe(chained(loss_fn)) == \
        "with_clipping(max_norm=0.5) ∘ chain(agc(0.01), scale) ∘ loss_fn"


def test_passes_the_contract_kit():
    def reference(model, optimizer, batch):
        reference_update(model, optimizer, batch, loss_fn, edit_grads=timm_agc(0.01))

    report = check_transform(af.adaptive_clipping(0.01), reference=reference, loss_fn=loss_fn,
                             make_model=make_model, make_batch=make_batch,
                             builtins=[af.with_clipping(max_norm=0.5)])
    assert report.passed == ["reference", "purity", "orders", "resume", "no host sync",
                             "bad input"]


@pytest.mark.parametrize("call, error", [
    (lambda: af.adaptive_clipping(0.0), "clip_factor=0.0"),
    (lambda: af.adaptive_clipping(0.01, eps=-1.0), "eps=-1.0"),
    (lambda: af.adaptive_clipping(True), "clip_factor=True"),
    (lambda: af.adaptive_clipping(0.01, skip=("head",)), "names need the model"),
    (lambda: af.adaptive_clipping(0.01, skip="head"), "names need the model"),
    (lambda: af.adaptive_clipping(0.01, skip=[]), "empty"),
])
def test_refuses_what_it_cannot_use_when_built(call, error):
    with pytest.raises((ValueError, TypeError), match=error):
        call()


def test_label_names_its_options():
    assert repr(af.adaptive_clipping()) == "agc(0.01)"
    assert repr(af.adaptive_clipping(0.02, eps=1e-4, norm_type=math.inf,
                                     skip=copy.deepcopy(nn.Linear(1, 1)))) == \
        "agc(0.02, eps=0.0001, norm_type=inf, skip)"
