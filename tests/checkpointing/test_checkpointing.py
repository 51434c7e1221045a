"""checkpointing: atomic save, whole-or-nothing load, refusals, rotation, weights-only files.

In one process and fast; kill-and-resume across processes is in test_resume.py.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_helpers import (
    assert_unchanged,
    counter,
    dataset,
    forge,
    noisy,
    refused,
    run,
    scramble_rngs,
    setup,
    snapshot,
)
from helpers import Net, classify, make_batch

import accelfn as af
from accelfn import checkpointing as ckpt
from accelfn import data
from accelfn.checkpointing import files as ckpt_files
from accelfn.checkpointing import format as ckpt_format


@pytest.fixture
def saved(tmp_path):
    """A run trained 3 steps and saved; what the next 3 steps give; and the Step."""
    state, loader, step = setup()
    it = iter(loader)
    run(state, it, step, 3)
    path = ckpt.save(tmp_path / "run", state, loader=loader, step=step, extra={"epoch": 0})
    after = run(state, it, step, 3)
    return tmp_path / "run", path, state, after


# ------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "dcp"])
def test_resume_restores_everything_and_continues_identically(tmp_path, sharded):
    state, loader, step = setup()
    it = iter(loader)
    run(state, it, step, 3)
    path = ckpt.save(tmp_path, state, loader=loader, step=step, sharded=sharded,
                     extra={"epoch": 0, "best": 0.5})
    assert path.name == "step-000000003" and (path / "COMMITTED").is_file()
    assert (path / "sharded").is_dir() == sharded
    expected = run(state, it, step, 3)

    fresh, fresh_loader, fresh_step = setup(seed=1)
    scramble_rngs()
    info = ckpt.load(tmp_path, fresh, loader=fresh_loader, step=fresh_step)
    assert info.path == path and info.step == 3 and info.world_size == 1
    assert info.sharded == sharded and info.extra == {"epoch": 0, "best": 0.5}
    assert info.stack == af.describe(step)
    assert set(info.restored) >= {"model", "optimizer", "scheduler", "step", "slot:with_amp",
                                  "slot:nonfinite", "slot:gradients.counter", "rng.python",
                                  "rng.numpy", "rng.torch", "data"}
    got = run(fresh, iter(fresh_loader), fresh_step, 3)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    for a, b in zip(state.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
    assert fresh.step == state.step == 6
    assert fresh.slots["with_amp"].get_scale() == state.slots["with_amp"].get_scale()


def test_every_file_is_weights_only_and_load_never_unpickles_freely(saved, monkeypatch):
    run_dir, path, _, _ = saved
    for file in path.glob("*.pt"):
        torch.load(file, weights_only=True)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 3 and meta["model"]["head.weight"] == [[4, 8], "float32"]
    calls = []
    real = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load while loading"))
    state, loader, step = setup()
    ckpt.load(run_dir, state, loader=loader, step=step)
    assert calls and all(flag is True for flag in calls)


class _Exploit:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_checkpoint_carrying_code_is_refused_without_running_it(tmp_path):
    state, loader, step = setup()
    run(state, iter(loader), step, 2)
    ok = ckpt.save(tmp_path / "a", state, step=step)
    dcp = ckpt.save(tmp_path / "b", state, step=step, sharded=True)
    pwned = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"format": ckpt_format.FORMAT, "state": _Exploit(str(pwned))}, buffer)
    forge(ok, "state.pt", buffer.getvalue())
    forge(dcp, "sharded/.metadata", pickle.dumps(_Exploit(str(pwned)), protocol=2))
    for path in (ok, dcp):
        fresh, _, fresh_step = setup(seed=1)
        before = snapshot(fresh)
        with pytest.raises(ckpt.CheckpointError, match=r"cannot be read safely|not plain data"):
            ckpt.load(path, fresh, step=fresh_step)
        assert not pwned.exists()
        assert_unchanged(before, fresh)


# ------------------------------------------------------------------------- atomic writes
def _fail_torch_save(monkeypatch):
    real = torch.save

    def half_then_fail(obj, f, *a, **k):
        real({"half": torch.zeros(10)}, f)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_then_fail)


def _fail_fsync(monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("I/O error")))


def _fail_rename(monkeypatch):
    real = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError("rename failed")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def _fail_marker(monkeypatch):
    real = ckpt_files.write_json

    def write(path, obj):
        if path.name.startswith(ckpt_format.MARKER):
            raise OSError("no space left for the marker")
        return real(path, obj)

    monkeypatch.setattr(ckpt_files, "write_json", write)


def _fail_dcp(monkeypatch):
    from torch.distributed.checkpoint import state_dict_saver

    monkeypatch.setattr(state_dict_saver, "save", lambda *a, **k: (_ for _ in ()).throw(
        OSError("shard write failed")))


@pytest.mark.parametrize("inject", [_fail_torch_save, _fail_fsync, _fail_rename, _fail_marker,
                                    _fail_dcp], ids=lambda f: f.__name__[6:])
def test_crash_while_saving_leaves_the_previous_checkpoint(saved, monkeypatch, inject):
    run_dir, first, state, _ = saved
    with monkeypatch.context() as m:
        inject(m)
        with pytest.raises(OSError):
            ckpt.save(run_dir, state, step=None, keep=1, sharded=inject is _fail_dcp)
    assert ckpt.latest(run_dir) == first
    assert sorted(p.name for p in run_dir.iterdir()) == [first.name]  # nothing half-written
    fresh, loader, step = setup(seed=1)
    assert ckpt.load(run_dir, fresh, loader=loader, step=step).step == 3


def test_half_written_directories_are_never_picked_and_are_cleaned_up(saved):
    run_dir, first, state, _ = saved
    shutil.copytree(first, run_dir / "step-000000099")
    (run_dir / "step-000000099" / "COMMITTED").unlink()  # renamed, killed before the marker
    (run_dir / ".tmp-step-000000100-0000").mkdir()         # killed while writing files
    (run_dir / "notes.txt").write_text("not a checkpoint")
    assert ckpt.latest(run_dir) == first
    assert ckpt.checkpoints(run_dir) == [first]
    fresh, _, _ = setup(seed=1)
    with pytest.raises(ckpt.CheckpointError, match="no COMMITTED marker"):
        ckpt.load(run_dir / "step-000000099", fresh)
    ckpt.save(run_dir, state)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt", first.name,
                                                         "step-000000006"]


def test_rotation_keeps_the_newest_and_deletes_only_after_a_commit(tmp_path, monkeypatch):
    state, loader, step = setup()
    it = iter(loader)
    for _ in range(4):
        run(state, it, step, 1)
        ckpt.save(tmp_path, state, keep=2)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000000003", "step-000000004"]
    run(state, it, step, 1)
    _fail_marker(monkeypatch)
    with pytest.raises(OSError):
        ckpt.save(tmp_path, state, keep=1)
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000000003", "step-000000004"]


def test_saving_the_same_step_twice_keeps_one_checkpoint_and_evicts_nothing(tmp_path):
    # "save every N, then at the end": the end's save is at a step saved already
    state, loader, step = setup()
    it = iter(loader)
    for _ in range(2):
        run(state, it, step, 1)
        ckpt.save(tmp_path, state, keep=2)
    again = ckpt.save(tmp_path, state, keep=2, extra={"at": "end"})
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000000001",
                                                            "step-000000002.1"]
    assert ckpt.latest(tmp_path) == again
    fresh, _, _ = setup(seed=1)
    assert ckpt.load(tmp_path, fresh).extra == {"at": "end"}  # the newer save is the one kept
    ckpt.save(tmp_path, state)  # without keep= too
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000000001",
                                                            "step-000000002.2"]


def test_a_save_after_going_back_moves_the_abandoned_later_checkpoints_aside(tmp_path):
    # a run diverges, the user loads an earlier checkpoint (as the non-finite refusal says)
    # and trains on into the same folder: latest(), load(folder) and keep= must follow the
    # branch trained now, not the higher step numbers of the one given up; nothing is deleted
    state, loader, step = setup()
    it = iter(loader)
    run(state, it, step, 3)
    early = ckpt.save(tmp_path, state, step=step, keep=2)
    run(state, it, step, 3)
    ckpt.save(tmp_path, state, step=step, keep=2)  # step 6: the branch given up
    back, _, back_step = setup(seed=1)
    ckpt.load(early, back, step=back_step)
    run(back, iter(loader), back_step, 1)
    with pytest.warns(RuntimeWarning, match=r"step-000000006.*abandoned-step-000000006"):
        now = ckpt.save(tmp_path, back, step=back_step, keep=2)
    assert now.name == "step-000000004"
    assert ckpt.checkpoints(tmp_path) == [early, now]  # keep=2 evicted neither
    assert ckpt.latest(tmp_path) == now
    aside = tmp_path / "abandoned-step-000000006"
    fresh, _, fresh_step = setup(seed=2)
    assert ckpt.load(aside, fresh, step=fresh_step).step == 6  # kept whole, loadable by path
    assert ckpt.load(tmp_path, fresh, step=fresh_step).step == 4
    # a second branch given up at the same step keeps the first one aside too
    ckpt.save(tmp_path / "other", state, step=step)
    shutil.copytree(tmp_path / "other" / "step-000000006", tmp_path / "step-000000006")
    with pytest.warns(RuntimeWarning, match="abandoned-step-000000006.1"):
        ckpt.save(tmp_path, back, step=back_step, keep=2)
    assert aside.is_dir() and (tmp_path / "abandoned-step-000000006.1").is_dir()


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_damaged_files_arerefused(saved, damage):
    _, path, _, _ = saved
    target = path / "rank-00000.pt"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    else:
        target.unlink()
    fresh, loader, step = setup(seed=1)
    before = snapshot(fresh)
    with pytest.raises(ckpt.CheckpointError, match="damaged"):
        ckpt.load(path, fresh, loader=loader, step=step)
    assert_unchanged(before, fresh)


@pytest.mark.parametrize("rel", ["state.pt", "rank-00000.pt", "meta.json", "sharded/.metadata",
                                 "sharded/__0_0.distcp"])
def test_a_flipped_byte_anywhere_isrefused(tmp_path, rel):
    state, loader, step = setup()
    run(state, iter(loader), step, 2)
    path = ckpt.save(tmp_path, state, loader=loader, step=step, sharded=True)
    marker = json.loads((path / "COMMITTED").read_text())
    assert sorted(marker["files"]) == ["meta.json", "rank-00000.pt", "sharded/.metadata",
                                       "sharded/__0_0.distcp", "state.pt"]
    data = bytearray((path / rel).read_bytes())
    data[len(data) // 2] ^= 0x10  # bit rot: same size, different content
    (path / rel).write_bytes(bytes(data))
    fresh, fresh_loader, fresh_step = setup(seed=1)
    before = snapshot(fresh)
    with pytest.raises(ckpt.CheckpointError, match=f"damaged: {rel} does not match the checksum"):
        ckpt.load(path, fresh, loader=fresh_loader, step=fresh_step)
    assert_unchanged(before, fresh)


def test_save_reads_no_rng_and_writes_nothing_whenrefused(tmp_path):
    state, loader, step = setup()
    run(state, iter(loader), step, 1)
    before = repr(ckpt.rng_state())
    ckpt.save(tmp_path / "ok", state, loader=loader, step=step)
    assert repr(ckpt.rng_state()) == before
    with pytest.raises(TypeError, match=r"extra\['cfg'\] is a object"):
        ckpt.save(tmp_path / "bad", state, extra={"cfg": object()})
    with pytest.raises(TypeError, match=r"extra\['counts'\] is a defaultdict"):
        ckpt.save(tmp_path / "bad", state, extra={"counts": collections.defaultdict(int)})
    calls = af.with_accumulation(2, mode="calls")(classify)
    calls(state, next(iter(loader)))  # a window is open
    with pytest.raises(RuntimeError, match="window is open"):
        ckpt.save(tmp_path / "bad", state)
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


def test_bad_arguments():
    state, _, _ = setup()
    with pytest.raises(ValueError, match="keep"):
        ckpt.save("unused", state, keep=0)
    with pytest.raises(TypeError, match="state_dict"):
        ckpt.save("unused", state, loader=[1, 2])
    with pytest.raises(TypeError, match="TrainState"):
        ckpt.save("unused", state.model)
    with pytest.raises(TypeError, match="Step"):
        ckpt.save("unused", state, step=classify)


def test_nothing_to_load(tmp_path):
    state, _, _ = setup()
    assert ckpt.latest(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.load(tmp_path, state)


# ------------------------------------------------------------------------- refusals
def test_a_different_model_is_refused_naming_the_parameters(saved):
    _, path, _, _ = saved
    refused(path, r"different model: 21 with another shape or dtype: blocks.0.fc1.bias saved "
             r"\[16\] float32, here \[24\] float32",
             build=lambda: setup(dim=12))

    def deeper():
        _, loader, step = setup()
        torch.manual_seed(0)
        model = Net(depth=4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = af.TrainState(model, opt,
                              scheduler=torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
        step.prepare(state)
        return state, loader, step

    refused(path, r"6 in this model but not in the checkpoint: blocks\.3\.norm\.weight",
             build=deeper)


def test_a_different_transform_stack_is_refused_but_not_another_order(saved):
    _, path, _, _ = saved
    other = af.with_amp(dtype=torch.float16, growth_interval=1)(af.apply_transform(noisy,
                                                                                   counter()))
    refused(path, r"removed: with_clipping\(max_norm=1\)", step=other)
    reordered = af.with_clipping(af.with_amp(dtype=torch.float16, growth_interval=1)(
        af.apply_transform(noisy, counter())))
    fresh, loader, _ = setup()
    assert ckpt.load(path, fresh, loader=loader, step=reordered).step == 3


def test_another_distributed_layout_is_refused_unless_resharding():
    """distributed's strategy and mesh are the layout: another one is a different stack for an
    exact resume, and the layout being changed under allow_resharding."""
    from accelfn.checkpointing.checks import compare_stacks, stack_signature

    hsdp = stack_signature(af.with_clipping(af.distributed(strategy="hsdp", replicate=2)(
        noisy)))
    fsdp = stack_signature(af.with_clipping(af.distributed(strategy="fsdp")(noisy)))
    alone = stack_signature(af.with_clipping(noisy))
    with pytest.raises(ckpt.CheckpointError, match=r"added: distributed\(fsdp\)"):
        compare_stacks(hsdp, fsdp)
    compare_stacks(hsdp, fsdp, resharding=True)
    compare_stacks(hsdp, alone, resharding=True)
    with pytest.raises(ckpt.CheckpointError, match=r"removed: with_clipping"):
        compare_stacks(hsdp, stack_signature(af.distributed(strategy="fsdp")(noisy)),
                       resharding=True)


def test_other_mismatches_are_refused_with_the_fix(saved):
    _, path, _, _ = saved
    refused(path, "optimizer is AdamW .* this one is SGD", build=lambda: setup(opt="sgd"))
    refused(path, "scheduler is StepLR, this state's is None",
             build=lambda: setup(scheduler=False))
    refused(path, "batch_size: saved 4, here 6",
             loader=data.loader(dataset(), batch_size=6, seed=1))


def test_another_world_size_needs_allow_resharding(saved):
    _, path, _, _ = saved
    meta = json.loads((path / "meta.json").read_text())
    meta["world_size"] = 2
    forge(path, "meta.json", json.dumps(meta).encode())
    refused(path, "written by 2 process.*allow_resharding=True")
    fresh, loader, step = setup(seed=1)
    with pytest.raises(ckpt.CheckpointError, match="loader=None"):
        ckpt.load(path, fresh, loader=loader, step=step, allow_resharding=True)
    info = ckpt.load(path, fresh, step=step, allow_resharding=True)
    assert "data" not in info.restored and not any(p.startswith("rng") for p in info.restored)
    assert fresh.step == 3


def test_a_restore_that_fails_part_way_is_rolled_back(saved, monkeypatch):
    _, path, _, _ = saved
    fresh, loader, step = setup(seed=1)
    run(fresh, iter(loader), step, 1)
    loader = data.loader(dataset(), batch_size=4, seed=1)
    before = snapshot(fresh)
    scaler = type(fresh.slots["with_amp"])
    own, calls = scaler.load_state_dict, []

    def breaks_once(self, sd):  # the checkpoint's scale fails; putting ours back works
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("scaler broke")
        return own(self, sd)

    monkeypatch.setattr(scaler, "load_state_dict", breaks_once)
    with pytest.raises(ckpt.CheckpointError, match=r"scaler broke.*nothing was restored"):
        ckpt.load(path, fresh, loader=loader, step=step)
    assert_unchanged(before, fresh)
    # a rollback that fails too is not called one
    monkeypatch.setattr(scaler, "load_state_dict",
                        lambda self, sd: (_ for _ in ()).throw(RuntimeError("scaler broke")))
    with pytest.raises(ckpt.CheckpointError, match=r"rolling the state back failed too"):
        ckpt.load(path, fresh, loader=loader, step=step)
    monkeypatch.undo()
    assert fresh.optimizer.state  # still its own AdamW moments
    assert next(iter(loader)) is not None  # the loader starts at its own beginning


def test_loader_refusal_after_checks_rolls_back_rng_and_state(saved, monkeypatch):
    _, path, _, _ = saved
    fresh, loader, step = setup(seed=1)
    before = snapshot(fresh)
    monkeypatch.setattr(type(loader), "load_state_dict",
                        lambda self, sd: (_ for _ in ()).throw(ValueError("loader broke")))
    with pytest.raises(ckpt.CheckpointError, match="loader broke"):
        ckpt.load(path, fresh, loader=loader, step=step)
    assert_unchanged(before, fresh)


def _two_groups():
    _, loader, step = setup()
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    state = af.TrainState(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 2, 0.5))
    step.prepare(state)
    return state, loader, step


def test_other_parameter_groups_are_refused_before_the_model_changes(saved):
    _, path, _, _ = saved
    refused(path, r"parameter groups of sizes \[22\], this one is AdamW with \[2, 20\]",
             build=_two_groups)


def test_train_state_load_state_dict_is_whole_or_nothing(saved):
    """The optimizer refuses after the model was loaded: the model must be rolled back."""
    _, _, state, _ = saved
    fresh, _, _ = _two_groups()
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(ValueError, match="parameter groups"):
        fresh.load_state_dict(state.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters()))


# ------------------------------------------------------------------------- epoch boundary
def _per_epoch_run(seed: int = 0):
    """SGD with a per-epoch StepLR, 12 batches per epoch, dropout and RNG in the step."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = Net(dim=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    state = af.TrainState(model, optimizer, scheduler=sched, scheduler_every="epoch")
    loader = data.loader(dataset(), batch_size=4, seed=1)  # 48 samples: 12 batches
    return state, loader, af.with_clipping(max_norm=0.5)(noisy)


