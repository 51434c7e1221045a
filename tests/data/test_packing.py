"""Packing documents into rows (accelfn.data.packing), checked against brute force.

On random token streams (both delimiter layouts, random row lengths, chunk sizes and buffer
sizes): every pair of every document is in exactly one row, each row segment lies in one
document, rows are full but at the end of the data, greedy rows follow the stream, and a
packer restored from any row's position continues with exactly the rows the uninterrupted
one gives (mid-buffer; greedy with the rest of a cut piece carried).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from helpers import roundtrip

import accelfn.data as ad
from accelfn.data.packing import (
    IGNORE_INDEX,
    BestFitPacker,
    DocumentScanner,
    GreedyPacker,
    feistel_permute,
    packed_rows,
    window_rows,
)

D = 7  # the delimiter of the random streams


def documents(stream: np.ndarray, opens: bool) -> list[list[int]]:
    """The pair indices of each document, by the definition written out by hand."""
    docs: list[list[int]] = []
    current: list[int] = []
    for i in range(len(stream) - 1):
        if opens:
            if stream[i] == D and current:
                docs.append(current)
                current = []
            current.append(i)
        elif stream[i] == D:
            if current:
                docs.append(current)
                current = []
        else:
            current.append(i)
    return [*docs, current] if current else docs


def packer(files, kind: str, opens: bool, seq_len: int, rng, size: int = 3):
    scanner = DocumentScanner(files, delimiter=D, opens=opens, max_pairs=seq_len,
                              chunk=int(rng.integers(1, 40)))
    return GreedyPacker(scanner, seq_len) if kind == "greedy" else BestFitPacker(
        scanner, seq_len, size)


def shape_of(value):
    """The form of a position: its keys, list lengths and value types."""
    if isinstance(value, dict):
        return {k: shape_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape_of(v) for v in value]
    return type(value)


def all_rows(p) -> list:
    rows = []
    while (row := p.next_row()) is not None:
        rows.append(row)
    return rows


def random_stream(rng, tmp_path) -> tuple[np.ndarray, ad.TokenFiles]:
    n = int(rng.integers(2, 200))
    stream = rng.integers(0, 10, size=n)
    stream[rng.random(n) < rng.uniform(0.02, 0.3)] = D
    return stream, ad.TokenFiles(ad.write_tokens(tmp_path / "s.bin", stream))


@pytest.mark.parametrize("kind", ["greedy", "best-fit"])
@pytest.mark.parametrize("opens", [False, True], ids=["eot", "bos"])
def test_rows_hold_every_pair_of_every_document_once(tmp_path, kind, opens):
    rng = np.random.default_rng(0 if opens else 1)
    for _ in range(60):
        stream, files = random_stream(rng, tmp_path)
        docs = documents(stream, opens)
        owner = {pair: k for k, doc in enumerate(docs) for pair in doc}
        seq_len = int(rng.integers(1, 12))
        rows = all_rows(packer(files, kind, opens, seq_len, rng, int(rng.integers(1, 6))))
        seen = []
        for r, row in enumerate(rows):
            filled = sum(n for _, n in row)
            assert filled == seq_len or (r == len(rows) - 1 and filled < seq_len)  # no padding
            for i, (a, n) in enumerate(row):
                assert len({owner[p] for p in range(a, a + n)}) == 1  # one document each
                if kind == "greedy" and i:  # a document continued in a row is one segment
                    b, m = row[i - 1]
                    assert owner[b] != owner[a] or b + m != a
                seen += range(a, a + n)
        every = [p for doc in docs for p in doc]
        if kind == "greedy":
            assert seen == every  # the stream's order
        else:
            assert sorted(seen) == every


@pytest.mark.parametrize("kind", ["greedy", "best-fit"])
@pytest.mark.parametrize("opens", [False, True], ids=["eot", "bos"])
def test_a_restored_packer_continues_exactly_from_any_row(tmp_path, kind, opens):
    rng = np.random.default_rng(2 if opens else 3)
    carried = buffered = 0
    for _ in range(25):
        _, files = random_stream(rng, tmp_path)
        seq_len = int(rng.integers(1, 10))
        size = int(rng.integers(1, 6))
        rows = all_rows(packer(files, kind, opens, seq_len, rng, size))
        for cut in range(len(rows) + 1):
            first = packer(files, kind, opens, seq_len, rng, size)
            for _ in range(cut):
                first.next_row()
            state = roundtrip(first.state())  # plain data through torch.save / load
            assert first.check(copy.deepcopy(state))
            if kind == "greedy":
                carried += state["carry"][1] > 0
            else:
                buffered += any(n > 0 for _, n, _ in state["buffer"])
            fresh = packer(files, kind, opens, seq_len, rng, size).state()
            assert shape_of(state) == shape_of(fresh)  # one form (checkpointing checks it)
            second = packer(files, kind, opens, seq_len, rng, size)  # another chunk size
            second.restore(state)
            assert all_rows(second) == rows[cut:]
    assert carried if kind == "greedy" else buffered  # resumed mid-buffer / with a cut rest


def test_best_fit_cuts_fewer_documents_than_greedy(tmp_path):
    rng = np.random.default_rng(4)
    docs = [np.append(rng.integers(0, 7, size=int(rng.integers(1, 40))), D) for _ in range(400)]
    files = ad.TokenFiles(ad.write_tokens(tmp_path / "d.bin", np.concatenate(docs)))
    cut = {}
    for kind in ("greedy", "best-fit"):
        rows = all_rows(packer(files, kind, False, 32, rng, size=64))
        starts = [a for row in rows for a, _ in row]
        cut[kind] = len(starts) - len(docs)  # pieces beyond one per document
        assert sum(n for row in rows for _, n in row) == sum(len(d) - 1 for d in docs)
    assert cut["best-fit"] < cut["greedy"] / 2


def test_packed_rows_tensors(tmp_path):
    stream = np.array([5, 6, D, 8, 9, 1, D, 2, 3, D])
    files = ad.TokenFiles(ad.write_tokens(tmp_path / "r.bin", stream))
    rows = packed_rows(files, [[(3, 3), (0, 2)], [(7, 2)]], seq_len=5, num_rows=3)
    assert rows["inputs"].tolist() == [[8, 9, 1, 5, 6], [2, 3, 0, 0, 0], [0] * 5]
    pad = IGNORE_INDEX
    assert rows["targets"].tolist() == [[9, 1, D, 6, D], [3, D, pad, pad, pad], [pad] * 5]
    assert rows["document_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, -1, -1, -1], [-1] * 5]
    assert rows["positions"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 0], [0] * 5]


@pytest.mark.parametrize("opens", [False, True], ids=["eot", "bos"])
def test_window_rows_restart_documents_at_delimiters(tmp_path, opens):
    rng = np.random.default_rng(5)
    stream = rng.integers(0, 10, size=300)
    files = ad.TokenFiles(ad.write_tokens(tmp_path / "w.bin", stream))
    starts = np.array([0, 17, 250])
    rows = window_rows(files, starts, 40, D, opens)
    for r, s in enumerate(starts):
        window = stream[s:s + 41]
        assert rows["inputs"][r].tolist() == window[:-1].tolist()
        assert rows["targets"][r].tolist() == window[1:].tolist()  # every pair: nanoGPT's
        doc, pos = 0, 0
        for j in range(40):
            if j and (window[j] == D if opens else window[j - 1] == D):
                doc, pos = doc + 1, 0
            assert (rows["document_ids"][r, j], rows["positions"][r, j]) == (doc, pos)
            pos += 1
    plain = window_rows(files, starts, 40, None, False)
    assert (plain["document_ids"] == 0).all() and (plain["positions"] == np.arange(40)).all()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_feistel_permutation_is_a_permutation(n):
    values = feistel_permute(np.arange(n), n, key=11)
    assert sorted(values.tolist()) == list(range(n))
    if n >= 64:
        other = feistel_permute(np.arange(n), n, key=12)
        assert (values != other).mean() > 0.9  # another key, another order
        assert (values != np.arange(n)).mean() > 0.9
        assert feistel_permute(np.array([5, 3]), n, key=11).tolist() == values[[5, 3]].tolist()
