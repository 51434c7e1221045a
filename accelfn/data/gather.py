"""TensorDict sources: a whole batch gathered with one ``index_select`` per key.

:class:`TensorDictGather` fetches batches from an in-memory, memory-mapped or device-resident
TensorDict, with no per-sample Python: the fast path of :func:`accelfn.data.loader`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["Key", "TensorDictGather", "plain_tensor"]

#: A TensorDict key: a name, or a tuple of names for a nested key.
Key = str | tuple[str, ...]


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.Tensor`` view (drops the MemoryMappedTensor subclass and its overhead)."""
    return t.as_subclass(torch.Tensor) if type(t) is not torch.Tensor else t


def _nest(flat: Mapping[Key, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(key, tuple):
            d = out
            for part in key[:-1]:
                d = d.setdefault(part, {})
            d[key[-1]] = value
        else:
            out[key] = value
    return out


class TensorDictGather:
    """Fetch a batch from a TensorDict with one gather per key: ``__call__(indices) -> TensorDict``.

    Works on in-memory, memory-mapped (``TensorDict.load_memmap``) or device-resident
    TensorDicts; the gather runs where the data lives. Indices index the first batch dimension.

    Args:
        data: the dataset, one row per sample along ``batch_size[0]``.
        keys: keys to fetch (nested keys as tuples); default all leaves.

    Raises:
        TypeError: ``data`` is not a TensorDict with at least one batch dimension, or holds
            non-tensor leaves.
        ValueError: it is empty, or a requested key is missing.
    """

    def __init__(self, data: TensorDictBase, keys: Sequence[Key] | None = None) -> None:
        if not isinstance(data, TensorDictBase):
            raise TypeError(f"expected a TensorDict, got {type(data).__name__}")
        if data.batch_dims < 1:
            raise TypeError(
                "the TensorDict source needs a batch dimension (one row per sample): build it "
                "with TensorDict({...}, batch_size=[num_samples])"
            )
        n = data.batch_size[0]
        if n == 0:
            raise ValueError("the TensorDict source is empty (batch_size[0] == 0)")
        available = list(data.keys(include_nested=True, leaves_only=True))
        if keys is None:
            keys = available
        leaves: dict[Key, torch.Tensor] = {}
        for key in keys:
            if key not in available:
                raise ValueError(
                    f"key {key!r} is not in the TensorDict source; available keys: "
                    f"{sorted(map(str, available))}"
                )
            value = data.get(key)
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"key {key!r} of the TensorDict source holds {type(value).__name__}, not a "
                    "tensor; store per-sample data as tensors (one row per sample)"
                )
            leaves[key] = plain_tensor(value)
        self.num_samples = n
        self.device = data.device
        self._leaves = leaves

    def __call__(self, indices: torch.Tensor) -> TensorDict:
        first = next(iter(self._leaves.values()))
        if indices.device != first.device:
            indices = indices.to(first.device, non_blocking=True)
        out = {k: torch.index_select(v, 0, indices) for k, v in self._leaves.items()}
        return TensorDict(_nest(out), batch_size=[indices.shape[0]], device=self.device)

