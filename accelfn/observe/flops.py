"""FLOP counting and datasheet peaks: the numerator and denominator of MFU.

:func:`training_flops` counts one forward and backward of a model once (with
``torch.utils.flop_counter.FlopCounterMode``); :func:`peak_flops` looks up the GPU's dense
peak for a dtype in :data:`PEAK_FLOPS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["PEAK_FLOPS", "count_flops", "peak_flops", "training_flops"]

# Dense (no sparsity) datasheet peaks per GPU in FLOP/s, matched against the device name in
# order (first match wins). tf32/bf16/fp16 are tensor-core rates with fp32 accumulation.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    (r"\bB200\b", {"bf16": 2.25e15, "fp16": 2.25e15, "tf32": 1.1e15}),
    (r"\bH200 NVL\b", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bGH200\b|\bH200\b", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12,
                             "fp32": 66.9e12}),
    (r"\bH100 NVL\b", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bH100 PCIe\b", {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51.2e12}),
    (r"\bH100\b|\bH800\b", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12,
                            "fp32": 66.9e12}),
    (r"\bA100\b|\bA800\b", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (r"\bL40S\b", {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12}),
    (r"\bA10\b", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    (r"\bL4\b", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    (r"\bV100\b", {"fp16": 125e12, "fp32": 15.7e12}),
    (r"\bT4\b", {"fp16": 65e12, "fp32": 8.1e12}),
]

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


_DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
                "half": "fp16", "tf32": "tf32", "fp32": "fp32", "float32": "fp32",
                "float": "fp32"}


def _dtype_key(name: str) -> str:
    """The table's key for a dtype name (``"bfloat16"`` -> ``"bf16"``); unknown ones raise."""
    key = _DTYPE_NAMES.get(str(name).lower().removeprefix("torch."))
    if key is None:
        raise ValueError(f"peak_dtype={name!r}: use a torch dtype or one of 'bf16', 'fp16', "
                         "'tf32', 'fp32'")
    return key


def peak_flops(device_name: str, dtype: torch.dtype | str = torch.bfloat16) -> float | None:
    """Datasheet dense peak FLOP/s of the GPU called ``device_name`` for ``dtype``.

    ``dtype`` is a torch dtype or one of ``"bf16"``, ``"fp16"``, ``"tf32"``, ``"fp32"`` (or
    ``"bfloat16"``, ``"float16"``, ``"float32"``); another name raises ``ValueError``.
    Returns ``None`` for an unknown GPU or a dtype it has no rate for (e.g. bf16 on a V100);
    pass ``peak_flops=`` to :class:`Monitor` then.
    """
    key = _DTYPE_KEYS.get(dtype, None) if isinstance(dtype, torch.dtype) else _dtype_key(dtype)
    for pattern, rates in PEAK_FLOPS:
        if re.search(pattern, device_name):
            return rates.get(key or "")
    return None


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """FLOPs of whatever ``fn(*args, **kwargs)`` runs, counted by ``FlopCounterMode``.

    Matrix multiplications and convolutions (forward and, if ``fn`` calls ``backward``,
    backward) are counted as 2 FLOPs per multiply-add; elementwise work is not counted,
    which is the usual convention for MFU.
    """
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())


def training_flops(model: nn.Module, *inputs: Any,
                   loss_fn: Callable[[Any], Tensor] | None = None) -> int:
    """FLOPs of one forward and backward of ``model(*inputs)`` (one training step's work).

    ``loss_fn(output)`` makes the loss (default ``output.sum()``; the loss itself adds no
    counted FLOPs for the usual losses). Gradients, buffers (BatchNorm statistics) and the
    random number generators (dropout) are restored afterwards, so counting does not change
    training. For a ``Linear(i, o)`` on a
    batch of ``B`` this is ``2*B*i*o`` forward plus ``2*B*i*o`` for the weight gradient,
    and another ``2*B*i*o`` when the input needs a gradient (every layer but the first).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    saved_buffers = [b.detach().clone() for b in model.buffers()]
    for p in params:
        p.grad = None

    def run() -> None:
        out = model(*inputs)
        if loss_fn is not None:
            loss = loss_fn(out)
        else:
            if isinstance(out, Mapping):
                out = out.get("loss", next(iter(out.values())))
            elif isinstance(out, (tuple, list)):
                out = out[0]
            loss = out.float().sum()
        torch.autograd.backward(loss)

    # dropout and other random layers draw from the generators: count on a forked stream so
    # that the training run's random numbers are the same with and without the count
    devices = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers(),
                                                      *[i for i in inputs
                                                        if isinstance(i, Tensor)]]
                      if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            return count_flops(run)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, s in zip(model.buffers(), saved_buffers):
                b.copy_(s)
