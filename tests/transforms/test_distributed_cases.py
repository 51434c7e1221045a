"""distributed: further 2-process (gloo, CPU) cases against the single-process reference.

The module is also the torchrun worker: ``python -m torch.distributed.run --nproc_per_node=2
test_distributed_cases.py OUT`` runs every case of WORKER_CASES on both ranks and saves what
each rank saw in ``OUT/rank<r>.pt``; the tests compare it with one process training on the
concatenated batches.
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

from dist_worker import RANK_ROWS, STEPS, global_batch  # noqa: E402
from helpers import Net, classify, torchrun  # noqa: E402
from reference import reference_update  # noqa: E402

import accelfn as af  # noqa: E402

CALLS = 4  # with_accumulation(3, mode="calls"): one full window, then a flushed one of 1


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
            for name, p in model.named_parameters()}


def _calls_flush(strategy: str, fsdp_sync: str = "every") -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    step = af.with_accumulation(3, mode="calls")(
        af.distributed(strategy=strategy, fsdp_sync=fsdp_sync)(classify))
    rank = dist.get_rank()
    error = None
    for i in range(CALLS):
        step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(i).items()})
    try:
        step.flush(state)
    except ValueError as exc:
        error = str(exc)
    return {"params": _full(model), "error": error}


def _static_graph_accumulation() -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    step = af.distributed(static_graph=True)(af.with_accumulation(3)(classify))
    rank = dist.get_rank()
    try:
        for i in range(STEPS):
            step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(i).items()})
    except RuntimeError as exc:  # torch's DDP: static_graph asserts under no_sync
        return {"params": _full(model), "error": str(exc)[:500]}
    return {"params": _full(model), "error": None}


def _ema_fsdp_state() -> tuple[af.TrainState, af.Step]:
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return state, af.with_ema(decay=0.5)(af.distributed(strategy="fsdp")(classify))


def _full_ema(state: af.TrainState) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
            for k, v in af.ema_state_dict(state).items()}


def _ema_fsdp(out_dir: str) -> dict:
    """with_ema over FSDP2: the average of the sharded parameters, seen inside ema_weights
    and through ema_state_dict, and the model's own weights back after the block; saved
    (sharded, synchronously and in the background) and loaded into a fresh state."""
    import torch.distributed as dist

    from accelfn import checkpointing

    state, step = _ema_fsdp_state()
    rank = dist.get_rank()
    for i in range(STEPS):
        step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(i).items()})
    own = _full(state.model)
    error = None
    inside: dict[str, torch.Tensor] = {}
    try:
        with af.ema_weights(state) as averaged:
            inside = _full(averaged)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    exported = _full_ema(state)
    loaded, save_error = [], None
    for asynchronous in (False, True):
        where = os.path.join(out_dir, f"ema-{asynchronous}")
        try:
            pending = checkpointing.save(where, state, step=step, asynchronous=asynchronous)
            if asynchronous:
                pending.wait()
            fresh, fresh_step = _ema_fsdp_state()
            checkpointing.load(where, fresh, step=fresh_step)
            loaded.append({"ema": _full_ema(fresh), "params": _full(fresh.model),
                           "n": fresh.slots["with_ema"].n_averaged.clone()})
        except Exception as exc:
            save_error = f"{type(exc).__name__}: {exc}"[:800]
            break
    return {"own": own, "inside": inside, "after": _full(state.model), "exported": exported,
            "n": state.slots["with_ema"].n_averaged.clone(), "loaded": loaded,
            "error": error, "save_error": save_error}


def clamped_token_loss(model, batch):
    """The masked mean over valid tokens that docs/reliability.md recommends: divided by the
    count clamped to 1, so an all-padding batch has a zero gradient."""
    import torch.nn.functional as F

    per = F.cross_entropy(model(batch["x"]), batch["y"], reduction="none")
    mask = batch["mask"].float()
    tokens = mask.sum()
    return {"loss": (per * mask).sum() / tokens.clamp(min=1), "weight": tokens}


def padded_batch(step: int) -> dict:
    """``global_batch(step)`` with every row of rank 1 padding (no valid token)."""
    batch = global_batch(step)
    batch["mask"][RANK_ROWS[1]] = False
    return batch


def _zero_tokens(strategy: str, accumulate: bool) -> dict:
    """Rank 1's rows are all padding: the update is rank 0's rows' alone, not skipped."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    inner = af.with_accumulation(2)(clamped_token_loss) if accumulate else clamped_token_loss
    step = af.distributed(strategy=strategy)(inner)
    rank = dist.get_rank()
    skipped, losses = [], []
    for i in range(STEPS):
        metrics = step(state, {k: v[RANK_ROWS[rank]] for k, v in padded_batch(i).items()})
        skipped.append(float(metrics["skipped"]))
        losses.append(float(metrics["loss"]))
    return {"params": _full(model), "skipped": skipped, "losses": losses}


