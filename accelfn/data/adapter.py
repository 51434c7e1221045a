"""An existing DataLoader as an accelfn loader: named TensorDict batches on the device.

:func:`from_dataloader` wraps a ``torch.utils.data.DataLoader`` (or torchdata's
``StatefulDataLoader``, or any iterable of batches) in a :class:`DataLoaderAdapter`, a
:class:`~accelfn.data.BatchLoader`: tuple batches get names, batches are pinned and copied to
the device without blocking, the loop's data wait is recorded, and a ``StatefulDataLoader``'s
position goes into checkpoints. Under torchrun the DataLoader is sharded across the processes
(its sampler made a ``DistributedSampler``, see :mod:`accelfn.data.sharding`), the sampler's
epoch set before each epoch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torchdata.nodes import BaseNode

from .batch_loader import BatchLoader
from .collate import DEFAULT_PAIR_KEYS
from .epochs import is_reading_state
from .sharding import Epochs, process_shard, shard_dataloader
from .stages import ToDevice, resolve_device

__all__ = ["DataLoaderAdapter", "batch_to_tensordict", "from_dataloader"]


def _first_dim(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else None
    if isinstance(value, (Mapping, TensorDictBase)):
        for v in value.values():
            n = _first_dim(v)
            if n is not None:
                return n
    return None


def batch_to_tensordict(batch: Any, keys: Sequence[str] | None = None) -> TensorDictBase:
    """Equivalent to ``TensorDict(dict(zip(keys, batch)), batch_size=[len(batch[0])])``.

    A DataLoader's batch as a TensorDict: tuples and lists get their field names from
    ``keys`` (2-tuples, the ``(input, target)`` convention, default to ``("image",
    "label")``), a single tensor needs one key; mappings and TensorDicts keep their keys
    (``keys`` then selects some). Values may be tensors, nested mappings of tensors, or
    per-sample lists (e.g. file names, kept as non-tensor data). The batch size is the first
    tensor's first dimension.

    Raises:
        TypeError / ValueError: what the batch is and how to name or fix it.
    """
    fields: Mapping[str, Any]
    if isinstance(batch, TensorDictBase):
        if keys is None:
            return batch
        missing = [k for k in keys if k not in batch.keys()]
        if missing:
            raise ValueError(
                f"the batch has no key(s) {missing}; its keys are {sorted(batch.keys())} "
                "(keys= selects among them)"
            )
        return batch.select(*keys)
    if isinstance(batch, Mapping):
        names = list(batch) if keys is None else list(keys)
        missing = [k for k in names if k not in batch]
        if missing:
            raise ValueError(
                f"the batch has no key(s) {missing}; its keys are {sorted(map(str, batch))} "
                "(keys= selects among them; a dict batch needs no keys)"
            )
        fields = {k: batch[k] for k in names}
    elif isinstance(batch, (tuple, list)):
        if keys is None:
            if len(batch) != 2:
                example = tuple(f"x{i}" for i in range(len(batch)))
                raise ValueError(
                    f"the DataLoader yields {len(batch)}-tuples; name their fields, e.g. "
                    f"from_dataloader(loader, keys={example}) (only pairs get default names, "
                    f"{DEFAULT_PAIR_KEYS})"
                )
            keys = DEFAULT_PAIR_KEYS
        if len(keys) != len(batch):
            raise ValueError(
                f"the DataLoader yields {len(batch)}-tuples but keys={tuple(keys)} names "
                f"{len(keys)} fields; give one name per field"
            )
        fields = dict(zip(keys, batch))
    elif isinstance(batch, torch.Tensor):
        if keys is None or len(keys) != 1:
            raise ValueError(
                "the DataLoader yields single tensors; name them with one key, e.g. "
                "from_dataloader(loader, keys=('input',))"
            )
        fields = {keys[0]: batch}
    else:
        raise TypeError(
            f"the DataLoader yields {type(batch).__name__} batches; an accelfn step needs "
            "tensors: a tuple/list of tensors (named by keys=), a dict of tensors or a "
            "TensorDict (change the DataLoader's collate_fn)"
        )
    for name, value in fields.items():
        if not isinstance(name, str):
            raise TypeError(f"batch key {name!r} is not a string; TensorDict keys are strings")
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            raise TypeError(
                f"batch field {name!r} is a {type(value).__name__} of tensors (a nested tuple "
                "in the samples); flatten it into named fields in the dataset or collate_fn"
            )
    n = _first_dim(fields)
    if n is None:
        raise ValueError(
            f"the batch {sorted(fields)} holds no tensor with a batch dimension; an accelfn "
            "step needs at least one"
        )
    try:
        return TensorDict(dict(fields), batch_size=[n])
    except (RuntimeError, ValueError) as error:
        shapes = {
            k: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            for k, v in fields.items()
        }
        raise ValueError(
            f"the batch's fields disagree on the number of samples ({shapes}): every field's "
            f"first dimension must be the batch size ({error})"
        ) from error


def _all_pinned(batch: TensorDictBase) -> bool:
    return all(
        t.is_pinned()
        for t in batch.values(include_nested=True, leaves_only=True)
        if isinstance(t, torch.Tensor)
    )


class _DataLoaderNode(BaseNode[TensorDictBase]):  # type: ignore[misc]  # torchdata: untyped
    """Iterate a DataLoader in the calling thread, yielding named (optionally pinned) batches.

    Its state is the DataLoader's ``state_dict()`` right after the last batch (when it has
    one). Resuming loads it, and undoes the random draw that the DataLoader's ``iter()``
    makes (the uninterrupted run made it before the checkpoint, whose RNG state follows it),
    so that the random stream continues as in the uninterrupted run. A start made only to
    read the state (``reading_state()``) puts the generators back and records
    ``"redraw": True``: restoring that position starts the DataLoader for real.

    Each start is one epoch, counted in ``epochs`` (shared by the adapters over one sharded
    DataLoader) and in the state (``"epoch"``); with a ``sampler`` (the DistributedSampler
    that sharding put in), ``sampler.set_epoch(epoch)`` is called before the DataLoader is
    started, so that a resumed epoch has its shuffle again.
    """

    def __init__(self, dataloader: Iterable[Any], keys: Sequence[str] | None, pin: bool,
                 stateful: bool, sampler: Any = None, epochs: Epochs | None = None) -> None:
        super().__init__()
        self.dataloader = dataloader
        self.keys = None if keys is None else tuple(keys)
        self.pin = pin
        self.stateful = stateful
        self.sampler = sampler
        self.epoch = 0  # the epoch of the current start
        self.epochs = Epochs() if epochs is None else epochs  # the next start's, from scratch
        generator = getattr(dataloader, "generator", None)
        self._generator = generator if isinstance(generator, torch.Generator) else None
        self._it: Iterator[Any] | None = None
        self._position: Any = None
        self._redraw = False

    @contextlib.contextmanager
    def _undoing_draws(self, *, global_rng: bool, generator: bool) -> Iterator[None]:
        """Put back torch's global generator and/or the DataLoader's own ``generator``."""
        g = self._generator if generator else None
        before = torch.get_rng_state() if global_rng else None
        before_g = None if g is None else g.get_state()
        yield
        if before is not None:
            torch.set_rng_state(before)
        if g is not None and before_g is not None:
            g.set_state(before_g)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._it = None  # a DataLoader's iterator ends its worker processes when dropped
        saved = None if initial_state is None else initial_state.get("dataloader")
        redraw = initial_state is None or bool(initial_state.get("redraw"))
        reading = is_reading_state()
        if initial_state is None:
            self.epoch = self.epochs.next
        else:  # positions saved before epochs were counted are of the first one
            self.epoch = int(initial_state.get("epoch", 0))
        self.epochs.next = self.epoch + 1
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        if saved is not None:
            self.dataloader.load_state_dict(saved)  # type: ignore[attr-defined]
        # Reading: draw nothing. Resuming: the base seed was drawn before the checkpoint,
        # whose RNG state follows that draw (a StatefulDataLoader puts its sampler's
        # generator back itself). A position read before the first iter() draws now.
        with self._undoing_draws(global_rng=reading or not redraw, generator=reading):
            self._it = iter(self.dataloader)
            self._capture()
        self._redraw = redraw and reading

    def _capture(self) -> None:
        self._position = self.dataloader.state_dict() if self.stateful else None  # type: ignore[attr-defined]

    def next(self) -> TensorDictBase:
        assert self._it is not None
        batch = batch_to_tensordict(next(self._it), self.keys)
        self._capture()
        self._redraw = False
        if self.pin and not _all_pinned(batch):
            batch = batch.pin_memory()  # page-locked staging, from torch's caching host allocator
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"dataloader": self._position, "redraw": self._redraw, "epoch": self.epoch}

    def close(self) -> None:
        self._it = None


class DataLoaderAdapter(BatchLoader):
    """A [`BatchLoader`][accelfn.data.BatchLoader] over a DataLoader; see [`from_dataloader`][].

    Each ``iter()`` is one ``iter(dataloader)`` (one epoch); its batches are TensorDicts,
    already on ``device``. Data wait (``last_wait_s``, ``total_wait_s``, ``batches``,
    ``total_time_s``, ``wait_share``, ``reset_timing()``), ``close()`` and ``len()`` are the
    BatchLoader's. ``state_dict()`` / ``load_state_dict()`` need a DataLoader with a position
    (torchdata's ``StatefulDataLoader``); a plain ``torch.utils.data.DataLoader`` has none.
    """

    def __init__(self, node: _DataLoaderNode, root: BaseNode[TensorDictBase], *,
                 num_batches: int | None, config: Mapping[str, Any]) -> None:
        super().__init__(root, num_batches=num_batches, config=config, close_fns=(node.close,),
                         portable_position=True)
        self.dataloader = node.dataloader
        self.stateful = node.stateful

    def _refuse(self, what: str) -> None:
        if not self.stateful:
            raise TypeError(
                f"{what}: a {type(self.dataloader).__name__} has no position to save (it "
                "restarts at the beginning of an epoch). For exact mid-epoch resume build a "
                "torchdata.stateful_dataloader.StatefulDataLoader with the same arguments and "
                "wrap that; or checkpoint without loader= (a resumed run then re-iterates the "
                "epoch from its start)"
            )

    def state_dict(self) -> dict[str, Any]:
        """The wrapped ``StatefulDataLoader``'s ``state_dict()`` as of the last batch returned.

        Raises:
            TypeError: the DataLoader has no ``state_dict()`` (a plain DataLoader).
        """
        self._refuse("DataLoaderAdapter.state_dict()")
        return super().state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from [`state_dict`][] at the next ``iter()`` (see ``BatchLoader``).

        Raises:
            TypeError: the DataLoader has no ``load_state_dict()`` (a plain DataLoader).
            ValueError: not a state of an adapter configured like this one.
        """
        self._refuse("DataLoaderAdapter.load_state_dict()")
        super().load_state_dict(state)


def from_dataloader(
    dataloader: Iterable[Any],
    *,
    keys: Sequence[str] | None = None,
    device: torch.device | str | None = None,
    pin_memory: bool | None = None,
    shard: bool = True,
    seed: int = 0,
) -> DataLoaderAdapter:
    """Equivalent to ``(TensorDict(dict(zip(keys, b)), ...).to(device, non_blocking=True)
    for b in dataloader)``, pinned, timed and checkpointable.

    The one-line way to feed an accelfn step from an existing DataLoader:

        train = accelfn.data.from_dataloader(loader, keys=("image", "label"), device="cuda")
        for batch in train:                     # TensorDict on cuda, one epoch per iter()
            metrics = step(state, batch)

    The DataLoader is iterated in the loop's thread, exactly when a plain ``for b in
    loader`` would, so its random draws (its base seed at each ``iter()``, per-sample
    augmentation with ``num_workers=0``) keep their place in the random stream. Batches go
    to ``device`` with ``non_blocking=True`` copies from page-locked memory: batches the
    DataLoader pinned itself (``pin_memory=True``, in its pin thread) are copied as they
    are, others are first copied into page-locked staging memory (in the loop's thread; pass
    ``pin_memory=True`` to the DataLoader to move that off the loop). On CUDA, with
    ``num_workers > 0``, the next batch's copy is issued on a side stream while the current
    one is used.

    Under torchrun (``torch.distributed``'s process group, or torchrun's ``RANK`` and
    ``WORLD_SIZE`` when the group is not set up yet) each process reads its own share: the
    DataLoader is rebuilt with the same arguments and ``sampler=DistributedSampler(dataset,
    shuffle=<whether it shuffled>, seed=seed)``, whose ``set_epoch`` is called with the
    epoch (the count of ``iter()``) before each epoch, exactly as a hand-written DDP loop
    does; ``batch_size`` stays the per-process batch. A DataLoader already sampled by a
    ``DistributedSampler`` is used as it is (set its epoch yourself, as in a plain loop).
    What cannot be resharded this way (an ``IterableDataset``, a custom sampler or batch
    sampler, a DataLoader subclass, any other iterable) is refused with how to shard it by
    hand; ``shard=False`` takes the DataLoader as it is (it already yields this process'
    share, or every process is to read all of it). In one process nothing changes.

    Resume: with torchdata's ``StatefulDataLoader`` (a drop-in replacement taking the same
    arguments), ``state_dict()`` is its position after the last batch the loop received, and
    ``accelfn.checkpointing.save(..., loader=train)`` / ``load(..., loader=train)`` resume
    mid-epoch with the same remaining batches and the same random stream. A plain
    ``DataLoader`` has no position: ``state_dict()`` raises, so checkpoint without
    ``loader=`` (a resumed run re-iterates that epoch from its start). A sharded
    position also holds the epoch, so the resumed epoch has the same shuffle; it resumes only
    with the same rank, number of processes and ``seed``.

    Args:
        dataloader: a ``torch.utils.data.DataLoader``, a ``StatefulDataLoader``, or any
            re-iterable of batches.
        keys: names of the fields of tuple/list batches (pairs default to ``("image",
            "label")``; dict batches need none, or select keys with it).
        device: where batches go (``None``: where the DataLoader leaves them).
        pin_memory: page-lock batches before the copy; ``None`` = when ``device`` is CUDA.
        shard: under torchrun, give each process its share of the DataLoader (above);
            ``False``: use it as it is.
        seed: the ``DistributedSampler``'s shuffle seed when sharding (the same on every
            process; ``DistributedSampler``'s default, 0).

    Raises:
        TypeError / ValueError: a bad argument, or a DataLoader that cannot be sharded
            under torchrun (with how to shard it); while iterating, a batch that cannot be
            named (with how to name it).
    """
    if isinstance(dataloader, (BatchLoader, TensorDictBase, Mapping)) or not isinstance(
        dataloader, Iterable
    ):
        raise TypeError(
            f"from_dataloader() wraps a DataLoader (an iterable of batches), got "
            f"{type(dataloader).__name__}; use accelfn.data.loader() for datasets and "
            "TensorDicts, and iterate an accelfn loader as it is"
        )
    if keys is not None and (isinstance(keys, str) or not all(isinstance(k, str) for k in keys)):
        raise TypeError(
            f"keys must be a sequence of strings, e.g. ('image', 'label'); got {keys!r}"
        )
    if not isinstance(shard, bool):
        raise TypeError(f"from_dataloader(shard={shard!r}) takes True or False")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"from_dataloader(seed={seed!r}) takes an int, the same on every "
                        "process")
    dev, pin_memory = resolve_device(device, pin_memory)
    sampler = epochs = None
    rank, world = process_shard() if shard else (0, 1)
    if world > 1:
        sharded = shard_dataloader(dataloader, rank=rank, world_size=world,  # type: ignore[arg-type]
                                   seed=seed)
        dataloader, sampler, epochs = sharded.dataloader, sharded.sampler, sharded.epochs
    stateful = callable(getattr(dataloader, "state_dict", None)) and callable(
        getattr(dataloader, "load_state_dict", None)
    )
    node = _DataLoaderNode(dataloader, keys, bool(pin_memory), stateful, sampler, epochs)
    root: BaseNode[TensorDictBase] = node
    if dev is not None:
        # Looking ahead pulls the next batch early: only when workers, not the loop's thread,
        # make it (so no random draw moves).
        workers = int(getattr(dataloader, "num_workers", 0) or 0)
        root = ToDevice(node, dev, lookahead=1 if workers > 0 else 0)
    try:
        num_batches: int | None = len(dataloader)  # type: ignore[arg-type]
    except TypeError:
        num_batches = None
    dataset = getattr(dataloader, "dataset", None)
    try:
        num_samples: int | None = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        num_samples = None
    config = {
        "source": "dataloader",
        "dataloader": type(dataloader).__name__,
        "batch_size": getattr(dataloader, "batch_size", None),
        "num_samples": num_samples,
        "keys": None if keys is None else list(keys),
    }
    if sampler is not None:  # a position is this process' share of this shuffle
        config["shard"] = {"rank": rank, "world_size": world, "seed": seed}
    return DataLoaderAdapter(node, root, num_batches=num_batches, config=config)
