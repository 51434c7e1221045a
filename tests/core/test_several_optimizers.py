"""Several optimizers in one TrainState, and several states in one process.

A TrainState may hold Muon for the hidden matrices and AdamW for the rest: one update steps
every optimizer, clipping's norm is over ``model.parameters()``, one non-finite decision
skips all of them or none, fp16 uses one GradScaler (``unscale_`` each, step each, one
``update()``). Each case is checked against a plain PyTorch loop written here (nothing from
accelfn), bitwise in fp32.

Several models (a GAN, a frozen teacher) are several states and steps: a step applies only
its own loss's gradients, as a loop that calls ``netD.zero_grad()`` / ``netG.zero_grad()``
before each backward (pytorch/examples' dcgan) does, and computes none for the parameters
it does not train.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import Net, as_dict, assert_params_equal, classify, make_batch, poisonable, roundtrip
from reference import chunks
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import accelfn as af

MAX_NORM = 0.3  # below the gradients' norm on these batches: clipping really scales them
MICRO = 3  # 10 samples: micro-batches of 4, 3 and 3


# ----------------------------------------------------------------- the two optimizers
def hidden(name: str, p: torch.Tensor) -> bool:
    """The blocks' matrices: what Muon trains (it refuses anything but 2-D parameters)."""
    return name.startswith("blocks.") and p.ndim == 2


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if hidden(n, p)], lr=0.05, momentum=0.9,
                            weight_decay=0.01)
    adamw = torch.optim.AdamW([p for n, p in named if not hidden(n, p)], lr=1e-2,
                              weight_decay=0.01)
    return [muon, adamw]


def schedulers(opts: list[torch.optim.Optimizer]) -> list[LambdaLR]:
    muon, adamw = opts
    return [LambdaLR(muon, lambda s: 1.0 / (1 + s)),  # decays from the first update
            LambdaLR(adamw, lambda s: min(1.0, (s + 1) / 3))]  # warms up over 3 updates


def setup(seed: int = 0):
    """(model, optimizers, schedulers) built alike from ``seed``."""
    torch.manual_seed(seed)
    model = Net()
    opts = optimizers(model)
    return model, opts, schedulers(opts)


# ----------------------------------------------------------------- the plain loop
def plain_update(model, opts, scheds, batch: dict, loss_fn=classify, *, micro: int = 1,
                 max_norm: float | None = None, scaler: torch.amp.GradScaler | None = None,
                 ) -> dict:
    """One update the plain way: each micro-batch's loss weighted by its share of the samples,
    (scaled) backward; ``unscale_`` each optimizer, clip over ``model.parameters()``, step
    each (through the scaler), one ``scaler.update()``, step each scheduler, clear."""
    total = len(batch["y"])
    for piece in chunks(batch, micro) if micro > 1 else [batch]:
        if scaler is not None:
            with torch.autocast("cpu", dtype=torch.float16):
                out = loss_fn(model, piece)
        else:
            out = loss_fn(model, piece)
        loss = out["loss"] if isinstance(out, dict) else out
        if micro > 1:
            loss = loss * (len(piece["y"]) / total)
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
    if scaler is not None:
        for optimizer in opts:
            scaler.unscale_(optimizer)
    norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if max_norm is not None else None)
    for optimizer in opts:
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
    if scaler is not None:
        scaler.update()
    for scheduler in scheds:
        scheduler.step()
    for optimizer in opts:
        optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": norm}


