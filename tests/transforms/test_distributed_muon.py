"""torch.optim.Muon over sharded parameters (accelfn.parts.distributed.muon): with AdamW
in one TrainState, under FSDP2 over 2 and 4 processes, HSDP 2x2, FSDP2 x TP 2x2 and HSDP x TP
(gloo, CPU), with accumulation, clipping and a scheduler on each optimizer, equal to one
process running torch's Muon on every rank's rows together (each update's gradient within
1e-5 of one process', and the optimizers then compared on the same gradients: see
``reference``); each matrix orthogonalised once per replica, by owners balanced by its cost;
checkpoints that load into one plain Muon (2 -> 1) and into HSDP over 4 (2 -> 4) and continue
equal; a Muon over a 1-D parameter refused first. One process: Newton-Schulz is torch's
bitwise, the replaced step keeps torch's hooks and a scheduler's check.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=N
test_distributed_muon.py OUT [CHECKPOINTS]`` trains every case of its launch (CASES[N]) on
all ranks and saves what each rank saw in ``OUT/rank<r>.pt``. Two launches in all (2, then 4).
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
if TESTS not in sys.path:  # under torchrun: helpers and dist_worker sit in tests/
    sys.path.insert(0, TESTS)

from dist_worker import RANK_ROWS, STEPS, global_batch  # noqa: E402
from helpers import MLPNet, Net, classify, save_rank_results, torchrun_results  # noqa: E402

import accelfn as af  # noqa: E402
from accelfn.parts.distributed import muon as sharded_muon  # noqa: E402

MAX_NORM = 0.05  # below the gradients' norm: every update is clipped
# the rows of each data shard of the global batch (12 rows): four shards, or two
SHARDS = {4: [slice(0, 4), slice(4, 7), slice(7, 10), slice(10, 12)], 2: RANK_ROWS}


class OddBlock(nn.Module):
    """A residual MLP block whose matrices shard unevenly over 4 processes: fc1 (30, 10) in
    rows of 8, 8, 8, 6 (tall: Newton-Schulz runs on its transpose), fc2 (10, 30) in 3, 3, 3,
    1, and gate (3, 10) in 1, 1, 1 and none."""

    def __init__(self, dim: int = 10) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)
        self.gate = nn.Linear(dim, 3, bias=False)

    def forward(self, x):
        h = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return h * torch.sigmoid(self.gate(h)).mean(-1, keepdim=True)


class OddNet(Net):
    """``Net`` of [`OddBlock`][]s, width 10."""

    def __init__(self, dim: int = 10, depth: int = 2, classes: int = 4) -> None:
        super().__init__(dim, depth, classes, block=OddBlock)


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


# processes -> name -> (model, distributed options, tensor-parallel size)
CASES = {
    2: {"fsdp2": (OddNet, {"strategy": "fsdp"}, 1)},
    4: {"fsdp4": (OddNet, {"strategy": "fsdp"}, 1),
        "hsdp": (OddNet, {"strategy": "hsdp", "replicate": 2}, 1),
        "fsdp_tp": (MLPNet, {"strategy": "fsdp", "tp": 2}, 2),
        "hsdp_tp": (MLPNet, {"strategy": "hsdp", "replicate": 2, "tp": 2}, 2)},
}
ALL = {name: case for cases in CASES.values() for name, case in cases.items()}
SAVED = "fsdp2"  # saved after training; loaded by one process and by HSDP over 4
REPLICAS = {"fsdp2": 1, "fsdp4": 1, "hsdp": 2, "fsdp_tp": 1, "hsdp_tp": 2}


def matrix(name: str, p: torch.Tensor) -> bool:
    """What Muon trains: the blocks' matrices (the rest, AdamW)."""
    return name.startswith("blocks.") and p.ndim == 2


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    return [torch.optim.Muon([p for n, p in named if matrix(n, p)], lr=0.05, momentum=0.9),
            torch.optim.AdamW([p for n, p in named if not matrix(n, p)], lr=1e-2,
                              weight_decay=0.01)]


