"""Run under torchrun by tests/transforms/test_distributed.py: every distributed case in one launch.

Each rank trains on its own slice of a global batch; rank 0 saves the final parameters of
each case (and every rank its all-reduce counts) for the test to compare with a
single-process reference on the whole batch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, os.path.dirname(__file__))
from helpers import Net, classify, token_loss
from trunk_models import TrunkNet, via_method, via_submodule

import accelfn as af

# Rank r trains on rows RANK_ROWS[r] of the global batch: uneven across ranks.
RANK_ROWS = [slice(0, 7), slice(7, 12)]
STEPS = 3


def global_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    n = 12
    mask = torch.rand(n, generator=g) > 0.3
    mask[0] = mask[7] = True
    return {"x": torch.randn(n, 6, generator=g), "y": torch.randint(0, 4, (n,), generator=g),
            "mask": mask}


CASES = {
    "ddp": lambda: af.distributed(classify),
    "ddp_acc3": lambda: af.distributed(af.with_accumulation(3)(classify)),
    "acc3_ddp": lambda: af.with_accumulation(3)(af.distributed(classify)),
    "ddp_tokens": lambda: af.with_accumulation(2)(af.distributed(token_loss)),
    "ddp_clip_amp": lambda: af.with_amp(dtype=torch.bfloat16)(af.distributed(
        af.with_accumulation(2)(af.with_clipping(max_norm=0.05)(classify)))),
    "ddp_bf16_hook": lambda: af.distributed(compression="bf16")(classify),
    "fsdp_acc2_clip": lambda: af.with_clipping(max_norm=0.05)(af.with_accumulation(2)(
        af.distributed(strategy="fsdp")(classify))),
    "fsdp_once": lambda: af.with_accumulation(2)(af.distributed(strategy="fsdp",
                                                                fsdp_sync="once")(classify)),
    # checkpoint wrap, DDP/FSDP2, then torch.compile, whatever the stacking order
    "ddp_compiled_ckpt": lambda: af.with_accumulation(2)(af.compiled(af.checkpointed(
        af.distributed(classify)))),
    "fsdp_compiled_ckpt": lambda: af.compiled(af.distributed(strategy="fsdp")(
        af.with_accumulation(2)(af.checkpointed(classify)))),
    # the loss outside forward: submodules called, the head's weight read; a method
    "ddp_trunk_clip_amp": lambda: af.with_amp(dtype=torch.bfloat16)(af.distributed(
        af.with_accumulation(2)(af.with_clipping(max_norm=0.05)(received(via_submodule))))),
    "ddp_method_acc3": lambda: af.with_accumulation(3)(af.distributed(received(via_method))),
    "fsdp_trunk_acc2_clip": lambda: af.with_clipping(max_norm=0.05)(af.with_accumulation(2)(
        af.distributed(strategy="fsdp")(af.checkpointed(received(via_submodule))))),
    "fsdp_method_once": lambda: af.with_accumulation(2)(af.distributed(
        strategy="fsdp", fsdp_sync="once")(received(via_method))),
    # adaptive clipping on DTensor shards (a row whole on one process), the head left out
    "fsdp_agc_clip": lambda: af.with_clipping(max_norm=0.05)(af.distributed(strategy="fsdp")(
        af.adaptive_clipping(0.01, skip=lambda p: p.shape[:1] == (4,))(classify))),
}
MODELS = {name: TrunkNet for name in CASES if "trunk" in name or "method" in name}
RECEIVED: list[str] = []  # what each call of a received(fn) got
TRAINED: list = []  # the model of the case being trained


def received(fn):
    """``fn``, noting whether it receives the model being trained (FSDP2 makes its class a
    subclass of the user's, in place)."""
    def spy(model, batch):
        RECEIVED.append("the TrunkNet trained" if isinstance(model, TrunkNet)
                        and model is TRAINED[-1] else f"another: {type(model).__name__}")
        return fn(model, batch)

    spy.__name__ = fn.__name__
    return spy


class Counter:
    def __init__(self) -> None:
        self.calls = 0


def counting_hook(state: Counter, bucket):
    state.calls += 1
    return default_hooks.allreduce_hook(None, bucket)


def main(out_dir: str) -> None:
    af.init_distributed()
    rank = dist.get_rank()
    results = {}
    only = os.environ.get("ACCELFN_CASES")
    selected = {k: v for k, v in CASES.items() if not only or k in only.split(",")}
    for name, build in selected.items():
        torch.manual_seed(0)
        model = MODELS.get(name, Net)()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = build()
        state = af.TrainState(model, optimizer)
        counter = Counter()
        counts = []
        RECEIVED.clear()
        TRAINED.append(model)
        if name in ("ddp_acc3", "ddp_method_acc3"):  # the DDP that runs the step function
            step.prepare(state).call.register_comm_hook(counter, counting_hook)
        for i in range(STEPS):
            rows = RANK_ROWS[rank]
            batch = {k: v[rows] for k, v in global_batch(i).items()}
            before = counter.calls
            metrics = step(state, batch)
            counts.append(counter.calls - before)
        full = {}
        for pname, p in model.named_parameters():
            full[pname] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        results[name] = {"params": {k: v.clone() for k, v in full.items()},
                         "counts": counts, "loss": metrics["loss"].clone(),
                         "reduced": af.reduce_metrics(metrics).to_dict(),
                         "received": sorted(set(RECEIVED))}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
