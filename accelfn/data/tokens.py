"""Token files: flat arrays of token ids on disk, read as one stream in windows.

Two layouts are read (and :func:`write_tokens` writes both):

* **raw** — nanoGPT's ``train.bin``: the token ids and nothing else, written with
  ``np.memmap`` (or ``ndarray.tofile``); its dtype is not recorded, so it is given
  (``dtype="uint16"`` by default, nanoGPT's for the GPT-2 vocabulary).
* **shard** — llm.c's and modded-nanogpt's ``.bin`` shards: a header of 256 little-endian
  int32 (1024 bytes), then the tokens. ``header[0]`` is the magic number, ``header[1]`` the
  version, ``header[2]`` the number of tokens; ``20240520`` / version 1 means uint16 tokens,
  ``20240801`` / version 7 uint32 tokens (a vocabulary over 65,536). The rest of the header is
  zero. The file is exactly ``1024 + count * itemsize`` bytes: a shorter one (an interrupted
  write) is refused.

With ``format="auto"`` a file whose header holds one of the magic numbers, its version and a
count that matches the file's size is a shard; any other file is raw.

:class:`TokenFiles` reads any number of such files as one stream of tokens, in order. It
reads only the windows asked for (positioned reads, ``os.pread``), into buffers of that
size: memory stays bounded whatever the size of the files, and nothing of a file stays
resident in the process once its window is copied out (a memory map of the file would keep
every page it touched resident in the process, which is why nanoGPT re-creates its
``np.memmap`` for every batch). The operating system's page cache still serves repeated
reads, shared by the processes of a node.
"""

from __future__ import annotations

import bisect
import glob
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = ["HEADER_BYTES", "SHARD_MAGIC", "TokenFiles", "write_tokens"]

#: The shard header: 256 little-endian int32.
HEADER_BYTES = 256 * 4
#: magic number -> (version, token dtype) of the shard layout (llm.c's, modded-nanogpt's).
SHARD_MAGIC: dict[int, tuple[int, str]] = {20240520: (1, "uint16"), 20240801: (7, "uint32")}
_DTYPES = ("uint16", "uint32")

PathLike = str | os.PathLike[str]
Format = Literal["auto", "raw", "shard"]


def _dtype_name(dtype: Any) -> str:
    try:
        name = str(np.dtype(dtype).name)
    except TypeError:
        name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(
            f"dtype={dtype!r}: token files hold uint16 (a vocabulary up to 65,536, e.g. "
            "GPT-2's) or uint32 tokens; pass dtype='uint16' or 'uint32'"
        )
    return name


def _expand(paths: PathLike | Sequence[PathLike]) -> list[Path]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[Path] = []
    for item in items:
        text = os.fspath(item)
        if any(c in text for c in "*?[") and not os.path.exists(text):
            matches = sorted(glob.glob(text))
            if not matches:
                raise FileNotFoundError(f"no token file matches {text!r}")
            out += [Path(m) for m in matches]
        else:
            out.append(Path(text))
    if not out:
        raise ValueError("no token files given: pass a path, a glob pattern or a list of paths")
    return out


def _read_header(path: Path, size: int) -> tuple[str, int] | None:
    """``(dtype, count)`` if ``path`` starts with a shard header, else None.

    Raises:
        ValueError: the header is a shard's but the file's size does not match its count.
    """
    if size < HEADER_BYTES:
        return None
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    magic, version, count = (int(v) for v in header[:3])
    if magic not in SHARD_MAGIC or SHARD_MAGIC[magic][0] != version:
        return None
    dtype = SHARD_MAGIC[magic][1]
    expected = HEADER_BYTES + count * np.dtype(dtype).itemsize
    if count < 0 or size != expected:
        raise ValueError(
            f"{path} has a token-shard header (magic {magic}, version {version}) saying "
            f"{count} {dtype} tokens, i.e. {expected} bytes, but the file has {size} bytes: "
            "it was not completely written; write it again (or pass format='raw' if it is a "
            "raw token file that happens to start with these numbers)"
        )
    return dtype, count