FROZEN_STEPS = 1  # updates with the blocks frozen, then STEPS with them unfrozen


def _unfreeze(strategy: str) -> dict:
    """The fine-tuning recipe: the blocks frozen for the first update, unfrozen after; the
    optimizer holds every parameter from the start."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    step = af.distributed(strategy=strategy)(classify)
    rank = dist.get_rank()
    af.freeze(model, "blocks")
    for i in range(FROZEN_STEPS + STEPS):
        if i == FROZEN_STEPS:
            af.unfreeze(model, "blocks")
        step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(i).items()})
    return {"params": _full(model)}


def _unfreeze_in_window() -> dict:
    """Unfrozen between two calls of one window: refused, the next calls train on."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_accumulation(2, mode="calls")(af.distributed(classify))
    rank = dist.get_rank()
    batch = {k: v[RANK_ROWS[rank]] for k, v in global_batch(0).items()}
    af.freeze(model, "blocks")
    step(state, batch)
    af.unfreeze(model, "blocks")
    error = None
    try:
        step(state, batch)
    except ValueError as exc:
        error = str(exc)
    for _ in range(2):  # a new window, with DDP built again over every parameter
        step(state, batch)
    return {"error": error, "step": state.step, "params": _full(model)}


BIG = 1e4  # a regression target whose summed-over-rows gradient overflows float16


def _regression(model, batch):
    out = model(batch["x"])[:, 0]
    return torch.nn.functional.mse_loss(out, batch["x"][:, 0] * 0 + BIG)


def _fp16_compression() -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=1e-6))
    step = af.distributed(compression="fp16")(_regression)
    rank = dist.get_rank()
    metrics = step(state, {k: v[RANK_ROWS[rank]] for k, v in global_batch(0).items()})
    return {"params": _full(model), "skipped": float(metrics["skipped"])}


WORKER_CASES = {
    "ema_fsdp": _ema_fsdp,  # takes the output directory
    "zero_tokens_ddp": lambda: _zero_tokens("ddp", False),
    "zero_tokens_ddp_acc2": lambda: _zero_tokens("ddp", True),
    "zero_tokens_fsdp": lambda: _zero_tokens("fsdp", False),
    "unfreeze_ddp": lambda: _unfreeze("ddp"),
    "unfreeze_fsdp": lambda: _unfreeze("fsdp"),
    "unfreeze_in_window_ddp": _unfreeze_in_window,
    "fp16_compression": _fp16_compression,
    "static_graph_acc3": _static_graph_accumulation,
    "calls_flush_ddp": lambda: _calls_flush("ddp"),
    "calls_flush_fsdp": lambda: _calls_flush("fsdp"),
    "calls_flush_fsdp_once": lambda: _calls_flush("fsdp", "once"),
}


