"""load() and save() failures found by attacking them (issue 13): DCP's BaseException
translated, parameter groups checked by name, the loader position checked before anything
is restored. Each is a refusal that leaves state, RNGs and loader as they were.
"""

from __future__ import annotations

import copy
import errno
import io

import pytest
import torch
from checkpoint_helpers import assert_unchanged, dataset, forge, noisy, run, setup, snapshot
from helpers import Net

import accelfn as af
from accelfn import checkpointing as ckpt
from accelfn import data


def causes(error: BaseException) -> list[str]:
    out = []
    while error is not None:
        out.append(type(error).__name__)
        error = error.__cause__ or error.__context__
    return out


def build(groups=None, amsgrad: bool = False, lrs=(1e-2, 1e-3, 1e-4)):
    """setup()'s run, with the optimizer's parameters split into groups by name."""
    _, loader, step = setup()
    torch.manual_seed(0)
    model = Net()
    if groups is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=amsgrad)
    else:
        named = dict(model.named_parameters())
        opt = torch.optim.AdamW([{"params": [named[n] for n in names], "lr": lr,
                                  "weight_decay": 0.1 * i}
                                 for i, (names, lr) in enumerate(zip(groups, lrs))],
                                amsgrad=amsgrad)
    state = af.TrainState(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    step.prepare(state)
    return state, loader, step


# ------------------------------------------------------------------------- item 3: DCP
def test_a_full_disk_during_a_sharded_save_is_an_oserror_keeping_the_cause(tmp_path,
                                                                           monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    state, loader, step = setup()
    run(state, iter(loader), step, 2)
    first = ckpt.save(tmp_path, state, loader=loader, step=step)
    run(state, iter(loader), step, 1)

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(OSError, match="No space left on device") as raised:
        ckpt.save(tmp_path, state, loader=loader, step=step, sharded=True)
    assert raised.value.errno == errno.ENOSPC
    assert "CheckpointException" in causes(raised.value)
    monkeypatch.undo()
    assert ckpt.checkpoints(tmp_path) == [first]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]


def test_a_dcp_failure_while_loading_is_a_checkpoint_error_and_changes_nothing(tmp_path):
    state, loader, step = setup()
    run(state, iter(loader), step, 2)
    path = ckpt.save(tmp_path, state, loader=loader, step=step, sharded=True)
    fresh, fresh_loader, fresh_step = build(amsgrad=True)  # DCP misses max_exp_avg_sq
    before = snapshot(fresh)
    with pytest.raises(ckpt.CheckpointError, match="max_exp_avg_sq") as raised:
        ckpt.load(path, fresh, loader=fresh_loader, step=fresh_step)
    assert "CheckpointException" in causes(raised.value)
    assert_unchanged(before, fresh)
    assert not fresh.optimizer.state


# ------------------------------------------------------------------------- item 4: groups
NAMES = [n for n, _ in Net().named_parameters()]
B0, B1 = ([n for n in NAMES if n.startswith(f"blocks.{i}.")] for i in (0, 1))
REST = [n for n in NAMES if n not in B0 + B1]


def test_parameter_groups_of_the_same_sizes_in_another_assignment_are_refused(tmp_path):
    # two blocks of the same shapes: swapped, every size and shape still matches and the
    # learning rates, weight decays and Adam moments would land on the other block
    state, loader, step = build([B0, B1, REST])
    run(state, iter(loader), step, 2)
    path = ckpt.save(tmp_path, state, loader=loader, step=step)
    for groups, first in (([B1, B0, REST], rf"group 0 holds {B0[0]} in the checkpoint, "
                                           rf"{B1[0]} here"),
                          ([B0, B1[::-1], REST], rf"group 1 holds {B1[0]} in the checkpoint, "
                                                 rf"{B1[-1]} here")):
        fresh, fresh_loader, fresh_step = build(groups)
        before = snapshot(fresh)
        with pytest.raises(ckpt.CheckpointError, match=first):
            ckpt.load(path, fresh, loader=fresh_loader, step=fresh_step)
        assert_unchanged(before, fresh)
    fresh, fresh_loader, fresh_step = build([B0, B1, REST])  # the same assignment loads
    ckpt.load(path, fresh, loader=fresh_loader, step=fresh_step)
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [1e-2, 1e-3, 1e-4]


def test_a_sharded_checkpoint_checks_the_assignment_too(tmp_path):
    state, loader, step = build([B0, B1, REST])
    run(state, iter(loader), step, 2)
    path = ckpt.save(tmp_path, state, loader=loader, step=step, sharded=True)
    fresh, fresh_loader, fresh_step = build([B1, B0, REST])
    before = snapshot(fresh)
    with pytest.raises(ckpt.CheckpointError, match=rf"group 0 holds {B0[0]}"):
        ckpt.load(path, fresh, loader=fresh_loader, step=fresh_step)
    assert_unchanged(before, fresh)


# ------------------------------------------------------------------------- item 5: loader
def _sampler(root):
    return root["snapshot"]["it_state"]["source"]


def _set(key, value):
    def change(root):
        _sampler(root)[key] = value
    return change


def _drop(root):
    del root["snapshot"]["it_state"]


def _extra(root):
    _sampler(root)["cursor"] = 3


MALFORMED = {
    "batches_as_text": _set("batches", "2"),
    "batches_past_the_epoch": _set("batches", 10**6),
    "negative_epoch": _set("epoch", -1),
    "float_epoch": _set("epoch", 0.5),
    "missing_entry": _drop,
    "unknown_entry": _extra,
}


@pytest.mark.parametrize("taken", [0, 1], ids=["fresh_loader", "loader_mid_epoch"])
@pytest.mark.parametrize("kind", [*MALFORMED, "not_a_mapping", "config_not_a_mapping"])
def test_a_malformed_loader_position_is_refused_before_anything_is_restored(tmp_path, kind,
                                                                            taken):
    state, loader, step = setup()
    it = iter(loader)
    run(state, it, step, 3)
    path = ckpt.save(tmp_path, state, loader=loader, step=step)
    rank = torch.load(path / "rank-00000.pt", weights_only=True)
    position = copy.deepcopy(rank["loader"])
    assert _sampler(position["root"]) == {"epoch": 0, "batches": 3}
    if kind == "not_a_mapping":
        position["root"] = "epoch 0, batch 3"
    elif kind == "config_not_a_mapping":
        position["config"] = 4
    else:
        MALFORMED[kind](position["root"])
    rank["loader"] = position
    buffer = io.BytesIO()
    torch.save(rank, buffer)
    forge(path, "rank-00000.pt", buffer.getvalue())

    fresh, fresh_loader, fresh_step = setup(seed=1)
    twin = data.loader(dataset(), batch_size=4, seed=1)  # an untouched copy of fresh_loader
    for _ in range(taken):
        assert torch.equal(next(iter(fresh_loader))["x"], next(iter(twin))["x"])
    before = snapshot(fresh)
    with pytest.raises(ckpt.CheckpointError, match="loader position"):
        ckpt.load(path, fresh, loader=fresh_loader, step=fresh_step)
    assert_unchanged(before, fresh)
    # the loader is where it was: its next two epochs are the untouched copy's
    for _ in range(2):
        got, want = list(fresh_loader), list(twin)
        assert len(got) == len(want) == 12
        assert all(torch.equal(a["x"], b["x"]) for a, b in zip(got, want))


# ------------------------------------------------------------------------- refused step
def _unprepared(seed: int = 0):
    """setup()'s run in a new process: its state not yet prepared by any step."""
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = af.TrainState(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    return state, data.loader(dataset(), batch_size=4, seed=1)


def _right():
    return af.with_clipping(max_norm=0.5)(noisy)


def _wrong():
    return af.with_ema(decay=0.9)(af.with_amp(dtype=torch.bfloat16, fp32=(torch.nn.Linear,))(
        af.with_clipping(max_norm=0.5)(noisy)))


def _wrapped(model):
    """The modules whose forward a transform wrapped (with the wrappers' tags)."""
    return {name: m.__dict__.get("_accelfn_tags") for name, m in model.named_modules()
            if "_accelfn_tags" in m.__dict__}


def test_a_load_refused_for_another_step_prepares_nothing(tmp_path):
    state, loader = _unprepared()
    step = _right()
    it = iter(loader)
    run(state, it, step, 3)
    ckpt.save(tmp_path, state, loader=loader, step=step)

    def resume(mistake: bool):
        fresh, fresh_loader = _unprepared(seed=1)
        if mistake:
            before = snapshot(fresh)
            with pytest.raises(ckpt.CheckpointError, match="added: with_amp"):
                ckpt.load(tmp_path, fresh, loader=fresh_loader, step=_wrong())
            assert_unchanged(before, fresh)
            assert fresh.preparations == () and dict(fresh.slots) == {}
            assert _wrapped(fresh.model) == {}
        right = _right()
        ckpt.load(tmp_path, fresh, loader=fresh_loader, step=right)
        losses = run(fresh, iter(fresh_loader), right, 3)
        path = ckpt.save(tmp_path / "again", fresh, loader=fresh_loader, step=right)
        saved_slots = sorted(torch.load(path / "state.pt", weights_only=True)["state"]["slots"])
        return losses, fresh, saved_slots

    losses, clean, clean_slots = resume(False)
    losses_after_mistake, state_after_mistake, slots_after_mistake = resume(True)
    assert all(torch.equal(a, b) for a, b in zip(losses, losses_after_mistake))
    assert all(torch.equal(a, b) for a, b in zip(clean.model.parameters(),
                                                 state_after_mistake.model.parameters()))
    assert _wrapped(state_after_mistake.model) == _wrapped(clean.model)
    assert len(state_after_mistake.preparations) == len(clean.preparations) == 1
    assert slots_after_mistake == clean_slots
    assert sorted(state_after_mistake.slots) == sorted(clean.slots)
