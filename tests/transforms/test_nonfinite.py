"""The non-finite guard: skip (and count), raise, or off; state untouched on a skip."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Net, as_dict, assert_params_equal, classify, make_batch
from reference import reference_update

import accelfn as af
from accelfn.core.syncs import GUARD_READ


def _setup(net):
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return af.TrainState(net, opt, scheduler=sched)


def _snapshot(state):
    opt_state = {i: {k: v.clone() for k, v in s.items()}
                 for i, s in enumerate(state.optimizer.state.values())}
    return ([p.detach().clone() for p in state.model.parameters()], opt_state,
            state.scheduler.state_dict())


def _assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert a[1].keys() == b[1].keys()
    for i in a[1]:
        for k in a[1][i]:
            assert torch.equal(a[1][i][k], b[1][i][k])
    assert a[2] == b[2]


class Poison:
    def __init__(self):
        self.loss = None  # multiply the loss by this
        self.grad = None  # put this into one gradient
        self.hooked = set()

    def fn(self, model, batch):
        out = classify(model, batch)
        if self.loss is not None:
            out["loss"] = out["loss"] * self.loss
        if id(model) not in self.hooked:
            self.hooked.add(id(model))
            model.head.weight.register_hook(
                lambda g: g if self.grad is None else torch.full_like(g, self.grad))
        return out


@pytest.mark.parametrize("where,value", [("loss", float("nan")), ("loss", float("inf")),
                                         ("grad", float("nan")), ("grad", float("inf"))])
def test_skip_leaves_state_untouched(net, where, value):
    poison = Poison()
    state = _setup(net)
    step = af.with_clipping(poison.fn) if where == "loss" else af.lift(poison.fn)
    step(state, make_batch(seed=0))
    before = _snapshot(state)
    setattr(poison, where, value)
    metrics = step(state, make_batch(seed=1))
    assert metrics["skipped"] == 1
    _assert_same(before, _snapshot(state))
    assert all(p.grad is None for p in net.parameters())
    assert state.slots["nonfinite"].skipped == 1 and state.step == 2
    setattr(poison, where, None)
    assert step(state, make_batch(seed=2))["skipped"] == 0
    assert state.slots["nonfinite"].consecutive == 0


def test_skip_then_raise_after_max_consecutive(net):
    poison = Poison()
    state = _setup(net)
    step = af.with_nonfinite(policy="skip", max_consecutive=3)(poison.fn)
    poison.loss = float("nan")
    step(state, make_batch())
    step(state, make_batch())
    before = _snapshot(state)
    with pytest.raises(af.NonFiniteError, match="3 updates in a row"):
        step(state, make_batch())
    _assert_same(before, _snapshot(state))


def test_raise_policy_raises_first_time_with_state_intact(net):
    poison = Poison()
    state = _setup(net)
    step = af.with_nonfinite(policy="raise")(poison.fn)
    step(state, make_batch())
    before = _snapshot(state)
    poison.grad = float("inf")
    with pytest.raises(af.NonFiniteError, match="non-finite gradients at update 1"):
        step(state, make_batch())
    _assert_same(before, _snapshot(state))
    assert all(p.grad is None for p in net.parameters())


def test_off_policy_applies_nan_and_reports_no_skip(net):
    poison = Poison()
    state = _setup(net)
    step = af.with_nonfinite(policy="off")(poison.fn)
    poison.loss = float("nan")
    metrics = step(state, make_batch())
    assert "skipped" not in metrics.keys()
    assert torch.isnan(net.head.weight).any()


def test_guard_reads_the_host_once_per_update_and_off_never(net, monkeypatch):
    reads = []
    for name in ("item", "tolist", "__bool__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=original, _name=name, **k):
            reads.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    # SGD: unlike CPU Adam, it reads nothing on the host itself
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    step = af.with_amp(dtype=torch.bfloat16)(af.with_accumulation(2)(af.with_clipping(classify)))
    step(state, make_batch())
    assert reads == ["tolist"]  # loss and norm, stacked and read once
    reads.clear()
    other = copy.deepcopy(net)
    state = af.TrainState(other, torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9))
    af.with_nonfinite(policy="off")(af.with_accumulation(2)(af.with_clipping(classify)))(
        state, make_batch())
    assert reads == []


# ------------------------------------------------------------- fused optimizers: on the device
def _fused_setup(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return af.TrainState(model, opt, scheduler=sched)


def test_fused_optimizer_skips_on_device_and_settles_next_update(net):
    poison = Poison()
    state = _fused_setup(net)
    step = af.with_clipping(poison.fn)
    step(state, make_batch(seed=0))
    state.sync()
    before = _snapshot(state)
    poison.loss = float("nan")
    metrics = step(state, make_batch(seed=1))
    assert metrics["skipped"] == 1
    state.sync()
    _assert_same(before, _snapshot(state))  # parameters, Adam moments and step, scheduler
    assert state.slots["nonfinite"].skipped == 1


def test_fused_guard_reads_only_the_previous_updates_flags(net, monkeypatch):
    state = _fused_setup(net)
    step = af.with_clipping(classify)
    reads = []
    original = torch.Tensor.tolist

    def spy(self):
        reads.append(self)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    step(state, make_batch(seed=0))
    assert reads == []  # nothing read on the host during the first update
    pending = state.slots["nonfinite"]._pending.host
    step(state, make_batch(seed=1))
    assert len(reads) == 1 and reads[0] is pending  # the earlier update's flags, not this one's


def test_fused_matches_reference_and_scheduler_catches_up(net):
    import copy

    from helpers import as_dict
    from reference import reference_update

    m2 = copy.deepcopy(net)
    state = _fused_setup(net)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2, fused=True)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=1, gamma=0.5)
    step = af.lift(classify)
    for i in range(4):
        batch = make_batch(seed=i)
        metrics = step(state, batch)
        reference_update(m2, o2, as_dict(batch), classify, scheduler=s2)
        assert metrics["lr"] == pytest.approx(1e-2 * 0.5**i)
    state.sync()
    assert state.scheduler.get_last_lr() == s2.get_last_lr()
    for a, b in zip(net.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_fused_divergence_raises_one_update_later_with_state_intact(net):
    poison = Poison()
    state = _fused_setup(net)
    step = af.with_nonfinite(max_consecutive=2)(poison.fn)
    step(state, make_batch())
    poison.loss = float("inf")
    step(state, make_batch())
    step(state, make_batch())  # second bad update, decided on the device
    state_before = _snapshot(state)
    with pytest.raises(af.NonFiniteError, match=r"2 updates in a row.*skipped on the device"):
        step(state, make_batch())  # settles the previous one and raises
    _assert_same(state_before, _snapshot(state))
    guard = state.slots["nonfinite"]
    assert (guard.skipped, guard.consecutive) == (2, 2)  # both were skipped, on the device


def test_sync_probe_finds_no_host_sync_in_a_fused_step_and_the_guard_read_otherwise(net):
    from accelfn.observe.sync_probe import SyncProbe

    fused = _fused_setup(net)
    step = af.with_amp(dtype=torch.bfloat16)(af.with_accumulation(2)(af.with_clipping(classify)))
    for i in range(2):
        step(fused, make_batch(seed=i))
    with SyncProbe(mode="emulate") as probe:
        step(fused, make_batch(seed=3))
    assert probe.syncs == []
    plain = _setup(Net())  # non-fused AdamW: the guard reads its flags before the update
    step(plain, make_batch())
    with SyncProbe(mode="emulate") as probe:
        step(plain, make_batch(seed=1))
    assert [(s.op, s.location.split(":")[0]) for s in probe.syncs] == [
        ("Tensor.tolist", "accelfn/parts/nonfinite.py")]
    (read,) = probe.syncs  # named, with the one-line fix
    assert read.via == GUARD_READ and "fused=True" in read.fix


def test_policy_off_with_fp16_still_skips_loss_scale_overflows_as_grad_scaler_does(net):
    """``off`` adds no check of its own, but an fp16 overflow is skipped as scaler.step does."""
    ref_net = copy.deepcopy(net)
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    step = af.with_nonfinite(policy="off")(af.with_amp(dtype=torch.float16, init_scale=2.0**40)(
        classify))
    ref_opt = torch.optim.SGD(ref_net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    skipped = []
    for i in range(40):  # the huge scale overflows until it has backed off enough
        batch = make_batch(seed=i)
        metrics = step(state, batch)
        assert metrics["loss_scale"].item() == scaler.get_scale()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = classify(ref_net, as_dict(batch))["loss"]
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad(set_to_none=True)
        skipped.append(metrics["skipped"].item())
    assert 0 < sum(skipped) < len(skipped)  # some overflowed and were skipped, then it trained
    assert_params_equal(net, ref_net)


def test_a_finite_loss_and_norm_whose_sum_overflows_are_not_bad():
    # the guard reads loss + norm at once; an overflow of that sum alone is no NaN/Inf (a
    # clipping norm cannot reach it in fp32, a norm reported by another transform might)
    from accelfn.parts.nonfinite import _host_flags

    big, inf = torch.tensor(3e38), torch.tensor(float("inf"))
    assert _host_flags([(big, False), (big, False)]) == [False, False]
    assert _host_flags([(inf, False), (big, False)]) == [True, False]
    assert _host_flags([(big, False), (-inf, False)]) == [False, True]
    assert _host_flags([(big, False), (torch.tensor(True), True)]) == [False, True]


# ------------------------------------------------------------- sparse gradients (nn.Embedding)
class _Sparse(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 4, sparse=True)

    def forward(self, i):
        return self.emb(i).sum(-1)


def _sparse_fn(model, b):
    return torch.nn.functional.mse_loss(model(b["i"]), b["t"])


def _sparse_batch(seed):
    g = torch.Generator().manual_seed(seed)
    return {"i": torch.randint(0, 20, (6,), generator=g), "t": torch.randn(6, generator=g)}


_SPARSE_OPTIMIZERS = {"SGD": lambda p: torch.optim.SGD(p, lr=0.1),
                      "SparseAdam": lambda p: torch.optim.SparseAdam(list(p), lr=0.1)}


@pytest.mark.parametrize("opt", sorted(_SPARSE_OPTIMIZERS))
@pytest.mark.parametrize("policy,micro", [("skip", 1), ("raise", 1), ("skip", 2)])
def test_sparse_gradients_are_checked_and_match_the_plain_loop(opt, policy, micro):
    model, ref = _Sparse(), _Sparse()
    state = af.TrainState(model, _SPARSE_OPTIMIZERS[opt](model.parameters()))
    ref_opt = _SPARSE_OPTIMIZERS[opt](ref.parameters())
    step = af.with_nonfinite(policy=policy)(af.with_accumulation(micro)(_sparse_fn))
    for s in range(3):
        metrics = step(state, _sparse_batch(s))
        assert metrics["skipped"] == 0
        b = _sparse_batch(s)
        for part in ([slice(0, 3), slice(3, 6)] if micro == 2 else [slice(0, 6)]):
            (_sparse_fn(ref, {k: v[part] for k, v in b.items()}) / micro).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_params_equal(model, ref)


def _poison_sparse(g, value):
    g = g.coalesce()
    values = g.values().clone()
    values[0, 0] = value
    return torch.sparse_coo_tensor(g.indices(), values, g.shape, check_invariants=True)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_sparse_gradient_is_caught(value):
    model = _Sparse()
    state = af.TrainState(model, torch.optim.SparseAdam(list(model.parameters()), lr=0.1))
    poisoned = {"on": True}
    model.emb.weight.register_hook(  # one NaN/Inf value in the sparse gradient, finite loss
        lambda g: _poison_sparse(g, value) if poisoned["on"] else g)
    step = af.lift(_sparse_fn)
    before = model.emb.weight.detach().clone()
    metrics = step(state, _sparse_batch(0))
    assert metrics["skipped"] == 1 and torch.isfinite(metrics["loss"])
    assert torch.equal(model.emb.weight, before)
    with pytest.raises(af.NonFiniteError, match="non-finite gradients"):
        af.with_nonfinite(policy="raise")(_sparse_fn)(state, _sparse_batch(1))
    poisoned["on"] = False
    assert step(state, _sparse_batch(2))["skipped"] == 0


# ------------------------------------------------- refused updates: counters and what changed
def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 4))


def _nan_batch(seed):
    batch = make_batch(seed=seed)
    batch["x"][0, 0] = float("nan")
    return batch


def test_refused_update_counts_nothing_and_says_buffers_are_as_the_forward_left_them():
    model, ref = _bn_net(), _bn_net()
    state = _setup(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = af.with_nonfinite(policy="raise")(classify)
    step(state, make_batch(seed=0))
    reference_update(ref, ref_opt, as_dict(make_batch(seed=0)), classify)
    before = _snapshot(state)
    with pytest.raises(af.NonFiniteError) as info:
        step(state, _nan_batch(1))
    message = str(info.value)
    assert "parameters, optimizer state, scheduler, carry, EMA weights and loss scale are " \
           "unchanged" in message and "no state was changed" not in message
    assert "BatchNorm running statistics, are as the forward left them" in message
    assert "reset_running_stats()" in message
    _assert_same(before, _snapshot(state))
    guard = state.slots["nonfinite"]
    assert (guard.skipped, guard.consecutive) == (0, 0)  # refused, not skipped
    # the hand-written loop that skips the step: its forward updated the buffers the same way
    loss = classify(ref, as_dict(_nan_batch(1)))["loss"]
    loss.backward()
    ref_opt.zero_grad(set_to_none=True)
    for (name, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)
    assert model[1].running_mean.isnan().any()
    model[1].reset_running_stats()  # what the message advises
    step(state, make_batch(seed=2))
    assert all(b.isfinite().all() for b in model.buffers())


def test_refusal_at_max_consecutive_counts_the_skips_only():
    state = _setup(Net())
    step = af.with_nonfinite(policy="skip", max_consecutive=3)(classify)
    step(state, _nan_batch(0))
    step(state, _nan_batch(1))
    guard = state.slots["nonfinite"]
    for _ in range(2):  # refused again if the caller carries on with bad data
        with pytest.raises(af.NonFiniteError, match=r"3 updates in a row.*last was refused: "
                                                    "the update was not applied"):
            step(state, _nan_batch(2))
        assert (guard.skipped, guard.consecutive) == (2, 2)
    assert step(state, make_batch(seed=3))["skipped"] == 0
    assert (guard.skipped, guard.consecutive) == (2, 0)


# ------------------------------------ skipped updates that still advance schedules and EMA
def _timm_like_loop(base, batches, poisoned):
    """A loop that steps the scheduler and counts EMA updates after ``scaler.step``
    unconditionally (timm's NativeScaler loop): a skipped update advances them too."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    lrs, ema_updates = [], 0
    for i, batch in enumerate(batches):
        lrs.append(opt.param_groups[0]["lr"])
        with torch.autocast("cpu", dtype=torch.float16):
            loss = classify(model, as_dict(batch))["loss"]
        if i == poisoned:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
        ema_updates += 1
    return model, lrs, ema_updates


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("skipped", ["hold", "advance"])
def test_skipped_updates_advance_the_schedule_and_ema_only_when_asked(skipped, fused):
    """Decided on the host, or on the device by a fused optimizer (read one update later)."""
    from helpers import poisonable

    torch.manual_seed(0)
    base = Net()
    batches = [make_batch(seed=i) for i in range(6)]
    fn, poison = poisonable()
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    state = af.TrainState(model, opt, scheduler=sched)
    step = af.with_ema(decay=0.9)(af.with_nonfinite(skipped=skipped)(
        af.with_amp(dtype=torch.float16, init_scale=2.0**8)(fn)))
    lrs, flags = [], []
    for i, batch in enumerate(batches):
        poison["on"] = i == 2
        metrics = step(state, batch)
        lrs.append(float(metrics["lr"]))
        flags.append(float(metrics["skipped"]))
    state.sync()
    assert flags == [0, 0, 1, 0, 0, 0]
    ema_updates = int(state.get_slot("with_ema").updates)
    if skipped == "advance":
        ref, ref_lrs, ref_ema = _timm_like_loop(base, batches, poisoned=2)
        assert lrs == [torch.tensor(x).item() for x in ref_lrs]
        assert ema_updates == ref_ema == 6
        assert_params_equal(model, ref)
    else:  # the schedule waits for the next applied update
        assert lrs[3] == lrs[2] and ema_updates == 5
    assert "skipped=advance" in repr(step) or skipped == "hold"


def test_an_unknown_skipped_option_is_refused():
    with pytest.raises(ValueError, match="skipped='later'"):
        af.with_nonfinite(skipped="later")