def _evaluate_on_rank0_only() -> dict:
    """The usual 'evaluate on the main process' with a BatchNorm model under DDP."""
    import time

    import torch.distributed as dist
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 4))
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def fn(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    step = af.distributed(fn)
    rank = dist.get_rank()
    batch = {k: v[RANK_ROWS[rank]] for k, v in global_batch(0).items()}
    step(state, batch)
    error, start = None, time.monotonic()
    if af.is_main_process():
        try:
            step.evaluate(state, batch)
            step.evaluate(state, batch)
        except RuntimeError as exc:  # a collective that the other process never joins
            error = str(exc)[:300]
    seconds = time.monotonic() - start
    dist.barrier()
    step(state, batch)  # training goes on together
    return {"error": error, "seconds": seconds}


def worker(out_dir: str, which: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    # a short timeout: a collective joined by one process only fails the case, not the run
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    af.init_distributed()  # the group is up: used as it is
    cases = WORKER_CASES if which == "cases" else {"evaluate_alone": _evaluate_on_rank0_only}
    results = {name: case(out_dir) if name == "ema_fsdp" else case()
               for name, case in cases.items()}
    torch.save(results, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _launch(out, which: str) -> list[dict]:
    torchrun(__file__, out, which)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def cases_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dist_cases")


@pytest.fixture(scope="module")
def results(cases_dir):
    return _launch(cases_dir, "cases")


def _reference_calls() -> dict[str, torch.Tensor]:
    """A window of 3 calls and a flushed window of 1, each one update on all ranks' rows."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for window in ([0, 1, 2], [3]):
        batches = [global_batch(i) for i in window]
        reference_update(model, optimizer, {k: torch.cat([b[k] for b in batches])
                                            for k in batches[0]}, classify)
    return {k: v.detach() for k, v in model.named_parameters()}


pytestmark = pytest.mark.distributed


def _reference(batch_of, loss_fn) -> torch.nn.Module:
    """One process's STEPS updates (SGD with momentum) on every rank's rows of each step."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(STEPS):
        reference_update(model, optimizer, batch_of(i), loss_fn)
    return model


@pytest.mark.parametrize("case", ["calls_flush_ddp", "calls_flush_fsdp"])
def test_flushed_short_window_equals_single_process(results, case):
    # the flushed window's calls ran under no_sync: its gradients must still be reduced
    expected = _reference_calls()
    for rank in range(2):
        got = results[rank][case]
        assert got["error"] is None
        for name, value in expected.items():
            torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-5,
                                       msg=f"{case} rank {rank} {name}")
    if case.endswith("ddp"):
        for name in expected:  # DDP replicas stay bitwise identical
            assert torch.equal(results[0][case]["params"][name],
                               results[1][case]["params"][name])


@pytest.mark.parametrize("case", ["zero_tokens_ddp", "zero_tokens_ddp_acc2",
                                  "zero_tokens_fsdp"])
def test_a_process_whose_rows_are_all_padding_does_not_skip_the_others_update(results, case):
    # its local mean over no token is 0/0: it must not be taken for a non-finite loss
    model = _reference(padded_batch, clamped_token_loss)
    for rank in range(2):
        got = results[rank][case]
        assert got["skipped"] == [0.0] * STEPS, (rank, got["skipped"])
        if rank == 1:  # its mean over no token: 0, not NaN
            assert got["losses"] == [0.0] * STEPS, got["losses"]
        for name, value in model.named_parameters():
            torch.testing.assert_close(got["params"][name], value.detach(), atol=1e-5,
                                       rtol=1e-5, msg=f"{case} rank {rank} {name}")


@pytest.mark.parametrize("case", ["unfreeze_ddp", "unfreeze_fsdp"])
def test_blocks_unfrozen_after_the_first_update_are_synchronised(results, case):
    # DDP registers the trainable parameters when it is built: unfrozen ones must be
    # reduced too, or each process trains its own copy of them
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    af.freeze(model, "blocks")
    for i in range(FROZEN_STEPS + STEPS):
        if i == FROZEN_STEPS:
            af.unfreeze(model, "blocks")
        reference_update(model, optimizer, global_batch(i), classify)
    for rank in range(2):
        for name, value in model.named_parameters():
            torch.testing.assert_close(results[rank][case]["params"][name], value.detach(),
                                       atol=1e-5, rtol=1e-5, msg=f"{case} rank {rank} {name}")


def test_unfreezing_inside_an_accumulation_window_is_refused_and_training_goes_on(results):
    for rank in range(2):
        got = results[rank]["unfreeze_in_window_ddp"]
        assert got["error"] is not None and "between updates" in got["error"], got["error"]
        assert got["step"] == 1
    for name, value in results[0]["unfreeze_in_window_ddp"]["params"].items():
        assert torch.equal(value, results[1]["unfreeze_in_window_ddp"]["params"][name]), name


def test_fp16_compression_does_not_overflow_where_torchs_hook_does_not(results):
    # the weighted objective is counted in a unit near the mean loss's, as under fp16's
    # loss scaling: torch's DDP with fp16_compress_hook over the mean loss does not overflow
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    reference_update(model, optimizer, global_batch(0), _regression)
    for rank in range(2):
        got = results[rank]["fp16_compression"]
        assert got["skipped"] == 0.0
        for name, value in model.named_parameters():
            torch.testing.assert_close(got["params"][name], value.detach(), atol=1e-4,
                                       rtol=1e-3, msg=f"rank {rank} {name}")


def test_ema_over_fsdp_equals_averaged_model_of_single_process(results):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5), use_buffers=True)
    for i in range(STEPS):
        reference_update(model, optimizer, global_batch(i), classify)
        ema.update_parameters(model)
    for rank in range(2):
        got = results[rank]["ema_fsdp"]
        assert got["error"] is None, got["error"]
        for name, value in ema.module.named_parameters():
            for where in ("inside", "exported"):
                torch.testing.assert_close(got[where][name], value.detach(), atol=1e-5,
                                           rtol=1e-5, msg=f"rank {rank} {where} {name}")
        for name, value in model.named_parameters():  # the model's own weights came back
            torch.testing.assert_close(got["own"][name], value.detach(), atol=1e-5,
                                       rtol=1e-5, msg=f"rank {rank} own {name}")
            assert torch.equal(got["after"][name], got["own"][name]), name
        assert got["save_error"] is None, got["save_error"]
        assert len(got["loaded"]) == 2  # a synchronous and an asynchronous save
        for loaded in got["loaded"]:  # the fresh state holds the saved average and weights
            assert torch.equal(loaded["n"], got["n"])
            for name, value in got["exported"].items():
                assert torch.equal(loaded["ema"][name], value), name
            for name, value in got["own"].items():
                assert torch.equal(loaded["params"][name], value), name


