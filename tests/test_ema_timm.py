"""with_ema against timm's ModelEmaV3, re-implemented below from timm's source.

The reference is ``timm/utils/model_ema.py``'s ``ModelEmaV3`` as of timm 1.0 (the version on
huggingface/pytorch-image-models' main branch, commit 0a044bf): ``get_decay(step)`` and the
foreach path (``torch._foreach_lerp_(ema, model, weight=1. - decay)`` on the floating
entries of ``state_dict()``, ``copy_`` of the others; with ``exclude_buffers=True`` the lerp
of the parameters and a ``copy_`` of every buffer), updated as timm's ``train.py`` does after
each optimizer update: ``num_updates += 1; model_ema.update(model, step=num_updates)``.
timm itself is not a dependency; the reference imports nothing from accelfn.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import as_dict, classify, make_batch, poisonable, roundtrip
from reference import reference_update
from torch import nn

import accelfn as af
from accelfn.observe.sync_probe import SyncProbe
from accelfn.parts.averaging import _Schedule
from accelfn.transforms.ema import ema_state_dict, with_ema


class BNNet(nn.Module):
    """A classifier with BatchNorm: float running statistics and an integer counter."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.inp(x))))


class ModelEmaV3(nn.Module):
    """timm's ModelEmaV3 (foreach path, EMA on the model's device), its maths unchanged."""

    def __init__(self, model, decay=0.9999, min_decay=0.0, update_after_step=0,
                 use_warmup=False, warmup_gamma=1.0, warmup_power=2 / 3,
                 exclude_buffers=False):
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        self.decay = decay
        self.min_decay = min_decay
        self.update_after_step = update_after_step
        self.use_warmup = use_warmup
        self.warmup_gamma = warmup_gamma
        self.warmup_power = warmup_power
        self.exclude_buffers = exclude_buffers

    def get_decay(self, step=None):
        if step is None:
            return self.decay
        step = max(0, step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_warmup:
            decay = 1 - (1 + step / self.warmup_gamma) ** -self.warmup_power
            decay = max(min(decay, self.decay), self.min_decay)
        else:
            decay = self.decay
        return decay

    @torch.no_grad()
    def update(self, model, step=None):
        decay = self.get_decay(step)
        if self.exclude_buffers:
            self.apply_update_no_buffers_(model, decay)
        else:
            self.apply_update_(model, decay)

    def apply_update_(self, model, decay):
        ema_lerp_values, model_lerp_values = [], []
        for ema_v, model_v in zip(self.module.state_dict().values(),
                                  model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_lerp_values.append(ema_v)
                model_lerp_values.append(model_v)
            else:
                ema_v.copy_(model_v)
        torch._foreach_lerp_(ema_lerp_values, model_lerp_values, weight=1. - decay)

    def apply_update_no_buffers_(self, model, decay):
        ema_params = tuple(self.module.parameters())
        model_params = tuple(model.parameters())
        torch._foreach_lerp_(ema_params, model_params, weight=1. - decay)
        for ema_b, model_b in zip(self.module.buffers(), model.buffers()):
            ema_b.copy_(model_b)


def timm_run(model, optimizer, ema, batches, micro):
    """timm's train loop around the EMA: one update per batch, then update(step=num_updates)."""
    num_updates = 0
    for batch in batches:
        reference_update(model, optimizer, batch, classify, micro=micro)
        num_updates += 1
        ema.update(model, step=num_updates)
        yield num_updates


def assert_equals_timm(state, ema: ModelEmaV3, model):
    got, want = ema_state_dict(state), ema.module.state_dict()
    assert got.keys() == want.keys()
    for key in want:  # every tensor, bitwise
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), f"{key}: {got[key]} != {want[key]}"
    # timm copies the counter: the EMA's is the model's
    assert torch.equal(got["bn.num_batches_tracked"], model.bn.num_batches_tracked)


def fresh():
    """A new BNNet and its TrainState (SGD with momentum), from the same init every time."""
    torch.manual_seed(0)
    model = BNNet()
    return model, af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.05,
                                                       momentum=0.9))


def run_against_timm(options: dict, timm_options: dict, *, updates=30, resume_at=13, micro=2):
    """``updates`` updates of accelfn's with_ema(**options) against ModelEmaV3(**timm_options),
    compared after every update; at ``resume_at`` the run moves to a new state loaded from a
    checkpoint of the old one (state_dict -> torch.save/load -> load_state_dict)."""
    model, state = fresh()
    step = with_ema(**options)(af.with_accumulation(micro)(classify))
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    ref_ema = ModelEmaV3(ref_model, **timm_options)
    batches = [make_batch(n=12, seed=i) for i in range(updates)]
    ref = timm_run(ref_model, ref_opt, ref_ema, [as_dict(b) for b in batches], micro)
    for i, batch in enumerate(batches):
        if i == resume_at:
            saved = roundtrip(state.state_dict())
            model, state = fresh()
            state.load_state_dict(saved)
        step(state, batch)
        next(ref)
        assert_equals_timm(state, ref_ema, model)
    # the average moved away from both the first weights and the model's
    ema = ema_state_dict(state)
    assert not torch.equal(ema["head.weight"], model.head.weight)
    return state, ref_ema


