"""Hangs named: a stuck rank, the survivors' errors and ``accelfn doctor --hang`` on the dumps.

One launch of 3 gloo processes under torchrun (``init_distributed(timeout=2, hang_dir=...)``,
rank 1 joining the group later than the timeout, which bounds collectives, not joining; a
DDP step twice); then rank 2 gets stuck (a long sleep outside any collective) while ranks 0
and 1 run a third step. The survivors must fail within the timeout and a short grace, each
error naming the collective (its Flight Recorder entry) and rank 2; each survivor dumps its
Flight Recorder (torch's own pickle, ``_dump_fr_trace``), and ``accelfn doctor --hang`` names
rank 2 from those dumps. torchrun ends the stuck rank once the others failed.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=3
test_hang_dumps.py OUT HANG_DIR`` saves what each survivor caught in ``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
if TESTS not in sys.path:  # under torchrun: helpers sit in tests/
    sys.path.insert(0, TESTS)

from helpers import free_port  # noqa: E402

from accelfn.cli.main import main  # noqa: E402
from accelfn.observe.hang_dumps import analyse  # noqa: E402

TIMEOUT_S = 2.0
STUCK_S = 60.0  # far beyond the bound: the survivors must not wait for it
GRACE_S = 1.0  # accelfn.core.hangs: a tenth of the timeout, at least 1 s


def squared(model, batch):
    return model(batch["x"]).pow(2).mean()


def worker(out_dir: str, hang_dir: str) -> None:
    from tensordict import TensorDict
    from torch import nn

    import accelfn as af

    if os.environ["RANK"] == "1":  # starts late: joining is not bounded by the timeout
        time.sleep(TIMEOUT_S + 2)
    af.init_distributed(timeout=TIMEOUT_S, hang_dir=hang_dir)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.distributed(squared)
    batch = TensorDict(x=torch.randn(4, 4), batch_size=[4])
    for _ in range(2):
        step(state, batch)
    if rank == 2:
        time.sleep(STUCK_S)  # stuck outside any collective
        return
    started = time.monotonic()
    try:
        step(state, batch)
    except Exception as error:
        torch.save({"type": type(error).__name__, "kind": getattr(error, "kind", None),
                    "message": str(error), "elapsed": time.monotonic() - started,
                    "failed_at": time.time()},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        raise  # the process ends on it, as a training script would


@pytest.fixture(scope="module")
def stuck(tmp_path_factory):
    out, hang_dir = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("hang")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "--monitor-interval=1", __file__, str(out), str(hang_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * STUCK_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    ended = time.time()
    caught = {r: torch.load(out / f"rank{r}.pt", weights_only=False)
              for r in (0, 1) if (out / f"rank{r}.pt").exists()}
    return proc, ended, caught, hang_dir


@pytest.mark.distributed
@pytest.mark.slow
def test_the_survivors_fail_within_the_bound_naming_the_stuck_rank_and_the_collective(stuck):
    proc, ended, caught, _ = stuck
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode != 0, log
    assert sorted(caught) == [0, 1], log
    for rank, got in caught.items():
        assert (got["type"], got["kind"]) == ("DistributedError", "timeout"), got
        assert got["elapsed"] < TIMEOUT_S + GRACE_S + 3.0, got  # bounded, not STUCK_S
        message = got["message"]
        assert f"rank {rank} was in collective #" in message, message
        assert "gloo:all_reduce" in message and "ranks [0, 1, 2]" in message, message
        assert "rank 2 never arrived" in message, message
        assert "rank 0 never" not in message and "rank 1 never" not in message, message
        assert "accelfn doctor --hang" in message, message
    # the survivors' processes ended (their teardown, torchrun's check each second), and
    # torchrun ended the stuck one, long before it would have woken up
    assert ended - max(got["failed_at"] for got in caught.values()) < STUCK_S / 3, log


@pytest.mark.distributed
@pytest.mark.slow
def test_doctor_hang_names_the_rank_that_left_no_dump_from_the_survivors_dumps(stuck, capsys):
    _, _, _, hang_dir = stuck
    assert sorted(p.name for p in hang_dir.iterdir()) == ["rank_0", "rank_1"]
    found = [f for f in analyse(hang_dir) if f.check == "hang"]
    assert [f.severity for f in found] == ["error"], found
    assert "gloo:all_reduce" in found[0].message and "ranks 0, 1 entered it" in found[0].message
    assert "rank 2 did not and left no dump" in found[0].message
    assert main(["doctor", "--hang", str(hang_dir)]) == 1
    assert "rank 2 did not" in capsys.readouterr().out


def test_doctor_hang_refuses_a_folder_without_dumps(tmp_path, capsys):
    assert main(["doctor", "--hang", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("x")
    assert main(["doctor", "--hang", str(tmp_path)]) == 2
    assert "no Flight Recorder dumps" in capsys.readouterr().err
    (tmp_path / "rank_0").write_text("not a pickle")
    assert main(["doctor", "--hang", str(tmp_path)]) == 2
    assert "not a Flight Recorder dump" in capsys.readouterr().err


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
