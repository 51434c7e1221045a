"""Packing documents into rows of ``seq_len`` training positions, and the rows' tensors.

A language model trains on *pairs* of consecutive tokens: input ``s[i]``, target ``s[i + 1]``
(pair ``i`` of the token stream ``s``). A row is ``seq_len`` pairs: ``inputs``, ``targets``,
``document_ids`` (which document of the row each position belongs to: 0, 1, ... from the
row's start; -1 for padding) and ``positions`` (the position within that document, 0 at its
first token in the row).

Documents are delimited by a token id: with ``eot`` it *ends* each document (nanoGPT's
layout: GPT-2's ``<|endoftext|>`` appended to every document), so a document's pairs run up
to the one whose target is that token, and the pair that would predict the next document's
first token from it is left out; with ``bos`` it *opens* each document (modded-nanogpt's and
nanochat's layout), and a document's pairs run up to the one whose target is the next
document's opening token (learning where a document ends). Every pair of a packed row is a
pair of one document: no target crosses a document boundary.

* :class:`DocumentScanner` walks the stream in order, finding delimiters a chunk at a time
  (numpy, no Python per token), and yields *pieces*: runs of at most ``seq_len`` pairs of one
  document (a longer document gives several, each marked as continuing the previous one).
* :class:`GreedyPacker` fills rows with the pieces in stream order, cutting the piece that
  does not fit at the row's end and starting the next row with its rest (the stream cut into
  rows, as nanoGPT's batches, with document boundaries kept).
* :class:`BestFitPacker` keeps a buffer of pieces and fills each row with the longest piece
  that fits the space left (best-fit decreasing); only when none fits is a piece cut to fill
  the row, its rest going back to the buffer. Filling every row, it cuts about as many
  documents as greedy packing (on the corpus of ``examples/gpt.py`` at 512 positions, 0.39
  cuts a document against 0.42), but it cuts the shortest piece waiting, so targets keep
  more of their context.

Neither pads: a row is full unless the stream ended. A cut keeps every pair: the rest of a
piece starts with the pair after the last one placed, so its first input is the last target
placed (its positions restart at 0: it no longer sees the part before the cut). The packers'
states are plain ints and lists of a fixed length, so a position resumes exactly, mid-buffer.

Why it is written here: neither torch nor torchdata packs documents (torchdata's nodes batch,
they do not fill rows), and the packers that exist come with their trainers (torchtune's
``PackedDataset``, over a map-style dataset it reads whole, with its own sample format; the
nanoGPT-family scripts' loops) and are not dependencies accelfn may take. What this needs
beyond them: pairs that never cross a document, the ``document_ids``/``positions`` that
flex attention's document masks read, and a position that resumes exactly mid-buffer.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np

from .sampling import mix_seed
from .tokens import TokenFiles

__all__ = [
    "IGNORE_INDEX",
    "BestFitPacker",
    "DocumentScanner",
    "GreedyPacker",
    "Piece",
    "Segment",
    "feistel_permute",
    "packed_rows",
    "window_rows",
]

#: ``targets`` of padding positions: ``F.cross_entropy``'s default ``ignore_index``.
IGNORE_INDEX = -100

#: ``(first pair, number of pairs, continues the previous piece of its document)``
Piece = tuple[int, int, bool]
#: ``(first pair, number of pairs)`` of one document in a row; its index is its document id.
Segment = tuple[int, int]

_CHUNK = 1 << 20  # pairs scanned for delimiters per read


class DocumentScanner:
    """The pieces of the documents of ``files``, in order (see the module).

    Its state is ``[pair, pairs of the current document already given]``; ``restore()``
    continues from it exactly. Memory: one chunk of ``max(chunk, max_pairs + 1)`` tokens.
    """

    def __init__(self, files: TokenFiles, *, delimiter: int, opens: bool, max_pairs: int,
                 chunk: int = _CHUNK) -> None:
        self.files = files
        self.delimiter = delimiter
        self.opens = opens
        self.max_pairs = max_pairs
        self.chunk = max(chunk, max_pairs + 1)
        self.num_pairs = files.num_tokens - 1
        self.pos = 0
        self.doc_pos = 0
        self._lo = self._hi = 0
        self._delims = np.empty(0, dtype=np.int64)

    def state(self) -> list[int]:
        return [self.pos, self.doc_pos]

    def restore(self, state: list[int] | None = None) -> None:
        self.pos, self.doc_pos = (0, 0) if state is None else (int(state[0]), int(state[1]))

    def _load(self, pos: int) -> None:
        hi = min(self.num_pairs, pos + self.chunk)
        tokens = self.files.read(pos, hi)  # the first token of each pair
        self._delims = np.flatnonzero(tokens == self.delimiter).astype(np.int64) + pos
        self._lo, self._hi = pos, hi

    def next_piece(self) -> Piece | None:
        """The next piece, or None at the end of the stream."""
        while True:
            pos = self.pos
            if pos >= self.num_pairs:
                return None
            limit = min(self.num_pairs, pos + self.max_pairs)
            # the chunk must show the delimiters of pairs [pos, limit], limit included (an
            # opening one there ends this document)
            if not self._lo <= pos < limit <= self._hi or limit == self._hi < self.num_pairs:
                self._load(pos)
            delims = self._delims
            if self.opens:  # the next document opens at the next delimiter after pos
                k = int(np.searchsorted(delims, pos, side="right"))
            else:  # this document's last pair is the one before the next delimiter
                k = int(np.searchsorted(delims, pos, side="left"))
            boundary = int(delims[k]) if k < len(delims) else math.inf
            if boundary == pos:  # (not opens) pairs from a delimiter: none is a document's
                run = delims[k:k + limit - pos] - np.arange(min(limit - pos, len(delims) - k))
                skip = int(np.argmax(run != pos)) if (run != pos).any() else len(run)
                self.pos, self.doc_pos = pos + skip, 0  # a run of delimiters in one go
                continue
            end = int(min(boundary, limit))
            piece = (pos, end - pos, self.doc_pos > 0)
            self.pos = end
            self.doc_pos = 0 if end == boundary else self.doc_pos + end - pos
            return piece


_NONE = [0, 0, False]  # an empty slot: positions have a fixed form (checkpointing checks it)


def _check_piece(entry: Any) -> bool:
    return (isinstance(entry, list) and len(entry) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) for v in entry[:2])
            and isinstance(entry[2], bool) and entry[0] >= 0 and entry[1] >= 0)


def _piece(entry: list[Any]) -> Piece | None:
    return None if entry[1] == 0 else (int(entry[0]), int(entry[1]), bool(entry[2]))


class GreedyPacker:
    """Rows of the pieces in stream order; the piece that does not fit is cut at the row's end
    and its rest starts the next row. Contiguous pieces of one document in a row are one
    document there (their positions continue)."""

    def __init__(self, scanner: DocumentScanner, seq_len: int) -> None:
        self.scanner = scanner
        self.seq_len = seq_len
        self.carry: Piece | None = None

    def state(self) -> dict[str, Any]:
        return {"scan": self.scanner.state(),
                "carry": list(_NONE) if self.carry is None else list(self.carry)}

    def check(self, state: Any) -> bool:
        return (isinstance(state, dict) and set(state) == {"scan", "carry"}
                and _scan_ok(state["scan"]) and _check_piece(state["carry"]))

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            self.scanner.restore(None)
            self.carry = None
            return
        self.scanner.restore(state["scan"])
        self.carry = _piece(state["carry"])

    def next_row(self) -> list[Segment] | None:
        """The next row's documents, or None when the stream has no pair left."""
        segments: list[list[int]] = []
        gap = self.seq_len
        while gap > 0:
            piece, self.carry = self.carry or self.scanner.next_piece(), None
            if piece is None:
                break
            a, n, cont = piece
            take = min(n, gap)
            if take < n:
                self.carry = (a + take, n - take, True)
            last = segments[-1] if segments else None
            if last is not None and cont and last[0] + last[1] == a:
                last[1] += take  # the same document, continued
            else:
                segments.append([a, take])
            gap -= take
        return [(a, n) for a, n in segments] or None


