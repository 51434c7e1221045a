"""float8 training of the Linear layers through torchao: ``with_float8``'s options and its
calls (the layers converted first among the preparations; the forward's check that CUDA runs
it compiled; the float8 scales precomputed after each update for FSDP2's float8
all-gather), and the shape rule that chooses the layers (``SHAPE_RULES``)."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core import compat
from ..core.contexts import CallContext, Prepared, UpdateContext
from ..core.state import TrainState
from .compilation import Compilation

__all__ = ["SHAPE_RULES", "Box", "Float8", "Float8Layers", "Predicate", "ShapeRule",
           "after_update", "convert", "describe", "eligible", "forward", "layers_of", "plan"]

_SLOT = "with_float8"
_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
_INSTALL = "pip install 'accelfn[float8]'"
Predicate = Callable[[str, nn.Module], bool]
Box = tuple[int | None, int | None]  # (K, N): the layers with K <= k and N <= n (None: any)


@dataclass(frozen=True, slots=True)
class ShapeRule:
    """Which Linear layers one float8 recipe leaves in their dtype, by shape: a layer of ``K``
    input and ``N`` output features (its matmul is ``(M, K) @ (K, N)``, ``M`` the tokens of a
    micro-batch) is left out when ``K <= k and N <= n`` for one of the ``boxes`` (``None``:
    any size). Equivalent to torchao's ``_auto_filter_for_<recipe>`` refusing the layer.

    ``source`` says where the numbers come from. ``measured`` is the place for our own
    crossover (``benchmarks/float8.py --shapes`` on a GPU, at the ``M`` that ``measured_on``
    names); once set, it is the rule (``boxes`` stays as the record of torchao's)."""

    boxes: tuple[Box, ...]
    source: str
    measured: tuple[Box, ...] | None = None
    measured_on: str = ""

    @property
    def active(self) -> tuple[Box, ...]:
        """The boxes in force: ours where measured, else torchao's."""
        return self.boxes if self.measured is None else self.measured


# The one table of the rule's constants, per recipe. torchao measured float8 against bf16 for
# one Linear's forward and backward over a sweep of M x K x N on H100 GPUs (the performance
# tables of its float8 README) and condensed it into its auto filters
# (torchao.float8.float8_linear_utils: _auto_filter_for_tensorwise, _auto_filter_for_rowwise):
# below these shapes the casts and amax reductions (memory-bound) cost more than the faster
# float8 matmul saves. torchao has no filter for rowwise_with_gw_hp (the weight gradient's
# matmul in high precision): rowwise's, the stricter of its two, applies until measured. Our
# own crossover goes in ``measured`` when a GPU run of benchmarks/float8.py --shapes gives one.
_TORCHAO = "torchao's H100 measurements"
_ROWWISE: tuple[Box, ...] = ((None, 2048), (1024, None), (2048, 4096))
SHAPE_RULES: dict[str, ShapeRule] = {
    "tensorwise": ShapeRule(((4096, 1024),), f"{_TORCHAO}, _auto_filter_for_tensorwise"),
    "rowwise": ShapeRule(_ROWWISE, f"{_TORCHAO}, _auto_filter_for_rowwise"),
    "rowwise_with_gw_hp": ShapeRule(
        _ROWWISE, f"{_TORCHAO}, rowwise's: torchao has no filter for rowwise_with_gw_hp"),
}
_LAYERS = ("auto", "all")


def box_text(box: Box) -> str:
    """``K <= 4096 and N <= 1024`` for ``(4096, 1024)``."""
    k, n = box
    parts = ([] if k is None else [f"K <= {k}"]) + ([] if n is None else [f"N <= {n}"])
    return " and ".join(parts)


def _within(box: Box, k: int, n: int) -> bool:
    return (box[0] is None or k <= box[0]) and (box[1] is None or n <= box[1])


def _torchao() -> Any:
    """``torchao.float8``, imported on first use: torchao is the optional extra ``float8``."""
    try:
        import torchao.float8 as float8  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError as error:
        raise ImportError(
            f"with_float8 needs torchao, accelfn's optional extra 'float8': {_INSTALL} "
            f"(or pip install torchao). ({error})") from error
    return float8


def _float8_linear() -> type[nn.Linear]:
    """torchao's ``Float8Linear`` (an ``nn.Linear`` subclass; torchao does not export it)."""
    from torchao.float8.float8_linear import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        Float8Linear,
    )

    return Float8Linear  # type: ignore[no-any-return]


