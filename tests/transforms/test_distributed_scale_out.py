"""distributed at scale (4 processes, gloo, CPU): HSDP, FSDP2 x tensor parallel, CPU offload,
and ZeRO-1 (ZeroRedundancyOptimizer with DDP), each with accumulation and clipping, against
one process training on every rank's rows together.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=4
test_distributed_scale_out.py OUT`` trains every case of CASES and tries every refusal of
REFUSALS on all ranks, and saves what each rank saw in ``OUT/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
if TESTS not in sys.path:  # under torchrun: conftest, dist_worker and reference sit in tests/
    sys.path.insert(0, TESTS)

from dist_worker import RANK_ROWS, STEPS, global_batch  # noqa: E402
from helpers import MLPNet, Net, classify, save_rank_results, torchrun_results  # noqa: E402
from reference import reference_update  # noqa: E402
from trunk_models import Hidden, TrunkNet, via_method, via_submodule  # noqa: E402

import accelfn as af  # noqa: E402

WORLD = 4
MAX_NORM = 0.05  # small enough that every update is clipped
# the rows of each data shard of the global batch (12 rows): four shards, or two (tp=2)
SHARDS = {4: [slice(0, 4), slice(4, 7), slice(7, 10), slice(10, 12)], 2: RANK_ROWS}


class TrunkMLPNet(Hidden, MLPNet):
    """``MLPNet`` with a ``hidden`` method (the same parameters, initialised alike)."""


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


# name -> (model, distributed options, tensor-parallel size, ZeroRedundancyOptimizer)
CASES = {
    "hsdp": (Net, {"strategy": "hsdp", "replicate": 2}, 1, False),
    "hsdp_once": (Net, {"strategy": "hsdp", "replicate": 2, "fsdp_sync": "once"}, 1, False),
    "fsdp_tp": (MLPNet, {"strategy": "fsdp", "tp": 2}, 2, False),
    "hsdp_tp": (MLPNet, {"strategy": "hsdp", "replicate": 2, "tp": 2}, 2, False),
    "fsdp_offload": (Net, {"strategy": "fsdp", "offload": "cpu",
                           "reshard_after_forward": False}, 1, False),
    "zero_ddp": (Net, {"strategy": "ddp"}, 1, True),
    # the loss outside forward (submodules called, the head's weight read) and a method
    "hsdp_trunk": (TrunkNet, {"strategy": "hsdp", "replicate": 2}, 1, False),
    "fsdp_tp_method": (TrunkMLPNet, {"strategy": "fsdp", "tp": 2}, 2, False),
    "hsdp_tp_trunk": (TrunkMLPNet, {"strategy": "hsdp", "replicate": 2, "tp": 2}, 2, False),
}
# the step function of a case (classify otherwise): each computes what classify does
FUNCTIONS = {"hsdp_trunk": via_submodule, "fsdp_tp_method": via_method,
             "hsdp_tp_trunk": via_submodule}


def _optimizer(model: nn.Module, zero: bool, overlap: bool = False) -> torch.optim.Optimizer:
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                       overlap_with_ddp=overlap, lr=0.1, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
            for name, p in model.named_parameters()}


def _layout(param: torch.Tensor) -> dict:
    mesh = param.device_mesh  # type: ignore[attr-defined]
    return {"names": mesh.mesh_dim_names, "ranks": mesh.mesh.tolist(),
            "local": tuple(param.to_local().shape)}  # type: ignore[attr-defined]


class _Counter:
    def __init__(self) -> None:
        self.calls = 0


def _counting_hook(counter: _Counter, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    counter.calls += 1
    return default_hooks.allreduce_hook(None, bucket)


SAVED = ("hsdp", "fsdp_tp")  # saved sharded after training, loaded by one process


def _step(name: str) -> af.Step:
    _, options, tp, _ = CASES[name]
    plan = {"tensor_parallel": tp_plan()} if tp > 1 else {}
    fn = FUNCTIONS.get(name, classify)

    def function(model, batch):  # notes what it receives: the model trained (FSDP2 makes
        # its class a subclass of the user's, in place)
        RECEIVED.add(f"{CASES[name][0].__name__} trained" if isinstance(model, CASES[name][0])
                     and model is TRAINED[-1] else f"another: {type(model).__name__}")
        return fn(model, batch)

    function.__name__ = fn.__name__
    return af.with_clipping(max_norm=MAX_NORM)(af.with_accumulation(2)(
        af.distributed(**options, **plan)(function)))


RECEIVED: set[str] = set()
TRAINED: list = []  # the model of the case being trained


def _train(name: str, out_dir: str) -> dict:
    import torch.distributed as dist

    from accelfn import checkpointing

    build, _, tp, zero = CASES[name]
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build()
    state = af.TrainState(model, _optimizer(model, zero))
    step = _step(name)
    counter = _Counter()
    RECEIVED.clear()
    TRAINED.append(model)
    if zero:  # count DDP's all-reduces: one per update, none on the first micro-batch
        step.prepare(state).call.register_comm_hook(counter, _counting_hook)
    rows = SHARDS[WORLD // tp][rank // tp]  # a tensor-parallel group shares its data shard
    norms, counts = [], []
    for i in range(STEPS):
        before = counter.calls
        metrics = step(state, {k: v[rows] for k, v in global_batch(i).items()})
        norms.append(metrics["grad_norm"].clone())
        counts.append(counter.calls - before)
    out: dict = {"params": _full(model), "norms": norms, "counts": counts,
                 "received": sorted(RECEIVED),
                 "label": repr(step), "save_error": None}
    if name in SAVED:
        try:
            checkpointing.save(os.path.join(out_dir, name), state, step=step)
        except Exception as exc:
            out["save_error"] = f"{type(exc).__name__}: {exc}"[:800]
    if name.startswith(("hsdp", "fsdp")):
        first = model.blocks[0]
        out["layout"] = _layout(first.up.weight if tp > 1 else first.fc1.weight)
        out["head_layout"] = _layout(model.head.weight)
    if name == "fsdp_offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        group = model._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        out["offloaded"] = isinstance(group.offload_policy, CPUOffloadPolicy)
    return out


def _muon_over_a_vector(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon over the blocks' matrices and, through add_param_group, the head's bias."""
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "blocks" in n]
    rest = [p for n, p in model.named_parameters()
            if not (p.ndim == 2 and "blocks" in n) and n != "head.bias"]
    muon = torch.optim.Muon(matrices, lr=0.02)
    muon.add_param_group({"params": [model.head.bias]})
    return [muon, torch.optim.AdamW(rest, lr=1e-3)]


