"""Sampling: which sample indices make up each batch of each epoch, on each rank.

Everything here is a pure function of ``(num_samples, batch_size, shuffle, seed, epoch, rank,
world_size, drop_last)``, so a position in the data stream is fully described by two integers,
``epoch`` and ``batches`` (yielded so far in that epoch). That is what makes resume exact.

:class:`DataLoaderRNG` is the exception, for ports of ``torch.utils.data.DataLoader`` loops:
it draws from a generator (torch's global one by default) what a DataLoader draws, so that
the rest of the loop (dropout, augmentation in the loop) sees the same random stream; its
position then also records those draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torchdata.nodes import BaseNode

from .epochs import EpochSource, is_reading_state
from .sharding import process_shard

__all__ = [
    "DataLoaderDraws",
    "DataLoaderDrawsNode",
    "DataLoaderRNG",
    "EpochBatch",
    "IndexBatchSampler",
    "epoch_indices",
    "mix_seed",
    "resolve_shard",
    "shard_order",
]

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
    """``(rank, world_size)``: the explicit values, else ``torch.distributed``'s, else
    torchrun's ``RANK`` and ``WORLD_SIZE``, else ``(0, 1)``.

    Raises:
        ValueError: only one of ``rank`` / ``world_size`` given, or ``rank`` out of range.
    """
    if rank is None and world_size is None:
        return process_shard()  # torchrun's RANK / WORLD_SIZE before the group exists, too
    if rank is None or world_size is None:
        raise ValueError(
            f"got rank={rank!r} and world_size={world_size!r}: pass both, or neither to use "
            "torch.distributed's rank and world size when it is initialised"
        )
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"{name} must be an int, got {value!r} ({type(value).__name__}); pass rank=r, "
                "world_size=w as ints (or neither, to use torch.distributed's)"
            )
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
    return shard_order(order, rank=rank, world_size=world_size, drop_last=drop_last)


def shard_order(
    order: torch.Tensor, *, rank: int, world_size: int, drop_last: bool
) -> torch.Tensor:
    """Rank ``rank``'s share of the permutation ``order``: every ``world_size``-th entry.

    Truncated to a multiple of ``world_size`` with ``drop_last``, else padded by wrapping
    around, as ``torch.utils.data.DistributedSampler`` does.
    """
    if world_size == 1:
        return order
    n = order.numel()
    if drop_last:
        order = order[: (n // world_size) * world_size]
    else:
        total = -(-n // world_size) * world_size
        order = order.repeat(-(-total // n))[:total]
    return order[rank::world_size]


def _draw_int64(generator: torch.Generator | None) -> int:
    """One int64 drawn as the DataLoader draws it (``torch.empty((), int64).random_()``)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


@dataclass(frozen=True)
class DataLoaderRNG:
    """Draw what ``torch.utils.data.DataLoader(..., generator=generator)`` draws, when it does.

    Pass it as ``loader(..., rng=DataLoaderRNG())`` to port a DataLoader loop without changing
    its random stream. At each ``iter()`` (each epoch) a DataLoader draws one int64 from
    ``generator`` (torch's global generator when None) as its base seed, and, with
    ``shuffle=True``, its ``RandomSampler`` draws the epoch's permutation: with no generator,
    from a ``torch.Generator`` seeded by one more int64 from the global generator; with one,
    from ``generator`` itself (plus a second ``randperm`` when the epoch ends). Every later
    random number of the loop (dropout masks, in-loop augmentation) depends on these draws;
    with this option the loader makes the same draws, in the same order, and visits the
    samples in the DataLoader's order. Without it, the loader draws nothing from global
    generators and shuffles from ``(seed, epoch)``.

    Under sharding (``world_size > 1``) the order is ``DistributedSampler(shuffle=shuffle,
    seed=seed, drop_last=drop_last)``'s after ``set_epoch(epoch)``, and only the base seed is
    drawn. The loader's ``seed`` still seeds the batch ``transform``.

    Args:
        generator: the DataLoader's ``generator=`` (the same object, or one in the same
            state). Its state is part of the loader's position and is set on resume.
        persistent_workers: the DataLoader had ``num_workers > 0`` and
            ``persistent_workers=True``: it then draws its base seed at the first ``iter()``
            only.
    """

    generator: torch.Generator | None = None
    persistent_workers: bool = False

    def __post_init__(self) -> None:
        g = self.generator
        if g is not None and (not isinstance(g, torch.Generator) or g.device.type != "cpu"):
            raise TypeError(
                f"DataLoaderRNG(generator={g!r}): pass the CPU torch.Generator given to the "
                "DataLoader (or None for torch's global generator)"
            )


