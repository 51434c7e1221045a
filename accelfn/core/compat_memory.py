"""The private torch APIs the memory estimate and snapshots use, each behind one name (kept
beside ``compat``, whose rule it follows, so that ``import accelfn`` does not import them).

Fake tensors (``torch._subclasses.fake_tensor``) carry a shape, a dtype and a device but no
memory; a dispatch mode (``torch.utils._python_dispatch``) sees every operator. CUDA's
allocator history is ``torch.cuda.memory._record_memory_history`` / ``_dump_snapshot``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["DispatchMode", "dump_cuda_snapshot", "fake_mode", "fake_of", "in_backward",
           "is_fake", "leaves", "local_scalar", "record_cuda_history"]

DispatchMode = TorchDispatchMode
local_scalar = torch.ops.aten._local_scalar_dense.default  # Tensor.item() and friends


def fake_mode() -> Any:
    """A fake-tensor mode that accepts real tensors (made fake as they come)."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_of(mode: Any, tensor: Tensor) -> Tensor:
    """The fake tensor of ``tensor`` in ``mode``: same shape, dtype, strides and device."""
    return mode.from_tensor(tensor)  # type: ignore[no-any-return]


def is_fake(tensor: object) -> bool:
    return issubclass(type(tensor), FakeTensor)


def in_backward() -> bool:
    """Whether the running operator runs in autograd's backward pass."""
    return torch._C._current_autograd_node() is not None


def record_cuda_history(enabled: bool, max_entries: int = 100_000) -> None:
    """Start (or stop) recording CUDA allocations with their stacks."""
    torch.cuda.memory._record_memory_history("all" if enabled else None,
                                             max_entries=max_entries)


def dump_cuda_snapshot(path: str) -> None:
    """Write the recorded CUDA allocator history (PyTorch's memory viewer reads it)."""
    torch.cuda.memory._dump_snapshot(path)  # type: ignore[no-untyped-call]


def leaves(tree: Any) -> list[Any]:
    """The leaves of nested lists, tuples and dicts (``torch.utils._pytree.tree_flatten``)."""
    return list(tree_flatten(tree)[0])
