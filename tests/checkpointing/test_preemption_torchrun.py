"""Preempted under torchrun, the launch's exit status says so: ``python -m accelfn.cli.launch``
(torchrun's arguments and agent) exits 75 when its 2 workers checkpointed on a SIGTERM, sent
to one rank or to the agent, where torchrun itself exits 1; 0 when they finish and 1 when one
crashes, as torchrun."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelfn.checkpointing import EXIT_PREEMPTED, latest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).with_name("preempt_launch_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[2])}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(mode: str, out: Path, *, launcher: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", *launcher, "--nproc_per_node=2", "--monitor-interval=0.1",
           "--master_addr=127.0.0.1", f"--master_port={_port()}", str(WORKER), mode, str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, start_new_session=True)


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str]:
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the launch did not end within {timeout} s: {stderr[-3000:]}")
    return proc.returncode, stderr


def wait_ready(out: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not all((out / f"ready-{r}").exists() for r in (0, 1)):
        if proc.poll() is not None or time.monotonic() > end:
            code, stderr = finish(proc)
            pytest.fail(f"the workers never got ready (status {code}): {stderr[-3000:]}")
        time.sleep(0.1)


LAUNCH = ["accelfn.cli.launch"]
TORCHRUN = ["torch.distributed.run"]


@pytest.mark.parametrize("target", ["rank 1", "agent"])
def test_sigterm_to_a_rank_or_the_agent_exits_75_after_one_checkpoint(tmp_path, target):
    proc = start("wait", tmp_path, launcher=LAUNCH)
    wait_ready(tmp_path, proc)
    pid = proc.pid if target == "agent" else int((tmp_path / "pid-1").read_text())
    os.kill(pid, signal.SIGTERM)
    code, stderr = finish(proc)
    assert code == EXIT_PREEMPTED, stderr[-3000:]
    assert latest(tmp_path / "run") is not None  # the checkpoint the requeued job resumes
    assert "preempted at step" in stderr and "`accelfn launch`" not in stderr


def test_torchrun_itself_exits_1_for_the_same_preemption(tmp_path):
    # what the launcher is for: torchrun's status hides the workers' 75
    proc = start("wait", tmp_path, launcher=TORCHRUN)
    wait_ready(tmp_path, proc)
    os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGTERM)
    code, stderr = finish(proc)
    assert code == 1 and "exitcode: 75" in stderr, stderr[-3000:]
    assert latest(tmp_path / "run") is not None
    # the workers' exit message says why no requeue will come, and what to launch with
    assert "torchrun itself will exit 1, not 75" in stderr and "`accelfn launch`" in stderr


@pytest.mark.parametrize(("mode", "expected"), [("finish", 0), ("crash", 1)])
def test_a_finished_run_exits_0_and_a_crash_1(tmp_path, mode, expected):
    code, stderr = finish(start(mode, tmp_path, launcher=LAUNCH))
    assert code == expected, stderr[-3000:]
    assert latest(tmp_path / "run") is None  # nobody saved on preemption
