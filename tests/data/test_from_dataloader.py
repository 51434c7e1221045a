"""from_dataloader: an existing DataLoader feeding an accelfn step (issue 14, item 1).

Batches are named, moved, timed and (with torchdata's StatefulDataLoader) checkpointed; the
reference is always the same DataLoader iterated by hand.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import roundtrip, torchrun_results
from tensordict import TensorDict
from torch import nn
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
    WeightedRandomSampler,
)

import accelfn as af
import accelfn.data as ad
from accelfn import checkpointing as ckpt

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

# StatefulDataLoader's constructor warns about a deprecated torch call it makes.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

X = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(1))


def pairs() -> TensorDataset:
    return TensorDataset(X, Y)


class Records(Dataset):
    """Dict samples with a non-tensor field, as many real datasets return."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"x": X[i], "y": Y[i], "name": f"file{i}.png"}


class Slow(Dataset):
    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return X[i], Y[i]


# ------------------------------------------------------------------------------ batches
def test_tuple_batches_are_named_by_keys_and_match_the_dataloader():
    dl = DataLoader(pairs(), batch_size=8)
    got = list(ad.from_dataloader(dl, keys=("x", "y")))
    ref = list(dl)
    assert len(got) == len(ref) == 5
    for batch, (x, y) in zip(got, ref):
        assert isinstance(batch, TensorDict) and batch.batch_size == torch.Size([8])
        assert torch.equal(batch["x"], x) and torch.equal(batch["y"], y)


def test_pairs_get_default_names_and_dict_batches_need_no_keys():
    first = next(iter(ad.from_dataloader(DataLoader(pairs(), batch_size=4))))
    assert sorted(first.keys()) == ["image", "label"]
    records = next(iter(ad.from_dataloader(DataLoader(Records(), batch_size=4))))
    assert sorted(records.keys()) == ["name", "x", "y"]
    assert torch.equal(records["x"], X[:4])
    assert records["name"] == [f"file{i}.png" for i in range(4)]  # kept as non-tensor data
    chosen = next(iter(ad.from_dataloader(DataLoader(Records(), batch_size=4), keys=["y"])))
    assert list(chosen.keys()) == ["y"]


def test_tensordict_and_single_tensor_batches():
    td = TensorDict({"x": X[:4], "y": Y[:4]}, batch_size=[4])
    assert ad.batch_to_tensordict(td) is td
    assert list(ad.batch_to_tensordict(td, ["x"]).keys()) == ["x"]
    single = ad.batch_to_tensordict(X[:5], keys=("x",))
    assert torch.equal(single["x"], X[:5]) and single.batch_size == torch.Size([5])


@pytest.mark.parametrize(
    ("batch", "keys", "error", "match"),
    [
        ((X[:2], Y[:2], Y[:2]), None, ValueError, r"keys=\('x0', 'x1', 'x2'\)"),
        ((X[:2], Y[:2]), ("a", "b", "c"), ValueError, "names 3 fields"),
        (X[:2], None, ValueError, "one key"),
        ({"x": X[:2]}, ("y",), ValueError, "no key"),
        ("text", None, TypeError, "collate_fn"),
        ({"x": X[:2], "y": Y[:3]}, None, ValueError, "disagree on the number of samples"),
        ((X[:2], (Y[:2], Y[:2])), None, TypeError, "flatten it"),
        ({"n": [1, 2]}, None, ValueError, "no tensor"),
    ],
)
def test_a_batch_that_cannot_be_named_says_how_to_fix_it(batch, keys, error, match):
    with pytest.raises(error, match=match):
        ad.batch_to_tensordict(batch, keys)


def test_bad_arguments_are_refused_when_building():
    with pytest.raises(TypeError, match=r"accelfn\.data\.loader"):
        ad.from_dataloader(ad.loader({"x": X}, batch_size=4))
    with pytest.raises(TypeError, match="sequence of strings"):
        ad.from_dataloader(DataLoader(pairs()), keys="xy")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            ad.from_dataloader(DataLoader(pairs()), device="cuda")
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            ad.from_dataloader(DataLoader(pairs()), pin_memory=True)


def test_batches_go_to_the_device_and_are_pinned_only_for_cuda():
    train = ad.from_dataloader(DataLoader(pairs(), batch_size=8), keys=("x", "y"), device="cpu")
    for batch in train:
        assert batch.device == torch.device("cpu")
        assert not batch["x"].is_pinned()  # nothing to pin for: batches stay on the host
    assert len(train) == 5 and train.batches == 5


