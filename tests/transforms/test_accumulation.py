"""with_accumulation: bitwise the seeds' loop, and the full-batch gradient exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import as_dict, assert_params_equal, classify, clone_setup, make_batch, token_loss
from reference import chunks, full_batch_grads, reference_update
from tensordict import TensorDict

import accelfn as af


class GradProbe:
    """Records the fully accumulated gradients (a user gradient transform)."""

    def __init__(self):
        self.grads = None
        self.transform = af.GradientTransform("grad_probe", self.record)

    def record(self, grads, params, state):
        self.grads = [g.detach().clone() for g in grads]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_split_equals_reference_loop_bitwise(net, n):
    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.SGD, momentum=0.9)
    step = af.with_accumulation(n)(classify)
    state = af.TrainState(m1, o1)
    for i in range(3):
        batch = make_batch(n=10, seed=i)  # 10 samples: uneven for n=3 and n=4
        metrics = step(state, batch)
        ref = reference_update(m2, o2, as_dict(batch), classify, micro=n)
        sizes = [len(c["x"]) for c in chunks(as_dict(batch), n)]
        expected = sum(loss * (s / 10) for loss, s in zip(ref["losses"], sizes))
        torch.testing.assert_close(metrics["loss"], expected, atol=0, rtol=0)
    assert_params_equal(m1, m2)


def assert_accumulated_equals_full_batch(net, loss_fn, n, batch):
    """``n`` accumulated micro-batches of ``batch``: the gradients and the loss of one
    backward over the whole batch. Returns the metrics, the full batch's output, its
    gradients and the untouched copy of ``net`` they came from."""
    probe = GradProbe()
    step = af.apply_transform(af.with_accumulation(n)(loss_fn), probe.transform)
    ref_model = copy.deepcopy(net)
    expected = full_batch_grads(ref_model, as_dict(batch), loss_fn)
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.0))
    metrics = step(state, batch)
    for got, want in zip(probe.grads, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    full = loss_fn(ref_model, as_dict(batch))
    torch.testing.assert_close(metrics["loss"], full["loss"].detach(), atol=1e-6, rtol=1e-5)
    return metrics, full, expected, ref_model


@pytest.mark.parametrize("n", [3, 7])
def test_gradient_equals_full_batch(net, n):
    metrics, full, _, _ = assert_accumulated_equals_full_batch(net, classify, n,
                                                               make_batch(n=10))
    torch.testing.assert_close(metrics["accuracy"], full["accuracy"], atol=1e-6, rtol=1e-5)


def test_token_weighted_equals_full_batch_token_mean(net):
    batch = make_batch(n=11, seed=3)
    _, _, expected, ref_model = assert_accumulated_equals_full_batch(net, token_loss, 3, batch)
    # and it differs from plain sample weighting, so the weight is really used
    sample_probe = GradProbe()
    plain = af.apply_transform(af.with_accumulation(3)(lambda m, b: token_loss(m, b)["loss"]),
                               sample_probe.transform)
    plain(af.TrainState(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.0)), batch)
    assert not torch.allclose(sample_probe.grads[0], expected[0], atol=1e-6)


def test_token_weighted_equals_reference_bitwise(net):
    (m1, o1), (m2, o2) = clone_setup(net)
    step = af.with_accumulation(3)(token_loss)
    state = af.TrainState(m1, o1)
    for i in range(3):
        batch = make_batch(n=11, seed=i)
        step(state, batch)
        reference_update(m2, o2, as_dict(batch), token_loss, micro=3, token_weighted=True)
    assert_params_equal(m1, m2)


def test_hand_computed_uneven_split():
    """A linear model y = w.x with squared error: gradient computed by hand."""
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    probe = GradProbe()

    def mse(m, b):
        return ((m(b["x"]).squeeze(-1) - b["y"]) ** 2).mean()

    x = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])
    y = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    step = af.apply_transform(af.with_accumulation(2)(mse), probe.transform)  # split 3 + 2
    step(af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.0)),
         TensorDict({"x": x, "y": y}, batch_size=[5]))
    # d/dw mean((w x - 1)^2) at w=0 = mean(-2 x) = -2 * 3 = -6
    assert probe.grads[0].item() == pytest.approx(-6.0)


def test_calls_mode_equals_one_big_batch(net):
    probe = GradProbe()
    step = af.apply_transform(af.with_accumulation(3, mode="calls")(classify), probe.transform)
    ref_model = copy.deepcopy(net)
    batches = [make_batch(n=n, seed=i) for i, n in enumerate([4, 5, 3])]
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.0))
    outs = [step(state, b) for b in batches]
    assert state.step == 1 and "lr" not in outs[0].keys() and "lr" in outs[2].keys()
    whole = torch.cat([b.to_tensordict() for b in batches])
    expected = full_batch_grads(ref_model, as_dict(whole), classify)
    for got, want in zip(probe.grads, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    full = classify(ref_model, as_dict(whole))
    torch.testing.assert_close(outs[2]["loss"], full["loss"].detach(), atol=1e-6, rtol=1e-5)


def test_calls_mode_short_final_window_via_flush(net):
    probe = GradProbe()
    step = af.apply_transform(af.with_accumulation(4, mode="calls")(token_loss), probe.transform)
    ref_model = copy.deepcopy(net)
    batches = [make_batch(n=n, seed=10 + i) for i, n in enumerate([4, 4, 4, 4, 5, 2])]
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.0))
    for b in batches:
        step(state, b)
    assert state.step == 1
    metrics = step.flush(state)
    assert state.step == 2 and metrics is not None
    assert step.flush(state) is None
    tail = torch.cat([b.to_tensordict() for b in batches[4:]])
    expected = full_batch_grads(ref_model, as_dict(tail), token_loss)
    for got, want in zip(probe.grads, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_calls_mode_refuses_to_checkpoint_an_open_window(net):
    step = af.with_accumulation(2, mode="calls")(classify)
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    step(state, make_batch())
    with pytest.raises(RuntimeError, match="window is open"):
        state.state_dict()
    step(state, make_batch())
    assert state.state_dict()["slots"]["accumulation"] == {"calls": 0}


def test_another_step_on_a_state_with_an_open_window_is_refused_with_nothing_changed(net):
    """A second step on a state whose calls window holds gradients would clear them while the
    window still counts their call: it is refused, naming the fix, and the window goes on."""
    probe = GradProbe()
    step = af.apply_transform(af.with_accumulation(2, mode="calls")(classify), probe.transform)
    other = af.lift(classify)
    ref_model = copy.deepcopy(net)
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.0))
    first, second = make_batch(n=4, seed=1), make_batch(n=6, seed=2)
    step(state, first)
    held = [p.grad.clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match=r"window is open.*flush\(state\)"):
        other(state, second)
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), held))
    assert state.step == 0
    step(state, second)  # closes the window: first + second, as if nothing had come between
    whole = torch.cat([first.to_tensordict(), second.to_tensordict()])
    for got, want in zip(probe.grads, full_batch_grads(ref_model, as_dict(whole), classify)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    other(state, second)  # at a window boundary the other step runs
    assert state.step == 2


def test_calls_mode_failures_refused_input_keeps_window_failed_call_discards_it(net):
    probe = GradProbe()
    fail = {"on": False}

    def fn(model, batch):
        if fail["on"]:
            raise RuntimeError("boom")
        return classify(model, batch)

    step = af.apply_transform(af.with_accumulation(2, mode="calls")(fn), probe.transform)
    ref_model = copy.deepcopy(net)
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.0))
    first, second = make_batch(n=4, seed=1), make_batch(n=6, seed=2)
    step(state, first)
    with pytest.raises(TypeError):
        step(state, [1, 2, 3])  # refused before anything runs: the window stays open
    step(state, second)  # closes the window: first + second
    whole = torch.cat([first.to_tensordict(), second.to_tensordict()])
    for got, want in zip(probe.grads, full_batch_grads(ref_model, as_dict(whole), classify)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    step(state, first)
    fail["on"] = True
    with pytest.raises(RuntimeError, match="boom"):
        step(state, second)  # fails in the forward: the open window is discarded
    fail["on"] = False
    assert all(p.grad is None for p in net.parameters())
    step(state, second)
    step(state, first)  # a fresh window: second + first
    whole = torch.cat([second.to_tensordict(), first.to_tensordict()])
    for got, want in zip(probe.grads, full_batch_grads(ref_model, as_dict(whole), classify)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert state.step == 2


@pytest.mark.parametrize("outer", [True, False])
def test_calls_mode_with_fp16_amp_equals_grad_scaler_loop(net, outer):
    """Calls mode under fp16 loss scaling, either order: the seeds' GradScaler loop with
    loss / n per call, the scale growing after every update; a call that fails mid-window
    discards the window and the scaler's step (both abort hooks), and training goes on."""
    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.SGD, momentum=0.9)
    calls = af.with_accumulation(2, mode="calls")
    amp = af.with_amp(dtype=torch.float16, init_scale=2.0**10, growth_interval=1)
    fail = {"on": False}

    def fn(model, batch):
        if fail["on"]:
            raise RuntimeError("boom")
        return classify(model, batch)

    step = calls(amp(fn)) if outer else amp(calls(fn))
    state = af.TrainState(m1, o1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    batches = [make_batch(n=6, seed=i) for i in range(6)]
    for i, batch in enumerate(batches):
        step(state, batch)
        if i == 2:  # window open: a failing call discards it
            fail["on"] = True
            with pytest.raises(RuntimeError, match="boom"):
                step(state, batch)
            fail["on"] = False
            assert all(p.grad is None for p in m1.parameters())
    windows = [batches[0:2], batches[3:5]]  # batches[2] was discarded; batches[5] is open
    for window in windows:
        for batch in window:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = classify(m2, as_dict(batch))["loss"]
            scaler.scale(loss / 2).backward()
        scaler.step(o2)
        scaler.update()
        o2.zero_grad(set_to_none=True)
    assert state.step == 2
    assert state.slots["with_amp"].get_scale() == scaler.get_scale() == 2.0**12
    # fp16 backward rounds differently when the loss is weighted by samples (the step's
    # loss * 6, gradients / 12) than by loss / 2: 4e-5 apart; a 5% weighting error is 2e-3
    assert_params_equal(m1, m2, exact=False, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------- the batch contract
@pytest.fixture
def unwarned(monkeypatch):
    """A process that has not been warned about small batches yet."""
    import accelfn.parts.accumulation as accumulation

    monkeypatch.setattr(accumulation, "_warned_small", False)


def test_a_batch_smaller_than_n_warns_once_naming_calls_and_is_one_whole_update(net, unwarned):
    """A loader of micro-batches (Accelerate's and Fabric's habit) meets mode='split'."""
    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.SGD, momentum=0.9)
    step = af.with_accumulation(4)(classify)
    state = af.TrainState(m1, o1)
    with pytest.warns(UserWarning, match=r"with_accumulation\(4, mode='calls'\)") as caught:
        for i in range(3):
            batch = make_batch(n=3, seed=i)
            metrics = step(state, batch)
            ref = reference_update(m2, o2, as_dict(batch), classify, micro=3)
            expected = sum(loss * (1 / 3) for loss in ref["losses"])
            torch.testing.assert_close(metrics["loss"], expected, atol=0, rtol=0)
    assert len([w for w in caught if "mode='calls'" in str(w.message)]) == 1  # once
    assert "batch of 3 sample(s), fewer than its 4 micro-batches" in str(caught[0].message)
    assert caught[0].filename == __file__  # points at the loop's line
    assert_params_equal(m1, m2)  # one update per call, on the whole (small) batch


def test_batches_of_at_least_n_samples_and_calls_mode_do_not_warn(net, unwarned):
    import warnings

    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        af.with_accumulation(4)(classify)(state, make_batch(n=4))
        calls = af.with_accumulation(4, mode="calls")(classify)
        for i in range(4):
            calls(state, make_batch(n=2, seed=i))


def _linear_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    return model, af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_metric_returned_by_some_micro_batches_only_is_refused_before_any_change():
    # averaged over the whole batch, it cannot be: its missing shares would count as 0
    def sometimes(model, batch):
        out = classify(model, batch)
        if batch["x"].shape[0] > 4:  # the first micro-batch of 5 rows, not the second of 4
            out["extra"] = out["loss"].detach() * 0
        return out

    model, state = _linear_state()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"metrics \['accuracy'\] for a micro-batch.*"
                                         r"\['accuracy', 'extra'\]"):
        af.with_accumulation(2)(sometimes)(state, make_batch(n=9))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert state.step == 0 and all(p.grad is None for p in model.parameters())


def test_weight_returned_by_some_calls_of_a_window_only_is_refused():
    # a token count and a sample count would weigh one window's calls in two units
    def weighted_when_long(model, batch):
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        return {"loss": loss, "weight": torch.tensor(1000.0)} if batch["x"].shape[0] > 4 \
            else loss

    _, state = _linear_state()
    step = af.with_accumulation(2, mode="calls")(weighted_when_long)
    step(state, make_batch(n=8))
    with pytest.raises(ValueError, match=r"'weight' for some micro-batches \(or calls\)"):
        step(state, make_batch(n=2, seed=1))
    assert state.step == 0


def test_a_split_returning_an_empty_micro_batch_is_refused_naming_it():
    # a mean over no sample is NaN: the update would be skipped as non-finite, silently
    def by_label(batch, n):
        return [batch[batch["y"] == 0], batch[batch["y"] != 0]]

    _, state = _linear_state()
    batch = make_batch(n=10)
    batch["y"] = torch.ones(10, dtype=torch.long)
    with pytest.raises(ValueError, match=r"returned empty micro-batches \(at \[0\]\)"):
        af.with_accumulation(2, split=by_label)(classify)(state, batch)
    assert state.step == 0