# name -> (model, distributed options, optimizers of the model)
REFUSALS = {
    "hsdp_replicate3": (Net, {"strategy": "hsdp", "replicate": 3},
                        lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
    "tp3": (lambda: MLPNet(dim=12), {"strategy": "fsdp", "tp": 3},
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
    "muon_hsdp": (Net, {"strategy": "hsdp", "replicate": 2}, _muon_over_a_vector),
    "muon_tp": (MLPNet, {"strategy": "fsdp", "tp": 2}, _muon_over_a_vector),
    "zero_fsdp": (Net, {"strategy": "fsdp"}, lambda m: _optimizer(m, zero=True)),
    "zero_overlap": (Net, {"strategy": "ddp"}, lambda m: _optimizer(m, True, overlap=True)),
}


def _refuse(name: str) -> dict:
    import torch.distributed as dist

    build, options, optimizers = REFUSALS[name]
    torch.manual_seed(0)
    model = build()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = af.TrainState(model, optimizers(model))
    plan = {"tensor_parallel": tp_plan()} if "tp" in options else {}
    step = af.distributed(**options, **plan)(classify)
    rows = SHARDS[WORLD][dist.get_rank()]
    error = None
    try:
        step(state, {k: v[rows] for k, v in global_batch(0).items()})
    except ValueError as exc:
        error = str(exc)
    params = dict(model.named_parameters())
    return {"error": error, "step": state.step,
            "unchanged": all(type(params[n]) is nn.Parameter and torch.equal(params[n], v)
                             for n, v in before.items())}


def worker(out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    af.init_distributed()
    results: dict = {"seconds": {}}
    for name in CASES:
        start = time.perf_counter()
        results[name] = _train(name, out_dir)
        results["seconds"][name] = time.perf_counter() - start
    for name in REFUSALS:
        results[name] = _refuse(name)
    save_rank_results(out_dir, results)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("scale_out")


@pytest.fixture(scope="module")
def results(out_dir):
    start = time.perf_counter()
    got = torchrun_results(__file__, out_dir, timeout=600, nproc=WORLD)
    print(f"\ntorchrun --nproc_per_node={WORLD}: {time.perf_counter() - start:.1f} s; per "
          f"case (rank 0): { {k: round(v, 2) for k, v in got[0]['seconds'].items()} }")
    return got


def _reference(name: str) -> dict:
    """One process, plain PyTorch, on all ranks' rows together: clip_grad_norm_, then SGD."""
    build, _, _, _ = CASES[name]
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = [reference_update(model, optimizer, global_batch(i), classify,
                              max_norm=MAX_NORM)["grad_norm"] for i in range(STEPS)]
    return {"params": {n: p.detach() for n, p in model.named_parameters()}, "norms": norms,
            "momentum": {n: optimizer.state[p]["momentum_buffer"]
                         for n, p in model.named_parameters()}}


pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", list(CASES))
def test_update_equals_one_process_on_every_ranks_rows(results, case):
    expected = _reference(case)
    for rank in range(WORLD):
        got = results[rank][case]
        for name, value in expected["params"].items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-5,
                                       msg=f"{case} rank {rank} {name}")
        for i, (norm, want) in enumerate(zip(got["norms"], expected["norms"])):
            # clipping saw the global norm of the full-batch gradient, on every rank
            torch.testing.assert_close(norm, want, atol=1e-5, rtol=1e-5,
                                       msg=f"{case} rank {rank} update {i}")
            assert want > MAX_NORM


@pytest.mark.parametrize("case", list(FUNCTIONS))
def test_the_function_receives_the_users_model_under_hsdp_and_tensor_parallel(results, case):
    for rank in range(WORLD):
        assert results[rank][case]["received"] == [f"{CASES[case][0].__name__} trained"]


def test_hsdp_shards_inside_a_replica_and_replicates_across(results):
    for rank in range(WORLD):
        got = results[rank]["hsdp"]
        assert got["label"].startswith("with_clipping") and \
            "distributed(hsdp, replicate=2)" in got["label"]
        # ranks 0,1 shard one replica, 2,3 the other (consecutive ranks: one node's)
        assert got["layout"]["names"] == ("replicate", "shard")
        assert got["layout"]["ranks"] == [[0, 1], [2, 3]]
        assert got["layout"]["local"] == (8, 8)  # fc1 (16, 8) sharded over 2 processes


def test_tensor_parallel_groups_are_consecutive_ranks_and_fsdp_shards_over_dp(results):
    for rank in range(WORLD):
        got = results[rank]["fsdp_tp"]
        assert got["layout"]["names"] == ("dp", "tp")
        assert got["layout"]["ranks"] == [[0, 1], [2, 3]]  # ranks 2i, 2i+1: one TP group
        assert got["layout"]["local"] == (8, 8)  # up (32, 8): over tp 2, then dp 2
        assert got["head_layout"]["names"] == ("dp",)  # outside the plan: FSDP2 only
        three = results[rank]["hsdp_tp"]["layout"]
        assert three["names"] == ("replicate", "shard", "tp")
        assert three["ranks"] == [[[0, 1]], [[2, 3]]]


def test_cpu_offload_is_fsdp2s_policy(results):
    assert all(results[rank]["fsdp_offload"]["offloaded"] for rank in range(WORLD))


def test_zero_redundancy_optimizer_with_ddp_reduces_once_per_update(results):
    for rank in range(WORLD):  # accumulation(2): no all-reduce on the first micro-batch
        assert results[rank]["zero_ddp"]["counts"] == [1] * STEPS
    for name in results[0]["zero_ddp"]["params"]:  # replicas stay bitwise identical
        for rank in range(1, WORLD):
            assert torch.equal(results[0]["zero_ddp"]["params"][name],
                               results[rank]["zero_ddp"]["params"][name])


@pytest.mark.parametrize("case", SAVED)
def test_a_sharded_checkpoint_of_the_layout_loads_into_one_process(results, out_dir, case):
    # DCP reshards (replicate, shard) and (dp, tp) DTensors into whole tensors
    from accelfn import checkpointing

    assert results[0][case]["save_error"] is None, results[0][case]["save_error"]
    build, _, _, _ = CASES[case]
    torch.manual_seed(1)  # other weights: all must come from the checkpoint
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = af.TrainState(model, optimizer)
    checkpointing.load(out_dir / case, state, step=_step(case), allow_resharding=True)
    assert state.step == STEPS
    expected = _reference(case)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), results[0][case]["params"][name]), name
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"],
                                   expected["momentum"][name], atol=1e-5, rtol=1e-5,
                                   msg=f"{case} momentum of {name}")