def pin_calls(monkeypatch) -> list[int]:
    """Count TensorDict.pin_memory calls (the real method runs when CUDA is there)."""
    calls: list[int] = []
    real = TensorDict.pin_memory

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs) if torch.cuda.is_available() else self

    monkeypatch.setattr(TensorDict, "pin_memory", spy)
    return calls


def test_unpinned_batches_are_staged_in_pinned_memory_and_pinned_ones_are_not(monkeypatch):
    from accelfn.data import adapter

    calls = pin_calls(monkeypatch)
    dl = DataLoader(pairs(), batch_size=8)
    node = adapter._DataLoaderNode(dl, ("x", "y"), pin=True, stateful=False)
    node.reset()
    next(node)
    next(node)
    assert len(calls) == 2  # one page-locked copy per batch
    monkeypatch.setattr(adapter, "_all_pinned", lambda batch: True)  # e.g. pin_memory=True
    next(node)
    assert len(calls) == 2  # the DataLoader's pinned batch is copied as it is
    unpinned = adapter._DataLoaderNode(dl, ("x", "y"), pin=False, stateful=False)
    unpinned.reset()
    next(unpinned)
    assert len(calls) == 2


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_batches_are_copied_from_pinned_staging_memory(monkeypatch):
    calls = pin_calls(monkeypatch)
    train = ad.from_dataloader(DataLoader(pairs(), batch_size=8), keys=("x", "y"),
                               device="cuda")
    got = [b for b in train]
    assert len(calls) == 5
    for batch, (x, y) in zip(got, DataLoader(pairs(), batch_size=8), strict=True):
        assert batch.device.type == "cuda" and batch["x"].is_cuda
        assert torch.equal(batch["x"].cpu(), x) and torch.equal(batch["y"].cpu(), y)


@cuda
def test_a_pinning_dataloader_with_workers_is_copied_ahead_on_a_side_stream(monkeypatch):
    calls = pin_calls(monkeypatch)
    dl = DataLoader(pairs(), batch_size=8, pin_memory=True, num_workers=2)
    train = ad.from_dataloader(dl, keys=("x", "y"), device="cuda")
    assert train.root.lookahead == 1  # the next batch's copy overlaps this one's use
    got = [b["x"].cpu() for b in train]
    assert calls == []  # pinned by the DataLoader's own pin thread, not again
    assert all(torch.equal(a, x) for a, (x, _) in zip(got, dl, strict=True))
    train.close()


@cuda
def test_a_cuda_step_fed_by_the_adapter_equals_the_step_fed_by_hand():
    def run(feed):
        torch.manual_seed(0)
        model = Dropper().cuda()
        state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        step = af.lift(loss_fn)
        torch.manual_seed(7)
        for batch in feed():
            step(state, batch)
        return [p.detach().cpu() for p in model.parameters()]

    def by_hand():
        for x, y in DataLoader(pairs(), batch_size=8, shuffle=True):
            yield TensorDict({"x": x, "y": y}, batch_size=[len(x)]).to("cuda")

    adapted = run(lambda: ad.from_dataloader(
        DataLoader(pairs(), batch_size=8, shuffle=True), keys=("x", "y"), device="cuda"))
    assert all(torch.equal(p, q) for p, q in zip(adapted, run(by_hand)))


# ------------------------------------------------------------------------------ epochs, close
def test_each_iter_is_one_epoch_also_after_a_break():
    torch.manual_seed(3)
    dl = DataLoader(pairs(), batch_size=8, shuffle=True)
    train = ad.from_dataloader(dl, keys=("x", "y"))
    first = next(iter(train))
    second = [b["y"] for b in train]
    torch.manual_seed(3)
    ref = DataLoader(pairs(), batch_size=8, shuffle=True)
    assert torch.equal(first["y"], next(iter(ref))[1])
    assert all(torch.equal(a, b) for a, (_, b) in zip(second, ref, strict=True))


def test_close_ends_the_dataloader_workers():
    before = set(multiprocessing.active_children())
    dl = DataLoader(pairs(), batch_size=4, num_workers=2)
    train = ad.from_dataloader(dl, keys=("x", "y"))
    it = iter(train)
    next(it)
    workers = set(multiprocessing.active_children()) - before
    assert len(workers) == 2
    train.close()
    deadline = time.monotonic() + 10
    while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(w.is_alive() for w in workers)
    assert len(list(train)) == 10  # iterating again starts a new epoch (and new workers)
    train.close()


