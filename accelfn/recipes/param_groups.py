"""Optimizer parameter groups: weight decay that spares biases, norms and embeddings;
layer-wise learning rates; freezing and unfreezing parts of a model by module path.

    optimizer = torch.optim.AdamW(af.param_groups(model, weight_decay=0.05), lr=1e-3)
    af.freeze(model, "backbone")          # transfer learning: train the head only

The linear scaling rule for large batches is :func:`accelfn.scale_lr` (``base_lr`` times
the global batch over a reference batch); pass its result as ``lr``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..core.modules import find_blocks

__all__ = ["NO_DECAY_TYPES", "freeze", "no_decay_names", "param_groups", "unfreeze"]

NO_DECAY_TYPES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm,
    nn.Embedding, nn.EmbeddingBag,
)
"""Modules whose own parameters get no weight decay: torch's normalisation layers and
embeddings (subclasses included, e.g. torchvision's ``LayerNorm2d``)."""


def _is_bias(local_name: str) -> bool:
    # torch modules register biases as ``bias`` (Linear, Conv*, norms), ``in_proj_bias``
    # and ``bias_k``/``bias_v`` (MultiheadAttention), ``bias_ih_l0``... (RNNs)
    return local_name == "bias" or local_name.endswith("_bias") or local_name.startswith("bias_")


def no_decay_names(
    model: nn.Module,
    no_decay_types: tuple[type[nn.Module], ...] = NO_DECAY_TYPES,
) -> set[str]:
    """Equivalent to the names (as in ``model.named_parameters()``) of the biases and of every
    parameter owned directly by a module of ``no_decay_types``: what gets no weight decay."""
    spared: set[int] = set()
    for module in model.modules():
        by_type = isinstance(module, no_decay_types)
        for local, p in module.named_parameters(recurse=False):
            if by_type or _is_bias(local):
                spared.add(id(p))
    return {name for name, p in model.named_parameters() if id(p) in spared}


def _layer_ids(model: nn.Module, blocks: Sequence[str] | None) -> tuple[dict[str, int], int]:
    """Depth of each parameter: 0 before the first block, block i -> i + 1, L + 1 after."""
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


def param_groups(
    model: nn.Module,
    *,
    weight_decay: float,
    lr: float | None = None,
    no_decay_types: tuple[type[nn.Module], ...] = NO_DECAY_TYPES,
    skip: Iterable[str] = (),
    layer_decay: float | None = None,
    blocks: Sequence[str] | None = None,
    trainable_only: bool = True,
    named: bool = False,
) -> list[dict[str, Any]]:
    """Equivalent to the seeds' ``configure_weight_decay``: ``[{"params": decay,
    "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]``, with the
    no-decay set found by module type instead of by name or shape.

    No weight decay for: biases (``bias``, ``*_bias``, ``bias_*`` parameters of any module),
    all parameters of modules of ``no_decay_types`` (normalisation layers and embeddings,
    see :data:`NO_DECAY_TYPES`), and the parameter names in ``skip`` (e.g. a ViT's
    ``"pos_embed"``). Tied parameters appear once.

    ``layer_decay`` (with ``lr``) gives layer-wise learning rates: the parameters of the
    ``i``-th of ``L`` blocks get ``lr * layer_decay ** (L + 1 - i)``, those before the first
    block (stem, embeddings) ``lr * layer_decay ** (L + 1)``, those after the last (final
    norm, head) ``lr``. Blocks are [`accelfn.find_blocks`][] (a ResNet's residual blocks,
    a transformer's layers) unless ``blocks`` lists module paths, shallowest first.

    Frozen parameters (``requires_grad=False``) are left out unless ``trainable_only=False``
    (use that if you will [`unfreeze`][] them later with the same optimizer). With
    ``named=True`` each group holds ``(name, parameter)`` pairs, which ``torch.optim`` keeps
    as the group's ``param_names``. Empty groups are omitted.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"param_groups() takes an nn.Module, got {type(model).__name__}")
    if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"param_groups(weight_decay={weight_decay!r}) must be a number >= 0")
    if lr is not None and (not isinstance(lr, (int, float)) or lr <= 0):
        raise ValueError(f"param_groups(lr={lr!r}) must be a number > 0 (or None to keep "
                         "the optimizer's)")
    if not isinstance(no_decay_types, tuple) or not all(
            isinstance(t, type) and issubclass(t, nn.Module) for t in no_decay_types):
        raise TypeError("param_groups(no_decay_types=...) takes a tuple of nn.Module classes")
    if layer_decay is not None:
        if not isinstance(layer_decay, (int, float)) or not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"param_groups(layer_decay={layer_decay!r}) must be in (0, 1]")
        if lr is None:
            raise ValueError("param_groups(layer_decay=...) needs lr=<the base learning "
                             "rate>: each layer's rate is lr * layer_decay ** depth")
    elif blocks is not None:
        raise ValueError("param_groups(blocks=...) only applies with layer_decay=...")
    named_params = dict(model.named_parameters())
    skip = list(skip) if not isinstance(skip, str) else [skip]
    unknown = [s for s in skip if s not in named_params]
    if unknown:
        raise ValueError(f"param_groups(skip=...): {unknown} are not parameter names of "
                         f"{type(model).__name__}; "
                         f"close: {_close(unknown[0], list(named_params))}")
    spared = no_decay_names(model, no_decay_types) | set(skip)
    if layer_decay is not None:
        ids, depth = _layer_ids(model, blocks)
    else:
        ids, depth = {}, 0
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, p in named_params.items():
        if trainable_only and not p.requires_grad:
            continue
        layer = ids.get(name, 0)
        decay = name not in spared
        key = (layer, decay)
        if key not in groups:
            group: dict[str, Any] = {"params": [],
                                     "weight_decay": float(weight_decay) if decay else 0.0}
            if lr is not None:
                scale = 1.0 if layer_decay is None else layer_decay ** (depth + 1 - layer)
                group["lr"] = float(lr) * scale
            groups[key] = group
        groups[key]["params"].append((name, p) if named else p)
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters; unfreeze some "
                         "or pass trainable_only=False")
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], not k[1]))]


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
