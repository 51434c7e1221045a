"""accelfn.data.loader at its edges: positions across pipeline settings, options that do not
apply to a source, malformed arguments, and epochs started without a batch."""

from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

import accelfn.data as ad

N = 30


def make_td() -> TensorDict:
    return TensorDict({"x": torch.arange(N) * 10, "label": torch.arange(N)}, batch_size=[N])


def samples() -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.tensor(i * 10), "label": torch.tensor(i)} for i in range(N)]


def noise(batch, generator=None):
    """A batch transform with a per-sample random draw (seeded per batch by the loader)."""
    return batch.set("noise", torch.rand(batch.batch_size, generator=generator))


def labels(batches) -> list[list[int]]:
    return [b["label"].tolist() for b in batches]


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x.keys())
        for x, y in zip(a, b)
    )


# --------------------------------------------------------------------------------------------
# A position resumes whatever prefetch, pin_memory, device and the transform's placement:
# the batches do not depend on them (a checkpoint taken on a GPU machine resumes on a CPU one)


SETTINGS = [
    {"prefetch": 2},
    {"prefetch": 0},
    {"prefetch": 3, "device": "cpu"},
    {"prefetch": 0, "device": "cpu"},
]


@pytest.mark.parametrize("source", ["tensordict", "map", "iterable"])
@pytest.mark.parametrize("transform", [None, noise])
@pytest.mark.parametrize(("saved", "resumed"), [(0, 1), (1, 0), (2, 3), (3, 2), (0, 3)])
def test_a_position_resumes_with_other_prefetch_and_device_settings(source, transform, saved,
                                                                     resumed):
    def make(settings):
        data = {"tensordict": make_td(), "map": samples(), "iterable": samples()}[source]
        return ad.loader(data, batch_size=4, seed=5, shuffle=source != "iterable",
                         transform=transform, num_workers=0 if source == "map" else None,
                         **settings)

    with make(SETTINGS[saved]) as ref:
        full = list(ref) + list(ref)  # two epochs, uninterrupted (7 batches each)
    with make(SETTINGS[saved]) as first:
        it = iter(first)
        head = [next(it) for _ in range(3)]
        state = first.state_dict()
    assert same(head, full[:3])
    with make(SETTINGS[resumed]) as second:
        second.load_state_dict(state)
        rest = list(second) + list(second)
    assert same(rest, full[3:3 + 11])


def test_a_dataloader_adapters_position_resumes_with_another_device_setting():
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = torch.utils.data.TensorDataset(torch.arange(N))

    def make(device):
        dl = StatefulDataLoader(dataset, batch_size=4,
                                generator=torch.Generator().manual_seed(1), shuffle=True)
        return ad.from_dataloader(dl, keys=("x",), device=device)

    ref = make(None)
    full = [b["x"].tolist() for b in ref]
    first = make("cpu")
    it = iter(first)
    head = [next(it)["x"].tolist() for _ in range(3)]
    state = first.state_dict()
    assert head == full[:3]
    second = make(None)
    second.load_state_dict(state)
    assert [b["x"].tolist() for b in second] == full[3:]


def test_a_malformed_position_is_refused_when_loaded_and_the_loader_keeps_its_place():
    with ad.loader(make_td(), batch_size=4, seed=5) as train:
        ref = ad.loader(make_td(), batch_size=4, seed=5)
        good = ref.state_dict()
        ref.close()
        expected = labels(list(ad.loader(make_td(), batch_size=4, seed=5)))
        bad = dict(good, root={"it_state": {"source": {"epoch": 0, "batches": 99}}})
        with pytest.raises(ValueError, match="out of range"):
            train.load_state_dict(bad)
        nonsense = dict(good, root={"what": 1})
        with pytest.raises(ValueError, match="position"):
            train.load_state_dict(nonsense)
        assert labels(train) == expected  # the first epoch, as if nothing had been loaded


# --------------------------------------------------------------------------------------------
# Options a TensorDict source cannot apply are refused, not ignored


@pytest.mark.parametrize("source", [make_td, lambda: {"x": torch.arange(N)}])
def test_per_sample_options_on_a_tensordict_source_are_refused(source):
    with pytest.raises(ValueError, match=r"sample_transform.*TensorDict.*transform="):
        ad.loader(source(), batch_size=4, sample_transform=lambda s: s)
    with pytest.raises(ValueError, match=r"ragged_keys.*TensorDict"):
        ad.loader(source(), batch_size=4, ragged_keys=["x"])


def test_preloading_a_tensordict_with_a_sample_transform_is_refused(tmp_path):
    # it wrote the untransformed rows and recorded the transform as applied
    with pytest.raises(ValueError, match="sample_transform"):
        ad.preload(make_td(), tmp_path / "p", sample_transform=lambda s: s)
    assert not (tmp_path / "p" / "accelfn_preload.json").exists()


# --------------------------------------------------------------------------------------------
# Malformed arguments are refused when the loader is built, saying what to pass


def test_bool_rank_and_world_size_are_refused():
    with pytest.raises(TypeError, match="rank"):
        ad.loader(make_td(), batch_size=4, rank=True, world_size=2)
    with pytest.raises(TypeError, match="world_size"):
        ad.loader(make_td(), batch_size=4, rank=0, world_size=True)


@pytest.mark.parametrize("source", [make_td, samples, lambda: iter(samples())])
def test_no_keys_is_refused(source):
    # a TensorDict source gave epochs of no batch at all, a map-style one batches of no key
    with pytest.raises(ValueError, match=r"keys=.*no key"):
        ad.loader(source(), batch_size=4, keys=[], shuffle=False)


@pytest.mark.parametrize("source", [samples, lambda: iter(samples())])
def test_a_sample_transform_that_is_not_callable_is_refused(source):
    with pytest.raises(TypeError, match="sample_transform must be callable"):
        ad.loader(source(), batch_size=4, shuffle=False, sample_transform=5)


@pytest.mark.slow
def test_mp_context_is_checked_and_only_taken_with_worker_processes():
    with pytest.raises(ValueError, match=r"mp_context='bogus'.*spawn"):
        ad.loader(samples(), batch_size=4, worker_type="process", mp_context="bogus")
    with pytest.raises(ValueError, match=r"mp_context.*worker_type='process'"):
        ad.loader(samples(), batch_size=4, mp_context="spawn")  # threads: it would be ignored
    with pytest.raises(ValueError, match=r"mp_context.*worker_type='process'"):
        ad.loader(make_td(), batch_size=4, mp_context="spawn")


# --------------------------------------------------------------------------------------------
# Each iter() starts the next epoch, whether or not a batch was taken from the previous one,
# whatever prefetch (it depended on whether the prefetch thread had pulled a batch)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("source", ["tensordict", "map"])
def test_each_iter_starts_the_next_epoch_even_if_no_batch_was_taken(prefetch, source):
    def make():
        data = make_td() if source == "tensordict" else samples()
        return ad.loader(data, batch_size=4, seed=5, prefetch=prefetch,
                         num_workers=0 if source == "map" else None)

    with make() as ref:
        epochs = [labels(ref) for _ in range(4)]
    assert epochs[0] != epochs[1]
    with make() as train:
        iter(train)  # an epoch begun, no batch taken
        time.sleep(0.05)
        second = labels(train)
        iter(train)
        fourth = labels(train)
    assert second == epochs[1]
    assert fourth == epochs[3]
