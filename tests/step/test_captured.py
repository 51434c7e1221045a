"""The captured update (accelfn.step.captured), recorded and replayed on the CPU by
accelfn.testing.TapeRecorder: equal to the plain loop and to the eager step bitwise, its
host work run at every call, recorded again when what it holds fixed changed."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import Net, assert_params_equal, classify, make_batch, token_loss

import accelfn as af
from accelfn.testing import TapeRecorder


class Recorders:
    """A recorder factory that keeps what it made (to count replays)."""

    def __init__(self) -> None:
        self.made: list[TapeRecorder] = []

    def __call__(self, device):
        recorder = TapeRecorder(device)
        self.made.append(recorder)
        return recorder

    @property
    def replays(self) -> int:
        return sum(r.replays for r in self.made)


def _setup(seed=0, **adamw):
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True,
                                  **adamw)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def _batches(n=8, size=10):
    return [make_batch(n=size, seed=i) for i in range(n)]


def test_the_captured_update_equals_the_plain_loop_bitwise():
    model, optimizer, scheduler = _setup()
    for batch in _batches():  # the plain loop: nothing from accelfn
        logits = model(batch["x"])
        F.cross_entropy(logits, batch["y"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    recorders = Recorders()
    ours, opt, sched = _setup()
    state = af.TrainState(ours, opt, sched)
    step = af.captured(recorder=recorders)(af.with_clipping(classify, max_norm=0.5))
    for batch in _batches():
        metrics = step(state, batch)
    state.sync()
    # three warm-up calls, then the update recorded (in two parts) and replayed
    assert recorders.replays == 2 * (8 - 3)
    assert_params_equal(ours, model)
    assert sched.last_epoch == scheduler.last_epoch == 8
    assert torch.equal(opt.state[next(ours.parameters())]["exp_avg"],
                       optimizer.state[next(model.parameters())]["exp_avg"])
    assert set(metrics.keys()) == {"loss", "accuracy", "lr", "grad_norm", "skipped"}


STACKS = {
    "accumulation": lambda fn: af.with_accumulation(2)(fn),
    "bf16": lambda fn: af.with_amp(dtype=torch.bfloat16)(fn),
    "accumulation+bf16+clipping": lambda fn: af.with_clipping(max_norm=0.1)(
        af.with_amp(dtype=torch.bfloat16)(af.with_accumulation(5)(fn))),
    "unchecked": lambda fn: af.with_nonfinite(policy="off")(fn),
    "skip_if": lambda fn: af.with_nonfinite(skip_if=lambda loss, grads: loss > 1.35)(fn),
    "ema": lambda fn: af.with_ema(decay=0.9)(fn),
}


@pytest.mark.parametrize("stack", list(STACKS))
@pytest.mark.parametrize("fn", [classify, token_loss], ids=["mean", "weighted"])
def test_the_captured_update_equals_the_eager_step_bitwise(stack, fn):
    made = STACKS[stack]
    eager_state = af.TrainState(*_setup())
    state = af.TrainState(*_setup())
    eager = made(fn)
    recorders = Recorders()
    step = af.captured(warmup=2, recorder=recorders)(made(fn))
    for batch in _batches(7):
        expected, got = eager(eager_state, batch), step(state, batch)
        assert set(got.keys()) == set(expected.keys())
        for key in expected.keys():  # bitwise, NaN where the eager step has NaN
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0,
                                       equal_nan=True, msg=f"{stack}: {key}")
    assert recorders.replays == 2 * 5
    eager_state.sync(), state.sync()
    assert_params_equal(state.model, eager_state.model)
    assert eager_state.step == state.step == 7
    assert state.scheduler.last_epoch == eager_state.scheduler.last_epoch
    guard, eager_guard = state.slots["nonfinite"], eager_state.slots["nonfinite"]
    assert (guard.skipped, guard.consecutive) == (eager_guard.skipped, eager_guard.consecutive)
    if stack == "skip_if":
        assert eager_guard.skipped > 0  # the verdict skipped some, on the device
    if stack == "ema":
        for a, b in zip(af.ema_state_dict(state).values(),
                        af.ema_state_dict(eager_state).values()):
            assert torch.equal(a, b)


def test_a_nonfinite_batch_is_skipped_on_the_device_as_by_the_eager_step():
    eager_state, state = af.TrainState(*_setup()), af.TrainState(*_setup())
    eager = af.with_clipping(classify)
    step = af.captured(recorder=TapeRecorder)(eager)
    for i, batch in enumerate(_batches(9)):
        if i in (5, 7):
            batch["x"][0, 0] = float("nan")
        expected, got = eager(eager_state, batch), step(state, batch)
        assert torch.equal(got["skipped"], expected["skipped"])
        assert got["skipped"].item() == (i in (5, 7))
    eager_state.sync(), state.sync()
    assert_params_equal(state.model, eager_state.model)
    assert state.slots["nonfinite"].skipped == 2
    assert state.scheduler.last_epoch == eager_state.scheduler.last_epoch == 7


def test_the_metrics_returned_are_the_callers_not_the_recordings():
    state = af.TrainState(*_setup())
    step = af.captured(warmup=1, recorder=TapeRecorder)(classify)
    batches = _batches(5)
    held = [step(state, b) for b in batches]
    losses = [m["loss"].clone() for m in held]
    step(state, batches[0])
    assert all(torch.equal(m["loss"], loss) for m, loss in zip(held, losses))
    assert len({m["loss"].item() for m in held}) == 5


def test_a_batch_of_other_shapes_is_refused_before_anything_changes():
    state = af.TrainState(*_setup())
    step = af.captured(warmup=1, recorder=TapeRecorder)(classify)
    for batch in _batches(3):
        step(state, batch)
    before = copy.deepcopy(state.state_dict())
    with pytest.raises(ValueError, match=r"differs from the one the update is recorded for.*"
                                         r"drop_last=True"):
        step(state, make_batch(n=7))
    after = state.state_dict()
    assert after["step"] == before["step"] == 3
    assert all(torch.equal(a, b) for a, b in zip(after["model"].values(),
                                                 before["model"].values()))
    assert all(p.grad is None for p in state.model.parameters())
    step(state, make_batch(n=10, seed=9))  # the next call works
    assert state.step == 4


def test_a_loaded_optimizer_state_and_a_changed_hyperparameter_are_recorded_again():
    eager_state, state = af.TrainState(*_setup()), af.TrainState(*_setup())
    recorders = Recorders()
    eager = af.with_nonfinite()(classify)
    step = af.captured(warmup=1, recorder=recorders)(classify)
    batches = _batches(12)
    for batch in batches[:4]:
        eager(eager_state, batch), step(state, batch)
    saved = copy.deepcopy(eager_state.state_dict())
    for batch in batches[4:6]:
        eager(eager_state, batch), step(state, batch)
    eager_state.load_state_dict(copy.deepcopy(saved))
    state.load_state_dict(copy.deepcopy(saved))  # new optimizer state tensors: re-recorded
    for batch in batches[6:9]:
        eager(eager_state, batch), step(state, batch)
    for group in (*eager_state.optimizer.param_groups, *state.optimizer.param_groups):
        group["weight_decay"] = 0.5  # recorded as a number: re-recorded
    for batch in batches[9:]:
        eager(eager_state, batch), step(state, batch)
    eager_state.sync(), state.sync()
    assert len(recorders.made) == 3
    assert_params_equal(state.model, eager_state.model)
    assert state.step == eager_state.step == 10


def test_the_tape_replays_device_work_only_as_a_cuda_graph_does():
    """A step that decides on the host from Python state it changes: eager, each call sees
    the new value; replayed, every call repeats what the recording saw. The tape shows the
    difference a GPU would, so these tests can fail."""
    calls = []

    def drifting(model, batch):
        calls.append(1)
        return classify(model, batch)["loss"] * (1.0 + 0.5 * len(calls))

    eager_state, state = af.TrainState(*_setup()), af.TrainState(*_setup())
    step = af.captured(warmup=1, recorder=TapeRecorder)(drifting)
    batches = _batches(4)
    got = [step(state, b)["loss"] for b in batches]
    assert len(calls) == 2  # a warm-up call and the recording: replays run no Python
    calls.clear()
    expected = [drifting(eager_state.model, b) for b in batches[:2]]
    assert torch.equal(got[0], expected[0].detach())  # the warm-up call (fresh weights)
    assert not torch.equal(got[2] / got[1], torch.tensor(1.0))  # not a trivial loss
    assert state.step == 4


def test_every_stacking_order_with_captured_builds_the_same_update():
    registry = [af.captured(recorder=TapeRecorder), af.with_amp(dtype=torch.bfloat16),
                af.with_accumulation(2), af.with_clipping(max_norm=1.0),
                af.with_nonfinite(max_consecutive=3), af.with_ema(decay=0.9)]
    reference = None
    for order in itertools.permutations(registry):
        step = classify
        for transform in order:
            step = transform(step)
        if reference is None:
            reference = step
        assert step.spec == reference.spec
    assert str(reference).startswith("with_ema")


def _cuda_setup(seed=0):
    torch.manual_seed(seed)
    model = Net().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01, device="cuda"),
                                  fused=True)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("stack", ["clipping", "accumulation"])
def test_cuda_graphs_equal_the_eager_step_in_fp32(stack):
    made = ((lambda fn: af.with_clipping(max_norm=0.5)(fn)) if stack == "clipping"
            else (lambda fn: af.with_accumulation(2)(fn)))
    eager_state, state = af.TrainState(*_cuda_setup()), af.TrainState(*_cuda_setup())
    eager, step = made(classify), af.captured(made(classify))
    for i, batch in enumerate(_batches(10)):
        batch = batch.to("cuda")
        if i == 6:
            batch["x"][0, 0] = float("nan")
        expected, got = eager(eager_state, batch), step(state, batch)
        for key in expected.keys():
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6,
                                       equal_nan=True, msg=f"{stack}: {key} at {i}")
    eager_state.sync(), state.sync()
    assert_params_equal(state.model, eager_state.model, exact=False, atol=1e-6)
    assert state.slots["nonfinite"].skipped == eager_state.slots["nonfinite"].skipped == 1
    assert state.scheduler.last_epoch == eager_state.scheduler.last_epoch == 9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("read", ["item", "cpu", "to_device", "host_index"])
def test_a_host_read_is_refused_on_cuda(read):
    def fn(model, batch):
        loss = classify(model, batch)["loss"]
        if read == "to_device":  # a copy from the host: it synchronises, a replay skips it
            return loss * torch.ones(()).add(1).to(loss.device)
        if read == "host_index":  # indexed by a tensor made on the host
            return loss + batch["x"][torch.arange(2)].sum() * 0
        value = loss.item() if read == "item" else loss.cpu()
        return loss * (2 if value > 0 else 1)

    state = af.TrainState(*_cuda_setup())
    stream = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="captured"):
        af.captured(fn)(state, make_batch().to("cuda"))
    assert state.step == 0
    assert torch.cuda.current_stream() == stream  # no capture stream left behind


def test_a_failure_after_the_replay_counts_the_update_and_the_next_call_works():
    eager_state, state = af.TrainState(*_setup()), af.TrainState(*_setup())
    fail = []

    def scheduler_step(original):
        def step(*args, **kwargs):
            if fail:
                fail.clear()
                raise RuntimeError("scheduler failed")
            return original(*args, **kwargs)
        return step

    for s in (eager_state, state):
        s.scheduler.step = scheduler_step(s.scheduler.step)
    eager = af.with_nonfinite(policy="off")(classify)  # the scheduler steps in the update
    step = af.captured(warmup=1, recorder=TapeRecorder)(eager)
    batches = _batches(6)
    for i, batch in enumerate(batches):
        for s, f in ((eager_state, eager), (state, step)):
            if i == 3:
                fail.append(1)
                with pytest.raises(RuntimeError, match="scheduler failed") as raised:
                    f(s, batch)
                assert "counts as update 4" in "".join(raised.value.__notes__)
            else:
                f(s, batch)
    assert state.step == eager_state.step == 6
    assert_params_equal(state.model, eager_state.model)


def test_a_recording_does_not_keep_its_state_alive():
    import gc
    import weakref

    state = af.TrainState(*_setup())
    step = af.captured(warmup=1, recorder=TapeRecorder)(classify)
    for batch in _batches(3):
        step(state, batch)
    gone = weakref.ref(state)
    del state
    gc.collect()
    assert gone() is None


def test_every_call_reads_its_batch_from_the_recordings_memory():
    """The warm-up calls run on the recording's copy of the batch too, so that code
    compiled in a warm-up call sees the tensors it is recorded with (a batch of views, as
    ``tokens[:, :-1]``, has strides its copy does not keep: compiled for the view, the code
    would recompile inside the recording on a GPU)."""
    seen = []

    def looking(model, batch):
        seen.append((batch["x"].data_ptr(), batch["x"].stride()))
        return classify(model, batch)

    def views(seed):
        batch = make_batch(n=10, seed=seed)
        batch["x"] = torch.cat([batch["x"], batch["x"]], dim=1)[:, :6]
        return batch

    state = af.TrainState(*_setup())
    step = af.captured(recorder=TapeRecorder)(looking)
    for seed in range(6):
        step(state, views(seed))
    assert len(seen) == 4  # three warm-up calls and the recording: replays run no Python
    assert len(set(seen)) == 1 and seen[0][1] == (6, 1)


def test_captured_passes_the_contract_kit_against_the_plain_loop():
    from accelfn.testing import check_transform, plain_update

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)

    def loss(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    report = check_transform(
        af.captured(warmup=1, recorder=TapeRecorder), loss_fn=loss, make_optimizer=adamw,
        reference=lambda model, optimizer, batch: plain_update(model, optimizer, batch, loss),
        steps=4)
    assert report.passed == ["reference", "purity", "orders", "resume", "no host sync",
                             "bad input"]
    assert report.orders == 24  # with bf16 amp, accumulation and clipping, every order
    assert report.not_applicable == [
        "a failing loss function or optimizer step: a captured step replays its recorded "
        "update without calling them"]


def test_gradients_left_before_the_recording_are_not_this_updates():
    """A backward outside the step (a probe, a GAN's other loss) leaves gradients before the
    recording and between replays: the captured update ignores them, as the eager step's new
    window does, and its replays do not add into them."""
    eager_model, eager_opt, _ = _setup()
    model, opt, _ = _setup()
    eager_state, state = af.TrainState(eager_model, eager_opt), af.TrainState(model, opt)
    eager = af.with_clipping(classify, max_norm=1e9)
    step = af.captured(warmup=1, recorder=TapeRecorder)(af.with_clipping(classify,
                                                                         max_norm=1e9))
    for i, batch in enumerate(_batches(6)):
        if i in (1, 3):  # before the recording, and before a replay
            for m in (eager_model, model):
                classify(m, make_batch(seed=99))["loss"].backward()
        want, got = eager(eager_state, batch), step(state, batch)
        assert torch.equal(got["grad_norm"], want["grad_norm"]), i
    eager_state.sync()
    state.sync()
    assert_params_equal(model, eager_model)
    assert all(p.grad is None for p in model.parameters())


def test_the_optimizer_is_made_capturable_and_a_float_rate_put_back_is_filled_in_place():
    """The fused groups become capturable (torch refuses a step in a capture otherwise); a
    rate a hand-written schedule sets as a float each call is filled into the recorded
    tensor: recorded once, replayed after, equal to the eager step given the same tensor."""
    recorders = Recorders()
    eager_model, eager_opt, _ = _setup()
    model, opt, _ = _setup()
    opt.param_groups[0]["lr"] = 0.01
    eager_state, state = af.TrainState(eager_model, eager_opt), af.TrainState(model, opt)
    step = af.captured(recorder=recorders)(classify)
    eager = af.lift(classify)
    for i, batch in enumerate(_batches(8)):
        rate = 0.01 * (1 - i / 8)
        opt.param_groups[0]["lr"] = rate  # a float, as nanoGPT's loop sets it
        eager_opt.param_groups[0]["lr"].fill_(torch.tensor(rate, dtype=torch.float32))
        step(state, batch)
        eager(eager_state, batch)
    assert opt.param_groups[0]["capturable"] is True
    assert len(recorders.made) == 1 and recorders.replays == 2 * (8 - 3)
    eager_state.sync()
    state.sync()
    assert_params_equal(model, eager_model)


def test_a_dropped_step_takes_its_recording_with_it():
    """Recordings are kept per state and step, the step weakly: a step built anew each epoch
    does not keep every old recording (and its graphs' memory) alive."""
    import gc
    import weakref
    model, opt, _ = _setup()
    state = af.TrainState(model, opt)
    recorders = []
    for _ in range(3):  # an epoch, its step built anew
        step = af.captured(warmup=1, recorder=TapeRecorder)(classify)
        for batch in _batches(3):
            step(state, batch)
        recorders.append(weakref.ref(step))
        del step
        gc.collect()
    assert all(ref() is None for ref in recorders)