def _for_loop(state, loader, step, epochs, save_to=None, stop_at=None):
    """``for epoch in range(state.epoch, E): for batch in loader: step`` then ``end_epoch()``;
    saves (and stops: the process "dies") right after step ``stop_at``."""
    lrs = []
    for _ in range(state.epoch, epochs):
        for batch in loader:
            step(state, batch)
            lrs.append(state.optimizer.param_groups[0]["lr"])
            if state.step == stop_at:
                ckpt.save(save_to, state, loader=loader, step=step)
                return lrs
        state.end_epoch()
    return lrs


def _while_loop(state, loader, step, steps, save_to=None, stop_at=None):
    """The ``while`` loop: ``next(it)``, and on StopIteration ``end_epoch()`` and iter()."""
    lrs = []
    it = iter(loader)
    while state.step < steps:
        try:
            batch = next(it)
        except StopIteration:
            state.end_epoch()
            it = iter(loader)
            continue
        step(state, batch)
        lrs.append(state.optimizer.param_groups[0]["lr"])
        if state.step == stop_at:
            ckpt.save(save_to, state, loader=loader, step=step)
            return lrs
    return lrs


@pytest.mark.parametrize("shape", ["for", "while"])
@pytest.mark.parametrize("stop_at", [12, 24, 7])  # an epoch's last batch, another, mid-epoch
def test_a_resume_at_an_epochs_last_batch_equals_the_uninterrupted_run(tmp_path, shape,
                                                                       stop_at):
    loop = _for_loop if shape == "for" else _while_loop
    length = 3 if shape == "for" else 30  # epochs, or steps (into the third epoch)
    state, loader, step = _per_epoch_run()
    reference_lrs = loop(state, loader, step, length)
    reference = (state.step, state.epoch, [p.detach().clone() for p in state.model.parameters()])

    first, first_loader, first_step = _per_epoch_run()
    head = loop(first, first_loader, first_step, length, save_to=tmp_path, stop_at=stop_at)
    resumed, resumed_loader, resumed_step = _per_epoch_run(seed=5)
    scramble_rngs()
    ckpt.load(tmp_path, resumed, loader=resumed_loader, step=resumed_step)
    tail = loop(resumed, resumed_loader, resumed_step, length)
    assert head + tail == reference_lrs  # the per-epoch schedule on time
    assert (resumed.step, resumed.epoch) == reference[:2]
    assert all(torch.equal(a, b) for a, b in zip(reference[2], resumed.model.parameters()))