def test_ema_saved_under_fsdp_loads_into_one_process(results, cases_dir):
    from accelfn import checkpointing

    state, step = _ema_fsdp_state()  # in one process: no sharding
    model = state.model
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    checkpointing.load(cases_dir / "ema-False", state, step=step, allow_resharding=True)
    got = results[0]["ema_fsdp"]
    for name, value in af.ema_state_dict(state).items():
        assert torch.equal(value, got["exported"][name]), name
    for name, value in model.named_parameters():
        assert torch.equal(value.detach(), got["own"][name]), name
    assert torch.equal(state.slots["with_ema"].n_averaged, got["n"])


def test_sharded_ema_without_its_step_is_refused_and_changes_nothing(results, cases_dir):
    from accelfn import checkpointing

    state, _ = _ema_fsdp_state()
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    with pytest.raises(checkpointing.CheckpointError, match="step=step"):
        checkpointing.load(cases_dir / "ema-False", state, allow_resharding=True)
    for name, value in state.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert state.step == 0 and "with_ema" not in state.slots


def test_static_graph_with_accumulation_equals_single_process(results):
    model = _reference(global_batch, classify)
    for rank in range(2):
        got = results[rank]["static_graph_acc3"]
        assert got["error"] is None
        for name, value in model.named_parameters():
            torch.testing.assert_close(got["params"][name], value.detach(), atol=1e-5,
                                       rtol=1e-5, msg=f"rank {rank} {name}")


def test_evaluate_on_the_main_process_only_needs_no_other_process(tmp_path):
    # DDP broadcast BatchNorm buffers in the evaluation forward: rank 0 waited for rank 1
    results = _launch(tmp_path, "evaluate_alone")
    got = results[0]["evaluate_alone"]
    assert got["error"] is None and got["seconds"] < 20


def test_flush_with_fsdp_sync_once_is_refused_on_every_rank(results):
    # FSDP2 keeps the unsynced window's gradients unsharded: flushing them cannot be exact
    for rank in range(2):
        error = results[rank]["calls_flush_fsdp_once"]["error"]
        assert error is not None and "fsdp_sync='every'" in error


@pytest.mark.parametrize("options", [{"bucket_cap_mb": 25}, {"find_unused_parameters": True},
                                     {"compression": "bf16"}, {"static_graph": True}])
def test_ddp_options_given_to_fsdp_are_refused(options):
    with pytest.raises(ValueError, match="DDP option"):
        af.distributed(strategy="fsdp", **options)


def test_fsdp_sync_given_to_ddp_is_refused():
    with pytest.raises(ValueError, match="fsdp_sync"):
        af.distributed(fsdp_sync="once")
    af.distributed(strategy="fsdp", fsdp_sync="once")  # an FSDP2 option


@pytest.mark.parametrize("group_up", [False, True])
def test_init_distributed_keeps_the_device_chosen_without_torchrun(monkeypatch, group_up):
    # a plain run on cuda:1, or a process group made by mp.spawn: no LOCAL_RANK to bind to
    import torch.distributed as dist

    bound = []
    for name in ("WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: group_up)
    assert af.init_distributed() == torch.device("cuda", 1)
    assert bound == []


def test_init_distributed_binds_torchruns_local_rank(monkeypatch):
    import torch.distributed as dist

    bound = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # already set up by the user
    assert af.init_distributed() == torch.device("cuda", 1)
    assert bound == [torch.device("cuda", 1)]


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
