"""with_amp: bf16 autocast and fp16 with GradScaler, as the seeds write them."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import as_dict, assert_params_equal, classify, clone_setup, make_batch
from reference import reference_update
from torch import nn

import accelfn as af


def test_bf16_equals_autocast_loop_bitwise(net):
    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.AdamW, lr=1e-2)
    step = af.with_amp(dtype=torch.bfloat16)(classify)
    state = af.TrainState(m1, o1)
    for i in range(3):
        batch = make_batch(seed=i)
        metrics = step(state, batch)
        ref = reference_update(m2, o2, as_dict(batch), classify, amp_dtype=torch.bfloat16)
        assert torch.equal(metrics["loss"], ref["losses"][0])
    assert_params_equal(m1, m2)


def test_bf16_really_runs_in_bf16(net):
    dtypes = []
    net.head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    af.with_amp(dtype=torch.bfloat16)(classify)(state, make_batch())
    assert dtypes == [torch.bfloat16]
    af.with_amp(dtype=torch.bfloat16)(classify).evaluate(state, make_batch())
    assert dtypes[-1] == torch.bfloat16


def test_fp16_with_grad_scaler_equals_reference(net):
    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.SGD, momentum=0.9)
    step = af.with_amp(dtype=torch.float16)(af.with_accumulation(2)(classify))
    state = af.TrainState(m1, o1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000)
    for i in range(3):
        batch = make_batch(seed=i)
        metrics = step(state, batch)
        reference_update(m2, o2, as_dict(batch), classify, amp_dtype=torch.float16,
                         scaler=scaler, micro=2)
        assert metrics["loss_scale"] == 2.0**16
        assert metrics["skipped"] == 0
    assert_params_equal(m1, m2)
    saved = state.state_dict()["slots"]["with_amp"]
    assert saved["scale"] == scaler.get_scale()


def test_fp16_overflow_skips_update_and_halves_scale(net):
    blow_up = {"on": False}

    def fn(model, batch):
        out = classify(model, batch)
        if blow_up["on"]:
            out["loss"] = out["loss"] * 1e30  # finite in fp32, overflows fp16 gradients
        return out

    sched_opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=1, gamma=0.5)
    state = af.TrainState(net, sched_opt, scheduler=sched)
    step = af.with_amp(dtype=torch.float16)(fn)
    step(state, make_batch(seed=0))
    params = [p.detach().clone() for p in net.parameters()]
    opt_state = {k: v.clone() for k, v in sched_opt.state[next(net.parameters())].items()}
    lr = sched.get_last_lr()
    blow_up["on"] = True
    metrics = step(state, make_batch(seed=1))
    assert metrics["skipped"] == 1
    assert metrics["loss_scale"] == 2.0**16
    assert state.slots["with_amp"].get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(params, net.parameters()))
    for k, v in sched_opt.state[next(net.parameters())].items():
        assert torch.equal(v, opt_state[k]), k
    assert sched.get_last_lr() == lr
    assert state.slots["nonfinite"].consecutive == 0  # overflow is not divergence
    blow_up["on"] = False
    metrics = step(state, make_batch(seed=2))
    assert metrics["skipped"] == 0 and metrics["loss_scale"] == 2.0**15


class Recurrent(nn.Module):
    """The seeds' example: conv features, an LSTM that must stay fp32, a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(6, 8, 1)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = self.conv(x.unsqueeze(-1)).transpose(1, 2)
        out, _ = self.lstm(h)
        return self.fc(out[:, -1])


@pytest.mark.parametrize("spec", [nn.LSTM, "lstm", lambda name, m: name == "lstm"])
def test_fp32_islands(spec):
    torch.manual_seed(0)
    model = Recurrent()
    seen = {}
    model.lstm.register_forward_hook(lambda m, i, o: seen.__setitem__("lstm", o[0].dtype))
    model.conv.register_forward_hook(lambda m, i, o: seen.__setitem__("conv", o.dtype))
    model.fc.register_forward_hook(lambda m, i, o: seen.__setitem__("fc", o.dtype))
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    af.with_amp(dtype=torch.bfloat16, fp32=spec)(classify)(state, make_batch())
    assert seen == {"conv": torch.bfloat16, "lstm": torch.float32, "fc": torch.bfloat16}
    assert set(model.state_dict()) == set(Recurrent().state_dict())


