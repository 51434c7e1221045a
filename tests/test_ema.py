"""with_ema against torch.optim.swa_utils.AveragedModel updated after each optimizer step."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Net, as_dict, classify, clone_setup, make_batch, poisonable, roundtrip
from reference import reference_update
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import accelfn as af
from accelfn.observe.sync_probe import SyncProbe
from accelfn.parts.averaging import _Schedule
from accelfn.transforms.ema import ema_state_dict, ema_weights, with_ema


class BNNet(nn.Module):
    """A classifier with BatchNorm: float running statistics and an integer counter."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.inp(x))))


def ema_values(state):
    return state.slots["with_ema"].named_values()


def assert_matches_averaged_model(state, ref: AveragedModel, buffers: bool = True):
    ema = ema_values(state)
    for name, p in ref.module.named_parameters():
        assert torch.equal(ema[name], p), f"{name}: max {(ema[name] - p).abs().max()}"
    if buffers:  # all of them: the integer num_batches_tracked too
        for name, b in ref.module.named_buffers():
            assert ema[f"buffer:{name}"].dtype == b.dtype, name
            assert torch.equal(ema[f"buffer:{name}"], b), (name, ema[f"buffer:{name}"], b)


@pytest.mark.parametrize("micro", [1, 2])
def test_equals_averaged_model_step_by_step(micro):
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(BNNet(), torch.optim.AdamW, lr=1e-2)
    ref = AveragedModel(m2, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    step = with_ema(decay=0.9)(af.with_accumulation(micro)(classify))
    state = af.TrainState(m1, o1)
    for i in range(5):
        batch = make_batch(seed=i)
        step(state, batch)
        reference_update(m2, o2, as_dict(batch), classify, micro=micro)
        ref.update_parameters(m2)
        assert_matches_averaged_model(state, ref)  # bitwise, after every update
    ema = ema_values(state)
    assert not torch.equal(ema["head.weight"], m1.head.weight)  # really an average
    got, want = ema_state_dict(state), ref.module.state_dict()
    assert got.keys() == want.keys()
    for k in want:  # what the docs promise: the whole state_dict, bitwise
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("decay", [0.9, 0.4])
@pytest.mark.parametrize("warmup", [False, True])
def test_the_batch_counter_is_averaged_model_s_over_many_updates(decay, warmup):
    # num_batches_tracked: AveragedModel averages it in float and truncates it back (it is
    # not the model's count); the report had 20 (the model's) against 10
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(BNNet(), torch.optim.SGD, lr=0.05, momentum=0.9)
    ref = AveragedModel(m2, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    step = with_ema(decay=decay, warmup=warmup)(af.with_accumulation(2)(classify))
    state = af.TrainState(m1, o1)
    for i in range(12):
        batch = make_batch(seed=i)
        step(state, batch)
        reference_update(m2, o2, as_dict(batch), classify, micro=2)
        if warmup:  # the same decay ramp, as a float, by hand
            n = int(ref.n_averaged)
            ref.multi_avg_fn = get_ema_multi_avg_fn(min(decay, (1 + n) / (10 + n)))
        ref.update_parameters(m2)
        if not warmup:
            assert_matches_averaged_model(state, ref)  # bitwise, after every update
    counter = ema_values(state)["buffer:bn.num_batches_tracked"]
    want = ref.module.bn.num_batches_tracked
    assert counter.dtype == torch.int64 and m1.bn.num_batches_tracked.item() == 24
    if warmup:  # the decay is a float32 device tensor here: the counter still agrees
        assert counter.item() == want.item()
    else:
        assert torch.equal(counter, want) and counter.item() < 24


def test_buffers_copy_equals_averaged_model_without_buffers():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(BNNet(), torch.optim.SGD, lr=0.1, momentum=0.9)
    ref = AveragedModel(m2, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    step = with_ema(decay=0.8, buffers="copy")(classify)
    state = af.TrainState(m1, o1)
    for i in range(4):
        batch = make_batch(seed=i)
        step(state, batch)
        reference_update(m2, o2, as_dict(batch), classify)
        ref.update_parameters(m2)
    got, want = ema_state_dict(state), ref.module.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_skipped_updates_leave_the_average_alone_and_every_counts_real_updates(net):
    fn, poison = poisonable()

    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.AdamW, lr=1e-2)
    ref = AveragedModel(m2, multi_avg_fn=get_ema_multi_avg_fn(0.7))
    state = af.TrainState(m1, o1)
    step = with_ema(decay=0.7, every=2)(fn)
    real = 0
    for i in range(7):
        poison["on"] = i in (0, 3)  # the very first update is skipped too
        batch = make_batch(seed=i)
        before = {k: v.clone() for k, v in ema_values(state).items()} if i else None
        metrics = step(state, batch)
        if poison["on"]:
            assert metrics["skipped"].item() == 1
            if before is not None:
                assert all(torch.equal(before[k], v) for k, v in ema_values(state).items())
            continue
        reference_update(m2, o2, as_dict(batch), fn)
        real += 1
        if real % 2 == 0:
            ref.update_parameters(m2)
        assert_matches_averaged_model(state, ref, buffers=False)
    slot = state.slots["with_ema"]
    assert slot.updates.item() == 5 and slot.n_averaged.item() == 2
    assert ref.n_averaged.item() == 2


def test_warmup_uses_min_decay_and_its_ramp():
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = with_ema(decay=0.5, warmup=True)(classify)
    expected = None
    for i in range(11):  # the ramp reaches the decay at the 9th average
        step(state, make_batch(seed=i))
        weights = [p.detach().double() for p in model.parameters()]
        if expected is None:
            expected = weights  # the first average copies
        else:
            n = i  # averages taken before this one
            d = min(0.5, (1 + n) / (10 + n))
            expected = [d * e + (1 - d) * w for e, w in zip(expected, weights)]
    for (name, e), want in zip(ema_values(state).items(), expected):
        torch.testing.assert_close(e.double(), want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("options", [
    {"every": 2, "warmup": True},
    {"every": 2, "updates_per_epoch": 3, "warmup_epochs": 1, "formula": "weighted_sum"},
])
def test_update_has_no_host_sync(options):
    torch.manual_seed(0)
    model = BNNet()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = with_ema(decay=0.9, **options)(classify)
    step(state, make_batch())
    slot = state.slots["with_ema"]
    schedule = _Schedule(0.9, **options)
    with SyncProbe(mode="emulate") as probe:
        for index in range(4):
            slot.update(model, torch.tensor(index == 2), schedule, index)
    assert probe.syncs == []


def test_checkpoint_resume_equals_uninterrupted_run():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(BNNet(), torch.optim.AdamW, lr=1e-2)
    step = with_ema(decay=0.9)(classify)
    s1 = af.TrainState(m1, o1)
    s2 = af.TrainState(m2, o2)
    for i in range(3):
        step(s1, make_batch(seed=i))
        step(s2, make_batch(seed=i))
    saved = roundtrip(s2.state_dict())
    assert "with_ema" in saved["slots"]
    m3 = BNNet()
    s3 = af.TrainState(m3, torch.optim.AdamW(m3.parameters(), lr=1e-2))
    s3.load_state_dict(saved)  # applied when the slot is created, at the first call
    for i in range(3, 6):
        step(s1, make_batch(seed=i))
        step(s3, make_batch(seed=i))
    for k, v in ema_values(s1).items():
        assert torch.equal(v, ema_values(s3)[k]), k
    assert ema_values(s3)["inp.weight"] is not ema_values(s1)["inp.weight"]


def test_evaluate_with_ema_weights_then_restore():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(BNNet(), torch.optim.AdamW, lr=1e-2)
    ref = AveragedModel(m2, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    step = with_ema(decay=0.9)(classify)
    state = af.TrainState(m1, o1)
    for i in range(3):
        batch = make_batch(seed=i)
        step(state, batch)
        reference_update(m2, o2, as_dict(batch), classify)
        ref.update_parameters(m2)
    own = copy.deepcopy(m1.state_dict())
    val = make_batch(n=16, seed=99)
    with ema_weights(state) as model:
        assert model is m1
        metrics = step.evaluate(state, val)
    with torch.no_grad():
        expected = classify(ref.module.eval(), as_dict(val))
    assert torch.equal(metrics["loss"], expected["loss"])
    for k, v in m1.state_dict().items():  # the model's own weights are back, exactly
        assert torch.equal(v, own[k]), k
    assert not torch.equal(step.evaluate(state, val)["loss"], metrics["loss"])
    fresh = BNNet()
    fresh.load_state_dict(ema_state_dict(state))
    for k, v in ref.module.state_dict().items():
        if v.is_floating_point():
            assert torch.equal(fresh.state_dict()[k], v), k


def test_tied_weights_and_restore_after_an_error():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = self.a
            self.head = nn.Linear(6, 4)

        def forward(self, x):
            return self.head(self.b(self.a(x)))

    torch.manual_seed(0)
    model = Tied()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = with_ema(decay=0.5)(classify)
    for i in range(3):
        step(state, make_batch(seed=i))
    sd = ema_state_dict(state)
    assert torch.equal(sd["a.weight"], sd["b.weight"])
    assert torch.equal(sd["a.weight"], ema_values(state)["a.weight"])
    own = model.a.weight.detach().clone()
    with pytest.raises(RuntimeError, match="boom"), ema_weights(state):
        assert torch.equal(model.a.weight, sd["a.weight"])
        with torch.no_grad():
            model.a.weight.add_(1.0)  # discarded: never reaches the average
        raise RuntimeError("boom")
    assert torch.equal(model.a.weight, own)
    assert torch.equal(ema_values(state)["a.weight"], sd["a.weight"])


def test_errors_and_description():
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="with_ema"):
        with ema_weights(state):
            pass
    for kwargs, match in [({"decay": 1.0}, r"\[0, 1\)"), ({"every": 0}, "int >= 1"),
                          ({"buffers": "mean"}, "buffers"), ({"warmup": 5}, "True or False")]:
        with pytest.raises((ValueError, TypeError), match=match):
            with_ema(**kwargs)
    with pytest.raises(TypeError, match="keyword"):
        with_ema(0.99)
    assert repr(with_ema(classify)) == "with_ema(0.999) ∘ classify"
    assert repr(with_ema(decay=0.9, every=4, warmup=True)(classify)).startswith(
        "with_ema(0.9, every=4, warmup)")
    step = with_ema(classify)
    step.prepare(state)  # creates the average: the model's weights, nothing averaged yet
    with ema_weights(state):
        assert torch.equal(model.head.weight, ema_values(state)["head.weight"])
    with pytest.raises(ValueError, match="applied twice"):
        with_ema(with_ema(classify))


def test_evaluate_with_ema_weights_option():
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))

    def fn(m, b):
        return F.mse_loss(m(b["x"]), b["y"])

    step = af.with_ema(decay=0.5)(fn)
    batch = {"x": torch.randn(8, 4), "y": torch.randn(8, 2)}
    for _ in range(3):
        step(state, batch)
    with af.ema_weights(state):
        expected = step.evaluate(state, batch)["loss"]
    got = step.evaluate(state, batch, weights="ema")["loss"]
    own = step.evaluate(state, batch)["loss"]
    assert torch.equal(got, expected) and not torch.equal(got, own)
    with pytest.raises(TypeError, match="unknown option"):
        step.evaluate(state, batch, weight="ema")
    with pytest.raises(ValueError, match="'model' or 'ema'"):
        step.evaluate(state, batch, weights="best")
    with pytest.raises(TypeError, match="offers none"):
        af.lift(fn).evaluate(state, batch, weights="ema")


# ----------------------------------------------------------------- torchvision's schedule
class TorchvisionEMA(torch.optim.swa_utils.AveragedModel):
    """torchvision's references/classification/utils.py ExponentialMovingAverage, verbatim."""

    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


def torchvision_run(model, optimizer, loader, *, epochs, batch_size, world_size=1,
                    model_ema_steps, model_ema_decay, lr_warmup_epochs, after=None):
    """torchvision's train.py: its EMA set-up in main() and train_one_epoch's loop."""
    adjust = world_size * batch_size * model_ema_steps / epochs
    alpha = 1.0 - model_ema_decay
    alpha = min(1.0, alpha * adjust)
    model_ema = TorchvisionEMA(model, device="cpu", decay=1.0 - alpha)
    for epoch in range(epochs):
        model.train()
        for i, batch in enumerate(loader):
            output = model(batch["x"])
            loss = torch.nn.functional.cross_entropy(output, batch["y"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if model_ema and i % model_ema_steps == 0:
                model_ema.update_parameters(model)
                if epoch < lr_warmup_epochs:
                    # Reset ema buffer to keep copying weights during warmup period
                    model_ema.n_averaged.fill_(0)
            if after is not None:
                after(epoch, i, model_ema)
    return model_ema


def torchvision_ema(*, epochs, batch_size, world_size=1, model_ema_steps, model_ema_decay,
                    lr_warmup_epochs, per_epoch):
    """The same schedule as with_ema options."""
    return with_ema(decay=model_ema_decay, every=model_ema_steps, updates_per_epoch=per_epoch,
                    warmup_epochs=lr_warmup_epochs, formula="weighted_sum",
                    adjust=world_size * batch_size * model_ema_steps / epochs)


def assert_equals_torchvision_ema(state, model_ema):
    got, want = ema_state_dict(state), model_ema.module.state_dict()
    assert got.keys() == want.keys()
    for k in want:  # num_batches_tracked too: averaged, then truncated, as torchvision does
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


TV = dict(epochs=5, batch_size=10, model_ema_steps=3, model_ema_decay=0.99,
          lr_warmup_epochs=2)


def test_torchvision_schedule_equals_its_exponential_moving_average_bitwise():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(BNNet(), torch.optim.SGD, lr=0.1, momentum=0.9)
    loader = [as_dict(make_batch(seed=i)) for i in range(7)]  # 7 updates an epoch
    step = torchvision_ema(**TV, per_epoch=len(loader))(classify)
    state = af.TrainState(m1, o1)
    checked = []

    def after(epoch, i, model_ema):
        step(state, loader[i])
        assert_equals_torchvision_ema(state, model_ema)  # after every update, bitwise
        checked.append(int(model_ema.n_averaged))

    ref = torchvision_run(m2, o2, loader, **TV, after=after)
    # 3 averages an epoch (i = 0, 3, 6); copies during the 2 warm-up epochs, then averages
    assert checked[:14] == [0] * 14 and checked[-1] == 3 * 3
    assert slot_n(state) == ref.n_averaged.item() == 9
    for n, p in m1.named_parameters():
        assert torch.equal(p, dict(m2.named_parameters())[n]), n
    val = make_batch(n=16, seed=99)
    with torch.no_grad():
        expected = classify(ref.module.eval(), as_dict(val))["loss"]
    assert torch.equal(step.evaluate(state, val, weights="ema")["loss"], expected)


def slot_n(state):
    return state.slots["with_ema"].n_averaged.item()


def test_every_alone_is_not_torchvisions_schedule():
    """The issue's report: every=k counts real updates across epochs, no warm-up copies."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(BNNet(), torch.optim.SGD, lr=0.1, momentum=0.9)
    loader = [as_dict(make_batch(seed=i)) for i in range(7)]
    step = with_ema(decay=0.94, every=3)(classify)
    state = af.TrainState(m1, o1)
    ref = torchvision_run(m2, o2, loader, **TV,
                          after=lambda epoch, i, ema: step(state, loader[i]))
    got, want = ema_state_dict(state), ref.module.state_dict()
    assert not torch.equal(got["head.weight"], want["head.weight"])


def test_torchvision_schedule_skips_and_resumes_mid_epoch():
    """A skipped update is not averaged and keeps its place in the epoch; a checkpoint taken
    mid-epoch resumes the schedule where it was."""
    fn, poison = poisonable()
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(BNNet(), torch.optim.SGD, lr=0.1, momentum=0.9)
    step = torchvision_ema(**TV, per_epoch=4)(fn)
    s1, s2 = af.TrainState(m1, o1), af.TrainState(m2, o2)
    step.prepare(s1)
    step.prepare(s2)
    for k in range(10):  # epochs 0, 1 (warm-up) and half of 2
        poison["on"] = k == 4  # i = 0 of epoch 1: due, but skipped
        for s in (s1, s2):
            before = {n: v.clone() for n, v in ema_values(s).items()}
            step(s, make_batch(seed=k))
            if poison["on"]:
                assert all(torch.equal(before[n], v) for n, v in ema_values(s).items())
    saved = roundtrip(s2.state_dict())
    m3 = BNNet()
    s3 = af.TrainState(m3, torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9))
    s3.load_state_dict(saved)
    poison["on"] = False
    for k in range(10, 20):
        step(s1, make_batch(seed=k))
        step(s3, make_batch(seed=k))
    for n, v in ema_values(s1).items():
        assert torch.equal(v, ema_values(s3)[n]), n
    # averages at i = 0 and 3 of each epoch: epochs 0-1 copy (n reset), 2-4 average
    assert slot_n(s1) == 6 and s1.slots["with_ema"].updates.item() == 19


def test_adjust_scales_one_minus_decay_up_to_a_copy():
    t = with_ema(decay=0.99998, every=32, adjust=8 * 128 * 32 / 600, formula="weighted_sum")
    assert dict(t.options)["decay"] == 0.99998
    assert t.label == "with_ema(0.99998, every=32, adjust=54.6133, formula='weighted_sum')"
    torch.manual_seed(0)
    model = BNNet()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5))
    step = with_ema(decay=0.9, adjust=100.0)(classify)  # alpha = min(1, 0.1 * 100): copies
    for i in range(3):
        step(state, make_batch(seed=i))
    for k, v in ema_state_dict(state).items():
        assert torch.equal(v, model.state_dict()[k]), k


@pytest.mark.parametrize("kwargs,match", [
    ({"updates_per_epoch": 0}, "updates_per_epoch"),
    ({"warmup_epochs": 2}, "needs updates_per_epoch"),
    ({"updates_per_epoch": 5, "warmup_epochs": -1}, "warmup_epochs"),
    ({"adjust": 0.0}, "adjust"),
    ({"formula": "mean"}, "formula"),
])
def test_schedule_options_are_checked(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        with_ema(**kwargs)


def test_torchvision_schedule_passes_the_contract():
    from accelfn.testing import check_transform, plain_update

    def loss_fn(model, batch):
        return classify(model, batch)["loss"]

    def make_model():
        torch.manual_seed(0)
        return BNNet()

    report = check_transform(
        torchvision_ema(**TV, per_epoch=2),
        reference=lambda m, o, b: plain_update(m, o, b, loss_fn), loss_fn=loss_fn,
        make_model=make_model, make_batch=lambda i: as_dict(make_batch(seed=i)), steps=4)
    assert {"reference", "orders", "resume"} <= set(report.passed), report.passed


def _ema_run(seed=0):
    torch.manual_seed(seed)
    model = BNNet()
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return state, with_ema(decay=0.9)(classify)


@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
def test_saving_inside_ema_weights_saves_the_models_own_weights(tmp_path, how):
    """Keeping the best model at evaluation time: a save inside ``ema_weights`` holds the
    model's own weights as the model and the average as the EMA, and the run resumes from
    it as if it had not been evaluated."""
    from accelfn import checkpointing as ckpt

    state, step = _ema_run()
    for i in range(3):
        step(state, make_batch(seed=i))
    own = copy.deepcopy(state.model.state_dict())
    ema = {k: v.clone() for k, v in ema_values(state).items()}
    assert any(not torch.equal(own[k], ema[k]) for k in own if k in ema)
    with ema_weights(state):
        step.evaluate(state, make_batch(n=16, seed=99))
        if how == "state_dict":
            saved = roundtrip(state.state_dict())
        else:
            ckpt.save(tmp_path, state, step=step)
        assert torch.equal(state.model.inp.weight, ema["inp.weight"])  # still evaluating EMA
    resumed, step2 = _ema_run(seed=5)
    if how == "state_dict":
        resumed.load_state_dict(saved)
        step2.prepare(resumed)
    else:
        ckpt.load(tmp_path, resumed, step=step2)
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, own[k]), k
    for k, v in ema_values(resumed).items():
        assert torch.equal(v, ema[k]), k
    batch = make_batch(seed=3)
    step(state, batch)
    step2(resumed, batch)
    for (k, a), b in zip(state.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
    for k, v in ema_values(resumed).items():
        assert torch.equal(v, ema_values(state)[k]), k


def test_loading_inside_ema_weights_is_refused_and_changes_nothing():
    state, step = _ema_run()
    step(state, make_batch(seed=0))
    saved = copy.deepcopy(state.state_dict())
    step(state, make_batch(seed=1))
    own = copy.deepcopy(state.model.state_dict())
    with ema_weights(state):
        inside = copy.deepcopy(state.model.state_dict())
        with pytest.raises(RuntimeError, match="ema_weights"):
            state.load_state_dict(saved)
        for k, v in state.model.state_dict().items():
            assert torch.equal(v, inside[k]), k
        with ema_weights(state):  # nested: still the model's own weights are saved
            for k, v in state.state_dict()["model"].items():
                assert torch.equal(v, own[k]), k
    for k, v in state.model.state_dict().items():
        assert torch.equal(v, own[k]), k
    assert state.step == 2
    state.load_state_dict(saved)  # outside the block it loads
    assert state.step == 1


def test_a_sharded_save_inside_ema_weights_is_refused_before_writing(tmp_path):
    # torch.distributed.checkpoint reads the model's tensors, which hold the EMA in the block
    from accelfn import checkpointing as ckpt

    state, step = _ema_run()
    step(state, make_batch(seed=0))
    before = copy.deepcopy(state.model.state_dict())
    with ema_weights(state), pytest.raises(RuntimeError, match="after the block"):
        ckpt.save(tmp_path / "run", state, step=step, sharded=True)
    assert not (tmp_path / "run").exists()
    for k, v in state.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    ckpt.save(tmp_path / "run", state, step=step, sharded=True)  # after the block: works


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "dcp"])
def test_a_load_inside_ema_weights_is_refused_before_anything_changes(tmp_path, sharded):
    # torch.distributed.checkpoint writes into the model and optimizer before the state is
    # loaded: the refusal must come first, leaving the optimizer's moments as they were
    from accelfn import checkpointing as ckpt

    state, step = _ema_run()
    step(state, make_batch(seed=0))
    path = ckpt.save(tmp_path / "run", state, step=step, sharded=sharded)
    step(state, make_batch(seed=1))
    optimizer = copy.deepcopy(state.optimizer.state_dict())
    own = copy.deepcopy(state.model.state_dict())
    with ema_weights(state), pytest.raises(RuntimeError, match="after the block"):
        ckpt.load(path, state, step=step)
    after = state.optimizer.state_dict()
    for i, moments in optimizer["state"].items():
        for k, v in moments.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    for k, v in state.model.state_dict().items():
        assert torch.equal(v, own[k]), k
    assert state.step == 2
    assert ckpt.load(path, state, step=step).step == 1  # after the block it loads
