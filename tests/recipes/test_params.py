"""Parameter groups (no decay on biases, norms and embeddings, by module type), layer-wise
learning rates, and freezing by module path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchvision
from helpers import Net, classify, make_batch
from torch import nn

import accelfn as af
from accelfn.recipes.param_groups import (
    NO_DECAY_TYPES,
    freeze,
    no_decay_names,
    param_groups,
    unfreeze,
)


def names_by_decay(model, groups):
    """{weight_decay: set of parameter names} for groups of a model."""
    ids = {id(p): n for n, p in model.named_parameters()}
    out: dict[float, set[str]] = {}
    for g in groups:
        out.setdefault(g["weight_decay"], set()).update(ids[id(p)] for p in g["params"])
    return out


class TinyTransformer(nn.Module):
    def __init__(self, vocab=50, dim=16, depth=2, tie=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.norm(self.encoder(self.embed(tokens))))


# ----------------------------------------------------------------- weight decay
def test_resnet18_no_decay_on_batchnorm_and_biases():
    model = torchvision.models.resnet18(num_classes=10)
    got = names_by_decay(model, param_groups(model, weight_decay=1e-4))
    decay, spared = set(), set()
    for mod_name, module in model.named_modules():
        for local, _ in module.named_parameters(recurse=False):
            name = f"{mod_name}.{local}" if mod_name else local
            if isinstance(module, (nn.Conv2d, nn.Linear)) and local == "weight":
                decay.add(name)
            else:
                assert isinstance(module, nn.BatchNorm2d) or local == "bias", name
                spared.add(name)
    assert got == {1e-4: decay, 0.0: spared}
    assert "fc.bias" in spared and "bn1.weight" in spared and "layer2.0.downsample.1.bias" in spared
    assert "layer2.0.downsample.0.weight" in decay and "conv1.weight" in decay


def test_transformer_no_decay_on_layernorm_biases_and_embedding():
    model = TinyTransformer()
    got = names_by_decay(model, param_groups(model, weight_decay=0.05))
    expected_decay = {"head.weight"} | {
        f"encoder.layers.{i}.{w}" for i in range(2)
        for w in ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight",
                  "linear2.weight")}
    assert got[0.05] == expected_decay
    assert got[0.0] == set(dict(model.named_parameters())) - expected_decay
    assert {"embed.weight", "encoder.layers.0.self_attn.in_proj_bias", "norm.weight",
            "encoder.layers.1.norm2.bias"} <= got[0.0]


def test_rule_is_by_module_type_not_by_shape_or_name():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))  # 1-d but not a bias or a norm: decays
            self.table = nn.Embedding(4, 8)  # 2-d but an embedding: no decay
            self.mix = nn.MultiheadAttention(8, 2, add_bias_kv=True)
            self.rnn = nn.GRU(8, 8)

    model = Odd()
    spared = no_decay_names(model)
    assert "scale" not in spared and "table.weight" in spared
    assert {"mix.in_proj_bias", "mix.bias_k", "mix.bias_v", "mix.out_proj.bias",
            "rnn.bias_ih_l0", "rnn.bias_hh_l0"} <= spared
    assert "rnn.weight_ih_l0" not in spared and "mix.in_proj_weight" not in spared
    # a subclass of a norm layer is a norm layer; custom types can be added
    norm2d = torchvision.models.convnext.LayerNorm2d(4)
    assert no_decay_names(nn.ModuleDict({"norm": norm2d})) == {"norm.weight", "norm.bias"}
    act = nn.ModuleDict({"act": nn.PReLU()})
    assert no_decay_names(act) == set()
    assert no_decay_names(act, (*NO_DECAY_TYPES, nn.PReLU)) == {"act.weight"}


def test_custom_types_and_skip():
    model = nn.Sequential(nn.Linear(4, 4), nn.PReLU(4))
    got = names_by_decay(model, param_groups(model, weight_decay=0.1,
                                             no_decay_types=(*NO_DECAY_TYPES, nn.PReLU),
                                             skip=["0.weight"]))
    assert got == {0.0: {"0.weight", "0.bias", "1.weight"}}
    with pytest.raises(ValueError, match=r"not parameter names.*close: \['0.weight'"):
        param_groups(model, weight_decay=0.1, skip=["0.weigth"])


def test_groups_apply_decay_only_where_they_should():
    """AdamW on zero gradients: decayed weights shrink by (1 - lr * wd), the others stay."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(4, 4), TinyTransformer(dim=4, depth=1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.5), lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    spared = no_decay_names(model)
    for n, p in model.named_parameters():
        if n in spared:
            assert torch.equal(p, before[n]), n
        else:
            torch.testing.assert_close(p, before[n] * (1 - 0.1 * 0.5), msg=n)


