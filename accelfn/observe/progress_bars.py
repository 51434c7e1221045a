"""Console progress bars for long work: tqdm when installed, else a built-in one.

Bars show on rank 0 only when ``torch.distributed`` is initialised.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import IO, Protocol, TypeVar

from ..core.processes import is_main_process

__all__ = ["Bar", "make_bar", "progress"]

T = TypeVar("T")


class Bar(Protocol):
    """What the monitor asks of a progress bar (tqdm's methods of the same names)."""

    def update(self, n: int = 1) -> object: ...

    def set_postfix_str(self, s: str) -> object: ...

    def close(self) -> object: ...


class _SimpleBar:
    """A one-line progress bar for when tqdm is not installed."""

    def __init__(self, total: int | None, desc: str, file: IO[str],
                 interval: float = 0.2) -> None:
        self.total, self.desc, self.file, self.interval = total, desc, file, interval
        self.n = 0
        self.postfix = ""
        self._t0 = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self._last >= self.interval or (self.total and self.n >= self.total):
            self._last = now
            self._draw(now)

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def _draw(self, now: float) -> None:
        rate = self.n / max(now - self._t0, 1e-9)
        if self.total:
            frac = min(self.n / self.total, 1.0)
            bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
            head = f"{self.desc} {self.n}/{self.total} [{bar}] {100 * frac:3.0f}%"
        else:
            head = f"{self.desc} {self.n}"
        tail = f" {self.postfix}" if self.postfix else ""
        self.file.write(f"\r{head} {rate:.1f} it/s{tail}")
        self.file.flush()

    def close(self) -> None:
        self._draw(time.perf_counter())
        self.file.write("\n")
        self.file.flush()


def make_bar(total: int | None, desc: str, file: IO[str] | None) -> Bar:
    """A console progress bar on ``file`` (default ``sys.stderr``): tqdm when installed,
    else a built-in one-line bar."""
    file = file if file is not None else sys.stderr
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total, desc, file)
    bar: Bar = tqdm(total=total, desc=desc, file=file, dynamic_ncols=True, leave=True)
    return bar


def progress(iterable: Iterable[T], *, total: int | None = None, desc: str = "",
             disable: bool | None = None, file: IO[str] | None = None) -> Iterator[T]:
    """Iterate with a console progress bar (tqdm if installed, else a built-in one).

    Shown on rank 0 only when ``torch.distributed`` is initialised; ``disable=True`` hides
    it. ``total`` defaults to ``len(iterable)`` when it has one.
    """
    if disable is None:
        disable = not is_main_process()
    if disable:
        yield from iterable
        return
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    bar = make_bar(total, desc, file)
    try:
        for item in iterable:
            yield item
            bar.update(1)
    finally:
        bar.close()

