"""load() under 2 processes (gloo, CPU) when it fails on one process only: every process
raises the same type, none hangs, nothing changes on any of them.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=2
test_load_agree.py OUT`` saves one checkpoint, then loads it in every case of CASES, each
failing on one rank, and saves what each rank raised and whether its state changed in
``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
if TESTS not in sys.path:  # under torchrun: conftest sits in tests/
    sys.path.insert(0, TESTS)

from dist_worker import RANK_ROWS, global_batch  # noqa: E402
from helpers import Net, classify, save_rank_results, torchrun_results  # noqa: E402

import accelfn as af  # noqa: E402
from accelfn import checkpointing  # noqa: E402
from accelfn.checkpointing.format import rank_file  # noqa: E402


class NoPosition:
    """A loader (its position was not saved: refused by load's checks)."""


def _state() -> tuple[af.TrainState, af.Step]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = af.TrainState(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    return state, af.distributed(classify)


def _corrupt(path: Path, rel: str) -> None:
    """Flip the last byte: the size is right, the checksum is not."""
    data = bytearray((path / rel).read_bytes())
    data[-1] ^= 0xFF
    (path / rel).write_bytes(bytes(data))


def _case(name: str, rank: int, root: Path, saved: Path, state: af.TrainState,
          step: af.Step) -> dict:
    """Load as case ``name`` says (rank 1 is the one that fails); what it raised, whether
    anything changed."""
    import torch.distributed as dist

    where: Path = saved
    loader = None
    if name == "missing":  # no checkpoint at the path rank 0 resolves
        where = root / "nothing-here"
    elif name == "rank_file_corrupt":
        copy = root / "corrupt" / saved.name
        if rank == 0:
            import shutil

            shutil.copytree(saved, copy)
            _corrupt(copy, rank_file(1))  # read by rank 1 only
        dist.barrier()
        where = copy
    elif name == "loader_unsaved" and rank == 1:  # a loader position the save has not
        loader = NoPosition()
    elif name == "step_refused" and rank == 1:  # not a Step: a TypeError
        step = classify  # type: ignore[assignment]
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    opt_before = repr(state.optimizer.state_dict()["state"])
    sched_before = state.scheduler.state_dict()
    error = None
    try:
        checkpointing.load(where, state, loader=loader, step=step)
    except Exception as exc:
        error = {"type": type(exc).__name__, "checkpoint_error": isinstance(
            exc, checkpointing.CheckpointError), "message": str(exc)[:300]}
    unchanged = (all(torch.equal(v, state.model.state_dict()[k]) for k, v in before.items())
                 and opt_before == repr(state.optimizer.state_dict()["state"])
                 and sched_before == state.scheduler.state_dict() and state.step == 2)
    return {"error": error, "unchanged": unchanged}


CASES = ("missing", "rank_file_corrupt", "loader_unsaved", "step_refused")


def worker(out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    # a short timeout: a collective joined by one process only fails the case, not the run
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    af.init_distributed()
    rank = dist.get_rank()
    root = Path(out_dir)
    state, step = _state()
    for i in range(2):
        step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(i).items()})
    saved = checkpointing.save(root / "run", state, step=step)
    step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(2).items()})  # moved on
    state.step = 2  # the parameters differ from the checkpoint's; the step count does not
    results = {name: _case(name, rank, root, saved, state, step) for name in CASES}
    save_rank_results(out_dir, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("load_agree")
    return torchrun_results(__file__, out, timeout=240)


pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case,expected", [
    ("missing", "FileNotFoundError"),  # documented: no committed checkpoint at the path
    ("rank_file_corrupt", "CheckpointError"),
    ("loader_unsaved", "CheckpointError"),
    ("step_refused", "TypeError"),
])
def test_a_load_failing_on_one_rank_raises_the_same_type_everywhere(results, case, expected):
    for rank in range(2):
        got = results[rank][case]
        assert got["error"] is not None, f"{case}: rank {rank} raised nothing"
        assert got["error"]["type"] == expected, f"{case}: rank {rank}: {got['error']}"
        assert got["unchanged"], f"{case}: rank {rank} changed its state"
    assert "rank 1" in results[0][case]["error"]["message"] or case == "missing"


if __name__ == "__main__":
    worker(sys.argv[1])