def test_fp32_islands_match_hand_written_autocast_off():
    torch.manual_seed(0)
    model = Recurrent()
    (m1, o1), (m2, o2) = clone_setup(model)

    def by_hand(model, batch):
        h = model.conv(batch["x"].unsqueeze(-1)).transpose(1, 2)
        with torch.autocast("cpu", enabled=False):
            out, _ = model.lstm(h.float())
        return F.cross_entropy(model.fc(out[:, -1]), batch["y"])

    state = af.TrainState(m1, o1)
    batch = make_batch()
    af.with_amp(dtype=torch.bfloat16, fp32=nn.LSTM)(classify)(state, batch)
    reference_update(m2, o2, as_dict(batch), by_hand, amp_dtype=torch.bfloat16)
    assert_params_equal(m1, m2)


def test_fp32_spec_matching_nothing_is_an_error(net):
    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="matched no module"):
        af.with_amp(dtype=torch.bfloat16, fp32=nn.LSTM)(classify)(state, make_batch())


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"init_scale": float("inf")}, ValueError, r"init_scale=inf.*finite number > 0"),
    ({"init_scale": float("nan")}, ValueError, r"init_scale=nan.*finite number > 0"),
    ({"init_scale": 0.0}, ValueError, r"init_scale=0\.0.*finite number > 0"),
    ({"init_scale": -1}, ValueError, r"init_scale=-1.*finite number > 0"),
    ({"init_scale": 1e39}, ValueError, r"init_scale=1e\+39.*float32's largest"),
    ({"init_scale": "65536"}, TypeError, r"init_scale='65536'.*finite number > 0"),
    ({"init_scale": True}, TypeError, r"init_scale=True.*finite number > 0"),
    ({"init_scale": torch.tensor(2.0)}, TypeError, r"init_scale=tensor.*finite number > 0"),
    ({"growth_interval": 2.7}, TypeError, r"growth_interval=2\.7.*int >= 1"),
    ({"growth_interval": 2.0}, TypeError, r"growth_interval=2\.0.*int >= 1"),
    ({"growth_interval": True}, TypeError, r"growth_interval=True.*int >= 1"),
    ({"growth_interval": "10"}, TypeError, r"growth_interval='10'.*int >= 1"),
    ({"growth_interval": 0}, ValueError, r"growth_interval=0.*int >= 1"),
])
def test_bad_scaler_options_are_refused_when_built(options, error, match):
    with pytest.raises(error, match=match):
        af.with_amp(dtype=torch.float16, **options)
    with pytest.raises(error, match=match):
        af.with_amp(**options)(classify)


def test_good_scaler_options_reach_the_grad_scaler(net):
    import numpy as np

    state = af.TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    step = af.with_amp(dtype=torch.float16, init_scale=np.float32(1024),
                       growth_interval=np.int64(3))(classify)
    metrics = step(state, make_batch())
    assert metrics["loss_scale"] == 1024.0
    assert state.slots["with_amp"].get_growth_interval() == 3
    assert type(state.slots["with_amp"].get_growth_interval()) is int


