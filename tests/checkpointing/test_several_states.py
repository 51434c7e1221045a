"""A checkpoint of several states (a GAN's generator and discriminator): ``save(directory,
{name: state})`` writes and commits one atomic checkpoint (one RNG state, one loader
position, each state under its name) and ``load(directory, {name: state})`` restores all of
them exactly, whole or not at all; a checkpoint of one state loaded into a mapping, the
reverse, or other names, is refused before anything changes.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import (
    assert_unchanged,
    dataset,
    forge,
    scramble_rngs,
    setup,
    snapshot,
)
from torch import nn

import accelfn as af
from accelfn import checkpointing as ckpt
from accelfn import data

NAMES = ("discriminator", "generator")


def gan(seed: int = 0):
    """Two states, two steps: the discriminator's loss draws noise for the generator (no
    gradients to it), the generator's runs through the discriminator; dropout in both."""
    torch.manual_seed(seed)
    netG = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 6))
    netD = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Dropout(0.2),
                         nn.Linear(16, 1))
    opt_g = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.AdamW(netD.parameters(), lr=1e-3, betas=(0.5, 0.999))
    states = {"generator": af.TrainState(netG, opt_g),
              "discriminator": af.TrainState(
                  netD, opt_d, scheduler=torch.optim.lr_scheduler.StepLR(opt_d, 2, 0.7))}

    def d_loss(model, batch):
        with torch.no_grad():
            fake = netG(torch.randn(batch["x"].shape[0], 4))
        real, made = model(batch["x"]), model(fake)
        return F.binary_cross_entropy_with_logits(real, torch.ones_like(real)) + \
            F.binary_cross_entropy_with_logits(made, torch.zeros_like(made))

    def g_loss(model, batch):
        out = netD(model(torch.randn(batch["x"].shape[0], 4)))
        return F.binary_cross_entropy_with_logits(out, torch.ones_like(out))

    steps = {"discriminator": af.with_clipping(max_norm=1.0)(d_loss), "generator": af.lift(g_loss)}
    for name, step in steps.items():
        step.prepare(states[name])
    loader = data.loader(dataset(), batch_size=4, seed=1)
    return states, steps, loader


def train(states, steps, it, n):
    losses = []
    for _ in range(n):
        batch = next(it)
        losses.append(steps["discriminator"](states["discriminator"], batch)["loss"].clone())
        losses.append(steps["generator"](states["generator"], batch)["loss"].clone())
    return losses


def snapshots(states):
    return {name: snapshot(state) for name, state in states.items()}


def unchanged(before, states):
    for name, state in states.items():
        assert_unchanged(before[name], state)


@pytest.mark.parametrize("how", ["plain", "dcp", "asynchronous", "asynchronous_dcp"])
def test_a_gans_two_states_resume_exactly_from_one_checkpoint(tmp_path, how):
    states, steps, loader = gan()
    it = iter(loader)
    train(states, steps, it, 3)
    saved = ckpt.save(tmp_path, states, loader=loader, step=steps, sharded="dcp" in how,
                      asynchronous="asynchronous" in how, extra={"epoch": 0})
    path = saved.wait() if isinstance(saved, ckpt.AsyncSave) else saved
    expected = train(states, steps, it, 4)

    fresh, fresh_steps, fresh_loader = gan(seed=1)
    scramble_rngs()
    info = ckpt.load(tmp_path, fresh, loader=fresh_loader, step=fresh_steps)
    assert info.path == path and info.step == 3 and info.extra == {"epoch": 0}
    assert info.states == NAMES and info.sharded == ("dcp" in how)
    assert info.stack == "; ".join(f"{n}: {af.describe(fresh_steps[n])}" for n in NAMES)
    assert {"discriminator/model", "discriminator/optimizer", "discriminator/scheduler",
            "generator/model", "generator/optimizer", "rng.torch", "data"} <= set(info.restored)
    got = train(fresh, fresh_steps, iter(fresh_loader), 4)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))  # bitwise
    for name in NAMES:
        for a, b in zip(states[name].model.parameters(), fresh[name].model.parameters()):
            assert torch.equal(a, b)
        assert repr(states[name].optimizer.state_dict()) == \
            repr(fresh[name].optimizer.state_dict())
        assert fresh[name].step == 7
    assert fresh["discriminator"].scheduler.last_epoch == 7


