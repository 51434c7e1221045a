"""with_float8: torchao's float8 Linear layers, emulated on the CPU, against bf16 and by hand."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys

import pytest
import torch
import torch.nn.functional as F
import torchao.float8 as float8  # the test extra installs accelfn[float8]
from helpers import as_dict, roundtrip, torchrun
from reference import reference_update
from tensordict import TensorDict
from torch import nn
from torchao.float8.float8_linear import Float8Linear

import accelfn as af
from accelfn import with_float8
from accelfn.core.contexts import CallContext
from accelfn.parts.float8 import SHAPE_RULES, Float8, eligible, plan
from accelfn.testing import check_transform, plain_update
from accelfn.transforms.float8 import float8_layers

BF16 = af.with_amp(dtype=torch.bfloat16)  # bf16 autocast whatever the CPU computes natively


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLP(nn.Module):
    """Input 8 wide (not a multiple of 16: never converted), blocks, a 5-way head."""

    def __init__(self, dim: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(depth)))
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def mlp(dim: int = 64) -> MLP:
    torch.manual_seed(0)
    return MLP(dim)


def batches(n: int, size: int = 64, seed: int = 1) -> list[TensorDict]:
    g = torch.Generator().manual_seed(seed)
    return [TensorDict({"x": torch.randn(size, 8, generator=g),
                        "y": torch.randint(0, 5, (size,), generator=g)}, batch_size=[size])
            for _ in range(n)]


def ce(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def by_hand(model: nn.Module, min_features: int = 16, **config) -> nn.Module:
    """What with_float8 is equivalent to: torchao's conversion, written out."""
    def chosen(module: nn.Module, fqn: str) -> bool:
        return all(n % 16 == 0 and n >= min_features
                   for n in (module.in_features, module.out_features))

    return float8.convert_to_float8_training(
        model, config=float8.Float8LinearConfig(emulate=True, **config),
        module_filter_fn=chosen)


