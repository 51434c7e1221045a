"""Two writers in one directory: a lock names the live one, a dead one's lock is taken over,
a save removes only what it wrote, and COMMITTED is written only after every file checks out.

The other writer is a real process (writer_worker.py), as with a requeued job overlapping the
old one's final save.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoint_helpers import run, setup
from writer_worker import WORKER

from accelfn import checkpointing as ckpt

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
LOCK = ".lock"


def start_writer(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)


def wait_paused(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "paused", line + (proc.stderr.read() if proc.stderr else "")


def loads(path: Path) -> bool:
    state, loader, step = setup(seed=3)
    return ckpt.load(path, state, loader=loader, step=step).path == path


@pytest.mark.parametrize("pause", ["writing", "committing"])
@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_first_which_then_commits(tmp_path, pause):
    run_dir = tmp_path / "run"
    holder = start_writer("hold", run_dir, pause)
    try:
        wait_paused(holder)
        state, loader, step = setup()
        run(state, iter(loader), step, 1)
        with pytest.raises(OSError, match=rf"is being written by pid {holder.pid} on "
                                          rf"{socket.gethostname()}") as refused:
            ckpt.save(run_dir, state, loader=loader, step=step, keep=1)
        assert isinstance(refused.value, ckpt.CheckpointLockedError)
        assert refused.value.holder["pid"] == holder.pid
        _, stderr = holder.communicate("go\n", timeout=120)
    finally:
        holder.kill()
    assert holder.returncode == 0, stderr[-3000:]
    assert [p.name for p in ckpt.checkpoints(run_dir)] == ["step-000000002"]
    assert loads(run_dir / "step-000000002")
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-000000002"]  # lock released


@pytest.mark.slow
def test_two_processes_saving_into_one_directory_leave_only_loadable_checkpoints(tmp_path,
                                                                                  capsys):
    run_dir = tmp_path / "run"
    writers = [start_writer("loop", run_dir, 30) for _ in range(2)]
    for proc in writers:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    for proc in writers:  # both start saving at once
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = []
    for proc in writers:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    for mine, other in (results, results[::-1]):
        assert mine["other"] == [], mine["other"][0]  # each save committed or was refused
        assert all(f"pid {other['pid']} on" in message for message in mine["refused"])
    assert all(len(r["saved"]) + len(r["refused"]) == 30 for r in results)
    assert sum(len(r["saved"]) for r in results) >= 1
    assert sum(len(r["refused"]) for r in results) > 0  # they did overlap
    committed = ckpt.checkpoints(run_dir)
    assert committed and all(loads(path) for path in committed)
    with capsys.disabled():
        print(f"\ntwo writers: {[len(r['saved']) for r in results]} saved, "
              f"{[len(r['refused']) for r in results]} refused, {len(committed)} committed "
              "(kept), all loadable")
    assert not (run_dir / LOCK).exists()
    # a save at a step below the other writer's newest sets that one aside (it looks like a
    # run gone back to an earlier checkpoint): renamed whole, still loadable, no leftovers
    aside = [p for p in run_dir.iterdir() if p.name.startswith("abandoned-step-")]
    assert all(loads(path) for path in aside)
    assert all(p.name.startswith("step-") for p in run_dir.iterdir() if p not in aside)


@pytest.mark.slow
def test_the_lock_of_a_killed_writer_is_taken_over_and_its_leftovers_removed(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_writer("hold", run_dir, "committing")  # renamed, no marker yet
    wait_paused(holder)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    lock = json.loads((run_dir / LOCK).read_text())
    assert (lock["pid"], lock["host"]) == (holder.pid, socket.gethostname())
    assert [p.name for p in run_dir.iterdir() if p.name != LOCK] == ["step-000000002"]
    state, loader, step = setup()
    run(state, iter(loader), step, 3)
    path = ckpt.save(run_dir, state, loader=loader, step=step)
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-000000003"]
    assert loads(path)


def _foreign_lock(run_dir: Path, age_s: float) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK
    lock.write_text(json.dumps({"pid": 4242, "host": "node-17.cluster", "boot": "b", "pidns": "n",
                                "start": 1, "created": time.time() - age_s, "token": "t0"}))
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_lock_held_on_another_host_is_refused_until_its_heartbeat_stops(tmp_path):
    state, _, _ = setup()
    _foreign_lock(tmp_path, age_s=5.0)
    with pytest.raises(ckpt.CheckpointLockedError, match=r"pid 4242 on node-17\.cluster.*"
                                                        r"delete .*\.lock"):
        ckpt.save(tmp_path, state)
    assert ckpt.checkpoints(tmp_path) == []
    _foreign_lock(tmp_path, age_s=3600.0)  # no heartbeat for an hour: that writer is gone
    assert ckpt.save(tmp_path, state).name == "step-000000000"
    assert not (tmp_path / LOCK).exists()


def test_the_lock_is_refreshed_while_a_long_save_runs(tmp_path, monkeypatch):
    from accelfn.checkpointing import files, lock

    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    seen = []
    real = files.write_torch

    def slow(path, obj):
        before = (tmp_path / LOCK).stat().st_mtime_ns
        time.sleep(0.5)
        seen.append((tmp_path / LOCK).stat().st_mtime_ns > before)
        return real(path, obj)

    monkeypatch.setattr(files, "write_torch", slow)
    state, _, _ = setup()
    ckpt.save(tmp_path, state)
    assert seen and all(seen)


def _after_the_rename(monkeypatch, damage):
    real = os.replace

    def replace(src, dst):
        real(src, dst)
        if Path(src).name.startswith(".tmp-"):
            damage(Path(dst))

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("damage", ["delete", "change", "truncate"])
def test_committed_is_written_only_after_every_listed_file_checks_out(tmp_path, monkeypatch,
                                                                        damage):
    state, loader, step = setup()
    run(state, iter(loader), step, 1)
    first = ckpt.save(tmp_path, state, loader=loader, step=step)
    run(state, iter(loader), step, 1)

    def hit(final: Path) -> None:  # what another writer's cleanup or a bad disk would do
        target = final / "rank-00000.pt"
        if damage == "delete":
            target.unlink()
        elif damage == "change":
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0xFF
            target.write_bytes(bytes(data))
        else:
            target.write_bytes(target.read_bytes()[:-10])

    with monkeypatch.context() as m:
        _after_the_rename(m, hit)
        with pytest.raises(OSError, match=r"rank-00000\.pt.*nothing was committed"):
            ckpt.save(tmp_path, state, loader=loader, step=step)
    assert ckpt.checkpoints(tmp_path) == [first]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
    assert loads(first)