class BestFitPacker:
    """Rows filled best-fit from a buffer of ``buffer`` pieces: each row takes the longest
    piece that fits the space left (the oldest among equals), until none fits; then the
    shortest piece is cut to fill the row exactly and its rest goes back to the buffer.

    Cutting the shortest piece loses the least context (the rest's ``n - gap`` targets each
    lose the ``gap`` before them): on the corpus of ``examples/gpt.py`` at 1024 positions,
    targets keep a mean context of 364 tokens against 357 when the longest is cut, and 329
    with greedy packing.
    """

    def __init__(self, scanner: DocumentScanner, seq_len: int, buffer: int) -> None:
        self.scanner = scanner
        self.seq_len = seq_len
        self.size = buffer
        # sorted by (pairs, -arrival): the last entry is the longest, the oldest among equals
        self.buffer: list[tuple[int, int, int, bool]] = []
        self.arrivals = 0
        self.exhausted = False

    def state(self) -> dict[str, Any]:
        """The scanner's place and the buffer in order of arrival, padded to ``buffer``
        entries with empty ones (``[0, 0, False]``): a position has the same form wherever it
        is taken."""
        waiting = [[a, n, cont] for n, _, a, cont in sorted(self.buffer, key=lambda e: -e[1])]
        return {"scan": self.scanner.state(),
                "buffer": waiting + [list(_NONE) for _ in range(self.size - len(waiting))],
                "arrivals": self.arrivals, "exhausted": self.exhausted}

    def check(self, state: Any) -> bool:
        if not (isinstance(state, dict)
                and set(state) == {"scan", "buffer", "arrivals", "exhausted"}
                and _scan_ok(state["scan"])
                and isinstance(state["buffer"], list) and len(state["buffer"]) == self.size
                and all(_check_piece(e) for e in state["buffer"])
                and isinstance(state["arrivals"], int)
                and not isinstance(state["arrivals"], bool)
                and isinstance(state["exhausted"], bool)):
            return False
        sizes = [e[1] for e in state["buffer"]]
        waiting = sum(n > 0 for n in sizes)
        return all(sizes[:waiting]) and state["arrivals"] >= waiting  # empty slots last

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            self.scanner.restore(None)
            self.buffer, self.arrivals, self.exhausted = [], 0, False
            return
        self.scanner.restore(state["scan"])
        self.arrivals = int(state["arrivals"])
        waiting = [p for p in map(_piece, state["buffer"]) if p is not None]
        first = self.arrivals - len(waiting)  # arrival numbers in the same order
        self.buffer = sorted((n, -(first + i), a, cont) for i, (a, n, cont) in enumerate(waiting))
        self.exhausted = bool(state["exhausted"])

    def _fill(self) -> None:
        while len(self.buffer) < self.size and not self.exhausted:
            piece = self.scanner.next_piece()
            if piece is None:
                self.exhausted = True
                return
            a, n, cont = piece
            bisect.insort(self.buffer, (n, -self.arrivals, a, cont))
            self.arrivals += 1

    def next_row(self) -> list[Segment] | None:
        """The next row's documents, or None when no pair is left."""
        segments: list[Segment] = []
        gap = self.seq_len
        self._fill()
        while gap > 0 and self.buffer:
            i = bisect.bisect_right(self.buffer, (gap, math.inf)) - 1
            if i >= 0:
                n, _, a, _ = self.buffer.pop(i)
                segments.append((a, n))
                gap -= n
                self._fill()
                continue
            # nothing fits: cut a piece to fill the row, its rest waits in the buffer
            n, order, a, _ = self.buffer.pop(0)  # the shortest, all being longer than gap
            segments.append((a, gap))
            bisect.insort(self.buffer, (n - gap, order, a + gap, True))
            gap = 0
        return segments or None


