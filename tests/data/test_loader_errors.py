"""A batch whose loading fails: the loader retries it at the next ``next()``, and its position
points at it meanwhile, so an epoch continued after the error is whole (never silently short).

The expected samples come from a plain ``torch.utils.data.DataLoader`` over the same dataset.
"""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

import accelfn.data as ad

N = 32
BATCH = 4


class FailsOnce:
    """A map-style dataset whose sample ``bad`` raises the first time it is loaded (the flag
    is a file, so that worker processes see it too)."""

    def __init__(self, bad: int, flag: str) -> None:
        self.bad = bad
        self.flag = flag

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == self.bad and not os.path.exists(self.flag):
            with open(self.flag, "w"):
                pass
            raise OSError(f"sample {i}: transient read error")
        return {"x": torch.tensor([float(i)]), "label": torch.tensor(i)}


def expected_epochs(epochs: int) -> list[int]:
    """The sample ids of a plain DataLoader loop (in order), ``epochs`` times."""
    ds = [{"x": torch.tensor([float(i)]), "label": torch.tensor(i)} for i in range(N)]
    dl = DataLoader(ds, batch_size=BATCH, shuffle=False, drop_last=True)
    return [i for _ in range(epochs) for b in dl for i in b["label"].tolist()]


def run_through_errors(loader, epochs: int) -> tuple[list[int], list[dict]]:
    """Iterate ``epochs`` epochs, catching each error and continuing the same iterator; the
    positions read right after each error."""
    ids: list[int] = []
    positions = []
    for _ in range(epochs):
        it = iter(loader)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            except OSError:
                positions.append(loader.state_dict())
                continue
            ids += batch["label"].tolist()
    return ids, positions


SETTINGS = [
    {"num_workers": 0, "prefetch": 0},
    {"num_workers": 0, "prefetch": 2},
    {"num_workers": 2, "prefetch": 0},
    {"num_workers": 2, "prefetch": 2},
    {"num_workers": 2, "prefetch": 2, "worker_type": "process"},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("bad", [1, 10, N - 1])  # sample 0 is read when the loader is built
def test_an_epoch_continued_after_a_sample_error_is_whole(tmp_path, settings, bad):
    ds = FailsOnce(bad, str(tmp_path / "raised"))
    with ad.loader(ds, batch_size=BATCH, shuffle=False, **settings) as loader:
        ids, positions = run_through_errors(loader, epochs=2)
    assert ids == expected_epochs(2)  # the failed batch was retried, nothing dropped
    assert len(positions) == 1


@pytest.mark.parametrize("settings", SETTINGS[:4], ids=lambda s: "-".join(map(str, s.values())))
def test_the_position_after_an_error_points_at_the_failed_batch(tmp_path, settings):
    bad = 10
    ds = FailsOnce(bad, str(tmp_path / "raised"))
    loader = ad.loader(ds, batch_size=BATCH, shuffle=True, seed=3, **settings)
    it = iter(loader)
    before = []
    with pytest.raises(OSError, match="transient read error"):
        while True:
            before += next(it)["label"].tolist()
    position = loader.state_dict()
    assert loader.state_dict() == position  # a read, whatever the error left behind
    rest = [i for b in it for i in b["label"].tolist()]  # the same iterator retries
    # an identically built loader resumed at that position yields the same batches
    resumed = ad.loader(FailsOnce(bad, str(tmp_path / "raised")), batch_size=BATCH,
                        shuffle=True, seed=3, **settings)
    resumed.load_state_dict(position)
    assert [i for b in resumed for i in b["label"].tolist()] == rest
    # and together they are the uninterrupted epoch
    plain = ad.loader(FailsOnce(-1, str(tmp_path / "unused")), batch_size=BATCH,
                      shuffle=True, seed=3, **settings)
    assert before + rest == [i for b in plain for i in b["label"].tolist()]
    assert bad in rest and len(before + rest) == N
    for ld in (loader, resumed, plain):
        ld.close()


def test_a_batch_transform_error_is_retried_too():
    td = TensorDict({"x": torch.arange(N).float(), "label": torch.arange(N)}, [N])
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("transform failed once")
        return batch

    with ad.loader(td, batch_size=BATCH, shuffle=False, transform=flaky, prefetch=0) as loader:
        it = iter(loader)
        ids = []
        while True:
            try:
                ids += next(it)["label"].tolist()
            except StopIteration:
                break
            except RuntimeError:
                continue
    assert ids == expected_epochs(1)


def test_an_error_that_persists_is_raised_again_not_skipped(tmp_path):
    class AlwaysFails(FailsOnce):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            if i == self.bad:
                raise OSError(f"sample {i}: corrupt")
            return super().__getitem__(i)

    ds = AlwaysFails(10, str(tmp_path / "raised"))
    with ad.loader(ds, batch_size=BATCH, shuffle=False, num_workers=0, prefetch=0) as loader:
        it = iter(loader)
        assert [next(it)["label"].tolist() for _ in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        for _ in range(3):
            with pytest.raises(OSError, match="sample 10: corrupt"):
                next(it)


def for_loops_through_errors(loader, epochs: int) -> list[int]:
    """``epochs`` epochs of ``for batch in loader:``, the loop written again (a new
    ``iter()``) after each error, as a training script's retry does."""
    ids: list[int] = []
    done = 0
    while done < epochs:
        try:
            for batch in loader:
                ids += batch["label"].tolist()
        except OSError:
            continue  # the `for` again: the epoch goes on
        done += 1
    return ids


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("bad", [1, 10, N - 1])
def test_a_for_loop_retried_after_an_error_continues_the_epoch(tmp_path, settings, bad):
    ds = FailsOnce(bad, str(tmp_path / "raised"))
    with ad.loader(ds, batch_size=BATCH, shuffle=False, **settings) as loader:
        ids = for_loops_through_errors(loader, epochs=2)
    assert ids == expected_epochs(2)  # the rest of the epoch, then the next one whole