@pytest.mark.parametrize("gamma,power", [(1.0, 2 / 3), (1.0, 3 / 4), (2.0, 0.5)])
def test_power_warmup_equals_model_ema_v3_bitwise(gamma, power):
    # decay 0.9: the warmup 1 - (1 + s / gamma) ** -power stays below it for most updates,
    # so the ramp is what is compared
    run_against_timm({"decay": 0.9, "warmup": "power", "warmup_gamma": gamma,
                      "warmup_power": power, "buffers": "average_floats"},
                     {"decay": 0.9, "use_warmup": True, "warmup_gamma": gamma,
                      "warmup_power": power})


def test_constant_decay_equals_model_ema_v3_without_warmup():
    # timm's get_decay(step) is 0 (a copy) at step 1, then the decay: with_ema's first copy
    run_against_timm({"decay": 0.8, "buffers": "average_floats"}, {"decay": 0.8})


def test_callable_decay_equals_model_ema_v3_with_every_option():
    # update_after_step and min_decay live in timm's get_decay: the callable carries them
    timm_options = {"decay": 0.95, "min_decay": 0.3, "update_after_step": 4, "use_warmup": True,
                    "warmup_gamma": 1.5, "warmup_power": 0.75}
    decay_of = ModelEmaV3(nn.Linear(1, 1), **timm_options).get_decay
    calls = []

    def timm_decay(updates):
        calls.append(updates)
        return decay_of(updates)

    run_against_timm({"decay": timm_decay, "buffers": "average_floats"}, timm_options)
    assert calls == list(range(1, 31))  # timm's num_updates, across the checkpoint too


def test_buffers_copy_equals_model_ema_v3_excluding_buffers():
    run_against_timm({"decay": 0.9, "warmup": "power", "buffers": "copy"},
                     {"decay": 0.9, "use_warmup": True, "exclude_buffers": True})


def test_the_default_buffers_are_averaged_model_s_not_timm_s():
    # with_ema's default averages num_batches_tracked and truncates it (AveragedModel):
    # timm's counter is the model's, so "average_floats" is needed for timm's state_dict
    model, state = fresh()
    step = with_ema(decay=0.9, warmup="power")(classify)
    for i in range(6):
        step(state, make_batch(seed=i))
    ema = ema_state_dict(state)
    assert ema["bn.num_batches_tracked"].item() < model.bn.num_batches_tracked.item() == 6


def test_skipped_updates_are_counted_not_averaged():
    fn, poison = poisonable()
    _, state = fresh()
    seen = []

    def decay(updates):
        seen.append(updates)
        return 0.5

    step = with_ema(decay=decay, buffers="average_floats")(fn)
    for i in range(6):
        poison["on"] = i == 3
        before = {k: v.clone() for k, v in ema_state_dict(state).items()} if i else None
        metrics = step(state, make_batch(seed=i))
        if poison["on"]:
            assert metrics["skipped"].item() == 1
            assert all(torch.equal(before[k], v) for k, v in ema_state_dict(state).items())
    assert seen == [1, 2, 3, 4, 5, 6]  # state.step: the skipped update keeps its place


@pytest.mark.parametrize("options", [
    {"warmup": "power", "every": 2, "buffers": "average_floats"},
    {"decay": lambda n: 0.9, "buffers": "average_floats"},
    {"decay": lambda n: 0.9, "formula": "weighted_sum"},
])
def test_host_decays_add_no_host_sync(options):
    model, state = fresh()
    step = with_ema(**options)(classify)
    step(state, make_batch())
    slot = state.slots["with_ema"]
    decay = options.pop("decay", 0.999)
    fn = decay if callable(decay) else None
    schedule = _Schedule(0.0 if fn else decay, decay_fn=fn,
                         **{k: v for k, v in options.items() if k != "buffers"})
    with SyncProbe(mode="emulate") as probe:
        for index in range(4):
            slot.update(model, torch.tensor(index == 2), schedule, index)
    assert probe.syncs == []
    assert len(slot._constants) <= 1  # a new decay each update: filled in place, not cached


@pytest.mark.parametrize("kwargs,match", [
    ({"decay": lambda n: 0.9, "warmup": True}, "drop warmup"),
    ({"decay": lambda n: 0.9, "adjust": 2.0}, "drop warmup"),
    ({"warmup": "tf"}, "True or False"),
    ({"warmup_power": 0.75}, "warmup='power'"),
    ({"warmup": "power", "warmup_gamma": 0.0}, "warmup_gamma"),
    ({"warmup": "power", "warmup_power": float("inf")}, "warmup_power"),
    ({"buffers": "floats"}, "buffers"),
])
def test_options_are_checked(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        with_ema(**kwargs)


def test_a_callable_returning_no_decay_is_refused_with_the_fix():
    _, state = fresh()
    step = with_ema(decay=lambda n: torch.tensor(0.9))(classify)
    with pytest.raises(ValueError, match=r"number in \[0, 1\]"):
        step(state, make_batch())


def test_description_names_the_options():
    def timm_decay(n):
        return 0.9

    assert repr(with_ema(decay=timm_decay, buffers="average_floats")(classify)).startswith(
        "with_ema(decay=timm_decay, buffers='average_floats')")
    assert repr(with_ema(decay=0.99, warmup="power", warmup_power=0.75)(classify)).startswith(
        "with_ema(0.99, warmup='power', warmup_gamma=1, warmup_power=0.75)")