class DataLoaderDraws:
    """The draws of [`DataLoaderRNG`][] for one loader, and their record in its position.

    ``start_epoch()`` makes one epoch's draws (returning the DataLoader's permutation when it
    shuffles); ``state()`` and ``restore(state)`` carry them through a checkpoint, so a
    resumed loader continues the epoch without drawing again and leaves ``generator`` in the
    state the uninterrupted run had. A start made only to read the position
    (``reading_state()`` of ``accelfn.data.epochs``) puts the generators back and records
    ``"redraw": True``: restoring that position makes the draws then.
    """

    def __init__(self, rng: DataLoaderRNG, num_samples: int, *, permute: bool) -> None:
        self.rng = rng
        self.num_samples = num_samples
        self.permute = permute
        self.base_drawn = False
        self.drawn_before = False
        self.draw: int | torch.Tensor | None = None
        self.redraw = False

    def start_epoch(self) -> torch.Tensor | None:
        """Draw as the DataLoader's ``iter()`` and first ``next()`` do; the permutation."""
        g = self.rng.generator
        reading = is_reading_state()
        if reading:
            saved = torch.get_rng_state(), None if g is None else g.get_state()
        self.drawn_before = self.base_drawn
        if not (self.rng.persistent_workers and self.base_drawn):
            _draw_int64(g)
            self.base_drawn = True
        if g is not None:
            self.draw = g.get_state()
        elif self.permute:
            self.draw = _draw_int64(None)
        order = self._replay()
        self.redraw = reading
        if reading:
            torch.set_rng_state(saved[0])
            if g is not None and saved[1] is not None:
                g.set_state(saved[1])
                self.draw = saved[1]  # where the real start draws from
            self.base_drawn = self.drawn_before
        return order

    def _replay(self) -> torch.Tensor | None:
        g = self.rng.generator
        if g is not None:
            assert isinstance(self.draw, torch.Tensor)
            g.set_state(self.draw)
        if not self.permute:
            return None
        if g is None:
            assert isinstance(self.draw, int)
            g = torch.Generator().manual_seed(self.draw)
            return torch.randperm(self.num_samples, generator=g)
        order = torch.randperm(self.num_samples, generator=g)
        torch.randperm(self.num_samples, generator=g)  # RandomSampler's draw at the epoch's end
        return order

    def state(self) -> dict[str, Any]:
        return {"drawn_before": self.drawn_before, "draw": self.draw, "redraw": self.redraw}

    def restore(self, state: Any) -> torch.Tensor | None:
        """Take the draws of a saved position (made before it was saved); the permutation."""
        draw = state.get("draw") if isinstance(state, dict) else None
        expected = torch.Tensor if self.rng.generator is not None else (
            int if self.permute else type(None))
        if (not isinstance(state, dict) or not isinstance(state.get("drawn_before"), bool)
                or not isinstance(state.get("redraw"), bool)
                or not isinstance(draw, expected) or isinstance(draw, bool)):
            raise ValueError(
                f"the loader position {state!r} lacks the DataLoaderRNG draws this loader "
                "needs: it was saved by a loader built without rng=DataLoaderRNG(...) or with "
                "another generator setting; build the loader as the saved run did"
            )
        if state["redraw"]:  # saved before the draws were made for real: make them now
            self.base_drawn = state["drawn_before"]
            if self.rng.generator is not None:
                assert isinstance(draw, torch.Tensor)
                self.rng.generator.set_state(draw)
            return self.start_epoch()
        self.drawn_before, self.draw, self.redraw = state["drawn_before"], draw, False
        self.base_drawn = True
        return self._replay()


class EpochBatch(NamedTuple):
    """A batch's sample indices and its epoch, as ``IndexBatchSampler(with_epoch=True)`` yields
    them: what a per-sample source needs to seed each sample from ``(seed, epoch, index)``."""

    indices: torch.Tensor
    epoch: int


