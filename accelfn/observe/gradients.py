"""Gradient diagnostics: per-layer gradient norms on the device, and what they say.

A layer is a module owning parameters directly (``"encoder.0"`` holds ``weight`` and
``bias``). Norms are computed on the device; :func:`gradient_findings` turns norms already
read on the host into exploding, vanishing, dead and non-finite findings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.compat import foreach_norm
from .findings import Finding, Severity

__all__ = ["gradient_findings", "layer_grad_norms"]


def layer_of(param_name: str) -> str:
    """The layer owning the parameter ``param_name`` (its module's name)."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else "(root)"


def layer_groups(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[str],
                                            list[int]]:
    """The trainable parameters with their names, the layers in order, and each
    parameter's layer index."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layers: list[str] = []
    index: list[int] = []
    for n, _ in named:
        layer = layer_of(n)
        if layer not in layers:
            layers.append(layer)
        index.append(layers.index(layer))
    return named, layers, index


def group_norms(norms: Sequence[Tensor], index: Sequence[int], n_layers: int) -> Tensor:
    """Per-layer L2 norms from per-parameter norms (on their device, no host read)."""
    stacked = torch.stack([n.float() for n in norms])
    # made on the host and sent without waiting: torch.tensor(..., device="cuda") would
    # copy from pageable memory and synchronise the stream
    idx = torch.tensor(list(index)).to(stacked.device, non_blocking=True)
    sq = torch.zeros(n_layers, device=stacked.device).index_add_(0, idx, stacked * stacked)
    return sq.sqrt()


def layer_grad_norms(model: nn.Module) -> dict[str, Tensor]:
    """Per-layer L2 norms of the current ``.grad`` of ``model``, as device scalars.

    A layer is a module owning parameters directly (``"encoder.0"`` holds ``weight`` and
    ``bias``). Nothing is read on the host; call ``float()`` on the values when reporting.
    Parameters without a gradient are left out.
    """
    named, _, _ = layer_groups(model)
    with_grad = [(n, p.grad) for n, p in named if p.grad is not None]
    if not with_grad:
        return {}
    layers: list[str] = []
    index: list[int] = []
    for n, _ in with_grad:
        if layer_of(n) not in layers:
            layers.append(layer_of(n))
        index.append(layers.index(layer_of(n)))
    with torch.no_grad():
        norms = foreach_norm([g for _, g in with_grad])
        grouped = group_norms(norms, index, len(layers))
    return dict(zip(layers, grouped.unbind(0)))


def gradient_findings(history: list[dict[str, Any]], *, explode: float, vanish: float,
                      ratio: float) -> list[Finding]:
    """Findings from sampled per-layer norms, ``history`` as ``[{"step": s, "norms":
    {layer: norm}}]``: non-finite, exploding (above ``explode`` or ``ratio`` times the median
    layer), dead (zero), vanishing (below ``vanish`` or ``ratio`` times under the median)."""
    if not history:
        return [Finding("gradients", "info", "no gradients sampled yet",
                        "call diag.step() after each training step")]
    out: list[Finding] = []
    flagged: set[tuple[str, str]] = set()

    def add(kind: str, layer: str, sev: Severity, msg: str, fix: str) -> None:
        if (kind, layer) not in flagged:
            flagged.add((kind, layer))
            out.append(Finding("gradients", sev, msg, fix))

    explode_fix = ("clip gradients (accelfn.with_clipping(max_norm=1.0)), lower the "
                   "learning rate or warm it up, check this layer's initialisation and "
                   "any unnormalised input feeding it")
    vanish_fix = ("use residual connections and normalisation layers, ReLU/GELU instead "
                  "of saturating activations, and a Kaiming/Xavier initialisation")
    for sample in history:
        step, norms = sample["step"], sample["norms"]
        finite = [v for v in norms.values() if math.isfinite(v)]
        median = sorted(finite)[len(finite) // 2] if finite else 0.0
        # Next to exploding layers every normal layer looks small: compare with the
        # median only when nothing in this sample explodes.
        exploding = any(not math.isfinite(v) or v > explode or
                        (median > 0 and v > ratio * median) for v in norms.values())
        for layer, v in norms.items():
            if not math.isfinite(v):
                add("nonfinite", layer, "error",
                    f"non-finite gradient in layer {layer!r} at step {step}",
                    "enable the non-finite policy (skip the update) and fix the source: "
                    "log(0), division by zero or fp16 overflow")
            elif v > explode:
                add("explode", layer, "error",
                    f"exploding gradient in layer {layer!r} at step {step}: norm "
                    f"{v:.3e} > {explode:g}", explode_fix)
            elif median > 0 and v > ratio * median:
                add("explode", layer, "warning",
                    f"layer {layer!r} gradient norm {v:.3e} is {v / median:.0f}x the "
                    f"median layer ({median:.3e}) at step {step}", explode_fix)
            elif v == 0:
                add("dead", layer, "warning",
                    f"layer {layer!r} has an all-zero gradient at step {step}",
                    "dead units (ReLU stuck at 0), a detached branch or a zero-initialised "
                    "layer after which nothing learns")
            elif v < vanish or (not exploding and median > 0
                                     and v < median / ratio):
                add("vanish", layer, "warning",
                    f"vanishing gradient in layer {layer!r} at step {step}: norm "
                    f"{v:.3e} (median layer {median:.3e})", vanish_fix)
    if len(history) >= 2:
        first, last = history[0]["norms"], history[-1]["norms"]
        tot0 = math.sqrt(sum(v * v for v in first.values() if math.isfinite(v)))
        tot1 = math.sqrt(sum(v * v for v in last.values() if math.isfinite(v)))
        if tot0 > 0 and tot1 > 100 * tot0:
            out.append(Finding("gradients", "warning",
                               f"total gradient norm grew {tot1 / tot0:.0f}x from step "
                               f"{history[0]['step']} to {history[-1]['step']}",
                               explode_fix))
    if not out:
        v = history[-1]["norms"]
        finite = [x for x in v.values() if math.isfinite(x)]
        rng = f"{min(finite):.2e}..{max(finite):.2e}" if finite else "n/a"
        out.append(Finding("gradients", "ok",
                           f"{len(history)} sample(s), layer gradient norms {rng}"))
    return out

