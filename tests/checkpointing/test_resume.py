"""Kill-and-resume across processes: exact (bitwise on CPU fp32), mid-epoch, also under
torchrun with 2 processes (DDP and FSDP2), and sensitive to every part of the checkpoint.

The runs themselves are in resume_worker.py; each phase is a separate process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import resume_worker as worker
import torch
from resume_worker import ENV, WORKER, assert_same_run
from resume_worker import load_result as load

from accelfn import checkpointing as ckpt


def run_worker(*args: object, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


def torchrun(mode: str, run: Path, out: Path, restarts: int,
             timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """torchrun with 2 processes; on a timeout the whole process group (workers too) is
    killed and the result has returncode None."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--max-restarts={restarts}", "--monitor-interval=0.1", "--master_addr=127.0.0.1",
           f"--master_port={port}", WORKER.name, mode, str(run), str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=WORKER.parent, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code = None
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def same_params(a: dict, b: dict) -> bool:
    return a["params"].keys() == b["params"].keys() and all(
        torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


# --------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    run, out = root / "run", root / "out"
    first = run_worker("first", run, out)
    left = sorted(p.name for p in run.iterdir())
    resumed = run_worker("resume", run, out, "--mutations")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return SimpleNamespace(run=run, out=out, first=first, left=left)


@pytest.mark.slow
def test_a_process_killed_while_saving_leaves_the_last_committed_checkpoint(single):
    assert single.first.returncode == -signal.SIGKILL, single.first.stderr[-3000:]
    assert "killed while committing step-000000007" in single.first.stdout
    # keep=2 rotated step 2 away; step 7 was renamed but never got its marker, and the
    # killed writer's lock stays (the next save takes it over: test_writers.py)
    assert single.left == [".lock", "step-000000004", "step-000000005", "step-000000007"]
    assert ckpt.latest(single.run) == single.run / "step-000000005"
    state, _, _ = worker.build()
    with pytest.raises(ckpt.CheckpointError, match="no COMMITTED marker"):
        ckpt.load(single.run / "step-000000007", state)


@pytest.mark.slow
def test_resume_in_a_new_process_is_bitwise_exact_mid_epoch(single):
    reference = load(single.out / "reference.pt")
    resumed = load(single.out / "resumed.pt")
    info = resumed["info"]
    assert info["step"] == worker.SAVE_AT and info["extra"] == {"at": worker.SAVE_AT}
    assert set(worker.MUTATIONS) <= set(info["restored"])
    assert reference["skipped"] > 0  # the fp16 scaler skipped updates: its state matters
    assert_same_run(reference, resumed)


@pytest.mark.slow  # the runs of the single fixture: two worker processes
@pytest.mark.parametrize("part", worker.MUTATIONS)
def test_leaving_out_any_part_makes_the_resume_differ(single, part):
    reference = load(single.out / "reference.pt")
    mutated = load(single.out / f"mutation-{part}.pt")
    assert mutated["step"] == reference["step"]
    assert not same_params(reference, mutated), f"resuming without {part} was still exact"


# --------------------------------------------------------------------- torchrun
@pytest.fixture(scope="module")
def dist_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_resume")
    run, out = root / "run", root / "out"
    proc = torchrun("dist", run, out, restarts=2)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return SimpleNamespace(run=run, out=out, log=proc.stdout + proc.stderr)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_torchrun_kill_restart_resume_is_exact_on_every_rank(dist_run, strategy):
    assert "exitcode: -9" in dist_run.log  # a worker was SIGKILLed and torchrun restarted
    for rank in range(2):
        assert_same_run(load(dist_run.out / f"reference-{strategy}-rank{rank}.pt"),
                        load(dist_run.out / f"resumed-{strategy}-rank{rank}.pt"))
    assert [p.name for p in ckpt.checkpoints(dist_run.run / strategy)] == ["step-000000004"]
    files = sorted(p.name for p in (dist_run.run / strategy / "step-000000004").iterdir())
    assert files == ["COMMITTED", "meta.json", "rank-00000.pt", "rank-00001.pt",
                     *(["sharded"] if strategy == "fsdp" else []), "state.pt"]


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_sigterm_on_one_rank_stops_all_together_and_resumes_exactly(dist_run):
    stops = [json.loads((dist_run.out / f"preempted-rank{r}.json").read_text())
             for r in range(2)]
    assert [s["step"] for s in stops] == [4, 4]  # signalled after step 3, agreed at 4
    assert [s["requested"] for s in stops] == [False, True]  # only rank 1 got SIGTERM
    assert "exitcode: 75" in dist_run.log
    for rank in range(2):
        assert_same_run(load(dist_run.out / f"reference-ddp-rank{rank}.pt"),
                        load(dist_run.out / f"resumed-preempt-rank{rank}.pt"))


@pytest.mark.distributed
@pytest.mark.slow
def test_a_sharded_checkpoint_loads_into_one_process(dist_run):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state, _, step = worker.build("fsdp")
    with pytest.raises(ckpt.CheckpointError, match="written by 2 process"):
        ckpt.load(dist_run.run / "fsdp", state, step=step)
    info = ckpt.load(dist_run.run / "fsdp", state, step=step, allow_resharding=True)
    assert info.world_size == 2 and info.sharded and "rng.torch" not in info.restored
    saved = load(dist_run.out / "at-save-fsdp.pt")
    for name, value in worker.full_params(state.model).items():
        assert torch.equal(value, saved["params"][name]), name
    optim = get_optimizer_state_dict(state.model, state.optimizer)
    for name, entry in saved["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(optim["state"][name][key], value), (name, key)
    assert state.step == worker.DIST_SAVE_AT == state.scheduler.last_epoch


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_restart_reconnects_with_init_distributed(tmp_path):
    proc = torchrun("reconnect", tmp_path / "run", tmp_path / "out", restarts=1, timeout=120)
    assert proc.returncode is not None, "the restarted workers hung while connecting"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "rank1-connecting", "reconnected-rank0", "reconnected-rank1"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_locked_folder_fails_the_save_on_every_rank_with_the_holder_named(tmp_path):
    proc = torchrun("locked", tmp_path / "run", tmp_path / "out", restarts=0, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / "out" / f"locked-rank{r}.json").read_text())
                    for r in range(2))
    assert rank0["raised"] == "CheckpointLockedError"
    assert "pid 4242 on node-17.cluster" in rank0["message"]
    assert rank1["raised"] == "OSError"  # the type save() documents, as on rank 0
    assert "rank 0: CheckpointLockedError" in rank1["message"] and "node-17" in rank1["message"]
    assert ckpt.checkpoints(tmp_path / "run") == []


