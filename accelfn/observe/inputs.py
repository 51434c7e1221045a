"""Input diagnostics: input ranges (unnormalised, non-finite, constant) and label balance.

:func:`input_stats` reduces an input on the device; :func:`input_findings` and
:func:`label_findings` judge statistics already read on the host; :func:`check_batch` does
both for one batch now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .findings import Finding

__all__ = ["check_batch"]

_LABEL_KEYS = ("label", "labels", "target", "targets", "y")


def batch_tensors(batch: Any) -> list[tuple[str, Tensor]]:
    """Flat (key, tensor) pairs of a TensorDict, mapping or (inputs, labels) sequence."""
    if hasattr(batch, "items") and callable(batch.items):
        try:
            items = batch.items(include_nested=True, leaves_only=True)  # TensorDict
        except TypeError:
            items = batch.items()
        out = []
        for k, v in items:
            key = ".".join(k) if isinstance(k, tuple) else str(k)
            if isinstance(v, Tensor):
                out.append((key, v))
            elif isinstance(v, Mapping):
                out.extend((f"{key}.{kk}", vv) for kk, vv in batch_tensors(v))
        return out
    if isinstance(batch, Tensor):
        return [("input", batch)]
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        tensors = [b for b in batch if isinstance(b, Tensor)]
        if len(tensors) >= 2 and not tensors[-1].is_floating_point():
            return [(f"input{i}" if len(tensors) > 2 else "input", t)
                    for i, t in enumerate(tensors[:-1])] + [("label", tensors[-1])]
        return [(f"input{i}", t) for i, t in enumerate(tensors)]
    return []


def inputs_and_labels(batch: Any, label_key: str | None
                      ) -> tuple[list[tuple[str, Tensor]], Tensor | None]:
    """The batch's float (or uint8) inputs by key, and its integer labels: ``label_key``,
    else the first integer tensor named like a label (``label``, ``target``, ``y``, ...)."""
    pairs = batch_tensors(batch)
    labels = None
    inputs = []
    for k, v in pairs:
        is_label = (k == label_key) if label_key else (
            k.rsplit(".", 1)[-1] in _LABEL_KEYS and not v.is_floating_point())
        if is_label and labels is None:
            labels = v
        elif v.numel() > 1 and (v.is_floating_point() or v.dtype == torch.uint8):
            inputs.append((k, v))
    return inputs, labels


def input_stats(x: Tensor) -> Tensor:
    """[min, max, mean, std, all_finite, integer_valued] on the device, float32."""
    f = x.detach().float()
    finite = torch.isfinite(f).all().float()
    g = torch.nan_to_num(f, nan=0.0, posinf=0.0, neginf=0.0)
    integral = (g == g.round()).all().float()
    return torch.stack([g.amin(), g.amax(), g.mean(),
                        g.std() if g.numel() > 1 else g.new_zeros(()), finite, integral])


def input_findings(key: str, dtype: torch.dtype, st: Sequence[float]) -> list[Finding]:
    """Findings from one input's :func:`input_stats`, read on the host: non-finite values,
    unnormalised pixels, large magnitudes, constant inputs."""
    lo, hi, _mean, std, finite, integral = st
    out: list[Finding] = []
    if finite < 1:
        out.append(Finding("inputs", "error", f"input {key!r} contains NaN or Inf",
                           "check the data source and any division in preprocessing"))
    if dtype == torch.uint8 or (lo >= 0 and 2 < hi <= 255 and integral >= 1):
        what = "is uint8" if dtype == torch.uint8 else f"holds integers in [{lo:g}, {hi:g}]"
        out.append(Finding(
            "inputs", "warning" if dtype != torch.uint8 else "info",
            f"input {key!r} {what}: looks like unnormalised 0-255 pixels",
            "normalise on the device before the model: x.float().div(255).sub(mean).div(std) "
            "(accelfn.data's GPU preprocessing does this for whole batches)"))
    elif max(abs(lo), abs(hi)) > 1e3:
        out.append(Finding("inputs", "warning",
                           f"input {key!r} spans [{lo:.3g}, {hi:.3g}]: large magnitudes slow "
                           "convergence and overflow fp16",
                           "standardise it: (x - mean) / std computed over the training set"))
    elif std == 0 and hi == lo:
        out.append(Finding("inputs", "warning", f"input {key!r} is constant ({lo:g})",
                           "check the loader: every sample has the same value"))
    return out


def label_findings(counts: dict[int, int], num_classes: int | None,
                   imbalance: float) -> list[Finding]:
    """Findings from class counts: one class only, classes never seen, imbalance above
    ``imbalance`` (most/least frequent)."""
    if not counts:
        return []
    total = sum(counts.values())
    present = {k: v for k, v in counts.items() if v > 0}
    out: list[Finding] = []
    if len(present) == 1 and total > 1:
        (only,) = present
        out.append(Finding("labels", "warning",
                           f"every sampled label is class {only} ({total} samples)",
                           "shuffle the data (sampler shuffle=True) and check the label key"))
        return out
    if num_classes is not None:
        missing = [c for c in range(num_classes) if counts.get(c, 0) == 0]
        if missing and total >= 10 * num_classes:
            out.append(Finding("labels", "warning",
                               f"classes never seen in {total} sampled labels: "
                               f"{missing[:10]}{'...' if len(missing) > 10 else ''}",
                               "check num_classes and the label mapping"))
    lo, hi = min(present.values()), max(present.values())
    if hi / lo > imbalance:
        out.append(Finding("labels", "warning",
                           f"labels are imbalanced: most frequent class {hi} vs least {lo} "
                           f"samples ({hi / lo:.0f}x)",
                           "re-weight the loss (cross_entropy(weight=...)) or sample with "
                           "torch.utils.data.WeightedRandomSampler"))
    if not out:
        out.append(Finding("labels", "ok",
                           f"{len(present)} classes, most/least frequent ratio {hi / lo:.1f}"))
    return out


def check_batch(batch: Any, *, label_key: str | None = None, num_classes: int | None = None,
                imbalance: float = 10.0) -> list[Finding]:
    """Check one batch now: input ranges (unnormalised or non-finite) and label balance.

    ``batch`` is a TensorDict, a mapping of tensors or an ``(inputs, labels)`` sequence.
    Reads values on the host: call it on demand, e.g. on the first batch.
    """
    inputs, labels = inputs_and_labels(batch, label_key)
    out: list[Finding] = []
    with torch.no_grad():
        for key, x in inputs:
            out += input_findings(key, x.dtype, input_stats(x).tolist())
        if labels is not None:
            lab = labels.detach().reshape(-1).long().cpu()
            if lab.numel() and lab.min() >= 0:
                bins = torch.bincount(lab, minlength=num_classes or 0).tolist()
                counts = {k: v for k, v in enumerate(bins) if v or num_classes}
                out += label_findings(counts, num_classes, imbalance)
    if not out:
        out.append(Finding("inputs", "ok", f"{len(inputs)} input tensor(s) in range"))
    return out
