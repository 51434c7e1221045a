"""A loader position at an epoch's end, and iterators of a closed loader.

A position taken right after an epoch's last batch, before the loop heard of the epoch's
end, resumes with that end (the first ``iter()`` is an empty epoch), so that the loop's
end-of-epoch code runs exactly once, as in the uninterrupted run. One taken after the loop
heard of it resumes at the next epoch.
"""

from __future__ import annotations

import pytest
import torch
from helpers import roundtrip
from tensordict import TensorDict

import accelfn.data as ad

N, BATCH, EPOCHS = 40, 4, 3  # 10 batches per epoch


def make_td() -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict({"x": torch.randn(N, 3, generator=g), "label": torch.arange(N)},
                      batch_size=[N])


def make(kind: str = "plain") -> ad.BatchLoader:
    if kind == "threads":
        return ad.loader(make_td(), batch_size=BATCH, seed=3, num_workers=2)
    return ad.loader(make_td(), batch_size=BATCH, seed=3)


def for_loop(loader, start_epoch=0, save_at=None):
    """``for epoch in range(...): for batch in loader: ...`` then the epoch's end code.
    Returns the events and the position saved after batch number ``save_at``."""
    events: list[tuple] = []
    saved = None
    for epoch in range(start_epoch, EPOCHS):
        for batch in loader:
            events.append(("batch", epoch, batch["label"].tolist()))
            if len(events) - sum(e[0] == "end" for e in events) == save_at:
                saved = roundtrip(loader.state_dict())
                return events, saved, epoch
        events.append(("end", epoch))
    return events, saved, EPOCHS


def while_loop(loader, batches, save_at=None):
    """The documented ``while`` loop: ``next(it)``, and on StopIteration the epoch's end code
    and a new ``iter()``."""
    events: list[tuple] = []
    ends = 0
    it = iter(loader)
    seen = 0
    while seen < batches:
        try:
            batch = next(it)
        except StopIteration:
            events.append(("end",))
            ends += 1
            it = iter(loader)
            continue
        seen += 1
        events.append(("batch", batch["label"].tolist()))
        if seen == save_at:
            return events, roundtrip(loader.state_dict())
    return events, None


@pytest.mark.parametrize("kind", ["plain", "threads"])
@pytest.mark.parametrize("save_at", [10, 20, 7])
def test_a_for_loop_resumed_at_an_epochs_last_batch_runs_its_end_once(kind, save_at):
    reference = make(kind)
    full, _, _ = for_loop(reference)
    reference.close()

    first = make(kind)
    head, state, epoch = for_loop(first, save_at=save_at)
    first.close()
    resumed = make(kind)
    resumed.load_state_dict(state)
    tail, _, _ = for_loop(resumed, start_epoch=epoch)
    resumed.close()
    assert head + tail == full
    assert sum(e[0] == "end" for e in head + tail) == EPOCHS


@pytest.mark.parametrize("save_at", [10, 20, 3])
def test_a_while_loop_resumed_at_an_epochs_last_batch_sees_the_epochs_end(save_at):
    full, _ = while_loop(make(), 25)
    head, state = while_loop(make(), 25, save_at=save_at)
    resumed = make()
    resumed.load_state_dict(state)
    tail, _ = while_loop(resumed, 25 - save_at)
    assert head + tail == full
    assert [e for e in full if e[0] == "end"] == [("end",), ("end",)]


def test_a_position_taken_after_the_epochs_end_was_delivered_resumes_at_the_next_epoch():
    reference = make()
    epochs = [[b["label"].tolist() for b in reference] for _ in range(2)]
    first = make()
    assert [b["label"].tolist() for b in first] == epochs[0]  # StopIteration reached the loop
    state = roundtrip(first.state_dict())
    assert state["ended"] is True
    resumed = make()
    resumed.load_state_dict(state)
    assert [b["label"].tolist() for b in resumed] == epochs[1]


def test_the_empty_epoch_of_a_resume_reports_its_position_and_then_its_end():
    first = make()
    it = iter(first)
    for _ in range(10):
        next(it)
    state = roundtrip(first.state_dict())
    assert state["ended"] is False
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # pending: as loaded
    it = iter(resumed)
    assert roundtrip(resumed.state_dict()) == state  # in the empty epoch, before its end
    with pytest.raises(StopIteration):
        next(it)
    after = roundtrip(resumed.state_dict())
    assert after["ended"] is True and after["root"] == state["root"]
    # resuming there skips to the next epoch, as iterating on does
    again = make()
    again.load_state_dict(after)
    assert [b["label"].tolist() for b in again] == [b["label"].tolist() for b in resumed]


def test_a_position_without_the_end_flag_still_resumes_at_the_next_epoch():
    """Positions written before the flag existed: an epoch's end resumes at the next epoch."""
    reference = make()
    epochs = [[b["label"].tolist() for b in reference] for _ in range(2)]
    first = make()
    it = iter(first)
    for _ in range(10):
        next(it)
    old = roundtrip(first.state_dict())
    del old["ended"]
    resumed = make()
    resumed.load_state_dict(old)
    assert [b["label"].tolist() for b in resumed] == epochs[1]


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_a_malformed_end_flag_is_refused_before_anything_changes(bad):
    first = make()
    it = iter(first)
    for _ in range(3):
        next(it)
    good = roundtrip(first.state_dict())
    target = make()
    target.load_state_dict(good)
    state = dict(good, ended=bad)
    with pytest.raises(ValueError, match=r"'ended'.*True or False"):
        target.load_state_dict(state)
    assert target.state_dict() == good  # the pending position is still the one loaded before


def test_an_iterator_continued_after_close_is_stale():
    reference = make()
    epochs = [[b["label"].tolist() for b in reference] for _ in range(2)]
    loader = make("threads")
    it = iter(loader)
    got = [next(it)["label"].tolist() for _ in range(2)]
    assert got == epochs[0][:2]
    loader.close()
    with pytest.raises(RuntimeError, match=r"stale.*closed"):
        next(it)
    # the loader itself can still be iterated: the next iter() starts the next epoch
    assert [b["label"].tolist() for b in loader] == epochs[1]
    loader.close()


def test_a_position_saved_with_the_workers_in_its_config_still_resumes():
    # positions written before the workers left the checked configuration name them there
    from torch.utils.data import Dataset

    class Ranged(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return {"x": torch.tensor([float(i)])}

    def make(n):
        return ad.loader(Ranged(), batch_size=4, seed=3, num_workers=n)

    with make(1) as ref:
        full = [b["x"].clone() for b in ref]
    with make(1) as first:
        it = iter(first)
        head = [next(it)["x"].clone() for _ in range(2)]
        state = first.state_dict()
    state["config"] = {**state["config"], "num_workers": 1, "worker_type": "thread"}
    with make(2) as second:
        second.load_state_dict(state)
        rest = [b["x"].clone() for b in second]
    assert all(torch.equal(a, b) for a, b in zip(head + rest, full, strict=True))
