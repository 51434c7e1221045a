"""The private torch API of an update's optimizer calls: the step and the gradient clip.

``optimizer.step()`` and ``clip_grad_norm_`` are correct and slow around small models: the
step runs inside a profiler label (an operator of its own) with hook loops, and the clip
groups the gradients by device and dtype twice and moves each norm to the first device. On a
three-layer MLP on the CPU that Python costs 25 us of the step's 189 us and 36 us of the
clip's 63 us. Here each is the same kernels, in the same order, called directly when nothing
else is asked of the wrapper (no hook registered, no profiler recording, one device and
dtype); anything else takes torch's own call. The results are bitwise those of torch's calls
(``tests/core/test_compat_optim.py``), and each private name used is tested there so that a
torch upgrade that changes it fails in one place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.optim.optimizer as _optimizer_module
from torch import Tensor

__all__ = ["clip_grad_norm_", "direct_step"]

_profiler_enabled = torch._C._autograd._profiler_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_compiling = torch.compiler.is_compiling
_foreach_devices = {"cpu", *torch.utils._foreach_utils._get_foreach_kernels_supported_devices()}


def direct_step(optimizer: torch.optim.Optimizer) -> Callable[[], object]:
    """``optimizer.step``, calling the optimizer class's own ``step`` without torch's
    profiling wrapper (``Optimizer.profile_hook_step``) whenever that wrapper would add
    nothing: no step hook registered (on the optimizer or globally), no profiler recording,
    and ``step`` not replaced on the instance other than by a learning-rate scheduler's
    tracker, whose flag is set as it sets it, and not being traced by ``torch.compile``
    (which knows ``optimizer.step``). Checked at every call."""
    wrapped = type(optimizer).step
    raw = getattr(wrapped, "__wrapped__", None) if getattr(wrapped, "hooked", False) else None
    if raw is None:
        return optimizer.step
    fields = optimizer.__dict__
    global_pre = _optimizer_module._global_optimizer_pre_hooks
    global_post = _optimizer_module._global_optimizer_post_hooks

    def step() -> object:
        own = fields.get("step")
        if (_profiler_enabled() or _compiling() or global_pre or global_post
                or fields.get("_optimizer_step_pre_hooks")
                or fields.get("_optimizer_step_post_hooks")
                or (own is not None and not getattr(own, "_wrapped_by_lr_sched", False))):
            return optimizer.step()
        if own is not None:  # what the scheduler's tracker records, for its order warning
            fields["_opt_called"] = True
        return raw(optimizer)

    return step


def _plain(grads: list[Tensor]) -> bool:
    """Whether ``grads`` are plain tensors of one device and dtype with foreach kernels
    (torch's clip then makes one group of them, in this order)."""
    device, dtype = grads[0].device, grads[0].dtype
    return device.type in _foreach_devices and all(
        type(g) is Tensor and g.device == device and g.dtype == dtype for g in grads)


def clip_grad_norm_(grads: list[Tensor], max_norm: float, norm_type: float) -> Tensor | None:
    """``torch.nn.utils.clip_grad_norm_`` of the parameters of ``grads`` (in their order),
    bitwise, returning the total norm before clipping, when ``grads`` are plain tensors of
    one device and dtype; None, changing nothing, otherwise (take torch's call then)."""
    if not grads or not _plain(grads):
        return None
    previous = torch.is_grad_enabled()
    _set_grad_enabled(False)
    try:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type)),
                                        norm_type)
        torch._foreach_mul_(grads, torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0))
        return norm  # type: ignore[no-any-return]
    finally:
        _set_grad_enabled(previous)