def test_several_states_are_one_commit_with_one_rng_state_and_loader_position(tmp_path):
    states, steps, loader = gan()
    train(states, steps, iter(loader), 2)
    path = ckpt.save(tmp_path, states, loader=loader, step=steps)
    assert ckpt.checkpoints(tmp_path) == [path] and ckpt.latest(tmp_path) == path
    assert sorted(p.name for p in path.iterdir()) == ["COMMITTED", "meta.json",
                                                      "rank-00000.pt", "state.pt"]
    meta = json.loads((path / "meta.json").read_text())
    assert sorted(meta["states"]) == list(NAMES) and meta["step"] == 2
    assert meta["states"]["discriminator"]["scheduler"] == "StepLR"
    assert meta["states"]["generator"]["optimizer"]["class"] == "Adam"
    assert meta["states"]["discriminator"]["stack"]["describe"] == \
        af.describe(steps["discriminator"])
    payload = torch.load(path / "state.pt", weights_only=True)
    assert sorted(payload["states"]) == list(NAMES) and "state" not in payload
    # a later checkpoint of the mapping rotates like any other
    train(states, steps, iter(loader), 1)
    newer = ckpt.save(tmp_path, states, loader=loader, step=steps, keep=1)
    assert ckpt.checkpoints(tmp_path) == [newer]


def _one_state(seed: int = 0):
    state, loader, step = setup(seed)
    return state, loader, step


@pytest.mark.parametrize("case", ["one_into_mapping", "mapping_into_one", "other_names",
                                  "fewer_names"])
def test_a_checkpoint_of_other_states_is_refused_before_anything_changes(tmp_path, case):
    if case == "one_into_mapping":
        state, loader, step = _one_state()
        train_one = iter(loader)
        step(state, next(train_one))
        path = ckpt.save(tmp_path, state, loader=loader, step=step)
    else:
        states, steps, loader = gan()
        train(states, steps, iter(loader), 1)
        path = ckpt.save(tmp_path, states, loader=loader, step=steps)
    if case == "mapping_into_one":
        fresh, fresh_loader, _ = _one_state(seed=1)
        before = snapshot(fresh)
        with pytest.raises(ckpt.CheckpointError,
                           match=r"holds several states \(discriminator, generator\).* one "
                                 r"TrainState.*pass a mapping \{'discriminator': \.\.\., "
                                 r"'generator': \.\.\.\}"):
            ckpt.load(path, fresh, loader=fresh_loader)
        assert_unchanged(before, fresh)
        return
    fresh_states, _, fresh_loader = gan(seed=1)
    if case == "other_names":
        fresh_states = {"G": fresh_states["generator"], "D": fresh_states["discriminator"]}
        match = (r"holds the states discriminator, generator; this call passes D, G.*"
                 r"name the states as the checkpointed run did")
    elif case == "fewer_names":
        fresh_states = {"generator": fresh_states["generator"]}
        match = r"holds the states discriminator, generator; this call passes generator"
    else:
        match = (r"holds one TrainState, this call passes several states \(discriminator, "
                 r"generator\); pass the state itself")
    before = snapshots(fresh_states)
    rng = ckpt.rng_state()
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load(path, fresh_states, loader=fresh_loader)
    unchanged(before, fresh_states)
    assert repr(ckpt.rng_state()) == repr(rng)


def test_a_checkpoint_whose_files_disagree_on_the_states_is_refused(tmp_path):
    # forged: state.pt lacks a state meta.json names (the marker's checksums fixed)
    states, steps, loader = gan()
    train(states, steps, iter(loader), 1)
    path = ckpt.save(tmp_path, states, loader=loader, step=steps)
    payload = torch.load(path / "state.pt", weights_only=True)
    del payload["states"]["generator"]
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    forge(path, "state.pt", buffer.getvalue())
    fresh, fresh_steps, fresh_loader = gan(seed=1)
    before = snapshots(fresh)
    with pytest.raises(ckpt.CheckpointError, match=r"state\.pt does not hold the states its "
                                                   r"metadata names"):
        ckpt.load(path, fresh, loader=fresh_loader, step=fresh_steps)
    unchanged(before, fresh)


def test_a_restore_failing_in_the_second_state_rolls_back_the_first(tmp_path, monkeypatch):
    states, steps, loader = gan()
    train(states, steps, iter(loader), 2)
    path = ckpt.save(tmp_path, states, loader=loader, step=steps)
    fresh, fresh_steps, fresh_loader = gan(seed=1)
    before = snapshots(fresh)
    rng = ckpt.rng_state()
    second = fresh["generator"]
    calls = []
    original = second.load_state_dict

    def fails_once(state_dict):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("disk gone")
        original(state_dict)

    monkeypatch.setattr(second, "load_state_dict", fails_once)
    with pytest.raises(ckpt.CheckpointError, match=r"disk gone.*nothing was restored"):
        ckpt.load(path, fresh, loader=fresh_loader, step=fresh_steps)
    unchanged(before, fresh)
    assert repr(ckpt.rng_state()) == repr(rng)


