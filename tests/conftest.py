"""Shared fixtures: small models, batches and step functions (no accelfn logic here).

Every test process runs torch with one intra-op thread, and so does every process a test
starts (torchrun workers, loader worker processes, example scripts, the GPU suite's dry run):
they inherit ``OMP_NUM_THREADS=1`` from here. The suite's processes share a few cores; torch's
default of one thread per core oversubscribes them and makes a loaded machine many times
slower.

Tiers (markers in pyproject.toml): ``make test-fast`` leaves out ``slow``, ``compile`` and
``distributed`` tests; ``make test`` runs them all but ``gpu_suite`` (registered here), the
full dry run of ``benchmarks/gpu_suite.sh``, which runs with ``--gpu-suite-dry-run``
(``make test-gpu-suite``).

In parallel (``make test`` runs ``pytest -n auto --dist loadgroup``, pytest-xdist): each worker
process imports this file, so the one-thread pin holds in every worker, and each has its own
``tmp_path`` root. The scheduler below sends all the tests of a module that defines a module-
or class-scoped fixture, or caches a result with functools (a training run, a torchrun
launch, a built site), to one worker, so it is built once rather than once on each worker;
every other test goes to whichever worker is free.
"""

from __future__ import annotations

import ast
import copy
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_variable] = "1"  # inherited by every process a test starts
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu-suite-dry-run", action="store_true",
                     help="also run the tests marked gpu_suite: the full dry run of "
                          "benchmarks/gpu_suite.sh on the CPU (minutes)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu_suite: the full dry run of benchmarks/gpu_suite.sh; run with "
                   "--gpu-suite-dry-run (make test-gpu-suite)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--gpu-suite-dry-run"):
        return
    skip = pytest.mark.skip(reason="the full dry run of benchmarks/gpu_suite.sh: "
                                   "make test-gpu-suite (or pytest --gpu-suite-dry-run)")
    for item in items:
        if item.get_closest_marker("gpu_suite") is not None:
            item.add_marker(skip)


def _shares_fixtures(path: Path) -> bool:
    """Whether the test module at ``path`` (or a conftest.py above it in tests/) defines a
    fixture built once for several of its tests (``scope`` "class", "module" or "package"),
    or caches a result for them (``functools.lru_cache`` or ``cache``)."""
    files = [path, *(d / "conftest.py" for d in path.parents if d.is_relative_to(_TESTS))]
    for file in files:
        if not file.is_file():
            continue
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.keyword) and node.arg == "scope" and isinstance(
                    node.value, ast.Constant) and node.value.value in _SHARED_SCOPES:
                return True
            if isinstance(node, ast.FunctionDef) and any(
                    _name(d.func if isinstance(d, ast.Call) else d) in _CACHES
                    for d in node.decorator_list):
                return True
    return False


def _name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)


_TESTS = Path(__file__).resolve().parent
_SHARED_SCOPES = ("class", "module", "package")
_CACHES = ("lru_cache", "cache")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` that also keeps the tests of a module with shared fixtures on one
    worker. pytest-xdist's own loadgroup reads the groups from node ids it rewrites, which
    pytest 9.2's structured node ids no longer allow; here the groups come from the scheduler,
    which sees only node ids (so a module's fixtures are found in its source)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    shared: dict[str, bool] = {}

    class SharedFixtureScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # an xdist_group mark
                return super()._split_scope(nodeid)
            return worker_unit(nodeid, config.rootpath, shared)

    return SharedFixtureScheduling(config, log)


def worker_unit(nodeid: str, root: Path, shared: dict[str, bool]) -> str:
    """What goes to one worker with the test ``nodeid``: its module (every test in it) when
    the module shares fixtures, else the test alone; ``shared`` caches the modules' answers."""
    module = nodeid.split("::", 1)[0]
    if module not in shared:
        shared[module] = _shares_fixtures(root / module)
    return module if shared[module] else nodeid


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
    def __init__(self, dim: int = 8, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(6, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


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


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net()


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
