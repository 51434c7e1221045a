"""Language-model batches from token files: random windows, or documents packed into rows.

:func:`token_loader` reads [`TokenFiles`][accelfn.data.TokenFiles] (nanoGPT's raw ``.bin``,
llm.c / modded-nanogpt shards) and yields TensorDict batches of ``batch_size`` rows of
``seq_len`` positions: ``inputs``, ``targets`` (``-100`` at padding), ``document_ids`` and
``positions`` (see ``accelfn.data.packing``), through the same stages as
[`loader`][accelfn.data.loader] (prefetch thread, pinned memory, non-blocking copy) and
with the same exact, checked position (``state_dict()`` / ``load_state_dict()``).

* ``packing="windows"``: nanoGPT's random windows, but as epochs: the stream is cut into
  windows of ``seq_len`` pairs from an offset drawn per epoch, visited in a permutation
  drawn per epoch from ``(seed, epoch)`` (a Feistel permutation: nothing stored, whatever
  the number of windows). ``shuffle=False`` walks them in order from offset 0.
* ``packing="greedy"`` / ``"best-fit"``: documents walked in order and packed into rows
  without padding (see ``accelfn.data.packing``); an epoch is one pass over the stream. The
  rows are given out shuffled within blocks of ``shuffle_rows`` (a new order every epoch),
  so that a batch holds many documents, not consecutive rows of a few.

Sharding: every rank computes the same sequence of windows or rows, rank ``r`` of ``w``
keeps ``r, r + w, ...`` of each round of ``batch_size * w``, so all ranks yield the same
number of batches without talking to each other. A position is the epoch, the batches
given and (packing) the block of rows and the packer's state at its start: plain ints and
lists of a fixed form, exact mid-epoch and mid-buffer.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDict
from torchdata.nodes import BaseNode

from .batch_loader import BatchLoader
from .epochs import EpochSource
from .packing import (
    BestFitPacker,
    DocumentScanner,
    GreedyPacker,
    feistel_permute,
    packed_rows,
    window_rows,
)
from .sampling import mix_seed, resolve_shard
from .stages import ToDevice, in_threads, resolve_device
from .tokens import TokenFiles

__all__ = ["PackedRows", "TokenWindows", "token_loader"]

Packing = Literal["windows", "greedy", "best-fit"]


def _as_batch(arrays: dict[str, np.ndarray]) -> TensorDict:
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    return TensorDict(tensors, batch_size=[next(iter(tensors.values())).shape[0]])


def _refuse(state: Any, what: str) -> ValueError:
    return ValueError(
        f"the loader position holds {state!r:.300} where a {what} position belongs; pass what "
        "BatchLoader.state_dict() returned by a token_loader built the same way"
    )


def _counters(state: Any, what: str) -> tuple[int, int]:
    if not isinstance(state, dict):
        raise _refuse(state, what)
    epoch, batches = state.get("epoch"), state.get("batches")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for v in (epoch, batches)):
        raise _refuse(state, what)
    assert isinstance(epoch, int) and isinstance(batches, int)
    return epoch, batches


class TokenWindows(EpochSource[TensorDict]):
    """Batches of windows of ``seq_len`` pairs, drawn per epoch (see the module).

    The stream's ``num_tokens - 1`` pairs are cut into ``num_windows`` windows starting at an
    offset in ``[0, seq_len)`` drawn from ``(seed, epoch)``; an epoch visits them in a
    permutation drawn from ``(seed, epoch)``, rank ``r`` taking entries ``r, r + w, ...``.
    State: ``{"epoch": e, "batches": k}``.
    """

    def __init__(self, files: TokenFiles, *, seq_len: int, batch_size: int, shuffle: bool,
                 seed: int, drop_last: bool, rank: int, world_size: int,
                 delimiter: int | None, opens: bool) -> None:
        super().__init__()
        self.files, self.seq_len, self.batch_size = files, seq_len, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.rank, self.world_size = rank, world_size
        self.delimiter, self.opens = delimiter, opens
        pairs = files.num_tokens - 1
        if pairs < seq_len:
            raise ValueError(
                f"the token files hold {files.num_tokens} tokens, fewer than one window of "
                f"seq_len + 1 = {seq_len + 1}; lower seq_len or add data"
            )
        # room for the drawn offset: windows from any offset < seq_len fit in the stream
        self.num_windows = (pairs - seq_len + 1) // seq_len if pairs >= 2 * seq_len - 1 else 1
        self._offsets = min(seq_len - 1, pairs - self.num_windows * seq_len) + 1
        w = world_size
        self.per_rank = self.num_windows // w if drop_last else -(-self.num_windows // w)

    @property
    def num_batches(self) -> int:
        b = self.batch_size
        return self.per_rank // b if self.drop_last else -(-self.per_rank // b)

    def check_state(self, state: Any) -> tuple[int, int]:
        epoch, batches = _counters(state, "token-window")
        if set(state) != {"epoch", "batches"} or batches > self.num_batches:
            raise _refuse(state, f"token-window ({self.num_batches} batches per epoch)")
        return epoch, batches

    def window_starts(self, epoch: int, batch: int) -> np.ndarray:
        """The first pairs of the windows of ``batch`` of ``epoch`` on this rank."""
        b, w, n = self.batch_size, self.world_size, self.num_windows
        local = np.arange(batch * b, min((batch + 1) * b, self.per_rank), dtype=np.int64)
        order = (self.rank + local * w) % n  # wrap-around pads the last round (not drop_last)
        offset = 0
        if self.shuffle:
            order = feistel_permute(order, n, mix_seed(self.seed, epoch))
            offset = mix_seed(self.seed, epoch, 1) % self._offsets
        return offset + order * self.seq_len

    def next(self) -> TensorDict:
        self._started = True
        if self._batches >= self.num_batches:
            raise StopIteration
        starts = self.window_starts(self.epoch, self._batches)
        self._batches += 1
        return _as_batch(window_rows(self.files, starts, self.seq_len, self.delimiter,
                                     self.opens))

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches": self._batches}


class PackedRows(EpochSource[TensorDict]):
    """Batches of documents packed into rows, walked in order (see ``accelfn.data.packing``).

    The packer's rows are taken in blocks of ``shuffle_rows`` consecutive rows, each block
    given out in a permutation drawn from ``(seed, epoch, block)`` (in order with
    ``shuffle=False``): a batch holds rows of many documents rather than consecutive rows of
    a few. Every rank packs the whole stream (the delimiters of all of it are read: a scan
    at memory speed) and keeps rows ``r, r + w, ...`` of each round of ``batch_size * w``
    rows given out, reading the tokens of its own rows only. With ``drop_last`` a final
    incomplete round is dropped; without it every rank gets ``ceil(k / w)`` of its ``k``
    rows, padded with empty rows. State: ``{"epoch", "batches", "block", "given",
    "packer"}``: the block, the rows of it given out, and the packer's state at the block's
    start (the block is packed again on resume).
    """

    def __init__(self, files: TokenFiles, *, seq_len: int, batch_size: int,
                 packing: Literal["greedy", "best-fit"], buffer: int, drop_last: bool,
                 rank: int, world_size: int, delimiter: int, opens: bool, shuffle: bool,
                 shuffle_rows: int, seed: int) -> None:
        super().__init__()
        self.files, self.seq_len, self.batch_size = files, seq_len, batch_size
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.shuffle, self.shuffle_rows, self.seed = shuffle, shuffle_rows, seed
        if files.num_tokens < 2:
            raise ValueError("the token files hold one token: no pair to train on")
        scanner = DocumentScanner(files, delimiter=delimiter, opens=opens, max_pairs=seq_len)
        self.packer: GreedyPacker | BestFitPacker = (
            GreedyPacker(scanner, seq_len) if packing == "greedy"
            else BestFitPacker(scanner, seq_len, buffer))
        self._start_epoch(None)

    def _start_epoch(self, state: dict[str, Any] | None) -> None:
        self.packer.restore(None if state is None else state["packer"])
        self._block = 0 if state is None else int(state["block"])
        self._given = 0 if state is None else int(state["given"])
        self._block_start = self.packer.state()
        self._rows: list[list[Any]] | None = None  # the block's rows, packed when needed
        self._order: list[int] = []

    def _pack_block(self) -> None:
        rows: list[list[Any]] = []
        while len(rows) < self.shuffle_rows and (row := self.packer.next_row()) is not None:
            rows.append(row)
        self._rows = rows
        self._order = list(range(len(rows)))
        if self.shuffle and len(rows) > 1:
            g = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch, self._block))
            self._order = torch.randperm(len(rows), generator=g).tolist()
        if self._given > len(rows):
            raise ValueError(
                f"the loader position says {self._given} rows of block {self._block} were "
                f"given out, but the block has {len(rows)}: it was saved with other files or "
                "settings"
            )

    def _next_row(self) -> list[Any] | None:
        if self._rows is None:
            self._pack_block()
        assert self._rows is not None
        if self._given == len(self._rows) and self._rows:
            self._block += 1
            self._given = 0
            self._block_start = self.packer.state()
            self._pack_block()
        if self._given == len(self._rows):
            return None  # the end of the data
        row = self._rows[self._order[self._given]]
        self._given += 1
        return row

    def check_state(self, state: Any) -> tuple[int, int]:
        epoch, batches = _counters(state, "packed-rows")
        if (set(state) != {"epoch", "batches", "block", "given", "packer"}
                or not all(isinstance(state[k], int) and not isinstance(state[k], bool)
                           and 0 <= state[k] for k in ("block", "given"))
                or state["given"] > self.shuffle_rows
                or not self.packer.check(state["packer"])):
            raise _refuse(state, f"packed-rows ({type(self.packer).__name__})")
        return epoch, batches

    def _resume(self, state: dict[str, Any]) -> None:
        self._start_epoch(state)

    def _begin_epoch(self) -> None:
        self._start_epoch(None)

    def next(self) -> TensorDict:
        self._started = True
        w, b = self.world_size, self.batch_size
        mine = []
        count = 0
        while count < b * w:
            row = self._next_row()
            if row is None:
                break
            if count % w == self.rank:
                mine.append(row)
            count += 1
        if count < b * w and (self.drop_last or count == 0):
            if self._batches == 0:
                raise ValueError(
                    f"the token files give no batch: {count} rows of seq_len={self.seq_len} "
                    f"in epoch {self.epoch}, and a batch needs a whole round of batch_size * "
                    f"world_size = {b * w} rows with drop_last=True; lower batch_size or "
                    "seq_len, add data, or pass drop_last=False"
                )
            raise StopIteration
        self._batches += 1
        rows = -(-count // w)  # every rank the same batch size, padded with empty rows
        return _as_batch(packed_rows(self.files, mine, self.seq_len, num_rows=rows))

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches": self._batches, "block": self._block,
                "given": self._given, "packer": self._block_start}


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def token_loader(
    source: TokenFiles | str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    batch_size: int,
    seq_len: int,
    packing: Packing = "windows",
    eot: int | None = None,
    bos: int | None = None,
    buffer: int | None = None,
    shuffle: bool = True,
    shuffle_rows: int | None = None,
    seed: int = 0,
    drop_last: bool = True,
    device: torch.device | str | None = None,
    prefetch: int = 2,
    pin_memory: bool | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    dtype: Any = None,
) -> BatchLoader:
    """A loader of language-model batches from token files.

    Each batch is a TensorDict of ``batch_size`` rows (``int64``, ``(batch_size, seq_len)``):
    ``inputs`` and ``targets`` (the next token; ``-100``, cross-entropy's ``ignore_index``,
    at padding), ``document_ids`` (0, 1, ... per row; -1 at padding) and ``positions``
    (restarting at 0 at each document). Build attention masks from ``document_ids`` with
    [`document_causal_mask`][accelfn.data.document_causal_mask] or
    [`document_block_mask`][accelfn.data.document_block_mask]; count the real tokens as
    ``(targets != -100).sum()``.

    Args:
        source: [`TokenFiles`][accelfn.data.TokenFiles], or the path(s) / glob pattern to
            open as such (with ``dtype``).
        batch_size: rows per batch (per rank).
        seq_len: positions per row.
        packing: ``"windows"`` (random windows, per epoch), ``"greedy"`` (documents in order,
            cut at row ends) or ``"best-fit"`` (documents in order, each row filled best-fit
            from a buffer of ``buffer`` pieces); the last two need ``eot`` or ``bos``.
        eot: the token id that ends each document (nanoGPT: GPT-2's 50256 after every one).
        bos: the token id that opens each document (modded-nanogpt, nanochat).
        buffer: pieces of documents the best-fit packer chooses from (default 256).
        shuffle: windows: a new offset and order every epoch (default), or in order from 0;
            packing: the packed rows given out in a new order every epoch within blocks of
            ``shuffle_rows`` consecutive rows (default), so that a batch holds rows of many
            documents, or in the order packed.
        shuffle_rows: packing only: rows per shuffled block (default 1024); they are packed
            ahead (a list of their documents' places: memory bounded by this).
        seed: seed of the windows' offsets and of the permutations.
        drop_last: drop the final incomplete round of batches (default). Without it the
            last batch is smaller: windows, the rank's remaining windows (the last round
            wraps around to the first windows, so that every rank has as many); packing, the
            ``count < batch_size * world_size`` rows left are shared out in turn and every
            rank's last batch has ``ceil(count / world_size)`` rows, a rank with fewer real
            rows getting empty ones (targets ``-100``, ``document_ids`` ``-1``) so that all
            ranks' batches have one size.
        device: where batches go (``None``: stay on the host); pinned and copied without
            blocking on CUDA, as [`loader`][accelfn.data.loader] does.
        prefetch: batches prepared ahead in a background thread (0: none).
        pin_memory: page-lock host batches; ``None`` = only when ``device`` is CUDA.
        rank: shard to load; default ``torch.distributed``'s rank when initialised, else 0.
        world_size: number of shards; default ``torch.distributed``'s, else 1.
        dtype: the token dtype of raw files, when ``source`` is paths.

    Raises:
        TypeError / ValueError: with how to fix it, for a bad argument or too little data.
    """
    _check_int("batch_size", batch_size, 1)
    _check_int("seq_len", seq_len, 1)
    _check_int("prefetch", prefetch, 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if packing not in ("windows", "greedy", "best-fit"):
        raise ValueError(
            f"packing must be 'windows', 'greedy' or 'best-fit', got {packing!r}"
        )
    if isinstance(source, TokenFiles):
        if dtype is not None:
            raise ValueError(
                "dtype applies when source is paths; the TokenFiles were opened with theirs"
            )
        files = copy.copy(source)  # its own file descriptors, closed with this loader
    else:
        files = TokenFiles(source, dtype=dtype)
    if eot is not None and bos is not None:
        raise ValueError(
            "pass eot (the id that ends each document, nanoGPT's layout) or bos (the id that "
            "opens each document, modded-nanogpt's), not both"
        )
    delimiter = eot if eot is not None else bos
    if delimiter is not None:
        name = "eot" if eot is not None else "bos"
        _check_int(name, delimiter, 0)
        if delimiter >= 2 ** (8 * files.dtype.itemsize):
            raise ValueError(f"{name}={delimiter} is not a {files.dtype.name} token id")
    if packing != "windows" and delimiter is None:
        raise ValueError(
            f"packing={packing!r} walks documents, which needs their delimiter: pass eot= "
            "(the id ending each document, e.g. 50256 for nanoGPT's GPT-2 files) or bos= "
            "(the id opening each)"
        )
    if buffer is not None and packing != "best-fit":
        raise ValueError(f"buffer applies to packing='best-fit', not {packing!r}")
    if not isinstance(shuffle, bool):
        raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
    if shuffle_rows is not None and packing == "windows":
        raise ValueError(
            "shuffle_rows applies to packing='greedy' or 'best-fit' (windows are permuted "
            "whole, per epoch)"
        )
    _check_int("buffer", 256 if buffer is None else buffer, 1)
    _check_int("shuffle_rows", 1024 if shuffle_rows is None else shuffle_rows, 1)
    rank, world_size = resolve_shard(rank, world_size)
    dev, pin = resolve_device(device, pin_memory)
    opens = bos is not None
    config: dict[str, Any] = {
        "source": "tokens", "files": files.describe(), "dtype": files.dtype.name,
        "batch_size": batch_size, "seq_len": seq_len, "packing": packing,
        "delimiter": None if delimiter is None else ["bos" if opens else "eot", delimiter],
        "shuffle": shuffle, "seed": seed, "drop_last": drop_last, "rank": rank,
        "world_size": world_size,
    }
    node: BaseNode[Any]
    num_batches: int | None = None
    if packing == "windows":
        windows = TokenWindows(files, seq_len=seq_len, batch_size=batch_size,
                               shuffle=shuffle, seed=seed, drop_last=drop_last, rank=rank,
                               world_size=world_size, delimiter=delimiter, opens=opens)
        num_batches = windows.num_batches
        if num_batches == 0:
            shard = f" (rank {rank}'s share of {world_size})" if world_size > 1 else ""
            raise ValueError(
                f"batch_size={batch_size} is more than the {windows.per_rank} windows of "
                f"seq_len={seq_len}{shard} in the {files.num_tokens} tokens, with "
                "drop_last=True; lower batch_size or seq_len, or pass drop_last=False"
            )
        node = windows
    else:
        assert delimiter is not None  # refused above
        config["buffer"] = (256 if buffer is None else buffer) if packing == "best-fit" else None
        config["shuffle_rows"] = 1024 if shuffle_rows is None else shuffle_rows
        node = PackedRows(files, seq_len=seq_len, batch_size=batch_size, packing=packing,
                          buffer=config["buffer"] or 1, drop_last=drop_last, rank=rank,
                          world_size=world_size, delimiter=delimiter, opens=opens,
                          shuffle=shuffle, shuffle_rows=config["shuffle_rows"], seed=seed)
    close_fns: list[Callable[[], None]] = [files.close]
    node = in_threads(node, prefetch=prefetch, pin_memory=pin)  # exceptions cross as raised
    if dev is not None:
        node = ToDevice(node, dev)
    return BatchLoader(node, num_batches=num_batches, config=config, close_fns=close_fns,
                       portable_position=True)
