"""The tests' shared helpers: small models, batches and step functions, parameter comparisons,
and torchrun launches (no accelfn logic here). Tests import them from here; tests/conftest.py
keeps pytest's hooks and fixtures only."""

from __future__ import annotations

import copy
import io

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn


class Block(nn.Module):
    """A residual MLP block with dropout-free LayerNorm (a transformer block's shape)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """An input layer, ``depth`` blocks (``block(dim)``, a [`Block`][] by default), a head."""

    def __init__(self, dim: int = 8, depth: int = 3, classes: int = 4,
                 block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.inp = nn.Linear(6, dim)
        self.blocks = nn.ModuleList(block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class MLPBlock(nn.Module):
    """A transformer block's MLP: LayerNorm, Linear up, GELU, Linear down, residual (tensor
    parallel: ``up`` column-wise, ``down`` row-wise)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPNet(Net):
    """``Net`` of two [`MLPBlock`][]s."""

    def __init__(self, dim: int = 8, depth: int = 2, classes: int = 4) -> None:
        super().__init__(dim, depth, classes, block=MLPBlock)


def classify(model, batch):
    logits = model(batch["x"])
    loss = F.cross_entropy(logits, batch["y"])
    return {"loss": loss, "accuracy": (logits.argmax(-1) == batch["y"]).float().mean()}


def token_loss(model, batch):
    """Token-level loss: mean over valid tokens (mask), returning the token count as weight."""
    logits = model(batch["x"])  # (B, classes) stands in for per-token logits
    per = F.cross_entropy(logits, batch["y"], reduction="none")
    mask = batch["mask"].float()
    tokens = mask.sum()
    return {"loss": (per * mask).sum() / tokens, "weight": tokens}


def make_batch(n: int = 10, seed: int = 0, td: bool = True):
    g = torch.Generator().manual_seed(seed)
    data = {
        "x": torch.randn(n, 6, generator=g),
        "y": torch.randint(0, 4, (n,), generator=g),
        "mask": (torch.rand(n, generator=g) > 0.3),
    }
    data["mask"][0] = True
    return TensorDict(data, batch_size=[n]) if td else data


def clone_setup(model, opt_cls=torch.optim.SGD, **opt_kwargs):
    """Two identical (model, optimizer) pairs."""
    a = model
    b = copy.deepcopy(model)
    kwargs = {"lr": 0.1, **opt_kwargs}
    return (a, opt_cls(a.parameters(), **kwargs)), (b, opt_cls(b.parameters(), **kwargs))


def assert_params_equal(m1, m2, exact: bool = True, atol: float = 0.0, rtol: float = 0.0):
    for (n1, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        if exact:
            assert torch.equal(p1, p2), f"parameter {n1} differs: max {(p1 - p2).abs().max()}"
        else:
            torch.testing.assert_close(p1, p2, atol=atol, rtol=rtol, msg=f"parameter {n1}")


def as_dict(batch) -> dict:
    return {k: v for k, v in batch.items()}


def free_port() -> int:
    """A free TCP port on the loopback interface (for torchrun rendezvous in tests)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(*args, timeout: float = 300, nproc: int = 2, **run):
    """``args`` (a script and its arguments) under torchrun: ``nproc`` processes meeting on
    127.0.0.1, one intra-op thread each; asserts that they succeeded."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **run.pop("env", {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **run)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def torchrun_results(worker, out, timeout: float = 300, nproc: int = 2) -> list:
    """Run ``worker out`` under [`torchrun`][] (``nproc`` processes) and load what each rank
    saved with [`save_rank_results`][] (``out/rank<r>.pt``), rank 0 first."""
    torchrun(worker, out, timeout=timeout, nproc=nproc)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def save_rank_results(out_dir, results) -> None:
    """In a torchrun worker: save this rank's ``results`` for [`torchrun_results`][], then
    wait for every rank and take the process group down."""
    import os

    import torch.distributed as dist

    torch.save(results, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def roundtrip(obj):
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)`` in memory (what a
    checkpoint file does to a state_dict)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def poisonable(loss_fn=classify):
    """``(fn, poison)``: ``loss_fn`` whose loss turns NaN while ``poison["on"]`` is true (a
    skipped update on demand)."""
    poison = {"on": False}

    def fn(model, batch):
        out = loss_fn(model, batch)
        if poison["on"]:
            out["loss"] = out["loss"] * float("nan")
        return out

    return fn, poison