def converted(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


# ----------------------------------------------------------------------------- equivalence
def test_equals_torchao_conversion_and_the_plain_loop_bitwise():
    model, ref = mlp(), mlp()
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    by_hand(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    step = af.with_clipping(max_norm=0.5)(af.with_accumulation(2)(
        BF16(with_float8(min_features=16)(ce))))
    for batch in batches(3):
        metrics = step(state, batch)
        out = reference_update(ref, ref_opt, as_dict(batch), ce, micro=2,
                               amp_dtype=torch.bfloat16, max_norm=0.5)
        assert torch.equal(metrics["loss"], sum(out["losses"]) / 2)
    assert converted(model) == converted(ref) == [
        "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    assert torch.equal(flat(model), flat(ref))


def test_emulated_float8_against_bf16_within_the_stated_tolerance(capsys):
    """The documented tolerance: over 30 AdamW steps of bf16 training, float8 (emulated)
    losses stay within 1% of the bf16 losses and the weights within 3% (relative L2)."""
    def train(step):
        model = mlp()
        state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses = torch.stack([step(state, b)["loss"] for b in batches(30)])
        return losses.float(), flat(model)

    bf16_losses, bf16_w = train(BF16(ce))
    f8_losses, f8_w = train(BF16(with_float8(min_features=16)(ce)))
    loss_err = ((f8_losses - bf16_losses).abs() / bf16_losses.abs()).max().item()
    weight_err = ((f8_w - bf16_w).norm() / bf16_w.norm()).item()
    with capsys.disabled():
        print(f"\nfloat8 (emulated) vs bf16, 30 steps: max relative loss error {loss_err:.2e}, "
              f"relative weight error {weight_err:.2e}")
    assert loss_err < 1e-2 and weight_err < 3e-2
    assert loss_err > 1e-5 and weight_err > 1e-4  # float8 really ran: not bf16 again
    assert f8_losses[-5:].mean() < f8_losses[:5].mean()  # and it trains


def test_evaluate_runs_the_float8_layers():
    model = mlp()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = with_float8(min_features=16)(ce)
    ref = by_hand(mlp())
    batch = batches(1)[0]
    with torch.no_grad():
        expected = ce(ref, batch)
    assert torch.equal(step.evaluate(state, batch)["loss"], expected)


# ----------------------------------------------------------------------- what is converted
def test_size_threshold_multiples_of_16_and_the_predicate():
    assert eligible(nn.Linear(1024, 4096), 1024)
    assert not eligible(nn.Linear(1024, 1000), 16)  # 1000 is not a multiple of 16
    assert not eligible(nn.Linear(512, 4096), 1024)  # the smaller side is below the threshold
    assert not eligible(nn.Conv2d(16, 16, 3), 16)
    model = mlp()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = with_float8(min_features=64, predicate=lambda name, m: not name.startswith(
        "blocks.1"))(ce)
    step(state, batches(1)[0])
    assert converted(model) == ["blocks.0.fc1", "blocks.0.fc2"]  # inp (8) and head (5): kept
    assert type(model.head) is nn.Linear and type(model.inp) is nn.Linear


class OwnForward(nn.Linear):
    """A Linear subclass whose forward is its own (a LoRA-style or scaled layer)."""

    def forward(self, x):
        return 2.0 * super().forward(x) + 1.0


def test_a_linear_subclass_with_its_own_forward_keeps_it():
    torch.manual_seed(0)
    model = nn.Sequential(OwnForward(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 5))
    plain = copy.deepcopy(model)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = TensorDict({"x": torch.randn(16, 32), "y": torch.randint(0, 5, (16,))}, [16])
    with_float8(min_features=16)(ce).evaluate(state, batch)
    assert type(model[0]) is OwnForward  # converting it would drop its forward
    assert converted(model) == ["2"]
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(model[0](x), plain[0](x))
    assert not eligible(OwnForward(32, 32), 16)


class Attention(nn.Module):
    """nn.MultiheadAttention wide enough (1040) for the tensorwise rule to choose its
    out_proj by shape, beside a Linear of the same shape that runs its forward."""

    def __init__(self, dim: int = 1040) -> None:
        super().__init__()
        self.att = nn.MultiheadAttention(dim, 8, batch_first=True)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        h, _ = self.att(x, x, x, need_weights=False)
        return self.head(self.fc(h).mean(1))


def test_multihead_attentions_out_proj_is_left_out_with_why():
    # MultiheadAttention passes out_proj.weight to F.multi_head_attention_forward and never
    # calls out_proj's forward: a Float8Linear there would never run in float8
    torch.manual_seed(0)
    model = Attention()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = with_float8(ce)  # layers="auto": the tensorwise rule chooses (1040, 1040)
    why = ("inside nn.MultiheadAttention, which passes the weight to "
           "F.multi_head_attention_forward and never calls the layer's forward")
    assert plan(Float8(), model).left_out["att.out_proj"] == ((1040, 1040), why)
    batch = TensorDict({"x": torch.randn(2, 3, 1040), "y": torch.randint(0, 5, (2,))}, [2])
    step.evaluate(state, batch)
    assert converted(model) == ["fc"]
    assert type(model.att.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    layers = float8_layers(model)
    assert list(layers.converted) == ["fc"]
    assert layers.left_out["att.out_proj"] == ((1040, 1040), why)
    assert f"  left out, {why}: 'att.out_proj' (K=1040, N=1040)" in af.describe(
        step, state).splitlines()


def test_nothing_to_convert_is_refused_with_the_shapes_and_the_rule():
    model = mlp(dim=32)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"no Linear layer to convert in MLP under the "
                                         r"tensorwise rule.*'blocks.0.fc1' \(32, 128\): under "
                                         r"the tensorwise rule.*layers='all'"):
        with_float8(ce)(state, batches(1)[0])
    assert converted(model) == []


# -------------------------------------------------------------------- the shape rule
class GPTLike(nn.Module):
    """A GPT's Linear layers: one block (fused qkv, attention out, MLP in and out), the head."""

    def __init__(self, dim: int, vocab: int = 50304) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.fc_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)


ALL = ["qkv", "proj", "fc", "fc_proj", "head"]


@pytest.mark.parametrize(("dim", "recipe", "expected"), [
    (768, "tensorwise", ["qkv", "fc", "head"]),  # N <= 1024 (768) and K <= 4096: out
    (768, "rowwise", []),  # every layer has K or N of 768
    (768, "rowwise_with_gw_hp", []),
    (2048, "tensorwise", ALL),
    (2048, "rowwise", ["qkv", "fc", "head"]),  # N = 2048: out
    (2048, "rowwise_with_gw_hp", ["qkv", "fc", "head"]),
    (4096, "tensorwise", ALL),
    (4096, "rowwise", ALL),
    (4096, "rowwise_with_gw_hp", ALL),
])
def test_the_shape_rule_chooses_by_width_and_recipe(dim, recipe, expected):
    """Selection is a function of the shapes: checked on meta tensors, nothing converted."""
    with torch.device("meta"):
        model = GPTLike(dim)
    layers = plan(Float8(recipe=recipe), model)
    assert list(layers.converted) == expected
    assert set(layers.left_out) == set(ALL) - set(expected)
    assert all(why.startswith(f"under the {recipe} rule") for _, why in layers.left_out.values())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_shape_rule_is_torchaos_auto_filter(recipe):
    """Over a grid around every threshold, the default rule chooses what torchao's own auto
    filter for the recipe chooses (``_auto_filter_for_recipe``, measured on H100s)."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    sizes = (16, 768, 1024, 1040, 2048, 2064, 4096, 4112, 8192, 1000)
    with torch.device("meta"):
        model = nn.ModuleDict({f"l{k}_{n}": nn.Linear(k, n) for k in sizes for n in sizes})
    torchao_filter = _auto_filter_for_recipe(recipe, [])
    expected = [name for name, m in model.items() if torchao_filter(m, name)]
    assert list(plan(Float8(recipe=recipe), model).converted) == expected
    assert 10 < len(expected) < 90


class Mixed(nn.Module):
    """One Linear per reason to be left out, and one converted."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 64)  # 8: not a multiple of 16
        self.own = OwnForward(64, 64)  # a forward of its own
        self.small = nn.Linear(64, 64)  # under layers=[(64, 64)]
        self.big = nn.Linear(64, 256)
        self.head = nn.Linear(256, 16)  # the predicate

    def forward(self, x):
        return self.head(self.big(self.small(self.own(self.inp(x)))))


def test_describe_names_the_converted_and_the_left_out_layers_with_why():
    torch.manual_seed(0)
    model = Mixed()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = with_float8(layers=[(64, 64)], predicate=lambda name, m: name != "head")(ce)
    assert af.describe(step) == "with_float8(tensorwise, layers=[(64, 64)], predicate) ∘ ce"
    before = af.describe(step, state)  # before the first call: what it will do
    assert "1 of 5 Linear layers to convert at the first call, 4 left out" in before
    assert float8_layers(model) is None and converted(model) == []
    batch = TensorDict({"x": torch.randn(4, 8), "y": torch.randint(0, 5, (4,))}, [4])
    step.evaluate(state, batch)
    text = af.describe(step, state)
    assert text.splitlines() == [
        "with_float8(tensorwise, layers=[(64, 64)], predicate) ∘ ce",
        "with_float8(tensorwise, layers=[(64, 64)], predicate): 1 of 5 Linear layers "
        "converted, 4 left out; layers=: leaves out K <= 64 and N <= 64",
        "  converted: 'big' (K=64, N=256)",
        "  left out, not a multiple of 16 (float8 matmuls need it): 'inp' (K=8, N=64)",
        "  left out, a forward of its own (OwnForward.forward, which the float8 layer would "
        "drop): 'own' (K=64, N=64)",
        "  left out, under the layers= rule (K <= 64 and N <= 64): 'small' (K=64, N=64)",
        "  left out, the predicate: 'head' (K=256, N=16)"]
    layers = float8_layers(model)
    assert converted(model) == list(layers.converted) == ["big"]
    assert layers.left_out["small"] == ((64, 64), "under the layers= rule (K <= 64 and N <= 64)")
    assert str(layers) == "\n".join(text.splitlines()[1:])


def test_old_spellings_and_explicit_rules():
    with torch.device("meta"):
        model = GPTLike(768, vocab=512)
    # min_features: the size rule of before, honoured when given
    assert list(plan(Float8(min_features=768), model).converted) == ALL[:4]
    assert plan(Float8(min_features=1024), model).left_out["proj"] == (
        (768, 768), "below min_features=1024")
    assert list(plan(Float8(layers="all"), model).converted) == ALL
    assert list(plan(Float8(layers=[(None, 768)]), model).converted) == ["qkv", "fc"]
    assert Float8(layers=[[4096, 1024]]).layers == ((4096, 1024),)  # hashable, as pairs
    assert repr(with_float8(layers="all")) == "with_float8(tensorwise, layers=all)"
    # the default is the recipe's rule, equal to spelling its boxes out
    auto, spelled = plan(Float8(), model), plan(Float8(layers=SHAPE_RULES["tensorwise"].boxes),
                                                  model)
    assert auto.converted == spelled.converted and auto.left_out.keys() == spelled.left_out.keys()


def test_options_are_checked_when_built():
    with pytest.raises(ValueError, match="min_features"):
        with_float8(min_features=8)
    with pytest.raises(ValueError, match=r"min_features=1024, layers='all'\) gives two rules"):
        with_float8(min_features=1024, layers="all")
    for bad in ("every", [], [(1,)], [(0, 16)], [("a", 16)], [(True, 16)], 4096, [(16, 16.0)]):
        with pytest.raises(ValueError, match=r"layers=.*\(K, N\)"):
            with_float8(layers=bad)
    with pytest.raises(ValueError, match=r"\(None, None\), which leaves out every layer"):
        with_float8(layers=[(None, None)])
    with pytest.raises(ValueError, match="recipe"):
        with_float8(recipe="blockwise")
    with pytest.raises(ValueError, match="tensorwise"):
        with_float8(recipe="rowwise", fsdp_float8_all_gather=True)
    with pytest.raises(TypeError, match="predicate"):
        with_float8(predicate="blocks")
    with pytest.raises(TypeError, match="emulate"):
        with_float8(emulate=1)
    with pytest.raises(TypeError, match="keyword"):
        with_float8(16)
    with pytest.raises(ValueError, match="applied twice"):
        with_float8(with_float8(ce))
    assert repr(with_float8(min_features=64)(ce)) == "with_float8(tensorwise, min_features=64) ∘ ce"


def test_without_torchao_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"accelfn\[float8\]"):
        with_float8(min_features=16)


# --------------------------------------------------------------- optimizer and checkpoints
def test_the_optimizer_still_holds_the_converted_layers_parameters():
    model = mlp()
    before = {name: p for name, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = af.TrainState(model, opt)
    with_float8(min_features=16)(ce)(state, batches(1)[0])
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)  # torchao keeps the Parameters
    held = [p for g in opt.param_groups for p in g["params"]]
    assert [id(p) for p in held] == [id(p) for p in model.parameters()]
    assert all(p in opt.state for p in held)  # and each was updated


def test_float8_all_gather_repoints_the_optimizer_and_moves_its_state():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_update(model, opt, batches(1)[0], ce)  # the optimizer has state before conversion
    old = dict(model.named_parameters())
    moments = {k: opt.state[p]["exp_avg"].clone() for k, p in old.items()}
    state = af.TrainState(model, opt)
    step = with_float8(min_features=16, fsdp_float8_all_gather=True)(ce)
    step.prepare(state)
    new = dict(model.named_parameters())
    assert new["blocks.0.fc1.weight"] is not old["blocks.0.fc1.weight"]  # wrapped anew
    assert new["blocks.0.fc1.bias"] is old["blocks.0.fc1.bias"]
    held = [p for g in opt.param_groups for p in g["params"]]
    assert [id(p) for p in held] == [id(p) for p in model.parameters()]
    for key, p in new.items():
        assert torch.equal(opt.state[p]["exp_avg"], moments[key]), key
    w = new["blocks.0.fc1.weight"].detach().clone()
    step(state, batches(2)[1])
    assert not torch.equal(new["blocks.0.fc1.weight"].detach(), w)  # the update reached it


def test_float8_all_gather_refuses_a_tied_weight():
    class Tied(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(64, 64, bias=False)
            self.twin = nn.Linear(64, 64, bias=False)
            self.twin.weight = self.out.weight

        def forward(self, x):
            return self.head(self.twin(self.out(self.blocks(self.inp(x)))))

    torch.manual_seed(0)
    model = Tied()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"'out'.*tied to \['twin.weight'\].*predicate"):
        with_float8(min_features=16, fsdp_float8_all_gather=True)(ce)(state, batches(1)[0])
    # without the all-gather the tie survives the conversion
    torch.manual_seed(0)
    model = Tied()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with_float8(min_features=16)(ce)(state, batches(1)[0])
    assert model.out.weight is model.twin.weight and isinstance(model.twin, Float8Linear)


@pytest.mark.parametrize("all_gather", [False, True])
def test_state_dict_keys_unchanged_and_checkpoints_load_across(all_gather):
    f8_step = BF16(with_float8(min_features=16, fsdp_float8_all_gather=all_gather)(ce))
    bf16_step = BF16(ce)
    data = batches(4)

    def trained(step, n):
        model = mlp()
        state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for b in data[:n]:
            step(state, b)
        return state

    plain = mlp().state_dict()
    f8 = trained(f8_step, 2)
    assert list(f8.model.state_dict()) == list(plain)
    saved = roundtrip(f8.state_dict())
    # a float8 checkpoint resumes in bf16 ...
    into_bf16 = trained(bf16_step, 0)
    into_bf16.load_state_dict(saved)
    assert torch.equal(flat(into_bf16.model), flat(f8.model))
    bf16_step(into_bf16, data[2])
    # ... and a bf16 checkpoint resumes in float8, exactly as if it had run in float8
    bf16 = trained(bf16_step, 2)
    into_f8 = trained(f8_step, 0)
    into_f8.load_state_dict(copy.deepcopy(bf16.state_dict()))
    assert torch.equal(flat(into_f8.model), flat(bf16.model))
    f8_step(into_f8, data[2])
    model = mlp()
    model.load_state_dict(bf16.model.state_dict())
    by_hand(model, enable_fsdp_float8_all_gather=all_gather)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.load_state_dict(bf16.optimizer.state_dict())
    reference_update(model, opt, as_dict(data[2]), ce, amp_dtype=torch.bfloat16)
    assert torch.equal(flat(into_f8.model), flat(model))


# ------------------------------------------------------------------------------ stacking
def _by_hand_update(model, optimizer, batch):
    if not converted(model):
        by_hand(model)
    plain_update(model, optimizer, batch, lambda m, b: F.cross_entropy(m(b["x"]), b["y"]))


def test_contract_every_order_with_amp_accumulation_and_clipping():
    report = check_transform(with_float8(min_features=16), reference=_by_hand_update)
    assert report.orders == 24
    assert report.passed == ["reference", "purity", "orders", "resume", "no host sync",
                             "bad input"]


def test_checkpointed_gives_the_float8_result_bitwise():
    results = []
    for step in (BF16(with_float8(min_features=16)(ce)),
                 af.checkpointed(BF16(with_float8(min_features=16)(ce))),
                 with_float8(min_features=16)(BF16(af.checkpointed(ce)))):
        model = mlp()
        state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for b in batches(3):
            step(state, b)
        results.append(flat(model))
        assert len(converted(model)) == 4
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


@pytest.mark.slow
def test_contract_every_order_with_checkpointed_too():
    report = check_transform(with_float8(min_features=16), builtins=[
        af.with_amp(dtype=torch.bfloat16), af.with_accumulation(2),
        af.with_clipping(max_norm=0.5), af.checkpointed()])
    assert report.orders == 120


def test_steps_sharing_a_state_convert_once():
    model = mlp()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    train = with_float8(min_features=16)(ce)
    other = af.checkpointed(with_float8(min_features=16)(ce))  # another preparation
    train(state, batches(1)[0])
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    other(state, batches(1)[0])
    assert {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)} == layers
    with pytest.raises(ValueError, match="converted once"):
        with_float8(min_features=16, recipe="rowwise")(BF16(ce))(state, batches(1)[0])


