"""The user's order written once (accelfn/step/chain.py): ``af.chain(a, b)`` checked against
the same transforms applied by hand (``b(a(fn))``) and against the plain loop; one public
type, ``af.Transform``, for built-ins, user transforms and chains; the user's place after the
optimizer step (``after_step``), in written order and skipped with the update; and
``describe`` printing the update in the order it runs."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Net, as_dict, assert_params_equal, classify, make_batch

import accelfn as af
from accelfn.testing import check_transform, plain_update

BATCHES = [make_batch(seed=i) for i in range(4)]


def affine(name="affine", factor=3.0):
    """Stateless and affine: two of them in either order give different updates."""

    def update(grads, params, state):
        for g in grads:
            g.mul_(factor).add_(1e-3)

    return af.Transform(name, update=update, label=f"{name}({factor:g})")


def rms(name="rms", decay=0.5):
    """Stateful: divides by 1 + a running mean of the squared norm."""

    def init(params):
        return {"mean": torch.zeros(())}

    def update(grads, params, state):
        mean = state["mean"] * decay + torch.stack([g.square().sum() for g in grads]).sum() * (
            1 - decay)
        for g in grads:
            g.div_(1 + mean.sqrt())
        return {"mean": mean}

    return af.Transform(name, update=update, init=init)


def affine_by_hand(factor=3.0):
    def edit(model):
        for p in model.parameters():
            p.grad.mul_(factor).add_(1e-3)

    return edit


def rms_by_hand(decay=0.5):
    state = {"mean": torch.zeros(())}

    def edit(model):
        grads = [p.grad for p in model.parameters()]
        state["mean"] = state["mean"] * decay + torch.stack(
            [g.square().sum() for g in grads]).sum() * (1 - decay)
        for g in grads:
            g.div_(1 + state["mean"].sqrt())

    return edit


def _state():
    torch.manual_seed(0)
    model = Net()
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _train(step, batches=BATCHES):
    state = _state()
    for batch in batches:
        step(state, batch)
    return state


def _hand_loop(edits, after=(), clip=None, batches=BATCHES):
    """The plain loop: the gradient edits in order, clipping, the step, then ``after``."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batch in batches:
        classify(model, as_dict(batch))["loss"].backward()
        for edit in edits:
            edit(model)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        with torch.no_grad():
            for project in after:
                project(model)
        optimizer.zero_grad(set_to_none=True)
    return model


# ------------------------------------------------------ af.chain against the transforms by hand
def test_chain_is_the_transforms_applied_one_by_one():
    a, b = rms(), affine()
    chained, by_hand = af.chain(a, b)(classify), b(a(classify))
    assert chained.transforms == by_hand.transforms
    assert af.describe(chained) == af.describe(by_hand) == "chain(rms, affine(3)) ∘ classify"
    one, two = _train(chained), _train(by_hand)
    assert_params_equal(one.model, two.model)
    assert torch.equal(one.state_dict()["slots"]["gradients.rms"]["mean"],
                       two.state_dict()["slots"]["gradients.rms"]["mean"])
    assert_params_equal(one.model, _hand_loop([rms_by_hand(), affine_by_hand()]))
    # added to a step (apply_transform, with_transform): its members, one by one, as well
    assert af.apply_transform(classify, af.chain(a, b)).transforms == by_hand.transforms
    assert af.lift(classify).with_transform(af.chain(a, b)).transforms == by_hand.transforms


def test_chain_runs_in_written_order_whatever_the_builtins_around_it():
    a, b = affine("scale", 3.0), affine("shift", 0.5)
    forward = _hand_loop([affine_by_hand(3.0), affine_by_hand(0.5)], clip=0.5)
    backward = _hand_loop([affine_by_hand(0.5), affine_by_hand(3.0)], clip=0.5)
    assert not torch.equal(forward.head.weight, backward.head.weight)
    clip = af.with_clipping(max_norm=0.5)
    for stack, expected in [(clip(af.chain(a, b)(classify)), forward),
                            (af.chain(a, b)(clip(classify)), forward),
                            (af.chain(b, a)(clip(classify)), backward),
                            (af.apply_transform(classify, af.chain(a, b)), None)]:
        if expected is None:  # applied as one transform: the chain's order all the same
            stack = clip(stack)
            expected = forward
        assert_params_equal(_train(stack).model, expected)


def test_a_chain_in_a_chain_is_flattened_and_the_empty_chain_changes_nothing():
    a, b, c = affine("a", 2.0), affine("b", 0.5), rms("c")
    assert af.chain(af.chain(a, b), c)(classify).transforms == \
        af.chain(a, b, c)(classify).transforms == c(b(a(classify))).transforms
    assert af.chain(a)(classify).transforms == a(classify).transforms
    assert af.chain()(classify).transforms == ()
    assert repr(af.chain(a, af.chain(b, c))) == "chain(a(2), b(0.5), c)"


