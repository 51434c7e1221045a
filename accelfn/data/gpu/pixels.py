"""Pixel values and layout: normalisation, dtype casts, the channels-last memory format."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from tensordict import TensorDictBase

from .base import as_keys, image

__all__ = ["ChannelsLast", "Normalize", "ToDtype"]


def _max_value(dtype: torch.dtype) -> float:
    if dtype.is_floating_point or dtype == torch.bool:
        return 1.0
    return float(torch.iinfo(dtype).max)


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
    """``(x / max - mean) / std`` per channel, output in ``dtype``, bitwise as torchvision.

    Integer inputs (uint8 images) are first scaled to ``[0, 1]`` by their dtype's maximum
    (255), so ``Normalize`` on raw uint8 batches equals ``ToDtype(dtype, scale=True)``
    followed by ``torchvision``'s ``Normalize``, bit for bit: the same three roundings (scale,
    subtract, divide), in as many passes over the batch as a fused scale-and-shift would take
    (the scale writes the output dtype directly; float64 output takes one more pass). Floating
    inputs are taken as already in ``[0, 1]``-scale: a cast to ``dtype``, then torchvision's
    subtract and divide.

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
        self._cache: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _coeffs(self, device: torch.device, ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, ndim)
        if key not in self._cache:
            shape = (1, len(self.mean)) + (1,) * (ndim - 2)
            mean = torch.tensor(self.mean, dtype=self.dtype).view(shape).to(device)
            std = torch.tensor(self.std, dtype=self.dtype).view(shape).to(device)
            self._cache[key] = (mean, std)
        return self._cache[key]

    def _convert(self, key: str, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != len(self.mean):
            raise ValueError(
                f"Normalize: key {key!r} has {x.shape[1]} channels (dim 1) but mean/std "
                f"have {len(self.mean)}"
            )
        mean, std = self._coeffs(x.device, x.dim())
        if x.dtype.is_floating_point:
            y = x.to(self.dtype, copy=True)
        else:
            c = 1.0 / _max_value(x.dtype)
            if self.dtype != torch.float64 and torch.result_type(x, c) == torch.float32:
                # One pass: computed in float32 and rounded to ``dtype`` on store, which is
                # what ``x.to(dtype).mul_(c)`` computes too (float32 arithmetic for 16-bit
                # floats), without the separate cast.
                y = torch.mul(x, c, out=torch.empty_like(x, dtype=self.dtype))
            else:
                y = x.to(self.dtype).mul_(c)
        return y.sub_(mean).div_(std)

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, keys={self.keys})"


# Value bits of the integer dtypes ``ToDtype(scale=True)`` rescales (torchvision's table).
_INT_BITS = {
    torch.uint8: 8,
    torch.int8: 7,
    torch.int16: 15,
    torch.uint16: 16,
    torch.int32: 31,
    torch.int64: 63,
}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Refused by torchvision: the float cannot hold every integer of the range.
_UNSAFE = {
    (torch.float32, torch.int32),
    (torch.float32, torch.int64),
    (torch.float64, torch.int64),
}


def _scalable(dtype: torch.dtype, src: bool) -> bool:
    return dtype in _INT_BITS or dtype in _FLOATS or (src and dtype == torch.bool)


def _largest_at_most(n: int, dtype: torch.dtype) -> float:
    """The largest value of the floating ``dtype`` that is at most the integer ``n > 0``."""
    digits = round(-math.log2(torch.finfo(dtype).eps)) + 1  # significand bits
    drop = n.bit_length() - digits
    return float(n if drop <= 0 else (n >> drop) << drop)


class ToDtype(_EachKey):
    """Cast keys to ``dtype``; with ``scale``, rescale value ranges as torchvision does.

    Bitwise equal to ``torchvision.transforms.v2.functional.to_dtype(x, dtype, scale)``:

    - ``scale=False``, or float -> float: a plain cast.
    - int -> float: ``x.to(dtype) * (1 / max(x.dtype))`` (uint8: divide by 255).
    - float -> int: ``x * (max(dtype) + 1 - 1e-3)`` truncated, so ``[0, 1]`` spreads evenly
      over ``0..max`` (0.5 -> 127 for uint8). Where torchvision's product falls outside the
      integer range its cast overflows (float32 1.0 -> uint16 gives 0, bfloat16 1.0 -> uint8
      gives 0); here it saturates (65535, 255): the one difference. float32 -> int32/int64 and
      float64 -> int64 are refused as in torchvision, and float16 -> uint16/int32/int64 too
      (float16 cannot hold the scaled values).
    - int -> int: a shift by the difference in value bits (uint8 -> int16: ``<< 7``).

    ``scale=True`` takes the floating dtypes float16, bfloat16, float32, float64 and the
    integer dtypes uint8, int8, int16, uint16, int32, int64 (bool as input for float output).
    """

    MIN_DIM = 0

    def __init__(
        self, dtype: torch.dtype, *, scale: bool = False, keys: str | Sequence[str] = ("image",)
    ) -> None:
        if scale and not _scalable(dtype, src=False):
            raise TypeError(self._unscalable(dtype))
        self.dtype = dtype
        self.scale = scale
        self.keys = as_keys(keys)

    @staticmethod
    def _unscalable(dtype: torch.dtype) -> str:
        return (
            f"ToDtype with scale=True rescales float16, bfloat16, float32, float64, uint8, "
            f"int8, int16, uint16, int32 and int64 (and bool to a float), not {dtype}; cast it "
            "with scale=False"
        )

    def _convert(self, key: str, x: torch.Tensor) -> torch.Tensor:
        src, dst = x.dtype, self.dtype
        if src == dst:
            return x
        if not self.scale:
            return x.to(dst)
        if not _scalable(src, src=True) or (src == torch.bool and not dst.is_floating_point):
            raise TypeError(f"ToDtype: key {key!r}: " + self._unscalable(src))
        if dst.is_floating_point:
            if src.is_floating_point:
                return x.to(dst)
            return x.to(dst).mul_(1.0 / _max_value(src))
        info = torch.iinfo(dst)
        if src.is_floating_point:
            k = float(info.max) + 1.0 - 1e-3
            if (src, dst) in _UNSAFE or k > torch.finfo(src).max:
                raise TypeError(
                    f"ToDtype: key {key!r} ({src}) cannot be converted safely to {dst} with "
                    "scale=True (torchvision refuses it too); convert to a smaller integer "
                    "dtype, or cast to float64 first (ToDtype(torch.float64)) for int32"
                )
            hi = _largest_at_most(info.max, src)
            return x.mul(k).clamp_(info.min, hi).to(dst)
        shift = _INT_BITS[dst] - _INT_BITS[src]
        if shift < 0:
            if src == torch.uint16:  # no bit shifts for uint16 (as torchvision)
                return (x / (1 << -shift)).to(dst)
            return x.bitwise_right_shift(-shift).to(dst)
        if dst == torch.uint16:
            return x.to(dst) * (1 << shift)
        return x.to(dst).bitwise_left_shift_(shift)

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

