"""The batch-transform protocol, :class:`Compose`, and the checks every transform shares."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDictBase

from ..rng import seeded_draws

__all__ = [
    "BatchTransform",
    "Compose",
    "accepts_generator",
    "as_keys",
    "as_pair",
    "fit_image",
    "host_keys",
    "image",
    "same_size_images",
    "uniform",
]


@runtime_checkable
class BatchTransform(Protocol):
    """The protocol: ``transform(batch, generator=None) -> batch`` on TensorDict batches."""

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase: ...


def accepts_generator(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes a ``generator`` keyword (then the loader passes its seeded one)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "generator" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def host_keys(fn: Callable[..., Any] | None) -> tuple[str, ...]:
    """Keys ``fn`` needs on the host (the loader does not move them to the device)."""
    return tuple(getattr(fn, "host_keys", ())) if fn is not None else ()


def as_keys(keys: str | Sequence[str]) -> tuple[str, ...]:
    """``keys`` as a non-empty tuple of key names."""
    out = (keys,) if isinstance(keys, str) else tuple(keys)
    if not out:
        raise ValueError("keys must name at least one key of the batch")
    return out


def as_pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    """An int or a ``(height, width)`` pair as a pair of non-negative ints."""
    values = (value, value) if isinstance(value, int) else tuple(int(v) for v in value)
    if len(values) != 2 or min(values) < 0:
        raise ValueError(f"{name} must be an int or a (height, width) pair >= 0, got {values}")
    return values[0], values[1]


def image(batch: TensorDictBase, key: str, who: str, min_dim: int = 4) -> torch.Tensor:
    """The tensor at ``batch[key]``, checked to have at least ``min_dim`` dimensions."""
    if key not in batch.keys():
        raise ValueError(
            f"{who}: the batch has no key {key!r} (keys: {sorted(batch.keys())}); pass "
            "keys=... naming the image keys"
        )
    x = batch.get(key)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{who}: key {key!r} holds {type(x).__name__}, not a tensor")
    if x.dim() < min_dim:
        raise ValueError(
            f"{who}: key {key!r} has shape {tuple(x.shape)}; expected (batch, channels, "
            "height, width)"
        )
    return x


def uniform(
    n: int, generator: torch.Generator | None, device: torch.device, who: str
) -> torch.Tensor:
    """``n`` draws from U[0, 1) on ``device`` with ``generator`` (checked to be there)."""
    if generator is not None and generator.device.type != device.type:
        raise ValueError(
            f"{who}: the generator is on {generator.device} but the batch is on {device}; "
            "create it with torch.Generator(device=batch.device)"
        )
    return torch.rand(n, generator=generator, device=device)


def same_size_images(
    batch: TensorDictBase, keys: tuple[str, ...], who: str
) -> list[torch.Tensor]:
    """The image tensors at ``keys``, checked to share batch and spatial size."""
    xs = [image(batch, k, who) for k in keys]
    hw = xs[0].shape[-2:]
    for k, x in zip(keys, xs):
        if x.shape[-2:] != hw or x.shape[0] != xs[0].shape[0]:
            raise ValueError(
                f"{who}: keys {keys} must share batch and spatial size, but {k!r} has shape "
                f"{tuple(x.shape)} and {keys[0]!r} has {tuple(xs[0].shape)}"
            )
    return xs


def fit_image(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Resize ``img`` (shorter side to fit, antialiased) and centre-crop it to ``size``."""
    from torchvision.transforms.v2.functional import (  # type: ignore[import-untyped]
        center_crop,
        resize,
    )

    th, tw = size
    h, w = img.shape[-2:]
    if (h, w) == (th, tw):
        return img
    s = max(th / h, tw / w)
    img = resize(img, [max(th, round(h * s)), max(tw, round(w * s))], antialias=True)
    out: torch.Tensor = center_crop(img, [th, tw])
    return out


def _member_seed(generator: torch.Generator, position: int) -> int:
    """A seed for the plain member at ``position`` of a Compose, from ``generator``'s state,
    without drawing from it (the state is read on the host: no device sync)."""
    state = generator.get_state()
    digest = hashlib.blake2b(state.numpy().tobytes(), digest_size=8,
                             salt=position.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Compose:
    """Apply transforms in order, passing the same generator to those that take one.

    ``Compose(a, b, c)(batch, generator=g)`` is ``c(b(a(batch, generator=g), ...), ...)``.
    Plain callables ``f(batch) -> batch`` may be mixed in. Given a generator, a plain
    callable's draws from torch's default generators (``torch.rand`` without
    ``generator=``) are taken, as in the loader (``accelfn.data.rng.seeded_draws``),
    from generators seeded from ``g``'s current state and the callable's position, never from
    torch's global generators: the same ``g`` state gives the same draws, ``g`` itself is not
    drawn from (the other members draw what they would without the plain callable), and the
    loader's per-batch generator makes them reproducible per batch. Without a generator,
    plain callables draw from torch's global generators, as when called alone.
    """

    def __init__(self, *transforms: Callable[..., TensorDictBase]) -> None:
        if len(transforms) == 1 and isinstance(transforms[0], (list, tuple)):
            transforms = tuple(transforms[0])
        for t in transforms:
            if not callable(t):
                raise TypeError(f"Compose takes callables, got {t!r}")
        self.transforms = tuple(transforms)
        self._takes_gen = tuple(accepts_generator(t) for t in self.transforms)
        self.host_keys = tuple(k for t in self.transforms for k in host_keys(t))

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        for i, (t, takes) in enumerate(zip(self.transforms, self._takes_gen)):
            if takes:
                batch = t(batch, generator=generator)
            elif generator is None:
                batch = t(batch)
            else:
                with seeded_draws(_member_seed(generator, i)):
                    batch = t(batch)
            if not isinstance(batch, TensorDictBase):
                raise TypeError(f"{t!r} returned {type(batch).__name__}, not a TensorDict")
        return batch

    def __repr__(self) -> str:
        inner = ", ".join(repr(t) for t in self.transforms)
        return f"Compose({inner})"