def test_chain_refuses_builtins_two_of_one_name_and_what_is_no_transform():
    with pytest.raises(TypeError, match=r"with_clipping\(max_norm=1\) is a built-in.*around"):
        af.chain(affine(), af.with_clipping(max_norm=1.0))
    with pytest.raises(ValueError, match="two gradient transforms named affine"):
        af.chain(affine(), affine(factor=2.0))
    with pytest.raises(TypeError, match="takes gradient transforms"):
        af.chain(lambda g, p, s: None)
    with pytest.raises(ValueError, match="affine is applied twice"):
        af.chain(affine())(affine(factor=2.0)(classify))


def test_check_transform_takes_a_chain():
    a, b = rms(), affine()

    def by_hand_fresh():
        edits = [rms_by_hand(), affine_by_hand()]

        def reference(model, optimizer, batch):
            plain_update(model, optimizer, batch, classify,
                         edit_grads=lambda m: [e(m) for e in edits])

        return reference

    report = check_transform(af.chain(a, b), reference=by_hand_fresh(), loss_fn=classify,
                             make_batch=lambda i: make_batch(seed=i))
    assert "reference" in report.passed and report.orders == 24


# ------------------------------------------------------------------- one public type
def test_the_user_transform_is_an_af_transform_as_the_builtins_and_chains_are():
    def halve(grads, params, state):
        for g in grads:
            g.mul_(0.5)

    def init(params):
        return {"n": 0}

    mine = af.Transform("halve", update=halve, init=init, label="halve(0.5)")
    old = af.GradientTransform("halve", halve, init, "halve(0.5)")
    for t in (mine, af.with_clipping(max_norm=1.0), af.chain(mine), old.transform()):
        assert isinstance(t, af.Transform)
    assert mine == old.transform() and hash(mine) == hash(old.transform())
    assert mine(classify).transforms == old(classify).transforms
    assert_params_equal(_train(mine(classify)).model, _train(old(classify)).model)
    assert repr(mine) == "halve(0.5)" and repr(af.Transform("halve", update=halve)) == "halve"


def test_a_user_transform_is_checked_when_built_saying_the_fix():
    with pytest.raises(TypeError, match=r"update="):
        af.Transform("mine", lambda g, p, s: None)  # the function given as a built-in's part
    with pytest.raises(TypeError, match=r"needs update="):
        af.Transform("mine")
    with pytest.raises(TypeError, match="without a part"):
        af.Transform("mine", object(), update=lambda g, p, s: None)
    with pytest.raises(TypeError, match=r"after_step must take 2 positional"):
        af.Transform("mine", update=lambda g, p, s: None, after_step=lambda params: None)
    with pytest.raises(TypeError, match=r"update must take 3 positional"):
        af.Transform("mine", update=lambda grads: None)


# ------------------------------------------------------------ the place after the step
def unit_rows(name="unit_rows"):
    """A projection: every weight matrix's rows to unit norm, after the optimizer step."""

    def project(params, state):
        for p in params:
            if p.ndim == 2:
                p.div_(p.norm(dim=1, keepdim=True))

    return af.Transform(name, after_step=project)


def unit_rows_by_hand(model):
    for p in model.parameters():
        if p.ndim == 2:
            p.div_(p.norm(dim=1, keepdim=True))


def shrink(name="shrink", factor=0.9):
    def after_step(params, state):
        for p in params:
            p.mul_(factor)

    return af.Transform(name, after_step=after_step)


def shrink_by_hand(factor=0.9):
    def project(model):
        for p in model.parameters():
            p.mul_(factor)

    return project


def test_after_step_equals_the_plain_loop_projecting_after_the_optimizer_step():
    step = af.with_clipping(max_norm=0.5)(af.chain(affine(), unit_rows())(classify))
    state = _train(step)
    expected = _hand_loop([affine_by_hand()], after=[unit_rows_by_hand], clip=0.5)
    assert_params_equal(state.model, expected)
    norms = state.model.head.weight.norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms))


def test_after_steps_run_in_written_order():
    """Normalising then shrinking leaves rows of norm 0.9; the other way round, of norm 1."""
    first = _train(af.chain(unit_rows(), shrink())(classify))
    second = _train(af.chain(shrink(), unit_rows())(classify))
    assert_params_equal(first.model, _hand_loop([], after=[unit_rows_by_hand,
                                                           shrink_by_hand()]))
    assert_params_equal(second.model, _hand_loop([], after=[shrink_by_hand(),
                                                            unit_rows_by_hand]))
    assert torch.allclose(first.model.head.weight.norm(dim=1), torch.full((4,), 0.9))


