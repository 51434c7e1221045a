"""DDP: the model wrapped in ``DistributedDataParallel``, and the all-reduce of gradients that
a window's last backward did not synchronise (``step.flush``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["all_reduce_grads", "wrap_ddp"]


def wrap_ddp(model: nn.Module, device: torch.device, static_graph: bool,
             compression: str | None, bucket_cap_mb: float | None,
             find_unused_parameters: bool) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    kwargs: dict[str, Any] = {"gradient_as_bucket_view": True, "static_graph": static_graph,
                              "find_unused_parameters": find_unused_parameters}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    ddp = DistributedDataParallel(model, **kwargs)
    _no_buffer_sync_without_grad(ddp)
    if compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif compression == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif compression == "powersgd":
        hook_state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                start_powerSGD_iter=2)
        ddp.register_comm_hook(hook_state, powerSGD_hook.powerSGD_hook)
    return ddp


def _no_buffer_sync_without_grad(ddp: nn.Module) -> None:
    """DDP broadcasts rank 0's buffers (BatchNorm statistics) before a forward that follows a
    training forward, evaluation included: a collective that evaluating on the main process
    only waits for forever. A forward without gradients skips it, and leaves DDP's flag as
    it found it, so the next training forward synchronises on every process alike."""
    saved: list[bool] = []

    def before(module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            saved.append(bool(getattr(module, "require_forward_param_sync")))  # noqa: B009
            setattr(module, "require_forward_param_sync", False)  # noqa: B010

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if saved:
            setattr(module, "require_forward_param_sync", saved.pop())  # noqa: B010

    ddp.register_forward_pre_hook(before)
    ddp.register_forward_hook(after, always_call=True)


def all_reduce_grads(model: nn.Module, group: Any) -> None:
    """Average the gradients over the processes, as DDP's synced backward does, for
    gradients accumulated under ``no_sync`` that no synced backward followed (a window that
    ``step.flush`` closes). One all-reduce; a gradient that no process has stays None."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    device = params[0].device
    flat = torch.cat([*[(p.grad if p.grad is not None else torch.zeros_like(p))
                        .detach().reshape(-1).to(torch.float32) for p in params],
                      torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                                   device=device)])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    world = dist.get_world_size(group)
    total = sum(p.numel() for p in params)
    present = flat[total:].tolist()  # one host read, at a flush only
    offset = 0
    for p, has in zip(params, present):
        n = p.numel()
        if has:
            grad = flat[offset:offset + n].view_as(p).div_(world).to(p.dtype)
            if p.grad is not None:
                p.grad.copy_(grad)  # in place: DDP's bucket views stay views
            else:
                p.grad = grad
        offset += n