# --------------------------------------------------------------------- compile on the GPU
def _context(step, state, device: str):
    """The call context of ``step`` as it would be on ``device`` (a CUDA preparation faked
    on the CPU: the check reads only the preparation)."""
    prepared = step.prepare(state)
    moved = dataclasses.replace(prepared, device=torch.device(device))
    key = next(k for k, p, _ in state.preparations if p is prepared)
    state.add_preparation(key, moved, af.describe(step))
    return CallContext(state, moved)


def _hook(step):
    from accelfn.parts import float8

    return lambda ctx: float8.forward(step.spec.float8, ctx)


def test_cuda_without_compile_is_refused_with_the_fix():
    model = mlp()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    eager = BF16(with_float8(min_features=16)(ce))
    with pytest.raises(ValueError, match=r"needs the model compiled.*af\.compiled"):
        _hook(eager)(_context(eager, state, "cuda"))
    with _hook(eager)(_context(eager, state, "cpu")):  # emulated on the CPU: eager is fine
        pass
    emulated = with_float8(min_features=16, emulate=True)(ce)
    with _hook(emulated)(_context(emulated, state, "cuda")):  # numerics checks, eager
        pass


def test_cuda_with_compile_in_the_stack_is_accepted():
    regional = af.compiled(regional=True)  # compiles the blocks inside float8's wrap
    for step in (af.compiled(with_float8(min_features=16)(ce)),  # wraps the model
                 regional(with_float8(min_features=16)(ce))):  # compiles inside it
        model = mlp()
        state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with _hook(step)(_context(step, state, "cuda")):
            pass


