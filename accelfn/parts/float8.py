"""float8 training of the Linear layers through torchao: ``with_float8``'s options and its
calls (the layers converted first among the preparations; the forward's check that CUDA runs
it compiled; the float8 scales precomputed after each update for FSDP2's float8
all-gather)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core import compat
from ..core.contexts import CallContext, Prepared, UpdateContext
from ..core.state import TrainState
from .compilation import Compilation

__all__ = ["Float8", "Predicate", "after_update", "convert", "eligible", "forward"]

_SLOT = "with_float8"
_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
_INSTALL = "pip install 'accelfn[float8]'"
Predicate = Callable[[str, nn.Module], bool]


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
    """Whether ``module`` is an ``nn.Linear`` worth converting: both sizes multiples of 16
    (what float8 matmuls require) and at least ``min_features`` (below it the casts cost more
    than the faster matmul saves). A subclass with a forward of its own is left alone: the
    float8 layer runs ``nn.Linear``'s matmul and would silently drop that forward."""
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return False
    sizes = (module.in_features, module.out_features)
    return all(n % 16 == 0 and n >= min_features for n in sizes)


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


def _convert(model: nn.Module, state: TrainState, config: Any, min_features: int,
             predicate: Predicate | None) -> list[str]:
    """Swap the chosen Linear layers of ``model`` for torchao's ``Float8Linear`` in place;
    returns the names of the float8 layers. The optimizer keeps holding every parameter it
    held."""
    float8 = _torchao()
    float8_linear = _float8_linear()
    if isinstance(model, nn.Linear):
        raise ValueError("with_float8 converts the Linear layers inside a model, not a model "
                         "that is itself one Linear; wrap it: nn.Sequential(linear)")
    chosen: list[str] = []
    already: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, float8_linear):
            if module.config != config:  # type: ignore[attr-defined]
                raise ValueError(
                    f"{name!r} was converted to float8 by another with_float8(...) with other "
                    "options; a model is converted once: use the same with_float8 options in "
                    "every step of a TrainState, or build a new model and TrainState")
            already.append(name)
        elif name and eligible(module, min_features) and (
                predicate is None or predicate(name, module)):
            chosen.append(name)
    if not chosen and not already:
        sizes = sorted({(m.in_features, m.out_features) for m in model.modules()
                        if isinstance(m, nn.Linear)})
        raise ValueError(
            f"with_float8 found no Linear layer to convert in {type(model).__name__}: it "
            f"converts layers whose in and out features are multiples of 16 and at least "
            f"min_features={min_features} (and that the predicate accepts); the model's "
            f"Linear sizes (in, out) are {sizes[:8]}{' ...' if len(sizes) > 8 else ''}. Lower "
            "min_features, or leave with_float8 out: small layers gain nothing from float8")
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
    return sorted(already + chosen)


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



@dataclass(frozen=True, slots=True, repr=False)
class Float8:
    """``with_float8``'s options: the smallest layer converted (``min_features``), the
    user's ``predicate(name, module)``, torchao's ``recipe``, FSDP2's float8 all-gather, and
    ``emulate`` (None: where the device has no float8 matmuls)."""

    min_features: int = 1024
    predicate: Predicate | None = None
    recipe: str = "tensorwise"
    fsdp_float8_all_gather: bool = False
    emulate: bool | None = None

    def __post_init__(self) -> None:
        min_features, predicate, recipe = self.min_features, self.predicate, self.recipe
        fsdp_float8_all_gather, emulate = self.fsdp_float8_all_gather, self.emulate
        if (isinstance(min_features, bool) or not isinstance(min_features, int)
                or min_features < 16):
            raise ValueError(f"with_float8(min_features={min_features!r}) must be an int >= 16 "
                             "(float8 matmuls need sizes that are multiples of 16)")
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
        if self.min_features != 1024:
            parts.append(f"min_features={self.min_features}")
        if self.predicate is not None:
            parts.append("predicate")
        if self.fsdp_float8_all_gather:
            parts.append("fsdp_float8_all_gather")
        if self.emulate is not None:
            parts.append(f"emulate={self.emulate}")
        return f"with_float8({', '.join(parts)})"


def convert(options: Float8, prepared: Prepared, state: TrainState) -> Prepared:
    """Prepare: the chosen Linear layers become torchao's ``Float8Linear`` in place."""
    resolved = _resolve_emulate(options.emulate, prepared.device)
    config = _config(options.recipe, resolved, options.fsdp_float8_all_gather)
    _convert(prepared.model, state, config, options.min_features, options.predicate)
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
