"""Run under torchrun (2 gloo processes) by tests/transforms/test_accumulation_adaptive.py.

Rank 1's model runs out of memory above a micro-batch size (in the forward, or in the
backward after the earlier micro-batches' backwards), rank 0's never: both processes must
retry together with the same count and end where a run with that count from the start ends.
Each rank saves its parameters, reported counts and errors for the test to compare.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from helpers import classify, make_batch, save_rank_results  # noqa: E402
from test_accumulation_adaptive import Limited  # noqa: E402

import accelfn as af  # noqa: E402

STEPS = 3
PER_RANK = 8


def rank_batch(step: int, rank: int):
    """Rank ``rank``'s rows of the global batch of ``step`` (16 samples)."""
    return make_batch(n=2 * PER_RANK, seed=step)[rank * PER_RANK:(rank + 1) * PER_RANK]


def _state(model):
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _train(step, model, rank):
    state = _state(model)
    counts = [int(step(state, rank_batch(i, rank)).get("micro_batches", -1))
              for i in range(STEPS)]
    return state, counts


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.net.named_parameters()}


def main(out_dir: str) -> None:
    af.init_distributed()
    rank = dist.get_rank()
    results: dict[str, object] = {}
    for case, in_backward in (("forward", False), ("backward", True)):
        limit = 2 if rank == 1 else 100  # rank 1 only: at most 2 samples per micro-batch
        model = Limited(limit=limit, in_backward=in_backward)
        reference = Limited(limit=100)
        reference.load_state_dict(copy.deepcopy(model.state_dict()))
        state, counts = _train(af.distributed(af.with_accumulation(1, adaptive=True)(classify)),
                               model, rank)
        _train(af.distributed(af.with_accumulation(4)(classify)), reference,
                               rank)
        results[case] = {"counts": counts, "raised": model.raised, "params": _params(model),
                         "reference": _params(reference),
                         "saved": state.state_dict()["slots"]["accumulation"],
                         "grads": [p.grad for p in model.parameters() if p.grad is not None]}
    # no finer split on rank 1: every rank raises, none waits in a collective
    model = Limited(limit=0 if rank == 1 else 100)
    state = _state(model)
    before = _params(model)
    step = af.distributed(af.with_accumulation(2, adaptive=True)(classify))
    try:
        step(state, make_batch(n=2, seed=rank))
        results["stuck"] = "no error"
    except torch.OutOfMemoryError as error:
        results["stuck"] = str(error)
    results["stuck_unchanged"] = all(torch.equal(before[k], v) for k, v in _params(model).items())
    results["stuck_step"] = state.step
    # FSDP cannot run its backward without collectives: refused before anything changes
    model = Limited(limit=100)
    state = _state(model)
    try:
        af.distributed(strategy="fsdp")(af.with_accumulation(2, adaptive=True)(classify))(
            state, make_batch(n=8, seed=rank))
        results["fsdp"] = "no error"
    except ValueError as error:
        results["fsdp"] = str(error)
    results["fsdp_step"] = state.step
    save_rank_results(out_dir, results)


if __name__ == "__main__":
    main(sys.argv[1])