def test_load_while_a_calls_window_is_open_rolls_back_to_the_checkpoint(tmp_path):
    # loading a checkpoint mid-window discards the open window and its gradients
    torch.manual_seed(0)
    model = Net()
    step = af.with_accumulation(2, mode="calls")(classify)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = [make_batch(seed=i) for i in range(5)]
    for b in batches[:2]:
        step(state, b)
    ckpt.save(tmp_path / "ckpt", state, step=step)  # at a window boundary
    step(state, batches[2])  # a window is open now
    assert any(p.grad is not None for p in state.model.parameters())
    ckpt.load(tmp_path / "ckpt", state, step=step)
    assert all(p.grad is None for p in state.model.parameters())
    other = Net()  # a run that resumed from the checkpoint
    twin = af.TrainState(other, torch.optim.SGD(other.parameters(), lr=0.1))
    ckpt.load(tmp_path / "ckpt", twin, step=step)
    for b in batches[3:]:
        step(state, b)
        step(twin, b)
    assert state.step == twin.step == 2
    for p, q in zip(state.model.parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_loading_a_loader_position_without_loader_warns_naming_it(tmp_path):
    import warnings

    state, loader, step = setup()
    run(state, iter(loader), step, 2)
    with_position = ckpt.save(tmp_path / "a", state, loader=loader, step=step)
    without = ckpt.save(tmp_path / "b", state, step=step)
    fresh, _, fresh_step = setup(seed=1)
    with pytest.warns(UserWarning, match=r"loader position.*loader=") as caught:
        ckpt.load(with_position, fresh, step=fresh_step)
    assert str(with_position) in str(caught[0].message)
    assert fresh.step == state.step  # loaded all the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.load(without, fresh, step=fresh_step)  # nothing to restore: nothing said
        ckpt.load(with_position, fresh, loader=setup()[1], step=fresh_step)
