"""accelfn.data.loader: positions across worker counts, dict sources, bad input, dead workers."""

from __future__ import annotations

import os
import re
from concurrent.futures.process import BrokenProcessPool

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


# --------------------------------------------------------------------------------------------
# A worker process that dies


class Crashing:
    """Sample 17 kills its worker process (as a segfault or the OOM killer would) while the
    file ``flag`` exists."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == 17 and os.path.exists(self.flag):
            os._exit(3)
        return {"x": torch.tensor(float(i))}


@pytest.mark.slow
def test_e_a_dead_worker_process_is_reported_and_the_loop_goes_on_with_new_ones(tmp_path):
    flag = tmp_path / "crash"
    loader = ad.loader(
        Crashing(str(flag)), batch_size=4, shuffle=False, num_workers=2, worker_type="process"
    )
    flag.touch()
    yielded = []
    with pytest.raises(BrokenProcessPool) as info:
        for batch in loader:
            yielded.append(batch["x"][0].item())
    message = str(info.value)
    assert "a worker process died" in message
    named = re.search(r"one of the samples in flight \(([\d, -]+)\)", message)
    assert named is not None
    runs = [[int(x) for x in run.split("-")] for run in named.group(1).split(", ")]
    assert any(run[0] <= 17 <= run[-1] for run in runs)  # sample 17 is among those named
    assert "__getitem__" in message and "memory" in message and "num_workers=0" in message
    flag.unlink()
    try:  # new workers: the loop written again continues the epoch at the batch that
        # failed, then every later epoch is whole. The pool breaks for every batch in flight:
        # the one that failed is sample 17's (the 5th) or, when the dead worker is found
        # sooner (a loaded machine), an earlier one still in flight
        assert yielded == [4.0 * i for i in range(len(yielded))] and len(yielded) <= 4
        assert [b["x"][0].item() for b in loader] == [4.0 * i for i in range(len(yielded), 10)]
        assert [b["x"][0].item() for b in loader] == [4.0 * i for i in range(10)]
    finally:
        loader.close()


def _load_or_die(flag: str, idx: torch.Tensor) -> list[int]:
    if 17 in idx.tolist() and os.path.exists(flag):
        os._exit(3)
    return idx.tolist()


@pytest.mark.slow
def test_e_a_pool_broken_in_an_unfinished_epoch_is_replaced_at_the_next(tmp_path):
    import functools
    import time

    flag = tmp_path / "crash"
    flag.touch()
    sampler = ad.IndexBatchSampler(24, 4, shuffle=False)
    fn = functools.partial(_load_or_die, str(flag))
    pool = ad.PoolMapper(sampler, fn, 1, worker_type="process", max_in_flight=6)
    try:
        pool.reset(None)
        assert next(pool) == [0, 1, 2, 3]  # the batch with 17 is in flight: its worker dies
        deadline = time.monotonic() + 30
        while not pool._pending[-1][0].done() and time.monotonic() < deadline:
            time.sleep(0.02)
        flag.unlink()
        pool.reset(None)  # the epoch is left unfinished: the next one gets a new pool
        assert [next(pool) for _ in range(6)][-1] == [20, 21, 22, 23]
    finally:
        pool.close()


def test_e_the_samples_in_flight_are_named_in_runs():
    from accelfn.data.sampling import EpochBatch
    from accelfn.data.workers import _describe_samples

    items = [torch.tensor([4, 5, 6]), EpochBatch(torch.tensor([7, 9]), 1), torch.tensor([2])]
    assert _describe_samples(items) == "one of the samples in flight (2, 4-7, 9)"
    assert _describe_samples(["a", "b"]) == "one of the items in flight (2)"


def _raise_broken(idx: torch.Tensor) -> None:
    raise BrokenProcessPool("the dataset's own pool broke")


def test_e_a_broken_pool_raised_in_a_worker_thread_is_passed_as_it_is():
    sampler = ad.IndexBatchSampler(8, 4, shuffle=False)
    pool = ad.PoolMapper(sampler, _raise_broken, 2)
    try:
        pool.reset(None)
        with pytest.raises(BrokenProcessPool, match=r"^the dataset's own pool broke$"):
            next(pool)
    finally:
        pool.close()
