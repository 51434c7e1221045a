"""The documents of packed rows, read from their ``document_ids`` (a test helper)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def segments(document_ids: torch.Tensor) -> Iterator[tuple[int, int, int]]:
    """``(row, start, stop)`` of every document of every row (padding, ids < 0, left out)."""
    for r, ids in enumerate(document_ids.tolist()):
        start = 0
        for j in range(1, len(ids) + 1):
            if j == len(ids) or ids[j] != ids[start]:
                if ids[start] >= 0:
                    yield r, start, j
                start = j