# ------------------------------------------------------------------------------ data wait
def test_data_wait_is_reported_like_accelfn_loaders():
    train = ad.from_dataloader(DataLoader(Slow(0.01), batch_size=4), keys=("x", "y"))
    assert train.batches == 0 and train.total_wait_s == 0.0 and train.wait_share == 0.0
    waits = []
    for _ in train:
        waits.append(train.last_wait_s)
    assert train.batches == 3
    assert all(w >= 0.035 for w in waits)  # 4 samples x 10 ms, in the loop's next()
    assert train.total_wait_s == pytest.approx(sum(waits))
    assert train.wait_share > 0.9  # the loop did nothing but wait
    train.reset_timing()
    assert train.batches == 0 and train.total_wait_s == 0.0


def test_the_monitor_reads_its_data_wait():
    train = ad.from_dataloader(DataLoader(Slow(0.005), batch_size=4), keys=("x", "y"))
    mon = af.Monitor(progress=False, warmup=0, sync_check=None, log_every=100)
    with mon:
        for _ in range(2):
            for _ in train:
                time.sleep(0.02)  # the "step"
                mon.step({"loss": torch.zeros(())}, samples=4, data_wait=train.last_wait_s)
    report = mon.report()
    assert report.data_wait_share == pytest.approx(train.wait_share, abs=0.1)
    assert 0.3 < report.data_wait_share < 0.8  # 20 ms per batch against 20 ms of "step"


# ------------------------------------------------------------------------------ training
class Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), 0.3, training=self.training))


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = Dropper()
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return state, af.with_clipping(max_norm=1.0)(loss_fn)


def test_a_step_refuses_the_dataloaders_tuples_and_takes_the_adapters_batches():
    state, step = build()
    dl = DataLoader(pairs(), batch_size=8)
    with pytest.raises(TypeError, match="a batch must be a TensorDict or a mapping of tensors, "
                                        "got list"):
        step(state, next(iter(dl)))  # the issue: a stock DataLoader cannot feed a step
    assert state.step == 0
    metrics = step(state, next(iter(ad.from_dataloader(dl, keys=("x", "y")))))
    assert state.step == 1 and torch.isfinite(metrics["loss"])


def test_a_step_fed_by_the_adapter_equals_the_step_fed_by_hand():
    state, step = build()
    torch.manual_seed(7)
    dl = DataLoader(pairs(), batch_size=8, shuffle=True)
    by_hand = []
    for _ in range(2):
        for x, y in dl:
            batch = TensorDict({"x": x, "y": y}, batch_size=[len(x)])
            by_hand.append(step(state, batch)["loss"].clone())
    ref = [p.detach().clone() for p in state.model.parameters()]

    state, step = build()
    torch.manual_seed(7)
    train = ad.from_dataloader(DataLoader(pairs(), batch_size=8, shuffle=True), keys=("x", "y"))
    fed = [step(state, batch)["loss"].clone() for _ in range(2) for batch in train]
    assert torch.equal(torch.stack(fed), torch.stack(by_hand))
    for p, q in zip(state.model.parameters(), ref):
        assert torch.equal(p, q)  # same batches and the same dropout masks, bitwise


# ------------------------------------------------------------------------------ resume
def stateful(num_workers: int = 0) -> StatefulDataLoader:
    return StatefulDataLoader(pairs(), batch_size=8, shuffle=True, num_workers=num_workers)


def train_steps(state, step, it, n):
    return [step(state, next(it))["loss"].clone() for _ in range(n)]


