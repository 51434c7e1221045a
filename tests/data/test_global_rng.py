"""Datasets that use torch's global generator themselves leave the training loop's random
stream alone: a loop with dropout over such a dataset (torchvision's ``FakeData`` saves the
global generator's state, seeds it with the index, draws, and puts the state back) trains
bitwise as the same loop over a ``torch.utils.data.DataLoader`` (``num_workers=0``), with any
workers and prefetching, and two identical runs with worker threads are equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import accelfn.data as ad

N = 48
BATCH = 6
UPDATES = 8


class SeedsPerIndex:
    """One fixed sample per index, made as torchvision's ``FakeData`` makes it: save the
    global generator's state, seed it with the index, draw, put the state back."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        state = torch.get_rng_state()
        torch.manual_seed(i + 7)
        x = torch.randn(8)
        label = int(torch.randint(0, 3, (1,)).item())
        torch.set_rng_state(state)
        return x, label


class ForksPerIndex:
    """The same with ``torch.random.fork_rng`` (state saved and restored by torch)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with torch.random.fork_rng():
            torch.manual_seed(i + 7)
            x = torch.randn(8)
            label = int(torch.randint(0, 3, (1,)).item())
        return x, label


def fake_data():
    datasets = pytest.importorskip("torchvision.datasets")
    v2 = pytest.importorskip("torchvision.transforms.v2")
    to_tensor = v2.Compose([v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True)])
    return datasets.FakeData(size=N, image_size=(1, 2, 4), num_classes=3, transform=to_tensor)


DATASETS = {"seeds": SeedsPerIndex, "forks": ForksPerIndex, "fakedata": fake_data}


def train(batches) -> torch.Tensor:
    """A plain loop with dropout: its random stream is the global generator's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = 0
    while seen < UPDATES:
        for x, y in batches():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += 1
            if seen == UPDATES:
                break
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def with_dataloader(dataset) -> torch.Tensor:
    torch.manual_seed(1)
    dl = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=0, drop_last=True)
    return train(lambda: dl)


def with_loader(dataset, **kwargs) -> torch.Tensor:
    torch.manual_seed(1)
    loader = ad.loader(dataset, batch_size=BATCH, shuffle=True, rng=ad.DataLoaderRNG(),
                       **kwargs)
    with loader:
        return train(lambda: ((b["image"], b["label"]) for b in loader))


SETTINGS = [
    {"num_workers": 0, "prefetch": 0},
    {"num_workers": 0, "prefetch": 2},
    {"num_workers": 3, "prefetch": 2},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("kind", DATASETS)
def test_a_dataset_using_the_global_generator_trains_as_under_a_dataloader(kind, settings):
    expected = with_dataloader(DATASETS[kind]())
    assert torch.equal(with_loader(DATASETS[kind](), **settings), expected)


@pytest.mark.parametrize("kind", DATASETS)
def test_two_runs_with_worker_threads_are_equal(kind):
    runs = [with_loader(DATASETS[kind](), num_workers=4, prefetch=3) for _ in range(3)]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])


class DrawsFromTheGlobalGenerator:
    """Draws without a generator (an augmentation): per sample under the loader."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((8,), float(i)) + torch.randn(8), i % 3


def test_a_dataset_drawing_from_the_global_generator_is_reproducible_with_threads():
    runs = [with_loader(DrawsFromTheGlobalGenerator(), num_workers=4, prefetch=3)
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert torch.equal(runs[0], with_loader(DrawsFromTheGlobalGenerator(), num_workers=0,
                                            prefetch=0))