def eligible(module: nn.Module, min_features: int) -> bool:
    """Whether ``module`` passes the size rule of ``with_float8(min_features=...)``: an
    ``nn.Linear`` with both sizes multiples of 16 (what float8 matmuls require) and at least
    ``min_features``. A subclass with a forward of its own is left alone: the float8 layer
    runs ``nn.Linear``'s matmul and would silently drop that forward. (The default rule is by
    shape: see ``SHAPE_RULES`` and ``plan``.)"""
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return False
    sizes = (module.in_features, module.out_features)
    return all(n % 16 == 0 and n >= min_features for n in sizes)


def _boxes(layers: Any) -> tuple[Box, ...]:
    """``layers=`` given as boxes, checked and as a tuple of pairs (refused: what is not)."""
    fix = ("layers= takes 'auto' (the shape rule of the recipe), 'all' (every Linear whose "
           "sizes are multiples of 16) or the shapes to leave out as (K, N) pairs, a layer "
           "being left out when K <= k and N <= n (None: any size), e.g. "
           "layers=[(4096, 1024)]")
    if isinstance(layers, str) or not isinstance(layers, Sequence) or not layers:
        raise ValueError(f"with_float8(layers={layers!r}) is not understood: {fix}")
    out: list[Box] = []
    for box in layers:
        ok = isinstance(box, Sequence) and not isinstance(box, str) and len(box) == 2 and all(
            x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 1)
            for x in box)
        if not ok:
            raise ValueError(f"with_float8(layers=...) has {box!r}, not a (K, N) pair of "
                             f"sizes >= 1 or None: {fix}")
        if box[0] is None and box[1] is None:
            raise ValueError("with_float8(layers=...) has (None, None), which leaves out every "
                             "layer; leave with_float8 out instead, or bound K or N")
        out.append((box[0], box[1]))
    return tuple(out)


@dataclass(frozen=True, slots=True, repr=False)
class Float8:
    """``with_float8``'s options: which Linear layers are converted (``layers``: the shape rule
    of the recipe, every layer, or boxes; ``min_features``: the size rule of before), the
    user's ``predicate(name, module)``, torchao's ``recipe``, FSDP2's float8 all-gather, and
    ``emulate`` (None: where the device has no float8 matmuls)."""

    min_features: int | None = None
    predicate: Predicate | None = None
    recipe: str = "tensorwise"
    fsdp_float8_all_gather: bool = False
    emulate: bool | None = None
    layers: str | tuple[Box, ...] = "auto"

    def __post_init__(self) -> None:
        min_features, predicate, recipe = self.min_features, self.predicate, self.recipe
        fsdp_float8_all_gather, emulate, layers = (self.fsdp_float8_all_gather, self.emulate,
                                                   self.layers)
        if min_features is not None and (isinstance(min_features, bool) or not isinstance(
                min_features, int) or min_features < 16):
            raise ValueError(f"with_float8(min_features={min_features!r}) must be an int >= 16 "
                             "(float8 matmuls need sizes that are multiples of 16)")
        if not (isinstance(layers, str) and layers in _LAYERS):
            object.__setattr__(self, "layers", _boxes(layers))
        if min_features is not None and self.layers != "auto":
            raise ValueError(
                f"with_float8(min_features={min_features}, layers={self.layers!r}) gives two "
                "rules: min_features is the size rule of before (both sizes at least it); pass "
                "one of them (layers=[(k, n), ...] for thresholds by shape)")
        if predicate is not None and not callable(predicate):
            raise TypeError(f"with_float8(predicate={predicate!r}) must be a function "
                            "predicate(name, module) -> bool")
        if recipe not in _RECIPES:
            raise ValueError(f"with_float8(recipe={recipe!r}) is unknown; use one of {_RECIPES}")
        if not isinstance(fsdp_float8_all_gather, bool):
            raise TypeError("with_float8(fsdp_float8_all_gather=...) takes a boolean")
        if fsdp_float8_all_gather and recipe != "tensorwise":
            raise ValueError(f"with_float8(fsdp_float8_all_gather=True) works with "
                             f"recipe='tensorwise' only (torchao's rule), not {recipe!r}")
        if emulate is not None and not isinstance(emulate, bool):
            raise TypeError("with_float8(emulate=...) takes None (automatic), True or False")
        _torchao()  # fail when the step is built, not at its first call, without the extra

    def __repr__(self) -> str:
        parts = [self.recipe]
        if self.min_features is not None:
            parts.append(f"min_features={self.min_features}")
        if self.layers != "auto":
            parts.append(f"layers={self.layers if self.layers == 'all' else list(self.layers)}")
        if self.predicate is not None:
            parts.append("predicate")
        if self.fsdp_float8_all_gather:
            parts.append("fsdp_float8_all_gather")
        if self.emulate is not None:
            parts.append(f"emulate={self.emulate}")
        return f"with_float8({', '.join(parts)})"

    @property
    def rule(self) -> str:
        """The size rule in words: ``the tensorwise rule (torchao's H100 measurements ...):
        leaves out K <= 4096 and N <= 1024``."""
        if self.min_features is not None:
            return f"min_features={self.min_features}: both sizes at least {self.min_features}"
        if self.layers == "all":
            return "layers='all': every Linear whose sizes are multiples of 16"
        if isinstance(self.layers, tuple):
            return f"layers=: leaves out {'; '.join(map(box_text, self.layers))}"
        rule = SHAPE_RULES[self.recipe]
        source = rule.source if rule.measured is None else rule.measured_on
        return (f"the {self.recipe} rule ({source}): leaves out "
                f"{'; '.join(map(box_text, rule.active))}")

    def left_out_by_shape(self, k: int, n: int) -> str | None:
        """Why the rule leaves a Linear of ``k`` input and ``n`` output features out, or None
        when it converts it (sizes that are not multiples of 16 are not its business)."""
        if self.min_features is not None:
            if min(k, n) < self.min_features:
                return f"below min_features={self.min_features}"
            return None
        layers = self.layers
        if isinstance(layers, tuple):
            boxes, name = layers, "layers="
        elif layers == "auto":
            boxes, name = SHAPE_RULES[self.recipe].active, self.recipe
        else:
            return None
        for box in boxes:
            if _within(box, k, n):
                return f"under the {name} rule ({box_text(box)})"
        return None


