"""accelfn/data/epochs.py: the epoch and position protocol of the nodes that decide batches
(``EpochSource``: the sampler, the token windows, the packed rows) or seed draws over a source
(``EpochCounting``: the iterable batcher), and the mark of a start made to read a position.

For each of the four nodes: a bare ``reset()`` starts the next epoch only when something was
drawn (or ``mark_started()`` said so) since the last one; ``reset(state)`` resumes exactly at
a saved position, the next bare ``reset()`` starting the epoch after it; a state that is not
a source's is refused before anything changes. The batches are compared with those of a
fresh node walked by hand to the same place.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torchdata.nodes import IterableWrapper

import accelfn.data as ad
from accelfn.data.epochs import EpochCounting, EpochSource, is_reading_state, reading_state
from accelfn.data.sampling import IndexBatchSampler
from accelfn.data.token_batches import PackedRows, TokenWindows


def make(kind: str, tmp_path):
    if kind == "sampler":
        return lambda: IndexBatchSampler(40, 4, seed=3)
    if kind == "iterable":  # the draws of each sample seeded by epoch and position
        samples = [{"x": torch.tensor(i)} for i in range(40)]
        return lambda: ad.IterableBatcher(IterableWrapper(samples), 4, seed=3,
                                          sample_transform=lambda s: {**s, "r": torch.rand(())})
    rng = np.random.default_rng(0)
    stream = np.concatenate([np.append(rng.integers(0, 90, size=int(rng.integers(2, 30))), 99)
                             for _ in range(40)])
    files = ad.TokenFiles(ad.write_tokens(tmp_path / "t.bin", stream))
    common = dict(seq_len=16, batch_size=2, drop_last=True, rank=0, world_size=1,
                  delimiter=99, opens=False, seed=5)
    if kind == "windows":
        return lambda: TokenWindows(files, shuffle=True, **common)
    return lambda: PackedRows(files, packing="best-fit", buffer=8, shuffle=True,
                              shuffle_rows=8, **common)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return all(torch.equal(a[k], b[k]) for k in a.keys())


@pytest.mark.parametrize("kind", ["sampler", "windows", "packed", "iterable"])
def test_epochs_advance_only_after_a_draw_and_resume_exactly(kind, tmp_path):
    new = make(kind, tmp_path)
    node = new()
    assert isinstance(node, (EpochSource, EpochCounting))
    node.reset()
    node.reset()  # nothing drawn: still the first epoch
    assert node.get_state()["epoch"] == 0
    first = next(node)
    node.reset()  # drawn: the next epoch, from its start
    assert (node.get_state()["epoch"], node.get_state()["batches"]) == (1, 0)
    node.mark_started()  # a position read before any batch counts the epoch as begun
    node.reset()
    assert node.get_state()["epoch"] == 2

    walked = new()  # by hand: epoch 2, two batches in
    walked.reset()
    for _ in range(2):
        next(walked)
        walked.reset()
    assert walked.get_state()["epoch"] == 2
    next(walked), next(walked)
    saved = walked.get_state()
    expected = next(walked)

    resumed = new()
    resumed.reset(saved)
    assert (resumed.get_state()["epoch"], resumed.get_state()["batches"]) == (2, 2)
    assert same(next(resumed), expected)
    resumed.reset()  # a resumed position is inside its epoch: the next reset starts epoch 3
    assert resumed.get_state()["epoch"] == 3

    again = new()  # epoch 0 again from a saved start: the first batch as before
    again.reset({**new().get_state()})
    assert same(next(again), first)


@pytest.mark.parametrize("kind", ["sampler", "windows", "packed"])
def test_a_foreign_state_is_refused_before_anything_changes(kind, tmp_path):
    node = make(kind, tmp_path)()
    node.reset()
    next(node)
    before = node.get_state()
    with pytest.raises(ValueError, match=r"position|state"):
        node.reset({"epoch": "one", "batches": 0})
    assert node.get_state() == before


def test_reading_state_is_marked_for_its_thread_only_and_ends_with_its_block():
    seen = []
    with pytest.raises(RuntimeError), reading_state():
        assert is_reading_state()
        other = threading.Thread(target=lambda: seen.append(is_reading_state()))
        other.start()
        other.join()
        raise RuntimeError("a node failed while read")
    assert seen == [False] and not is_reading_state()
