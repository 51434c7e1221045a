"""pytest plugin: keep only the GPU-only tests, deselecting the others.

A test is GPU-only when it is marked ``gpu`` or carries a ``skipif`` whose reason names CUDA
or a GPU (``@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")``),
and not the CPU-only ones (a reason that names the CPU). On a machine without a GPU the
selected tests are collected and skipped, which checks the selection itself.

    PYTHONPATH=benchmarks pytest -p gpu_only tests
"""

from __future__ import annotations

import re
from typing import Any

_GPU = re.compile(r"\b(cuda|gpus?|nvml|nccl)\b", re.IGNORECASE)
_CPU = re.compile(r"\bcpu\b", re.IGNORECASE)


def is_gpu_only(item: Any) -> bool:
    """Whether the collected test ``item`` is one that only runs on a GPU."""
    if item.get_closest_marker("gpu") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if _GPU.search(reason) and not _CPU.search(reason):
            return True
    return False


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    keep = [item for item in items if is_gpu_only(item)]
    dropped = [item for item in items if not is_gpu_only(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
