"""Several optimizers under distributed (2 processes, gloo, CPU): one TrainState holding SGD
with momentum for the matrices and AdamW for the rest (or Muon and AdamW under DDP) trains as
one process does on all ranks' rows, a scheduler on each; Muon under FSDP2 is
tests/transforms/test_distributed_muon.py's.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=2
test_distributed_several_optimizers.py OUT`` trains every case of CASES on both ranks and
saves what each rank ended with in ``OUT/rank<r>.pt``; the tests compare it with a plain loop
in one process on the concatenated batch (nothing from accelfn).
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
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402

import accelfn as af  # noqa: E402

STEPS = 3
MAX_NORM = 0.05  # below the gradients' norm: clipping scales them (over all parameters)

#: name -> (kind of the matrices' optimizer, the step). The matrices' optimizer is SGD with
#: momentum (every 2-D weight) or Muon (the blocks' matrices); AdamW takes the rest.
CASES = {
    "ddp": ("sgd", lambda: af.with_accumulation(2)(af.with_clipping(max_norm=MAX_NORM)(
        af.distributed(classify)))),
    "fsdp": ("sgd", lambda: af.with_clipping(max_norm=MAX_NORM)(af.with_accumulation(2)(
        af.distributed(strategy="fsdp")(classify)))),
    "ddp_muon": ("muon", lambda: af.with_accumulation(2)(af.with_clipping(max_norm=MAX_NORM)(
        af.distributed(classify)))),
}


def matrix(name: str, p: torch.Tensor, kind: str) -> bool:
    if kind == "muon":  # Muon: the hidden matrices only
        return name.startswith("blocks.") and p.ndim == 2
    return p.ndim == 2


def optimizers(model: torch.nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    mats = [p for n, p in named if matrix(n, p, kind)]
    rest = [p for n, p in named if not matrix(n, p, kind)]
    first = (torch.optim.Muon(mats, lr=0.05, momentum=0.9) if kind == "muon"
             else torch.optim.SGD(mats, lr=0.1, momentum=0.9))
    return [first, torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)]


def schedulers(opts: list[torch.optim.Optimizer]) -> list[LambdaLR]:
    return [LambdaLR(opts[0], lambda s: 1.0 / (1 + s)),
            LambdaLR(opts[1], lambda s: min(1.0, (s + 1) / 2))]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: an FSDP2 shard's gathered value, else the tensor."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _optimizer_states(model: torch.nn.Module, opts: list[torch.optim.Optimizer]) -> dict:
    """{parameter name: {state key: whole tensor}} over every optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for optimizer in opts:
        for group in optimizer.param_groups:
            for p in group["params"]:
                out[names[id(p)]] = {k: _full(v) if isinstance(v, torch.Tensor) else v
                                     for k, v in optimizer.state[p].items()}
    return out


def _train(kind: str, build) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    opts = optimizers(model, kind)
    scheds = schedulers(opts)
    state = af.TrainState(model, opts, scheduler=scheds)
    step = build()
    rates = []
    for i in range(STEPS):
        metrics = step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(i).items()})
        rates.append({k: float(v) for k, v in metrics.items() if k.startswith("lr")})
    return {"params": {n: _full(p) for n, p in model.named_parameters()},
            "optimizers": _optimizer_states(model, list(state.optimizers)),
            "rates": rates, "last_epochs": [s.last_epoch for s in scheds]}


def worker(out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    af.init_distributed()
    results = {name: _train(kind, build) for name, (kind, build) in CASES.items()}
    save_rank_results(out_dir, results)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_several_optimizers")
    return torchrun_results(__file__, out)


def _reference(kind: str) -> dict:
    """One process, plain PyTorch, on the concatenated rows of both ranks: backward, clip over
    all the parameters, step each optimizer, step each scheduler, clear."""
    torch.manual_seed(0)
    model = Net()
    opts = optimizers(model, kind)
    scheds = schedulers(opts)
    rates = []
    for i in range(STEPS):
        rates.append([o.param_groups[0]["lr"] for o in opts])
        loss = classify(model, global_batch(i))["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        for optimizer in opts:
            optimizer.step()
        for scheduler in scheds:
            scheduler.step()
        for optimizer in opts:
            optimizer.zero_grad(set_to_none=True)
    return {"params": {n: p.detach() for n, p in model.named_parameters()},
            "optimizers": _optimizer_states(model, opts), "rates": rates}


pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", list(CASES))
def test_two_optimizers_equal_one_process_on_all_ranks_rows(results, case):
    kind = CASES[case][0]
    expected = _reference(kind)
    first = "lr/muon" if kind == "muon" else "lr/sgd"
    for rank in range(2):
        got = results[rank][case]
        for name, value in expected["params"].items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-5,
                                       msg=f"{case} rank {rank} {name}")
        assert got["optimizers"].keys() == expected["optimizers"].keys()
        for name, values in expected["optimizers"].items():
            assert got["optimizers"][name].keys() == values.keys(), name
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(got["optimizers"][name][key], value,
                                               atol=1e-5, rtol=1e-5,
                                               msg=f"{case} rank {rank} {name} {key}")
                else:
                    assert got["optimizers"][name][key] == value, (name, key)
        for used, (lr0, lr1) in zip(got["rates"], expected["rates"]):
            assert used[first] == pytest.approx(lr0) and used["lr"] == used[first]
            assert used["lr/adamw"] == pytest.approx(lr1)
        assert got["last_epochs"] == [STEPS, STEPS]
    if case.startswith("ddp"):  # DDP replicas stay bitwise identical
        for name in expected["params"]:
            assert torch.equal(results[0][case]["params"][name],
                               results[1][case]["params"][name]), name


if __name__ == "__main__":
    worker(sys.argv[1])
