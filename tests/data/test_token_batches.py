"""token_loader: random windows per epoch, packed documents, sharding and exact resume."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import roundtrip, torchrun

import accelfn.data as ad
from accelfn.data.positions import core_node

EOT = 999
HERE = os.path.dirname(os.path.abspath(__file__))


def corpus(tmp_path, docs: int = 300, seed: int = 0, name: str = "c.bin"):
    """Documents of 1-60 tokens, each ended by EOT (nanoGPT's layout); the stream and path."""
    rng = np.random.default_rng(seed)
    stream = np.concatenate([np.append(rng.integers(0, EOT, size=int(rng.integers(1, 60))), EOT)
                             for _ in range(docs)])
    return stream, ad.write_tokens(tmp_path / name, stream)


def epoch(loader) -> list[dict]:
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


# ------------------------------------------------------------------------------- windows
def test_windows_visit_every_window_once_per_epoch_in_a_new_order(tmp_path):
    stream, path = corpus(tmp_path)
    loader = ad.token_loader(path, batch_size=4, seq_len=32, seed=1, drop_last=False)
    node = core_node(loader.root)
    starts = []
    for e in range(3):
        batches = epoch(loader)
        assert len(batches) == len(loader) == -(-node.num_windows // 4)
        first = [int(s) for b in range(len(loader)) for s in node.window_starts(e, b)]
        assert len(set(first)) == node.num_windows  # each window once
        assert len({s % 32 for s in first}) == 1  # cut from one offset
        for b, batch in enumerate(batches):
            for row, s in enumerate(node.window_starts(e, b)):
                assert batch["inputs"][row].tolist() == stream[s:s + 32].tolist()
                assert batch["targets"][row].tolist() == stream[s + 1:s + 33].tolist()
        starts.append(first)
    assert starts[0] != starts[1] != starts[2]  # reshuffled every epoch
    again = ad.token_loader(path, batch_size=4, seq_len=32, seed=1, drop_last=False)
    assert same(epoch(again), epoch(ad.token_loader(path, batch_size=4, seq_len=32, seed=1,
                                                   drop_last=False)))
    in_order = ad.token_loader(path, batch_size=4, seq_len=32, shuffle=False)
    assert [int(s) for s in core_node(in_order.root).window_starts(0, 0)] == [0, 32, 64, 96]


def test_windows_give_document_ids_and_positions_from_the_delimiter(tmp_path):
    _, path = corpus(tmp_path)
    batch = next(iter(ad.token_loader(path, batch_size=8, seq_len=64, eot=EOT)))
    inputs, ids, pos = batch["inputs"], batch["document_ids"], batch["positions"]
    after_eot = torch.zeros_like(inputs, dtype=torch.bool)
    after_eot[:, 1:] = inputs[:, :-1] == EOT
    assert torch.equal(ids, after_eot.cumsum(1))
    assert ((pos == 0) == (after_eot | (torch.arange(64) == 0))).all()
    plain = next(iter(ad.token_loader(path, batch_size=8, seq_len=64)))
    assert (plain["document_ids"] == 0).all() and (plain["positions"] == torch.arange(64)).all()


@pytest.mark.parametrize("drop_last", [True, False])
def test_windows_shard_by_rank(tmp_path, drop_last):
    _, path = corpus(tmp_path)
    w = 3
    loaders = [ad.token_loader(path, batch_size=4, seq_len=32, seed=2, rank=r, world_size=w,
                               drop_last=drop_last) for r in range(w)]
    counts = {len(x) for x in loaders}
    assert len(counts) == 1  # every rank the same number of batches
    node = core_node(loaders[0].root)
    shards = [[int(s) for b in range(len(x)) for s in core_node(x.root).window_starts(0, b)]
              for x in loaders]
    seen = [s for shard in shards for s in shard]
    if drop_last:
        assert len(seen) == len(set(seen))  # disjoint
    else:
        assert len(set(seen)) == node.num_windows  # all covered, a few twice
        assert len(seen) - len(set(seen)) == -node.num_windows % w
    assert all(len(shard) == len(shards[0]) for shard in shards)


def test_windows_resume_exactly_mid_epoch_and_across_epochs(tmp_path):
    _, path = corpus(tmp_path)

    def make():
        return ad.token_loader(path, batch_size=4, seq_len=32, seed=3, eot=EOT)

    reference = make()
    full = epoch(reference) + epoch(reference)
    for cut in (0, 5, len(reference), len(reference) + 3):
        first = make()
        seen: list[dict] = []
        while len(seen) < cut:
            for batch in first:
                seen.append({k: v.clone() for k, v in batch.items()})
                if len(seen) == cut:
                    break
        state = roundtrip(first.state_dict())
        resumed = make()
        resumed.load_state_dict(state)
        rest = epoch(resumed)
        if cut < len(reference):
            rest += epoch(resumed)
        else:
            rest = rest or epoch(resumed)
        assert same(seen + rest, full[:len(seen) + len(rest)])
        assert len(seen) + len(rest) == 2 * len(reference)


# -------------------------------------------------------------------------------- packed
@pytest.mark.parametrize("packing", ["greedy", "best-fit"])
def test_packed_rows_have_no_padding_but_at_the_end(tmp_path, packing):
    stream, path = corpus(tmp_path)
    loader = ad.token_loader(path, batch_size=4, seq_len=32, packing=packing, eot=EOT,
                             drop_last=False, buffer=16 if packing == "best-fit" else None)
    batches = epoch(loader)
    targets = torch.cat([b["targets"] for b in batches])
    real = targets != -100
    pairs = len(stream) - 1 - int((stream[:-1] == EOT).sum())
    assert int(real.sum()) == pairs  # every pair of every document
    assert int((~real.all(1)).sum()) == 1 and int((~real).sum()) < 32  # one row: the last
    for b in batches:  # positions restart at each document; a document's ids are contiguous
        ids, pos = b["document_ids"], b["positions"]
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        assert ((pos == 0) == starts | (ids == -1)).all()
        assert (b["targets"][ids == -1] == -100).all() and (b["targets"][ids >= 0] >= 0).all()


def test_packed_rows_are_shuffled_within_blocks_every_epoch(tmp_path):
    _, path = corpus(tmp_path, docs=400)

    def rows(loader) -> list[list[list[int]]]:
        return [[r.tolist() for r in b["inputs"]] for b in epoch(loader)]

    in_order = rows(ad.token_loader(path, batch_size=4, seq_len=32, packing="best-fit",
                                    eot=EOT, shuffle=False))
    shuffled = ad.token_loader(path, batch_size=4, seq_len=32, packing="best-fit", eot=EOT,
                               shuffle_rows=16, seed=3)
    first, second = rows(shuffled), rows(shuffled)
    flat = [r for b in in_order for r in b]
    assert len(flat) > 64
    for order in (first, second):
        given = [r for b in order for r in b]
        assert given != flat
        for k in range(0, len(given) - 16, 16):  # each block of 16 rows: the same rows
            assert sorted(given[k:k + 16]) == sorted(flat[k:k + 16])
    assert first != second  # a new order every epoch
    assert first == rows(ad.token_loader(path, batch_size=4, seq_len=32, packing="best-fit",
                                         eot=EOT, shuffle_rows=16, seed=3))


@pytest.mark.parametrize("packing", ["greedy", "best-fit"])
def test_packed_rows_resume_exactly_mid_buffer(tmp_path, packing):
    _, path = corpus(tmp_path, docs=400)

    def make(**kw):  # blocks of 8 rows: positions inside blocks, at block starts mid-buffer
        return ad.token_loader(path, batch_size=2, seq_len=48, packing=packing, bos=EOT,
                               shuffle_rows=8, **kw)

    reference = make()
    full = epoch(reference) + epoch(reference)
    n = len(full) // 2
    assert n > 20
    mid_buffer = 0
    for cut in (1, 7, n - 1, n, n + 2):
        first = make(prefetch=3)
        seen: list[dict] = []
        while len(seen) < cut:
            for batch in first:
                seen.append({k: v.clone() for k, v in batch.items()})
                if len(seen) == cut:
                    break
        state = roundtrip(first.state_dict())
        first.close()
        node = state["root"]
        while "packer" not in node:
            node = next(iter(node.values()))
        waiting = node["packer"].get("buffer", [[0, 0, False]])[0][1] > 0
        mid_buffer += waiting and node["given"] > 0  # inside a block whose start was mid-buffer
        resumed = make(prefetch=0)  # another staging: the position still loads
        resumed.load_state_dict(state)
        rest = epoch(resumed)
        if cut < n:
            rest += epoch(resumed)
        else:
            rest = rest or epoch(resumed)
        assert same(seen + rest, full[:len(seen) + len(rest)])
        assert len(seen) + len(rest) == 2 * n
    assert mid_buffer or packing == "greedy"


def test_packed_rows_shard_rounds_by_rank(tmp_path):
    _, path = corpus(tmp_path)
    single = epoch(ad.token_loader(path, batch_size=6, seq_len=32, packing="best-fit", eot=EOT,
                                   drop_last=False))
    rows = torch.cat([b["inputs"] for b in single])
    shards = [epoch(ad.token_loader(path, batch_size=3, seq_len=32, packing="best-fit",
                                    eot=EOT, rank=r, world_size=2, drop_last=False))
              for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == len(single)
    for k, batch in enumerate(single):  # round k: rank r has rows r, r + 2, ... of batch k
        for r in range(2):
            mine = batch["inputs"][r::2]
            got = shards[r][k]["inputs"]
            assert torch.equal(got[:len(mine)], mine)
            assert (shards[r][k]["targets"][len(mine):] == -100).all()  # padded rows
    assert sum(int((b["targets"] != -100).sum()) for s in shards for b in s) == int(
        (torch.cat([b["targets"] for b in single]) != -100).sum())
    assert rows.shape[0] > 0


def test_positions_are_checked(tmp_path):
    _, path = corpus(tmp_path)
    a = ad.token_loader(path, batch_size=4, seq_len=32, packing="greedy", eot=EOT)
    next(iter(a))
    state = a.state_dict()
    with pytest.raises(ValueError, match="packing: saved 'greedy', here 'best-fit'"):
        ad.token_loader(path, batch_size=4, seq_len=32, packing="best-fit",
                        eot=EOT).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        ad.token_loader(path, batch_size=4, seq_len=16, packing="greedy",
                        eot=EOT).load_state_dict(state)
    broken = roundtrip(state)
    inner = broken["root"]
    while "packer" not in inner:
        inner = next(iter(inner.values()))
    inner["packer"]["scan"] = ["x", 0]
    with pytest.raises(ValueError, match="packed-rows"):
        ad.token_loader(path, batch_size=4, seq_len=32, packing="greedy",
                        eot=EOT).load_state_dict(broken)
    _, other = corpus(tmp_path, seed=5, name="other.bin")
    with pytest.raises(ValueError, match="files"):
        ad.token_loader(other, batch_size=4, seq_len=32, packing="greedy",
                        eot=EOT).load_state_dict(state)


def test_batches_go_to_the_device_and_are_int64(tmp_path):
    _, path = corpus(tmp_path)
    for packing in ("windows", "greedy"):
        batch = next(iter(ad.token_loader(path, batch_size=2, seq_len=16, device="cpu",
                                          packing=packing, eot=EOT)))
        assert batch.device == torch.device("cpu") and batch.batch_size == torch.Size([2])
        assert {batch[k].dtype for k in batch.keys()} == {torch.int64}
        assert set(batch.keys()) == {"inputs", "targets", "document_ids", "positions"}


def test_refusals(tmp_path):
    _, path = corpus(tmp_path, docs=20)
    with pytest.raises(ValueError, match="needs their delimiter"):
        ad.token_loader(path, batch_size=2, seq_len=8, packing="greedy")
    with pytest.raises(ValueError, match="not both"):
        ad.token_loader(path, batch_size=2, seq_len=8, eot=1, bos=2)
    with pytest.raises(ValueError, match="buffer applies"):
        ad.token_loader(path, batch_size=2, seq_len=8, buffer=4)
    with pytest.raises(ValueError, match="shuffle_rows applies"):
        ad.token_loader(path, batch_size=2, seq_len=8, shuffle_rows=4)
    with pytest.raises(ValueError, match="packing must be"):
        ad.token_loader(path, batch_size=2, seq_len=8, packing="pad")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a uint16 token id"):
        ad.token_loader(path, batch_size=2, seq_len=8, eot=70_000)
    with pytest.raises(ValueError, match="fewer than one window"):
        ad.token_loader(path, batch_size=2, seq_len=100_000)
    with pytest.raises(ValueError, match="more than the"):
        ad.token_loader(path, batch_size=1000, seq_len=8)
    with pytest.raises(ValueError, match="no batch"):
        next(iter(ad.token_loader(path, batch_size=1000, seq_len=8, packing="greedy", eot=1)))
    with pytest.raises(TypeError, match="batch_size"):
        ad.token_loader(path, batch_size=2.0, seq_len=8)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unknown"):
        len(ad.token_loader(path, batch_size=2, seq_len=8, packing="greedy", eot=EOT))


# ------------------------------------------------------------------------- two processes
@pytest.mark.distributed
def test_two_processes_shard_by_torch_distributed_and_weigh_tokens(tmp_path):
    """Two gloo processes: each loader takes its rank from torch.distributed; the shards are
    the single-process rows split by rank, a resumed position continues them, and one DDP
    update with accumulation over packed rows equals the full batch's token-mean update."""
    from token_loader_worker import corpus_path, make_loader, reference_update

    path = corpus_path(tmp_path)
    torchrun(os.path.join(HERE, "token_loader_worker.py"), tmp_path, timeout=300)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r, got in enumerate(results):
        assert got["rank"] == r and got["world_size"] == 2
        for packing in ("windows", "best-fit"):
            explicit = epoch(make_loader(path, packing, rank=r, world_size=2))
            assert same(got[packing], explicit)
            assert same(got[packing + "_resumed"], explicit[3:])
    windows = [set(map(tuple, torch.cat([b["inputs"] for b in g["windows"]]).tolist()))
               for g in results]
    assert not windows[0] & windows[1]  # no window on both ranks
    single = epoch(make_loader(path, "best-fit", rank=0, world_size=1, batch_size=8))
    for k, batch in enumerate(single):
        for r in range(2):
            assert torch.equal(results[r]["best-fit"][k]["inputs"], batch["inputs"][r::2])
    expected = reference_update(path)
    unweighted = reference_update(path, by_rank=True)
    assert not torch.allclose(unweighted["head.bias"], expected["head.bias"], atol=1e-5)
    for got in results:
        for name, value in expected.items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6)


class ShardError(Exception):
    """A read error whose constructor takes other arguments than a message."""

    def __init__(self, shard: list[str], offset: int) -> None:
        super().__init__(f"cannot read {shard[0]} at {offset}")
        self.shard = shard
        self.offset = offset


@pytest.mark.parametrize("packing", ["windows", "greedy"])
@pytest.mark.parametrize("prefetch", [2, 0])
def test_a_read_error_reaches_the_loop_as_raised(tmp_path, monkeypatch, packing, prefetch):
    # Through the prefetch (and pinning) threads too: the exception object raised while
    # reading, with its type, message and attributes; not rebuilt as a RuntimeError.
    from accelfn.data import token_batches

    _, path = corpus(tmp_path)
    shard = ["shard-3.bin"]
    read = token_batches.window_rows if packing == "windows" else token_batches.packed_rows
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ShardError(shard, 4096)
        return read(*args, **kwargs)

    monkeypatch.setattr(token_batches, read.__name__, failing)
    kw = {"eot": EOT} if packing != "windows" else {}
    loader = ad.token_loader(path, batch_size=2, seq_len=16, packing=packing, prefetch=prefetch,
                             pin_memory=torch.cuda.is_available(), **kw)
    it = iter(loader)
    got = []
    with pytest.raises(ShardError) as info:
        while True:
            got.append({k: v.clone() for k, v in next(it).items()})
    e = info.value
    assert type(e) is ShardError and e.shard is shard and e.offset == 4096
    assert e.args == ("cannot read shard-3.bin at 4096",)
    rest = epoch(it)  # the failed batch is read again: the epoch is whole
    monkeypatch.setattr(token_batches, read.__name__, read)
    assert same(got + rest, epoch(ad.token_loader(path, batch_size=2, seq_len=16,
                                                  packing=packing, prefetch=0, **kw)))
