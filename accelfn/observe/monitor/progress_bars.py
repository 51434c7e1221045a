"""Console progress bars for long work: a redrawn bar in a terminal, plain lines elsewhere.

In a terminal (``file.isatty()``) the bar is tqdm when installed, else a built-in one-line
bar redrawn with ``\\r``. Anywhere else (a log file, a pipe, CI, a notebook's captured
stream) redrawing would pile every update into one endless line, so the bar writes a plain
line each ``every`` of the way (10% by default; every ``interval`` seconds when the total is
unknown) and its last line once, when it closes. Bars show on rank 0 only when
``torch.distributed`` is initialised. A resumed run's bar starts at ``initial`` (the steps
done before it) and its rate counts only the steps done since.

Why not tqdm alone: tqdm is not a dependency of accelfn (torch, torchvision, tensordict,
torchdata and pynvml are), so a bar must work without it; and tqdm redraws with ``\r`` in a
log file or a pipe as well, where the lines pile up. tqdm is used where it is right (an
interactive terminal, when installed); the rest is the few lines below.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import IO, Any, Protocol, TypeVar

from ...core.processes import is_main_process

__all__ = ["Bar", "is_terminal", "make_bar", "progress", "row_postfix"]

T = TypeVar("T")


class Bar(Protocol):
    """What the monitor asks of a progress bar (tqdm's methods of the same names)."""

    def update(self, n: int = 1) -> object: ...

    def set_postfix_str(self, s: str) -> object: ...

    def close(self) -> object: ...


def is_terminal(file: IO[str]) -> bool:
    """Whether ``file`` is an interactive terminal (where ``\\r`` redraws a line)."""
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _line(desc: str, n: int, total: int | None, elapsed: float, postfix: str,
          initial: int = 0) -> str:
    """``desc 30/100 [######..............]  30% 12.0 it/s 2.5s loss=0.3``; the rate counts
    the steps since ``initial``."""
    rate = (n - initial) / max(elapsed, 1e-9)
    if total:
        frac = min(n / total, 1.0)
        bar = "#" * int(frac * 20) + "." * (20 - int(frac * 20))
        head = f"{desc} {n}/{total} [{bar}] {100 * frac:3.0f}%"
    else:
        head = f"{desc} {n}"
    tail = f" {postfix}" if postfix else ""
    return f"{head} {rate:.1f} it/s {elapsed:.1f}s{tail}"


class _SimpleBar:
    """A one-line bar redrawn with ``\\r``, for terminals when tqdm is not installed."""

    def __init__(self, total: int | None, desc: str, file: IO[str],
                 interval: float = 0.2, initial: int = 0) -> None:
        self.total, self.desc, self.file, self.interval = total, desc, file, interval
        self.n = self.initial = initial
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
        self.file.write("\r" + _line(self.desc, self.n, self.total, now - self._t0,
                                     self.postfix, self.initial))
        self.file.flush()

    def close(self) -> None:
        self._draw(time.perf_counter())
        self.file.write("\n")
        self.file.flush()


class LineBar:
    """Progress as plain lines, for streams that are not terminals: no ``\\r``.

    With a ``total``, one line each time another ``every`` of it is done (``every=0.1``:
    10%, 20%, ... 90%); without one, a line every ``interval`` seconds. The last line is
    written by [`close`][] (after the caller has set the final postfix), once: not when it
    would repeat the last line written. ``initial``: the count it starts from (a resumed
    run's steps so far); its next line is at the next multiple of ``every`` after it.
    """

    def __init__(self, total: int | None, desc: str, file: IO[str], *, every: float = 0.1,
                 interval: float = 10.0, initial: int = 0) -> None:
        if not 0 < every <= 1:
            raise ValueError(f"progress bar every={every}: a fraction of the total in (0, 1]")
        self.total, self.desc, self.file = total, desc, file
        self.every, self.interval = every, interval
        self.n = self.initial = initial
        self.postfix = ""
        self._t0 = self._last = time.perf_counter()
        self._mark = self._reached() + 1  # the next multiple of every * total to report
        self._written: int | None = None  # n of the last line written
        self._closed = False

    def _reached(self) -> int:
        """How many multiples of ``every * total`` ``n`` has reached (0 without a total)."""
        return math.floor(self.n / (self.every * self.total) + 1e-9) if self.total else 0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if self.total:
            reached = self._reached()
            if reached >= self._mark:
                self._mark = reached + 1
                if self.n < self.total:  # the end is written by close()
                    self._write(now)
        elif now - self._last >= self.interval:
            self._write(now)

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def _write(self, now: float) -> None:
        self._last = now
        self._written = self.n
        self.file.write(_line(self.desc, self.n, self.total, now - self._t0, self.postfix,
                              self.initial) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._written != self.n:
            self._write(time.perf_counter())


def row_postfix(row: dict[str, Any]) -> str:
    """What the monitor's bar shows of its latest row: ``loss=0.31 812 samples/s wait 3%``."""
    parts = [f"{k}={row[k]:.4g}" for k in ("loss",) if k in row]
    if row.get("samples_per_s"):
        parts.append(f"{row['samples_per_s']:.0f} samples/s")
    parts.append(f"wait {100 * row['data_share']:.0f}%")
    return " ".join(parts)


def make_bar(total: int | None, desc: str, file: IO[str] | None, *,
             every: float = 0.1, initial: int = 0) -> Bar:
    """A console progress bar on ``file`` (default ``sys.stderr``).

    In a terminal: tqdm when installed, else a built-in one-line bar. Elsewhere: a
    [`LineBar`][] writing a plain line each ``every`` of ``total``. ``initial``: the count
    it starts from, e.g. the steps a resumed run had done (``total`` is then the whole
    run's); rates and the time left count only the steps since.
    """
    if initial < 0 or (total is not None and initial > total):
        raise ValueError(f"progress bar initial={initial}: the steps already done, from 0 to "
                         f"the total ({total})")
    file = file if file is not None else sys.stderr
    if not is_terminal(file):
        return LineBar(total, desc, file, every=every, initial=initial)
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total, desc, file, initial=initial)
    bar: Bar = tqdm(total=total, desc=desc, file=file, dynamic_ncols=True, leave=True,
                    initial=initial)
    return bar


def progress(iterable: Iterable[T], *, total: int | None = None, desc: str = "",
             disable: bool | None = None, file: IO[str] | None = None,
             every: float = 0.1) -> Iterator[T]:
    """Iterate with a console progress bar (see [`make_bar`][]).

    Shown on rank 0 only when ``torch.distributed`` is initialised; ``disable=True`` hides
    it. ``total`` defaults to ``len(iterable)`` when it has one. Outside a terminal a plain
    line is written each ``every`` of the total.
    """
    if disable is None:
        disable = not is_main_process()
    if disable:
        yield from iterable
        return
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    bar = make_bar(total, desc, file, every=every)
    try:
        for item in iterable:
            yield item
            bar.update(1)
    finally:
        bar.close()
