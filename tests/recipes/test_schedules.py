"""Schedules: the learning rate of every update against closed forms and torch's own
schedulers, stepped once per optimizer update (accumulation, skipped updates, 2 processes),
with tensor learning rates as ``compiled(optimizer=True)`` holds them.

Run as a script under torchrun, this file is the 2-process worker of
``test_scheduler_steps_once_per_update_on_two_processes``.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers import (
    Net,
    as_dict,
    assert_params_equal,
    classify,
    clone_setup,
    make_batch,
    poisonable,
    roundtrip,
)
from reference import reference_update
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LinearLR,
    OneCycleLR,
    ReduceLROnPlateau,
    SequentialLR,
)

import accelfn as af
from accelfn.recipes.schedules import (
    WarmupPlateau,
    one_cycle,
    warmup_cosine,
    warmup_linear,
    warmup_plateau,
    warmup_stable_decay,
)


def cosine_at(t, base, warmup, total, min_lr, start):
    """The seeds' warmup + cosine, written out: the lr used by update ``t``."""
    if t < warmup:
        return base * (start + (1 - start) * t / warmup)
    progress = (t - warmup) / (total - warmup)
    return min_lr + (base - min_lr) * (1 + math.cos(math.pi * progress)) / 2


def linear_at(t, base, warmup, total, end, start):
    if t < warmup:
        return base * (start + (1 - start) * t / warmup)
    return base * (1 + (end - 1) * (t - warmup) / (total - warmup))


def two_groups(lr_a=0.1, lr_b=0.02, **kwargs):
    net = Net()
    return torch.optim.SGD([{"params": net.inp.parameters(), "lr": lr_a},
                            {"params": net.head.parameters(), "lr": lr_b}], lr=lr_a, **kwargs)


def lrs_over(optimizer, scheduler, updates):
    """[per-group lrs used by update t] for t in range(updates), stepping once per update."""
    out = []
    for _ in range(updates):
        out.append([float(g["lr"]) for g in optimizer.param_groups])
        optimizer.step()  # no gradients: changes nothing, keeps torch's order check quiet
        scheduler.step()
    return out


# ----------------------------------------------------------------- closed forms
@pytest.mark.parametrize("warmup,start", [(3, None), (3, 0.25), (0, None)])
def test_warmup_cosine_follows_the_closed_form_per_group(warmup, start):
    opt = two_groups()
    sched = warmup_cosine(opt, warmup_steps=warmup, total_steps=10, min_lr=1e-3,
                          start_factor=start)
    s = 1 / (warmup + 1) if start is None else start
    got = lrs_over(opt, sched, 11)
    for t, lrs in enumerate(got):
        for lr, base in zip(lrs, (0.1, 0.02)):
            assert lr == pytest.approx(cosine_at(t, base, warmup, 10, 1e-3, s), rel=1e-9,
                                       abs=1e-12), t
    assert got[10] == pytest.approx([1e-3, 1e-3], rel=1e-9)  # min_lr after total_steps


def test_warmup_cosine_default_warmup_climbs_t_plus_one_over_warmup_plus_one():
    opt = two_groups()
    sched = warmup_cosine(opt, warmup_steps=4, total_steps=20)
    got = [lrs[0] for lrs in lrs_over(opt, sched, 5)]
    assert got == pytest.approx([0.1 * (t + 1) / 5 for t in range(5)], rel=1e-12)
    assert got[0] > 0  # the first update is never wasted on lr 0


def test_warmup_cosine_equals_the_hand_built_torch_schedule():
    opt_a, opt_b = two_groups(), two_groups()
    mine = warmup_cosine(opt_a, warmup_steps=5, total_steps=30, min_lr=1e-4, start_factor=0.1)
    ref = SequentialLR(opt_b, [LinearLR(opt_b, start_factor=0.1, total_iters=5),
                               CosineAnnealingLR(opt_b, T_max=25, eta_min=1e-4)],
                       milestones=[5])
    assert lrs_over(opt_a, mine, 30) == lrs_over(opt_b, ref, 30)