def test_tied_weights_appear_once_and_named_groups():
    model = TinyTransformer(tie=True)
    groups = param_groups(model, weight_decay=0.1, named=True)
    names = [n for g in groups for n, _ in g["params"]]
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    assert "embed.weight" in [n for g in groups if g["weight_decay"] == 0 for n, _ in
                              g["params"]]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    assert opt.param_groups[0]["param_names"][0] == names[0]


def test_lr_is_set_on_every_group_and_empty_groups_are_dropped():
    model = nn.Linear(3, 3, bias=False)
    groups = param_groups(model, weight_decay=0.1, lr=0.5)
    assert len(groups) == 1 and groups[0]["lr"] == 0.5 and groups[0]["weight_decay"] == 0.1
    assert "lr" not in param_groups(model, weight_decay=0.1)[0]


# ----------------------------------------------------------------- layer-wise rates
def test_layer_decay_on_a_transformer():
    model = TinyTransformer()
    groups = param_groups(model, weight_decay=0.05, lr=1.0, layer_decay=0.5)
    lr_of = {n: g["lr"] for g in groups for n, p in model.named_parameters()
             if any(p is q for q in g["params"])}
    assert lr_of["embed.weight"] == 0.5 ** 3  # before the 2 blocks: depth 0
    assert lr_of["encoder.layers.0.linear1.weight"] == 0.5 ** 2
    assert lr_of["encoder.layers.0.norm1.bias"] == 0.5 ** 2
    assert lr_of["encoder.layers.1.self_attn.in_proj_weight"] == 0.5
    assert lr_of["norm.weight"] == lr_of["head.weight"] == 1.0
    decays = {(g["lr"], g["weight_decay"]) for g in groups}
    assert (0.25, 0.05) in decays and (0.25, 0.0) in decays and len(groups) == 7


def test_layer_decay_on_resnet_blocks():
    model = torchvision.models.resnet18(num_classes=10)
    groups = param_groups(model, weight_decay=1e-4, lr=0.1, layer_decay=0.9)
    lr_of = {n: g["lr"] for g in groups for n, p in model.named_parameters()
             if any(p is q for q in g["params"])}
    assert lr_of["conv1.weight"] == pytest.approx(0.1 * 0.9 ** 9)  # stem: 8 blocks + 1
    assert lr_of["layer1.0.conv1.weight"] == pytest.approx(0.1 * 0.9 ** 8)
    assert lr_of["layer4.1.bn2.bias"] == pytest.approx(0.1 * 0.9)
    assert lr_of["fc.weight"] == pytest.approx(0.1)


def test_layer_decay_params_between_blocks_go_with_the_next_block():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    model = nn.Sequential(nn.Linear(4, 4), Block(), nn.LayerNorm(4), Block(), nn.Linear(4, 2))
    groups = param_groups(model, weight_decay=0.0, lr=1.0, layer_decay=0.5, named=True)
    lr_of = {n: g["lr"] for g in groups for n, _ in g["params"]}
    assert lr_of == {"0.weight": 0.125, "0.bias": 0.125, "1.fc.weight": 0.25,
                     "1.fc.bias": 0.25, "2.weight": 0.5, "2.bias": 0.5, "3.fc.weight": 0.5,
                     "3.fc.bias": 0.5, "4.weight": 1.0, "4.bias": 1.0}
    explicit = param_groups(model, weight_decay=0.0, lr=1.0, layer_decay=0.5, named=True,
                            blocks=["1", "3"])
    assert {n: g["lr"] for g in explicit for n, _ in g["params"]} == lr_of


