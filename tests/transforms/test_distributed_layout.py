"""distributed's layouts, plans and refusals in one process (no process group needed).

The mesh's shape is a function of the strategy and the world size
(``accelfn.parts.distributed.mesh.layout``), and a tensor-parallel plan is resolved
against the model alone (``plans.resolve_plan``): both are checked here with made-up world
sizes. tests/transforms/test_distributed_scale_out.py runs them in 4 processes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import MLPBlock, MLPNet, Net, classify, make_batch
from test_distributed_scale_out import tp_plan
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import accelfn as af
from accelfn.parts.distributed.fsdp import check_optimizers
from accelfn.parts.distributed.mesh import layout
from accelfn.parts.distributed.plans import resolve_plan


# ------------------------------------------------------------------------------ layouts
@pytest.mark.parametrize("strategy, world, options, shape, names", [
    ("fsdp", 4, {}, (4,), ("dp",)),
    ("fsdp", 4, {"tp": 2}, (2, 2), ("dp", "tp")),
    ("fsdp", 8, {"tp": 4}, (2, 4), ("dp", "tp")),
    ("hsdp", 4, {"replicate": 2}, (2, 2), ("replicate", "shard")),
    ("hsdp", 8, {"replicate": 4}, (4, 2), ("replicate", "shard")),
    ("hsdp", 8, {"replicate": 2, "tp": 2}, (2, 2, 2), ("replicate", "shard", "tp")),
    ("hsdp", 16, {"local_world": 8}, (2, 8), ("replicate", "shard")),  # a replica per node
    ("hsdp", 16, {"local_world": 8, "tp": 2}, (2, 4, 2), ("replicate", "shard", "tp")),
])
def test_the_mesh_shape_follows_the_strategy_and_the_world(strategy, world, options, shape,
                                                           names):
    grid = layout(strategy, world, **options)
    assert grid.shape == shape and grid.names == names
    assert grid.replicate * grid.shard * grid.tp == world
    assert grid.data_parallel == world // grid.tp


def test_ddp_keeps_whole_copies_on_every_process():
    grid = layout("ddp", 4)
    assert (grid.replicate, grid.shard, grid.tp, grid.data_parallel) == (4, 1, 1, 4)


@pytest.mark.parametrize("strategy, world, options, words", [
    ("hsdp", 4, {"replicate": 3}, ["replicate=3", "4 process", "[1, 2, 4]"]),
    ("hsdp", 6, {"replicate": 2, "tp": 2}, ["replicate=2 x tp=2", "6 process"]),
    ("fsdp", 4, {"tp": 3}, ["tp=3", "4 process", "[1, 2, 4]"]),
    ("hsdp", 12, {"local_world": 8}, ["per node", "replicate=R"]),
])
def test_a_world_the_layout_does_not_tile_is_refused_with_the_fix(strategy, world, options,
                                                                  words):
    with pytest.raises(ValueError) as error:
        layout(strategy, world, **options)
    for word in words:
        assert word in str(error.value), str(error.value)


# -------------------------------------------------------------------------------- plans
def test_a_plan_resolves_to_the_modules_its_patterns_name_in_model_order():
    model = MLPNet()
    resolved = resolve_plan(model, {"blocks.*.down": RowwiseParallel(),
                                    "blocks.*.up": ColwiseParallel()}, tp=2)
    assert list(resolved) == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]
    assert isinstance(resolved["blocks.1.up"], ColwiseParallel)
    # SequenceParallel shards activations, no weight: any module, no width to check
    assert list(resolve_plan(model, {"blocks.*.norm": SequenceParallel()}, tp=3)) == [
        "blocks.0.norm", "blocks.1.norm"]


def test_a_plan_names_the_models_own_modules_under_checkpointed():
    """checkpointed hands the step its model itself (the blocks wrapped in place): the
    patterns name the model's modules, as without it."""
    model = MLPNet()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    prepared = af.checkpointed(blocks=(MLPBlock,))(classify).prepare(state).model
    assert prepared is model
    resolved = resolve_plan(prepared, {"blocks.*.up": ColwiseParallel()}, tp=2)
    assert list(resolved) == ["blocks.0.up", "blocks.1.up"]


@pytest.mark.parametrize("plan, tp, words", [
    ({"layers.*.up": ColwiseParallel()}, 2, ["'layers.*.up' names no module", "'blocks.0.up'"]),
    ({"blocks.*.up": ColwiseParallel()}, 3, ["out_features=32", "tp=3"]),
    ({"blocks.*.down": RowwiseParallel()}, 5, ["in_features=32", "tp=5"]),
    ({"blocks.*": ColwiseParallel()}, 2, ["nn.Linear and nn.Embedding", "MLPBlock"]),
    ({"blocks.0.up": ColwiseParallel(), "blocks.*.up": ColwiseParallel()}, 2,
     ["named by both"]),
])
def test_a_plan_naming_no_module_or_an_indivisible_width_is_refused(plan, tp, words):
    with pytest.raises(ValueError) as error:
        resolve_plan(MLPNet(), plan, tp)
    for word in words:
        assert word in str(error.value), str(error.value)