@pytest.mark.parametrize("warmup,end", [(2, 0.0), (2, 0.1), (0, 0.5)])
def test_warmup_linear_follows_the_closed_form(warmup, end):
    opt = two_groups()
    sched = warmup_linear(opt, warmup_steps=warmup, total_steps=8, end_factor=end)
    s = 1 / (warmup + 1)
    for t, lrs in enumerate(lrs_over(opt, sched, 9)):
        for lr, base in zip(lrs, (0.1, 0.02)):
            assert lr == pytest.approx(linear_at(t, base, warmup, 8, end, s), rel=1e-9,
                                       abs=1e-12), t


def test_one_cycle_equals_the_seeds_onecyclelr():
    net = Net()
    opt_a = torch.optim.AdamW(net.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(Net().parameters(), lr=1e-3)
    opt_c = torch.optim.AdamW(Net().parameters(), lr=1e-3)
    ref = OneCycleLR(opt_b, max_lr=1e-3, epochs=10, steps_per_epoch=20, pct_start=0.3,
                     div_factor=25, final_div_factor=1e4)
    mine = one_cycle(opt_a, total_steps=200)  # max_lr: the optimizer's lr
    by_warmup = one_cycle(opt_c, max_lr=1e-3, total_steps=200, warmup_steps=60)
    used = []
    for _ in range(200):
        for opt in (opt_a, opt_c):
            assert opt.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
            assert opt.param_groups[0]["betas"] == opt_b.param_groups[0]["betas"]
        used.append(opt_a.param_groups[0]["lr"])
        for opt, s in ((opt_b, ref), (opt_a, mine), (opt_c, by_warmup)):
            opt.step()
            s.step()
    assert max(used) == pytest.approx(1e-3) and used.index(max(used)) == 59
    assert used[0] == pytest.approx(1e-3 / 25) and used[-1] == pytest.approx(1e-3 / 25 / 1e4)


def test_one_cycle_leaves_sgd_without_momentum_alone():
    opt = torch.optim.SGD(Net().parameters(), lr=0.1)
    sched = one_cycle(opt, total_steps=10)
    lrs = [lr for lr, in lrs_over(opt, sched, 10)]
    assert opt.param_groups[0]["momentum"] == 0  # torch's default would set 0.85..0.95
    assert max(lrs) == pytest.approx(0.1, rel=1e-6) and lrs[0] == pytest.approx(0.1 / 25)
    with pytest.raises(ValueError, match="momentum"):
        one_cycle(opt, total_steps=10, cycle_momentum=True)


def test_warmup_plateau_warms_up_then_follows_reduce_on_plateau():
    opt = two_groups()
    sched = warmup_plateau(opt, warmup_steps=4, factor=0.5, patience=1)
    assert isinstance(sched, WarmupPlateau) and sched.optimizer is opt
    ref_opt = two_groups()
    ref = ReduceLROnPlateau(ref_opt, factor=0.5, patience=1)
    for t in range(4):
        assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.1 * (t + 1) / 5)
        assert sched.observe(0.0) is False  # ignored during warmup
        opt.step()
        sched.step()
    assert sched.get_last_lr() == [0.1, 0.02]  # exactly the base rates
    metrics = [1.0, 0.9, 0.95, 0.93, 0.92, torch.tensor(0.5), 0.6, 0.7, 0.8]
    for i, m in enumerate(metrics):
        for _ in range(3):  # per-update steps after warmup change nothing
            sched.step()
        assert sched.observe(m) is True
        ref.step(float(m))
        assert sched.get_last_lr() == [g["lr"] for g in ref_opt.param_groups], i
    assert sched.get_last_lr()[0] < 0.1 / 2  # it did reduce, more than once
    with pytest.raises(ValueError, match="NaN"):
        sched.observe(float("nan"))


def test_warmup_plateau_checkpoint_round_trip_through_train_state(net):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = af.TrainState(net, opt, scheduler=warmup_plateau(opt, warmup_steps=2, patience=0))
    step = af.lift(classify)
    for i in range(3):
        step(state, make_batch(seed=i))
    state.scheduler.observe(1.0)
    state.scheduler.observe(2.0)  # patience 0: reduced once
    saved = state.state_dict()
    net2 = Net()
    opt2 = torch.optim.SGD(net2.parameters(), lr=0.1)
    state2 = af.TrainState(net2, opt2, scheduler=warmup_plateau(opt2, warmup_steps=2,
                                                                patience=0))
    state2.load_state_dict(saved)
    assert state2.scheduler.updates == 3 and not state2.scheduler.warming_up
    assert state2.scheduler.get_last_lr() == pytest.approx([0.01])
    for s in (state.scheduler, state2.scheduler):
        s.observe(3.0)
    assert state2.scheduler.get_last_lr() == state.scheduler.get_last_lr() == pytest.approx(
        [0.001])