@pytest.mark.compile
def test_compiled_float8_matches_eager_float8():
    def train(step):
        model = mlp()
        state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        return torch.stack([step(state, b)["loss"] for b in batches(3)]).float(), flat(model)

    eager = train(BF16(with_float8(min_features=16)(ce)))
    compiled = train(af.compiled(BF16(with_float8(min_features=16)(ce))))
    assert torch.allclose(compiled[0], eager[0], rtol=5e-3)
    assert ((compiled[1] - eager[1]).norm() / eager[1].norm()) < 1e-2


def _float8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _float8_gpu(),
                    reason="needs a CUDA GPU with float8 matmuls (compute capability 8.9+)")
def test_on_a_float8_gpu_eager_is_refused_and_compiled_stays_close_to_bf16():
    device = torch.device("cuda")
    data = [b.to(device) for b in batches(10)]

    def train(step):
        model = mlp().to(device)
        state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        return torch.stack([step(state, b)["loss"] for b in data]).float(), flat(model), model

    model = mlp().to(device)
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with pytest.raises(ValueError, match=r"needs the model compiled"):
        BF16(with_float8(min_features=16)(ce))(state, data[0])
    bf16_losses, bf16_w, _ = train(af.compiled(BF16(ce)))
    f8_losses, f8_w, f8_model = train(af.compiled(BF16(with_float8(min_features=16)(
        ce))))
    assert len(converted(f8_model)) == 4
    assert ((f8_losses - bf16_losses).abs() / bf16_losses).max() < 2e-2
    assert ((f8_w - bf16_w).norm() / bf16_w.norm()) < 5e-2