@dataclass(frozen=True, slots=True)
class Float8Layers:
    """The Linear layers of a model under ``with_float8``: those in float8 (``converted``,
    name -> (K, N)) and those left in their dtype (``left_out``, name -> ((K, N), why)), in
    the model's order; ``rule`` is the options' size rule in words. ``str()`` is what
    ``describe(step, state)`` prints."""

    label: str
    rule: str
    converted: dict[str, tuple[int, int]]
    left_out: dict[str, tuple[tuple[int, int], str]]
    prepared: bool = True

    def __str__(self) -> str:
        done, total = len(self.converted), len(self.converted) + len(self.left_out)
        verb = "converted" if self.prepared else "to convert at the first call"
        lines = [f"{self.label}: {done} of {total} Linear layers {verb}, "
                 f"{len(self.left_out)} left out; {self.rule}"]
        groups: dict[tuple[str, tuple[int, int]], list[str]] = {}
        for name, shape in self.converted.items():
            groups.setdefault(("converted", shape), []).append(name)
        for name, (shape, why) in self.left_out.items():
            groups.setdefault((f"left out, {why}", shape), []).append(name)
        for (what, (k, n)), names in groups.items():
            lines.append(f"  {what}: {_names(names)} (K={k}, N={n})")
        return "\n".join(lines)


def _names(names: list[str]) -> str:
    quoted = [repr(name) for name in names]
    if len(quoted) <= 3:
        return ", ".join(quoted)
    return f"{quoted[0]}, {quoted[1]}, ..., {quoted[-1]} ({len(quoted)} layers)"


def plan(options: Float8, model: nn.Module) -> Float8Layers:
    """Which Linear layers of ``model`` ``options`` convert and which they leave out, with why:
    a pure function of the layers' types and shapes (and the predicate), computed without
    touching the model. Layers already in float8 count as converted, except those inside an
    ``nn.MultiheadAttention``, which never run in float8 (see ``_left_out``)."""
    float8_linear = _float8_linear()
    converted: dict[str, tuple[int, int]] = {}
    left_out: dict[str, tuple[tuple[int, int], str]] = {}
    in_attention = {id(child) for module in model.modules()
                    if isinstance(module, nn.MultiheadAttention) for child in module.children()}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not name:
            continue
        shape = (module.in_features, module.out_features)
        if isinstance(module, float8_linear) and id(module) not in in_attention:
            converted[name] = shape
            continue
        why = _left_out(options, name, module, id(module) in in_attention)
        if why is None:
            converted[name] = shape
        else:
            left_out[name] = (shape, why)
    return Float8Layers(repr(options), options.rule, converted, left_out, prepared=False)


