"""DataLoaderRNG: a loop ported from torch.utils.data.DataLoader keeps its random stream
(issue 17, item 6).

The reference loops use torch.utils.data and plain PyTorch only; the accelfn loop differs only
in its loader. Without the option the dropout masks differ (shown too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import roundtrip
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import accelfn.data as ad
from accelfn import checkpointing as ckpt

N = 50
X = torch.randn(N, 6, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(1))


class Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 32), nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), 0.5, training=self.training))


def train(batches, *, epochs: int = 2):
    """A plain PyTorch loop: SGD with momentum, dropout drawn from the global generator."""
    torch.manual_seed(0)
    model = Dropper()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    make = batches()  # built after the seed, as a script builds its DataLoader
    updates = 0
    for _ in range(epochs):
        for batch in make:
            x, y = batch if isinstance(batch, (list, tuple)) else (batch["x"], batch["y"])
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            updates += 1
    return [p.detach().clone() for p in model.parameters()], updates


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_dropout_loop_is_bitwise_the_dataloaders(drop_last):
    ref, updates = train(lambda: DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True,
                                            drop_last=drop_last))
    assert updates == (12 if drop_last else 14)
    ported, _ = train(lambda: ad.loader({"x": X, "y": Y}, batch_size=8, shuffle=True,
                                        drop_last=drop_last, rng=ad.DataLoaderRNG()))
    assert same(ported, ref)
    # Without the option the loader draws nothing: other batches and other dropout masks.
    own, _ = train(lambda: ad.loader({"x": X, "y": Y}, batch_size=8, shuffle=True,
                                     drop_last=drop_last))
    assert not same(own, ref)


def test_an_unshuffled_loop_differs_only_by_the_base_seed():
    ref, _ = train(lambda: DataLoader(TensorDataset(X, Y), batch_size=8))
    ported, _ = train(lambda: ad.loader({"x": X, "y": Y}, batch_size=8, shuffle=False,
                                        drop_last=False, rng=ad.DataLoaderRNG()))
    assert same(ported, ref)
    own, _ = train(lambda: ad.loader({"x": X, "y": Y}, batch_size=8, shuffle=False,
                                     drop_last=False))
    assert not same(own, ref)  # same batches, but the masks shifted by one draw per epoch


def test_a_map_style_dataset_with_workers_gives_the_same_loop():
    ref, _ = train(lambda: DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True))
    ported, _ = train(lambda: ad.loader(TensorDataset(X, Y), batch_size=8, shuffle=True,
                                        drop_last=False, keys=("x", "y"), num_workers=2,
                                        rng=ad.DataLoaderRNG()))
    assert same(ported, ref)


def epochs_of(loader, n=3):
    out = []
    for _ in range(n):
        out += [b[1] if isinstance(b, (list, tuple)) else b["y"] for b in loader]
        out.append(torch.rand(3))  # what the loop draws between epochs
    return out


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_given_generator_is_drawn_from_as_the_dataloader_does(shuffle):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    ref = epochs_of(DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=shuffle,
                               generator=g))
    torch.manual_seed(0)
    g2 = torch.Generator().manual_seed(5)
    got = epochs_of(ad.loader({"x": X, "y": Y}, batch_size=8, shuffle=shuffle,
                              drop_last=False, rng=ad.DataLoaderRNG(generator=g2)))
    assert same(got, ref)
    assert torch.equal(g.get_state(), g2.get_state())


def test_persistent_workers_draw_the_base_seed_once():
    torch.manual_seed(0)
    ref = epochs_of(DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True, num_workers=1,
                               persistent_workers=True, multiprocessing_context="fork"))
    torch.manual_seed(0)
    rng = ad.DataLoaderRNG(persistent_workers=True)
    got = epochs_of(ad.loader({"x": X, "y": Y}, batch_size=8, drop_last=False, rng=rng))
    assert same(got, ref)
    torch.manual_seed(0)  # and drawing it every epoch would not match
    other = epochs_of(ad.loader({"x": X, "y": Y}, batch_size=8, drop_last=False,
                                rng=ad.DataLoaderRNG()))
    assert not same(other, ref)


class Stream(IterableDataset):
    def __iter__(self):
        yield from zip(X, Y)


def test_an_iterable_dataset_draws_the_base_seed_per_epoch():
    torch.manual_seed(0)
    ref = epochs_of(DataLoader(Stream(), batch_size=8))
    torch.manual_seed(0)
    got = epochs_of(ad.loader(Stream(), batch_size=8, shuffle=False, drop_last=False,
                              keys=("x", "y"), rng=ad.DataLoaderRNG()))
    assert same(got, ref)


@pytest.mark.parametrize("drop_last", [False, True])
def test_sharded_order_is_distributed_samplers(drop_last):
    for rank in range(3):
        sampler = DistributedSampler(TensorDataset(X, Y), num_replicas=3, rank=rank,
                                     shuffle=True, seed=4, drop_last=drop_last)
        dl = DataLoader(TensorDataset(X, Y), batch_size=4, sampler=sampler,
                        drop_last=drop_last)
        ref = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            ref += [y for _, y in dl]
        loader = ad.loader({"x": X, "y": Y}, batch_size=4, seed=4, drop_last=drop_last,
                           rank=rank, world_size=3, rng=ad.DataLoaderRNG())
        got = [b["y"] for _ in range(2) for b in loader]
        assert same(got, ref), rank


@pytest.mark.parametrize("generator", [False, True])
@pytest.mark.parametrize("stop", [3, 7])  # mid-epoch, and after an epoch's last batch
def test_resume_continues_the_batches_and_the_random_stream(generator, stop):
    def make(seed):
        g = torch.Generator().manual_seed(seed) if generator else None
        return ad.loader({"x": X, "y": Y}, batch_size=8, drop_last=False,
                         rng=ad.DataLoaderRNG(generator=g)), g

    torch.manual_seed(0)
    loader, g = make(5)
    it = iter(loader)
    head = [next(it)["y"] for _ in range(stop)]
    position, rng = roundtrip(loader.state_dict()), torch.get_rng_state()
    tail = [b["y"] for b in it] + [torch.rand(3)] + epochs_of(loader, 2)
    assert len(head) + len(tail) == 7 + 1 + 16

    torch.manual_seed(1)
    resumed, g2 = make(9)  # another process: another generator state
    resumed.load_state_dict(position)
    torch.set_rng_state(rng)
    # The rest of the saved epoch: after its last batch the first iter() yields nothing, as
    # the uninterrupted loop's `for b in it` did.
    again = [b["y"] for b in resumed]
    assert len(again) == 7 - stop
    again += [torch.rand(3), *epochs_of(resumed, 2)]
    assert same(again, tail)
    if generator:
        assert torch.equal(g.get_state(), g2.get_state())


def test_a_position_read_before_the_first_batch_draws_nothing_and_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    loader = ad.loader({"x": X, "y": Y}, batch_size=8, rng=ad.DataLoaderRNG(generator=g))
    before, before_g = torch.get_rng_state(), g.get_state()
    position = roundtrip(loader.state_dict())
    assert torch.equal(torch.get_rng_state(), before) and torch.equal(g.get_state(), before_g)
    ref = epochs_of(loader, 2)

    torch.set_rng_state(before)
    g2 = torch.Generator().manual_seed(9)
    resumed = ad.loader({"x": X, "y": Y}, batch_size=8, rng=ad.DataLoaderRNG(generator=g2))
    resumed.load_state_dict(position)
    assert same(epochs_of(resumed, 2), ref)
    assert torch.equal(g.get_state(), g2.get_state())


def test_resume_through_checkpointing_keeps_the_dropout_masks(tmp_path):
    import accelfn as af

    def build(seed):
        torch.manual_seed(seed)
        model = Dropper()
        state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = ad.loader({"x": X, "y": Y}, batch_size=8, drop_last=False,
                           rng=ad.DataLoaderRNG())
        return state, loader, af.lift(lambda m, b: F.cross_entropy(m(b["x"]), b["y"]))

    state, loader, step = build(0)
    it = iter(loader)
    for _ in range(3):
        step(state, next(it))
    path = ckpt.save(tmp_path, state, loader=loader, step=step)
    for batch in it:
        step(state, batch)
    for batch in loader:
        step(state, batch)
    ref = [p.detach().clone() for p in state.model.parameters()]

    state, loader, step = build(1)
    ckpt.load(path, state, loader=loader, step=step)
    for _ in range(2):
        for batch in loader:
            step(state, batch)
    assert same([p.detach() for p in state.model.parameters()], ref)


def test_a_position_without_the_draws_is_refused():
    plain = ad.loader({"x": X, "y": Y}, batch_size=8)
    next(iter(plain))
    ported = ad.loader({"x": X, "y": Y}, batch_size=8, rng=ad.DataLoaderRNG())
    with pytest.raises(ValueError, match="rng: saved None, here 'dataloader'"):
        ported.load_state_dict(plain.state_dict())
    it = iter(ported)
    next(it)
    forged = ported.state_dict()
    sampler = forged["root"]["snapshot"]["it_state"]["source"]
    sampler["rng"]["draw"] = "seven"
    again = ad.loader({"x": X, "y": Y}, batch_size=8, rng=ad.DataLoaderRNG())
    again.load_state_dict(forged)
    with pytest.raises(ValueError, match="lacks the DataLoaderRNG draws"):
        iter(again)


def test_bad_options_are_refused():
    with pytest.raises(TypeError, match="DataLoaderRNG"):
        ad.loader({"x": X}, batch_size=8, rng="dataloader")
    with pytest.raises(TypeError, match=r"CPU torch\.Generator"):
        ad.DataLoaderRNG(generator=3)
