"""af.schedule: any parameter-group key as a function of the update count, against nanochat's
loop (which sets Muon's momentum and weight decay, and every rate, before each update),
checkpointed and resumed mid-run, bitwise in fp32.

The references are nanochat's ``scripts/base_train.py`` functions, written out below:
``get_muon_momentum`` (0.85 -> 0.95 over the first 300 steps, its earlier version),
``get_weight_decay`` (cosine to zero over the run) and ``get_lr_multiplier``.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import Net, as_dict, classify, make_batch, poisonable, roundtrip
from torch.optim.lr_scheduler import ChainedScheduler

import accelfn as af
from accelfn.recipes.hyperparameters import Schedule, schedule
from accelfn.recipes.schedules import warmup_stable_decay

TOTAL = 40
WEIGHT_DECAY = 0.2


def get_muon_momentum(it):
    frac = min(it / 300, 1)
    momentum = (1 - frac) * 0.85 + frac * 0.95
    return momentum


def get_weight_decay(it):
    return WEIGHT_DECAY * 0.5 * (1 + math.cos(math.pi * it / TOTAL))


def adamw_weight_decay(it):
    return 0.01 * (1 - it / TOTAL)


def adamw_betas(it):
    return (0.9, min(0.999, 0.95 + 0.002 * it))


def get_lr_multiplier(it, num_iterations=TOTAL, warmup_iters=5, warmdown_iters=12,
                      final_lr_frac=0.1):
    if it < warmup_iters:
        return (it + 1) / warmup_iters
    elif it <= num_iterations - warmdown_iters:
        return 1.0
    else:
        progress = (num_iterations - it) / warmdown_iters
        return progress * 1.0 + (1 - progress) * final_lr_frac


def muon_and_adamw(seed=0):
    """Net with Muon on the blocks' 2-D weights and AdamW on the rest (nanochat's split)."""
    torch.manual_seed(seed)
    model = Net()
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if not (n.startswith("blocks.")
                                                           and p.ndim == 2)]
    muon = torch.optim.Muon(hidden, lr=0.02, momentum=0.95, weight_decay=WEIGHT_DECAY)
    adamw = torch.optim.AdamW(rest, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.01)
    return model, muon, adamw


def nanochat_update(model, muon, adamw, batch, step, lrm=None):
    """One update of nanochat's loop: set the hyperparameters of update ``step``, then step."""
    loss = classify(model, batch)["loss"]
    loss.backward()
    if lrm is not None:
        for opt in (muon, adamw):
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lrm(step)
    for group in muon.param_groups:
        group["momentum"] = get_muon_momentum(step)
        group["weight_decay"] = get_weight_decay(step)
    if lrm is None:  # the AdamW schedules of the first test
        for group in adamw.param_groups:
            group["weight_decay"] = adamw_weight_decay(step)
            group["betas"] = adamw_betas(step)
    muon.step()
    adamw.step()
    model.zero_grad(set_to_none=True)


def assert_same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: max {(p - q).abs().max()}"


# ----------------------------------------------------------------- against nanochat
def test_muon_and_adamw_schedules_train_as_nanochat_through_a_checkpoint():
    def build():
        model, muon, adamw = muon_and_adamw()
        schedules = [schedule(muon, momentum=get_muon_momentum, weight_decay=get_weight_decay),
                     schedule(adamw, weight_decay=adamw_weight_decay, betas=adamw_betas)]
        return af.TrainState(model, [muon, adamw], scheduler=schedules)

    state, step = build(), af.lift(classify)
    ref_model, ref_muon, ref_adamw = muon_and_adamw()
    for t in range(TOTAL):
        if t == 17:  # a new process: everything rebuilt, then the checkpoint loaded
            saved = roundtrip(state.state_dict())
            assert saved["scheduler"] == [{"last_epoch": 17}, {"last_epoch": 17}]
            state = build()
            state.load_state_dict(saved)
        muon_sched, adamw_sched = state.schedulers
        assert muon_sched.values() == {"momentum": get_muon_momentum(t),
                                       "weight_decay": get_weight_decay(t)}
        assert adamw_sched.values() == {"weight_decay": adamw_weight_decay(t),
                                        "betas[0]": 0.9, "betas[1]": adamw_betas(t)[1]}
        batch = make_batch(seed=t)
        step(state, batch)
        nanochat_update(ref_model, ref_muon, ref_adamw, as_dict(batch), t)
        assert_same_params(state.model, ref_model)  # bitwise, after every update
    muon, adamw = state.optimizers
    assert muon.param_groups[0]["momentum"] == get_muon_momentum(TOTAL)
    assert adamw.param_groups[0]["betas"] == adamw_betas(TOTAL)
    for key in ("exp_avg", "exp_avg_sq"):  # the optimizer state too
        for p, q in zip(adamw.param_groups[0]["params"], ref_adamw.param_groups[0]["params"]):
            assert torch.equal(adamw.state[p][key], ref_adamw.state[q][key])


