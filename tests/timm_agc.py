"""timm's adaptive gradient clipping, as it is written: the test reference of
``af.adaptive_clipping`` (tests/transforms/test_adaptive_clipping.py, and the FSDP2 case of
tests/transforms/test_distributed.py).

``timm/utils/agc.py`` (``unitwise_norm`` and ``adaptive_clip_grad``) and
``timm/models/_helpers.py``'s ``model_parameters``, as timm's ``train.py`` calls them with
``--clip-mode agc``. timm itself is not a dependency; this imports nothing from accelfn.
"""

from __future__ import annotations

import torch


def unitwise_norm(x, norm_type=2.0):
    if x.ndim <= 1:
        return x.norm(norm_type)
    else:
        return x.norm(norm_type, dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_clip_grad(parameters, clip_factor=0.01, eps=1e-3, norm_type=2.0):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    for p in parameters:
        if p.grad is None:
            continue
        p_data = p.detach()
        g_data = p.grad.detach()
        max_norm = unitwise_norm(p_data, norm_type=norm_type).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(g_data, norm_type=norm_type)
        clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        new_grads = torch.where(grad_norm < max_norm, g_data, clipped_grad)
        p.grad.detach().copy_(new_grads)


def model_parameters(model, exclude_head=False):
    if exclude_head:
        return [p for p in model.parameters()][:-2]
    else:
        return model.parameters()