def test_bad_mappings_and_steps_are_refused_with_the_fix(tmp_path):
    states, steps, _ = gan()
    with pytest.raises(ValueError, match="an empty mapping"):
        ckpt.save(tmp_path, {})
    with pytest.raises(TypeError, match=r"states\['generator'\] is a Linear"):
        ckpt.save(tmp_path, {"generator": nn.Linear(2, 2)})
    with pytest.raises(ValueError, match="the same TrainState twice"):
        ckpt.save(tmp_path, {"a": states["generator"], "b": states["generator"]})
    with pytest.raises(ValueError, match=r"name 'a\.b'.*letters, digits"):
        ckpt.save(tmp_path, {"a.b": states["generator"]})
    with pytest.raises(TypeError, match=r"step=\{name: step\}"):
        ckpt.save(tmp_path, states, step=steps["generator"])
    with pytest.raises(ValueError, match=r"step= names critic, which is not"):
        ckpt.save(tmp_path, states, step={"critic": steps["discriminator"]})
    with pytest.raises(TypeError, match=r"a mapping of steps for one state"):
        ckpt.save(tmp_path, states["generator"], step=steps)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_step_for_some_states_only_compares_those_stacks(tmp_path):
    states, steps, loader = gan()
    train(states, steps, iter(loader), 1)
    path = ckpt.save(tmp_path, states, step=steps)
    fresh, fresh_steps, _ = gan(seed=1)
    other = af.with_clipping(max_norm=2.0)(lambda model, batch: model(batch["x"]).mean())
    before = snapshots(fresh)
    with pytest.raises(ckpt.CheckpointError, match=r"state 'discriminator': the checkpoint was "
                                                   r"saved by the step"):
        ckpt.load(path, fresh, step={"discriminator": other})
    unchanged(before, fresh)
    info = ckpt.load(path, fresh, step={"generator": fresh_steps["generator"]})
    assert info.step == 1


def test_a_preemption_saves_every_state_in_one_checkpoint_and_exits_75(tmp_path, capsys):
    states, steps, loader = gan()
    train(states, steps, iter(loader), 2)
    guard = ckpt.PreemptionGuard()
    guard.request()
    assert guard.should_stop(states)
    with pytest.raises(SystemExit) as exited, \
            pytest.warns(RuntimeWarning, match="preempted at step 2"):
        guard.exit_if_requested(tmp_path, states, loader=loader, step=steps)
    assert exited.value.code == ckpt.EXIT_PREEMPTED
    fresh, fresh_steps, fresh_loader = gan(seed=1)
    info = ckpt.load(tmp_path, fresh, loader=fresh_loader, step=fresh_steps)
    assert info.step == 2 and info.states == NAMES
    for name in NAMES:
        for a, b in zip(states[name].model.parameters(), fresh[name].model.parameters()):
            assert torch.equal(a, b)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_two_states_one_with_two_optimizers_resume_exactly_under_ddp_and_fsdp(
        tmp_path):
    from test_resume import torchrun

    proc = torchrun("several", tmp_path / "run", tmp_path / "out", restarts=0)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    for rank in range(2):
        outcome = json.loads((tmp_path / "out" / f"several-rank{rank}.json").read_text())
        for strategy in ("ddp", "fsdp"):
            got = outcome[strategy]
            assert got["sharded"] == (strategy == "fsdp"), strategy
            assert got["states"] == ["aux", "main"]
            assert got["same_losses"] and got["same_params"], (rank, strategy, got)


def test_gradient_transforms_in_another_order_are_another_step(tmp_path):
    """Gradient transforms run in stacking order: a checkpoint of one order does not load
    into a step of the other (the built-ins' order still does not matter)."""
    import torch
    from helpers import Net, classify, make_batch

    import accelfn as af
    from accelfn import checkpointing

    def scale(factor):
        return af.GradientTransform(f"times_{int(factor * 10)}",
                                    lambda grads, params, state: [g.mul_(factor) for g in grads]
                                    and None)

    a, b = scale(0.5), scale(2.0)
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_clipping(max_norm=1.0)(b(a(classify)))
    step(state, make_batch())
    checkpointing.save(tmp_path, state, step=step)
    torch.manual_seed(0)
    model = Net()
    other = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(checkpointing.CheckpointError, match="another order"):
        checkpointing.load(tmp_path, other, step=a(b(af.with_clipping(max_norm=1.0)(classify))))
    torch.manual_seed(0)
    model = Net()
    same = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    checkpointing.load(tmp_path, same, step=b(a(af.with_clipping(max_norm=1.0)(classify))))
