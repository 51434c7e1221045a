"""Every built-in transform through the public contract kit (accelfn.testing), each against
its plain PyTorch reference written with torch only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accelfn as af
from accelfn.testing import check_transform, plain_update


def loss_fn(model, batch):
    return {"loss": F.cross_entropy(model(batch["x"]), batch["y"])}


def plain(model, optimizer, batch):
    plain_update(model, optimizer, batch, loss_fn)


def clipped(model, optimizer, batch):
    plain_update(model, optimizer, batch, loss_fn,
                 edit_grads=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))


def two_micro_batches(model, optimizer, batch):
    for part in (slice(0, 6), slice(6, 12)):
        (loss_fn(model, batch[part])["loss"] * 0.5).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bf16(model, optimizer, batch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(model, batch)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


OTHERS = {"amp": af.with_amp(dtype=torch.bfloat16), "accumulation": af.with_accumulation(2),
          "clipping": af.with_clipping(max_norm=0.5)}

CASES = {  # each stacked in every order with two other built-ins (6 orders)
    "with_clipping": (af.with_clipping(max_norm=0.5), clipped, ["amp", "accumulation"]),
    "with_accumulation": (af.with_accumulation(2), two_micro_batches, ["amp", "clipping"]),
    "with_amp": (af.with_amp(dtype=torch.bfloat16), bf16, ["accumulation", "clipping"]),
    "with_nonfinite": (af.with_nonfinite(policy="raise"), plain, ["amp", "clipping"]),
    "checkpointed": (af.checkpointed(), plain, ["accumulation", "clipping"]),
    "with_ema": (af.with_ema(decay=0.9), plain, ["amp", "accumulation"]),
    "distributed": (af.distributed(), plain, ["accumulation", "clipping"]),  # one process
}


@pytest.mark.parametrize("name", list(CASES))
def test_builtin_transform_passes_the_contract(name):
    transform, reference, others = CASES[name]
    report = check_transform(transform, reference=reference, loss_fn=loss_fn,
                             builtins=[OTHERS[o] for o in others], steps=2)
    assert report.passed == ["reference", "purity", "orders", "resume", "no host sync",
                             "bad input"]
    assert report.orders == 6


@pytest.mark.compile
def test_compiled_passes_the_contract_with_the_eager_backend():
    report = check_transform(af.compiled(backend="eager"), reference=plain, loss_fn=loss_fn,
                             builtins=[], steps=2)
    assert report.passed[0] == "reference" and report.orders == 1
