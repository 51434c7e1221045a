"""accelfn.data.loader: positions across worker counts, dict sources, bad input, dead workers."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import accelfn.data as ad


class Ranged:
    """Map-style samples with a random draw (seeded per sample by the loader); module level so
    that worker processes can unpickle it."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor(i), "noise": torch.rand(())}


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x.keys())
        for x, y in zip(a, b)
    )


# --------------------------------------------------------------------------------------------
# A position carries across num_workers and worker_type (the batches do not depend on them)


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [
        ((1, "thread"), (2, "thread")),
        ((1, "process"), (2, "process")),
        ((0, "thread"), (2, "process")),
        ((2, "thread"), (0, "thread")),
    ],
)
def test_a_map_position_resumes_with_another_number_of_workers(saved, resumed):
    def make(workers):
        n, kind = workers
        return ad.loader(Ranged(), batch_size=4, seed=3, num_workers=n, worker_type=kind)

    with make(saved) as ref:
        full = list(ref) + list(ref)  # two epochs, uninterrupted
    with make(saved) as first:
        it = iter(first)
        head = [next(it) for _ in range(3)]
        state = first.state_dict()
    assert _same(head, full[:3])
    with make(resumed) as second:
        second.load_state_dict(state)
        rest = list(second) + list(second)
    assert _same(rest, full[3:20])


@pytest.mark.parametrize(
    ("transform", "saved", "resumed"),
    [
        (None, 0, 2),
        (None, 2, 0),
        (ad.RandomHorizontalFlip(), 0, 2),
        (ad.RandomHorizontalFlip(), 2, 0),
    ],
)
def test_a_tensordict_position_resumes_with_another_number_of_workers(transform, saved, resumed):
    td = TensorDict({"image": torch.rand(30, 1, 2, 2), "label": torch.arange(30)}, [30])

    def make(workers):
        return ad.loader(td, batch_size=4, seed=1, num_workers=workers, transform=transform)

    full = list(make(saved))
    first = make(saved)
    it = iter(first)
    head = [next(it) for _ in range(2)]
    state = first.state_dict()
    assert _same(head, full[:2])
    with make(resumed) as second:
        second.load_state_dict(state)
        assert _same(list(second), full[2:])


def test_a_position_is_the_same_whatever_the_workers():
    states = []
    for workers, kind in [(0, "thread"), (1, "thread"), (2, "thread"), (2, "process")]:
        with ad.loader(Ranged(), batch_size=4, num_workers=workers, worker_type=kind) as lo:
            it = iter(lo)
            next(it), next(it)
            states.append(lo.state_dict())
    assert all(s == states[0] for s in states)


def test_a_pool_mapper_reads_the_state_it_wrote_before():
    sampler = ad.IndexBatchSampler(12, 3, shuffle=False)
    pool = ad.PoolMapper(sampler, lambda idx: idx.tolist(), 2)
    pool.reset(None)
    first = [next(pool), next(pool)]
    old = pool.state_dict()["it_state"]  # {"source": ...}: a PoolMapper's state until now
    pool.reset(old)
    assert first == [[0, 1, 2], [3, 4, 5]] and next(pool) == [6, 7, 8]
    pool.close()


# --------------------------------------------------------------------------------------------
# Bad arguments: refused, naming the option, the value and what is expected


