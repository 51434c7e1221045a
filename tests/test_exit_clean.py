"""A distributed run ends cleanly: 12 runs of a tiny complete training script under
``torchrun --nproc_per_node=2`` (gloo) all exit 0, with no process aborted at interpreter
exit ("terminate called without an active exception", SIGABRT: a thread or a process group
still alive while the interpreter is torn down)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).with_name("exit_clean_worker.py")
RUNS = 12


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_twelve_torchrun_runs_all_exit_cleanly(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[1])}
    failures = []
    for i in range(RUNS):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--monitor-interval=0.1", "--master_addr=127.0.0.1", f"--master_port={_port()}",
               str(WORKER), str(tmp_path / f"run{i}")]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
        if proc.returncode != 0 or "terminate called" in stderr:
            failures.append((i, proc.returncode, stderr[-2000:]))
    assert not failures, f"{len(failures)} of {RUNS} runs did not exit cleanly: {failures[0]}"