# ----------------------------------------------------------------- comparisons
def assert_optimizers_equal(got: list[torch.optim.Optimizer],
                            want: list[torch.optim.Optimizer]) -> None:
    """Every optimizer's state and hyper-parameters, bitwise."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa["param_groups"] == sb["param_groups"], f"optimizer {i} groups"
        assert sa["state"].keys() == sb["state"].keys(), f"optimizer {i}"
        assert sa["state"], f"optimizer {i} has no state: it never stepped"
        for key, values in sa["state"].items():
            assert values.keys() == sb["state"][key].keys()
            for name, value in values.items():
                other = sb["state"][key][name]
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, other), (
                        f"optimizer {i} ({type(a).__name__}) param {key} {name}: max "
                        f"{(value.float() - other.float()).abs().max()}")
                else:
                    assert value == other, (i, key, name)


def assert_schedulers_equal(got, want) -> None:
    for a, b in zip(got, want):
        assert a.state_dict() == b.state_dict()
        assert a.get_last_lr() == b.get_last_lr()


def assert_same_training(state: af.TrainState, model, opts, scheds) -> None:
    assert_params_equal(state.model, model)
    assert_optimizers_equal(list(state.optimizers), opts)
    assert_schedulers_equal(state.schedulers, scheds)


def frozen(model, opts, scheds) -> dict:
    """A deep copy of the parameters, optimizers' and schedulers' states."""
    return copy.deepcopy({"model": model.state_dict(),
                          "optimizers": [o.state_dict() for o in opts],
                          "schedulers": [s.state_dict() for s in scheds]})


def assert_unchanged(before: dict, model, opts, scheds) -> None:
    now = frozen(model, opts, scheds)
    for name, value in before["model"].items():
        assert torch.equal(value, now["model"][name]), name
    for i, (a, b) in enumerate(zip(before["optimizers"], now["optimizers"])):
        assert a["param_groups"] == b["param_groups"], i
        assert a["state"].keys() == b["state"].keys(), i
        for key in a["state"]:
            for name, value in a["state"][key].items():
                other = b["state"][key][name]
                assert (torch.equal(value, other) if isinstance(value, torch.Tensor)
                        else value == other), (i, key, name)
    assert before["schedulers"] == now["schedulers"]


# ----------------------------------------------------------------- 1, 2: against the loop
def test_muon_and_adamw_with_accumulation_clipping_and_schedulers_equal_the_plain_loop():
    model, opts, scheds = setup()
    plain = copy.deepcopy(model)
    p_opts = optimizers(plain)
    p_scheds = schedulers(p_opts)
    assert [len(g["params"]) for g in p_opts[0].param_groups] == [6]  # 2 matrices a block
    state = af.TrainState(model, opts, scheduler=scheds)
    step = af.with_accumulation(MICRO)(af.with_clipping(max_norm=MAX_NORM)(classify))
    clipped = []
    for i in range(4):
        batch = make_batch(n=10, seed=i)
        metrics = step(state, batch)
        ref = plain_update(plain, p_opts, p_scheds, as_dict(batch), micro=MICRO,
                           max_norm=MAX_NORM)
        assert torch.equal(metrics["grad_norm"], ref["grad_norm"]), i
        clipped.append(float(ref["grad_norm"]) > MAX_NORM)
        assert_same_training(state, plain, p_opts, p_scheds)  # after every update
    assert any(clipped)  # the clipping was not a no-op
    assert state.step == 4
    assert [s.last_epoch for s in state.schedulers] == [4, 4]
    # each optimizer updated its own parameters: Muon's matrices moved by Muon's rule
    assert {id(p) for p in opts[0].state} == {
        id(p) for n, p in model.named_parameters() if hidden(n, p)}


def test_fp16_one_grad_scaler_for_both_optimizers_equals_pytorch_amp_recipe():
    # growth_interval=2: the scale doubles every second update, as one scaler.update() per
    # update does (an update() per optimizer would double it every update)
    model, opts, scheds = setup()
    plain = copy.deepcopy(model)
    p_opts = optimizers(plain)
    p_scheds = schedulers(p_opts)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    state = af.TrainState(model, opts, scheduler=scheds)
    step = af.with_amp(dtype=torch.float16, init_scale=2.0**10, growth_interval=2)(
        af.with_accumulation(MICRO)(af.with_clipping(max_norm=MAX_NORM)(classify)))
    scales = []
    for i in range(4):
        batch = make_batch(n=10, seed=i)
        used = scaler.get_scale()
        metrics = step(state, batch)
        ref = plain_update(plain, p_opts, p_scheds, as_dict(batch), micro=MICRO,
                           max_norm=MAX_NORM, scaler=scaler)
        assert float(metrics["skipped"]) == 0
        assert float(metrics["loss_scale"]) == used
        scales.append(used)
        assert torch.equal(metrics["grad_norm"], ref["grad_norm"]), i
        assert_same_training(state, plain, p_opts, p_scheds)
    assert scales == [2.0**10, 2.0**10, 2.0**11, 2.0**11]
    assert state.slots["with_amp"].get_scale() == scaler.get_scale() == 2.0**12


# ----------------------------------------------------------------- 3: resume
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_resume_restores_both_optimizers_and_schedulers_exactly(fp16):
    def build(seed):
        model, opts, scheds = setup(seed)
        step = af.with_accumulation(MICRO)(af.with_clipping(max_norm=MAX_NORM)(classify))
        if fp16:
            step = af.with_amp(dtype=torch.float16, growth_interval=2)(step)
        return af.TrainState(model, opts, scheduler=scheds), step

    batches = [make_batch(n=10, seed=i) for i in range(5)]
    straight, step = build(0)
    for batch in batches[:2]:
        step(straight, batch)
    saved = roundtrip(straight.state_dict())  # a checkpoint file's round trip
    assert isinstance(saved["optimizer"], list) and len(saved["optimizer"]) == 2
    assert isinstance(saved["scheduler"], list) and len(saved["scheduler"]) == 2
    for batch in batches[2:]:
        step(straight, batch)

    resumed, step2 = build(1)  # other weights: only the checkpoint makes them equal
    resumed.load_state_dict(saved)
    assert resumed.step == 2
    for batch in batches[2:]:
        step2(resumed, batch)
    assert_same_training(resumed, straight.model, list(straight.optimizers),
                         list(straight.schedulers))
    assert resumed.step == straight.step == 5
    if fp16:
        assert resumed.slots["with_amp"].get_scale() == straight.slots["with_amp"].get_scale()


# ----------------------------------------------------------------- 4: refusals
def test_a_parameter_in_two_optimizers_is_refused_naming_it():
    torch.manual_seed(0)
    model = Net()
    matrices = [p for n, p in model.named_parameters() if hidden(n, p)]
    muon = torch.optim.Muon(matrices, lr=0.02)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the matrices again
    with pytest.raises(ValueError, match=r"'blocks\.0\.fc1\.weight' is in optimizer 0 and "
                                         r"optimizer 1"):
        af.TrainState(model, [muon, adamw])


def test_an_optimizer_holding_a_foreign_parameter_is_refused():
    torch.manual_seed(0)
    model = Net()
    muon, _ = optimizers(model)
    rest = [p for n, p in model.named_parameters() if not hidden(n, p)]
    stranger = nn.Parameter(torch.zeros(3))
    adamw = torch.optim.AdamW([*rest, stranger], lr=1e-3)
    with pytest.raises(ValueError, match=r"optimizer 1 holds 1 parameter.* not the model's"):
        af.TrainState(model, [muon, adamw])


def test_schedulers_must_be_one_per_optimizer_in_order():
    torch.manual_seed(0)
    model = Net()
    opts = optimizers(model)
    s_muon, s_adamw = schedulers(opts)
    with pytest.raises(ValueError, match=r"2 optimizer.* and 1 scheduler.*one scheduler per "
                                         r"optimizer"):
        af.TrainState(model, opts, scheduler=[s_muon])
    with pytest.raises(ValueError, match="one scheduler per optimizer"):
        af.TrainState(model, opts, scheduler=[s_muon, s_adamw, None])
    with pytest.raises(ValueError, match="give a list with one scheduler per optimizer"):
        af.TrainState(model, opts, scheduler=s_muon)  # one scheduler for two optimizers
    with pytest.raises(ValueError, match="scheduler 0 was built for another optimizer than "
                                         "optimizer 0"):
        af.TrainState(model, opts, scheduler=[s_adamw, s_muon])
    state = af.TrainState(model, opts, scheduler=[None, s_adamw])  # None entries are fine
    assert state.schedulers == (None, s_adamw)


def test_state_optimizer_of_two_points_to_state_optimizers():
    model, opts, scheds = setup()
    state = af.TrainState(model, opts, scheduler=scheds)
    assert state.optimizers == tuple(opts)
    assert state.schedulers == tuple(scheds)
    with pytest.raises(AttributeError, match=r"2 optimizers \(Muon, AdamW\); use "
                                             r"state\.optimizers"):
        state.optimizer  # noqa: B018
    with pytest.raises(AttributeError, match=r"state\.schedulers"):
        state.scheduler  # noqa: B018


def test_a_checkpoint_of_two_optimizers_does_not_load_into_one_and_back():
    model, opts, scheds = setup()
    two = af.TrainState(model, opts, scheduler=scheds)
    af.with_accumulation(MICRO)(classify)(two, make_batch(n=10))
    saved = roundtrip(two.state_dict())

    torch.manual_seed(1)
    single = Net()
    one = af.TrainState(single, torch.optim.AdamW(single.parameters(), lr=1e-3))
    before = copy.deepcopy(one.state_dict())
    with pytest.raises(ValueError, match=r"checkpoint holds 2 optimizer.*this state 1"):
        one.load_state_dict(saved)
    after = one.state_dict()  # refused whole: nothing loaded
    for name, value in before["model"].items():
        assert torch.equal(value, after["model"][name]), name
    assert after["optimizer"] == before["optimizer"] and one.step == 0

    af.lift(classify)(one, make_batch(n=10))
    with pytest.raises(ValueError, match=r"checkpoint holds 1 optimizer.*this state 2"):
        two.load_state_dict(roundtrip(one.state_dict()))


# ----------------------------------------------------------------- 5: metrics, skipping
def test_lr_metrics_are_each_optimizers_rate_the_update_used():
    model, opts, scheds = setup()
    state = af.TrainState(model, opts, scheduler=scheds)
    step = af.lift(classify)
    for i in range(3):
        metrics = step(state, make_batch(seed=i))
        assert set(metrics.keys()) == {"loss", "accuracy", "lr", "lr/muon", "lr/adamw",
                                       "skipped"}
        muon_lr = 0.05 * (1.0 / (1 + i))  # LambdaLR: base rate times lambda(update index)
        adamw_lr = 1e-2 * min(1.0, (i + 1) / 3)
        assert torch.equal(metrics["lr/muon"], torch.tensor(muon_lr)), i
        assert torch.equal(metrics["lr/adamw"], torch.tensor(adamw_lr)), i
        assert torch.equal(metrics["lr"], metrics["lr/muon"])  # the first optimizer's
    assert not math.isclose(float(metrics["lr/muon"]), float(metrics["lr/adamw"]))

    torch.manual_seed(0)
    model2 = Net()
    muon2, adamw2 = optimizers(model2)  # no schedulers: their base rates
    swapped = af.TrainState(model2, [adamw2, muon2])  # AdamW first: lr is AdamW's
    metrics = af.lift(classify)(swapped, make_batch())
    assert torch.equal(metrics["lr"], torch.tensor(1e-2))
    assert torch.equal(metrics["lr/muon"], torch.tensor(0.05))


def test_lr_metrics_of_two_optimizers_of_one_class_are_numbered():
    torch.manual_seed(0)
    model = Net()
    named = list(model.named_parameters())
    a = torch.optim.AdamW([p for n, p in named if hidden(n, p)], lr=1e-2)
    b = torch.optim.AdamW([p for n, p in named if not hidden(n, p)], lr=1e-3)
    metrics = af.lift(classify)(af.TrainState(model, [a, b]), make_batch())
    assert torch.equal(metrics["lr/adamw"], torch.tensor(1e-2))
    assert torch.equal(metrics["lr/adamw_1"], torch.tensor(1e-3))


def test_a_non_finite_loss_skips_both_optimizers_and_both_schedulers():
    fn, poison = poisonable()
    model, opts, scheds = setup()
    state = af.TrainState(model, opts, scheduler=scheds)
    step = af.with_accumulation(MICRO)(fn)
    plain = copy.deepcopy(model)
    p_opts = optimizers(plain)
    p_scheds = schedulers(p_opts)
    assert float(step(state, make_batch(n=10, seed=0))["skipped"]) == 0
    plain_update(plain, p_opts, p_scheds, as_dict(make_batch(n=10, seed=0)), micro=MICRO)
    before = frozen(model, opts, scheds)
    poison["on"] = True
    metrics = step(state, make_batch(n=10, seed=1))
    poison["on"] = False
    assert float(metrics["skipped"]) == 1
    assert_unchanged(before, model, opts, scheds)  # parameters, both states, both schedules
    assert all(p.grad is None for p in model.parameters())
    # the next update goes on as if the skipped one had not been tried
    metrics = step(state, make_batch(n=10, seed=2))
    plain_update(plain, p_opts, p_scheds, as_dict(make_batch(n=10, seed=2)), micro=MICRO)
    assert float(metrics["skipped"]) == 0
    assert_same_training(state, plain, p_opts, p_scheds)
    assert state.step == 3 and [s.last_epoch for s in scheds] == [2, 2]


def test_an_fp16_overflow_skips_both_optimizers_and_halves_the_one_scale():
    blow_up = {"on": False}

    def fn(model, batch):
        out = classify(model, batch)
        if blow_up["on"]:
            out["loss"] = out["loss"] * 1e30  # finite in fp32, overflows fp16 gradients
        return out

    model, opts, scheds = setup()
    state = af.TrainState(model, opts, scheduler=scheds)
    step = af.with_amp(dtype=torch.float16)(fn)
    step(state, make_batch(seed=0))
    before = frozen(model, opts, scheds)
    blow_up["on"] = True
    metrics = step(state, make_batch(seed=1))
    assert float(metrics["skipped"]) == 1
    assert state.slots["with_amp"].get_scale() == 2.0**15  # one update(): halved once
    assert_unchanged(before, model, opts, scheds)


# ----------------------------------------------------------------- 6: other paths
def test_evaluate_with_two_optimizers_changes_nothing():
    model, opts, scheds = setup()
    state = af.TrainState(model, opts, scheduler=scheds)
    step = af.with_accumulation(MICRO)(af.with_clipping(max_norm=MAX_NORM)(classify))
    step(state, make_batch(n=10, seed=0))
    before = frozen(model, opts, scheds)
    batch = make_batch(n=10, seed=1)
    metrics = step.evaluate(state, batch)
    assert_unchanged(before, model, opts, scheds)
    assert state.step == 1 and model.training
    with torch.no_grad():
        expected = classify(model.eval(), as_dict(batch))
    model.train()
    torch.testing.assert_close(metrics["loss"], expected["loss"])


def test_ema_averages_after_each_update_of_both_optimizers():
    model, opts, scheds = setup()
    plain = copy.deepcopy(model)
    p_opts = optimizers(plain)
    p_scheds = schedulers(p_opts)
    averaged = AveragedModel(plain, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    state = af.TrainState(model, opts, scheduler=scheds)
    step = af.with_ema(decay=0.9)(af.with_accumulation(MICRO)(classify))
    for i in range(3):
        batch = make_batch(n=10, seed=i)
        step(state, batch)
        plain_update(plain, p_opts, p_scheds, as_dict(batch), micro=MICRO)
        averaged.update_parameters(plain)
    assert_same_training(state, plain, p_opts, p_scheds)
    got, want = af.ema_state_dict(state), averaged.module.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert not torch.equal(got["head.weight"], model.head.weight)  # really an average


@pytest.mark.compile
def test_compiled_step_with_two_optimizers_equals_the_plain_loop():
    # aot_eager traces through AOTAutograd without generating code (seconds); its kernels are
    # eager PyTorch's, so the result is the plain loop's bitwise
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = Net(depth=1)
        opts = optimizers(model)
        scheds = schedulers(opts)
        plain = copy.deepcopy(model)
        p_opts = optimizers(plain)
        p_scheds = schedulers(p_opts)
        state = af.TrainState(model, opts, scheduler=scheds)
        step = af.compiled(backend="aot_eager")(af.with_clipping(max_norm=MAX_NORM)(classify))
        for i in range(3):
            batch = make_batch(n=10, seed=i)
            metrics = step(state, batch)
            plain_update(plain, p_opts, p_scheds, as_dict(batch), max_norm=MAX_NORM)
            assert set(metrics.keys()) >= {"lr", "lr/muon", "lr/adamw", "grad_norm"}
        assert counters["stats"]["unique_graphs"] >= 1  # it really compiled
        assert_same_training(state, plain, p_opts, p_scheds)
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------- 7: several states
class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def gan_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(8, 6, generator=g), "z": torch.randn(8, 4, generator=g)}


def gan_pair():
    torch.manual_seed(0)
    G, D = Generator(), Discriminator()
    return G, D


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def test_gan_steps_apply_their_own_loss_only_as_dcgan_s_loop():
    # the leak: stepG's backward through D left gradients on D's parameters, and the next
    # stepD added its own to them (the plain loop clears them with netD.zero_grad())
    G, D = gan_pair()
    netG, netD = copy.deepcopy(G), copy.deepcopy(D)
    stateG, stateD = af.TrainState(G, sgd(G)), af.TrainState(D, sgd(D))
    stepD = af.lift(lambda d, b: (d(b["x"]) - d(G(b["z"]).detach())).pow(2).mean())
    stepG = af.lift(lambda g, b: D(g(b["z"])).mean())
    optD, optG = sgd(netD), sgd(netG)

    def plain_d(b):
        netD.zero_grad()
        loss = (netD(b["x"]) - netD(netG(b["z"]).detach())).pow(2).mean()
        loss.backward()
        optD.step()

    def plain_g(b):
        netG.zero_grad()
        loss = netD(netG(b["z"])).mean()
        loss.backward()
        optG.step()

    for i in range(2):
        stepD(stateD, gan_batch(2 * i))
        plain_d(gan_batch(2 * i))
        assert all(p.grad is None for p in G.parameters())
        stepG(stateG, gan_batch(2 * i + 1))
        plain_g(gan_batch(2 * i + 1))
        # no gradients computed for the parameters stepG does not train
        assert all(p.grad is None for p in D.parameters())
        assert all(p.grad is None for p in G.parameters())
    stepD(stateD, gan_batch(4))
    plain_d(gan_batch(4))
    assert_params_equal(D, netD)
    assert_params_equal(G, netG)
    assert not torch.equal(D.net[0].weight, gan_pair()[1].net[0].weight)  # it trained


def test_a_step_drops_gradients_left_on_its_parameters_before_its_window():
    # a backward outside any step (an analysis, a penalty computed by hand) leaves gradients
    # on the model: the step's update is still its own loss's alone
    model, opts, scheds = setup()
    plain = copy.deepcopy(model)
    p_opts = optimizers(plain)
    p_scheds = schedulers(p_opts)
    state = af.TrainState(model, opts, scheduler=scheds)
    classify(model, make_batch(seed=7))["loss"].mul(100).backward()  # stray gradients
    step = af.with_accumulation(MICRO)(classify)
    step(state, make_batch(n=10, seed=0))
    plain_update(plain, p_opts, p_scheds, as_dict(make_batch(n=10, seed=0)), micro=MICRO)
    assert_same_training(state, plain, p_opts, p_scheds)


T = 2.0  # the distillation temperature


@pytest.mark.parametrize("other_state", [False, True], ids=["alone", "beside_another_state"])
def test_distillation_from_a_frozen_teacher_equals_the_plain_loop(other_state, monkeypatch):
    torch.manual_seed(1)
    teacher = Net().requires_grad_(False).eval()
    teacher_before = copy.deepcopy(teacher.state_dict())
    torch.manual_seed(0)
    student = Net()
    plain = copy.deepcopy(student)

    def distill(model, batch):
        logits = model(batch["x"])
        target = teacher(batch["x"])
        kl = F.kl_div(F.log_softmax(logits / T, -1), F.log_softmax(target / T, -1),
                      reduction="batchmean", log_target=True) * (T * T)
        ce = F.cross_entropy(logits, batch["y"])
        return {"loss": 0.7 * kl + 0.3 * ce, "kl": kl.detach()}

    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    state = af.TrainState(student, opt)
    if other_state:  # several states live: backward(inputs=) the student's parameters
        bystander = Net()
        keep = af.TrainState(bystander, torch.optim.SGD(bystander.parameters(), lr=0.1))
        assert keep is not None
        assert af.TrainState.several_alive()
    else:  # alone: states other tests keep alive must not choose the path this case checks
        monkeypatch.setattr(af.TrainState, "several_alive", staticmethod(lambda: False))
    p_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    step = af.with_accumulation(MICRO)(distill)
    for i in range(3):
        batch = make_batch(n=10, seed=i)
        metrics = step(state, batch)
        total = len(batch["y"])
        for piece in chunks(as_dict(batch), MICRO):
            (distill(plain, piece)["loss"] * (len(piece["y"]) / total)).backward()
        p_opt.step()
        p_opt.zero_grad()
        assert "kl" in metrics.keys()
    assert_params_equal(student, plain)
    assert_optimizers_equal([opt], [p_opt])
    assert all(p.grad is None for p in teacher.parameters())
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, teacher_before[name]), name
