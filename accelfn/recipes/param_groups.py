"""Optimizer parameter groups: weight decay by one of three rules (by module type, by
dimension as nanoGPT, torchvision's norm/bias options); layer-wise learning rates; freezing
and unfreezing parts of a model by module path.

    optimizer = torch.optim.AdamW(af.param_groups(model, weight_decay=0.05), lr=1e-3)
    af.freeze(model, "backbone")          # transfer learning: train the head only

The linear scaling rule for large batches is [`accelfn.scale_lr`][] (``base_lr`` times
the global batch over a reference batch); pass its result as ``lr``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..core.modules import find_blocks

__all__ = ["NO_DECAY_TYPES", "RULES", "TORCHVISION_NORM_TYPES", "freeze", "is_norm_layer",
           "no_decay_names", "param_groups", "unfreeze"]

_BATCH_NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d,
)
_INSTANCE_NORMS: tuple[type[nn.Module], ...] = (
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d,
)

NO_DECAY_TYPES: tuple[type[nn.Module], ...] = (
    *_BATCH_NORMS, *_INSTANCE_NORMS,
    nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm,
    nn.Embedding, nn.EmbeddingBag,
)
"""Modules whose own parameters get no weight decay under ``rule="type"``: torch's
normalisation layers and embeddings (subclasses included, e.g. torchvision's
``LayerNorm2d``). Norm layers of other libraries are caught by `is_norm_layer`."""

TORCHVISION_NORM_TYPES: tuple[type[nn.Module], ...] = (
    *_BATCH_NORMS, *_INSTANCE_NORMS, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
)
"""The ``norm_classes`` of torchvision's ``set_weight_decay`` (its ``_BatchNorm`` and
``_InstanceNorm`` bases spelled as their public subclasses); it has no ``RMSNorm``."""

RULES = ("type", "dim", "nanogpt", "torchvision")
"""The weight-decay rules of [`param_groups`][] (``"nanogpt"`` is ``"dim"``)."""

_TORCHVISION_EMBEDDINGS = ("class_token", "position_embedding", "relative_position_bias_table")


def _is_bias(local_name: str) -> bool:
    # torch modules register biases as ``bias`` (Linear, Conv*, norms), ``in_proj_bias``
    # and ``bias_k``/``bias_v`` (MultiheadAttention), ``bias_ih_l0``... (RNNs)
    return local_name == "bias" or local_name.endswith("_bias") or local_name.startswith("bias_")


def is_norm_layer(
    module: nn.Module,
    types: tuple[type[nn.Module], ...] = NO_DECAY_TYPES,
) -> bool:
    """Equivalent to ``isinstance(module, types)``, or else: the name of the module's class
    or of one of its base classes contains ``"Norm"`` and every parameter the module owns
    directly is a vector or a scalar (``p.dim() <= 1``).

    The second test catches the normalisation layers that are not ``torch.nn`` classes:
    nanoGPT's ``LayerNorm``, Llama's ``LlamaRMSNorm``, apex's ``FusedLayerNorm``, T5's
    ``T5LayerNorm``, and subclasses of them whatever their own name. The shape test keeps
    modules that only borrow the word (``NormalizedLinear``'s 2-D weight) decayed. Only a
    module's own parameters are concerned: children (a Linear inside an adaptive norm) are
    judged on their own.
    """
    if isinstance(module, types):
        return True
    named_like_norm = any("Norm" in cls.__name__ for cls in type(module).__mro__
                          if issubclass(cls, nn.Module) and cls is not nn.Module)
    own = list(module.parameters(recurse=False))
    return named_like_norm and bool(own) and all(p.dim() <= 1 for p in own)


def no_decay_names(
    model: nn.Module,
    no_decay_types: tuple[type[nn.Module], ...] = NO_DECAY_TYPES,
) -> set[str]:
    """Equivalent to the names (as in ``model.named_parameters()``) of the biases and of every
    parameter owned directly by a normalisation layer or embedding (`is_norm_layer`
    with ``no_decay_types``): what ``rule="type"`` leaves without weight decay."""
    spared: set[int] = set()
    for module in model.modules():
        by_type = is_norm_layer(module, no_decay_types)
        for local, p in module.named_parameters(recurse=False):
            if by_type or _is_bias(local):
                spared.add(id(p))
    return {name for name, p in model.named_parameters() if id(p) in spared}


def _torchvision_kinds(model: nn.Module, norm_types: tuple[type[nn.Module], ...],
                       custom: Sequence[str], norm: bool) -> dict[int, str]:
    """torchvision's set_weight_decay: per parameter, its group ('other', 'norm' or a custom
    key matched on the parameter's own name), at the first place the model lists it."""
    kinds: dict[int, str] = {}
    for module in model.modules():
        for local, p in module.named_parameters(recurse=False):
            if id(p) in kinds:
                continue
            key = next((k for k in custom if k == local), None)
            if key is not None:
                kinds[id(p)] = key
            elif norm and isinstance(module, norm_types):
                kinds[id(p)] = "norm"
            else:
                kinds[id(p)] = "other"
    return kinds


def _layer_ids(model: nn.Module, blocks: Sequence[str] | None) -> tuple[dict[str, int], int]:
    """Depth of each parameter: 0 before the first block, block i (1-based, in the order
    of ``find_blocks``, the model's, or of ``blocks``) -> i, L + 1 after; before, between
    and after in the order of ``model.named_parameters()``."""
    if blocks is None:
        paths = [name for name, _ in find_blocks(model)]
        if not paths:
            raise ValueError(
                f"layer_decay: no repeated blocks found in {type(model).__name__}; pass "
                "blocks=[...] with the module paths of its layers, shallowest first"
            )
    else:
        paths = list(blocks)
        for path in paths:
            _resolve(model, path, "param_groups(blocks=...)")
            if not _is_module(model, path):
                raise ValueError(f"param_groups(blocks=...): {path!r} is a parameter; give "
                                 "the module paths of the blocks, shallowest first")
    depth = len(paths)
    owner: dict[int, int] = {}
    for i, path in enumerate(paths):
        for p in model.get_submodule(path).parameters():
            owner.setdefault(id(p), i + 1)
    names = [(n, owner.get(id(p))) for n, p in model.named_parameters()]
    ids: dict[str, int] = {}
    pending: list[str] = []
    seen_block = False
    for name, layer in names:
        if layer is None:
            pending.append(name)
            continue
        for waiting in pending:  # between blocks: counts with the block it feeds
            ids[waiting] = layer if seen_block else 0
        pending = []
        seen_block = True
        ids[name] = layer
    for waiting in pending:
        ids[waiting] = depth + 1
    return ids, depth


def _check_decay(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0):
        raise ValueError(f"param_groups({name}={value!r}) must be a finite number >= 0")
    return float(value)


def param_groups(
    model: nn.Module,
    *,
    weight_decay: float,
    rule: str = "type",
    lr: float | None = None,
    norm_weight_decay: float | None = None,
    bias_weight_decay: float | None = None,
    transformer_embedding_decay: float | None = None,
    no_decay_types: tuple[type[nn.Module], ...] | None = None,
    skip: Iterable[str] = (),
    layer_decay: float | None = None,
    blocks: Sequence[str] | None = None,
    trainable_only: bool = True,
    named: bool = False,
) -> list[dict[str, Any]]:
    """Equivalent to the optimizer groups ``[{"params": decay, "weight_decay":
    weight_decay}, {"params": no_decay, "weight_decay": 0.0}]`` of a training script, with
    the split chosen by ``rule``:

    - ``"type"`` (default): no weight decay for biases (``bias``, ``*_bias``, ``bias_*``
      parameters of any module), the parameters of normalisation layers and embeddings
      ([`NO_DECAY_TYPES`][], or ``no_decay_types``, plus the norm layers of other libraries
      found by `is_norm_layer`: a class named ``*Norm*`` owning only vectors), and the
      names in ``skip`` (e.g. a ViT's ``"pos_embed"``).
    - ``"dim"`` (or ``"nanogpt"``): nanoGPT's ``configure_optimizers``: every parameter with
      2 or more dimensions decays (weights of matmuls, embeddings), the others do not
      (biases, norm scales), nor the names in ``skip``.
    - ``"torchvision"``: torchvision's ``set_weight_decay`` as its classification
      ``train.py`` calls it: ``weight_decay`` for every parameter; ``norm_weight_decay`` (if
      given) for those of `TORCHVISION_NORM_TYPES` layers (or ``no_decay_types``);
      ``bias_weight_decay`` (if given) for every parameter named ``bias``, norms' included;
      ``transformer_embedding_decay`` (if given) for ``class_token``, ``position_embedding``
      and ``relative_position_bias_table``. Groups come in that order; names in ``skip`` get
      a last group with no decay.

    Tied parameters appear once, where ``model.named_parameters()`` first lists them
    (``skip`` takes any of their names).
    (torchvision's function lists a tied weight once per module holding it: ``torch.optim``
    then steps it twice per update, or refuses groups that share it; its own models tie
    none.)

    ``layer_decay`` (with ``lr``) gives layer-wise learning rates: the parameters of the
    ``i``-th of ``L`` blocks get ``lr * layer_decay ** (L + 1 - i)``, those before the first
    block (stem, embeddings) ``lr * layer_decay ** (L + 1)``, those after the last (final
    norm, head) ``lr``, and those between two blocks the rate of the block after them.
    Blocks are [`accelfn.find_blocks`][] (a ResNet's residual blocks, a transformer's
    layers), numbered in the model's order, unless ``blocks`` lists module paths, shallowest
    first. "Before", "after" and "between" are the order of ``model.named_parameters()``
    (the order the modules were registered in, which is usually the order they run in).
    A stem is before the first block unless ``find_blocks`` counts it as one: a stem that
    shares a class with a sibling in the same ``nn.Sequential`` is a block. So swin_t's
    patch embedding ``features.0`` (a ``Sequential``, like the four stages beside it) is
    block 1 of 8 (stages and PatchMerging layers the other 7), as are mobilenet_v2's and
    efficientnet_b0's first convolution (a ``Conv2dNormActivation``, like their last one:
    that last one is block ``L``), and maxvit_t's two stem convolutions blocks 1 and 2;
    ResNet's ``conv1``, ViT's ``conv_proj`` and convnext's ``features.0`` are before the
    first block. Pass ``blocks=[...]`` (e.g. ``[f"features.{i}" for i in range(1, 8)]``
    for swin_t) to put a stem before the first block.

    Frozen parameters (``requires_grad=False``) are left out unless ``trainable_only=False``
    (use that if you will [`unfreeze`][] them later with the same optimizer). With
    ``named=True`` each group holds ``(name, parameter)`` pairs, which ``torch.optim`` keeps
    as the group's ``param_names``. Empty groups are omitted.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"param_groups() takes an nn.Module, got {type(model).__name__}")
    if rule not in RULES:
        raise ValueError(f"param_groups(rule={rule!r}) must be one of "
                         f"{', '.join(map(repr, RULES))}")
    decay = _check_decay("weight_decay", weight_decay)
    assert decay is not None
    extras = {"norm_weight_decay": norm_weight_decay, "bias_weight_decay": bias_weight_decay,
              "transformer_embedding_decay": transformer_embedding_decay}
    given = [k for k, v in extras.items() if _check_decay(k, v) is not None]
    if given and rule != "torchvision":
        raise ValueError(f"param_groups({given[0]}=...) is an option of rule='torchvision'; "
                         f"with rule={rule!r} biases and norm layers get no weight decay")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                           or not math.isfinite(lr) or lr <= 0):
        raise ValueError(f"param_groups(lr={lr!r}) must be a finite number > 0 (or None to "
                         "keep the optimizer's)")
    if no_decay_types is not None:
        if rule in ("dim", "nanogpt"):
            raise ValueError(f"param_groups(no_decay_types=...) does not apply with "
                             f"rule={rule!r}, which looks at dimensions only; use skip=[...]")
        if not isinstance(no_decay_types, tuple) or not all(
                isinstance(t, type) and issubclass(t, nn.Module) for t in no_decay_types):
            raise TypeError("param_groups(no_decay_types=...) takes a tuple of nn.Module "
                            "classes")
    if layer_decay is not None:
        if not isinstance(layer_decay, (int, float)) or not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"param_groups(layer_decay={layer_decay!r}) must be in (0, 1]")
        if lr is None:
            raise ValueError("param_groups(layer_decay=...) needs lr=<the base learning "
                             "rate>: each layer's rate is lr * layer_decay ** depth")
    elif blocks is not None:
        raise ValueError("param_groups(blocks=...) only applies with layer_decay=...")
    if blocks is not None and (isinstance(blocks, str) or not list(blocks)):
        raise ValueError(f"param_groups(blocks={blocks!r}) takes a non-empty list of module "
                         "paths, shallowest first (e.g. ['blocks.0', 'blocks.1']), or None to "
                         "find the repeated blocks")
    named_params = dict(model.named_parameters())
    skip = list(skip) if not isinstance(skip, str) else [skip]
    # a tied parameter may be skipped by any of its names (head.weight for embed.weight)
    first = {id(p): n for n, p in named_params.items()}
    aliases = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    unknown = [s for s in skip if s not in aliases]
    if unknown:
        raise ValueError(f"param_groups(skip=...): {unknown} are not parameter names of "
                         f"{type(model).__name__}; "
                         f"close: {_close(unknown[0], list(aliases))}")
    skip = [aliases[s] for s in skip]
    # each parameter's kind; each kind's weight decay, in the order the groups come
    if rule == "torchvision":
        # train.py's custom keys, in its order: "bias", then the transformer embeddings
        custom: dict[str, float] = {}
        if bias_weight_decay is not None:
            custom["bias"] = float(bias_weight_decay)
        if transformer_embedding_decay is not None:
            custom.update(dict.fromkeys(_TORCHVISION_EMBEDDINGS,
                                        float(transformer_embedding_decay)))
        by_id = _torchvision_kinds(model, no_decay_types or TORCHVISION_NORM_TYPES,
                                   list(custom), norm_weight_decay is not None)
        order: dict[str, float] = {"other": decay, "norm": float(norm_weight_decay or 0.0),
                                   **custom, "skip": 0.0}
        kinds = {n: "skip" if n in skip else by_id[id(p)] for n, p in named_params.items()}
    else:
        if rule == "type":
            spared = no_decay_names(model, no_decay_types or NO_DECAY_TYPES) | set(skip)
        else:
            spared = {n for n, p in named_params.items() if p.dim() < 2} | set(skip)
        order = {"decay": decay, "no_decay": 0.0}
        kinds = {n: "no_decay" if n in spared else "decay" for n in named_params}
    index = {kind: i for i, kind in enumerate(order)}
    if layer_decay is not None:
        ids, depth = _layer_ids(model, blocks)
    else:
        ids, depth = {}, 0
    groups: dict[tuple[int, int], dict[str, Any]] = {}
    for name, p in named_params.items():
        if trainable_only and not p.requires_grad:
            continue
        layer = ids.get(name, 0)
        kind = kinds[name]
        key = (layer, index[kind])
        if key not in groups:
            group: dict[str, Any] = {"params": [], "weight_decay": order[kind]}
            if lr is not None:
                scale = 1.0 if layer_decay is None else layer_decay ** (depth + 1 - layer)
                group["lr"] = float(lr) * scale
            groups[key] = group
        groups[key]["params"].append((name, p) if named else p)
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters; unfreeze some "
                         "or pass trainable_only=False")
    return [groups[k] for k in sorted(groups)]


def _is_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _close(path: str, candidates: list[str]) -> list[str]:
    return difflib.get_close_matches(path, candidates, n=3, cutoff=0.5)


def _resolve(model: nn.Module, path: str, fn: str) -> list[torch.nn.Parameter]:
    if not isinstance(path, str):
        raise TypeError(f"{fn} takes module paths as strings, e.g. 'backbone.layer1', got "
                        f"{type(path).__name__}")
    try:
        return list(model.get_submodule(path).parameters())
    except AttributeError:
        pass
    try:
        return [model.get_parameter(path)]
    except AttributeError:
        pass
    modules = [n for n, _ in model.named_modules() if n]
    close = _close(path, modules + [n for n, _ in model.named_parameters()])
    top = [n for n, _ in model.named_children()]
    hint = f"did you mean {close}? " if close else ""
    raise ValueError(f"{fn}: {path!r} is not a module or parameter of "
                     f"{type(model).__name__}; {hint}its top-level modules are {top}")


def freeze(model: nn.Module, *paths: str) -> nn.Module:
    """Equivalent to ``for p in model.get_submodule(path).parameters(): p.requires_grad =
    False`` for each path; returns the model.

    A path names a submodule (``"backbone.layer1"``, ``"0"`` inside a Sequential) or one
    parameter (``"fc.bias"``). Unknown paths raise, with the closest names. Freeze before
    building the optimizer with [`param_groups`][] (frozen parameters are left out). Batch
    norm layers of a frozen part still update their running statistics in ``train()`` mode;
    put them in ``eval()`` after each ``model.train()`` if that matters.
    """
    if not paths:
        raise ValueError("freeze() needs at least one module path, e.g. "
                         "freeze(model, 'backbone')")
    params = [p for path in paths for p in _resolve(model, path, "freeze()")]
    for p in params:
        p.requires_grad_(False)
    return model


def unfreeze(model: nn.Module, *paths: str) -> nn.Module:
    """Equivalent to ``p.requires_grad = True`` for the parameters under each path (all of
    the model's when no path is given); returns the model.

    The optimizer must hold those parameters to train them: build it with
    ``param_groups(model, ..., trainable_only=False)`` (or ``model.parameters()``) if parts
    will be unfrozen later, or add them with ``optimizer.add_param_group``.
    """
    if not paths:
        params = list(model.parameters())
    else:
        params = [p for path in paths for p in _resolve(model, path, "unfreeze()")]
    for p in params:
        p.requires_grad_(True)
    return model