# ------------------------------------------------------------------ FSDP2, float8 all-gather
_FSDP_WORKER = '''
import sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
import accelfn as af

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

class MLP(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.inp = nn.Linear(8, d)  # created in the order of the test's MLP: same weights
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, 5)
    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))

def ce(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])

af.init_distributed()
rank = dist.get_rank()
fsdp = af.distributed(strategy="fsdp")
cases = {
    "plain": lambda: fsdp(af.with_float8(min_features=16)(ce)),
    "gather": lambda: fsdp(af.with_float8(min_features=16, fsdp_float8_all_gather=True)(ce)),
    "gather_outside": lambda: af.with_float8(min_features=16, fsdp_float8_all_gather=True)(
        fsdp(ce)),
}
out = {}
for name, build in cases.items():
    torch.manual_seed(0)
    model = MLP()
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    step = build()
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 5, (16,), generator=g)
        rows = slice(0, 8) if rank == 0 else slice(8, 16)
        step(state, TensorDict({"x": x[rows], "y": y[rows]}, batch_size=[8]))
    weight = model.blocks[0].fc1.weight
    scale = getattr(weight._local_tensor, "_precomputed_scale", None)  # torchao sets it
    full = weight.full_tensor()
    out[name] = {"params": {k: v.full_tensor().detach().clone()
                            for k, v in model.named_parameters()},
                 "scale": None if scale is None else scale.clone(),
                 "expected_scale": torch.finfo(torch.float8_e4m3fn).max / full.abs().max()}
if rank == 0:
    torch.save(out, sys.argv[1])
dist.destroy_process_group()
'''


