"""save(..., asynchronous=True): the loop blocks only for the staging copy; the checkpoint is
the state at the call, committed only when the background write completes; the next save or
load waits for it (and raises its error); a kill during the write leaves the previous
checkpoint the newest. Whole and sharded (torch.distributed.checkpoint) formats.

The background write is held at a known point by a gate (a patched file write, or DCP's
``write_data``), so what happens before the commit is seen deterministically.
"""

from __future__ import annotations

import errno
import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from async_worker import WORKER, digests
from checkpoint_helpers import run, setup, snapshot
from helpers import Net
from resume_worker import ENV
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import accelfn as af
from accelfn import checkpointing as ckpt
from accelfn.checkpointing import background, files, format

FORMATS = pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])


class Gate:
    """Holds the background write of state.pt (and DCP's shard writes) until ``open()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: OSError | None = None,
                 dcp_fail: OSError | None = None) -> None:
        self.opened, self.reached = threading.Event(), threading.Event()
        real_torch, real_dcp = files.write_torch, FileSystemWriter.write_data

        def write_torch(path: Path, obj: object) -> object:
            if path.name == format.STATE_FILE:
                self.reached.set()
                assert self.opened.wait(60)
                if fail is not None:
                    raise fail
            return real_torch(path, obj)

        def write_data(writer: FileSystemWriter, *args: object, **kwargs: object) -> object:
            assert self.opened.wait(60)
            if dcp_fail is not None:
                raise dcp_fail
            return real_dcp(writer, *args, **kwargs)

        monkeypatch.setattr(files, "write_torch", write_torch)
        monkeypatch.setattr(FileSystemWriter, "write_data", write_data)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture(autouse=True)
def _no_save_left_running():
    yield
    background.wait_previous("the test teardown")  # a test's failure is its own


def trained(steps: int = 2):
    state, loader, step = setup()
    it = iter(loader)
    run(state, it, step, steps)
    return state, loader, step, it


def restored(path: Path) -> dict:
    fresh, loader, step = setup(seed=5)
    ckpt.load(path, fresh, loader=loader, step=step)
    return snapshot(fresh)


def same(a: dict, b: dict) -> bool:
    return (all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
            and a["opt"] == b["opt"] and a["sched"] == b["sched"] and a["step"] == b["step"]
            and a["slots"] == b["slots"] and repr(a["rng"]) == repr(b["rng"]))


@FORMATS
def test_the_commit_happens_only_when_the_background_write_completes(tmp_path, monkeypatch,
                                                                      sharded):
    state, loader, step, it = trained()
    first = ckpt.save(tmp_path, state, loader=loader, step=step, sharded=sharded)
    run(state, it, step, 1)
    gate = Gate(monkeypatch)
    handle = ckpt.save(tmp_path, state, loader=loader, step=step, sharded=sharded, keep=1,
                       asynchronous=True)
    assert isinstance(handle, ckpt.AsyncSave) and handle.step == 3
    assert gate.reached.wait(60)
    assert not handle.done() and handle.path is None
    assert ckpt.latest(tmp_path) == first  # not committed, nothing rotated yet
    assert (first / format.MARKER).exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(format.TMP_PREFIX)]
    assert (tmp_path / ".lock").exists()  # held by the background save
    with pytest.raises(TimeoutError, match="still being written"):
        handle.wait(timeout=0.05)
    assert "writing" in repr(handle)
    gate.open()
    path = handle.wait()
    assert handle.done() and handle.path == path == ckpt.latest(tmp_path)
    assert ckpt.checkpoints(tmp_path) == [path]  # keep=1 rotated only after the commit
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # lock released
    assert f"committed as {path}" in repr(handle)


@FORMATS
def test_changes_after_save_returns_do_not_reach_the_checkpoint(tmp_path, monkeypatch,
                                                                sharded):
    state, loader, step, it = trained()
    before = snapshot(state)
    gate = Gate(monkeypatch)  # nothing is written before the loop has changed everything
    handle = ckpt.save(tmp_path, state, loader=loader, step=step, sharded=sharded,
                       extra={"best": [1.0]}, asynchronous=True)
    run(state, it, step, 2)  # parameters, moments, schedule, scaler, slot, RNG, loader
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1000.0)
    for s in state.optimizer.state.values():
        s["exp_avg"].fill_(7.0)
    assert not handle.done()
    gate.open()
    path = handle.wait()
    assert not same(snapshot(state), before)
    assert same(restored(path), before)
    fresh, fresh_loader, fresh_step = setup(seed=5)
    assert ckpt.load(path, fresh, loader=fresh_loader, step=fresh_step).extra == {"best": [1.0]}


@FORMATS
def test_an_asynchronous_checkpoint_equals_a_synchronous_one(tmp_path, sharded):
    state, loader, step, it = trained()
    sync = ckpt.save(tmp_path / "sync", state, loader=loader, step=step, sharded=sharded)
    handle = ckpt.save(tmp_path / "async", state, loader=loader, step=step, sharded=sharded,
                       asynchronous=True)
    run(state, it, step, 1)
    assert same(restored(handle.wait()), restored(sync))


def test_load_waits_for_the_save_and_then_finds_it(tmp_path, monkeypatch):
    state, loader, step, it = trained()
    ckpt.save(tmp_path, state, loader=loader, step=step)
    run(state, it, step, 1)
    gate = Gate(monkeypatch)
    handle = ckpt.save(tmp_path, state, loader=loader, step=step, asynchronous=True)
    fresh, fresh_loader, fresh_step = setup(seed=5)
    found: list[ckpt.CheckpointInfo] = []
    loading = threading.Thread(target=lambda: found.append(
        ckpt.load(tmp_path, fresh, loader=fresh_loader, step=fresh_step)))
    loading.start()
    loading.join(0.5)
    assert loading.is_alive() and not found  # waiting for the commit (the gate is shut)
    gate.open()
    loading.join(60)
    assert found[0].step == 3 and found[0].path == handle.wait()


def test_the_next_save_waits_for_the_previous(tmp_path, monkeypatch):
    state, loader, step, it = trained()
    gate = Gate(monkeypatch)
    first = ckpt.save(tmp_path, state, loader=loader, step=step, asynchronous=True)
    assert gate.reached.wait(60)
    run(state, it, step, 1)
    second: list[Path] = []
    saving = threading.Thread(target=lambda: second.append(
        ckpt.save(tmp_path, state, loader=loader, step=step)))
    saving.start()
    saving.join(0.5)
    assert saving.is_alive() and not first.done()  # not refused by the lock: waiting
    gate.open()
    saving.join(60)
    assert ckpt.checkpoints(tmp_path) == [first.wait(), second[0]]
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000000002", "step-000000003"]


def test_a_failed_write_is_raised_by_wait_and_nothing_is_committed(tmp_path, monkeypatch):
    state, loader, step, it = trained()
    first = ckpt.save(tmp_path, state, loader=loader, step=step)
    run(state, it, step, 1)
    gate = Gate(monkeypatch, fail=OSError(errno.ENOSPC, "No space left on device"))
    handle = ckpt.save(tmp_path, state, loader=loader, step=step, keep=1, asynchronous=True)
    gate.open()
    for _ in range(2):  # as often as it is asked
        with pytest.raises(OSError, match="No space left") as raised:
            handle.wait()
        assert raised.value.errno == errno.ENOSPC
    assert handle.done() and handle.path is None and "failed (OSError)" in repr(handle)
    assert ckpt.checkpoints(tmp_path) == [first]  # keep=1 deleted nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no leftovers, no lock
    monkeypatch.undo()
    assert ckpt.save(tmp_path, state, loader=loader, step=step).name == "step-000000003"


@pytest.mark.parametrize("then", ["save", "load"])
def test_an_unseen_failure_is_raised_by_the_next_save_or_load(tmp_path, monkeypatch, then):
    state, loader, step, it = trained()
    first = ckpt.save(tmp_path, state, loader=loader, step=step)
    run(state, it, step, 1)
    gate = Gate(monkeypatch, fail=OSError(errno.EIO, "Input/output error"))
    ckpt.save(tmp_path, state, loader=loader, step=step, asynchronous=True)  # never waited on
    assert gate.reached.wait(60)
    gate.open()
    monkeypatch.undo()
    fresh, fresh_loader, fresh_step = setup(seed=5)
    before = snapshot(fresh)
    call = ((lambda: ckpt.save(tmp_path, state, loader=loader, step=step)) if then == "save"
            else (lambda: ckpt.load(tmp_path, fresh, loader=fresh_loader, step=fresh_step)))
    with pytest.raises(OSError, match="Input/output error") as raised:
        call()
    assert any(f"raised by {then}(): the asynchronous save of step 3" in note
               and "did nothing" in note for note in raised.value.__notes__)
    assert ckpt.checkpoints(tmp_path) == [first]
    assert same(snapshot(fresh), before)
    call()  # reported once: the call works again
    expected = ["step-000000002", "step-000000003"] if then == "save" else ["step-000000002"]
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == expected


def test_a_failed_sharded_write_is_an_oserror_with_its_errno(tmp_path, monkeypatch):
    state, loader, step, _ = trained()
    gate = Gate(monkeypatch, dcp_fail=OSError(errno.ENOSPC, "No space left on device"))
    handle = ckpt.save(tmp_path, state, loader=loader, step=step, sharded=True,
                       asynchronous=True)
    gate.open()
    with pytest.raises(OSError, match="writing the sharded checkpoint") as raised:
        handle.wait()
    assert raised.value.errno == errno.ENOSPC  # DCP's CheckpointException is the cause
    assert type(raised.value.__cause__).__name__ == "CheckpointException"
    assert ckpt.checkpoints(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_a_preemption_checkpoint_is_written_after_an_unseen_failure(tmp_path, monkeypatch,
                                                                   capsys):
    state, loader, step, _ = trained()
    gate = Gate(monkeypatch, fail=OSError(errno.EIO, "Input/output error"))
    ckpt.save(tmp_path, state, loader=loader, step=step, asynchronous=True)  # never waited on
    assert gate.reached.wait(60)
    gate.open()
    monkeypatch.undo()
    guard = ckpt.PreemptionGuard()
    with pytest.warns(UserWarning, match=r"earlier asynchronous checkpoint failed \(OSError: "
                                         r"\[Errno 5\] Input/output error"), \
            pytest.warns(RuntimeWarning) as exiting, pytest.raises(SystemExit) as exited:
        guard.checkpoint_and_exit(tmp_path, state, loader=loader, step=step, asynchronous=True)
    assert exited.value.code == ckpt.EXIT_PREEMPTED
    path = tmp_path / "step-000000002"
    assert ckpt.checkpoints(tmp_path) == [path]  # committed before the exit
    assert any(f"saved {path}; exiting" in str(w.message) for w in exiting)


def test_asynchronous_must_be_a_bool(tmp_path):
    state = trained(1)[0]
    with pytest.raises(TypeError, match="pass True or False"):
        ckpt.save(tmp_path, state, asynchronous="yes")  # type: ignore[call-overload]


EXITING = """
import sys, torch
from accelfn import checkpointing
from accelfn.checkpointing import files
if sys.argv[2] == "fail":
    def write_torch(path, obj):
        raise OSError(28, "No space left on device")
    files.write_torch = write_torch