class TokenFiles:
    """Token files (raw or shards, see the module) read as one stream of token ids.

    ``read(start, stop)`` returns tokens ``[start, stop)`` of the concatenation of the files,
    in the order given (a glob pattern is expanded in sorted order, as modded-nanogpt lists
    its shards), reading only that window. Document boundaries are not file boundaries: a
    file that does not end a document continues into the next.

    Args:
        paths: a path, a glob pattern (``"data/fineweb_train_*.bin"``) or a list of them.
        dtype: ``"uint16"`` or ``"uint32"``. Raw files need it (default ``"uint16"``,
            nanoGPT's); for shards it is read from the header, and a given one must agree.
        format: ``"auto"`` (a shard if the header says so, else raw), ``"raw"`` or
            ``"shard"`` (every file must be one).

    Raises:
        FileNotFoundError: a file (or a pattern's every match) is missing.
        ValueError: a bad dtype, a truncated shard, a raw file whose size is not a whole
            number of tokens, files of different dtypes, or no token at all.
    """

    def __init__(self, paths: PathLike | Sequence[PathLike], *, dtype: Any = None,
                 format: Format = "auto") -> None:
        if format not in ("auto", "raw", "shard"):
            raise ValueError(f"format must be 'auto', 'raw' or 'shard', got {format!r}")
        wanted = None if dtype is None else _dtype_name(dtype)
        self.paths = tuple(p.resolve() for p in _expand(paths))
        offsets, counts, dtypes = [], [], []
        for path in self.paths:
            size = os.stat(path).st_size  # FileNotFoundError names the path
            header = None if format == "raw" else _read_header(path, size)
            if header is None and format == "shard":
                raise ValueError(
                    f"{path} is not a token shard (no header with magic "
                    f"{' or '.join(map(str, SHARD_MAGIC))}); pass format='raw' (with its dtype) "
                    "for nanoGPT-style files without a header"
                )
            if header is not None:
                file_dtype, count = header
                if wanted is not None and wanted != file_dtype:
                    raise ValueError(
                        f"{path} is a shard of {file_dtype} tokens but dtype={wanted!r} was "
                        "given; leave dtype=None for shards"
                    )
                offsets.append(HEADER_BYTES)
            else:
                file_dtype = wanted or "uint16"
                itemsize = np.dtype(file_dtype).itemsize
                if size % itemsize:
                    raise ValueError(
                        f"{path} has {size} bytes, not a whole number of {file_dtype} tokens; "
                        "is it a token file, and is dtype right?"
                    )
                count = size // itemsize
                offsets.append(0)
            counts.append(count)
            dtypes.append(file_dtype)
        if len(set(dtypes)) > 1:
            mixed = ", ".join(f"{p.name}: {d}" for p, d in zip(self.paths, dtypes))
            raise ValueError(f"the token files hold different dtypes ({mixed}); use one dtype")
        self.dtype = np.dtype(dtypes[0]).newbyteorder("<")  # as written on disk
        self.counts = tuple(counts)
        self._offsets = tuple(offsets)
        self._starts = tuple(int(s) for s in np.cumsum([0, *counts]))
        self.num_tokens = self._starts[-1]
        if self.num_tokens == 0:
            raise ValueError(f"the token files {[str(p) for p in self.paths]} hold no token")
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()  # only where there is no os.pread (Windows)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"TokenFiles({len(self.paths)} file(s), {self.num_tokens:,} {self.dtype.name} "
                "tokens)")

    def describe(self) -> list[list[Any]]:
        """``[[file name, token count], ...]``: what a loader's position is checked against."""
        return [[p.name, c] for p, c in zip(self.paths, self.counts)]

    def _fd(self, i: int) -> int:
        if os.getpid() != self._pid:  # a forked child: descriptors are not shared
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(i)
        if fd is None:
            fd = self._fds[i] = os.open(self.paths[i], os.O_RDONLY | getattr(os, "O_BINARY", 0))
        return fd

    def _pread(self, i: int, nbytes: int, offset: int) -> bytes:
        fd = self._fd(i)
        if hasattr(os, "pread"):
            data = os.pread(fd, nbytes, offset)
        else:  # pragma: no cover - Windows
            with self._lock:
                os.lseek(fd, offset, os.SEEK_SET)
                data = os.read(fd, nbytes)
        if len(data) != nbytes:
            raise OSError(
                f"{self.paths[i]}: read {len(data)} of {nbytes} bytes at offset {offset}; the "
                "file changed size after it was opened"
            )
        return data

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream, a new array of the files' dtype.

        Raises:
            IndexError: the window is not inside ``[0, num_tokens]``.
        """
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(
                f"token window [{start}, {stop}) is outside the stream of {self.num_tokens}"
            )
        out = np.empty(stop - start, dtype=self.dtype)
        itemsize = self.dtype.itemsize
        i = bisect.bisect_right(self._starts, start) - 1
        pos = start
        while pos < stop:
            end = min(stop, self._starts[i + 1])
            if end > pos:
                data = self._pread(i, (end - pos) * itemsize,
                                   self._offsets[i] + (pos - self._starts[i]) * itemsize)
                out[pos - start:end - start] = np.frombuffer(data, dtype=self.dtype)
            pos = end
            i += 1
        return out

    def close(self) -> None:
        """Close the open file descriptors (the next read opens them again)."""
        fds, self._fds = self._fds, {}
        if os.getpid() == self._pid:
            for fd in fds.values():
                os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_fds"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()


def write_tokens(path: PathLike, tokens: Any, *, dtype: Any = None,
                 format: Literal["shard", "raw"] = "shard") -> Path:
    """Write token ids to ``path`` as a shard (header + tokens) or a raw nanoGPT file.

    ``tokens`` is anything ``np.asarray`` takes (a list, an array, a CPU tensor) of
    non-negative ids. ``dtype`` defaults to uint16 when every id fits, else uint32. The file
    is written under a temporary name and renamed, so a reader never sees half of it; missing
    folders of ``path`` are created. A shard holds fewer than 2**31 tokens (its header's count
    is an int32): split larger corpora into several files and read them together with
    [`TokenFiles`][].

    Raises:
        ValueError: negative ids, ids too large for ``dtype``, or too many for one shard.
    """
    if format not in ("shard", "raw"):
        raise ValueError(f"format must be 'shard' or 'raw', got {format!r}")
    if hasattr(tokens, "numpy") and hasattr(tokens, "detach"):
        tokens = tokens.detach().cpu().numpy()
    ids = np.asarray(tokens).reshape(-1)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got an array of {ids.dtype}")
    low = int(ids.min()) if ids.size else 0
    high = int(ids.max()) if ids.size else 0
    if low < 0:
        raise ValueError(f"token ids must be >= 0, got {low}")
    name = _dtype_name(dtype) if dtype is not None else (
        "uint16" if high < 2**16 else "uint32")
    if high >= 2 ** (8 * np.dtype(name).itemsize):
        raise ValueError(f"token id {high} does not fit in {name}; pass dtype='uint32'")
    if format == "shard" and ids.size >= 2**31:
        raise ValueError(
            f"{ids.size} tokens do not fit one shard (its header counts in int32): write "
            "several files"
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            if format == "shard":
                magic = next(m for m, (_, d) in SHARD_MAGIC.items() if d == name)
                header = np.zeros(256, dtype="<i4")
                header[:3] = (magic, SHARD_MAGIC[magic][0], ids.size)
                f.write(header.tobytes())
            f.write(ids.astype(np.dtype(name).newbyteorder("<"), copy=False).tobytes())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