def test_nanochat_rates_momentum_and_weight_decay_chained_with_warmup_stable_decay():
    def build():
        model, muon, adamw = muon_and_adamw()
        wsd = {"warmup_steps": 5, "decay_steps": 12, "total_steps": TOTAL, "end_factor": 0.1}
        muon_sched = ChainedScheduler([warmup_stable_decay(muon, **wsd), schedule(
            muon, momentum=get_muon_momentum, weight_decay=get_weight_decay)])
        return af.TrainState(model, [muon, adamw],
                             scheduler=[muon_sched, warmup_stable_decay(adamw, **wsd)])

    state, step = build(), af.lift(classify)
    ref_model, ref_muon, ref_adamw = muon_and_adamw()
    for opt in (ref_muon, ref_adamw):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    for t in range(TOTAL):
        if t == 23:
            saved = roundtrip(state.state_dict())
            state = build()
            state.load_state_dict(saved)
        batch = make_batch(seed=t)
        step(state, batch)
        nanochat_update(ref_model, ref_muon, ref_adamw, as_dict(batch), t, get_lr_multiplier)
    assert_same_params(state.model, ref_model)
    muon = state.optimizers[0].param_groups[0]
    assert muon["lr"] == 0.02 * get_lr_multiplier(TOTAL)
    assert muon["momentum"] == get_muon_momentum(TOTAL)


def test_values_follow_the_function_over_the_ramp_and_resume_exactly():
    torch.manual_seed(0)
    _, muon, _ = muon_and_adamw()
    sched = schedule(muon, momentum=get_muon_momentum)
    assert sched.last_epoch == 0 and muon.param_groups[0]["momentum"] == 0.85
    for t in range(400):
        if t == 250:
            saved = roundtrip(sched.state_dict())
            _, muon2, _ = muon_and_adamw()
            muon2.load_state_dict(muon.state_dict())
            sched = schedule(muon2, momentum=get_muon_momentum)
            sched.load_state_dict(saved)
            muon = muon2
        assert muon.param_groups[0]["momentum"] == get_muon_momentum(t), t
        assert sched.last_epoch == t
        muon.step()
        sched.step()
    assert muon.param_groups[0]["momentum"] == 0.95  # the plateau after 300 updates


# ----------------------------------------------------------------- inside the step
def test_one_step_per_update_under_accumulation_and_none_for_a_skipped_update():
    fn, poison = poisonable()
    model, muon, adamw = muon_and_adamw()
    sched = schedule(muon, momentum=get_muon_momentum)
    state = af.TrainState(model, [muon, adamw], scheduler=[sched, None])
    step = af.with_accumulation(3)(fn)
    for i in range(5):
        poison["on"] = i == 2
        metrics = step(state, make_batch(n=12, seed=i))
        assert metrics["skipped"].item() == (i == 2)
    assert sched.last_epoch == 4  # 4 real updates, each one step
    assert muon.param_groups[0]["momentum"] == get_muon_momentum(4)