@pytest.mark.parametrize("case, words", [
    ("hsdp_replicate3", ["replicate=3", "4 process"]),
    ("tp3", ["tp=3", "4 process"]),
    ("muon_hsdp", ["Muon", "strategy='hsdp'", "'head.bias'", "2-D matrices only", "AdamW"]),
    ("muon_tp", ["Muon", "tp=2", "'head.bias'", "2-D matrices only", "AdamW"]),
    ("zero_fsdp", ["ZeroRedundancyOptimizer", "strategy='ddp'"]),
    ("zero_overlap", ["overlap_with_ddp=True", "overlap_with_ddp=False"]),
])
def test_refused_on_every_rank_before_anything_changes(results, case, words):
    for rank in range(WORLD):
        got = results[rank][case]
        assert got["error"] is not None, f"{case} rank {rank}: not refused"
        for word in words:
            assert word in got["error"], (word, got["error"])
        assert got["unchanged"] and got["step"] == 0


def reshard_worker(out_dir: str) -> None:
    """2 processes, FSDP2 over both: resume each layout's checkpoint (HSDP 2x2, FSDP 2 x TP 2,
    written by 4 processes) with ``allow_resharding``, then one more update on this rank's
    rows."""
    from datetime import timedelta

    import torch.distributed as dist

    from accelfn import checkpointing

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    af.init_distributed()
    rank = dist.get_rank()
    results: dict = {}
    for name in SAVED:
        build = CASES[name][0]
        torch.manual_seed(1)  # other weights: all must come from the checkpoint
        model = build()
        state = af.TrainState(model, _optimizer(model, False))
        step = af.with_clipping(max_norm=MAX_NORM)(af.with_accumulation(2)(
            af.distributed(strategy="fsdp")(classify)))
        checkpointing.load(os.path.join(out_dir, name), state, step=step,
                           allow_resharding=True)
        loaded = _full(model)
        metrics = step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(STEPS).items()})
        results[name] = {"loaded": loaded, "after": _full(model), "step": state.step,
                         "norm": metrics["grad_norm"].clone()}
    save_rank_results(os.path.join(out_dir, "reshard"), results)