@pytest.mark.parametrize("stop", [2, 5])  # mid-epoch, and right after an epoch's last batch
def test_stateful_dataloader_resumes_exactly_through_checkpointing(tmp_path, stop):
    state, step = build()
    train = ad.from_dataloader(stateful(), keys=("x", "y"))
    it = iter(train)
    losses = train_steps(state, step, it, stop)
    path = ckpt.save(tmp_path, state, loader=train, step=step)
    losses += [step(state, b)["loss"].clone() for b in it]  # the rest of the epoch
    losses += [step(state, b)["loss"].clone() for b in train]  # and one more
    ref = [p.detach().clone() for p in state.model.parameters()]

    resumed, resumed_step = build(seed=1)  # another process: other weights, other RNG
    again = ad.from_dataloader(stateful(), keys=("x", "y"))
    ckpt.load(path, resumed, loader=again, step=resumed_step)
    # the rest of the saved epoch (none after its last batch), then the next one
    rest = [resumed_step(resumed, b)["loss"].clone() for b in again]
    rest += [resumed_step(resumed, b)["loss"].clone() for b in again]
    assert torch.equal(torch.stack(losses[stop:]), torch.stack(rest))
    for p, q in zip(resumed.model.parameters(), ref):
        assert torch.equal(p, q)  # same remaining batches and the same dropout masks


def test_stateful_dataloader_with_workers_resumes_through_state_dict():
    torch.manual_seed(0)
    train = ad.from_dataloader(stateful(num_workers=2), keys=("x", "y"))
    it = iter(train)
    seen = [next(it)["y"] for _ in range(2)]
    position, rng = train.state_dict(), torch.get_rng_state()
    rest = [b["y"] for b in it]
    train.close()
    assert len(seen + rest) == 5

    torch.manual_seed(5)
    again = ad.from_dataloader(stateful(num_workers=2), keys=("x", "y"))
    again.load_state_dict(roundtrip(position))
    torch.set_rng_state(rng)
    resumed = [b["y"] for b in again]
    again.close()
    assert len(resumed) == 3 and all(torch.equal(a, b) for a, b in zip(resumed, rest))


def test_a_position_taken_before_iterating_draws_nothing_and_resumes_exactly(tmp_path):
    state, step = build()
    train = ad.from_dataloader(stateful(), keys=("x", "y"))
    before = torch.get_rng_state()
    path = ckpt.save(tmp_path, state, loader=train, step=step)  # at step 0
    assert torch.equal(torch.get_rng_state(), before)  # reading the position drew nothing
    losses = [step(state, b)["loss"].clone() for _ in range(2) for b in train]
    ref = [p.detach().clone() for p in state.model.parameters()]

    resumed, resumed_step = build(seed=1)
    again = ad.from_dataloader(stateful(), keys=("x", "y"))
    ckpt.load(path, resumed, loader=again, step=resumed_step)
    rest = [resumed_step(resumed, b)["loss"].clone() for _ in range(2) for b in again]
    assert torch.equal(torch.stack(losses), torch.stack(rest))
    for p, q in zip(resumed.model.parameters(), ref):
        assert torch.equal(p, q)


def test_a_position_from_another_configuration_is_refused():
    train = ad.from_dataloader(stateful(), keys=("x", "y"))
    next(iter(train))
    other = ad.from_dataloader(stateful(), keys=("image", "label"))
    with pytest.raises(ValueError, match="keys: saved"):
        other.load_state_dict(train.state_dict())


def test_a_plain_dataloader_has_no_position_and_says_what_to_do(tmp_path):
    state, step = build()
    train = ad.from_dataloader(DataLoader(pairs(), batch_size=8, shuffle=True), keys=("x", "y"))
    it = iter(train)
    train_steps(state, step, it, 2)
    with pytest.raises(TypeError, match="StatefulDataLoader") as raised:
        train.state_dict()
    assert "re-iterates the epoch from its start" in str(raised.value)
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        train.load_state_dict({"format": "accelfn.data.loader/1", "config": {}, "root": None})
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        ckpt.save(tmp_path, state, loader=train, step=step)
    # Without loader=, a resumed run starts the epoch over: all its batches come again.
    path = ckpt.save(tmp_path, state, step=step)
    resumed, resumed_step = build(seed=1)
    ckpt.load(path, resumed, step=resumed_step)
    assert len(list(train)) == 5


# ------------------------------------------------------------------------------ sharding
HERE = os.path.dirname(os.path.abspath(__file__))


def distributed_sampler_loop(n: int, rank: int, *, shuffle: bool = True, seed: int = 0,
                             epochs: int = 3, world: int = 2) -> list[list[int]]:
    """The samples rank ``rank`` reads in each epoch of a hand-written DDP loop."""
    dataset = TensorDataset(torch.arange(n), 10 * torch.arange(n))
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle,
                                 seed=seed)
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    read = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        read.append(torch.cat([x for x, _ in loader]).tolist())
    return read