@pytest.mark.parametrize("name", ["swin_t", "swin_v2_t", "mobilenet_v2", "efficientnet_b0",
                                  "densenet121"])
def test_layer_decay_rates_grow_with_depth_on_models_with_blocks_of_several_classes(name):
    # their repeated blocks are of several classes (swin's stages and PatchMerging layers):
    # the rates follow the model's order, not the blocks grouped by class
    with torch.device("meta"):
        model = getattr(torchvision.models, name)(weights=None)
    groups = param_groups(model, weight_decay=0.05, lr=1.0, layer_decay=0.5, named=True)
    lr_of = {n: g["lr"] for g in groups for n, _ in g["params"]}
    rates = [lr_of[n] for n, _ in model.named_parameters()]
    assert rates == sorted(rates)
    blocks = [n for n, _ in af.find_blocks(model)]
    firsts = [next(lr_of[n] for n, _ in model.named_parameters() if n.startswith(b + "."))
              for b in blocks]
    assert firsts == [0.5 ** (len(blocks) + 1 - i) for i in range(1, len(blocks) + 1)]
    assert rates[-1] == 1.0


def test_layer_decay_counts_swins_patch_embedding_as_its_first_block():
    # the documented stem rule: swin_t's patch embedding (features.0) is a Sequential
    # sibling of the stages, so it is block 1 of 8; PatchMerging layers sit between stages
    with torch.device("meta"):
        model = torchvision.models.swin_t(weights=None)
    groups = param_groups(model, weight_decay=0.05, lr=1.0, layer_decay=0.5, named=True)
    lr_of = {n: g["lr"] for g in groups for n, _ in g["params"]}
    assert lr_of["features.0.0.weight"] == 0.5 ** 8
    assert lr_of["features.1.0.norm1.weight"] == 0.5 ** 7
    assert lr_of["features.2.reduction.weight"] == 0.5 ** 6
    assert lr_of["features.7.1.mlp.0.weight"] == 0.5
    assert lr_of["head.weight"] == 1.0


@pytest.mark.parametrize("kwargs,match", [
    ({"layer_decay": 0.8}, "needs lr="),
    ({"lr": 0.1, "layer_decay": 1.5}, r"\(0, 1\]"),
    ({"blocks": ["blocks.0"]}, "only applies with layer_decay"),
    ({"lr": 0.1, "layer_decay": 0.8, "blocks": ["blocks.7"]}, "not a module or parameter"),
    ({"lr": 0.1, "layer_decay": 0.8, "blocks": ["head.weight"]}, "is a parameter"),
    ({"weight_decay": -1}, ">= 0"),
    ({"lr": 0.0}, "> 0"),
])
def test_bad_arguments(kwargs, match):
    kwargs = {"weight_decay": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        param_groups(Net(), **kwargs)


def test_layer_decay_without_blocks_asks_for_them():
    with pytest.raises(ValueError, match=r"blocks=\[\.\.\.\]"):
        param_groups(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)),
                     weight_decay=0.1, lr=0.1, layer_decay=0.5)


# ----------------------------------------------------------------- freezing
def test_freeze_by_module_and_parameter_path_then_unfreeze():
    model = torchvision.models.resnet18(num_classes=10)
    assert freeze(model, "layer1", "fc.bias") is model
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith("layer1.")} | {
        "fc.bias"}
    unfreeze(model, "layer1.0")
    assert not any(n.startswith("layer1.0.") for n, p in model.named_parameters()
                   if not p.requires_grad)
    unfreeze(model)
    assert all(p.requires_grad for p in model.parameters())


def test_unknown_paths_name_the_closest_modules():
    model = torchvision.models.resnet18(num_classes=10)
    with pytest.raises(ValueError, match=r"'layer5'.*did you mean.*layer\d.*top-level"):
        freeze(model, "layer5")
    with pytest.raises(ValueError, match="at least one"):
        freeze(model)
    with pytest.raises(TypeError, match="strings"):
        freeze(model, model.fc)


