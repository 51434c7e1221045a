"""Pixel values and layout: normalisation, dtype casts, the channels-last memory format."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from tensordict import TensorDictBase

from .base import as_keys, image

__all__ = ["ChannelsLast", "Normalize", "ToDtype"]


def _max_value(dtype: torch.dtype) -> float:
    return 1.0 if dtype.is_floating_point else float(torch.iinfo(dtype).max)


class _EachKey:
    """A deterministic batch transform of each of ``keys``: a shallow copy of the batch with
    ``_convert(key, batch[key])`` set at every key (each checked to have ``MIN_DIM`` dims)."""

    MIN_DIM: ClassVar[int] = 4
    keys: tuple[str, ...]

    def _convert(self, key: str, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        out = batch.copy()
        for k in self.keys:
            out.set(k, self._convert(k, image(batch, k, type(self).__name__, self.MIN_DIM)))
        return out


class Normalize(_EachKey):
    """``(x / max - mean) / std`` per channel, output in ``dtype``: a cast and two in-place ops.

    Integer inputs (uint8 images) are first scaled to ``[0, 1]`` by their dtype's maximum
    (255), so ``Normalize`` on raw uint8 batches equals ``ToDtype(float32, scale=True)``
    followed by ``torchvision``'s ``Normalize``. Floating inputs are taken as already in
    ``[0, 1]``-scale.

    Args:
        mean: per-channel means (in ``[0, 1]`` units).
        std: per-channel standard deviations.
        dtype: output floating dtype.
        keys: batch keys to normalise (channels along dim 1).
    """

    MIN_DIM = 2

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        dtype: torch.dtype = torch.float32,
        keys: str | Sequence[str] = ("image",),
    ) -> None:
        if len(mean) != len(std) or not len(mean):
            raise ValueError(f"mean and std need one value per channel, got {mean} and {std}")
        if any(s <= 0 for s in std):
            raise ValueError(f"std must be positive, got {std}")
        if not dtype.is_floating_point:
            raise TypeError(f"Normalize outputs a floating dtype, got {dtype}")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.dtype = dtype
        self.keys = as_keys(keys)
        self._cache: dict[
            tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, torch.Tensor]
        ] = {}

    def _coeffs(
        self, device: torch.device, in_dtype: torch.dtype, ndim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, in_dtype, ndim)
        if key not in self._cache:
            top = _max_value(in_dtype)
            shape = (1, len(self.mean)) + (1,) * (ndim - 2)
            scale = torch.tensor([1.0 / (top * s) for s in self.std], dtype=self.dtype)
            shift = torch.tensor([-m / s for m, s in zip(self.mean, self.std)], dtype=self.dtype)
            self._cache[key] = (scale.view(shape).to(device), shift.view(shape).to(device))
        return self._cache[key]

    def _convert(self, key: str, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != len(self.mean):
            raise ValueError(
                f"Normalize: key {key!r} has {x.shape[1]} channels (dim 1) but mean/std "
                f"have {len(self.mean)}"
            )
        scale, shift = self._coeffs(x.device, x.dtype, x.dim())
        return x.to(self.dtype, copy=True).mul_(scale).add_(shift)

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, keys={self.keys})"


class ToDtype(_EachKey):
    """Cast keys to ``dtype``; with ``scale``, map integer ranges to ``[0, 1]`` and back.

    ``scale=True``: uint8 -> float divides by 255; float -> uint8 multiplies by 255, rounds and
    clamps (as ``torchvision.transforms.v2.ToDtype(..., scale=True)``).
    """

    MIN_DIM = 0

    def __init__(
        self, dtype: torch.dtype, *, scale: bool = False, keys: str | Sequence[str] = ("image",)
    ) -> None:
        self.dtype = dtype
        self.scale = scale
        self.keys = as_keys(keys)

    def _convert(self, key: str, x: torch.Tensor) -> torch.Tensor:
        src, dst = x.dtype, self.dtype
        if not self.scale or src.is_floating_point == dst.is_floating_point:
            return x.to(dst)
        if dst.is_floating_point:
            return x.to(dst).mul_(1.0 / _max_value(src))
        info = torch.iinfo(dst)
        return (x * _max_value(dst)).round_().clamp_(info.min, info.max).to(dst)

    def __repr__(self) -> str:
        return f"ToDtype({self.dtype}, scale={self.scale}, keys={self.keys})"


class ChannelsLast(_EachKey):
    """Store 4-D keys in ``torch.channels_last`` memory format (faster convolutions)."""

    def __init__(self, *, keys: str | Sequence[str] = ("image",)) -> None:
        self.keys = as_keys(keys)

    def _convert(self, key: str, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"ChannelsLast: key {key!r} must be 4-D, got {tuple(x.shape)}")
        return x.contiguous(memory_format=torch.channels_last)

    def __repr__(self) -> str:
        return f"ChannelsLast(keys={self.keys})"