class Attention(nn.Module):
    """Parameter-free scores (a matmul autocast would run in low precision) and softmax."""

    def forward(self, q, k):
        self.autocast_seen = (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda"))
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ k


class AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.attn = Attention()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.inp(x).unsqueeze(0)
        return self.head(self.attn(h, h).squeeze(0))


def test_fp32_island_without_parameters_runs_in_fp32_and_matches_autocast_off():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = clone_setup(AttnNet())
    seen = []
    m1.attn.register_forward_hook(lambda m, i, o: seen.append(o.dtype))

    def by_hand(model, batch):
        h = model.inp(batch["x"]).unsqueeze(0)
        with torch.autocast("cpu", enabled=False):
            a = model.attn(h.float(), h.float())
        return F.cross_entropy(model.head(a.squeeze(0)), batch["y"])

    state = af.TrainState(m1, o1)
    for i in range(2):
        af.with_amp(dtype=torch.bfloat16, fp32=Attention)(classify)(state, make_batch(seed=i))
        reference_update(m2, o2, as_dict(make_batch(seed=i)), by_hand, amp_dtype=torch.bfloat16)
    assert seen == [torch.float32, torch.float32]
    assert_params_equal(m1, m2)


def test_fp32_island_without_parameters_turns_the_accelerators_autocast_off(monkeypatch):
    # a parameter-free island on a GPU: the autocast to turn off is the GPU's, not the CPU's
    # (simulated on the CPU: the accelerator is said to be cuda and its autocast flag is set)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda *a, **k: torch.device("cuda"))
    model = AttnNet()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_amp(dtype=torch.bfloat16, fp32=Attention)(classify)
    was = torch.is_autocast_enabled("cuda")
    torch.set_autocast_enabled("cuda", True)
    try:
        step(state, make_batch())
        assert torch.is_autocast_enabled("cuda")
    finally:
        torch.set_autocast_enabled("cuda", was)
    assert model.attn.autocast_seen == (False, False)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_the_cpu_is_bf16_only_where_computed_natively(net, monkeypatch, native):
    """Emulated bf16 (no AVX-512/AMX) runs many times slower than float32: auto keeps float32
    there (autocast off, the plain fp32 loop bitwise) and says so; bf16 where native."""
    from accelfn.parts import precision as amp

    monkeypatch.setattr(amp, "_cpu_bf16", lambda: native)
    dtypes = []
    net.head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    (m1, o1), (m2, o2) = clone_setup(net, torch.optim.SGD)
    state = af.TrainState(m1, o1)
    step = af.with_amp(classify)
    if native:
        step(state, make_batch())
        ref = reference_update(m2, o2, as_dict(make_batch()), classify, amp_dtype=torch.bfloat16)
    else:
        with pytest.warns(RuntimeWarning, match="no native bf16"):
            step(state, make_batch())
        ref = reference_update(m2, o2, as_dict(make_batch()), classify)
    assert dtypes[0] == (torch.bfloat16 if native else torch.float32)
    assert ref["losses"]
    assert_params_equal(m1, m2)
    assert "with_amp" not in state.slots  # no loss scaler either way


# ------------------------------------------------- a module called twice in one forward
def _twice(model, batch):
    """A discriminator on real, then on fake: the same Linear twice in one step."""
    return {"loss": model(batch["real"]).mean() - model(batch["fake"]).mean()}


def _two_regions(model, batch):
    """The plain loop's other way: one autocast region per call."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = model(batch["real"]).mean()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fake = model(batch["fake"]).mean()
    return real - fake


@pytest.mark.parametrize("cache", [True, False])
def test_a_module_called_twice_sums_its_weight_gradients_in_fp32_without_the_cache(cache):
    torch.manual_seed(0)
    base = nn.Linear(64, 64)
    g = torch.Generator().manual_seed(1)
    batch = {"real": torch.randn(32, 64, generator=g), "fake": torch.randn(32, 64, generator=g)}
    grads = {}
    step = af.with_amp(dtype=torch.bfloat16, cache=cache)(_twice)
    probe = af.GradientTransform("probe", lambda gs, ps, s: grads.update(ours=gs[0].clone()))
    model = copy.deepcopy(base)
    probe(step)(af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.0)), batch)
    plain = copy.deepcopy(base)
    _two_regions(plain, batch).backward()
    same = torch.equal(grads["ours"], plain.weight.grad)
    assert same == (not cache)  # the cache sums the two in bf16: not the fp32 sum
    if cache:
        rel = ((grads["ours"] - plain.weight.grad).norm() / plain.weight.grad.norm()).item()
        assert 0 < rel < 1e-2
    assert ("cache=False" in repr(step)) == (not cache)


def test_cache_takes_a_bool():
    with pytest.raises(TypeError, match="cache"):
        af.with_amp(cache="no")  # type: ignore[arg-type]