# nn.MultiheadAttention hands its out_proj's weight and bias to F.multi_head_attention_forward
# (and so does its fast path): the layer's forward never runs, a Float8Linear's neither.
_IN_ATTENTION = ("inside nn.MultiheadAttention, which passes the weight to "
                 "F.multi_head_attention_forward and never calls the layer's forward")


def _left_out(options: Float8, name: str, module: nn.Linear,
              in_attention: bool = False) -> str | None:
    """Why ``module`` stays out of float8 (the first reason, in this order), or None.
    ``in_attention``: ``module`` is a child of an ``nn.MultiheadAttention``."""
    if in_attention:
        return _IN_ATTENTION
    forward = type(module).forward
    if forward is not nn.Linear.forward:
        return (f"a forward of its own ({type(module).__name__}.forward, which the float8 "
                "layer would drop)")
    k, n = module.in_features, module.out_features
    if k % 16 or n % 16:
        return "not a multiple of 16 (float8 matmuls need it)"
    why = options.left_out_by_shape(k, n)
    if why is not None:
        return why
    if options.predicate is not None and not options.predicate(name, module):
        return "the predicate"
    return None


# The layers each model's conversion chose, kept for describe (the model's life, no longer)
_CONVERTED: weakref.WeakKeyDictionary[nn.Module, Float8Layers] = weakref.WeakKeyDictionary()


def layers_of(model: nn.Module) -> Float8Layers | None:
    """The Linear layers ``with_float8`` converted in ``model`` and those it left out, or None
    when no ``with_float8`` step has prepared it."""
    return _CONVERTED.get(model)


def describe(options: Float8, state: TrainState) -> str:
    """The float8 facts of ``state``'s preparation (``describe(step, state)`` prints them):
    the layers converted and those left out, with why; before the first call, what the
    conversion will do."""
    done = _CONVERTED.get(state.model)
    return str(done if done is not None else plan(options, state.model))


def _config(recipe: str, emulate: bool, all_gather: bool) -> Any:
    float8 = _torchao()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=all_gather)


def _resolve_emulate(emulate: bool | None, device: torch.device) -> bool:
    if emulate is not None:
        return emulate
    if device.type != "cuda":
        return True  # no float8 matmul kernels off CUDA: emulate the numerics
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9) and not torch.version.hip:
        raise ValueError(
            f"with_float8 needs a GPU with float8 matmuls (compute capability 8.9 or newer: "
            f"H100, H200, L4, RTX 4090); {torch.cuda.get_device_name(device)} has "
            f"{capability[0]}.{capability[1]}. Pass emulate=True to check float8 numerics "
            "on it (slower than bf16), or train in bf16 with with_amp alone")
    return False


def _held(optimizer: torch.optim.Optimizer) -> dict[int, Tensor]:
    return {id(p): p for group in optimizer.param_groups for p in group["params"]}


def _repoint(optimizer: torch.optim.Optimizer, swaps: dict[int, nn.Parameter]) -> None:
    """Point ``optimizer`` at the new Parameters (``swaps``: id of the old one -> new one);
    the per-parameter state moves with them."""
    for group in optimizer.param_groups:
        olds = list(group["params"])
        group["params"] = [swaps.get(id(p), p) for p in olds]
        for old in olds:
            if id(old) in swaps and old in optimizer.state:
                optimizer.state[swaps[id(old)]] = optimizer.state.pop(old)


def _nothing_to_convert(model: nn.Module, chosen: Float8Layers) -> ValueError:
    shown = [f"{name!r} {shape}: {why}" for name, (shape, why) in chosen.left_out.items()]
    more = f"; and {len(shown) - 6} more" if len(shown) > 6 else ""
    return ValueError(
        f"with_float8 found no Linear layer to convert in {type(model).__name__} under "
        f"{chosen.rule}; its Linear layers (K=in, N=out): {'; '.join(shown[:6])}{more}. "
        "These shapes run slower in float8 than in bf16: leave with_float8 out, or force "
        "them with layers='all' (or layers=[(k, n), ...], or min_features=...)")


