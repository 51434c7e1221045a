"""Shared by the checkpointing tests: a small run with every kind of state, and snapshots.

The run: AdamW, a StepLR schedule, an fp16 loss scaler, a user transform with a slot, Python,
NumPy and torch RNG in the step function, and an accelfn.data loader.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Net, classify
from tensordict import TensorDict

import accelfn as af
from accelfn import checkpointing as ckpt
from accelfn import data


def _count_into_grads(grads, params, state):
    for g in grads:
        g.add_(state["count"] * 1e-3)
    return {"count": state["count"] + 1}


def counter() -> af.GradientTransform:
    """A user gradient transform whose state changes the update (so a lost state is
    visible)."""
    return af.GradientTransform("counter", _count_into_grads,
                                init=lambda params: {"count": torch.zeros(())})


def dataset(n: int = 48) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict({"x": torch.randn(n, 6, generator=g),
                       "y": torch.randint(0, 4, (n,), generator=g)}, batch_size=[n])


def noisy(model, batch):
    out = classify(model, batch)
    out["loss"] = torch.nn.functional.dropout(out["loss"].unsqueeze(0), 0.3)[0] * (
        1 + 0.1 * random.random()) * (1 + 0.1 * float(np.random.rand()))
    return out


def setup(seed: int = 0, *, opt: str = "adamw", scheduler: bool = True, batch_size: int = 4,
          dim: int = 8):
    torch.manual_seed(seed)
    model = Net(dim=dim)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-2) if opt == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5) if scheduler else None
    state = af.TrainState(model, optimizer, scheduler=sched)
    loader = data.loader(dataset(), batch_size=batch_size, seed=1)
    step = af.with_amp(dtype=torch.float16, growth_interval=1)(
        af.with_clipping(af.apply_transform(noisy, counter())))
    step.prepare(state)  # what load() does first (creates the loss scaler's slot)
    return state, loader, step


def run(state, it, step, n):
    return [step(state, next(it))["loss"].clone() for _ in range(n)]


def snapshot(state):
    return {"params": [p.detach().clone() for p in state.model.parameters()],
            "opt": repr([o.state_dict() for o in state.optimizers]),
            "sched": [None if s is None else s.state_dict() for s in state.schedulers],
            "step": state.step, "slots": repr(state.state_dict()["slots"]),
            "rng": ckpt.rng_state()}


def assert_unchanged(before, state):
    after = snapshot(state)
    assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"]))
    assert before["opt"] == after["opt"]
    assert before["sched"] == after["sched"]
    assert before["step"] == after["step"]
    assert before["slots"] == after["slots"]
    assert repr(before["rng"]) == repr(after["rng"])


def scramble_rngs():
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)


def forge(path: Path, rel: str, content: bytes) -> None:
    """Replace a file and fix the marker's size and checksum, as a forged checkpoint would."""
    (path / rel).write_bytes(content)
    marker = json.loads((path / "COMMITTED").read_text())
    marker["files"][rel] = {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (path / "COMMITTED").write_text(json.dumps(marker))


_OWN = object()


def refused(path, match, build=setup, loader=_OWN, step=_OWN):
    """Loading ``path`` into a state from ``build`` raises ``match`` and changes nothing."""
    fresh, own_loader, own_step = build()
    before = snapshot(fresh)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load(path, fresh, loader=own_loader if loader is _OWN else loader,
                  step=own_step if step is _OWN else step)
    assert_unchanged(before, fresh)