def test_after_step_is_skipped_with_the_update_and_sees_the_state_kept():
    seen = []

    def count(grads, params, state):
        return {"updates": state["updates"] + 1}

    def after_step(params, state):
        seen.append(state["updates"])
        for p in params:
            p.mul_(0.5)

    counting = af.Transform("counting", update=count, init=lambda params: {"updates": 0},
                            after_step=after_step)
    flag = {"nan": False}

    def fn(model, batch):
        out = classify(model, batch)
        return {**out, "loss": out["loss"] * float("nan")} if flag["nan"] else out

    step = counting(fn)
    state = _state()
    step(state, BATCHES[0])
    before = copy.deepcopy(state.model.state_dict())
    flag["nan"] = True
    assert step(state, BATCHES[1])["skipped"] == 1
    flag["nan"] = False
    assert all(torch.equal(v, state.model.state_dict()[k]) for k, v in before.items())
    step(state, BATCHES[2])
    assert seen == [1, 2]


def test_after_step_runs_before_the_ema_averages_the_weights():
    step = af.with_ema(decay=0.0)(unit_rows()(classify))  # the average is the last weights
    state = _train(step, BATCHES[:2])
    averaged = af.ema_state_dict(state)
    for name, p in state.model.named_parameters():
        assert torch.equal(averaged[name], p), name


def test_after_step_writing_parameters_is_not_refused_but_update_writing_them_is():
    def write(grads, params, state):
        params[0].detach().mul_(0.5)

    _train(af.Transform("later", after_step=lambda params, state: write(None, params, None))(
        classify), BATCHES[:1])
    with pytest.raises(RuntimeError, match="'now' wrote into the parameter"):
        _train(af.Transform("now", update=write)(classify), BATCHES[:1])


# ------------------------------------------------------------------ describe in run order
def test_describe_prints_the_update_in_the_order_it_runs():
    """Clipping runs after every gradient transform: it prints outside them, whatever the
    stacking; the built-ins whose work comes first print inside."""
    a, b = affine("a", 2.0), affine("b", 0.5)
    clip = af.with_clipping(max_norm=0.5)
    amp = af.with_amp(dtype=torch.float16)
    expected = "with_clipping(max_norm=0.5) ∘ chain(a(2), b(0.5)) ∘ with_amp(fp16) ∘ classify"
    for stack in (b(clip(a(amp(classify)))), clip(af.chain(a, b)(amp(classify))),
                  af.chain(a, b)(amp(clip(classify))), b(a(clip(amp(classify))))):
        assert af.describe(stack) == expected, af.describe(stack)
    assert af.describe(b(clip(a(classify)))) == \
        "with_clipping(max_norm=0.5) ∘ chain(a(2), b(0.5)) ∘ classify"
    assert af.describe(a(clip(classify))) == "with_clipping(max_norm=0.5) ∘ a(2) ∘ classify"
    assert af.describe(clip(amp(classify))) == \
        "with_clipping(max_norm=0.5) ∘ with_amp(fp16) ∘ classify"  # as stacked
    assert af.describe(amp(clip(classify))) == \
        "with_amp(fp16) ∘ with_clipping(max_norm=0.5) ∘ classify"


def test_an_after_step_that_raises_counts_the_applied_update_and_the_next_call_works():
    fail = {"on": True}

    def after_step(params, state):
        if fail["on"]:
            fail["on"] = False
            raise RuntimeError("projection failed")

    step = af.Transform("flaky", after_step=after_step)(classify)
    state = _state()
    before = copy.deepcopy(state.model.state_dict())
    with pytest.raises(RuntimeError, match="projection failed") as caught:
        step(state, BATCHES[0])
    assert "failed after the optimizer step" in "".join(caught.value.__notes__)
    assert state.step == 1 and all(p.grad is None for p in state.model.parameters())
    assert not torch.equal(before["head.weight"], state.model.head.weight)  # it was applied
    step(state, BATCHES[1])
    assert state.step == 2


def test_an_interrupt_in_after_step_leaves_autograd_enabled():
    def after_step(params, state):
        assert not torch.is_grad_enabled()  # it writes the parameters: no autograd
        raise KeyboardInterrupt

    state = _state()
    with pytest.raises(KeyboardInterrupt):
        af.Transform("stop", after_step=after_step)(classify)(state, BATCHES[0])
    assert torch.is_grad_enabled()
