"""DDP: the model's gradients synchronised by ``DistributedDataParallel``, the step function
run as its forward; and the all-reduce of gradients that a window's last backward did not
synchronise (``step.flush``).

DDP prepares its reducer in its own forward, so whatever the step function calls must run
inside that forward. DDP wraps :class:`StepCall`, a module whose only child is the user's
model and whose forward runs one call of the step function: DDP's buffer broadcast, reducer
and ``no_sync`` wrap the whole function, and the function gets the model itself (its
submodules and methods reach the same parameters, whose gradients DDP's hooks reduce).
torch's composable ``replicate`` would do the same in place, but is not public API and has
none of DDP's communication hooks, static graph or bucket settings.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import nn

__all__ = ["Replicated", "StepCall", "all_reduce_grads", "match_gradient_strides", "plain_output",
           "wrap_ddp"]


class StepCall(nn.Module):
    """What DDP wraps: the model (as ``module``, so DDP's names are the model's behind
    ``module.``) and a forward that runs one call of the step function."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model

    def forward(self, call: Callable[[], Any]) -> Any:
        return plain_output(call())


def plain_output(out: Any) -> Any:
    """A TensorDict output as a dict of its entries: DDP and FSDP2 find the tensors of an
    output (to hook the backward) in dicts, lists and tuples."""
    if isinstance(out, TensorDictBase):
        return dict(out.items())
    return out


def wrap_ddp(model: nn.Module, device: torch.device, static_graph: bool,
             compression: str | None, bucket_cap_mb: float | None,
             find_unused_parameters: bool) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel`` over :class:`StepCall` of ``model``: calling it with a
    function of no argument runs the function as DDP's forward."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    kwargs: dict[str, Any] = {"gradient_as_bucket_view": True, "static_graph": static_graph,
                              "find_unused_parameters": find_unused_parameters}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    match_gradient_strides(model)  # before DDP takes the parameters' strides
    ddp = DistributedDataParallel(StepCall(model), **kwargs)
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


class Replicated:
    """What runs the step function under DDP: ``build()``'s ``DistributedDataParallel``,
    built again when the model's trainable parameters change between updates (a layer
    unfrozen for fine-tuning, ``af.unfreeze``).

    DDP registers the parameters that require a gradient when it is built: one unfrozen
    later would keep a gradient of its own process only (the replicas drifting apart with no
    error), one frozen later fails the next forward. Rebuilding is what a hand-written loop
    does (``DistributedDataParallel(model.module, ...)`` again); it costs one broadcast, and
    ``compression="powersgd"`` starts its error feedback afresh. The check is a host walk of
    ``requires_grad`` at each update's first micro-batch, no device work."""

    def __init__(self, model: nn.Module, build: Callable[[], nn.Module]) -> None:
        self._model = model
        self._build = build
        self._trainable = _trainable(model)
        self._hooks: list[tuple[Any, Callable[..., Any]]] = []
        self.ddp: nn.Module = build()

    def __call__(self, call: Callable[[], Any]) -> Any:
        return self.ddp(call)

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """``DistributedDataParallel.register_comm_hook``, kept across rebuilds."""
        self.ddp.register_comm_hook(state, hook)  # type: ignore[operator]
        self._hooks.append((state, hook))

    def refresh(self, window_open: bool) -> None:
        """Build DDP again if the trainable parameters changed since it was built; refused
        inside an accumulation window (its gradients were reduced by the other set)."""
        now = _trainable(self._model)
        if now == self._trainable:
            return
        if window_open:
            raise ValueError(
                "the model's trainable parameters changed (requires_grad) inside an "
                "accumulation window, whose gradients DDP reduces as one set; freeze or "
                "unfreeze between updates (after the window's last call, or step.flush(state))")
        old, self.ddp = self.ddp, None  # type: ignore[assignment]
        del old  # its reducer's hooks go with it, before the new one adds its own
        gc.collect()
        self.ddp = self._build()
        for hook_state, hook in self._hooks:
            self.ddp.register_comm_hook(hook_state, hook)  # type: ignore[operator]
        self._trainable = now


def _trainable(model: nn.Module) -> tuple[bool, ...]:
    return tuple(p.requires_grad for p in model.parameters())


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def match_gradient_strides(model: nn.Module) -> None:
    """Give the weights of a channels_last model that are contiguous both ways (a 1x1
    convolution's ``(out, in, 1, 1)``, a depthwise one's ``(out, 1, k, k)``) channels_last's
    own strides, those of the gradients the convolutions' backward makes; values unchanged,
    the parameters the same objects.

    ``t.contiguous(memory_format=torch.channels_last)`` (``af.channels_last``) leaves such a
    weight as it was: its size-1 dimensions make it channels_last already. DDP builds its
    bucket views with the parameters' strides, so each such gradient differed from its view:
    "Grad strides do not match bucket view strides" at the first backward (and a copy of
    such a gradient into its bucket where a view would do). A model with no channels_last
    weight (4-D or 5-D, one that is not contiguous) is left as it is: its gradients are
    contiguous."""
    params = [p for p in model.parameters() if p.dim() in _CHANNELS_LAST]
    used = {p.dim() for p in params
            if p.is_contiguous(memory_format=_CHANNELS_LAST[p.dim()]) and not p.is_contiguous()}
    for p in params:
        fmt = _CHANNELS_LAST[p.dim()]
        if p.dim() not in used or not p.is_contiguous(memory_format=fmt):
            continue
        own = torch.empty(p.shape, device="meta", memory_format=fmt).stride()
        if p.stride() != own:
            with torch.no_grad():
                p.data = p.detach().clone(memory_format=fmt)


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
