"""Host reads that are not syncs by design, marked so the sync probe can tell them apart.

Some bookkeeping reads values on the host that were copied there asynchronously one update
earlier (the non-finite guard's deferred read with fused optimizers): on a GPU that read
waits for nothing. A CPU run cannot show the difference, so such reads run inside
:func:`deferred_read`, and ``accelfn.observe``'s sync probe leaves reads made inside it out
of its emulated report. The marker is a thread-local flag, not a file path: moving code does
not change what the probe sees.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["GUARD_READ", "deferred_read", "in_deferred_read", "labelled_read", "read_label"]

#: The label of the non-finite guard's host read with an optimizer that cannot skip on the
#: device (one read per update); the sync probe names it and its fix.
GUARD_READ = "accelfn non-finite guard (optimizer without a device-side skip)"


class _Flag(threading.local):
    depth = 0
    label: str | None = None


_FLAG = _Flag()


@contextlib.contextmanager
def deferred_read() -> Iterator[None]:
    """Mark the enclosed host reads as reads of data already copied to the host."""
    _FLAG.depth += 1
    try:
        yield
    finally:
        _FLAG.depth -= 1


def in_deferred_read() -> bool:
    """Whether the calling thread is inside :func:`deferred_read`."""
    return _FLAG.depth > 0


class labelled_read:  # a context manager used like a function
    """Name the host reads inside the block (real syncs on a GPU) for the sync probe.

    A class rather than a generator: it is entered once per update by the non-finite guard.
    """

    __slots__ = ("_label", "_outer")

    def __init__(self, label: str) -> None:
        self._label = label
        self._outer: str | None = None

    def __enter__(self) -> None:
        self._outer, _FLAG.label = _FLAG.label, self._label

    def __exit__(self, *exc: object) -> None:
        _FLAG.label = self._outer


def read_label() -> str | None:
    """The label of the enclosing :func:`labelled_read`, or None."""
    return _FLAG.label
