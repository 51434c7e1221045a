"""A plain DataLoader sharded across torchrun's processes: its sampler made a DistributedSampler.

:func:`process_shard` says which share of the data this process reads (the process group's
rank and size, else torchrun's ``RANK`` / ``WORLD_SIZE``, else the whole data);
:func:`shard_dataloader` rebuilds a ``torch.utils.data.DataLoader`` (or torchdata's
``StatefulDataLoader``) with the same arguments but ``sampler=DistributedSampler(...)``, as
a hand-written DDP loop does, so each process loads only its own samples.

The sampler is replaced rather than the batches dealt out by rank: the per-process
``batch_size`` stays the one the DataLoader was given (the global batch is ``batch_size *
world_size``, DDP's convention), each process loads only its own samples, and the processes
agree on a shuffle through the sampler's ``seed`` and epoch, with no collective. Nothing here
is home-made sampling: the sampler is torch's ``DistributedSampler``.
"""

from __future__ import annotations

import inspect
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

__all__ = ["Epochs", "Sharded", "process_shard", "shard_dataloader"]

# The constructor arguments a rebuilt DataLoader takes from the original's attributes of the
# same names; the sampling ones are replaced.
_REPLACED = frozenset({"self", "dataset", "shuffle", "sampler", "batch_sampler"})
_SHARD_YOURSELF = (
    "shard it yourself (e.g. sampler=torch.utils.data.DistributedSampler(dataset) in the "
    "DataLoader, its set_epoch(epoch) called before each epoch) and pass shard=False"
)


class Epochs:
    """The next epoch of a sharded DataLoader, shared by every adapter built over it (a loop
    that wraps the same DataLoader again each epoch gets a new shuffle each epoch, as the
    DataLoader's own sampler would have given it)."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0


@dataclass(frozen=True)
class Sharded:
    """What :func:`shard_dataloader` made of a DataLoader: the DataLoader to iterate, the
    sampler whose epoch is set before each epoch (None: the user's own), the epoch count."""

    dataloader: DataLoader[Any]
    sampler: DistributedSampler[Any] | None
    epochs: Epochs = field(default_factory=Epochs)


# DataLoaders sharded already, by (rank, world_size, seed): wrapped again, they continue
_SHARDED: weakref.WeakKeyDictionary[DataLoader[Any], tuple[tuple[int, int, int], Sharded]] = \
    weakref.WeakKeyDictionary()


def process_shard() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: torch.distributed's when its process group is
    initialised, else torchrun's ``RANK`` and ``WORLD_SIZE`` (a loader built before the first
    step, which sets the group up), else ``(0, 1)``.

    Raises:
        ValueError: ``WORLD_SIZE`` > 1 without a valid ``RANK`` (not a torchrun launch).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        world = 1
    if world <= 1:
        return 0, 1
    try:
        rank = int(os.environ["RANK"])
    except (KeyError, ValueError):
        rank = -1
    if not 0 <= rank < world:
        raise ValueError(
            f"WORLD_SIZE={world} but RANK={os.environ.get('RANK')!r}: the processes cannot "
            "tell their shares of the data apart; start the script with torchrun "
            "--nproc_per_node=N, or pass rank= and world_size="
        )
    return rank, world


def _shuffles(sampler: object, dataset: Any) -> bool | None:
    """True for a shuffling sampler over the whole dataset once, False for a sequential one,
    None for any other sampler (which a DistributedSampler cannot stand in for)."""
    if isinstance(sampler, SequentialSampler):
        return False
    random_types: tuple[type, ...] = (RandomSampler,)
    try:  # torchdata's StatefulDataLoader makes its own (stateful) RandomSampler
        from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandom

        random_types = (RandomSampler, StatefulRandom)
    except ImportError:  # pragma: no cover - torchdata is a dependency
        pass
    if isinstance(sampler, random_types):
        replacement = getattr(sampler, "replacement", False)
        given = getattr(sampler, "_num_samples", None)
        if not replacement and (given is None or given == len(dataset)):
            return True
    return None


