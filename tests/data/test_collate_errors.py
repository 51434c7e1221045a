"""Errors raised while samples are loaded and collated name the sample that caused them."""

from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch

import accelfn.data as ad

N = 40
BAD = 23


def decode(raw: int) -> torch.Tensor:  # the failing code does not know the index
    if raw < 0:
        raise ValueError("truncated record")
    return torch.tensor(float(raw))


class Truncated:
    """A map-style dataset whose record ``BAD`` is corrupt. Module level: process workers
    unpickle it."""

    def __init__(self) -> None:
        self.raw = [i if i != BAD else -1 for i in range(N)]

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return {"x": decode(self.raw[i])}


class TruncatedStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(N):
            yield -1 if i == BAD else i


def _shown(e: BaseException) -> str:
    """What the user sees of an uncaught exception: message, notes and traceback."""
    return "".join(traceback.format_exception(e))


@pytest.mark.parametrize(
    "worker_type, num_workers", [("thread", 0), ("thread", 2), ("process", 2)]
)
def test_an_error_in_getitem_names_the_sample_and_keeps_its_type(worker_type, num_workers):
    loader = ad.loader(Truncated(), batch_size=4, shuffle=True, num_workers=num_workers,
                       worker_type=worker_type)
    try:
        with pytest.raises(ValueError, match="truncated record") as info:
            for _ in range(2):
                for _ in loader:
                    pass
    finally:
        loader.close()
    assert f"while loading sample {BAD} of epoch 0" in _shown(info.value)


def test_an_error_in_an_iterables_sample_transform_names_its_position():
    loader = ad.loader(TruncatedStream(), batch_size=4, shuffle=False,
                       sample_transform=lambda raw: {"x": decode(raw)})
    with pytest.raises(ValueError, match="truncated record") as info:
        list(loader)
    assert f"sample {BAD} of epoch 0 of the iterable source" in _shown(info.value)


class FailingStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(N):
            if i == BAD:
                raise OSError("connection reset")
            yield {"x": torch.tensor(i)}


def test_an_error_while_reading_an_iterable_names_the_position():
    with pytest.raises(OSError, match="connection reset") as info:
        list(ad.loader(FailingStream(), batch_size=4, shuffle=False))
    assert f"sample {BAD} of epoch 0 of the iterable source" in _shown(info.value)


class RecordError(Exception):
    """A dataset's own exception, whose constructor takes other arguments than a message."""

    def __init__(self, path: list[str], offset: int) -> None:
        super().__init__(f"bad record in {path[0]} at {offset}")
        self.path = path
        self.offset = offset


SHARD = ["shard-3.bin"]  # the attribute the loop must get back: this object, not a copy


class BadRecord:
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        if i == BAD:
            raise RecordError(SHARD, 4096)
        return {"x": torch.tensor(float(i))}


PIN = [False, True] if torch.cuda.is_available() else [False]


@pytest.mark.parametrize("pin_memory", PIN, ids=["unpinned", "pinned"][: len(PIN)])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("prefetch", [2, 0])
def test_a_dataset_exception_reaches_the_loop_as_raised(prefetch, num_workers, pin_memory):
    # Through the prefetch (and pinning) threads too: the very exception object the dataset
    # raised, with its message, attributes and the note naming the sample; not rebuilt.
    with ad.loader(BadRecord(), batch_size=4, shuffle=False, prefetch=prefetch,
                   num_workers=num_workers, pin_memory=pin_memory) as loader:
        it = iter(loader)
        with pytest.raises(RecordError) as info:
            while True:
                next(it)
        e = info.value
        assert type(e) is RecordError
        assert e.path is SHARD and e.offset == 4096
        assert e.args == ("bad record in shard-3.bin at 4096",)
        assert str(e) == "bad record in shard-3.bin at 4096"
        assert e.__notes__ == [f"while loading sample {BAD} of epoch 0: in dataset[{BAD}]"]
        # the failed batch is retried at the next next(), and fails again (no second note)
        with pytest.raises(RecordError) as again:
            next(it)
        assert again.value is not e and len(again.value.__notes__) == 1


def test_a_dataset_exception_that_cannot_cross_processes_is_named_not_a_dead_worker():
    # RecordError cannot be rebuilt from its args in the trainer: concurrent.futures would
    # report a worker that "died abruptly"; it arrives as a RuntimeError saying what it was
    with ad.loader(BadRecord(), batch_size=4, shuffle=False, prefetch=0, num_workers=2,
                   worker_type="process") as loader:
        with pytest.raises(RuntimeError) as info:
            for _ in loader:
                pass
    e = info.value
    assert type(e) is RuntimeError
    assert str(e) == f"{__name__}.RecordError: bad record in shard-3.bin at 4096"
    assert e.__notes__[0] == f"while loading sample {BAD} of epoch 0: in dataset[{BAD}]"
    assert "cannot be rebuilt from its args" in e.__notes__[1]


class Samples:
    def __init__(self, samples) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return self.samples[i]


def _one_batch(samples, **kwargs):
    with ad.loader(Samples(samples), batch_size=len(samples), shuffle=False, drop_last=False,
                   num_workers=1, **kwargs) as loader:
        return next(iter(loader))


def test_numpy_arrays_with_negative_strides_are_collated():
    # np.flip and [::-1] give views with negative strides, which torch.from_numpy refuses
    batch = _one_batch([
        {"x": np.arange(4.0), "m": np.zeros((2, 3))},
        {"x": np.flip(np.arange(4.0)), "m": np.arange(6.0).reshape(2, 3)[::-1, ::-1]},
        {"x": np.arange(8.0)[::2], "m": np.ones((3, 2)).T},  # positive strides, not contiguous
    ])
    assert batch["x"].tolist() == [[0, 1, 2, 3], [3, 2, 1, 0], [0, 2, 4, 6]]
    assert batch["m"][1].tolist() == [[5, 4, 3], [2, 1, 0]]
    assert batch["m"][2].tolist() == [[1, 1, 1], [1, 1, 1]]
    # 0-d arrays stay 0-d
    assert _one_batch([{"y": np.array(1.5)}, {"y": np.array(2.5)}])["y"].tolist() == [1.5, 2.5]


@pytest.mark.parametrize("value", [np.array(["a", "b"]), np.array([object()])],
                         ids=["str", "object"])
def test_a_numpy_array_torch_cannot_hold_names_the_sample_and_key(value):
    with pytest.raises(TypeError, match=r"sample 1: key 'tag' holds a numpy array of dtype"):
        _one_batch([{"tag": np.zeros(2)}, {"tag": value}])