def numbered(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n), 10 * torch.arange(n))


def read_epochs(train, epochs: int = 3) -> list[list[int]]:
    return [torch.cat([b["x"] for b in train]).tolist() for _ in range(epochs)]


@pytest.fixture
def rank_one_of_two(monkeypatch):
    """torchrun's environment of rank 1 of 2, before its process group is set up."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("from_dataloader_sharded")
    return torchrun_results(os.path.join(HERE, "from_dataloader_worker.py"), out, timeout=300)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["early", "shuffled", "seeded", "sequential", "uneven"])
def test_under_torchrun_each_process_reads_what_a_distributed_sampler_gives_it(sharded, case):
    n = 23 if case == "uneven" else 24
    options = {"shuffle": case != "sequential", "seed": 3 if case == "seeded" else 0}
    for rank in range(2):
        assert sharded[rank][case] == distributed_sampler_loop(n, rank, **options)
    for epoch in range(3):
        shares = [set(sharded[rank][case][epoch]) for rank in range(2)]
        assert shares[0] | shares[1] == set(range(n))  # every sample, every epoch
        if n % 2 == 0:
            assert not shares[0] & shares[1]  # no sample on both processes
            assert len(sharded[0][case][epoch]) == n // 2
    if case != "sequential":  # the shuffle changes with the epoch set on the sampler
        assert sharded[0][case][0] != sharded[0][case][1]


@pytest.mark.distributed
def test_under_torchrun_shard_false_reads_everything_on_every_process(sharded):
    assert sharded[0]["unsharded"] == sharded[1]["unsharded"] == [list(range(24))]


@pytest.mark.distributed
def test_under_torchrun_a_sharded_position_resumes_exactly(sharded):
    for rank in range(2):
        got = sharded[rank]["resume"]
        ref = distributed_sampler_loop(22, rank, epochs=3)
        assert got["first"] == ref[0]
        assert got["head"] + got["tail"] == ref[1]
        assert got["resumed"] == got["tail"]  # the rest of the epoch, with its shuffle
        assert got["following"] == got["resumed_following"] == ref[2]


@pytest.mark.distributed
def test_ddp_fed_by_a_sharded_dataloader_trains_as_one_process_on_both_shares(sharded):
    """Each update: one process on the two processes' batches together, plain PyTorch."""
    from from_dataloader_worker import regression

    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    shares = [distributed_sampler_loop(24, rank, epochs=2) for rank in range(2)]
    for epoch in range(2):
        for start in range(0, 12, 4):
            index = torch.tensor(shares[0][epoch][start:start + 4]
                                 + shares[1][epoch][start:start + 4])
            optimizer.zero_grad(set_to_none=True)
            regression(model, {"x": index, "y": 10 * index}).backward()
            optimizer.step()
    for rank in range(2):
        for name, value in model.named_parameters():
            torch.testing.assert_close(sharded[rank]["trained"][name], value.detach(),
                                       atol=1e-6, rtol=1e-5)


def test_the_environments_rank_shards_before_the_process_group_exists(rank_one_of_two):
    train = ad.from_dataloader(DataLoader(numbered(10), batch_size=4, shuffle=True),
                               keys=("x", "y"))
    assert read_epochs(train) == distributed_sampler_loop(10, 1)
    assert isinstance(train.dataloader.sampler, DistributedSampler)
    assert train.dataloader.batch_size == 4  # the batch stays the per-process batch


def test_a_dataloader_wrapped_again_each_epoch_gets_each_epochs_shuffle(rank_one_of_two):
    """``for batch in from_dataloader(dl)`` inside the epoch loop, as many loops write it."""
    dl = DataLoader(numbered(10), batch_size=4, shuffle=True)
    read = [torch.cat([b["x"] for b in ad.from_dataloader(dl, keys=("x", "y"))]).tolist()
            for _ in range(3)]
    assert read == distributed_sampler_loop(10, 1)
    assert read[0] != read[1]


def test_one_process_leaves_the_dataloader_as_it_is():
    dl = DataLoader(numbered(10), batch_size=4, shuffle=True)
    assert ad.from_dataloader(dl, keys=("x", "y")).dataloader is dl