# ----------------------------------------------------------------- past the end
def nanogpt_get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's train.py get_lr, verbatim but for the arguments."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


@pytest.mark.parametrize("warmup,min_lr", [(4, 6e-5), (4, 0.0), (0, 6e-5)])
def test_warmup_cosine_holds_min_lr_past_total_steps(warmup, min_lr):
    opt = two_groups(lr_a=6e-4, lr_b=6e-4)
    sched = warmup_cosine(opt, warmup_steps=warmup, total_steps=20, min_lr=min_lr)
    got = [lrs[0] for lrs in lrs_over(opt, sched, 80)]
    assert got[20:] == [min_lr] * 60  # the reported climb: 4.1e-4 at update 40
    assert all(a >= b for a, b in zip(got[warmup:], got[warmup + 1:]))  # never climbs back
    expected = [nanogpt_get_lr(t, 6e-4, warmup, 20, min_lr) for t in range(80)]
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_warmup_cosine_past_its_end_survives_a_checkpoint():
    opt = two_groups()
    sched = warmup_cosine(opt, warmup_steps=2, total_steps=6, min_lr=1e-3)
    lrs_over(opt, sched, 9)
    opt2 = two_groups()
    sched2 = warmup_cosine(opt2, warmup_steps=2, total_steps=6, min_lr=1e-3)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert lrs_over(opt2, sched2, 5) == lrs_over(opt, sched, 5) == [[1e-3, 1e-3]] * 5


@pytest.mark.parametrize("warmup", [2, 0])
def test_warmup_linear_holds_its_end_factor_past_total_steps(warmup):
    opt = two_groups()
    sched = warmup_linear(opt, warmup_steps=warmup, total_steps=8, end_factor=0.1)
    got = lrs_over(opt, sched, 40)
    assert got[8] == pytest.approx([0.01, 0.002], rel=1e-9)
    assert all(lrs == got[8] for lrs in got[8:])


def test_one_cycle_holds_its_final_rate_and_momentum_past_total_steps():
    opt = torch.optim.AdamW(Net().parameters(), lr=1e-3)
    sched = one_cycle(opt, total_steps=20)
    ref_opt = torch.optim.AdamW(Net().parameters(), lr=1e-3)
    ref = OneCycleLR(ref_opt, max_lr=1e-3, total_steps=20)
    got, betas = [], []
    for t in range(60):  # torch's OneCycleLR raises at its 21st step
        got.append(float(opt.param_groups[0]["lr"]))
        betas.append(opt.param_groups[0]["betas"])
        if t < 20:
            assert got[-1] == ref_opt.param_groups[0]["lr"], t
            assert betas[-1] == ref_opt.param_groups[0]["betas"], t
            ref_opt.step()
            ref.step()
        opt.step()
        sched.step()
    final = 1e-3 / 25 / 1e4
    assert got[19] == pytest.approx(final)
    assert got[19:] == [got[19]] * 41 and betas[19:] == [betas[19]] * 41
    with pytest.raises(ValueError, match="Tried to step"):
        ref.step()  # what torch does at this point (we held instead)


def test_one_cycle_holds_a_tensor_learning_rate_in_place():
    opt = two_groups()
    for g in opt.param_groups:
        g["lr"] = torch.tensor(float(g["lr"]))
    sched = one_cycle(opt, total_steps=5)
    tensors = [g["lr"] for g in opt.param_groups]
    got = lrs_over(opt, sched, 12)
    assert got[4:] == [got[4]] * 8
    assert [g["lr"] for g in opt.param_groups] == tensors  # the same tensors


