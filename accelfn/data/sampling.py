"""Sampling: which sample indices make up each batch of each epoch, on each rank.

Everything here is a pure function of ``(num_samples, batch_size, shuffle, seed, epoch, rank,
world_size, drop_last)``, so a position in the data stream is fully described by two integers,
``epoch`` and ``batches`` (yielded so far in that epoch). That is what makes resume exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchdata.nodes import BaseNode

__all__ = ["IndexBatchSampler", "epoch_indices", "mix_seed", "resolve_shard"]

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """Hash integers into one well-mixed 63-bit seed (splitmix64 over the values).

    Used to derive independent streams, e.g. ``mix_seed(seed, epoch)`` for the shuffle of an
    epoch, so that nearby seeds or epochs do not give correlated permutations.
    """
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h & ((1 << 63) - 1)


def resolve_shard(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``: the explicit values, else ``torch.distributed``'s, else ``(0, 1)``.

    Raises:
        ValueError: only one of ``rank`` / ``world_size`` given, or ``rank`` out of range.
    """
    if rank is None and world_size is None:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError(
            f"got rank={rank!r} and world_size={world_size!r}: pass both, or neither to use "
            "torch.distributed's rank and world size when it is initialised"
        )
    if not isinstance(rank, int) or not isinstance(world_size, int):
        raise TypeError(f"rank and world_size must be ints, got {rank!r} and {world_size!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
        )
    return rank, world_size


def epoch_indices(
    num_samples: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = True,
) -> torch.Tensor:
    """The sample indices (int64, CPU) that ``rank`` visits in ``epoch``, in order.

    All ranks draw the same permutation (from ``mix_seed(seed, epoch)``) and take every
    ``world_size``-th entry starting at ``rank``, so shards never overlap. Every rank gets the
    same count: with ``drop_last`` the permutation is truncated to a multiple of
    ``world_size`` (the few dropped samples change every epoch); without it, it is padded by
    wrapping around (a few samples are seen twice in that epoch, as with
    ``torch.utils.data.DistributedSampler``).
    """
    if shuffle:
        g = torch.Generator().manual_seed(mix_seed(seed, epoch))
        order = torch.randperm(num_samples, generator=g)
    else:
        order = torch.arange(num_samples)
    if world_size > 1:
        if drop_last:
            order = order[: (num_samples // world_size) * world_size]
        else:
            total = -(-num_samples // world_size) * world_size
            reps = -(-total // num_samples)
            order = order.repeat(reps)[:total]
        order = order[rank::world_size]
    return order


class IndexBatchSampler(BaseNode[torch.Tensor]):  # type: ignore[misc]  # torchdata: untyped
    """A ``torchdata.nodes`` source node yielding one int64 index tensor per batch.

    Shuffled with ``seed`` and reshuffled every epoch (an epoch begins at each ``reset()``
    that follows iteration), sharded by ``rank`` / ``world_size``. Its state is two ints,
    ``{"epoch": e, "batches": k}``; ``reset(state)`` resumes exactly after the ``k``-th batch
    of epoch ``e``.

    Args:
        num_samples: size of the dataset.
        batch_size: indices per batch.
        shuffle: permute the dataset each epoch (else visit it in order).
        seed: seed of the permutations.
        drop_last: drop the final short batch (of this rank's shard).
        rank: this process's shard.
        world_size: number of shards.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__()
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self._batches = 0
        self._started = False
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    @property
    def shard_size(self) -> int:
        """Samples this rank visits per epoch (before dropping a short final batch)."""
        n, w = self.num_samples, self.world_size
        return n // w if self.drop_last else -(-n // w)

    @property
    def num_batches(self) -> int:
        """Batches per epoch on this rank."""
        s = self.shard_size
        return s // self.batch_size if self.drop_last else -(-s // self.batch_size)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            epoch, batches = int(initial_state["epoch"]), int(initial_state["batches"])
            if epoch < 0 or not 0 <= batches <= self.num_batches:
                raise ValueError(
                    f"sampler state {initial_state!r} is out of range for "
                    f"{self.num_batches} batches per epoch"
                )
            self.epoch, self._batches = epoch, batches
            # A restored position is inside an epoch: the next reset(None) starts a new one.
            self._started = True
        else:
            if self._started:
                self.epoch += 1
            self._batches = 0
            self._started = False

    def next(self) -> torch.Tensor:
        self._started = True
        if self._batches >= self.num_batches:
            raise StopIteration
        if self._order is None or self._order_epoch != self.epoch:
            self._order = epoch_indices(
                self.num_samples,
                shuffle=self.shuffle,
                seed=self.seed,
                epoch=self.epoch,
                rank=self.rank,
                world_size=self.world_size,
                drop_last=self.drop_last,
            )
            self._order_epoch = self.epoch
        start = self._batches * self.batch_size
        idx = self._order[start : start + self.batch_size].clone()
        self._batches += 1
        return idx

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches": self._batches}
