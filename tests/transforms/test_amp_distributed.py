"""with_amp(fp16) under distributed (2 processes, gloo, CPU): one loss scale for all ranks.

An overflow on one rank only must back the scale off on every rank, as one process
training on all ranks' batches does: else the scales part and DDP averages gradients
scaled differently on each rank, so that the replicas' parameters part too. Under DDP a
synced backward spreads one rank's Inf to every rank; the update of a short window that
``step.flush`` applies is not synced in the backward, its gradients are all-reduced after
unscaling, so the scaler's own overflow flags must be agreed on.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=2
test_amp_distributed.py OUT`` trains every case of CASES on both ranks and saves what each
rank saw in ``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
if TESTS not in sys.path:  # under torchrun: conftest, dist_worker and reference sit in tests/
    sys.path.insert(0, TESTS)

from dist_worker import RANK_ROWS, global_batch  # noqa: E402
from helpers import Net, classify, save_rank_results, torchrun_results  # noqa: E402
from reference import reference_update  # noqa: E402

import accelfn as af  # noqa: E402

# with_accumulation(3, mode="calls"): the windows that make an update, and the call whose
# gradients overflow on rank 1 only
CASES = {
    # a flushed window of one call (its backward not synced)
    "flush": {"windows": [[0, 1, 2], [3], [4, 5, 6], [7, 8, 9]], "poisoned": 3},
    # the last call of a full window (its backward synced by DDP)
    "synced": {"windows": [[0, 1, 2], [3, 4, 5], [6, 7, 8]], "poisoned": 5},
}


# the default: calls mode weights each call by its sample count, counted in a unit agreed by
# both ranks (7 and 5 rows: their own units would be 16 and 8), so only the poisoned call
# overflows, as in the plain loop
INIT_SCALE = 2.0**16


class Poison:
    """Puts Inf into the head's gradient while armed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.armed = False
        model.head.weight.register_hook(
            lambda g: torch.full_like(g, float("inf")) if self.armed else g)


def _train(case: dict) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    poison = Poison(model)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    step = af.with_amp(dtype=torch.float16, init_scale=INIT_SCALE)(
        af.with_accumulation(3, mode="calls")(af.distributed(strategy="ddp")(classify)))
    scales, skipped = [], []
    for window in case["windows"]:
        metrics = None
        for i in window:
            poison.armed = rank == 1 and i == case["poisoned"]
            metrics = step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(i).items()})
            poison.armed = False
        if len(window) < 3:
            metrics = step.flush(state)
        assert metrics is not None
        scales.append(float(metrics["loss_scale"]))  # the scale this update used
        skipped.append(float(metrics["skipped"]))
    scaler = state.slots["with_amp"]
    return {"scales": [*scales, float(scaler.get_scale())], "skipped": skipped,
            "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def worker(out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    af.init_distributed()
    results = {name: _train(case) for name, case in CASES.items()}
    save_rank_results(out_dir, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("amp_dist")
    return torchrun_results(__file__, out)


def _reference(case: dict) -> dict:
    """One process, plain PyTorch: autocast fp16, a GradScaler, one update per window on all
    ranks' rows together; the poisoned call's rows put Inf into the head's gradient."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2000)
    armed = [False]
    model.head.weight.register_hook(lambda g: torch.full_like(g, float("inf")) if armed[0] else g)
    scales = []
    for window in case["windows"]:
        batches = [global_batch(i) for i in window]
        armed[0] = case["poisoned"] in window
        scales.append(scaler.get_scale())
        reference_update(model, optimizer, {k: torch.cat([b[k] for b in batches])
                                            for k in batches[0]}, classify,
                         amp_dtype=torch.float16, scaler=scaler)
        armed[0] = False
    return {"scales": [*scales, scaler.get_scale()],
            "params": {k: v.detach() for k, v in model.named_parameters()}}


pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", list(CASES))
def test_an_overflow_on_one_rank_backs_off_the_scale_on_every_rank(results, case):
    expected = _reference(CASES[case])
    poisoned_update = next(u for u, w in enumerate(CASES[case]["windows"])
                           if CASES[case]["poisoned"] in w)
    for rank in range(2):
        got = results[rank][case]
        assert got["scales"] == expected["scales"], f"rank {rank}"
        assert got["skipped"] == [float(u == poisoned_update)
                                  for u in range(len(CASES[case]["windows"]))], f"rank {rank}"
        for name, value in expected["params"].items():
            torch.testing.assert_close(got["params"][name], value, atol=2e-3, rtol=2e-3,
                                       msg=f"{case} rank {rank} {name}")
    for name in expected["params"]:  # DDP replicas stay bitwise identical
        assert torch.equal(results[0][case]["params"][name], results[1][case]["params"][name])


if __name__ == "__main__":
    worker(sys.argv[1])