@pytest.mark.parametrize("plan, error", [
    ({}, ValueError), ([("blocks.*.up", ColwiseParallel())], ValueError),
    ({"blocks.*.up": ColwiseParallel}, TypeError), ({"blocks.*.up": "colwise"}, TypeError),
    ({3: ColwiseParallel()}, TypeError),
])
def test_a_plan_that_is_not_patterns_to_parallel_styles_is_refused_when_built(plan, error):
    with pytest.raises(error, match="tensor_parallel"):
        af.distributed(strategy="fsdp", tp=2, tensor_parallel=plan)


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize("options, words", [
    ({"strategy": "fsdp", "tp": 2}, ["tensor_parallel=plan"]),
    ({"strategy": "fsdp", "tensor_parallel": {"up": ColwiseParallel()}}, ["tp=k > 1"]),
    ({"tp": 2, "tensor_parallel": {"up": ColwiseParallel()}}, ["FSDP2 option", "'fsdp'"]),
    ({"offload": "cpu"}, ["offload", "FSDP2 option"]),
    ({"reshard_after_forward": False}, ["reshard_after_forward", "FSDP2 option"]),
    ({"strategy": "fsdp", "replicate": 2}, ["replicate=2", "strategy='hsdp'"]),
    ({"strategy": "hsdp", "replicate": 0}, ["replicate=0", ">= 1"]),
    ({"strategy": "fsdp", "tp": 0}, ["tp=0"]),
    ({"strategy": "fsdp", "offload": "nvme"}, ["offload='nvme'"]),
    ({"strategy": "fsdp", "reshard_after_forward": 1}, ["reshard_after_forward=1"]),
    ({"strategy": "hsdp", "compression": "bf16"}, ["DDP option"]),
    ({"strategy": "zero"}, ["strategy='zero') is unknown", "ZeroRedundancyOptimizer"]),
])
def test_options_that_do_not_go_together_are_refused_when_built(options, words):
    with pytest.raises(ValueError) as error:
        af.distributed(**options)
    for word in words:
        assert word in str(error.value), str(error.value)


def test_the_label_names_the_layout_and_equal_plans_give_equal_transforms():
    t = af.distributed(strategy="hsdp", replicate=2, offload="cpu")
    assert repr(t) == "distributed(hsdp, replicate=2, offload=cpu)"
    a = af.distributed(strategy="fsdp", tp=2, tensor_parallel=tp_plan())
    b = af.distributed(strategy="fsdp", tp=2, tensor_parallel=tp_plan())  # built apart
    assert a == b and repr(a) == "distributed(fsdp, tp=2)"
    c = af.distributed(strategy="fsdp", tp=2, tensor_parallel={
        "blocks.*.up": ColwiseParallel(use_local_output=False),
        "blocks.*.down": RowwiseParallel()})
    assert a != c


# ----------------------------------------------------------------------- one process
@pytest.mark.parametrize("options", [
    {"strategy": "hsdp", "replicate": 2},
    {"strategy": "fsdp", "offload": "cpu", "reshard_after_forward": False},
    {"strategy": "fsdp", "tp": 2, "tensor_parallel": tp_plan()},
])
def test_in_one_process_every_strategy_is_a_no_op(options):
    torch.manual_seed(0)
    base = MLPNet()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    s1 = af.TrainState(m1, torch.optim.SGD(m1.parameters(), lr=0.1))
    step = af.with_clipping(max_norm=0.05)(af.with_accumulation(2)(
        af.distributed(**options)(classify)))
    step(s1, make_batch())
    assert step.prepare(s1).model is m1 and step.prepare(s1).process_group is None
    s2 = af.TrainState(m2, torch.optim.SGD(m2.parameters(), lr=0.1))
    af.with_clipping(max_norm=0.05)(af.with_accumulation(2)(classify))(s2, make_batch())
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_a_bad_plan_is_refused_in_one_process_too_before_anything_changes():
    torch.manual_seed(0)
    model = MLPNet()
    before = copy.deepcopy(model.state_dict())
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.distributed(strategy="fsdp", tp=3, tensor_parallel=tp_plan())(classify)
    with pytest.raises(ValueError, match="out_features=32"):
        step(state, make_batch())  # found on a laptop, not on the cluster
    assert state.step == 0 and not state.preparations
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def _muon_and_adamw(model: nn.Module) -> tuple[torch.optim.Optimizer, ...]:
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and "blocks" in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "blocks" in n)]
    return torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)


def test_muon_with_ddp_is_accepted():
    check_optimizers(_muon_and_adamw(Net()), "ddp", 1)


# ------------------------------------------------------------------------------ orders
@pytest.mark.parametrize("options", [
    {"strategy": "hsdp", "replicate": 2},
    {"strategy": "fsdp", "tp": 2, "tensor_parallel": {"blocks.*.up": ColwiseParallel()}},
    {"strategy": "hsdp", "replicate": 2, "tp": 2,
     "tensor_parallel": {"blocks.*.up": ColwiseParallel()}},
    {"strategy": "fsdp", "offload": "cpu", "reshard_after_forward": False},
], ids=["hsdp", "fsdp_tp", "hsdp_tp", "fsdp_offload"])
def test_every_stacking_order_with_the_other_builtins_builds_the_same_update(options):
    """The scale-out strategies fill the one Sharding place, as DDP and FSDP do: all 120
    orders with with_amp, with_accumulation, with_clipping and checkpointed build the same
    update (tests/transforms/test_distributed_scale_out.py trains one order in 4 processes)."""
    import dataclasses
    import itertools

    registry = {"distributed": af.distributed(**options), "amp": af.with_amp(),
                "accumulation": af.with_accumulation(2), "clipping": af.with_clipping(),
                "checkpointed": af.checkpointed()}

    def stack(names):
        step = classify
        for name in names:
            step = registry[name](step)
        return step

    reference = stack(list(registry))
    places = [f.name for f in dataclasses.fields(reference.spec)]
    assert reference.spec.sharding is not None
    orders = list(itertools.permutations(registry))
    assert len(orders) == 120
    for order in orders:
        step = stack(order)
        for place in places:
            assert getattr(step.spec, place) is getattr(reference.spec, place), (order, place)
        assert set(step.transforms) == set(reference.transforms), order