class IndexBatchSampler(EpochSource[Any]):
    """A ``torchdata.nodes`` source node yielding one int64 index tensor per batch.

    With ``with_epoch=True`` it yields ``EpochBatch(indices, epoch)`` pairs (a named tuple of
    ``accelfn.data.sampling``) instead, so that a [`SampleCollator`][] seeds each sample's
    draws from ``(seed, epoch, index)``.

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
        rng: draw and shuffle as ``torch.utils.data.DataLoader`` does (see
            [`DataLoaderRNG`][]); the draws are made in ``reset()``, which runs in the
            thread that iterates the loader, and are recorded in the state under ``"rng"``.
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
        rng: DataLoaderRNG | None = None,
        with_epoch: bool = False,
    ) -> None:
        super().__init__()
        self.with_epoch = with_epoch
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self._order: torch.Tensor | None = None
        self._order_epoch = -1
        self.rng = rng
        self._draws = (
            None
            if rng is None
            else DataLoaderDraws(rng, num_samples, permute=shuffle and world_size == 1)
        )

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

    def check_state(self, state: Any) -> tuple[int, int]:
        """``(epoch, batches)`` of a saved state, checked against this sampler.

        Raises:
            ValueError: not a sampler state, or out of range for this sampler.
        """
        epoch, batches = (state.get("epoch"), state.get("batches")) if isinstance(
            state, dict) else (None, None)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (epoch, batches)):
            raise ValueError(
                f"the loader position holds {state!r:.200} where a sampler position "
                "{'epoch': int, 'batches': int} belongs; pass what BatchLoader.state_dict() "
                "returned"
            )
        assert isinstance(epoch, int) and isinstance(batches, int)
        if epoch < 0 or not 0 <= batches <= self.num_batches:
            raise ValueError(
                f"sampler state {state!r} is out of range for "
                f"{self.num_batches} batches per epoch"
            )
        return epoch, batches

    def _resume(self, state: dict[str, Any]) -> None:
        if self._draws is not None:
            self._use_order(self._draws.restore(state.get("rng")))

    def _begin_epoch(self) -> None:
        if self._draws is not None:
            self._use_order(self._draws.start_epoch())

    def _use_order(self, permutation: torch.Tensor | None) -> None:
        if permutation is not None:
            self._order = shard_order(
                permutation, rank=self.rank, world_size=self.world_size, drop_last=self.drop_last
            )
            self._order_epoch = self.epoch

    def _epoch_order(self) -> torch.Tensor:
        if self.rng is not None and self.shuffle and self.world_size > 1:
            # DistributedSampler(seed=seed) after set_epoch(epoch)
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return shard_order(
                torch.randperm(self.num_samples, generator=g),
                rank=self.rank,
                world_size=self.world_size,
                drop_last=self.drop_last,
            )
        if self._draws is not None and self._draws.permute:
            raise RuntimeError("the DataLoaderRNG permutation was not drawn: reset() first")
        return epoch_indices(
            self.num_samples,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
        )

    def next(self) -> torch.Tensor | EpochBatch:
        self._started = True
        if self._batches >= self.num_batches:
            raise StopIteration
        if self._order is None or self._order_epoch != self.epoch:
            self._order = self._epoch_order()
            self._order_epoch = self.epoch
        start = self._batches * self.batch_size
        idx = self._order[start : start + self.batch_size].clone()
        self._batches += 1
        return EpochBatch(idx, self.epoch) if self.with_epoch else idx

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "batches": self._batches}
        if self._draws is not None:
            state["rng"] = self._draws.state()
        return state


class DataLoaderDrawsNode(BaseNode[Any]):  # type: ignore[misc]  # torchdata: untyped
    """Pass ``source`` through, making [`DataLoaderRNG`][]'s draws at every new epoch.

    For sources a DataLoader reads in order (iterables): only the base seed is drawn.
    """

    def __init__(self, source: BaseNode[Any], rng: DataLoaderRNG) -> None:
        super().__init__()
        self.source = source
        self.draws = DataLoaderDraws(rng, 0, permute=False)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.draws.start_epoch()
            self.source.reset(None)
        else:
            self.draws.restore(initial_state.get("rng"))
            self.source.reset(initial_state["source"])

    def next(self) -> Any:
        return next(self.source)

    def get_state(self) -> dict[str, Any]:
        return {"source": self.source.state_dict(), "rng": self.draws.state()}