torch.manual_seed(0)
model = torch.nn.Linear(512, 512)
import accelfn as af
state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
checkpointing.save(sys.argv[1], state, asynchronous=True)
"""


@pytest.mark.parametrize("how", ["ok", "fail"])
@pytest.mark.slow
def test_a_script_that_ends_lets_the_save_finish(tmp_path, how):
    proc = subprocess.run([sys.executable, "-c", EXITING, str(tmp_path), how], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if how == "ok":  # committed before the interpreter exited
        assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000000000"]
        assert "RuntimeWarning" not in proc.stderr
    else:  # nobody saw the error: said at exit
        assert ckpt.checkpoints(tmp_path) == [] and list(tmp_path.iterdir()) == []
        assert "the asynchronous save of step 0 into" in proc.stderr
        assert "OSError: [Errno 28] No space left on device" in proc.stderr


# ------------------------------------------------------------------ killed while writing
@pytest.mark.slow
@pytest.mark.parametrize("how", ["whole", "sharded", "unpaused"])
def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path, how):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(WORKER), "kill", str(run_dir), str(out), how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert proc.stdout is not None
        # save() returning and the background write stopping come in either order
        expected = ["returned False"] + ([] if how == "unpaused" else ["writing"])
        lines = [proc.stdout.readline().strip() for _ in expected]
        assert sorted(lines) == sorted(expected), "\n".join(lines) + proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    leftovers = [p for p in run_dir.iterdir() if p.name.startswith(format.TMP_PREFIX)]
    assert leftovers, "the kill came after the commit"  # it did interrupt the write
    previous = run_dir / "step-000000001"
    assert ckpt.latest(run_dir) == previous
    from async_worker import big_state

    fresh = big_state()
    assert ckpt.load(run_dir, fresh).step == 1
    assert digests(fresh.model) == json.loads((out / "committed.json").read_text())
    # The next save takes the dead writer's lock over and removes its leftovers.
    fresh.step = 7
    assert ckpt.save(run_dir, fresh, sharded=how == "sharded").name == "step-000000007"
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-000000001", "step-000000007"]


# ------------------------------------------------------------------ torchrun
@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_async_saves_while_ddp_and_fsdp_keep_training(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={port}", WORKER.name, "dist",
           str(tmp_path / "run"), str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=WORKER.parent,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        result = torch.load(tmp_path / "out" / f"dist-rank{rank}.pt", weights_only=True)
        for strategy, got in result.items():
            assert got["sharded"] == (strategy == "fsdp")
            assert got["at_save"].keys() == got["loaded"].keys()
            for name, value in got["at_save"].items():
                assert torch.equal(got["loaded"][name], value), (strategy, name)
                assert not torch.equal(got["after"][name], value), (strategy, name)
                assert torch.equal(got["loaded_latest"][name], got["after"][name])
            assert got["latest_step"] == 6 and got["again"].endswith("step-000000006")


# ------------------------------------------------------------------ on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@FORMATS
def test_on_a_gpu_the_state_is_staged_in_pinned_memory(tmp_path, monkeypatch, sharded):
    def build(seed: int) -> af.TrainState:
        torch.manual_seed(seed)
        model = Net(dim=8).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 6, device="cuda")).sum().backward()
        optimizer.step()
        return af.TrainState(model, optimizer)

    state = build(0)
    before = {k: v.detach().cpu().clone() for k, v in state.state_dict()["model"].items()}
    staged: list[object] = []
    real = background.stage
    monkeypatch.setattr(background, "stage", lambda obj: staged.append(real(obj)) or staged[-1])
    handle = ckpt.save(tmp_path, state, sharded=sharded, asynchronous=True)
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)
    path = handle.wait()
    tensors = [t for t in _tensors(staged[0]) if t.numel() > 1]
    assert tensors and all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
    fresh = build(5)
    ckpt.load(path, fresh)
    for k, v in fresh.state_dict()["model"].items():
        assert torch.equal(v.cpu(), before[k]), k


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