@pytest.mark.parametrize("case", SAVED)
def test_a_checkpoint_of_the_layout_resumes_in_fsdp_over_two_processes(results, out_dir, case):
    """Resharding between multi-process layouts: 4 processes (HSDP 2x2, or FSDP 2 x TP 2)
    wrote it, 2 processes (FSDP over 2) continue it, equal to one process going on."""
    from helpers import torchrun

    folder = out_dir / "reshard"
    if not (folder / "rank0.pt").exists():  # one launch for every case
        folder.mkdir(exist_ok=True)
        torchrun(__file__, out_dir, "reshard", timeout=300, nproc=2)
    got = [torch.load(folder / f"rank{r}.pt", weights_only=True)[case] for r in range(2)]
    build, _, _, _ = CASES[case]
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(STEPS + 1):
        norm = reference_update(model, optimizer, global_batch(i), classify,
                                max_norm=MAX_NORM)["grad_norm"]
    for rank in range(2):
        assert got[rank]["step"] == STEPS + 1
        for name, p in model.named_parameters():
            assert torch.equal(got[rank]["loaded"][name], results[0][case]["params"][name])
            torch.testing.assert_close(got[rank]["after"][name], p.detach(), atol=1e-5,
                                       rtol=1e-5, msg=f"{case} rank {rank} {name}")
        torch.testing.assert_close(got[rank]["norm"], norm, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    if sys.argv[2:] == ["reshard"]:
        reshard_worker(sys.argv[1])
    else:
        worker(sys.argv[1])
