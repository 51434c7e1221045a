"""captured's refusals (accelfn.parts.capture): what a replay cannot reproduce is refused
with its reason and fix, when the step is built, when the state is prepared, or at the host
read itself, with nothing changed and the next call working."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Net, classify, make_batch

import accelfn as af
from accelfn.testing import TapeRecorder

TAPE = af.captured(recorder=TapeRecorder)


def _state(**adamw):
    torch.manual_seed(0)
    model = Net()
    return af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=0.01, **adamw))


BUILT = {
    "distributed": (lambda fn: af.distributed()(fn), "runs in one process"),
    "fp16": (lambda fn: af.with_amp(dtype=torch.float16)(fn), "fp16's loss scaling"),
    "checkpointed": (lambda fn: af.checkpointed()(fn), "random number generator"),
    "calls": (lambda fn: af.with_accumulation(2, mode="calls")(fn), "mode='calls'"),
    "adaptive": (lambda fn: af.with_accumulation(2, adaptive=True)(fn), "adaptive=True"),
    "gradient transform": (lambda fn: af.GradientTransform(
        "scaled", lambda grads, params, state: None)(fn), "gradient transforms"),
    "raise": (lambda fn: af.with_nonfinite(policy="raise")(fn), "policy='raise'"),
    "reduce-overhead": (lambda fn: af.compiled(mode="reduce-overhead")(fn),
                        "graphs of its own"),
    "compiled warmup": (lambda fn: af.compiled()(fn), "warmup >= 2"),
}


@pytest.mark.parametrize("name", list(BUILT))
def test_what_a_replay_cannot_reproduce_is_refused_when_the_step_is_built(name):
    made, reason = BUILT[name]
    warmup = 1 if name == "compiled warmup" else 3
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        af.captured(warmup=warmup, recorder=TapeRecorder)(made(classify))
    with pytest.raises(ValueError, match="captured"):  # in either order
        made(af.captured(warmup=warmup, recorder=TapeRecorder)(classify))


def test_a_carry_is_refused():
    def carried(model, batch, carry=None):
        return {"loss": classify(model, batch)["loss"], "carry": None}

    with pytest.raises(ValueError, match="carry"):
        TAPE(carried)


@pytest.mark.parametrize("warmup", [0, -1, True, 1.5])
def test_options_are_checked(warmup):
    with pytest.raises(ValueError, match="warmup"):
        af.captured(warmup=warmup)
    with pytest.raises(TypeError, match="recorder"):
        af.captured(recorder="tape")
    assert repr(af.captured()) == "captured"
    assert repr(af.captured(warmup=2, recorder=TapeRecorder)) == (
        "captured(warmup=2, TapeRecorder)")


def test_a_state_the_recorder_cannot_replay_is_refused_before_anything_changes():
    state = _state(fused=True)
    with pytest.raises(ValueError, match=r"CUDA graphs, and the model is on cpu.*TapeRecorder"):
        af.captured(classify)(state, make_batch())
    state = _state()  # neither fused nor capturable
    with pytest.raises(ValueError, match=r"cannot do unless fused: build it with fused=True"):
        TAPE(classify)(state, make_batch())
    assert state.step == 0 and not state.optimizer.state
    assert not isinstance(state.optimizer.param_groups[0]["lr"], torch.Tensor)


def _reading(kind):
    def fn(model, batch):
        out = classify(model, batch)
        if not fn.reads:
            return out
        loss = out["loss"]
        if kind == "item":
            return loss * 2 if loss.item() > 0 else loss
        if kind == "bool":
            return loss * 2 if loss > 0 else loss
        if kind == "mask":
            logits = model(batch["x"])
            return loss + logits[batch["mask"]].mean()
        if kind == "tolist":
            return loss * sum(batch["y"].tolist())
        return loss * batch["y"].nonzero().shape[0]
    fn.reads = True
    return fn


@pytest.mark.parametrize("kind", ["item", "bool", "mask", "tolist", "nonzero"])
def test_a_host_read_is_refused_where_it_happens_with_nothing_changed(kind):
    state = _state(fused=True)
    fn = _reading(kind)
    step = TAPE(fn)
    before = copy.deepcopy(state.model.state_dict())
    with pytest.raises(RuntimeError, match=r"captured\(\): the update .* at .*"
                                           r"test_capture_refusals.py:\d+ in fn") as raised:
        step(state, make_batch())
    assert "was not applied" in str(raised.value)
    assert state.step == 0 and not state.optimizer.state
    assert all(torch.equal(v, before[k]) for k, v in state.model.state_dict().items())
    assert all(p.grad is None for p in state.model.parameters())
    assert torch.Tensor.tolist.__name__ == "tolist"  # the methods are put back
    fn.reads = False
    for seed in range(5):  # the next calls work: warm-up, then recorded and replayed
        step(state, make_batch(seed=seed))
    assert state.step == 5


def test_indexing_by_integer_tensors_is_no_host_read():
    def gathered(model, batch):
        logits = model(batch["x"])
        picked = logits[torch.arange(logits.shape[0]), batch["y"]]
        return -picked.mean()

    state = _state(fused=True)
    step = af.captured(warmup=1, recorder=TapeRecorder)(gathered)
    for seed in range(3):
        step(state, make_batch(seed=seed))
    assert state.step == 3


def test_a_host_read_at_the_recording_is_refused_by_the_tape():
    """A read the first call did not make (a branch taken later) is refused by the tape
    as a capture fails on the GPU; the update is not applied."""
    calls = []

    def late(model, batch):
        calls.append(1)
        loss = classify(model, batch)["loss"]
        return loss * 2 if len(calls) > 1 and loss.item() > 0 else loss

    state = _state(fused=True)
    step = af.captured(warmup=1, recorder=TapeRecorder)(late)
    step(state, make_batch())
    weights = copy.deepcopy(state.model.state_dict())
    with pytest.raises(RuntimeError, match="could not be recorded") as raised:
        step(state, make_batch(seed=1))
    assert "reads a tensor's value on the host" in str(raised.value.__cause__)
    assert state.step == 1
    assert all(torch.equal(v, weights[k]) for k, v in state.model.state_dict().items())


@pytest.mark.parametrize("kind", ["to_device", "copy_from_host", "host_index"])
def test_a_copy_from_the_host_to_the_device_is_refused(kind):
    """A host-to-device copy synchronises and a replay would not repeat it: refused, naming
    it (the meta device stands in for a GPU; the refusal reads devices only)."""
    from accelfn.parts.capture import host_read_error
    device = torch.zeros(4, device="meta")
    host = torch.zeros(4)
    aten = torch.ops.aten
    calls = {"to_device": (aten._to_copy.default, (host,), {"device": torch.device("meta")}),
             "copy_from_host": (aten.copy_.default, (device, host), {}),
             "host_index": (aten.index.Tensor, (device, [torch.tensor([0, 2])]), {})}
    op, args, kwargs = calls[kind]
    error = host_read_error(op, args, kwargs)
    assert error is not None and "captured()" in str(error)
    assert ("from the host to the device" in str(error)) == (kind != "host_index")
    assert ("tensor on the host" in str(error)) == (kind == "host_index")
    # the same on the device, or a 0-d host scalar index, is not refused
    assert host_read_error(aten.index.Tensor, (device, [torch.tensor([0, 2],
                                                                      device="meta")]), {}) is None
    assert host_read_error(aten._to_copy.default, (device,),
                           {"device": torch.device("meta")}) is None


def test_an_optimizer_step_that_is_not_capturable_is_refused_by_the_tape_as_by_cuda():
    """torch refuses an optimizer step inside a CUDA capture unless its groups are
    capturable, fused or not: the tape does too, so the CPU tests see it."""
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
    classify(model, make_batch())["loss"].backward()
    optimizer.step()  # eager: no capture, no refusal
    with pytest.raises(RuntimeError, match="capturable is False"):
        TapeRecorder().record(optimizer.step)
    optimizer.param_groups[0]["capturable"] = True
    TapeRecorder().record(optimizer.step)


def test_a_hyperparameter_changed_at_every_call_is_named_in_a_warning():
    """OneCycleLR writes new betas each step, so the update is never recorded: said once,
    naming what changed and the fix."""
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=50)
    state = af.TrainState(model, optimizer, scheduler)
    step = af.captured(recorder=TapeRecorder)(classify)
    with pytest.warns(RuntimeWarning, match=r"never recorded: AdamW's group 0 'betas'.*"
                                         r"cycle_momentum=False"):
        for i in range(6):
            step(state, make_batch(seed=i))