def _td(n: int = 10) -> TensorDict:
    return TensorDict({"image": torch.zeros(n, 1, 2, 2), "label": torch.arange(n)}, [n])


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"seed": 1.7}, TypeError, r"seed must be an int, got 1\.7 \(float\)"),
        ({"seed": None}, TypeError, r"seed must be an int, got None"),
        ({"seed": "abc"}, TypeError, r"seed must be an int, got 'abc' \(str\)"),
        ({"seed": True}, TypeError, r"seed must be an int, got True"),
        ({"seed": 2**64}, ValueError, r"seed must be in \[-2\*\*63, 2\*\*63\)"),
        ({"shuffle": "no"}, TypeError, r"shuffle must be True or False, got 'no' \(str\)"),
        ({"shuffle": 0}, TypeError, r"shuffle must be True or False, got 0 \(int\)"),
        ({"drop_last": "yes"}, TypeError, r"drop_last must be True or False, got 'yes'"),
        ({"pin_memory": "auto"}, TypeError, r"pin_memory must be True, False or None"),
        ({"keys": "image"}, TypeError, r"keys='image' is a string; .*keys=\['image'\]"),
        ({"keys": 3}, TypeError, r"keys must be a list or tuple of keys, got 3 \(int\)"),
        ({"ragged_keys": "jpeg"}, TypeError, r"ragged_keys='jpeg' is a string; .*\['jpeg'\]"),
    ],
)
def test_d_bad_options_are_refused_with_the_fix(options, error, match):
    with pytest.raises(error, match=match):
        ad.loader(_td(), batch_size=4, **options)


def test_d_the_checks_do_not_refuse_good_values():
    assert len(ad.loader(_td(), batch_size=4, seed=-3, shuffle=False, drop_last=False)) == 3
    assert len(ad.loader(_td(), batch_size=4, seed=2**63 - 1, keys=("image",))) == 2
    b = next(iter(ad.loader(_td(), batch_size=4, keys=["label"], pin_memory=False)))
    assert list(b.keys()) == ["label"]


# --------------------------------------------------------------------------------------------
# Dict sources: one tensor (or NumPy array) per key


def test_c_numpy_values_of_a_dict_source_are_taken_as_tensors():
    np = pytest.importorskip("numpy")
    image = np.arange(30, dtype=np.float32).reshape(10, 3)
    for src in [
        {"image": torch.as_tensor(image), "label": np.arange(10)},
        {"image": image, "label": np.arange(10)},
    ]:
        batches = list(ad.loader(src, batch_size=4, shuffle=False))
        assert len(batches) == 2
        assert batches[1]["label"].tolist() == [4, 5, 6, 7]
        assert batches[1]["label"].dtype == torch.int64
        assert torch.equal(batches[0]["image"], torch.as_tensor(image[:4]))


def test_c_nested_dict_sources_are_taken_as_nested_keys():
    src = {"image": torch.zeros(8, 2), "meta": {"label": torch.arange(8)}}
    b = next(iter(ad.loader(src, batch_size=4, shuffle=False)))
    assert b["meta", "label"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([f"f{i}.jpg" for i in range(10)], r"key 'name' holds a list.*map-style dataset"),
        (3, r"key 'name' holds a value of type int"),
        (torch.tensor(1), r"key 'name' holds a 0-dim tensor"),
    ],
)
def test_c_a_dict_source_with_another_value_is_refused_naming_the_key(value, match):
    with pytest.raises(TypeError, match=match):
        ad.loader({"image": torch.zeros(10, 3), "name": value}, batch_size=4)


def test_c_a_numpy_array_that_is_not_numeric_is_refused_naming_the_key():
    np = pytest.importorskip("numpy")
    names = np.array([f"f{i}.jpg" for i in range(10)])
    with pytest.raises(TypeError, match=r"key 'name' holds a NumPy array of dtype <U6"):
        ad.loader({"image": torch.zeros(10, 3), "name": names}, batch_size=4)


def test_c_a_dict_source_with_keys_of_mixed_types_is_refused():
    with pytest.raises(TypeError, match=r"keys must be strings.*got 0 \(int\)"):
        ad.loader({"image": torch.zeros(10, 3), 0: torch.zeros(10)}, batch_size=4)


def test_c_a_dict_source_with_rows_of_different_lengths_is_refused():
    with pytest.raises(ValueError, match="different first dimensions"):
        ad.loader({"image": torch.zeros(10, 3), "label": torch.zeros(9)}, batch_size=4)


def test_c_a_dict_source_of_empty_dicts_is_refused():
    with pytest.raises(ValueError, match="holds no tensor"):
        ad.loader({"meta": {}}, batch_size=4)