def test_per_group_functions_leave_other_groups_alone():
    net = Net()
    opt = torch.optim.SGD([{"params": net.inp.parameters(), "weight_decay": 0.1},
                           {"params": net.blocks.parameters(), "weight_decay": 0.0},
                           {"params": net.head.parameters(), "weight_decay": 0.05}],
                          lr=0.1, momentum=0.9)
    sched = schedule(opt, weight_decay={0: lambda t: 0.1 / (t + 1), 2: lambda t: 0.05 * t},
                     momentum=lambda t: 0.8 + 0.01 * t)
    for t in range(4):
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1 / (t + 1), 0.0, 0.05 * t]
        assert [g["momentum"] for g in opt.param_groups] == [0.8 + 0.01 * t] * 3
        assert sched.values() == {"weight_decay/group0": 0.1 / (t + 1),
                                  "weight_decay/group2": 0.05 * t, "momentum": 0.8 + 0.01 * t}
        opt.step()
        sched.step()


def _tensor_hyperparameters(prepared, state):
    for group in state.optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]))
        group["betas"] = tuple(torch.tensor(float(b)) for b in group["betas"])
    return prepared


def test_tensor_hyperparameters_are_filled_in_place():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, foreach=False)

    def lr(t):
        return 1e-2 / (t + 1)

    def betas(t):
        return (0.9 - 0.01 * t, 0.999)

    sched = schedule(opt, lr=lr, betas=betas)  # built while they are floats
    state = af.TrainState(net, opt, scheduler=sched)
    # what compiled(optimizer=True) does to the rate (and tensor betas) when preparing
    _tensor_hyperparameters(None, state)
    step = af.lift(classify)
    step(state, make_batch(seed=0))
    rate, (beta1, _) = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]
    assert isinstance(rate, torch.Tensor) and isinstance(beta1, torch.Tensor)
    for t in range(1, 5):
        step(state, make_batch(seed=t))
        group = opt.param_groups[0]
        assert group["lr"] is rate and group["betas"][0] is beta1  # same tensors
        assert rate.item() == pytest.approx(lr(t + 1))
        assert beta1.item() == pytest.approx(betas(t + 1)[0])
        assert sched.values()["lr"] == lr(t + 1)


# ----------------------------------------------------------------- refusals
@pytest.mark.parametrize("kwargs,match", [
    ({}, "at least one"),
    ({"betas": lambda t: (0.9, 0.99)}, "has no 'betas'"),
    ({"momentum": 0.9}, "function of the update count"),
    ({"momentum": {3: lambda t: 0.9}}, r"keys \[3\]"),
    ({"params": lambda t: 0}, "not a hyperparameter"),
    ({"momentum": lambda t: float("nan")}, "finite number"),
    ({"lr": lambda t: 0.1, "momentum": lambda t: "0.9"}, "finite number"),
    ({"nesterov": lambda t: 1}, "returned 1"),
])
def test_bad_arguments_are_refused_before_anything_changes(kwargs, match):
    opt = torch.optim.SGD(Net().parameters(), lr=0.5, momentum=0.5)
    before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    with pytest.raises((ValueError, TypeError), match=match):
        schedule(opt, **kwargs)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before


def test_a_failing_function_changes_nothing_at_its_update():
    opt = torch.optim.SGD(Net().parameters(), lr=0.5, momentum=0.5)

    def momentum(t):
        if t == 2:
            raise RuntimeError("no value for update 2")
        return 0.9

    sched = schedule(opt, lr=lambda t: 0.1 * (t + 1), momentum=momentum)
    sched.step()
    with pytest.raises(RuntimeError, match="update 2"):
        sched.step()
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.2
    with pytest.raises(ValueError, match="state"):
        sched.load_state_dict({"last_epoch": -1})
    assert sched.last_epoch == 1


def test_public_names_and_description():
    opt = torch.optim.SGD(Net().parameters(), lr=0.5, momentum=0.5)
    sched = af.schedule(opt, momentum=lambda t: 0.9)
    assert isinstance(sched, af.Schedule) and af.Schedule is Schedule
    assert repr(sched) == "Schedule(SGD, keys=['momentum'], last_epoch=0)"
    assert sched.get_last_lr() == [0.5]