def test_frozen_backbone_trains_only_the_head(net):
    freeze(net, "inp", "blocks")
    groups = param_groups(net, weight_decay=0.01)
    assert {id(p) for g in groups for p in g["params"]} == {id(p) for p in net.head.parameters()}
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    state = af.TrainState(net, torch.optim.AdamW(groups, lr=1e-2))
    af.lift(classify)(state, make_batch())
    for n, p in net.named_parameters():
        assert torch.equal(p, before[n]) != n.startswith("head."), n
    everything = param_groups(net, weight_decay=0.01, trainable_only=False)
    assert sum(len(g["params"]) for g in everything) == len(list(net.parameters()))


# ----------------------------------------------------------------- rules of public scripts
# The originals' own grouping code, copied: nanoGPT's model.py (GPT.configure_optimizers) and
# torchvision's references/classification/utils.py (set_weight_decay) with train.py's call.
class NanoLayerNorm(nn.Module):
    """nanoGPT's LayerNorm: not a torch.nn class (PyTorch had no bias=False then)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoBlock(nn.Module):
    def __init__(self, dim, bias, norm):
        super().__init__()
        self.ln_1 = norm(dim, bias=bias)
        self.c_attn = nn.Linear(dim, 3 * dim, bias=bias)
        self.c_proj = nn.Linear(dim, dim, bias=bias)
        self.ln_2 = norm(dim, bias=bias)
        self.c_fc = nn.Linear(dim, 4 * dim, bias=bias)
        self.mlp_proj = nn.Linear(4 * dim, dim, bias=bias)

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's GPT layout: wte/wpe/h/ln_f, lm_head tied to wte (weight tying)."""

    def __init__(self, vocab=32, block_size=8, dim=16, depth=2, bias=True, tie=True,
                 norm=NanoLayerNorm):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(block_size, dim),
            h=nn.ModuleList([NanoBlock(dim, bias, norm) for _ in range(depth)]),
            ln_f=norm(dim, bias=bias)))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nanogpt_groups(model, weight_decay):
    """nanoGPT's configure_optimizers, the grouping part, verbatim."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    return [{"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0}]


def torchvision_set_weight_decay(model, weight_decay, norm_weight_decay=None,
                                 norm_classes=None, custom_keys_weight_decay=None):
    """torchvision's references/classification/utils.py set_weight_decay, verbatim."""
    if not norm_classes:
        norm_classes = [
            torch.nn.modules.batchnorm._BatchNorm,
            torch.nn.LayerNorm,
            torch.nn.GroupNorm,
            torch.nn.modules.instancenorm._InstanceNorm,
            torch.nn.LocalResponseNorm,
        ]
    norm_classes = tuple(norm_classes)

    params = {"other": [], "norm": []}
    params_weight_decay = {"other": weight_decay, "norm": norm_weight_decay}
    custom_keys = []
    if custom_keys_weight_decay is not None:
        for key, weight_decay in custom_keys_weight_decay:
            params[key] = []
            params_weight_decay[key] = weight_decay
            custom_keys.append(key)

    def _add_params(module, prefix=""):
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_custom_key = False
            for key in custom_keys:
                target_name = f"{prefix}.{name}" if prefix != "" and "." in key else name
                if key == target_name:
                    params[key].append(p)
                    is_custom_key = True
                    break
            if not is_custom_key:
                if norm_weight_decay is not None and isinstance(module, norm_classes):
                    params["norm"].append(p)
                else:
                    params["other"].append(p)

        for child_name, child_module in module.named_children():
            child_prefix = f"{prefix}.{child_name}" if prefix != "" else child_name
            _add_params(child_module, prefix=child_prefix)

    _add_params(model)

    param_groups = []
    for key in params:
        if len(params[key]) > 0:
            param_groups.append({"params": params[key], "weight_decay": params_weight_decay[key]})
    return param_groups


