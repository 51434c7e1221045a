"""Recipes at their edges: resumed and rebuilt schedules against torch's own, rates that
would move the wrong way, non-finite options, and checkpoints that do not fit the object
loading them (refused before anything changes)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR

from accelfn.recipes.early_stopping import EarlyStopping
from accelfn.recipes.param_groups import param_groups
from accelfn.recipes.schedules import one_cycle, warmup_cosine, warmup_linear, warmup_plateau


def sgd(lr=0.1, momentum=0.9, groups=None):
    if groups is None:
        groups = [{"params": [nn.Parameter(torch.zeros(2))]}]
    return torch.optim.SGD(groups, lr=lr, momentum=momentum)


def lrs(scheduler, n):
    """The lr of each of the next ``n`` updates (of the first group)."""
    optimizer, out = scheduler.optimizer, []
    for _ in range(n):
        out.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        scheduler.step()
    return out


# ---- one_cycle: the peak of a resumed or rebuilt cycle -----------------------------------

def test_one_cycle_built_after_loading_the_optimizer_resumes_as_torchs_does():
    # reference: the same resume with OneCycleLR, which takes max_lr explicitly
    def run(build):
        opt = sgd()
        first = build(opt)
        lrs(first, 4)
        opt_state, sched_state = opt.state_dict(), first.state_dict()
        resumed_opt = sgd()
        resumed_opt.load_state_dict(opt_state)  # mid-cycle: lr is no longer the peak
        resumed = build(resumed_opt)
        resumed.load_state_dict(sched_state)
        return lrs(resumed, 6)

    expected = run(lambda opt: OneCycleLR(opt, max_lr=0.1, total_steps=10))
    assert run(lambda opt: one_cycle(opt, total_steps=10)) == pytest.approx(expected, rel=1e-12)
    # after its first update (the constructor's rate), the uninterrupted cycle's rates
    assert expected[1:] == lrs(OneCycleLR(sgd(), max_lr=0.1, total_steps=10), 10)[5:]


def test_one_cycle_rebuilt_on_the_same_optimizer_keeps_its_peak():
    opt = sgd()
    one_cycle(opt, total_steps=10)  # sets lr to max_lr / div_factor
    again = one_cycle(opt, total_steps=10)
    assert max(lrs(again, 10)) == pytest.approx(0.1)


# ---- warmup_cosine: min_lr above a group's rate ------------------------------------------

def test_warmup_cosine_refuses_a_min_lr_above_a_groups_base_lr():
    # layer-wise rates (layer_decay) give deep groups rates under a min_lr meant for the top:
    # CosineAnnealingLR would make those groups climb to min_lr instead of decaying
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = sgd(groups=[{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 1e-5}])
    before = [g["lr"] for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"min_lr=0\.0001.*1e-05 of param group 1"):
        warmup_cosine(opt, warmup_steps=2, total_steps=10, min_lr=1e-4)
    assert [g["lr"] for g in opt.param_groups] == before
    assert all("initial_lr" not in g for g in opt.param_groups)


@pytest.mark.parametrize("min_lr", [float("nan"), float("inf")])
def test_warmup_cosine_refuses_a_non_finite_min_lr(min_lr):
    with pytest.raises(ValueError, match="min_lr"):
        warmup_cosine(sgd(), warmup_steps=0, total_steps=5, min_lr=min_lr)


# ---- options that would be ignored or fail inside torch ----------------------------------

@pytest.mark.parametrize("build", [warmup_cosine, warmup_linear])
def test_start_factor_without_warmup_is_refused(build):
    opt = sgd()
    with pytest.raises(ValueError, match=r"start_factor.*warmup_steps=0"):
        build(opt, warmup_steps=0, total_steps=5, start_factor=0.01)
    assert "initial_lr" not in opt.param_groups[0]


def test_warmup_plateau_start_factor_without_warmup_is_refused():
    with pytest.raises(ValueError, match=r"start_factor.*warmup_steps=0"):
        warmup_plateau(sgd(), warmup_steps=0, start_factor=0.01)


@pytest.mark.parametrize("option", ["div_factor", "final_div_factor"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_one_cycle_refuses_a_factor_that_is_not_positive(option, value):
    opt = sgd()
    with pytest.raises(ValueError, match=option):
        one_cycle(opt, total_steps=10, **{option: value})
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize("options", [{"factor": "0.1"}, {"patience": -1}, {"cooldown": -2},
                                     {"factor": float("nan")}])
def test_warmup_plateau_refuses_bad_options_clearly(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        warmup_plateau(sgd(), warmup_steps=2, **options)


# ---- param_groups: non-finite numbers ----------------------------------------------------

@pytest.mark.parametrize("options", [
    {"weight_decay": float("nan")}, {"weight_decay": float("inf")},
    {"weight_decay": 0.1, "lr": float("nan")}, {"weight_decay": 0.1, "lr": float("inf")},
    {"weight_decay": 0.1, "lr": True},
    {"weight_decay": 0.1, "rule": "torchvision", "norm_weight_decay": float("nan")},
])
def test_param_groups_refuses_non_finite_numbers(options):
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    key = [k for k in options if k != "rule"][-1]
    with pytest.raises(ValueError, match=key):
        param_groups(model, **options)


def test_param_groups_refuses_an_empty_block_list():
    # blocks=[] would give every parameter depth 1 of 0 blocks: no layer decay at all
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    with pytest.raises(ValueError, match="blocks"):
        param_groups(model, weight_decay=0.1, lr=1.0, layer_decay=0.5, blocks=[])


# ---- EarlyStopping: metrics and checkpoints that do not fit ------------------------------

def test_early_stopping_refuses_a_checkpoint_of_the_other_mode():
    model = nn.Linear(2, 2)
    accuracy = EarlyStopping(patience=3, mode="max")
    accuracy.update(0.9, model)
    losses = EarlyStopping(patience=3, mode="min")
    with pytest.raises(ValueError, match=r"mode='max'.*mode='min'"):
        losses.load_state_dict(accuracy.state_dict())
    assert losses.best is None and losses.calls == 0


def test_early_stopping_incomplete_checkpoint_changes_nothing():
    es = EarlyStopping(patience=3)
    with pytest.raises(ValueError, match="calls"):
        es.load_state_dict({"best": 1.0, "best_index": 0, "counter": 1})
    assert (es.best, es.best_index, es.counter, es.calls) == (None, None, 0, 0)


def test_early_stopping_loads_a_checkpoint_without_mode():
    # checkpoints written before the mode was recorded still load
    model = nn.Linear(2, 2)
    es = EarlyStopping(patience=3)
    es.update(1.0, model)
    saved = es.state_dict()
    del saved["mode"]
    other = EarlyStopping(patience=3)
    other.load_state_dict(saved)
    assert other.best == 1.0 and other.calls == 1


@pytest.mark.parametrize("metric", [TensorDict({"loss": torch.tensor(1.0)}, []),
                                    {"loss": 1.0}, torch.tensor([1.0, 2.0])])
def test_early_stopping_metric_must_be_one_number(metric):
    es = EarlyStopping(patience=3)
    with pytest.raises(TypeError, match=r"one number.*\[\"loss\"\]"):
        es.update(metric, nn.Linear(2, 2))
    assert es.calls == 0 and es.best is None