def schedulers(opts: list[torch.optim.Optimizer]) -> list[LambdaLR]:
    return [LambdaLR(opts[0], lambda s: 1.0 / (1 + s)),
            LambdaLR(opts[1], lambda s: min(1.0, (s + 1) / 2))]


def build_step(name: str) -> af.Step:
    _, options, tp = ALL[name]
    plan = {"tensor_parallel": tp_plan()} if tp > 1 else {}
    return af.with_clipping(max_norm=MAX_NORM)(af.with_accumulation(2)(
        af.distributed(**options, **plan)(classify)))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def optimizer_states(model: nn.Module, opts: list[torch.optim.Optimizer]) -> dict:
    """{parameter name: {state key: whole tensor, or value}} over every optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: _full(v) if isinstance(v, torch.Tensor) else v
                           for k, v in opt.state[p].items()}
            for opt in opts for group in opt.param_groups for p in group["params"]}


# ------------------------------------------------------------------------------ the worker


def record_grads(model: nn.Module, first: torch.optim.Optimizer) -> list[dict]:
    """The whole gradient of every parameter as each update applies it (reduced, accumulated
    and clipped), recorded when the first optimizer (Muon, stepped first) starts its step."""
    grads: list[dict] = []
    first.register_step_pre_hook(lambda *a: grads.append(
        {n: _full(p.grad) for n, p in model.named_parameters()}))
    return grads


class Counting:
    """Records the shapes of the matrices this process orthogonalised (a stacked call
    counts each matrix of its stack)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, int]] = []
        self.inner = sharded_muon.newton_schulz

    def __call__(self, update, *args, **kwargs):
        stack = update if update.ndim == 3 else update[None]
        self.shapes.extend([tuple(update.shape[-2:])] * len(stack))
        return self.inner(update, *args, **kwargs)