def _sampling(dataloader: DataLoader[Any], world_size: int) -> bool | None:
    """Whether the rebuilt sampler shuffles; None: the DataLoader is already sharded.

    Raises:
        TypeError: a DataLoader whose sampling a DistributedSampler cannot replace.
    """
    name = type(dataloader).__name__
    if isinstance(dataloader.dataset, IterableDataset):
        raise TypeError(
            f"from_dataloader() cannot shard a {name} over an IterableDataset across the "
            f"{world_size} processes (it has no sampler to replace): make the dataset yield "
            "only this process' share (torch.distributed.get_rank() of get_world_size()) and "
            "pass shard=False"
        )
    if isinstance(dataloader.sampler, DistributedSampler):
        replicas = dataloader.sampler.num_replicas
        if replicas != world_size:
            raise ValueError(
                f"the {name}'s DistributedSampler has num_replicas={replicas} but "
                f"{world_size} processes train; build it with the default num_replicas "
                "(torch.distributed's world size)"
            )
        return None  # the user's own sharding, epochs set by the user, as in a plain loop
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        raise TypeError(
            f"from_dataloader() cannot shard a {name} with batch_size=None (batching "
            f"disabled) across the {world_size} processes; {_SHARD_YOURSELF}"
        )
    own_batches = type(batch_sampler) is BatchSampler or (
        type(batch_sampler).__module__.startswith("torchdata.stateful_dataloader")
        and type(batch_sampler).__name__ == "BatchSampler")
    shuffle = _shuffles(dataloader.sampler, dataloader.dataset) if own_batches else None
    if shuffle is None:
        what = (type(dataloader.sampler).__name__ if own_batches
                else f"batch_sampler {type(batch_sampler).__name__}")
        raise TypeError(
            f"from_dataloader() cannot shard a {name} whose sampling is a {what} across the "
            f"{world_size} processes: only a shuffling or sequential sampler can be replaced "
            f"by a DistributedSampler; {_SHARD_YOURSELF}"
        )
    return shuffle


def shard_dataloader(dataloader: DataLoader[Any], *, rank: int, world_size: int,
                     seed: int) -> Sharded:
    """Equivalent to ``DataLoader(dataset, sampler=DistributedSampler(dataset,
    num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed), **the other
    arguments)``, where ``shuffle`` is whether ``dataloader`` shuffles.

    Returns the DataLoader to iterate and the sampler whose epoch its owner sets before each
    epoch; a DataLoader already sampled by a DistributedSampler is returned as it is, with
    None (its epochs are its user's). The same DataLoader sharded again alike gives the same
    result, its epoch count continued. Every sample is read once per epoch across the
    processes; when the dataset does not divide evenly, the sampler repeats a few samples so
    that each process gets as many (``DistributedSampler``'s ``drop_last=False``).

    Raises:
        TypeError: a DataLoader subclass, an IterableDataset, ``batch_size=None``, or a
            sampler or batch sampler other than a shuffling or sequential one: with how to
            shard it by hand.
        ValueError: a DistributedSampler built for another number of processes.
    """
    kind = type(dataloader)
    name = kind.__name__
    stateful = kind.__module__.startswith("torchdata.stateful_dataloader")
    if not isinstance(dataloader, DataLoader) or (kind is not DataLoader and not stateful):
        raise TypeError(
            f"from_dataloader() cannot shard a {name} across the {world_size} processes "
            "(only torch.utils.data.DataLoader and torchdata's StatefulDataLoader, whose "
            f"arguments it knows, are rebuilt with a DistributedSampler); {_SHARD_YOURSELF}"
        )
    shuffle = _sampling(dataloader, world_size)
    if shuffle is None:
        return Sharded(dataloader, None)
    done = _SHARDED.get(dataloader)
    if done is not None and done[0] == (rank, world_size, seed):
        return done[1]
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataloader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
    arguments = {
        param: getattr(dataloader, param)
        for param in inspect.signature(kind.__init__).parameters
        if param not in _REPLACED and hasattr(dataloader, param)
    }
    sharded = Sharded(kind(dataloader.dataset, sampler=sampler, **arguments), sampler)
    _SHARDED[dataloader] = ((rank, world_size, seed), sharded)
    return sharded
