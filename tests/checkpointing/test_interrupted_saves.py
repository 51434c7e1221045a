"""An interrupt anywhere in a save: a deterministic injector raises KeyboardInterrupt at the
k-th call made by or into the checkpointing code in the calling thread, for every k;
afterwards nothing waits for ever, no lock names this process, and the next save commits and
loads. (An interrupt as ``Thread.start`` returns is its own test below.)

Also: a save whose final agreement fails after its commit marker was written keeps that
complete checkpoint (a peer that died just after the commit), and forged checkpoints that a
checksum cannot catch (a NaN parameter, a ``step-*`` directory linking out of the run folder)
are refused.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading

import pytest
import torch
from helpers import Net

import accelfn as af
from accelfn import checkpointing as ckpt
from accelfn.checkpointing import (
    background,
    checks,
    collective,
    files,
    format,
    lock,
    rng,
    saving,
    states,
)

FILES = {os.path.abspath(m.__file__)
         for m in (saving, background, lock, files, collective, states, format, checks, rng)}
RISKY = {"acquire", "_create", "release", "start", "_decide", "writing", "_abandon"}


class Injector:
    """Raise KeyboardInterrupt at the ``at``-th call made by, or into, the checkpointing code in
    this thread (0: count them, recording each called function's name).

    Calls are where the interpreter delivers a signal (it checks for one as a function
    starts, and a blocking call returns into its caller with the interrupt): raising there,
    at every call of a save, is every place a real Ctrl-C can land. Line events would add
    places no signal reaches (the instruction after a lock's acquire in a ``with``, a
    ``try``'s own line), where an exception leaves the interpreter in states no run can see.
    """

    def __init__(self, at: int) -> None:
        self.at = at
        self.calls = 0
        self.functions: list[str] = []

    def __enter__(self) -> Injector:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)

    def _call(self, frame, event, arg):
        caller = frame.f_back
        if event == "call" and (_ours(frame) or (caller is not None and _ours(caller))):
            self.calls += 1
            if self.at == 0:
                self.functions.append(frame.f_code.co_name)
            elif self.calls == self.at:
                raise KeyboardInterrupt(f"injected at call {self.at} "
                                        f"({frame.f_code.co_name})")
        return None


def _ours(frame) -> bool:
    return os.path.abspath(frame.f_code.co_filename) in FILES


def _state() -> af.TrainState:
    torch.manual_seed(0)
    model = Net(dim=4)
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a thread, failing the test if it has not returned after
    ``seconds`` (a save waiting for ever on a save that never runs)."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as error:
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} still waiting after {seconds} s"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


def _points(asynchronous: bool) -> list[int]:
    """Every call in the lock, the thread start and the abandon paths; every second elsewhere
    (the rest is straight-line code that the same except clauses cover)."""
    state = _state()
    counting = Injector(at=0)
    with tempfile.TemporaryDirectory() as folder:
        with counting:
            handle = ckpt.save(folder, state, asynchronous=asynchronous)
        if asynchronous:
            handle.wait()
    return [k for k, name in enumerate(counting.functions, 1) if name in RISKY or k % 2 == 0]


@pytest.mark.slow
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_an_interrupt_anywhere_in_a_save_leaves_nothing_that_blocks_the_next(
        tmp_path, asynchronous):
    state = _state()
    points = _points(asynchronous)
    assert len(points) > 100
    for k in points:
        root = tmp_path / f"at-{k}"
        interrupted = False
        try:
            with Injector(at=k):
                handle = ckpt.save(root, state, asynchronous=asynchronous)
        except KeyboardInterrupt:
            interrupted = True
        if not interrupted and asynchronous:
            _within(30, handle.wait)
        # the next save neither waits for ever nor finds the folder locked by this process
        path = _within(30, ckpt.save, root, state)
        assert ckpt.latest(root) == path, k
        assert not (root / lock.LOCK_FILE).exists(), k
        assert [p.name for p in root.iterdir() if p.name.startswith(".")] == [], k
        for done in ckpt.checkpoints(root):  # every committed one is whole
            ckpt.load(done, _state())


def test_an_interrupt_as_the_background_thread_starts_cancels_the_save(tmp_path, monkeypatch):
    """The interrupt lands in ``Thread.start``: the thread is not let write, the save's lock
    and temporary directory are released, and nothing is pending."""
    state = _state()
    real_start = threading.Thread.start

    def interrupted_start(self):
        real_start(self)
        if self.name.startswith("accelfn-checkpoint-step"):
            raise KeyboardInterrupt("while the background thread started")

    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, state, asynchronous=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no lock, no temporary folder
    assert _within(30, ckpt.save, tmp_path, state) == ckpt.latest(tmp_path)


def test_an_interrupted_lock_acquire_is_released(tmp_path, monkeypatch):
    """The lock file was created, then the heartbeat's start was interrupted: the save gives
    the lock up, and the next save from this process takes it."""
    state = _state()
    real_start = threading.Thread.start

    def interrupted_start(self):
        if self.name == "accelfn-checkpoint-lock":
            raise KeyboardInterrupt("while the lock was taken")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path, state)
    monkeypatch.undo()
    assert not (tmp_path / lock.LOCK_FILE).exists()
    assert ckpt.save(tmp_path, state) == ckpt.latest(tmp_path)


def test_a_failure_after_the_commit_marker_keeps_the_complete_checkpoint(tmp_path,
                                                                         monkeypatch):
    """A peer dies just after rank 0 wrote the marker: the last agreement fails there, and
    the committed checkpoint stays (it was the newest complete one)."""
    state = _state()
    first = ckpt.save(tmp_path, state)
    state.step = 1  # another name
    real_agree = saving.agree
    calls = []

    def failing_agree(error, what, *args, **kwargs):
        calls.append(what)
        if what == "committing the checkpoint" and calls.count(what) == 2:
            raise RuntimeError("the other process died")
        return real_agree(error, what, *args, **kwargs)

    monkeypatch.setattr(saving, "agree", failing_agree)
    with pytest.raises(RuntimeError, match="died") as raised:
        ckpt.save(tmp_path, state, keep=1)
    monkeypatch.undo()
    newest = ckpt.latest(tmp_path)
    assert newest is not None and newest != first
    assert any("committed before this error" in note for note in raised.value.__notes__)
    assert ckpt.load(newest, _state()).step == 1
    assert not (tmp_path / lock.LOCK_FILE).exists()


# ------------------------------------------------------------------------- forged values
def test_a_nan_parameter_in_a_checkpoint_is_refused_unless_allowed(tmp_path):
    state = _state()
    with torch.no_grad():
        next(state.model.parameters())[0, 0] = float("nan")
    path = ckpt.save(tmp_path, state)
    fresh = _state()
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(ckpt.CheckpointError, match=r"parameter .* NaN or Inf.*allow_nonfinite"):
        ckpt.load(path, fresh)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters()))
    ckpt.load(path, fresh, allow_nonfinite=True)
    assert torch.isnan(next(fresh.model.parameters())[0, 0])


def test_an_inf_in_the_optimizer_state_is_refused(tmp_path):
    torch.manual_seed(0)
    model = Net(dim=4)
    state = af.TrainState(model, torch.optim.Adam(model.parameters(), lr=0.1))
    step = af.lift(lambda m, b: m(b["x"]).pow(2).mean())
    step(state, {"x": torch.randn(4, 6)})
    first = next(iter(state.optimizer.state.values()))
    first["exp_avg_sq"][0] = float("inf")
    path = ckpt.save(tmp_path, state)
    other = Net(dim=4)
    fresh = af.TrainState(other, torch.optim.Adam(other.parameters(), lr=0.1))
    step(fresh, {"x": torch.randn(4, 6)})
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer 0's state 'exp_avg_sq'"):
        ckpt.load(path, fresh)


def test_a_step_directory_linking_out_of_the_run_folder_is_neither_loaded_nor_rotated(
        tmp_path):
    state = _state()
    run = tmp_path / "run"
    real = ckpt.save(run, state)
    elsewhere = ckpt.save(tmp_path / "elsewhere", _state())
    link = run / "step-000000099"
    os.symlink(elsewhere, link)
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        assert ckpt.latest(run) == real
    with pytest.raises(ckpt.CheckpointError, match="symbolic link"):
        ckpt.load(link, _state())
    state.step = 5
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        ckpt.save(run, state, keep=1)
    assert (elsewhere / "COMMITTED").exists()  # rotation never reached through the link