def torchvision_train_py_groups(model, weight_decay, norm_weight_decay=None,
                                bias_weight_decay=None, transformer_embedding_decay=None):
    """torchvision's train.py: its options turned into set_weight_decay's custom keys."""
    custom_keys_weight_decay = []
    if bias_weight_decay is not None:
        custom_keys_weight_decay.append(("bias", bias_weight_decay))
    if transformer_embedding_decay is not None:
        for key in ["class_token", "position_embedding", "relative_position_bias_table"]:
            custom_keys_weight_decay.append((key, transformer_embedding_decay))
    return torchvision_set_weight_decay(
        model, weight_decay, norm_weight_decay=norm_weight_decay,
        custom_keys_weight_decay=custom_keys_weight_decay if custom_keys_weight_decay else None)


def layout(groups):
    """Each group as (weight_decay, [parameter ids in order]), leaving out empty groups and
    the repeats of a parameter already listed (tied weights: set_weight_decay lists them
    once per module that holds them, so torch.optim would step them twice)."""
    seen: set[int] = set()
    out = []
    for g in groups:
        ids = []
        for p in g["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                ids.append(id(p))
        if ids:
            out.append((g["weight_decay"], ids))
    return out


def train_bitwise_equal(model, groups_a, groups_b, *, batches=20, sgd=False):
    """Train two copies of ``model`` with each grouping (AdamW, or SGD with momentum) on the
    same batches: the parameters must be bitwise equal after every update."""
    import copy as _copy

    a, b = model, _copy.deepcopy(model)
    ids = {id(p): n for n, p in a.named_parameters()}
    named_b = dict(b.named_parameters())

    def remap(groups):  # the same grouping for the copy, parameter for parameter
        return [{**g, "params": [named_b[ids[id(p)]] for p in g["params"]]} for g in groups]

    def make(groups):
        if sgd:
            return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(groups, lr=3e-2, betas=(0.9, 0.95))

    opt_a, opt_b = make(groups_a), make(remap(groups_b))
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only contend on a shared machine
    try:
        for _ in range(batches):
            x = torch.randint(0, 32, (4, 8), generator=g)
            for m, o in ((a, opt_a), (b, opt_b)):
                logits = m(x)
                F.cross_entropy(logits.flatten(0, 1), x.roll(-1, 1).flatten()).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            for (n, p), q in zip(a.named_parameters(), b.parameters()):
                assert torch.equal(p, q), n
    finally:
        torch.set_num_threads(threads)


def test_dim_rule_is_nanogpts_configure_optimizers():
    torch.manual_seed(0)
    model = NanoGPT()
    want = nanogpt_groups(model, 0.1)
    for rule in ("dim", "nanogpt"):
        got = param_groups(model, weight_decay=0.1, rule=rule)
        assert layout(got) == layout(want)
    # embeddings (tied lm_head included) decay, nanoGPT's own LayerNorm and biases do not
    names = names_by_decay(model, got)
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= names[0.1]
    assert {"transformer.ln_f.weight", "transformer.h.0.c_attn.bias"} <= names[0.0]
    train_bitwise_equal(model, want, got)


def test_default_rule_catches_norm_layers_that_are_not_torch_classes():
    model = NanoGPT()
    spared = no_decay_names(model)
    norms = {n for n, _ in model.named_parameters() if ".ln_" in n or "ln_f" in n}
    assert {"transformer.ln_f.weight", "transformer.h.1.ln_2.weight"} <= norms <= spared
    got = names_by_decay(model, param_groups(model, weight_decay=0.1))
    assert not norms & got[0.1]

    class LlamaRMSNorm(nn.Module):  # a name with "Norm" and scale vectors only
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    class NormalizedLinear(nn.Linear):  # "Norm" in the name, but a 2-D weight: decays
        pass

    class Scale(nn.Module):  # 1-D, but neither a norm nor a bias: decays
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.ones(4))

    class Final(NanoLayerNorm):  # a base class named like a norm is enough
        pass

    odd = nn.ModuleDict({"rms": LlamaRMSNorm(), "lin": NormalizedLinear(4, 4, bias=False),
                         "scale": Scale(), "sub": Final(4, bias=False)})
    assert no_decay_names(odd) == {"rms.weight", "sub.weight"}