_ONE_RANK_FAILS = """
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
import accelfn as af
from accelfn import checkpointing

run, out = Path(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


class Loader:  # its position fails on rank 1 only
    def __init__(self, failure):
        self.failure = failure

    def state_dict(self):
        if rank == 1:
            if self.failure == "raises":
                raise RuntimeError("rank-1 loader broke")
            return {"position": object()}  # not plain data: save() refuses it
        return {"position": 0}


outcome = {}
for failure in ("raises", "not plain"):
    try:
        checkpointing.save(run, state, loader=Loader(failure))
        outcome[failure] = {"raised": None}
    except Exception as error:
        outcome[failure] = {"raised": type(error).__name__, "message": str(error)}
(out / f"rank{rank}.json").write_text(json.dumps(outcome))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.distributed
def test_a_failure_on_one_rank_raises_the_same_type_on_every_rank(tmp_path):
    script = tmp_path / "one_rank_fails.py"
    script.write_text(_ONE_RANK_FAILS)
    (tmp_path / "out").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--master_addr=127.0.0.1", f"--master_port={port}", str(script),
         str(tmp_path / "run"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=240, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / "out" / f"rank{r}.json").read_text())
                    for r in range(2))
    assert rank1["raises"] == {"raised": "RuntimeError", "message": "rank-1 loader broke"}
    assert rank0["raises"]["raised"] == "RuntimeError"
    assert "rank 1: RuntimeError: rank-1 loader broke" in rank0["raises"]["message"]
    assert rank1["not plain"]["raised"] == rank0["not plain"]["raised"] == "TypeError"
    assert "rank 1: TypeError: the loader state" in rank0["not plain"]["message"]
    assert ckpt.checkpoints(tmp_path / "run") == []