@pytest.mark.distributed
def test_fsdp2_float8_all_gather_on_two_processes(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(_FSDP_WORKER)
    torchrun(worker, tmp_path / "out.pt", timeout=600)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    plain, gather = out["plain"], out["gather"]
    # all-gathering the weights in float8 casts them as the matmul would: the same update
    for key, value in plain["params"].items():
        assert torch.equal(gather["params"][key], value), key
        assert torch.equal(out["gather_outside"]["params"][key], value), key
    assert plain["scale"] is None
    # the after_update hook precomputed each weight's scale from the updated weights
    assert torch.allclose(gather["scale"], gather["expected_scale"], rtol=1e-6)
    # and the sharded float8 run stays close to one process on the whole batch
    model = by_hand(mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 5, (16,), generator=g)
        plain_update(model, opt, {"x": x, "y": y}, ce)
    w = torch.cat([p.detach().flatten() for p in plain["params"].values()])
    assert list(plain["params"]) == [k for k, _ in model.named_parameters()]
    assert ((w - flat(model)).norm() / flat(model).norm()) < 1e-2


# ---------------------------------------------------------------------- the GPU benchmark
def _benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "float8.py"
    spec = importlib.util.spec_from_file_location("benchmark_float8", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_refuses_to_run_without_cuda(monkeypatch, capsys):
    bench = _benchmark()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err and "--dry-run" in err


def test_benchmark_models_and_the_rule_on_them():
    """The 2048-wide GPT has at least 350M parameters, the 4096-wide one about 1B; the shape
    rule converts every block's Linear of both (checked on meta tensors); the sweep's
    measured boxes are the losing shapes not inside another's box."""
    bench = _benchmark()
    from gpt2 import GPT  # the benchmark put benchmarks/ on the path

    for width, least in ((2048, 350e6), (4096, 0.9e9)):
        with torch.device("meta"):
            model = GPT(bench.PRESETS[width].config)
        assert sum(p.numel() for p in model.parameters()) >= least
        layers = plan(Float8(predicate=bench.not_the_head), model)
        assert len(layers.converted) == 4 * bench.PRESETS[width].config.layers
        assert list(layers.left_out) == ["head"]
    assert bench.PRESETS[4096].target == 1.2 and bench.PRESETS[2048].target == 1.1
    losing = [(1024, 1024), (2048, 1024), (1024, 2048), (1024, 4096), (2048, 1024)]
    assert bench._boxes(losing) == [[2048, 1024], [1024, 4096]]


@pytest.mark.compile
def test_benchmark_dry_run_prints_the_json(capsys):
    """One tiny model (standing for the 4096-wide one) and two Linear shapes, emulated."""
    bench = _benchmark()
    assert bench.main(["--dry-run", "--steps", "2", "--widths", "4096", "--shapes",
                       "--k", "16", "--n", "16,32"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["benchmark"] == "float8" and result["dry_run"] is True
    assert result["float8"]["emulated"] is True and result["meets_target"] is None
    assert [w["width"] for w in result["widths"]] == [4096] and result["target"] == 1.2
    bf16, f8 = result["sides"]
    assert (bf16["name"], f8["name"]) == ("bf16", "float8")
    assert (bf16["converted_layers"], f8["converted_layers"]) == (0, 8)  # 2 blocks x 4
    assert result["float8"]["left_out"] == {"head": "the predicate"}
    assert result["float8"]["left_in_bf16"] == ["head"]
    assert "compiled" in f8["stack"] and "with_float8" in f8["stack"]
    assert "with_float8" not in bf16["stack"]
    for side in (bf16, f8):
        assert side["tokens_per_s"] > 0 and len(side["step_ms_all"]) == 2
        assert 0 < side["eval_loss"] < 10
    assert result["speedup"] == pytest.approx(f8["tokens_per_s"] / bf16["tokens_per_s"])
    shapes = result["per_shape"]
    assert [(r["M"], r["K"], r["N"]) for r in shapes["shapes"]] == [(32, 16, 16), (32, 16, 32)]
    for row in shapes["shapes"]:
        assert row["speedup"] == pytest.approx(row["bf16_ms"] / row["float8_ms"])
        assert row["rule_converts"] is False  # tiny: under the tensorwise rule
    wins = [[r["M"], r["K"], r["N"]] for r in shapes["shapes"] if r["float8_wins"]]
    assert shapes["wins"] == wins == shapes["rule_leaves_out_but_wins"]
    assert shapes["rule_converts_but_loses"] == [] and shapes["not_measured"] == []
