"""Initialisation diagnostics: weight scales against ``1/sqrt(fan_in)``, non-finite
parameters, and per-GPU BatchNorm statistics under distributed training."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .findings import Finding

__all__ = ["check_init", "check_model"]

# The layers whose weights are checked, named by their public classes (lazy layers become
# these once materialised).
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d,
                 nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
# BatchNorm with per-process statistics (nn.SyncBatchNorm is not among them).
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _fan_in(w: Tensor) -> int:
    return int(w.shape[1] * (w[0][0].numel() if w.dim() > 2 else 1))


def check_init(model: nn.Module, *, low: float = 0.1, high: float = 10.0) -> list[Finding]:
    """Check weights of linear and convolution layers against ``1/sqrt(fan_in)``.

    For a layer with fan-in ``n``, common initialisations give a weight std between about
    ``0.4/sqrt(n)`` (Xavier with a wide output) and ``1.4/sqrt(n)`` (Kaiming for ReLU);
    PyTorch's default is ``0.58/sqrt(n)``. A ratio ``std * sqrt(n)`` outside
    ``[low, high]``, all-zero or constant weights, and NaN/Inf in any parameter are reported.
    Reads values on the host: call it once, not per step.
    """
    out: list[Finding] = []
    checked: list[tuple[str, Tensor]] = []
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, Tensor) or w.dim() < 2 or isinstance(mod, nn.Embedding):
            continue
        if isinstance(mod, (nn.Linear, nn.Bilinear, *_CONVOLUTIONS)) or \
                type(mod).__name__.endswith(("Linear", "Conv1d", "Conv2d", "Conv3d")):
            checked.append((name or "(root)", w))
    if checked:
        with torch.no_grad():
            stats = torch.stack([torch.stack([w.detach().float().std(),
                                              w.detach().float().abs().amax()])
                                 for _, w in checked]).tolist()
        for (name, w), (std, amax) in zip(checked, stats):
            fan_in = _fan_in(w)
            ratio = std * math.sqrt(fan_in)
            if amax == 0:
                out.append(Finding(
                    "init", "warning", f"layer {name!r} weights are all zero",
                    "zero weights give zero gradients to everything before this layer; use "
                    "the default or nn.init.kaiming_normal_ unless zero-init is intended "
                    "(last layer of a residual branch)"))
            elif std == 0 or not math.isfinite(std):
                out.append(Finding("init", "error" if not math.isfinite(std) else "warning",
                                   f"layer {name!r} weights are constant or non-finite",
                                   "identical weights stay identical (no symmetry breaking): "
                                   "initialise randomly, e.g. nn.init.kaiming_normal_"))
            elif not (low <= ratio <= high):
                out.append(Finding(
                    "init", "warning",
                    f"layer {name!r} weight std {std:.3g} is {ratio:.3g}/sqrt(fan_in="
                    f"{fan_in}); expected about 0.4-1.4/sqrt(fan_in)",
                    "re-initialise with nn.init.kaiming_normal_(w, nonlinearity='relu') or "
                    "nn.init.xavier_uniform_(w), or remove the custom scaling"))
    nonfinite = [n for n, p in model.named_parameters()
                 if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all())]
    if nonfinite:
        out.append(Finding("init", "error", f"non-finite values in parameters {nonfinite[:5]}",
                           "reload the checkpoint or re-initialise these parameters"))
    if not out:
        out.append(Finding("init", "ok", f"{len(checked)} linear/conv layer(s) initialised "
                           "within 0.1-10x of 1/sqrt(fan_in)"))
    return out


def check_model(model: nn.Module) -> list[Finding]:
    """:func:`check_init` plus the distributed BatchNorm check of the performance checklist.

    Under an initialised ``torch.distributed`` group of more than one process, plain
    BatchNorm layers normalise with per-GPU statistics; they should be SyncBatchNorm.
    """
    out = check_init(model)
    bns = [n for n, m in model.named_modules() if isinstance(m, _BATCH_NORMS)]
    dist = torch.distributed
    if bns and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out.append(Finding(
            "sync_batchnorm", "warning",
            f"{len(bns)} BatchNorm layer(s) use per-GPU statistics in a "
            f"{dist.get_world_size()}-process run: {bns[:3]}",
            "model = nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping in DDP"))
    return out
