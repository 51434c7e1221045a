"""FSDP2: ``fully_shard`` per block and on the root, over a 1-D mesh (FSDP), a 2-D one (HSDP)
or the data-parallel part of a mesh whose innermost dimension is tensor parallel; and the
optimizers that sharded parameters cannot be trained by (Muon's sharded step: ``muon``)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...core.modules import find_blocks
from ...core.state import TrainState
from .ddp import plain_output
from .muon import check_muon, is_muon

__all__ = ["check_optimizers", "parameter_names", "repoint_optimizers", "root_call",
           "shard_fsdp"]


def shard_fsdp(model: nn.Module, mesh: Any, param_dtype: torch.dtype | None,
               offload: str | None, reshard_after_forward: bool | int | None) -> None:
    """``fully_shard`` each repeated block, then the root, over ``mesh`` (None: the world),
    in place: reductions in float32, ``param_dtype`` for the forward (``with_amp``'s)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if offload == "cpu":  # pinned host memory only where there is a device to copy to
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks = dict(kwargs)
    if reshard_after_forward is not None:
        blocks["reshard_after_forward"] = reshard_after_forward
    for _, block in find_blocks(model):
        fully_shard(block, **blocks)
    # the root keeps FSDP2's default: gathered from its forward to the backward, so the
    # parameters it owns stay gathered for the whole step function (see root_call)
    fully_shard(model, **kwargs)


_CALL = "_accelfn_step_call"


def _run(call: Callable[[], Any]) -> Any:
    return plain_output(call())


def root_call(model: nn.Module) -> Callable[[Callable[[], Any]], Any]:
    """A function running a call of the step function as a forward of the FSDP2 root
    ``model`` (``register_fsdp_forward_method``): the parameters the root owns are gathered
    for the whole function, so a submodule, a method or a parameter read directly
    (``model.head.weight``) gets what ``model(...)`` gets; the blocks gather their own."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    model.__dict__[_CALL] = _run
    register_fsdp_forward_method(model, _CALL)
    call: Callable[[Callable[[], Any]], Any] = getattr(model, _CALL)
    return call


def parameter_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's name by its id: what to point the optimizers at after sharding."""
    return {id(p): name for name, p in model.named_parameters()}


def repoint_optimizers(state: TrainState, model: nn.Module, before: dict[int, str]) -> None:
    """``parallelize_module`` and ``fully_shard`` swap parameters for DTensor ones: point the
    optimizers' groups at them (``before``: the names taken before the swap)."""
    after = dict(model.named_parameters())
    for optimizer in state.optimizers:
        for group in optimizer.param_groups:
            group["params"] = [after[before[id(p)]] for p in group["params"]]


def check_optimizers(optimizers: tuple[torch.optim.Optimizer, ...], strategy: str,
                     tp: int, names: dict[int, str] | None = None) -> None:
    """Refuse what the strategy cannot train correctly, before anything changes: an optimizer
    with state and ``ZeroRedundancyOptimizer`` when parameters are sharded (FSDP2, HSDP,
    tensor parallel), ZeRO's ``overlap_with_ddp`` (its step runs inside a DDP hook that
    ``distributed`` does not register), and a Muon holding anything but 2-D matrices
    (``names``: the parameters' names by id, for the message). Muon over sharded parameters
    is trained by [`shard_muon`][accelfn.parts.distributed.muon.shard_muon]."""
    # looked up, not imported: importing it after the process group exists would bind the
    # group into a default argument for the process' life (see accelfn.core.processes)
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    ZeroRedundancyOptimizer = getattr(zero, "ZeroRedundancyOptimizer", ())
    sharded = strategy != "ddp" or tp > 1
    how = f"distributed(strategy={strategy!r}{f', tp={tp}' if tp > 1 else ''})"
    for index, optimizer in enumerate(optimizers):
        if is_muon(optimizer):
            check_muon(optimizer, index, how, names)
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            if sharded:
                raise ValueError(
                    f"ZeroRedundancyOptimizer cannot train the parameters that {how} shards: "
                    "FSDP2 shards the optimizer state already. Pass the plain optimizer "
                    "(torch.optim.AdamW(...)) with FSDP2/HSDP, or keep ZeroRedundancyOptimizer "
                    "with distributed(strategy='ddp') (ZeRO-1)")
            if getattr(optimizer, "_overlap_with_ddp", False):
                raise ValueError(
                    "ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside a DDP comm "
                    "hook that distributed(...) does not register; build it with "
                    "overlap_with_ddp=False (the default): the step then calls its step()")
        if not sharded:
            continue
        if optimizer.state:
            raise ValueError(f"{how} must shard the model before the optimizer has state; "
                             "build the step before loading a checkpoint")
