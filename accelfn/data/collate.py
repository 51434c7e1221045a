"""Per-sample sources: samples loaded one by one, checked and collated into TensorDicts.

* :class:`SampleCollator` loads a batch from a map-style dataset and collates it, checking
  every sample against the first one (keys, shapes, dtypes) so a bad sample is reported by its
  dataset index.
* :class:`IterableBatcher` does the same for an iterable, as a ``torchdata.nodes`` node.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchdata.nodes import BaseNode

from .epochs import EpochCounting
from .gather import plain_tensor
from .rng import seeded_draws
from .sampling import mix_seed

__all__ = [
    "DEFAULT_PAIR_KEYS",
    "IterableBatcher",
    "SampleCollator",
    "SampleSpec",
    "collate_samples",
    "sample_to_dict",
]

#: Held while a sample of a dataset that seeds torch's global generator itself is loaded.
_SELF_SEEDING = threading.Lock()

#: Keys given to the two fields of ``(input, target)`` tuple samples (torchvision datasets).
DEFAULT_PAIR_KEYS = ("image", "label")


@dataclass(frozen=True)
class SampleSpec:
    """What every sample must look like: its keys, and per key the shape and dtype.

    ``ragged`` keys hold 1-D tensors whose length may vary per sample (e.g. encoded JPEG
    bytes); they are collated into a zero-padded ``(batch, max_length)`` tensor plus
    ``"<key>_lengths"`` (int64).
    """

    keys: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    ragged: frozenset[str] = frozenset()

    @classmethod
    def of(cls, sample: Mapping[str, torch.Tensor], ragged: Iterable[str] = ()) -> SampleSpec:
        ragged = frozenset(ragged)
        for key in ragged:
            if key not in sample:
                raise ValueError(
                    f"ragged key {key!r} is not in the samples; their keys are {list(sample)}"
                )
            if sample[key].dim() != 1:
                raise ValueError(
                    f"ragged key {key!r} must hold 1-D tensors, got shape "
                    f"{tuple(sample[key].shape)} in the first sample"
                )
        return cls(
            keys=tuple(sample),
            shapes={k: tuple(v.shape) for k, v in sample.items()},
            dtypes={k: v.dtype for k, v in sample.items()},
            ragged=ragged,
        )


def _to_tensor(value: Any, key: str, index: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return plain_tensor(value)
    if isinstance(value, np.ndarray):
        if any(stride < 0 for stride in value.strides):  # np.flip, [::-1]: torch refuses them
            value = value.copy()
        try:
            return torch.from_numpy(value)
        except TypeError as e:
            raise TypeError(
                f"sample {index}: key {key!r} holds a numpy array of dtype {value.dtype}, which "
                "torch cannot hold; convert it to a numeric or bool dtype in the dataset or "
                "sample_transform (strings and objects: encode them as numbers, or leave them "
                "out with keys=...)"
            ) from e
    if isinstance(value, (bool, int, float, np.generic)):
        return torch.as_tensor(value)
    if type(value).__module__.startswith("PIL."):
        from torchvision.transforms.v2.functional import (  # type: ignore[import-untyped]
            pil_to_tensor,
        )

        out: torch.Tensor = pil_to_tensor(value)
        return out
    if isinstance(value, Mapping):
        raise TypeError(
            f"sample {index}: key {key!r} holds a nested mapping; samples must be flat "
            "(key -> tensor, array or number): flatten it in sample_transform"
        )
    raise TypeError(
        f"sample {index}: key {key!r} holds {type(value).__name__}, which cannot be collated; "
        "return tensors, numpy arrays, numbers or PIL images (convert it in sample_transform)"
    )


def sample_to_dict(
    sample: Any, keys: Sequence[str] | None, index: int
) -> dict[str, torch.Tensor]:
    """Convert one sample (mapping, TensorDict, tuple/list, or tensor) to ``{key: tensor}``.

    Tuple samples get their names from ``keys``; without ``keys``, 2-tuples (the torchvision
    convention ``(input, target)``) are named ``("image", "label")``. ``index`` names the
    sample in error messages.
    """
    if isinstance(sample, (Mapping, TensorDictBase)):
        names = list(sample.keys()) if keys is None else list(keys)
        out = {}
        for k in names:
            if k not in sample.keys():
                raise ValueError(
                    f"sample {index} has no key {k!r}; its keys are {sorted(sample.keys())}. "
                    "Every sample must have the same keys (fix the dataset, or pass keys= to "
                    "select the ones to load)"
                )
            out[k] = _to_tensor(sample[k], k, index)
        return out
    if isinstance(sample, (tuple, list)):
        if keys is None:
            if len(sample) != 2:
                raise ValueError(
                    f"sample {index} is a {len(sample)}-tuple; pass keys=(...) with one name "
                    "per field (only (input, target) pairs get default names "
                    f"{DEFAULT_PAIR_KEYS})"
                )
            keys = DEFAULT_PAIR_KEYS
        if len(keys) != len(sample):
            raise ValueError(
                f"sample {index} has {len(sample)} fields but keys={tuple(keys)} names "
                f"{len(keys)}"
            )
        return {k: _to_tensor(v, k, index) for k, v in zip(keys, sample)}
    if isinstance(sample, torch.Tensor) or type(sample).__module__.startswith("PIL."):
        if keys is None or len(keys) != 1:
            raise ValueError(
                f"sample {index} is a single {type(sample).__name__}; pass keys=('name',) to "
                "name it"
            )
        return {keys[0]: _to_tensor(sample, keys[0], index)}
    raise TypeError(
        f"sample {index} is a {type(sample).__name__}; samples must be mappings of tensors, "
        "tuples of tensors/numbers, or tensors"
    )


def _check(sample: Mapping[str, torch.Tensor], spec: SampleSpec, index: int) -> None:
    if len(sample) != len(spec.keys) or any(k not in sample for k in spec.keys):
        missing = [k for k in spec.keys if k not in sample]
        extra = [k for k in sample if k not in spec.shapes]
        raise ValueError(
            f"sample {index} has keys {list(sample)}, but the first sample has "
            f"{list(spec.keys)} (missing {missing}, unexpected {extra}); every sample must "
            "have the same keys"
        )
    for k in spec.keys:
        v = sample[k]
        if v.dtype != spec.dtypes[k]:
            raise TypeError(
                f"sample {index}: key {k!r} has dtype {v.dtype}, but the first sample has "
                f"{spec.dtypes[k]}; convert it in the dataset or sample_transform so every "
                "sample has the same dtype"
            )
        if k in spec.ragged:
            if v.dim() != 1:
                raise ValueError(
                    f"sample {index}: ragged key {k!r} must be 1-D, got shape "
                    f"{tuple(v.shape)}"
                )
        elif tuple(v.shape) != spec.shapes[k]:
            raise ValueError(
                f"sample {index}: key {k!r} has shape {tuple(v.shape)}, but the first sample "
                f"has {spec.shapes[k]}; every sample must have the same shape per key (resize "
                "or crop in sample_transform, e.g. torchvision.transforms.v2.Resize, or "
                "preload images at a fixed size with preload_image_folder(size=...))"
            )


def collate_samples(
    samples: Sequence[tuple[int, Mapping[str, torch.Tensor]]], spec: SampleSpec
) -> TensorDict:
    """Stack ``(index, sample)`` pairs into a TensorDict of batch size ``len(samples)``.

    Each sample is checked against ``spec`` first; errors name the sample's index.
    """
    n = len(samples)
    out: dict[str, torch.Tensor] = {}
    for index, sample in samples:
        _check(sample, spec, index)
    for k in spec.keys:
        if k in spec.ragged:
            lengths = [s[k].shape[0] for _, s in samples]
            buf = torch.zeros((n, max(lengths, default=0)), dtype=spec.dtypes[k])
            for j, (_, s) in enumerate(samples):
                buf[j, : lengths[j]] = s[k]
            out[k] = buf
            out[f"{k}_lengths"] = torch.tensor(lengths, dtype=torch.int64)
        else:
            buf = torch.empty((n, *spec.shapes[k]), dtype=spec.dtypes[k])
            for j, (_, s) in enumerate(samples):
                buf[j] = s[k]
            out[k] = buf
    return TensorDict(out, batch_size=[n])


class SampleCollator:
    """Load a batch from a map-style dataset: ``__call__(indices) -> TensorDict``.

    For each index: ``dataset[i]``, then ``sample_transform`` (a per-sample CPU function, e.g.
    a torchvision transform), then conversion to ``{key: tensor}`` (see
    `sample_to_dict`), then a check against the first sample (``dataset[0]``, loaded when
    the collator is built) and stacking. Picklable when the dataset and transform are, so it
    can run in worker processes.

    The random draws of ``dataset[i]`` and ``sample_transform`` (torchvision's random
    transforms draw from torch's global generator) come from generators seeded with
    ``mix_seed(seed, epoch, i)`` (see ``accelfn.data.rng.seeded_draws``), never from torch's
    global generators: a sample's augmentation depends on ``(seed, epoch, i)`` only, not on
    the worker, the thread scheduling or the training loop's own draws. Called with an
    ``EpochBatch(indices, epoch)`` (what ``IndexBatchSampler(with_epoch=True)`` yields) it
    uses that epoch; called with a plain index tensor, epoch 0. A dataset that seeds torch's
    global generator itself (``torch.manual_seed(index)``, as torchvision's ``FakeData``
    does) gets the draws that seed gives; as seeding one generator from several threads at
    once races, its samples are then loaded one at a time in worker threads (not in worker
    processes, where the generator is the worker's own).

    Args:
        dataset: anything with ``__getitem__(int)`` and ``__len__``.
        keys: names for tuple samples, or keys to select from mapping samples.
        sample_transform: optional per-sample function applied to ``dataset[i]``.
        ragged_keys: keys holding variable-length 1-D tensors (see [`SampleSpec`][]).
            Defaults to ``dataset.ragged_keys`` when the dataset declares it.
        seed: seed of the per-sample draws.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        keys: Sequence[str] | None = None,
        sample_transform: Callable[[Any], Any] | None = None,
        ragged_keys: Sequence[str] | None = None,
        seed: int = 0,
    ) -> None:
        self.dataset = dataset
        self.keys = None if keys is None else tuple(keys)
        self.sample_transform = sample_transform
        self.seed = int(seed)
        self.self_seeding = False  # the dataset seeds torch's global generator itself
        if ragged_keys is None:
            ragged_keys = tuple(getattr(dataset, "ragged_keys", ()))
        self.spec = SampleSpec.of(self.load(0), ragged_keys)

    def load(self, index: int, epoch: int = 0) -> dict[str, torch.Tensor]:
        """Load, transform and convert sample ``index`` of ``epoch`` (no shape check)."""
        one_at_a_time = _SELF_SEEDING if self.self_seeding else contextlib.nullcontext()
        where = f"while loading sample {index} of epoch {epoch}"
        with one_at_a_time, seeded_draws(mix_seed(self.seed, epoch, index)) as draws:
            try:
                sample = self.dataset[index]
            except Exception as e:  # name the sample; the type and message stay the user's
                e.add_note(f"{where}: in dataset[{index}]")
                raise
            if self.sample_transform is not None:
                try:
                    sample = self.sample_transform(sample)
                except Exception as e:
                    e.add_note(f"{where}: in sample_transform(dataset[{index}])")
                    raise
        if draws.seeded_global:
            self.self_seeding = True
        return sample_to_dict(sample, self.keys, index)

    def __call__(self, batch: torch.Tensor | tuple[torch.Tensor, int]) -> TensorDict:
        indices, epoch = batch if isinstance(batch, tuple) else (batch, 0)
        return collate_samples(
            [(i, self.load(i, int(epoch))) for i in indices.tolist()], self.spec
        )


class IterableBatcher(EpochCounting[TensorDict]):
    """Batch and collate the samples of an iterable source node into TensorDicts.

    The iterable is read in rounds of ``batch_size * world_size`` samples, and rank ``r`` of
    ``w`` keeps samples ``r, r + w, r + 2w, ...`` of each round (so of each pass: sharding is
    by position). Every rank reads the whole stream and decides alone, so all ranks yield the
    same number of batches of the same sizes (the same as a map-style source of that length
    gives), with no communication: a DDP step is never run by some ranks only.

    * With ``drop_last`` a batch is yielded only for a whole round; the final, incomplete
      round (fewer than ``batch_size * world_size`` samples) is dropped on every rank.
    * Without it the final round of ``k`` samples gives every rank a last batch of
      ``ceil(k / w)`` samples; the round is padded by wrapping around to its start (as
      ``torch.utils.data.DistributedSampler`` pads its permutation), so at most ``w - 1``
      samples are seen twice in an epoch, by different ranks, with the same augmentation.

    Its state is the source's state plus counters (plain ints). The random draws of
    ``sample_transform`` come from generators seeded with ``mix_seed(seed, epoch,
    position)`` (as in [`SampleCollator`][]); the iterable's own draws, made while it is
    read, are not managed.

    Raises:
        ValueError: (while iterating) an epoch of the iterable yields no batch at all: the
            iterable is empty, holds fewer than ``batch_size * world_size`` samples with
            ``drop_last``, or is a one-shot iterator that was already consumed.
    """

    COUNTERS = ("pos", "batches")
    _pos: int
    _batches: int

    def __init__(
        self,
        source: BaseNode[Any],
        batch_size: int,
        *,
        drop_last: bool = True,
        keys: Sequence[str] | None = None,
        sample_transform: Callable[[Any], Any] | None = None,
        ragged_keys: Sequence[str] = (),
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__(source)
        self.seed = int(seed)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.keys = None if keys is None else tuple(keys)
        self.sample_transform = sample_transform
        self.ragged_keys = tuple(ragged_keys)
        self.rank = rank
        self.world_size = world_size
        self.spec: SampleSpec | None = None

    def _prepare(self, pos: int, raw: Any) -> tuple[int, dict[str, torch.Tensor]]:
        if self.sample_transform is not None:
            with seeded_draws(mix_seed(self.seed, self._epoch, pos)):
                try:
                    raw = self.sample_transform(raw)
                except Exception as e:  # name the sample; the type and message stay the user's
                    e.add_note(
                        f"while loading sample {pos} of epoch {self._epoch} of the iterable "
                        "source: in sample_transform"
                    )
                    raise
        sample = sample_to_dict(raw, self.keys, pos)
        if self.spec is None:
            self.spec = SampleSpec.of(sample, self.ragged_keys)
        return pos, sample

    def _read_round(self) -> tuple[int, list[tuple[int, Any]], list[tuple[int, Any]]]:
        """Read one round: how many samples it had, this rank's ``(position, raw sample)``
        pairs, and (without ``drop_last``) the round's first ``world_size`` ones."""
        w = self.world_size
        size = self.batch_size * w
        mine: list[tuple[int, Any]] = []
        head: list[tuple[int, Any]] = []
        read = 0
        while read < size:
            try:
                raw = next(self.source)
            except StopIteration:
                break
            except Exception as e:
                e.add_note(
                    f"while reading sample {self._pos} of epoch {self._epoch} of the iterable "
                    "source"
                )
                raise
            pos = self._pos
            self._pos += 1
            if read % w == self.rank:
                mine.append((pos, raw))
            elif read < w and not self.drop_last:
                head.append((pos, raw))
            read += 1
        return read, mine, head

    def next(self) -> TensorDict:
        self._started = True
        w = self.world_size
        read, mine, head = self._read_round()
        whole = read == self.batch_size * w
        if not whole and (self.drop_last or read == 0):
            if self._batches == 0:
                needed = (
                    f"with drop_last=True a batch needs a whole round of batch_size * "
                    f"world_size = {self.batch_size * w} samples"
                    if self.drop_last
                    else "it needs at least one sample"
                )
                raise ValueError(
                    f"the iterable source gave no batch in epoch {self._epoch}: it yielded "
                    f"{self._pos} samples, and {needed} (batch_size={self.batch_size}, rank "
                    f"{self.rank} of world_size={w}). Check that it is not empty, use a "
                    "smaller batch_size or drop_last=False, and pass a re-iterable (a list, an "
                    "IterableDataset) rather than a one-shot generator"
                )
            raise StopIteration
        if not whole:  # the final round, padded by wrapping around to its start
            count = -(-read // w)
            # this rank's slot past the samples read (at most one) takes sample slot % read,
            # one of the round's first w, never this rank's own
            for slot in range(self.rank + len(mine) * w, count * w, w):
                offset = slot % read
                mine.append(head[offset if offset < self.rank else offset - 1])
        samples = [self._prepare(pos, raw) for pos, raw in mine]
        self._batches += 1
        assert self.spec is not None  # set by the first sample, and the batch has one
        return collate_samples(samples, self.spec)