def test_warmup_plateau_has_no_end_updates_never_change_the_rate_after_warmup():
    opt = two_groups()
    sched = warmup_plateau(opt, warmup_steps=3, factor=0.5, patience=0, min_lr=0.03)
    got = lrs_over(opt, sched, 500)
    assert got[3:] == [[0.1, 0.02]] * 497  # no total_steps: the base rates, held
    for metric in (1.0, 2.0, 3.0, 4.0):
        sched.observe(metric)  # patience 0: each worse metric halves, down to min_lr
    assert sched.get_last_lr() == pytest.approx([0.03, 0.02])
    assert lrs_over(opt, sched, 100)[-1] == pytest.approx([0.03, 0.02])


# ----------------------------------------------------------------- inside the step
def test_scheduler_steps_once_per_update_under_accumulation(net):
    (m1, o1), (m2, o2) = clone_setup(net, momentum=0.9)
    s1 = warmup_cosine(o1, warmup_steps=2, total_steps=6, min_lr=0.01)
    s2 = SequentialLR(o2, [LinearLR(o2, start_factor=1 / 3, total_iters=2),
                           CosineAnnealingLR(o2, T_max=4, eta_min=0.01)], milestones=[2])
    state = af.TrainState(m1, o1, scheduler=s1)
    step = af.with_accumulation(4)(classify)
    for i in range(6):
        batch = make_batch(n=10, seed=i)
        metrics = step(state, batch)
        assert metrics["lr"].item() == pytest.approx(cosine_at(i, 0.1, 2, 6, 0.01, 1 / 3))
        reference_update(m2, o2, as_dict(batch), classify, micro=4, scheduler=s2)
        assert s1.last_epoch == i + 1  # once per update, not per micro-batch
    assert_params_equal(m1, m2)
    assert s1.get_last_lr() == s2.get_last_lr()


def test_skipped_update_does_not_advance_the_schedule(net):
    fn, poison = poisonable()

    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = af.TrainState(net, opt, scheduler=warmup_cosine(opt, warmup_steps=3,
                                                            total_steps=10))
    step = af.lift(fn)
    step(state, make_batch(seed=0))
    poison["on"] = True
    metrics = step(state, make_batch(seed=1))
    assert metrics["skipped"].item() == 1
    assert state.scheduler.last_epoch == 1
    poison["on"] = False
    metrics = step(state, make_batch(seed=2))
    assert metrics["lr"].item() == pytest.approx(0.1 * 2 / 4)  # update 1's rate, not 2's


def _tensor_lr(prepared, state):
    for group in state.optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]))
    return prepared


@pytest.mark.parametrize("make", [
    lambda o: warmup_cosine(o, warmup_steps=2, total_steps=6),
    lambda o: warmup_linear(o, warmup_steps=2, total_steps=6),
    lambda o: one_cycle(o, total_steps=6),
    lambda o: warmup_plateau(o, warmup_steps=2),
    lambda o: warmup_stable_decay(o, warmup_steps=2, decay_steps=2, total_steps=6),
])
def test_tensor_learning_rates_are_updated_in_place(net, make):
    opt_f = torch.optim.SGD(Net().parameters(), lr=0.1)
    ref = make(opt_f)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = af.TrainState(net, opt, scheduler=make(opt))  # built before the lr is a tensor
    _tensor_lr(None, state)  # what compiled(optimizer=True) does when preparing
    step = af.lift(classify)
    step(state, make_batch(seed=0))
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor)
    opt_f.step()
    ref.step()
    for i in range(1, 5):
        metrics = step(state, make_batch(seed=i))
        assert opt.param_groups[0]["lr"] is lr  # same tensor: a compiled step never recompiles
        assert metrics["lr"].item() == pytest.approx(float(opt_f.param_groups[0]["lr"]))
        opt_f.step()
        ref.step()
        assert lr.item() == pytest.approx(float(opt_f.param_groups[0]["lr"]))


