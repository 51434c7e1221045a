"""A distributed run ends cleanly: torchrun runs (``--nproc_per_node=2``, gloo) of a tiny
complete training script all exit 0, no process aborted at interpreter exit ("terminate
called without an active exception", SIGABRT), and no gloo thread is left running when the
interpreter finalizes.

The abort comes from a process group still alive at finalization: a gloo worker thread that
finishes a collective takes the GIL to release the collective's tensors, and a thread that
asks for the GIL once the interpreter finalizes is ended by ``pthread_exit``, whose unwinding
through a ``noexcept`` destructor calls ``std::terminate``. Left to timing it happens in a
few runs of a hundred; the worker (exit_clean_worker.py) makes it likely by keeping the GIL
from its last collective to its exit, and reports the gloo threads still alive when its last
exit handler runs, which does not depend on timing at all; one run turns the garbage
collector off, so that what only a collection frees is still there at exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).with_name("exit_clean_worker.py")
RUNS: tuple[list[str], ...] = ([], [], ["--gc-off"])  # the worker's options, one run each


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                    reason="the worker lists its threads in /proc (Linux)")
def test_torchrun_runs_exit_cleanly_with_no_gloo_thread_left(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[1])}
    failures = []
    for i, options in enumerate(RUNS):
        out = tmp_path / f"run{i}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
               "--monitor-interval=0.1", "--master_addr=127.0.0.1", f"--master_port={_port()}",
               str(WORKER), str(out), *options]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
        if proc.returncode != 0 or "terminate called" in stderr:
            failures.append(f"run {i} {options}: exit {proc.returncode}: {stderr[-2000:]}")
        for rank in range(2):
            report = out / f"threads-{rank}.json"
            left = json.loads(report.read_text()) if report.exists() else None
            if left != []:
                failures.append(f"run {i} {options}, rank {rank}: gloo threads alive at "
                                f"interpreter exit: {left if left is not None else 'no report'}")
    assert not failures, f"{len(failures)} failure(s) in {len(RUNS)} runs:\n" + "\n".join(failures)
