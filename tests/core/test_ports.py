"""What ports of classic scripts need from the core: per-epoch schedulers, a carried hidden
state (truncated BPTT), time-major batches. Each against the original loop written out."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import Net, as_dict, assert_params_equal, classify, make_batch
from tensordict import TensorDict
from torch import nn

import accelfn as af


# ---------------------------------------------------------- schedulers per epoch or per N
def _mnist_like(every):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    return af.TrainState(model, opt, scheduler=sched, scheduler_every=every)


def test_a_scheduler_stepped_per_epoch_equals_the_original_loop_and_resumes_exactly():
    state = _mnist_like("epoch")
    ref = copy.deepcopy(state.model)
    ref_opt = torch.optim.Adadelta(ref.parameters(), lr=1.0)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    step = af.lift(classify)
    saved = None
    for epoch in range(3):
        for i in range(4):
            batch = make_batch(seed=10 * epoch + i)
            step(state, batch)
            classify(ref, as_dict(batch))["loss"].backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        state.end_epoch()
        ref_sched.step()
        if epoch == 0:
            saved = copy.deepcopy(state.state_dict())
    assert_params_equal(state.model, ref)
    assert state.epoch == 3 and state.scheduler.get_last_lr() == ref_sched.get_last_lr()
    resumed = _mnist_like("epoch")
    resumed.load_state_dict(saved)
    assert resumed.epoch == 1
    for epoch in range(1, 3):
        for i in range(4):
            step(resumed, make_batch(seed=10 * epoch + i))
        resumed.end_epoch()
    assert_params_equal(resumed.model, state.model)


def test_a_scheduler_every_n_updates_and_a_mismatched_resume():
    state = _mnist_like(3)
    for i in range(7):
        af.lift(classify)(state, make_batch(seed=i))
    assert state.scheduler.last_epoch == 2  # after updates 3 and 6
    with pytest.raises(ValueError, match="scheduler_every"):
        _mnist_like(1).load_state_dict(state.state_dict())
    with pytest.raises(ValueError, match="int N >= 1"):
        _mnist_like(0)


# --------------------------------------------------------- truncated BPTT: a carried state
class LM(nn.Module):
    def __init__(self, vocab=11, hidden=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden)  # time-major, as word_language_model's
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens, hidden=None):
        out, hidden = self.rnn(self.embed(tokens), hidden)
        return self.head(out), hidden


def lm_step(model, batch, carry):
    logits, hidden = model(batch["data"], carry)
    loss = F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())
    return {"loss": loss, "carry": hidden}


def _stream(steps, bptt=5, width=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (bptt * steps + 1, width), generator=g)
    return [TensorDict({"data": tokens[i * bptt:(i + 1) * bptt],
                        "target": tokens[i * bptt + 1:(i + 1) * bptt + 1]},
                       batch_size=[bptt, width]) for i in range(steps)]


def _repackage(h):
    return tuple(v.detach() for v in h)


def test_carried_hidden_state_equals_word_language_models_loop():
    torch.manual_seed(0)
    model = LM()
    ref = copy.deepcopy(model)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=1.0))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    step = af.with_clipping(max_norm=0.25)(lm_step)
    hidden = None
    for batch in _stream(6):
        step(state, batch)
        hidden = None if hidden is None else _repackage(hidden)
        logits, hidden = ref(batch["data"], hidden)
        F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.25)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert_params_equal(model, ref)
    carried = state.get_slot("carry").get("train", 0)
    assert all(torch.equal(a, b) for a, b in zip(carried, hidden))
    assert not carried[0].requires_grad


def test_carry_under_accumulation_keeps_one_state_per_micro_batch_and_resumes():
    torch.manual_seed(0)
    model = LM()
    ref = copy.deepcopy(model)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=1.0))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    step = af.with_accumulation(2, dim=1)(lm_step)  # split the batch columns, not time
    hidden = [None, None]
    stream = _stream(5)
    for t, batch in enumerate(stream):
        step(state, batch)
        for i, cols in enumerate((slice(0, 3), slice(3, 6))):
            h = None if hidden[i] is None else _repackage(hidden[i])
            logits, hidden[i] = ref(batch["data"][:, cols], h)
            loss = F.cross_entropy(logits.flatten(0, 1), batch["target"][:, cols].flatten())
            (loss * 0.5).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        if t == 2:
            saved = copy.deepcopy(state.state_dict())
    assert_params_equal(model, ref)
    torch.manual_seed(1)
    again = LM()
    resumed = af.TrainState(again, torch.optim.SGD(again.parameters(), lr=1.0))
    resumed.load_state_dict(saved)
    for batch in stream[3:]:
        step(resumed, batch)
    assert_params_equal(again, model)


def test_evaluate_keeps_its_own_carry_and_a_failed_call_keeps_the_old_one():
    torch.manual_seed(0)
    model = LM()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=1.0))
    step = af.lift(lm_step)
    stream = _stream(3)
    step(state, stream[0])
    train_carry = state.get_slot("carry").get("train", 0)
    step.evaluate(state, stream[1])
    carries = state.get_slot("carry")
    assert carries.get("train", 0) is train_carry and carries.get("evaluate", 0) is not None

    def broken(model, batch, carry):
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        af.lift(broken)(state, stream[2])
    assert state.get_slot("carry").get("train", 0) is train_carry
    state.reset_carry(evaluate=False)
    assert state.get_slot("carry").get("train", 0) is None
    assert state.get_slot("carry").get("evaluate", 0) is not None
    with pytest.raises(ValueError, match="'carry'"):
        af.lift(lambda model, batch, carry: lm_step(model, batch, carry)["loss"])(
            state, stream[0])


# ---------------------------------------------------------------- time-major batches
def test_time_major_batches_split_along_the_batch_or_are_refused_with_the_layout():
    torch.manual_seed(0)
    model = LM()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=1.0))
    batch = _stream(1)[0]

    def lm_loss(model, batch):
        logits, _ = model(batch["data"])
        return F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())

    seen = []

    def spy(model, b):
        seen.append(tuple(b["data"].shape))
        return lm_loss(model, b)

    af.with_accumulation(3, dim=1)(spy)(state, batch)
    assert seen == [(5, 2), (5, 2), (5, 2)]  # the time dimension is whole
    flat = TensorDict({"data": batch["data"], "target": batch["target"]}, batch_size=[5])
    with pytest.raises(ValueError, match=r"batch_size=\[bptt, batch\]"):
        af.with_accumulation(2, dim=1)(lm_loss)(state, flat)
    with pytest.raises(ValueError, match="dim"):
        af.with_accumulation(2, dim=-1)