@pytest.mark.parametrize("options", [
    {},
    {"norm_weight_decay": 0.0},
    {"norm_weight_decay": 0.0, "bias_weight_decay": 0.0},
    {"bias_weight_decay": 0.02},
    {"norm_weight_decay": 0.01, "bias_weight_decay": 0.0, "transformer_embedding_decay": 0.0},
])
def test_torchvision_rule_is_torchvisions_set_weight_decay(options):
    torch.manual_seed(0)
    for model in (torchvision.models.resnet18(num_classes=10),
                  torchvision.models.VisionTransformer(32, 16, num_layers=1, num_heads=2,
                                                       hidden_dim=8, mlp_dim=16),
                  torchvision.models.SwinTransformer([4, 4], 8, [1, 1], [1, 1], [2, 2]),
                  NanoGPT(), TinyTransformer(tie=True)):
        want = torchvision_train_py_groups(model, 0.05, **options)
        got = param_groups(model, weight_decay=0.05, rule="torchvision", **options)
        assert layout(got) == layout(want), type(model).__name__
    tied = NanoGPT()
    listed = [id(p) for g in torchvision_train_py_groups(tied, 0.05, **options)
              for p in g["params"]]
    assert listed.count(id(tied.lm_head.weight)) == 2  # the original's: twice
    got = param_groups(tied, weight_decay=0.05, rule="torchvision", **options)
    assert [id(p) for g in got for p in g["params"]].count(id(tied.lm_head.weight)) == 1
    # nanoGPT with torch's LayerNorm, untied (the original would step a tied weight twice),
    # trained with either grouping: bitwise the same
    model = NanoGPT(tie=False, norm=nn.LayerNorm)
    train_bitwise_equal(model, torchvision_train_py_groups(model, 0.05, **options),
                        param_groups(model, weight_decay=0.05, rule="torchvision", **options),
                        sgd=True)


def test_torchvision_rule_spares_norms_and_still_decays_biases():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    got = names_by_decay(model, param_groups(model, weight_decay=1e-4, rule="torchvision",
                                             norm_weight_decay=0.0))
    assert got == {1e-4: {"0.weight", "0.bias", "3.weight", "3.bias"},
                   0.0: {"1.weight", "1.bias"}}
    groups = param_groups(model, weight_decay=1e-4, rule="torchvision", skip=["3.weight"],
                          bias_weight_decay=1e-5, named=True)
    assert [(g["weight_decay"], [n for n, _ in g["params"]]) for g in groups] == [
        (1e-4, ["0.weight", "1.weight"]), (1e-5, ["0.bias", "1.bias", "3.bias"]),
        (0.0, ["3.weight"])]  # norms decay unless norm_weight_decay is given


@pytest.mark.parametrize("kwargs,match", [
    ({"rule": "shape"}, "rule='shape'.*'type', 'dim', 'nanogpt', 'torchvision'"),
    ({"norm_weight_decay": 0.0}, "rule='torchvision'"),
    ({"rule": "dim", "bias_weight_decay": 0.0}, "rule='torchvision'"),
    ({"rule": "dim", "no_decay_types": (nn.PReLU,)}, "does not apply with rule='dim'"),
    ({"rule": "torchvision", "norm_weight_decay": -1.0}, ">= 0"),
])
def test_rule_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        param_groups(Net(), weight_decay=0.1, **kwargs)


@pytest.mark.parametrize("rule", ["type", "dim", "torchvision"])
def test_skip_takes_any_name_of_a_tied_parameter(rule):
    model = TinyTransformer(tie=True)  # head.weight is embed.weight
    by_alias = param_groups(model, weight_decay=0.1, rule=rule, skip=["head.weight"])
    by_name = param_groups(model, weight_decay=0.1, rule=rule, skip=["embed.weight"])
    assert names_by_decay(model, by_alias) == names_by_decay(model, by_name)
    assert "embed.weight" in names_by_decay(model, by_alias)[0.0]