def _convert(model: nn.Module, state: TrainState, config: Any, options: Float8) -> Float8Layers:
    """Swap the chosen Linear layers of ``model`` for torchao's ``Float8Linear`` in place;
    returns the layers converted and left out. The optimizer keeps holding every parameter it
    held."""
    float8 = _torchao()
    float8_linear = _float8_linear()
    if isinstance(model, nn.Linear):
        raise ValueError("with_float8 converts the Linear layers inside a model, not a model "
                         "that is itself one Linear; wrap it: nn.Sequential(linear)")
    already: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, float8_linear):
            if module.config != config:  # type: ignore[attr-defined]
                raise ValueError(
                    f"{name!r} was converted to float8 by another with_float8(...) with other "
                    "options; a model is converted once: use the same with_float8 options in "
                    "every step of a TrainState, or build a new model and TrainState")
            already.append(name)
    layers = dataclasses.replace(plan(options, model), prepared=True)
    if not layers.converted:
        raise _nothing_to_convert(model, layers)
    chosen = [name for name in layers.converted if name not in already]
    held = {k: v for optimizer in state.optimizers for k, v in _held(optimizer).items()}
    before = {name: dict(model.get_submodule(name).named_parameters(recurse=False))
              for name in chosen}
    if config.enable_fsdp_float8_all_gather:
        _refuse_tied(model, before)
    names = set(chosen)
    float8.convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, fqn: fqn in names)
    swaps: dict[int, nn.Parameter] = {}
    for name, old_params in before.items():
        new = model.get_submodule(name)
        if not isinstance(new, float8_linear):
            raise RuntimeError(f"torchao left {name!r} unconverted ({type(new).__name__})")
        for key, old in old_params.items():
            fresh = getattr(new, key)
            if fresh is not old and id(old) in held:
                swaps[id(old)] = fresh
    if swaps:  # the float8 all-gather wraps each weight in a new Parameter
        for optimizer in state.optimizers:
            _repoint(optimizer, swaps)
    _check_held(model, state.optimizers, before, held)
    _CONVERTED[model] = layers
    return layers


def _refuse_tied(model: nn.Module, before: dict[str, dict[str, nn.Parameter]]) -> None:
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for key, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{key}" if name else key)
    for name, params in before.items():
        weight = params.get("weight")
        if weight is not None and len(set(owners.get(id(weight), []))) > 1:
            raise ValueError(
                f"with_float8(fsdp_float8_all_gather=True) cannot convert {name!r}: its weight "
                f"is tied to {sorted(set(owners[id(weight)]) - {name + '.weight'})} and the "
                "float8 all-gather gives it a Parameter of its own. Leave it out with "
                f"predicate=lambda name, module: name != {name!r}")


def _check_held(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...],
                before: dict[str, dict[str, nn.Parameter]], held: dict[int, Tensor]) -> None:
    now = {k: v for optimizer in optimizers for k, v in _held(optimizer).items()}
    for name in before:
        for key, p in model.get_submodule(name).named_parameters(recurse=False):
            if id(before[name][key]) in held and id(p) not in now:
                raise RuntimeError(
                    f"after the float8 conversion the optimizer no longer holds {name}.{key}; "
                    "this torchao version replaces parameters in a way accelfn does not know")


def _is_compiled(ctx: CallContext) -> bool:
    """Whether this call's preparation compiled the model: a transform of the stack that
    prepared it compiles, or the model is compiled (in place or a ``torch.compile`` wrapper)."""
    for key, prepared, _ in ctx.state.preparations:
        if prepared is ctx.prepared and any(isinstance(t.part, Compilation) for t in key):
            return True
    return compat.is_compiled(ctx.model)


def convert(options: Float8, prepared: Prepared, state: TrainState) -> Prepared:
    """Prepare: the chosen Linear layers become torchao's ``Float8Linear`` in place (what was
    converted and left out is kept for ``describe(step, state)``)."""
    resolved = _resolve_emulate(options.emulate, prepared.device)
    config = _config(options.recipe, resolved, options.fsdp_float8_all_gather)
    _convert(prepared.model, state, config, options)
    return prepared


def forward(options: Float8, ctx: CallContext) -> contextlib.AbstractContextManager[Any]:
    """The forward's context: on CUDA the model must run compiled (refused otherwise)."""
    if ctx.device.type == "cuda" and options.emulate is not True and not _is_compiled(ctx):
        raise ValueError(
            "with_float8 on CUDA needs the model compiled: add accelfn.compiled to the "
            "stack, e.g. af.compiled(af.with_float8(af.with_amp(step))). In eager mode "
            "every float8 cast is a kernel of its own and training is slower than bf16; "
            "pass emulate=True only to check float8 numerics eagerly")
    return contextlib.nullcontext()


def after_update(options: Float8, ctx: UpdateContext, skipped: Tensor) -> None:
    """After an update with ``fsdp_float8_all_gather``: torchao's one all-reduce computes
    every weight's float8 scale for the next all-gather (a no-op on weights FSDP2 did not
    shard)."""
    _torchao().precompute_float8_dynamic_scale_for_fsdp(ctx.state.model)