def _scan_ok(scan: Any) -> bool:
    return (isinstance(scan, list) and len(scan) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in scan))


def packed_rows(files: TokenFiles, rows: list[list[Segment]], seq_len: int,
                num_rows: int | None = None) -> dict[str, np.ndarray]:
    """``inputs``, ``targets``, ``document_ids``, ``positions`` (int64, ``(rows, seq_len)``)
    of packed rows; ``num_rows`` pads with empty rows (all padding) up to that many."""
    b = len(rows) if num_rows is None else num_rows
    inputs = np.zeros((b, seq_len), dtype=np.int64)
    targets = np.full((b, seq_len), IGNORE_INDEX, dtype=np.int64)
    doc_ids = np.full((b, seq_len), -1, dtype=np.int64)
    positions = np.zeros((b, seq_len), dtype=np.int64)
    ramp = np.arange(seq_len, dtype=np.int64)
    for r, segments in enumerate(rows):
        lo = min(a for a, _ in segments)
        hi = max(a + n + 1 for a, n in segments)
        # one read when the row's documents lie close together in the stream (greedy rows)
        span = files.read(lo, hi) if hi - lo <= 4 * (seq_len + 1) else None
        off = 0
        for d, (a, n) in enumerate(segments):
            tokens = span[a - lo:a - lo + n + 1] if span is not None else files.read(a, a + n + 1)
            inputs[r, off:off + n] = tokens[:-1]
            targets[r, off:off + n] = tokens[1:]
            doc_ids[r, off:off + n] = d
            positions[r, off:off + n] = ramp[:n]
            off += n
    return {"inputs": inputs, "targets": targets, "document_ids": doc_ids,
            "positions": positions}


