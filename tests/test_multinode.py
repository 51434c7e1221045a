"""Two "nodes" on one machine: two torchrun agents meet through the c10d rendezvous on the
loopback address (``--nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d``), as on two hosts, and
run the GPT example with HSDP: one replica per node, each sharded over its node's 2 processes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import free_port

from accelfn import checkpointing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_GPT = ["--text-bytes", "30000", "--batch-size", "8", "--seq-len", "32", "--dim", "32",
            "--depth", "2", "--quiet"]

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_nodes_on_the_loopback_address_train_the_gpt_example_with_hsdp(tmp_path):
    port = free_port()
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
             "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=loopback", "--max-restarts=0",
             os.path.join(ROOT, "examples", "gpt.py"), "--steps", "3", "--hsdp", "2",
             *TINY_GPT, "--out", str(out)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            stdout, stderr = agent.communicate(timeout=600)
            outputs.append(stdout)
            assert agent.returncode == 0, stdout[-2000:] + stderr[-3000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    printed = "".join(outputs)
    assert "distributed(hsdp, replicate=2)" in printed  # the stack the first process printed
    saved = checkpointing.latest(out)
    assert saved is not None and saved.name == "step-000000003"
