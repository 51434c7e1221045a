"""pytest's hooks and fixtures (the shared helpers are in tests/helpers.py; no accelfn logic here).

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
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Net

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


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net()