def window_rows(files: TokenFiles, starts: np.ndarray, seq_len: int, delimiter: int | None,
                opens: bool) -> dict[str, np.ndarray]:
    """The rows of the windows of ``seq_len`` pairs starting at the pairs ``starts``: every
    pair trained (nanoGPT's windows); ``document_ids`` and ``positions`` restart after each
    closing delimiter (``opens=False``) or at each opening one (without a delimiter: one
    document per row)."""
    windows = np.stack([files.read(int(s), int(s) + seq_len + 1) for s in starts])
    windows = windows.astype(np.int64)
    inputs = windows[:, :-1]
    b = len(starts)
    ramp = np.arange(seq_len, dtype=np.int64)
    if delimiter is None:
        doc_ids = np.zeros((b, seq_len), dtype=np.int64)
        positions = np.broadcast_to(ramp, (b, seq_len)).copy()
    else:
        new = np.zeros((b, seq_len), dtype=bool)
        new[:, 1:] = inputs[:, 1:] == delimiter if opens else inputs[:, :-1] == delimiter
        doc_ids = np.cumsum(new, axis=1, dtype=np.int64)
        first = np.maximum.accumulate(np.where(new, ramp, 0), axis=1)
        positions = ramp - first
    return {"inputs": np.ascontiguousarray(inputs),
            "targets": np.ascontiguousarray(windows[:, 1:]),
            "document_ids": doc_ids, "positions": positions}


def feistel_permute(indices: np.ndarray, n: int, key: int, rounds: int = 6) -> np.ndarray:
    """A pseudo-random permutation of ``range(n)``, evaluated at ``indices`` (int64 in
    ``[0, n)``): a balanced Feistel network over the smallest power of four ``>= n``, walked
    until the value falls in ``range(n)`` (cycle walking). O(1) memory whatever ``n``: the
    permutation is never stored. ``key`` picks the permutation (e.g. ``mix_seed(seed,
    epoch)``)."""
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(mix_seed(key, r)) for r in range(rounds)]
    shift = np.uint64(half)

    def once(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in keys:
            z = (right ^ k) * np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z = z ^ (z >> np.uint64(31))
            left, right = right, left ^ (z & mask)
        return (left << shift) | right

    with np.errstate(over="ignore"):
        out = once(np.asarray(indices, dtype=np.uint64))
        outside = out >= np.uint64(n)
        while outside.any():
            out[outside] = once(out[outside])
            outside = out >= np.uint64(n)
    return out.astype(np.int64)