def test_schedules_built_on_tensor_learning_rates():
    opt = two_groups()
    for g in opt.param_groups:
        g["lr"] = torch.tensor(float(g["lr"]))
    sched = warmup_cosine(opt, warmup_steps=2, total_steps=5)
    got = lrs_over(opt, sched, 6)
    assert [row[1] for row in got] == pytest.approx(
        [cosine_at(t, 0.02, 2, 5, 0.0, 1 / 3) for t in range(6)], abs=1e-8)
    assert all(isinstance(g["lr"], torch.Tensor) for g in opt.param_groups)


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize("call,match", [
    (lambda o: warmup_cosine(o, warmup_steps=10, total_steps=10), "smaller than"),
    (lambda o: warmup_cosine(o, warmup_steps=-1, total_steps=10), "int >= 0"),
    (lambda o: warmup_cosine(o, warmup_steps=1, total_steps=2.5), "epochs"),
    (lambda o: warmup_cosine(o, warmup_steps=1, total_steps=5, start_factor=0), r"\(0, 1\]"),
    (lambda o: warmup_cosine(o, warmup_steps=1, total_steps=5, min_lr=-1), ">= 0"),
    (lambda o: warmup_linear(o, warmup_steps=1, total_steps=5, end_factor=2), r"\[0, 1\]"),
    (lambda o: one_cycle(o, total_steps=5, warmup_steps=0), "rising phase"),
    (lambda o: one_cycle(o, total_steps=5, pct_start=1.0), r"\(0, 1\)"),
    (lambda o: warmup_plateau(o, warmup_steps=1, factor=1.0), "lr \\* factor"),
    (lambda o: warmup_plateau(o, warmup_steps=1, mode="lowest"), "'min' or 'max'"),
    (lambda o: warmup_cosine(o.param_groups, warmup_steps=1, total_steps=5), "Optimizer"),
    (lambda o: warmup_stable_decay(o, warmup_steps=3, decay_steps=3, total_steps=5),
     "warmup_steps \\+ decay_steps <= total_steps"),
    (lambda o: warmup_stable_decay(o, warmup_steps=1, decay_steps=0, total_steps=5), ">= 1"),
    (lambda o: warmup_stable_decay(o, warmup_steps=-1, decay_steps=1, total_steps=5), ">= 0"),
    (lambda o: warmup_stable_decay(o, warmup_steps=1, decay_steps=2, total_steps=5,
                                   end_factor=1.5), r"\[0, 1\]"),
    (lambda o: warmup_stable_decay(o, warmup_steps=1, decay_steps=2, total_steps=5,
                                   end_factor=-0.1), r"\[0, 1\]"),
    (lambda o: warmup_stable_decay(o, warmup_steps=1, decay_steps=2, total_steps=5,
                                   anneal_strategy="cosine"), "'linear' or 'cos'"),
])
def test_bad_arguments_say_how_to_fix_them(call, match):
    opt = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises((ValueError, TypeError), match=match):
        call(opt)


# ----------------------------------------------------------------- two processes
STEPS, WARMUP, TOTAL = 5, 2, 6
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # conftest, reference


