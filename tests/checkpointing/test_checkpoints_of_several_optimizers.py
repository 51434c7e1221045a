"""A TrainState with several optimizers (Muon for the hidden matrices, AdamW for the rest),
each with its own scheduler: saved and resumed exactly, whole and sharded (DCP); a checkpoint
of another number of optimizers, another order or other schedulers refused before anything
changes; the one-optimizer format unchanged (a checkpoint written before several optimizers
existed still loads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import (
    assert_unchanged,
    counter,
    dataset,
    noisy,
    run,
    scramble_rngs,
    setup,
    snapshot,
)
from helpers import Net

import accelfn as af
from accelfn import checkpointing as ckpt
from accelfn import data

FORMATS = pytest.mark.parametrize("sharded", [False, True], ids=["plain", "dcp"])
LEGACY = Path(__file__).parent / "data" / "one-optimizer" / "step-000000003"


def _muon_rate(t: int) -> float:
    return 1.0 / (1.0 + 0.5 * t)


def _adamw_rate(t: int) -> float:
    return 0.8 ** t


def build(seed: int = 0, *, order: str = "muon,adamw", schedulers: str = "both",
          moved: bool = False, first: str = "muon"):
    """Net trained by Muon (its 2-D weights) and AdamW (the rest), each with a LambdaLR.

    ``order``: the optimizers' order; ``schedulers``: "both", "first" (the second has None);
    ``moved``: the head's weight goes to AdamW; ``first``: "sgd" for a stateless SGD instead
    of Muon."""
    torch.manual_seed(seed)
    model = Net()
    named = list(model.named_parameters())
    hidden = [p for n, p in named if p.dim() == 2 and not (moved and n == "head.weight")]
    rest = [p for n, p in named if not any(p is h for h in hidden)]
    one = (torch.optim.Muon(hidden, lr=0.02, momentum=0.9) if first == "muon"
           else torch.optim.SGD(hidden, lr=0.05))
    two = torch.optim.AdamW(rest, lr=1e-2)
    optimizers = [one, two] if order == "muon,adamw" else [two, one]
    rates = {id(one): _muon_rate, id(two): _adamw_rate}
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, rates[id(o)]) for o in optimizers]
    if schedulers == "first":
        scheds[1] = None
    state = af.TrainState(model, optimizers, scheduler=scheds)
    loader = data.loader(dataset(), batch_size=4, seed=1)
    step = af.with_clipping(max_norm=1.0)(af.apply_transform(noisy, counter()))
    step.prepare(state)
    return state, loader, step


def _same_state(a: af.TrainState, b: af.TrainState) -> None:
    for x, y in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(x, y)
    for oa, ob in zip(a.optimizers, b.optimizers):
        sa, sb = oa.state_dict(), ob.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert sa["state"].keys() == sb["state"].keys()
        for k in sa["state"]:
            for key, value in sa["state"][k].items():
                other = sb["state"][k][key]
                assert torch.equal(value, other) if isinstance(value, torch.Tensor) \
                    else value == other
    assert [s.state_dict() if s else None for s in a.schedulers] == \
        [s.state_dict() if s else None for s in b.schedulers]


@FORMATS
def test_muon_and_adamw_with_their_schedules_resume_exactly(tmp_path, sharded):
    state, loader, step = build()
    it = iter(loader)
    run(state, it, step, 3)
    path = ckpt.save(tmp_path, state, loader=loader, step=step, sharded=sharded)
    expected = run(state, it, step, 4)

    fresh, fresh_loader, fresh_step = build(seed=1)
    scramble_rngs()
    info = ckpt.load(tmp_path, fresh, loader=fresh_loader, step=fresh_step)
    assert info.path == path and info.step == 3 and info.sharded == sharded
    assert {"model", "optimizer", "scheduler", "step", "data"} <= set(info.restored)
    assert [s.last_epoch for s in fresh.schedulers] == [3, 3]
    got = run(fresh, iter(fresh_loader), fresh_step, 4)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))  # bitwise
    _same_state(state, fresh)
    assert fresh.step == state.step == 7


def test_the_metadata_records_each_optimizer_and_its_scheduler(tmp_path):
    state, loader, step = build()
    run(state, iter(loader), step, 1)
    path = ckpt.save(tmp_path, state, step=step)
    meta = json.loads((path / "meta.json").read_text())
    assert [o["class"] for o in meta["optimizer"]] == ["Muon", "AdamW"]
    assert meta["scheduler"] == ["LambdaLR", "LambdaLR"]
    names = {n for n, p in state.model.named_parameters() if p.dim() == 2}
    assert {n for g in meta["optimizer"][0]["names"] for n in g} == names
    saved = torch.load(path / "state.pt", weights_only=True)["state"]
    assert isinstance(saved["optimizer"], list) and len(saved["optimizer"]) == 2
    assert isinstance(saved["scheduler"], list) and len(saved["scheduler"]) == 2


@FORMATS
@pytest.mark.parametrize("saved_with", ["two", "one"])
def test_a_checkpoint_of_another_number_of_optimizers_is_refused_before_anything_changes(
        tmp_path, sharded, saved_with):
    writer, other = (build, setup) if saved_with == "two" else (setup, build)
    state, loader, step = writer()
    run(state, iter(loader), step, 2)
    path = ckpt.save(tmp_path, state, loader=loader, step=step, sharded=sharded)
    fresh, fresh_loader, _ = other(seed=1)
    before = snapshot(fresh)
    n, m = (2, 1) if saved_with == "two" else (1, 2)
    with pytest.raises(ckpt.CheckpointError, match=rf"the checkpoint holds {n} optimizer\(s\) "
                                                   rf".*this state {m}.*same order"):
        ckpt.load(path, fresh, loader=fresh_loader)
    assert_unchanged(before, fresh)


@pytest.mark.parametrize("how, match", [
    ("order", r"optimizer 0 is Muon .* this state's optimizer 0 is AdamW"),
    ("moved", r"optimizer 0 is Muon with parameter groups of sizes \[8\], this state's "
              r"optimizer 0 is Muon with \[7\]"),
    ("schedulers", r"the checkpoint's scheduler of optimizer 1 is LambdaLR, this state's is "
                   r"None"),
    ("stateless", r"optimizer 0 is Muon .* this state's optimizer 0 is SGD"),
])
def test_other_optimizers_or_schedulers_are_refused_naming_which(tmp_path, how, match):
    state, loader, step = build()
    run(state, iter(loader), step, 2)
    path = ckpt.save(tmp_path, state, loader=loader, step=step)
    options = {"order": {"order": "adamw,muon"}, "moved": {"moved": True},
               "schedulers": {"schedulers": "first"}, "stateless": {"first": "sgd"}}[how]
    fresh, fresh_loader, fresh_step = build(seed=1, **options)
    before = snapshot(fresh)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load(path, fresh, loader=fresh_loader, step=fresh_step)
    assert_unchanged(before, fresh)


@FORMATS
def test_a_stateless_optimizer_beside_a_stateful_one_resumes_exactly(tmp_path, sharded):
    # SGD without momentum keeps no state: with DCP only AdamW's state is sharded
    state, loader, step = build(first="sgd")
    it = iter(loader)
    run(state, it, step, 2)
    assert not state.optimizers[0].state and state.optimizers[1].state
    ckpt.save(tmp_path, state, loader=loader, step=step, sharded=sharded)
    expected = run(state, it, step, 3)
    fresh, fresh_loader, fresh_step = build(seed=1, first="sgd")
    ckpt.load(tmp_path, fresh, loader=fresh_loader, step=fresh_step)
    assert not fresh.optimizers[0].state  # loading made no state for it
    got = run(fresh, iter(fresh_loader), fresh_step, 3)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    _same_state(state, fresh)


# ------------------------------------------------------------------------- one optimizer
def test_the_one_optimizer_format_is_unchanged(tmp_path):
    """A checkpoint written before several optimizers existed (tests/checkpointing/data, by
    checkpoint_helpers.setup() after 3 steps) loads, and saving the loaded state again
    writes the same layout: "optimizer" and "scheduler" are one optimizer's, not lists."""
    legacy = tmp_path / "legacy" / LEGACY.name
    shutil.copytree(LEGACY, legacy)
    saved = torch.load(legacy / "state.pt", weights_only=True)
    fresh, loader, _ = setup(seed=1)
    info = ckpt.load(legacy, fresh, loader=loader)  # step=None: the stack is not compared
    assert info.step == 3 and info.extra == {"written_by": "accelfn before several optimizers"}
    for name, tensor in fresh.model.state_dict().items():
        assert torch.equal(tensor, saved["state"]["model"][name])
    assert repr(fresh.optimizer.state_dict()) == repr(saved["state"]["optimizer"])
    assert fresh.scheduler.state_dict() == saved["state"]["scheduler"]

    again = ckpt.save(tmp_path / "again", fresh, loader=loader)
    old_meta = json.loads((legacy / "meta.json").read_text())
    new_meta = json.loads((again / "meta.json").read_text())
    assert set(new_meta) == set(old_meta)
    for key in ("format", "step", "world_size", "sharded", "optimizer_sharded", "model",
                "optimizer", "scheduler", "loader"):
        assert new_meta[key] == old_meta[key], key
    resaved = torch.load(again / "state.pt", weights_only=True)
    assert set(resaved) == set(saved) and set(resaved["state"]) == set(saved["state"])
    assert repr(resaved["state"]["optimizer"]) == repr(saved["state"]["optimizer"])
    assert resaved["state"]["scheduler"] == saved["state"]["scheduler"]
