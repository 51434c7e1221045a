"""TrainState: state_dict covers model, optimizer, scheduler and every transform's state."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Net, assert_params_equal, classify, make_batch, roundtrip

import accelfn as af


def _state(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    return af.TrainState(model, opt, scheduler=sched)


def test_save_load_resumes_exactly_with_fp16_scaler():
    torch.manual_seed(0)
    base = Net()
    step = af.with_amp(dtype=torch.float16)(af.with_clipping(classify))
    batches = [make_batch(seed=i) for i in range(6)]

    straight = _state(copy.deepcopy(base))
    for b in batches:
        step(straight, b)

    first = _state(copy.deepcopy(base))
    for b in batches[:3]:
        step(first, b)
    saved = roundtrip(first.state_dict())
    assert set(saved["slots"]) == {"with_amp", "nonfinite"}

    resumed = _state(Net())
    resumed.load_state_dict(saved)  # before the first call: slots applied when created
    for b in batches[3:]:
        step(resumed, b)
    assert_params_equal(resumed.model, straight.model)
    assert resumed.step == straight.step == 6
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()
    assert resumed.slots["with_amp"].get_scale() == straight.slots["with_amp"].get_scale()


def test_missing_parts_are_refused():
    torch.manual_seed(0)
    state = _state(Net())
    saved = state.state_dict()
    del saved["optimizer"]
    with pytest.raises(KeyError, match="optimizer"):
        _state(Net()).load_state_dict(saved)
    model = Net()
    no_sched = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="scheduler"):
        no_sched.load_state_dict(state.state_dict())


def test_slot_keys_must_match():
    torch.manual_seed(0)
    state = _state(Net())
    state.slot("custom", lambda: {"count": torch.zeros(())})
    saved = state.state_dict()
    saved["slots"]["custom"] = {"other": torch.ones(())}
    fresh = _state(Net())
    fresh.slot("custom", lambda: {"count": torch.zeros(())})
    with pytest.raises(ValueError, match="different transform stack"):
        fresh.load_state_dict(saved)


def test_scheduler_for_another_optimizer_is_refused():
    model = Net()
    other = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="another optimizer"):
        af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    assert "TrainState(model=Net" in repr(_state(model))


def test_plateau_scheduler_is_refused_with_the_alternative():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="warmup_plateau"):
        af.TrainState(model, opt, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))


def test_a_load_that_fails_midway_changes_nothing():
    torch.manual_seed(0)
    good = _state(Net())
    af.with_amp(dtype=torch.float16)(classify)(good, make_batch())
    saved = good.state_dict()
    torch.manual_seed(1)
    target = _state(Net())
    af.with_amp(dtype=torch.float16)(classify)(target, make_batch(seed=5))
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    opt_before = repr(target.optimizer.state_dict())
    broken = dict(saved)
    optimizer_state = dict(saved["optimizer"])
    optimizer_state["param_groups"] = [*saved["optimizer"]["param_groups"]] * 2
    broken["optimizer"] = optimizer_state  # refused by the optimizer, after the model loaded
    with pytest.raises(ValueError, match="parameter groups"):
        target.load_state_dict(broken)
    for k, v in target.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert repr(target.optimizer.state_dict()) == opt_before
    target.load_state_dict(saved)  # a good checkpoint still loads afterwards
    assert target.step == good.step


def _calls_run():
    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return state, af.with_accumulation(2, mode="calls")(classify)


def test_loading_discards_an_open_calls_window_and_its_gradients():
    """Loading a checkpoint rolls back to it, mid-window too: the open window and the
    gradients it accumulated are discarded, and training goes on as from the checkpoint."""
    state, step = _calls_run()
    batches = [make_batch(seed=i) for i in range(5)]
    for b in batches[:2]:
        step(state, b)
    saved = copy.deepcopy(state.state_dict())  # at a window boundary
    twin, _ = _calls_run()
    twin.load_state_dict(copy.deepcopy(saved))
    step(state, batches[2])  # a window is open now
    assert any(p.grad is not None for p in state.model.parameters())
    state.load_state_dict(saved)
    assert all(p.grad is None for p in state.model.parameters())
    assert state.state_dict()["slots"]["accumulation"] == {"calls": 0}  # saveable: closed
    for b in batches[3:]:
        step(state, b)
        step(twin, b)
    assert state.step == twin.step == 2
    assert_params_equal(state.model, twin.model)


def test_loading_a_checkpoint_without_the_window_discards_it_too():
    state, step = _calls_run()
    saved = copy.deepcopy(state.state_dict())  # before any call: no accumulation slot
    step(state, make_batch(seed=0))
    state.load_state_dict(saved)
    assert all(p.grad is None for p in state.model.parameters())
    assert state.state_dict()["slots"]["accumulation"] == {"calls": 0}  # afresh: closed


def test_loading_a_checkpoint_without_a_transforms_state_starts_it_afresh():
    # a checkpoint saved before the first step holds no average, loss scale nor counters:
    # loading it into a state that trained on must give what a new state loading it has,
    # not keep the later run's (an EMA of other weights, a grown loss scale)
    def build():
        torch.manual_seed(0)
        return _state(Net()), af.with_ema(decay=0.5)(
            af.with_amp(dtype=torch.float16, init_scale=2.0**16, growth_interval=1)(classify))

    state, step = build()
    saved = copy.deepcopy(state.state_dict())
    assert saved["slots"] == {}
    batches = [make_batch(seed=i) for i in range(5)]
    for b in batches[:3]:
        step(state, b)
    assert state.slots["with_amp"].get_scale() > 2.0**16
    state.load_state_dict(copy.deepcopy(saved))
    assert state.slots["with_amp"].get_scale() == 2.0**16  # as a new state's
    fresh, _ = build()
    fresh.load_state_dict(copy.deepcopy(saved))
    for b in batches[3:]:
        step(state, b)
        step(fresh, b)
    assert_params_equal(state.model, fresh.model)
    assert state.slots["with_amp"].get_scale() == fresh.slots["with_amp"].get_scale()
    ours, theirs = af.ema_state_dict(state), af.ema_state_dict(fresh)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # a slot waiting for its transform (loaded, never created) is not kept past a load
    # of a checkpoint without it either
    other, _ = build()
    other.load_state_dict(copy.deepcopy(state.state_dict()))  # pending: with_ema, with_amp
    other.load_state_dict(copy.deepcopy(saved))
    assert other.state_dict()["slots"] == {}


def test_a_failed_load_keeps_the_open_window_and_its_gradients():
    state, step = _calls_run()
    twin, _ = _calls_run()
    batches = [make_batch(seed=i) for i in range(4)]
    for b in batches[:3]:
        step(state, b)
        step(twin, b)
    grads = [p.grad.clone() for p in state.model.parameters()]
    broken = copy.deepcopy(_boundary_checkpoint())
    optimizer_state = dict(broken["optimizer"])
    optimizer_state["param_groups"] = [*broken["optimizer"]["param_groups"]] * 2
    broken["optimizer"] = optimizer_state
    with pytest.raises(ValueError, match="parameter groups"):  # the load's own error
        state.load_state_dict(broken)
    assert all(torch.equal(p.grad, g) for p, g in zip(state.model.parameters(), grads))
    step(state, batches[3])  # closes the window the failed load left as it was
    step(twin, batches[3])
    assert state.step == twin.step == 2
    assert_params_equal(state.model, twin.model)


def _boundary_checkpoint():
    state, step = _calls_run()
    step(state, make_batch(seed=7))
    step(state, make_batch(seed=8))
    return state.state_dict()


def test_a_pending_slot_that_fails_to_load_stays_pending():
    """A checkpointed slot applied when its transform creates it: a creation refused for a
    mismatch keeps it waiting, so the right transform still gets the checkpoint's values."""
    source = _state(Net())
    source.slot("custom", lambda: {"count": torch.zeros(())})["count"].fill_(3)
    saved = copy.deepcopy(source.state_dict())
    fresh = _state(Net())
    fresh.load_state_dict(saved)
    with pytest.raises(ValueError, match="different transform stack"):
        fresh.slot("custom", lambda: {"other": torch.zeros(())})
    assert fresh.state_dict()["slots"]["custom"]["count"] == 3  # still saved as pending
    assert fresh.slot("custom", lambda: {"count": torch.zeros(())})["count"] == 3


def test_an_epoch_ended_right_after_a_resume_steps_the_scheduler_without_torchs_warning():
    # resumed at an epoch's last batch, the loop's first act is end_epoch(): the updates
    # before the scheduler's step ran in the process that saved, so torch's "scheduler
    # stepped before optimizer.step()" warning does not apply
    import warnings

    def build():
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return af.TrainState(model, optimizer, scheduler, scheduler_every="epoch")

    step = af.lift(classify)
    state = build()
    step(state, make_batch(seed=0))
    saved = roundtrip(state.state_dict())
    state.end_epoch()
    resumed = build()
    resumed.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.end_epoch()
    assert resumed.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]
    fresh = build()  # no update anywhere yet: torch's warning is right and stays
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        fresh.end_epoch()