def _worker(out: str) -> None:
    import torch.distributed as dist

    af.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = af.TrainState(model, opt, scheduler=warmup_cosine(opt, warmup_steps=WARMUP,
                                                              total_steps=TOTAL))
    step = af.distributed(af.with_accumulation(2)(classify))
    lrs = [float(step(state, make_batch(n=6, seed=10 * i + rank))["lr"]) for i in range(STEPS)]
    torch.save({"last_epoch": state.scheduler.last_epoch, "lrs": lrs,
                "final": float(opt.param_groups[0]["lr"])},
               os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_scheduler_steps_once_per_update_on_two_processes(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # torchrun's environment, set by hand: two workers without a launcher process
    procs = [subprocess.Popen(
        [sys.executable, __file__, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
                 [TESTS, *filter(None, [os.environ.get("PYTHONPATH")])]),
             "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
             "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    expected = [cosine_at(t, 0.1, WARMUP, TOTAL, 0.0, 1 / (WARMUP + 1)) for t in range(STEPS)]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["last_epoch"] == STEPS  # not STEPS * processes, not per micro-batch
        assert got["lrs"] == pytest.approx(expected, rel=1e-6)  # float32 metric
        assert got["final"] == pytest.approx(cosine_at(STEPS, 0.1, WARMUP, TOTAL, 0.0, 1 / 3))


if __name__ == "__main__":
    _worker(sys.argv[1])


@pytest.mark.parametrize("kwargs", [{"pct_start": 0.6}, {"pct_start": 0.55},
                                    {"warmup_steps": 6}])
def test_one_cycle_three_phases_refuses_a_rise_leaving_no_annealing(kwargs):
    # the second phase would end at or after the last update: the final rate never comes
    opt = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="three_phase"):
        one_cycle(opt, total_steps=10, three_phase=True, **kwargs)


def test_one_cycle_three_phases_at_half_reaches_its_final_rate():
    opt = torch.optim.SGD(Net().parameters(), lr=1.0)
    sched = one_cycle(opt, total_steps=10, three_phase=True, pct_start=0.5)
    assert lrs_over(opt, sched, 10)[-1][0] == pytest.approx(1.0 / 25 / 1e4)


def test_warmup_plateau_refuses_a_checkpoint_of_another_warmup_length():
    # loaded as is, the 100-update warmup stopped at update 10: the rate stayed at half
    # the base one for good
    opt = torch.optim.SGD(Net().parameters(), lr=1.0)
    sched = warmup_plateau(opt, warmup_steps=100)
    for _ in range(50):
        opt.step()
        sched.step()
    saved = sched.state_dict()
    other = warmup_plateau(torch.optim.SGD(Net().parameters(), lr=1.0), warmup_steps=10)
    with pytest.raises(ValueError, match="warmup_steps=100"):
        other.load_state_dict(saved)
    assert other.updates == 0
    same = warmup_plateau(torch.optim.SGD(Net().parameters(), lr=1.0), warmup_steps=100)
    same.load_state_dict(saved)
    assert same.updates == 50


@pytest.mark.parametrize("kwargs", [{"warmup_steps": 1}, {"pct_start": 0.1},
                                    {"pct_start": 0.05}, {"pct_start": 0.1, "three_phase": True}])
def test_one_cycle_refuses_a_rise_shorter_than_two_updates(kwargs):
    # one update of rise divided by zero in OneCycleLR; less skipped the rise altogether
    # (update 0 at 0.99 * max_lr instead of max_lr / div_factor)
    opt = torch.optim.SGD(Net().parameters(), lr=1.0)
    with pytest.raises(ValueError, match="rising phase"):
        one_cycle(opt, total_steps=10, **kwargs)


def test_one_cycle_with_a_two_update_rise_starts_low_and_peaks():
    opt = torch.optim.SGD(Net().parameters(), lr=1.0)
    got = [row[0] for row in lrs_over(opt, one_cycle(opt, total_steps=10, warmup_steps=2), 3)]
    assert got[:2] == pytest.approx([1.0 / 25, 1.0])


# ----------------------------------------------------------------- warmup-stable-decay
def nanochat_get_lr_multiplier(it, num_iterations, warmup_iters, warmdown_iters,
                               final_lr_frac):
    """nanochat's scripts/base_train.py, as written there."""
    if it < warmup_iters:
        return (it + 1) / warmup_iters
    elif it <= num_iterations - warmdown_iters:
        return 1.0
    else:
        progress = (num_iterations - it) / warmdown_iters
        return progress * 1.0 + (1 - progress) * final_lr_frac


@pytest.mark.parametrize("warmup,decay,total,final", [
    (5, 8, 40, 0.0), (0, 10, 30, 0.05), (4, 6, 10, 0.1), (1, 1, 2, 1.0), (3, 20, 37, 0.3),
])
def test_warmup_stable_decay_is_nanochats_multiplier_bitwise(warmup, decay, total, final):
    opt = two_groups()  # two base rates: the multiplier applies to each
    sched = warmup_stable_decay(opt, warmup_steps=warmup, decay_steps=decay, total_steps=total,
                                end_factor=final)
    got = lrs_over(opt, sched, total + 10)
    for t, lrs in enumerate(got):  # nanochat: group["lr"] = group["initial_lr"] * lrm
        m = nanochat_get_lr_multiplier(min(t, total), total, warmup, decay, final)
        assert lrs == [0.1 * m, 0.02 * m], t  # exactly, held after total_steps
    assert got[-1] == [0.1 * final, 0.02 * final]


def test_warmup_stable_decay_cosine_warmdown():
    opt = two_groups()
    sched = warmup_stable_decay(opt, warmup_steps=2, decay_steps=8, total_steps=20,
                                end_factor=0.1, anneal_strategy="cos")
    got = [row[0] for row in lrs_over(opt, sched, 25)]
    assert got[:13] == [0.05] + [0.1] * 12  # warmup (t + 1) / 2, then the plateau to t = 12
    for t in range(12, 21):
        q = (t - 12) / 8
        assert got[t] == 0.1 * (0.1 + 0.9 * (1 + math.cos(math.pi * q)) / 2), t
    assert all(a > b for a, b in itertools.pairwise(got[12:21]))
    assert got[20:] == [0.1 * 0.1] * 5


def nanochat_loop(model, optimizer, batches, lrm):
    """nanochat's update: the rate of update ``step`` set from initial_lr, then the step."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    for step, batch in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm(step)
        reference_update(model, optimizer, batch, classify)


def test_warmup_stable_decay_trains_as_nanochat_through_a_checkpoint():
    total, warmup, decay, final, resume_at = 30, 4, 9, 0.05, 17
    torch.manual_seed(0)
    net = Net()
    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.AdamW, lr=3e-3)

    def build(model, optimizer):
        return af.TrainState(model, optimizer, scheduler=warmup_stable_decay(
            optimizer, warmup_steps=warmup, decay_steps=decay, total_steps=total,
            end_factor=final))

    state, step = build(m1, o1), af.lift(classify)
    batches = [make_batch(seed=i) for i in range(total)]
    for i, batch in enumerate(batches):
        if i == resume_at:  # a new process: model, optimizer and schedule rebuilt, then loaded
            saved = roundtrip(state.state_dict())
            model = Net()
            state = build(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
            state.load_state_dict(saved)
        step(state, batch)
    nanochat_loop(m2, o2, [as_dict(b) for b in batches],
                  lambda t: nanochat_get_lr_multiplier(t, total, warmup, decay, final))
    assert_params_equal(state.model, m2)  # bitwise
    # the rate set for the next update, as nanochat would set it
    assert state.optimizer.param_groups[0]["lr"] == 3e-3 * nanochat_get_lr_multiplier(
        total, total, warmup, decay, final)


def test_warmup_stable_decay_refuses_before_changing_the_optimizer():
    opt = two_groups()
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError):
        warmup_stable_decay(opt, warmup_steps=6, decay_steps=5, total_steps=10)
    assert [dict(g) for g in opt.param_groups] == before  # no initial_lr, no rate changed


def _wsd_rates(total: int, decay: int, *, resume_at: int | None = None,
               planned: int | None = None, updates: int | None = None) -> list[float]:
    """The rate of each update of a warmup-stable-decay run over ``total`` updates (with
    ``decay`` of warmdown); with ``resume_at``, the run until then was planned for
    ``planned`` updates and is resumed (a new scheduler, the checkpoint loaded) with
    ``total``."""
    model = torch.nn.Linear(2, 1)

    def build(span: int, warmdown: int):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return optimizer, warmup_stable_decay(optimizer, warmup_steps=3, decay_steps=warmdown,
                                              total_steps=span, end_factor=0.1)

    optimizer, scheduler = build(planned or total, decay if planned is None else 2)
    rates = []
    for t in range(updates or total + 2):
        if t == resume_at:
            saved = roundtrip({"o": optimizer.state_dict(), "s": scheduler.state_dict()})
            optimizer, scheduler = build(total, decay)
            optimizer.load_state_dict(saved["o"])
            scheduler.load_state_dict(saved["s"])
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_warmup_stable_decay_is_extended_from_its_stable_phase_exactly():
    # planned for 10 updates (warmdown 2: stable through update 8), resumed at update 6 with
    # 20 (warmdown 5): every rate is that of a run planned for 20 from the start
    assert _wsd_rates(20, 5, resume_at=6, planned=10) == _wsd_rates(20, 5)
    # shortened the same way, while both are stable
    assert _wsd_rates(8, 2, resume_at=5, planned=10) == _wsd_rates(8, 2)


def test_warmup_stable_decay_past_its_stable_phase_refuses_another_plan():
    # at update 9 the 10-update plan was decaying (from update 9 on): its rates differ from
    # any longer plan's, so loading it into one is refused, naming the way that works
    with pytest.raises(ValueError, match=r"total_steps=10.*total_steps=20.*update 9.*stable"):
        _wsd_rates(20, 5, resume_at=9, planned=10)