def _train(name: str, world: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from accelfn import checkpointing

    build, _, tp = ALL[name]
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = build()
    opts = optimizers(model)
    scheds = schedulers(opts)
    state = af.TrainState(model, opts, scheduler=scheds)
    step = build_step(name)
    hooks = {"pre": 0, "post": 0}
    opts[0].register_step_pre_hook(lambda *a: hooks.__setitem__("pre", hooks["pre"] + 1))
    opts[0].register_step_post_hook(lambda *a: hooks.__setitem__("post", hooks["post"] + 1))
    grads = record_grads(model, opts[0])
    rows = SHARDS[world // tp][rank // tp]
    counting = Counting()
    sharded_muon.newton_schulz = counting
    norms, rates, calls = [], [], []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(STEPS):
                before = len(counting.shapes)
                metrics = step(state, {k: v[rows] for k, v in global_batch(i).items()})
                calls.append(counting.shapes[before:])
                norms.append(metrics["grad_norm"].clone())
                rates.append({k: float(v) for k, v in metrics.items() if k.startswith("lr")})
    finally:
        sharded_muon.newton_schulz = counting.inner
    muon_state = opts[0].state_dict()
    out = {"params": {n: _full(p) for n, p in model.named_parameters()}, "grads": grads,
           "optimizers": optimizer_states(model, opts), "norms": norms, "rates": rates,
           "calls": calls, "hooks": hooks, "last_epochs": [s.last_epoch for s in scheds],
           "warnings": [str(w.message) for w in caught if "optimizer.step()" in str(w.message)],
           "muon_state_keys": sorted({k for s in muon_state["state"].values() for k in s}),
           "muon_groups": [len(g["params"]) for g in muon_state["param_groups"]],
           "sharded": all(hasattr(p, "full_tensor") for p in model.parameters())}
    if name == SAVED:
        checkpointing.save(os.path.join(out_dir, "checkpoint"), state, step=step)
    return out


def _refuse_a_vector(world: int) -> dict:
    """A Muon given a bias through add_param_group (its constructor would refuse it)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = OddNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    vector = model.blocks[1].fc1.bias
    named = [(n, p) for n, p in model.named_parameters() if p is not vector]
    opts = [torch.optim.Muon([p for n, p in named if matrix(n, p)], lr=0.05),
            torch.optim.AdamW([p for n, p in named if not matrix(n, p)], lr=1e-2)]
    opts[0].add_param_group({"params": [vector]})
    state = af.TrainState(model, opts)
    step = af.distributed(strategy="fsdp")(classify)
    error = None
    try:
        step(state, {k: v[SHARDS[world][dist.get_rank()]] for k, v in global_batch(0).items()})
    except ValueError as exc:
        error = str(exc)
    params = dict(model.named_parameters())
    return {"error": error, "step": state.step, "stepped": "step" in vars(opts[0]),
            "unchanged": all(type(params[n]) is nn.Parameter and torch.equal(params[n], v)
                             for n, v in before.items())}


def _resume_in_hsdp(checkpoints: str) -> dict:
    """The 2-process FSDP2 checkpoint, loaded by HSDP 2x2, then one more update."""
    import torch.distributed as dist

    from accelfn import checkpointing

    torch.manual_seed(1)  # other weights: all must come from the checkpoint
    model = OddNet()
    opts = optimizers(model)
    state = af.TrainState(model, opts, scheduler=schedulers(opts))
    step = build_step("hsdp")
    checkpointing.load(os.path.join(checkpoints, "checkpoint"), state, step=step,
                       allow_resharding=True)
    loaded = {n: _full(p) for n, p in model.named_parameters()}
    grads = record_grads(model, opts[0])
    rows = SHARDS[4][dist.get_rank()]
    metrics = step(state, {k: v[rows] for k, v in global_batch(STEPS).items()})
    return {"loaded": loaded, "after": {n: _full(p) for n, p in model.named_parameters()},
            "step": state.step, "norm": metrics["grad_norm"].clone(), "grads": grads,
            "optimizers": optimizer_states(model, opts)}


def worker(out_dir: str, checkpoints: str | None) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    af.init_distributed()
    world = dist.get_world_size()
    results: dict = {name: _train(name, world, out_dir) for name in CASES[world]}
    if world == 2:
        results["refused"] = _refuse_a_vector(world)
    if checkpoints is not None:
        results["resumed"] = _resume_in_hsdp(checkpoints)
    save_rank_results(out_dir, results)


# ------------------------------------------------------------------------------ one process


@pytest.mark.parametrize("shape", [(30, 10), (10, 30), (12, 12), (3, 10)])
def test_newton_schulz_is_torchs_bitwise_alone_and_stacked(shape):
    private = pytest.importorskip("torch.optim._muon")
    gen = torch.Generator().manual_seed(0)
    stack = [torch.randn(*shape, generator=gen) * scale for scale in (1.0, 1e-3, 50.0)]
    coefficients = (3.4445, -4.7750, 2.0315)
    want = [private._zeropower_via_newtonschulz(g, coefficients, 5, 1e-7) for g in stack]
    got = sharded_muon.newton_schulz(stack[0], coefficients, 5, 1e-7)
    assert got.dtype == want[0].dtype == torch.bfloat16 and torch.equal(got, want[0])
    # a stack of equal matrices (one batched iteration): each as if alone, bitwise
    stacked = sharded_muon.newton_schulz(torch.stack(stack), coefficients, 5, 1e-7)
    for got, expected in zip(stacked.unbind(0), want):
        assert torch.equal(got, expected)


def test_the_sharded_step_is_torchs_muon_step_with_its_hooks_and_scheduler():
    # whole tensors (one process, no process group): every matrix is orthogonalised where it
    # is, through the replaced step; a scheduler made before and one made after see it step
    twins = []
    for replace in (False, True):
        torch.manual_seed(0)
        model = OddNet()
        opts = optimizers(model)
        before = LambdaLR(opts[0], lambda s: 1.0 / (1 + s))
        calls = []
        opts[0].register_step_post_hook(lambda *a, calls=calls: calls.append(1))
        if replace:
            sharded_muon.shard_muon(opts)
            step = opts[0].step
            sharded_muon.shard_muon(opts)  # once per optimizer
            assert opts[0].step is step
        after = LambdaLR(opts[0], lambda s: 0.5 ** s)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()"
            for i in range(STEPS):
                classify(model, global_batch(i))["loss"].backward()
                for optimizer in opts:
                    optimizer.step()
                before.step()
                after.step()
                for optimizer in opts:
                    optimizer.zero_grad(set_to_none=True)
        assert len(calls) == STEPS
        twins.append((model, opts))
    (plain, plain_opts), (model, opts) = twins
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert repr(opts[0].state_dict()) == repr(plain_opts[0].state_dict())


def test_a_muon_over_a_vector_is_refused_by_every_strategy_naming_it():
    from accelfn.parts.distributed.fsdp import check_optimizers, parameter_names

    model = OddNet()
    opts = optimizers(model)
    check_optimizers(tuple(opts), "fsdp", 1)  # matrices only: accepted
    opts[0].add_param_group({"params": [model.head.bias]})
    for strategy, tp in (("ddp", 1), ("fsdp", 1), ("hsdp", 1), ("fsdp", 2)):
        with pytest.raises(ValueError, match=r"optimizer 0 \(torch.optim.Muon\) holds "
                           r"'head.bias' of shape \(4,\).*2-D matrices only.*AdamW"):
            check_optimizers(tuple(opts), strategy, tp, parameter_names(model))


# ------------------------------------------------------------------------------ torchrun


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon2")
    return out, torchrun_results(__file__, out, timeout=300, nproc=2)


@pytest.fixture(scope="module")
def four(tmp_path_factory, two):
    from helpers import torchrun

    out = tmp_path_factory.mktemp("muon4")
    torchrun(__file__, out, two[0], timeout=600, nproc=4)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(4)]


def results_of(case: str, two, four) -> list[dict]:
    return [r[case] for r in (two[1] if case in CASES[2] else four)]


def reference(build, grads: list[dict]) -> dict:
    """One process, plain PyTorch: torch.optim.Muon and AdamW on the concatenated rows of
    every rank: backward, clip over all the parameters, step each optimizer and scheduler,
    clear. Each update's clipped gradient is checked against the one the sharded run applied
    (``grads``: within 1e-5) and replaced by it: Newton-Schulz runs in bfloat16 and amplifies
    a one-ulp difference of its input (a gradient summed in another order rounding the other
    way) to about 1e-3 in the update, so the optimizers are compared on the same gradients,
    and the gradients on the same parameters."""
    torch.manual_seed(0)
    model = build()
    opts = optimizers(model)
    scheds = schedulers(opts)
    norms, rates = [], []
    for i, recorded in enumerate(grads):
        rates.append([o.param_groups[0]["lr"] for o in opts])
        classify(model, global_batch(i))["loss"].backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        for name, p in model.named_parameters():
            torch.testing.assert_close(recorded[name], p.grad, atol=1e-5, rtol=1e-5,
                                       msg=f"update {i}: the gradient of {name}")
            p.grad.copy_(recorded[name])
        for optimizer in opts:
            optimizer.step()
        for scheduler in scheds:
            scheduler.step()
        for optimizer in opts:
            optimizer.zero_grad(set_to_none=True)
    return {"model": model, "opts": opts, "norms": norms, "rates": rates,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "optimizers": optimizer_states(model, opts)}


def assert_states_close(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name, values in expected.items():
        assert got[name].keys() == values.keys(), (what, name)
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                assert got[name][key].shape == value.shape, (what, name, key)
                torch.testing.assert_close(got[name][key], value, atol=1e-5, rtol=1e-5,
                                           msg=f"{what} {name} {key}")
            else:
                assert got[name][key] == value, (what, name, key)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(ALL))
def test_sharded_muon_and_adamw_equal_one_process_on_every_ranks_rows(two, four, case):
    for rank, got in enumerate(results_of(case, two, four)):
        expected = reference(ALL[case][0], got["grads"])
        assert got["sharded"], f"{case} rank {rank}: the model was not sharded"
        for name, value in expected["params"].items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-5,
                                       msg=f"{case} rank {rank} {name}")
        # the momentum buffers (whole: DTensors sharded as their parameters) and AdamW's
        assert_states_close(got["optimizers"], expected["optimizers"], f"{case} rank {rank}")
        for norm, want in zip(got["norms"], expected["norms"]):
            torch.testing.assert_close(norm, want, atol=1e-5, rtol=1e-5)
            assert want > MAX_NORM
        for used, (lr0, lr1) in zip(got["rates"], expected["rates"]):
            assert used["lr/muon"] == pytest.approx(lr0) and used["lr/adamw"] == pytest.approx(lr1)
        assert got["last_epochs"] == [STEPS, STEPS]


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(ALL))
def test_each_matrix_is_orthogonalised_once_per_replica_by_owners_balanced_by_cost(
        two, four, case):
    got = results_of(case, two, four)
    shapes = sorted(tuple(p.shape) for n, p in ALL[case][0]().named_parameters()
                    if matrix(n, p))
    largest = max(sharded_muon._cost(s) for s in shapes)
    for i in range(STEPS):
        done = [[tuple(s) for s in r["calls"][i]] for r in got]
        assert sorted(s for mine in done for s in mine) == sorted(shapes * REPLICAS[case]), (
            case, done)
        # the largest first to the least loaded: no owner a whole matrix above another
        loads = [sum(sharded_muon._cost(s) for s in mine) for mine in done]
        assert max(loads) - min(loads) <= largest, (case, loads)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(ALL))
def test_the_optimizer_stays_torchs_muon_with_its_hooks_state_and_scheduler(two, four, case):
    for got in results_of(case, two, four):
        assert got["hooks"] == {"pre": STEPS, "post": STEPS}  # torch's step hooks ran
        assert got["warnings"] == []  # the scheduler saw optimizer.step() called first
        assert got["muon_state_keys"] == ["momentum_buffer"]  # one-process Muon's state_dict
        assert got["muon_groups"] == [sum(1 for n, p in ALL[case][0]().named_parameters()
                                          if matrix(n, p))]


@pytest.mark.distributed
def test_a_two_process_checkpoint_loads_into_one_plain_muon_and_continues_equal(two):
    from accelfn import checkpointing

    out, results = two
    torch.manual_seed(1)  # other weights: all must come from the checkpoint
    model = OddNet()
    opts = optimizers(model)
    state = af.TrainState(model, opts, scheduler=schedulers(opts))
    step = build_step(SAVED)  # one process: distributed is a no-op; torch's own Muon.step
    checkpointing.load(out / "checkpoint", state, step=step, allow_resharding=True)
    assert state.step == STEPS
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), results[0][SAVED]["params"][name]), name
    assert_states_close(optimizer_states(model, opts), results[0][SAVED]["optimizers"],
                        "loaded")
    grads = record_grads(model, opts[0])
    metrics = step(state, global_batch(STEPS))
    expected = reference(OddNet, results[0][SAVED]["grads"] + grads)
    torch.testing.assert_close(metrics["grad_norm"], expected["norms"][-1], atol=1e-5,
                               rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected["params"][name], atol=1e-5, rtol=1e-5,
                                   msg=name)
    assert_states_close(optimizer_states(model, opts), expected["optimizers"], "continued")


@pytest.mark.distributed
def test_a_two_process_checkpoint_resumes_in_hsdp_over_four_and_continues_equal(two, four):
    for rank in range(4):
        got = four[rank]["resumed"]
        expected = reference(OddNet, two[1][0][SAVED]["grads"] + got["grads"])
        assert got["step"] == STEPS + 1
        for name in expected["params"]:
            assert torch.equal(got["loaded"][name], two[1][0][SAVED]["params"][name]), name
            torch.testing.assert_close(got["after"][name], expected["params"][name],
                                       atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")
        torch.testing.assert_close(got["norm"], expected["norms"][-1], atol=1e-5, rtol=1e-5)
        assert_states_close(got["optimizers"], expected["optimizers"], f"resumed {rank}")


@pytest.mark.distributed
def test_muon_over_a_1d_parameter_is_refused_naming_it_before_anything_changes(two):
    for rank in range(2):
        got = two[1][rank]["refused"]
        assert got["error"] is not None, f"rank {rank}: not refused"
        assert "'blocks.1.fc1.bias'" in got["error"] and "(30,)" in got["error"]
        assert "2-D matrices only" in got["error"] and "AdamW" in got["error"]
        assert got["unchanged"] and got["step"] == 0 and not got["stepped"]


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
