"""accelfn.data loaders: batches, shuffling, sharding, exact resume, data wait, bad input."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torchdata.nodes as tn
from helpers import roundtrip
from tensordict import TensorDict

import accelfn.data as ad
from accelfn.data import sharding

N = 103  # not a multiple of the batch sizes used below, to exercise short final batches


def make_td(n: int = N) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict(
        {
            "image": torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g),
            "label": torch.arange(n),
        },
        batch_size=[n],
    )


class MapDataset:
    """A map-style dataset; module level so worker processes can unpickle it."""

    def __init__(self, n: int = N, delay: float = 0.0) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, object]:
        if self.delay:
            time.sleep(self.delay)
        img = torch.full((3, 8, 8), i % 256, dtype=torch.uint8)
        return {"image": img, "label": i, "pid": os.getpid(), "tid": threading.get_ident()}


class Broken:
    """Sample ``bad`` is malformed in the way ``how`` says."""

    def __init__(self, how: str, bad: int = 7, n: int = 20) -> None:
        self.how, self.bad, self.n = how, bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = {"image": torch.zeros(3, 4, 4), "label": torch.tensor(i)}
        if i == self.bad:
            if self.how == "shape":
                sample["image"] = torch.zeros(3, 4, 5)
            elif self.how == "dtype":
                sample["label"] = torch.tensor(float(i))
            elif self.how == "missing":
                del sample["label"]
            elif self.how == "type":
                sample["label"] = "seven"
        return sample


def augment() -> ad.Compose:
    return ad.Compose(
        ad.RandomCrop(8, padding=2),
        ad.RandomHorizontalFlip(),
        ad.Normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25]),
    )


def epoch_labels(loader) -> torch.Tensor:
    return torch.cat([b["label"] for b in loader])


def same_batches(a: list[TensorDict], b: list[TensorDict]) -> bool:
    if len(a) != len(b):
        return False
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x.keys())
        for x, y in zip(a, b)
    )


def assert_resumes_exactly(make, *, epochs: int, per_epoch: int, stop: int) -> None:
    """``epochs`` epochs of ``make()`` (``per_epoch`` batches each) against a loader stopped
    after ``stop`` batches, its state saved (through torch.save) and loaded into a fresh one:
    the batches before and after the stop together are exactly the uninterrupted run's."""
    reference = make()
    full = [b.clone() for _ in range(epochs) for b in reference]
    reference.close()
    assert len(full) // epochs == per_epoch

    first = make()
    seen: list[TensorDict] = []
    while len(seen) < stop:
        for b in first:
            seen.append(b.clone())
            if len(seen) == stop:
                break
    state = roundtrip(first.state_dict())
    first.close()

    resumed = make()
    resumed.load_state_dict(state)
    # the rest of the saved epoch, then the epochs after it; a position taken right after an
    # epoch's last batch, before its end reached the loop, resumes with that end: the first
    # iter() then yields no batch and only ends it
    rest = [b.clone() for _ in range(epochs - (stop - 1) // per_epoch) for b in resumed]
    resumed.close()
    assert same_batches(seen, full[:stop])
    assert same_batches(rest, full[stop:])


# --------------------------------------------------------------------------------------------
# Batches


def test_tensordict_source_yields_tensordict_batches():
    td = make_td()
    loader = ad.loader(td, batch_size=10, device="cpu")
    batches = list(loader)
    assert len(batches) == len(loader) == N // 10
    for b in batches:
        assert isinstance(b, TensorDict)
        assert b.batch_size == torch.Size([10])
        assert b["image"].dtype == torch.uint8 and b["image"].shape == (10, 3, 8, 8)
        assert b.device == torch.device("cpu")
        # Pinned memory only where CUDA exists.
        assert b["image"].is_pinned() == torch.cuda.is_available()
        # Rows are gathered consistently across keys.
        assert torch.equal(b["image"], td["image"][b["label"]])


def test_device_none_keeps_batches_on_host_unpinned():
    b = next(iter(ad.loader(make_td(), batch_size=8)))
    assert b["image"].device.type == "cpu"
    assert not b["image"].is_pinned()


def test_memmap_source_matches_in_memory(tmp_path):
    td = make_td()
    mm = td.memmap(tmp_path / "d")
    a = list(ad.loader(td, batch_size=16, seed=3))
    b = list(ad.loader(TensorDict.load_memmap(tmp_path / "d"), batch_size=16, seed=3))
    assert same_batches(a, b)
    assert mm["image"].dtype == torch.uint8


def test_dict_of_tensors_and_key_selection():
    src = {"x": torch.arange(12.0), "y": torch.arange(12)}
    b = next(iter(ad.loader(src, batch_size=4, keys=["y"], shuffle=False)))
    assert list(b.keys()) == ["y"] and b["y"].tolist() == [0, 1, 2, 3]


def test_map_dataset_tuple_samples_get_image_label_keys():
    data = [(torch.full((2, 2), float(i)), i) for i in range(10)]
    b = next(iter(ad.loader(data, batch_size=5, shuffle=False, num_workers=0)))
    assert sorted(b.keys()) == ["image", "label"]
    assert b["label"].tolist() == [0, 1, 2, 3, 4] and b["label"].dtype == torch.int64
    assert b["image"].shape == (5, 2, 2)


def test_map_dataset_named_keys_and_pil_images():
    from PIL import Image

    data = [(Image.new("RGB", (5, 4), (i, 0, 0)), float(i)) for i in range(6)]
    b = next(iter(ad.loader(data, batch_size=3, shuffle=False, keys=("img", "y"))))
    assert b["img"].shape == (3, 3, 4, 5) and b["img"].dtype == torch.uint8
    assert b["img"][:, 0, 0, 0].tolist() == [0, 1, 2]
    assert b["y"].dtype == torch.float32


def test_map_dataset_loads_in_worker_threads_that_persist_across_epochs():
    loader = ad.loader(MapDataset(), batch_size=8, num_workers=2)
    epochs = [list(loader) for _ in range(2)]
    tids = [set(torch.cat([b["tid"] for b in e]).tolist()) for e in epochs]
    assert threading.get_ident() not in tids[0] | tids[1]
    # the same two threads serve both epochs (which of them loads a sample varies with load)
    assert len(tids[0] | tids[1]) <= 2
    assert set(torch.cat([b["pid"] for b in epochs[0]]).tolist()) == {os.getpid()}


@pytest.mark.slow
def test_process_workers_persist_across_epochs():
    with ad.loader(MapDataset(40), batch_size=4, num_workers=2, worker_type="process") as loader:
        epochs = [list(loader) for _ in range(2)]
    pids = [set(torch.cat([b["pid"] for b in e]).tolist()) for e in epochs]
    for e in epochs:
        assert sorted(torch.cat([b["label"] for b in e]).tolist()) == list(range(40))
    assert os.getpid() not in pids[0]
    assert pids[1] <= pids[0] and len(pids[0] | pids[1]) <= 2


def _pools(loader) -> list[ad.PoolMapper]:
    found, todo = [], [loader.root]
    while todo:
        node = todo.pop()
        found += [node] if isinstance(node, ad.PoolMapper) else []
        todo += [v for v in vars(node).values() if isinstance(v, tn.BaseNode)]
    return found


class Gated(MapDataset):
    """Samples wait for ``gate`` once it is closed."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def __getitem__(self, i: int) -> dict[str, object]:
        self.gate.wait()
        return super().__getitem__(i)


def test_a_loader_collected_in_another_thread_is_stopped_without_blocking_that_thread():
    # The collector runs a dropped loader's finalizer in whatever thread allocates, e.g.
    # multiprocessing's resource sharer, which worker processes wait on: a finalizer that
    # waits for the workers there waits for ever. Here the thread that collects the loader
    # is the one its workers wait for.
    from accelfn.data import batch_loader

    ds = Gated()
    loader = ad.loader(ds, batch_size=4, num_workers=2)
    next(iter(loader))
    ds.gate.clear()  # the samples being loaded now wait
    (pool,) = _pools(loader)

    def collect_then_open() -> None:
        batch_loader._finalize(loader.root, loader._close_fns)
        ds.gate.set()

    other = threading.Thread(target=collect_then_open, daemon=True)
    other.start()
    other.join(timeout=20)
    blocked = other.is_alive()
    ds.gate.set()  # (unblocks a waiting finalizer)
    assert not blocked
    deadline = time.monotonic() + 30
    while pool._pool is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool._pool is None  # the workers were stopped, in the background


def test_a_loader_collected_in_one_of_its_own_worker_threads_is_stopped():
    from accelfn.data import batch_loader

    loader = ad.loader(MapDataset(), batch_size=4, num_workers=2)
    next(iter(loader))
    (pool,) = _pools(loader)
    done = pool._pool.submit(batch_loader._finalize, loader.root, loader._close_fns)
    done.result(timeout=30)  # not RuntimeError: cannot join current thread
    deadline = time.monotonic() + 30
    while pool._pool is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool._pool is None


def _session_processes(sid: int) -> set[int]:
    """Pids of the live (not zombie) processes of session ``sid``, from /proc."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        state, session = fields[0], int(fields[3])
        if session == sid and state not in "ZX":
            out.add(int(entry))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_process_workers_exit_when_the_trainer_is_killed(method):
    """SIGKILL the trainer: within 5 s no process it started is alive and its output pipe is
    closed (a supervisor reading it sees the end), as with torch's DataLoader workers."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("killed_trainer.py")), method],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    lines: queue.Queue[bytes] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(b"")  # end of file: nobody holds the pipe open any more

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        output = []
        while True:
            line = lines.get(timeout=180)
            output.append(line)
            assert line, b"".join(output).decode(errors="replace")
            if line.startswith(b"workers "):
                break
        workers = {int(p) for p in line.split()[1:]}
        assert len(workers) == 2 and workers <= _session_processes(proc.pid)
        time.sleep(1.0)  # the batches in flight are done: the workers wait for work
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        while _session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _session_processes(proc.pid)
        reader.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not left, f"alive 5 s after the SIGKILL: {sorted(left)} (workers {workers})"
        assert not reader.is_alive(), "the trainer's output pipe is still held open"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the session
        proc.wait(timeout=10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_a_dead_unreaped_trainer_counts_as_dead():
    """A SIGKILLed trainer whose supervisor has not reaped it is a zombie: workers must not
    take it for alive (``os.kill(pid, 0)`` would)."""
    from accelfn.data.workers import _alive

    assert _alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while _alive(child.pid) and time.monotonic() < deadline:  # exited, not reaped: a zombie
        time.sleep(0.05)
    try:
        assert not _alive(child.pid)
        os.kill(child.pid, 0)  # the pid still exists
    finally:
        child.wait()
    assert not _alive(child.pid)


def test_iterable_source_in_order_and_reiterable():
    data = [{"x": torch.tensor(i)} for i in range(10)]
    loader = ad.loader(iter_data := _Reiterable(data), batch_size=4, shuffle=False, drop_last=False)
    assert [b["x"].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b["x"].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert iter_data.passes == 2
    with pytest.raises(TypeError, match="unknown"):
        len(loader)


class _Reiterable(torch.utils.data.IterableDataset):
    def __init__(self, data):
        self.data = data
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        return iter(self.data)


def test_each_iter_starts_an_epoch_and_old_iterators_are_stale():
    loader = ad.loader(make_td(), batch_size=10, seed=1)
    first = iter(loader)
    a = next(first)["label"]
    second = iter(loader)  # a new epoch, as after a `break`
    b = next(second)["label"]
    assert not torch.equal(a, b)
    with pytest.raises(RuntimeError, match="stale"):
        next(first)


def test_drop_last_false_keeps_short_batch():
    loader = ad.loader(make_td(), batch_size=10, drop_last=False)
    sizes = [b.batch_size[0] for b in loader]
    assert sizes == [10] * 10 + [3] and len(loader) == 11


def test_nodes_compose_with_torchdata_nodes():
    td = make_td(20)
    root = tn.Mapper(
        ad.IndexBatchSampler(20, 5, shuffle=False),
        ad.TensorDictGather(td),
    )
    root = tn.Mapper(root, lambda b: b.set("twice", b["label"] * 2))
    loader = ad.BatchLoader(root, num_batches=4)
    batches = list(loader)
    assert len(batches) == len(loader) == 4
    assert batches[1]["twice"].tolist() == [10, 12, 14, 16, 18]


# --------------------------------------------------------------------------------------------
# Shuffling and sharding


def test_every_sample_once_per_epoch_new_order_each_epoch():
    loader = ad.loader(make_td(), batch_size=10, drop_last=False, seed=1)
    e0, e1 = epoch_labels(loader), epoch_labels(loader)
    assert sorted(e0.tolist()) == list(range(N)) == sorted(e1.tolist())
    assert not torch.equal(e0, e1)


def test_drop_last_drops_fewer_than_a_batch_without_duplicates():
    loader = ad.loader(make_td(), batch_size=10, seed=1)
    e0, e1 = epoch_labels(loader), epoch_labels(loader)
    for e in (e0, e1):
        assert e.numel() == 100 and e.unique().numel() == 100
    # The dropped samples change with the epoch's permutation.
    assert set(range(N)) - set(e0.tolist()) != set(range(N)) - set(e1.tolist())


def test_shuffle_is_reproducible_from_seed():
    a = [epoch_labels(ld) for ld in [ad.loader(make_td(), batch_size=8, seed=5)] for _ in range(2)]
    b = [epoch_labels(ld) for ld in [ad.loader(make_td(), batch_size=8, seed=5)] for _ in range(2)]
    c = epoch_labels(ad.loader(make_td(), batch_size=8, seed=6))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c)


def test_no_shuffle_is_in_order():
    assert epoch_labels(ad.loader(make_td(), batch_size=10, shuffle=False)).tolist() == list(
        range(100)
    )


@pytest.mark.parametrize("drop_last", [True, False])
def test_explicit_shards_do_not_overlap(drop_last):
    world = 3
    shards = [
        epoch_labels(
            ad.loader(
                make_td(), batch_size=4, seed=2, rank=r, world_size=world, drop_last=drop_last
            )
        )
        for r in range(world)
    ]
    sizes = {s.numel() for s in shards}
    assert len(sizes) == 1  # same number of samples on every rank (no rank waits at a barrier)
    seen = torch.cat(shards)
    if drop_last:
        assert seen.unique().numel() == seen.numel()  # no sample on two ranks
    else:
        assert set(seen.tolist()) == set(range(N))  # everything covered
        assert seen.numel() - seen.unique().numel() == (-N) % world  # only the wrap-around pad


def test_shards_follow_torch_distributed(monkeypatch):
    world = 4
    shards = []
    for r in range(world):
        monkeypatch.setattr(sharding.dist, "is_available", lambda: True)
        monkeypatch.setattr(sharding.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(sharding.dist, "get_rank", lambda r=r: r)
        monkeypatch.setattr(sharding.dist, "get_world_size", lambda: world)
        loader = ad.loader(make_td(), batch_size=5, seed=0)
        assert loader.config["rank"] == r and loader.config["world_size"] == world
        shards.append(set(epoch_labels(loader).tolist()))
    for i in range(world):
        for j in range(i + 1, world):
            assert not shards[i] & shards[j]
    assert sum(map(len, shards)) == world * 25


def test_iterable_shards_by_position():
    data = _Reiterable([{"x": torch.tensor(i)} for i in range(20)])
    shards = [
        torch.cat(
            [b["x"] for b in ad.loader(data, batch_size=3, shuffle=False, rank=r, world_size=2)]
        ).tolist()
        for r in range(2)
    ]
    assert shards == [[0, 2, 4, 6, 8, 10, 12, 14, 16], [1, 3, 5, 7, 9, 11, 13, 15, 17]]


def test_rank_without_world_size_is_an_error():
    with pytest.raises(ValueError, match="pass both"):
        ad.loader(make_td(), batch_size=4, rank=1)
    with pytest.raises(ValueError, match="rank < world_size"):
        ad.loader(make_td(), batch_size=4, rank=2, world_size=2)


# --------------------------------------------------------------------------------------------
# Exact resume


def _factories():
    return {
        "tensordict": lambda: ad.loader(make_td(), batch_size=10, seed=4, transform=augment()),
        "tensordict-threads": lambda: ad.loader(
            make_td(), batch_size=10, seed=4, num_workers=2, transform=augment(), device="cpu"
        ),
        "map-threads": lambda: ad.loader(
            MapDataset(), batch_size=10, seed=4, num_workers=3, keys=("image", "label"),
            transform=augment(),
        ),
        "map-processes": lambda: ad.loader(
            MapDataset(), batch_size=10, seed=4, num_workers=2, worker_type="process",
            keys=("image", "label"), transform=augment(),
        ),
        "no-prefetch": lambda: ad.loader(make_td(), batch_size=10, seed=4, prefetch=0),
        "iterable": lambda: ad.loader(
            _Reiterable([{"label": torch.tensor(i)} for i in range(N)]),
            batch_size=10,
            shuffle=False,
            transform=lambda b: b.set("double", b["label"] * 2),
        ),
    }


@pytest.mark.parametrize("kind", list(_factories()))
@pytest.mark.parametrize("stop", [3, 10, 14])  # mid-epoch 0, at the epoch boundary, mid-epoch 1
def test_resume_gives_exactly_the_remaining_batches(kind, stop):
    assert_resumes_exactly(_factories()[kind], epochs=3, per_epoch=10, stop=stop)


def test_state_before_iteration_and_resaving_a_loaded_state():
    a = ad.loader(make_td(), batch_size=10, seed=9)
    s0 = a.state_dict()
    first = epoch_labels(a)  # the state_dict() call did not skip or start an extra epoch
    assert torch.equal(first, epoch_labels(ad.loader(make_td(), batch_size=10, seed=9)))
    b = ad.loader(make_td(), batch_size=10, seed=9)
    b.load_state_dict(s0)
    assert b.state_dict()["root"] == s0["root"]
    assert torch.equal(epoch_labels(b), first)


def test_state_is_plain_data():
    loader = ad.loader(MapDataset(), batch_size=10, num_workers=2, transform=augment())
    it = iter(loader)
    next(it)

    def check(x):
        if isinstance(x, dict):
            for k, v in x.items():
                assert isinstance(k, str)
                check(v)
        else:
            assert x is None or isinstance(x, (int, float, str, bool, torch.Tensor)), type(x)

    state = loader.state_dict()
    check(state)
    assert roundtrip(state) == state


def test_loading_a_state_from_a_different_configuration_is_an_error():
    a = ad.loader(make_td(), batch_size=10)
    b = ad.loader(make_td(), batch_size=8)
    with pytest.raises(ValueError, match="batch_size: saved 10, here 8"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match=r"not an accelfn\.data loader state"):
        b.load_state_dict({"epoch": 1})


def test_augmentation_is_seeded_per_batch_and_differs_by_epoch():
    loader = ad.loader(make_td(), batch_size=10, shuffle=False, transform=augment())
    e0, e1 = list(loader), list(loader)
    again = list(ad.loader(make_td(), batch_size=10, shuffle=False, transform=augment()))
    assert same_batches(e0, again)  # reproducible from the seed
    assert not torch.equal(e0[0]["image"], e1[0]["image"])  # same samples, new augmentation


# --------------------------------------------------------------------------------------------
# Data wait


def test_wait_is_measured_for_a_slow_source():
    loader = ad.loader(MapDataset(12, delay=0.01), batch_size=4, num_workers=0, prefetch=0)
    assert loader.batches == 0 and loader.total_wait_s == 0.0
    waits = []
    for _ in loader:
        waits.append(loader.last_wait_s)
    assert loader.batches == 3
    assert all(w >= 0.035 for w in waits)  # 4 samples x 10 ms each
    assert loader.total_wait_s == pytest.approx(sum(waits))
    assert loader.wait_share > 0.9  # the loop did nothing but wait


def test_wait_share_is_small_when_prefetch_hides_loading():
    loader = ad.loader(MapDataset(40, delay=0.001), batch_size=4, num_workers=2, prefetch=4)
    for _ in loader:
        time.sleep(0.03)  # "compute", longer than loading a batch
    assert loader.batches == 10
    assert loader.total_time_s >= 10 * 0.03
    assert loader.wait_share < 0.3
    loader.reset_timing()
    assert loader.batches == 0 and loader.total_wait_s == 0.0 and loader.wait_share == 0.0


# --------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("how", "exc", "words"),
    [
        ("shape", ValueError, ["sample 7", "'image'", "(3, 4, 5)", "(3, 4, 4)"]),
        ("dtype", TypeError, ["sample 7", "'label'", "torch.float32", "torch.int64"]),
        ("missing", ValueError, ["sample 7", "missing ['label']"]),
        ("type", TypeError, ["sample 7", "'label'", "str"]),
    ],
)
@pytest.mark.parametrize(("workers", "worker_type"), [(0, "thread"), (2, "thread"), (2, "process")])
def test_bad_sample_names_index_and_key(how, exc, words, workers, worker_type):
    loader = ad.loader(
        Broken(how), batch_size=4, shuffle=False, num_workers=workers, worker_type=worker_type
    )
    with pytest.raises(exc) as info:
        list(loader)
    for w in words:
        assert w in str(info.value)


def test_bad_first_sample_is_reported_at_construction():
    with pytest.raises(TypeError, match="sample 0"):
        ad.loader(Broken("type", bad=0), batch_size=4)


@pytest.mark.parametrize(
    "source",
    [[], TensorDict({"x": torch.zeros(0, 2)}, batch_size=[0])],
    ids=["list", "tensordict"],
)
def test_empty_source(source):
    with pytest.raises(ValueError, match="empty"):
        ad.loader(source, batch_size=4)


def test_empty_iterable():
    loader = ad.loader(_Reiterable([]), batch_size=4, shuffle=False)
    with pytest.raises(ValueError, match="yielded 0 samples"):
        list(loader)


def test_one_shot_generator_second_epoch_is_an_error():
    loader = ad.loader(({"x": torch.tensor(i)} for i in range(8)), batch_size=4, shuffle=False)
    assert len(list(loader)) == 2
    with pytest.raises(ValueError, match="one-shot generator"):
        list(loader)


def test_batch_larger_than_dataset():
    with pytest.raises(ValueError, match=r"batch_size=200 .* 103 samples .* drop_last=False"):
        ad.loader(make_td(), batch_size=200)
    with pytest.raises(ValueError, match="shard"):
        ad.loader(make_td(), batch_size=40, rank=0, world_size=3)
    assert [b.batch_size[0] for b in ad.loader(make_td(), batch_size=200, drop_last=False)] == [N]


def test_missing_key_in_tensordict_source():
    with pytest.raises(ValueError, match="'nope' is not in the TensorDict source"):
        ad.loader(make_td(), batch_size=4, keys=["nope"])


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"batch_size": 2.0}, TypeError, "batch_size must be an int"),
        ({"batch_size": 2, "worker_type": "fiber"}, ValueError, "worker_type"),
        ({"batch_size": 2, "prefetch": -1}, ValueError, "prefetch"),
        ({"batch_size": 2, "worker_type": "process"}, ValueError, "map-style"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ad.loader(make_td(), **kwargs)


def test_bad_sources():
    with pytest.raises(TypeError, match="cannot load from int"):
        ad.loader(3, batch_size=2)
    with pytest.raises(ValueError, match="different first dimensions"):
        ad.loader({"x": torch.zeros(3), "y": torch.zeros(4)}, batch_size=2)
    with pytest.raises(ValueError, match="shuffle=False"):
        ad.loader(_Reiterable([1, 2]), batch_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only errors")
def test_cuda_requests_without_cuda():
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        ad.loader(make_td(), batch_size=4, pin_memory=True)
    with pytest.raises(ValueError, match="CUDA is not available"):
        ad.loader(make_td(), batch_size=4, device="cuda")


def test_transform_must_return_a_tensordict():
    loader = ad.loader(make_td(), batch_size=4, transform=lambda b: b["image"])
    with pytest.raises(TypeError, match="must return"):
        next(iter(loader))


@pytest.mark.parametrize("workers", [0, 3])
def test_transform_placement_does_not_change_batches(workers):
    # The loader transforms host batches before the prefetcher (in `workers` threads) and
    # device batches in the loop's thread; the per-batch seeds are the same, so the batches
    # are too.
    td = make_td()
    sampler = ad.IndexBatchSampler(N, 10, seed=4)
    after_prefetch = ad.ApplyTransform(
        tn.Prefetcher(tn.Mapper(sampler, ad.TensorDictGather(td)), prefetch_factor=2),
        augment(),
        seed=4,
    )
    manual = ad.BatchLoader(after_prefetch)
    built = ad.loader(td, batch_size=10, seed=4, transform=augment(), num_workers=workers)
    for _ in range(2):
        assert same_batches(list(manual), list(built))


# --------------------------------------------------------------------------------------------
# Iterable sources across ranks: every rank gets the same number of batches (DDP lockstep)


def _iterable_shards(n, batch_size, world_size, drop_last):
    data = _Reiterable([{"x": torch.tensor(i)} for i in range(n)])
    return [
        [
            b["x"].tolist()
            for b in ad.loader(
                data, batch_size=batch_size, shuffle=False, drop_last=drop_last, rank=r,
                world_size=world_size, prefetch=0,
            )
        ]
        for r in range(world_size)
    ]


def test_iterable_ranks_get_equal_batches_with_drop_last():
    # 10 samples, 3 ranks, batches of 2: one whole round of 6, the 4 left would give rank 0
    # a second batch that ranks 1 and 2 never join.
    assert _iterable_shards(10, 2, 3, True) == [[[0, 3]], [[1, 4]], [[2, 5]]]


def test_iterable_ranks_get_equal_batches_without_drop_last():
    # The last round (6..9) is padded by wrapping around to its start, as
    # DistributedSampler pads the permutation: each rank gets ceil(10 / 3) = 4 samples.
    assert _iterable_shards(10, 2, 3, False) == [
        [[0, 3], [6, 9]], [[1, 4], [7, 6]], [[2, 5], [8, 7]]
    ]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(
    "n, batch_size, world_size",
    [(n, b, w) for n in (1, 5, 7, 12, 13) for b in (1, 2, 3) for w in (1, 2, 3, 4)],
)
def test_iterable_shards_match_map_style_counts(n, batch_size, world_size, drop_last):
    if drop_last and n < batch_size * world_size:
        return  # no whole round: the empty-epoch error (tested elsewhere)
    shards = _iterable_shards(n, batch_size, world_size, drop_last)
    # every rank runs the same steps, with the same batch sizes, as a map-style source has
    sizes = [[len(b) for b in shard] for shard in shards]
    mapped = [
        [
            b["label"].numel()
            for b in ad.loader(
                make_td(n), batch_size=batch_size, shuffle=False, drop_last=drop_last,
                rank=r, world_size=world_size, prefetch=0,
            )
        ]
        for r in range(world_size)
    ]
    assert sizes == mapped
    seen = sorted(i for shard in shards for b in shard for i in b)
    if drop_last:  # each kept sample once; fewer than a round dropped
        kept = (n // (batch_size * world_size)) * batch_size * world_size
        assert seen == list(range(kept))
    else:  # each sample at least once; fewer than world_size padded
        assert set(seen) == set(range(n))
        assert len(seen) == -(-n // world_size) * world_size


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("stop", [1, 2, 3, 4])
def test_iterable_shard_resumes_exactly(drop_last, stop):
    def make():
        return ad.loader(
            _Reiterable([{"x": torch.tensor(i)} for i in range(23)]), batch_size=2,
            shuffle=False, drop_last=drop_last, rank=1, world_size=3,
            transform=lambda b: b.set("noise", torch.rand(b.batch_size[0])),
        )

    assert_resumes_exactly(make, epochs=2, per_epoch=3 if drop_last else 4, stop=stop)