def test_a_stateful_dataloader_keeps_its_kind_and_arguments_when_sharded(rank_one_of_two):
    dl = StatefulDataLoader(numbered(10), batch_size=3, shuffle=True, drop_last=True,
                            snapshot_every_n_steps=2)
    train = ad.from_dataloader(dl, keys=("x", "y"))
    rebuilt = train.dataloader
    assert type(rebuilt) is StatefulDataLoader and rebuilt is not dl
    assert (rebuilt.batch_size, rebuilt.drop_last, rebuilt.snapshot_every_n_steps) == (3, True, 2)
    assert isinstance(rebuilt.sampler, DistributedSampler) and rebuilt.sampler.rank == 1
    assert len(train) == 1  # 5 samples of this process' share, batches of 3, the last dropped


def test_a_dataloader_with_its_own_distributed_sampler_is_used_as_it_is(rank_one_of_two):
    dataset = numbered(10)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True)
    sampler.set_epoch(4)  # the user's own epochs, as in a plain loop
    dl = DataLoader(dataset, batch_size=4, sampler=sampler)
    train = ad.from_dataloader(dl, keys=("x", "y"))
    assert train.dataloader is dl
    list(train)
    list(train)
    assert sampler.epoch == 4
    other = DataLoader(dataset, batch_size=4,
                       sampler=DistributedSampler(dataset, num_replicas=4, rank=1))
    with pytest.raises(ValueError, match="num_replicas=4 but 2 processes"):
        ad.from_dataloader(other)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(zip(X, Y))


class Custom(DataLoader):
    pass


@pytest.mark.parametrize(("loader", "match"), [
    (lambda: DataLoader(Stream(), batch_size=4), "IterableDataset"),
    (lambda: DataLoader(pairs(), batch_size=4,
                        sampler=WeightedRandomSampler([1.0] * 40, 40)),
     "WeightedRandomSampler"),
    (lambda: DataLoader(pairs(), batch_sampler=[[0, 1], [2, 3]]), "batch_sampler list"),
    (lambda: DataLoader(pairs(), batch_size=None), "batch_size=None"),
    (lambda: Custom(pairs()), "Custom"),
    (lambda: [(X[:4], Y[:4])], "list"),
])
def test_what_cannot_be_sharded_is_refused_with_how_to_shard_it(rank_one_of_two, loader,
                                                               match):
    with pytest.raises(TypeError, match=match) as raised:
        ad.from_dataloader(loader())
    assert "shard=False" in str(raised.value)
    ad.from_dataloader(loader(), shard=False)  # taken as it is when asked


def test_a_rank_missing_from_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        ad.from_dataloader(DataLoader(pairs(), batch_size=4))
    with pytest.raises(TypeError, match="shard="):
        ad.from_dataloader(DataLoader(pairs(), batch_size=4), shard=1)
    with pytest.raises(TypeError, match="seed="):
        ad.from_dataloader(DataLoader(pairs(), batch_size=4), seed=1.5)


def test_a_sharded_position_resumes_only_as_the_same_share(rank_one_of_two, monkeypatch):
    train = ad.from_dataloader(stateful(), keys=("x", "y"))
    next(iter(train))
    position = train.state_dict()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="shard: saved"):
        ad.from_dataloader(stateful(), keys=("x", "y")).load_state_dict(position)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="shard: saved"):
        ad.from_dataloader(stateful(), keys=("x", "y")).load_state_dict(position)


def test_epochs_are_counted_through_a_position_taken_before_iterating(rank_one_of_two):
    train = ad.from_dataloader(StatefulDataLoader(numbered(10), batch_size=4, shuffle=True),
                               keys=("x", "y"))
    list(train)
    position = train.state_dict()  # right after epoch 0's end reached the loop
    again = ad.from_dataloader(StatefulDataLoader(numbered(10), batch_size=4, shuffle=True),
                               keys=("x", "y"))
    again.load_state_dict(position)
    assert read_epochs(again, 2) == distributed_sampler_loop(10, 1)[1:]


def test_a_loader_built_before_the_process_group_shards_by_torchruns_environment(monkeypatch):
    """accelfn.data.loader() given no rank: torchrun's RANK and WORLD_SIZE when the process
    group is not up yet (a loader built before the first step)."""
    from tensordict import TensorDict

    from accelfn import data as ad

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = ad.loader(TensorDict(x=torch.arange(10), batch_size=[10]), batch_size=2,
                       shuffle=False)
    assert [b["x"].tolist() for b in loader] == [[1, 3], [5, 7]]
