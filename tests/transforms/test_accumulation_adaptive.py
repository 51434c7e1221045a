"""with_accumulation(n, adaptive=True): an out-of-memory micro-batch makes the call run again
with twice as many micro-batches; the count that fits is kept, checkpointed and reported."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import Net, assert_params_equal, classify, make_batch, torchrun_results
from torch import nn

import accelfn as af


class Limited(nn.Module):
    """Net that runs out of memory above ``limit`` samples per micro-batch: in the forward,
    or (``in_backward``) in the backward, after the earlier micro-batches' backwards ran."""

    def __init__(self, limit: int, in_backward: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.limit = limit
        self.in_backward = in_backward
        self.raised = 0

    def forward(self, x):
        if x.shape[0] > self.limit and not self.in_backward:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        out = self.net(x)
        if x.shape[0] > self.limit:
            out = _FailInBackward.apply(out, self)
        return out


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.owner.raised += 1
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def _state(model):
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def _batches(n=3):
    return [make_batch(n=16, seed=i) for i in range(n)]


@pytest.mark.parametrize("in_backward", [False, True])
def test_an_oom_retries_with_twice_the_micro_batches_and_equals_that_count_from_the_start(
        in_backward):
    model = Limited(limit=4, in_backward=in_backward)
    reference = copy.deepcopy(model)
    state = _state(model)
    step = af.with_accumulation(2, adaptive=True)(classify)
    metrics = [step(state, batch) for batch in _batches()]
    # 2 micro-batches of 8: out of memory (undone); 4 of 4 fit, and are kept
    assert model.raised == 1
    assert [int(m["micro_batches"]) for m in metrics] == [4, 4, 4]
    assert state.step == 3
    ref_state = _state(reference)
    for batch in _batches():
        af.with_accumulation(4)(classify)(ref_state, batch)
    assert_params_equal(model.net, reference.net)  # shares 1/4: powers of two, bitwise
    assert all(p.grad is None for p in model.parameters())


def test_the_count_that_fits_is_checkpointed_and_resumed():
    model = Limited(limit=2)
    state = _state(model)
    step = af.with_accumulation(1, adaptive=True)(classify)
    step(state, make_batch(n=16, seed=0))
    assert model.raised == 3  # 1 -> 2 -> 4 -> 8 micro-batches of 2
    saved = copy.deepcopy(state.state_dict())
    assert saved["slots"]["accumulation"] == {"count": 8}
    resumed_model = Limited(limit=2)
    resumed = _state(resumed_model)
    resumed.load_state_dict(saved)
    assert int(step(resumed, make_batch(n=16, seed=1))["micro_batches"]) == 8
    assert resumed_model.raised == 0  # no out-of-memory again: it started at 8
    forged = _state(Limited(limit=2))
    forged.load_state_dict({**saved, "slots": {"accumulation": {"count": 0}}})
    with pytest.raises(ValueError, match="micro-batch count is 0"):  # when the slot is made
        step(forged, make_batch(n=16, seed=1))
    assert forged.step == saved["step"]


def test_a_short_batch_uses_at_most_one_sample_per_micro_batch():
    model = Limited(limit=2)
    state = _state(model)
    step = af.with_accumulation(1, adaptive=True)(classify)
    step(state, make_batch(n=16, seed=0))  # settles at 8 micro-batches
    assert int(step(state, make_batch(n=5, seed=1))["micro_batches"]) == 5


def test_out_of_memory_at_one_sample_per_micro_batch_raises_with_the_state_intact():
    model = Limited(limit=0)
    state = _state(model)
    before = copy.deepcopy(state.state_dict())
    with pytest.raises(torch.OutOfMemoryError, match="parameters, optimizer and scheduler are "
                                                     "unchanged"):
        af.with_accumulation(2, adaptive=True)(classify)(state, make_batch(n=4))
    assert model.raised == 2  # 2 micro-batches of 2, then 4 of 1: no finer split is left
    assert state.step == 0 and all(p.grad is None for p in model.parameters())
    after = state.state_dict()
    for key in ("model", "optimizer", "step"):
        assert str(after[key]) == str(before[key])


def test_adaptive_takes_the_builtin_split_only():
    with pytest.raises(ValueError, match="adaptive=True"):
        af.with_accumulation(2, mode="calls", adaptive=True)
    with pytest.raises(ValueError, match="adaptive=True"):
        af.with_accumulation(2, adaptive=True, split=lambda b, n: [b])
    with pytest.raises(TypeError, match="adaptive"):
        af.with_accumulation(2, adaptive=1)  # type: ignore[arg-type]
    assert "adaptive" in repr(af.with_accumulation(2, adaptive=True))


def test_without_adaptive_an_oom_raises_as_before():
    model = Limited(limit=4)
    state = _state(model)
    with pytest.raises(torch.OutOfMemoryError, match=r"with_accumulation\(4\)"):
        af.with_accumulation(2)(classify)(state, make_batch(n=16))
    assert model.raised == 1


def test_cross_entropy_of_a_limited_net_is_the_plain_one():
    """The fixture itself: below its limit Limited is Net."""
    model = Limited(limit=100)
    x = make_batch(n=4)["x"]
    assert torch.equal(model(x), model.net(x))
    assert F.cross_entropy(model(x), make_batch(n=4)["y"]).isfinite()


def test_a_wrapping_that_cannot_skip_the_sync_is_refused_before_anything_changes(monkeypatch):
    """In several processes the backward must run without collectives until the processes
    agree: a sharding part that reports a process group but wraps nothing in DDP (as FSDP)
    is refused at the first call (the DDP and FSDP cases run in the 2-process test)."""
    import dataclasses

    from accelfn.parts import sharding  # a static graph's refusal, a process group pretended

    monkeypatch.setattr(sharding, "shard", lambda options, prepared, state: dataclasses.replace(
        prepared, process_group="group"))
    grouped = af.distributed(static_graph=True)
    model = Limited(limit=100)
    state = _state(model)
    before = copy.deepcopy(state.state_dict())
    with pytest.raises(ValueError, match=r"adaptive=True.*needs distributed\(\) with DDP"):
        grouped(af.with_accumulation(2, adaptive=True)(classify))(state, make_batch(n=16))
    assert str(state.state_dict()["model"]) == str(before["model"]) and state.step == 0
    assert "accumulation" not in state.state_dict()["slots"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("adaptive")
    return torchrun_results(os.path.join(os.path.dirname(__file__), "adaptive_worker.py"), out,
                            timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["forward", "backward"])
def test_one_process_out_of_memory_makes_both_retry_with_one_count(two_processes, case):
    """Rank 1 runs out of memory above 2 samples per micro-batch (8 samples per rank): 1 ->
    2 -> 4 micro-batches on both ranks, kept for later calls, and the parameters are bitwise
    those of with_accumulation(4) under DDP from the start (shares of 1/4 and 1/2)."""
    zero, one = (r[case] for r in two_processes)
    assert one["raised"] == 2 and zero["raised"] == 0
    assert zero["counts"] == one["counts"] == [4, 4, 4]
    assert zero["saved"] == one["saved"] == {"count": 4}
    for r in (zero, one):
        assert r["grads"] == []
        for name, value in r["reference"].items():
            assert torch.equal(r["params"][name], value), name
    for name, value in zero["params"].items():
        assert torch.equal(one["params"][name], value), name


@pytest.mark.distributed
def test_two_processes_equal_the_plain_loop_on_the_whole_batch(two_processes):
    """The plain single-process loop over the global batch (16 samples, 8 micro-batches of
    2, each loss weighted by its share): equal within float32 rounding."""
    from adaptive_worker import PER_RANK, STEPS
    from reference import reference_update

    model = Limited(limit=100).net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(STEPS):
        batch = {k: v for k, v in make_batch(n=2 * PER_RANK, seed=i, td=False).items()}
        reference_update(model, optimizer, batch, classify, micro=8)
    for name, value in model.named_parameters():
        torch.testing.assert_close(two_processes[0]["backward"]["params"][name], value.detach(),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.distributed
def test_no_finer_split_in_one_process_raises_in_every_process(two_processes):
    zero, one = two_processes
    assert "another process of the run ran out of memory" in zero["stuck"]
    assert "parameters, optimizer and scheduler are unchanged" in one["stuck"]
    for r in two_processes:
        assert r["stuck_unchanged"] and r["stuck_step"] == 0


@pytest.mark.distributed
def test_fsdp_is_refused_in_every_process_before_anything_changes(two_processes):
    for r in two_processes:
        assert "needs distributed() with DDP" in r["fsdp"] and r["fsdp_step"] == 0


def test_a_count_that_never_worked_is_not_kept():
    """Out of memory down to one sample per micro-batch: the call fails and the count
    stays the one before it (not the finest, which never worked)."""
    model = Limited(limit=4)
    state = _state(model)
    step = af.with_accumulation(2, adaptive=True)(classify)
    step(state, make_batch(n=16, seed=0))  # 2 of 8 fail; 4 of 4 fit
    assert state.state_dict()["slots"]["accumulation"] == {"count": 4}
    model.limit = 0  # nothing fits any more: 4, 8, 16 micro-batches fail
    with pytest.raises(torch.OutOfMemoryError):
        step(state, make_batch(n=16, seed=1))
    assert state.state_dict()["slots"]["accumulation"] == {"count": 4}
    model.limit = 4
    assert int(step(state, make_batch(n=16, seed=2))["micro_batches"]) == 4
