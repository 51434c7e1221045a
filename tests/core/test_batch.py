"""split_batch: micro-batches equal to TensorDict.split for every kind of batch."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorData, TensorDict

from accelfn.core.batch import batch_size, split_batch


def _same(parts, reference):
    assert len(parts) == len(reference)
    for got, want in zip(parts, reference):
        assert type(got) is type(want)
        assert got.batch_size == want.batch_size and got.device == want.device
        assert got.names == want.names
        flat = got.flatten_keys(), want.flatten_keys()
        assert sorted(flat[0].keys()) == sorted(flat[1].keys())
        for key in flat[1].keys():
            a, b = flat[0][key], flat[1][key]
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b) and a.data_ptr() == b.data_ptr()  # views, no copy
            else:
                assert a == b


def _batch(**extra):
    g = torch.Generator().manual_seed(0)
    return TensorDict({"x": torch.randn(10, 3, generator=g), "y": torch.arange(10), **extra},
                      batch_size=[10])


@pytest.mark.parametrize("parts", [1, 3, 4, 10])
def test_flat_tensordict_splits_like_tensordict_split(parts):
    batch = _batch()
    sizes = [len(p) for p in torch.arange(10).tensor_split(parts)]
    _same(split_batch(batch, parts), batch.split(sizes))
    assert [batch_size(p) for p in split_batch(batch, parts)] == sizes


def test_device_and_time_major_batches():
    batch = TensorDict({"x": torch.randn(5, 6, 2)}, batch_size=[5, 6], device="cpu")
    _same(split_batch(batch, 4, dim=1), batch.split([2, 2, 1, 1], dim=1))


@pytest.mark.parametrize("kind", ["nested", "names", "non_tensor", "subclass"])
def test_other_tensordicts_split_like_tensordict_split(kind):
    if kind == "nested":
        batch = _batch(inner=TensorDict({"z": torch.ones(10, 2)}, batch_size=[10]))
    elif kind == "names":
        batch = TensorDict({"x": torch.randn(10, 3)}, batch_size=[10], names=["batch"])
    elif kind == "non_tensor":
        batch = _batch(tag=NonTensorData("train", batch_size=[10]))
    else:
        batch = _batch(w=torch.nn.Parameter(torch.ones(10)))
    _same(split_batch(batch, 3), batch.split([4, 3, 3]))


def test_mapping_batches_split_per_entry():
    batch = {"x": torch.randn(7, 2), "y": torch.arange(7)}
    parts = split_batch(batch, 2)
    assert [p["y"].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6]]
    assert all(type(p) is dict for p in parts)
