"""Batch transforms that run on whole batches, on whichever device the batch is on.

Each transform is a callable ``t(batch, generator=None) -> batch`` over a TensorDict whose
image keys hold ``(batch, channels, height, width)`` tensors (uint8 or floating point). Random
transforms draw one set of parameters **per sample** from ``generator`` (a ``torch.Generator``
on the batch's device; the loader seeds one per batch from ``seed``, epoch and batch number),
with no per-sample Python loop: crops are index arithmetic + one ``gather``, resized crops one
``roi_align`` call, flips one masked select. When several keys are listed (e.g. an image and
its segmentation mask), they all get the same per-sample parameters.

The same code runs on the CPU (tests) and on CUDA, so both give the same distributions.
:class:`DecodeJPEG` is the exception to "on the device": it needs the encoded bytes on the
host and writes the decoded images to the device; the loader keeps its ``host_keys`` on the
CPU.

Compose them with :class:`Compose`; any callable ``f(batch) -> batch`` can be mixed in.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase

__all__ = [
    "BatchTransform",
    "ChannelsLast",
    "Compose",
    "DecodeJPEG",
    "Normalize",
    "RandomCrop",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "ToDtype",
    "accepts_generator",
    "host_keys",
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


def _keys(keys: str | Sequence[str]) -> tuple[str, ...]:
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    if not keys:
        raise ValueError("keys must name at least one key of the batch")
    return keys


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    if isinstance(value, int):
        value = (value, value)
    value = tuple(int(v) for v in value)
    if len(value) != 2 or min(value) < 0:
        raise ValueError(f"{name} must be an int or a (height, width) pair >= 0, got {value}")
    return value  # type: ignore[return-value]


def _get(batch: TensorDictBase, key: str, who: str, min_dim: int = 4) -> torch.Tensor:
    if key not in batch.keys():
        raise ValueError(
            f"{who}: the batch has no key {key!r} (keys: {sorted(batch.keys())}); pass "
            "keys=... naming the image keys"
        )
    x = batch.get(key)
    if x.dim() < min_dim:
        raise ValueError(
            f"{who}: key {key!r} has shape {tuple(x.shape)}; expected (batch, channels, "
            "height, width)"
        )
    return x


def _rand(n: int, generator: torch.Generator | None, device: torch.device, who: str):
    if generator is not None and generator.device.type != device.type:
        raise ValueError(
            f"{who}: the generator is on {generator.device} but the batch is on {device}; "
            "create it with torch.Generator(device=batch.device)"
        )
    return torch.rand(n, generator=generator, device=device)


def _spatial(batch: TensorDictBase, keys: tuple[str, ...], who: str):
    xs = [_get(batch, k, who) for k in keys]
    hw = xs[0].shape[-2:]
    for k, x in zip(keys, xs):
        if x.shape[-2:] != hw or x.shape[0] != xs[0].shape[0]:
            raise ValueError(
                f"{who}: keys {keys} must share batch and spatial size, but {k!r} has shape "
                f"{tuple(x.shape)} and {keys[0]!r} has {tuple(xs[0].shape)}"
            )
    return xs


class Compose:
    """Apply transforms in order, passing the same generator to those that take one.

    ``Compose(a, b, c)(batch, generator=g)`` is ``c(b(a(batch, generator=g), ...), ...)``.
    Plain callables ``f(batch) -> batch`` may be mixed in.
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
        for t, takes in zip(self.transforms, self._takes_gen):
            batch = t(batch, generator=generator) if takes else t(batch)
            if not isinstance(batch, TensorDictBase):
                raise TypeError(f"{t!r} returned {type(batch).__name__}, not a TensorDict")
        return batch

    def __repr__(self) -> str:
        inner = ", ".join(repr(t) for t in self.transforms)
        return f"Compose({inner})"


class RandomCrop:
    """Pad by ``padding`` then crop ``size`` at a random offset, independently per sample.

    Equivalent to ``torchvision.transforms.v2.RandomCrop(size, padding, fill=fill,
    padding_mode=padding_mode)`` applied to each sample with a for-loop, but done as one
    ``gather`` over the batch. Keeps the dtype (uint8 stays uint8).

    Args:
        size: output ``(height, width)`` (or one int).
        padding: pixels added on each side: int or ``(vertical, horizontal)``.
        fill: value of constant padding.
        padding_mode: ``"constant"``, ``"reflect"`` or ``"replicate"``.
        keys: batch keys to crop (all with the same offsets per sample).
    """

    def __init__(
        self,
        size: int | Sequence[int],
        padding: int | Sequence[int] = 0,
        *,
        fill: float = 0,
        padding_mode: str = "constant",
        keys: str | Sequence[str] = ("image",),
    ) -> None:
        self.size = _pair(size, "size")
        self.padding = _pair(padding, "padding")
        if padding_mode not in ("constant", "reflect", "replicate"):
            raise ValueError(
                f"padding_mode must be 'constant', 'reflect' or 'replicate', got {padding_mode!r}"
            )
        self.fill = fill
        self.padding_mode = padding_mode
        self.keys = _keys(keys)

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        xs = _spatial(batch, self.keys, "RandomCrop")
        b, device = xs[0].shape[0], xs[0].device
        ph, pw = self.padding
        th, tw = self.size
        hp, wp = xs[0].shape[-2] + 2 * ph, xs[0].shape[-1] + 2 * pw
        if th > hp or tw > wp:
            raise ValueError(
                f"RandomCrop: crop size {self.size} is larger than the padded image "
                f"({hp}, {wp}); lower size or raise padding"
            )
        oy = (_rand(b, generator, device, "RandomCrop") * (hp - th + 1)).long()
        ox = (_rand(b, generator, device, "RandomCrop") * (wp - tw + 1)).long()
        rows = oy[:, None] + torch.arange(th, device=device)
        cols = ox[:, None] + torch.arange(tw, device=device)
        flat = (rows[:, :, None] * wp + cols[:, None, :]).reshape(b, 1, th * tw)
        out = batch.copy()
        for k, x in zip(self.keys, xs):
            lead = x.shape[1:-2]
            x = x.reshape(b, -1, *x.shape[-2:])
            if ph or pw:
                pad = (pw, pw, ph, ph)
                if self.padding_mode == "constant":
                    x = F.pad(x, pad, value=self.fill)
                else:
                    x = F.pad(x, pad, mode=self.padding_mode)
            x = x.reshape(b, x.shape[1], hp * wp)
            y = x.gather(2, flat.expand(b, x.shape[1], th * tw))
            out.set(k, y.reshape(b, *lead, th, tw))
        return out

    def __repr__(self) -> str:
        return f"RandomCrop(size={self.size}, padding={self.padding}, keys={self.keys})"


class RandomResizedCrop:
    """Crop a random area and aspect ratio, then resize to ``size``, independently per sample.

    The box is drawn as in ``torchvision.transforms.v2.RandomResizedCrop`` (area fraction
    uniform in ``scale``, log-aspect uniform in ``log(ratio)``, 10 tries, then a centre crop
    clamped to ``ratio``), vectorised over the batch. Resampling is one
    ``torchvision.ops.roi_align`` call (bilinear, averaging several points per output pixel
    when shrinking, which acts as antialiasing). Integer inputs are resampled in float32 and
    rounded back to their dtype.

    Args:
        size: output ``(height, width)`` (or one int).
        scale: range of the crop's area as a fraction of the image.
        ratio: range of the crop's aspect ratio (width / height).
        keys: batch keys to crop (all with the same boxes per sample).
    """

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        *,
        keys: str | Sequence[str] = ("image",),
    ) -> None:
        self.size = _pair(size, "size")
        if not (0 < scale[0] <= scale[1] <= 1):
            raise ValueError(f"scale must satisfy 0 < low <= high <= 1, got {scale}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"ratio must satisfy 0 < low <= high, got {ratio}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.keys = _keys(keys)

    def boxes(
        self, b: int, height: int, width: int, generator: torch.Generator | None,
        device: torch.device,
    ) -> torch.Tensor:
        """Draw ``b`` crop boxes ``(x1, y1, x2, y2)`` in pixels, float32, shape ``(b, 4)``."""
        tries = 10
        area = float(height * width)
        u = _rand(b * tries * 4, generator, device, "RandomResizedCrop").view(4, b, tries)
        target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[0])
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = torch.exp(lo + (hi - lo) * u[1])
        w = torch.sqrt(target * aspect).round()
        h = torch.sqrt(target / aspect).round()
        ok = (w > 0) & (h > 0) & (w <= width) & (h <= height)
        first = ok.int().argmax(dim=1, keepdim=True)
        any_ok = ok.any(dim=1)
        w = w.gather(1, first).squeeze(1)
        h = h.gather(1, first).squeeze(1)
        ty = (u[2].gather(1, first).squeeze(1) * (height - h + 1)).floor()
        tx = (u[3].gather(1, first).squeeze(1) * (width - w + 1)).floor()
        # Fallback: the largest centred crop whose aspect ratio is within ``ratio``.
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            fw, fh = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            fw, fh = round(height * self.ratio[1]), height
        else:
            fw, fh = width, height
        fy, fx = (height - fh) // 2, (width - fw) // 2
        w = torch.where(any_ok, w, torch.full_like(w, fw))
        h = torch.where(any_ok, h, torch.full_like(h, fh))
        ty = torch.where(any_ok, ty, torch.full_like(ty, fy))
        tx = torch.where(any_ok, tx, torch.full_like(tx, fx))
        return torch.stack([tx, ty, tx + w, ty + h], dim=1)

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        from torchvision.ops import roi_align

        xs = _spatial(batch, self.keys, "RandomResizedCrop")
        b, device = xs[0].shape[0], xs[0].device
        height, width = xs[0].shape[-2:]
        boxes = self.boxes(b, height, width, generator, device)
        rois = torch.cat([torch.arange(b, device=device, dtype=boxes.dtype)[:, None], boxes], 1)
        out = batch.copy()
        for k, x in zip(self.keys, xs):
            lead = x.shape[1:-2]
            x4 = x.reshape(b, -1, height, width)
            work = x4 if x4.dtype in (torch.float32, torch.float64) else x4.float()
            y = roi_align(work, rois.to(work.dtype), self.size, 1.0, -1, True)
            if not x.dtype.is_floating_point:
                info = torch.iinfo(x.dtype)
                y = y.round_().clamp_(info.min, info.max)
            out.set(k, y.to(x.dtype).reshape(b, *lead, *self.size))
        return out

    def __repr__(self) -> str:
        return (
            f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"keys={self.keys})"
        )


class RandomHorizontalFlip:
    """Mirror each sample left-right with probability ``p`` (one masked select, no loop)."""

    def __init__(self, p: float = 0.5, *, keys: str | Sequence[str] = ("image",)) -> None:
        if not 0 <= p <= 1:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.p = float(p)
        self.keys = _keys(keys)

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        xs = _spatial(batch, self.keys, "RandomHorizontalFlip")
        b, device = xs[0].shape[0], xs[0].device
        flip = _rand(b, generator, device, "RandomHorizontalFlip") < self.p
        out = batch.copy()
        for k, x in zip(self.keys, xs):
            mask = flip.view(b, *([1] * (x.dim() - 1)))
            if x.dtype.is_floating_point or x.dtype == torch.bool:
                y = torch.where(mask, x.flip(-1), x)
            else:
                # Exact for integers (one term is always zero) and several times faster than
                # torch.where on CPU; not used for floats, where 0 * inf would give nan.
                m = mask.to(x.dtype)
                y = x.flip(-1) * m + x * (1 - m)
            out.set(k, y)
        return out

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p}, keys={self.keys})"


def _max_value(dtype: torch.dtype) -> float:
    return 1.0 if dtype.is_floating_point else float(torch.iinfo(dtype).max)


class Normalize:
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
        self.keys = _keys(keys)
        self._cache: dict[tuple[torch.device, torch.dtype, int], tuple[torch.Tensor, ...]] = {}

    def _coeffs(self, device: torch.device, in_dtype: torch.dtype, ndim: int):
        key = (device, in_dtype, ndim)
        if key not in self._cache:
            top = _max_value(in_dtype)
            shape = (1, len(self.mean)) + (1,) * (ndim - 2)
            scale = torch.tensor([1.0 / (top * s) for s in self.std], dtype=self.dtype)
            shift = torch.tensor([-m / s for m, s in zip(self.mean, self.std)], dtype=self.dtype)
            self._cache[key] = (scale.view(shape).to(device), shift.view(shape).to(device))
        return self._cache[key]

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        out = batch.copy()
        for k in self.keys:
            x = _get(batch, k, "Normalize", min_dim=2)
            if x.shape[1] != len(self.mean):
                raise ValueError(
                    f"Normalize: key {k!r} has {x.shape[1]} channels (dim 1) but mean/std "
                    f"have {len(self.mean)}"
                )
            scale, shift = self._coeffs(x.device, x.dtype, x.dim())
            y = x.to(self.dtype, copy=True)
            out.set(k, y.mul_(scale).add_(shift))
        return out

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std}, dtype={self.dtype}, keys={self.keys})"


class ToDtype:
    """Cast keys to ``dtype``; with ``scale``, map integer ranges to ``[0, 1]`` and back.

    ``scale=True``: uint8 -> float divides by 255; float -> uint8 multiplies by 255, rounds and
    clamps (as ``torchvision.transforms.v2.ToDtype(..., scale=True)``).
    """

    def __init__(
        self, dtype: torch.dtype, *, scale: bool = False, keys: str | Sequence[str] = ("image",)
    ) -> None:
        self.dtype = dtype
        self.scale = scale
        self.keys = _keys(keys)

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        out = batch.copy()
        for k in self.keys:
            x = _get(batch, k, "ToDtype", min_dim=0)
            src, dst = x.dtype, self.dtype
            if not self.scale or src.is_floating_point == dst.is_floating_point:
                y = x.to(dst)
            elif dst.is_floating_point:
                y = x.to(dst).mul_(1.0 / _max_value(src))
            else:
                info = torch.iinfo(dst)
                y = (x * _max_value(dst)).round_().clamp_(info.min, info.max).to(dst)
            out.set(k, y)
        return out

    def __repr__(self) -> str:
        return f"ToDtype({self.dtype}, scale={self.scale}, keys={self.keys})"


class ChannelsLast:
    """Store 4-D keys in ``torch.channels_last`` memory format (faster convolutions)."""

    def __init__(self, *, keys: str | Sequence[str] = ("image",)) -> None:
        self.keys = _keys(keys)

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        out = batch.copy()
        for k in self.keys:
            x = _get(batch, k, "ChannelsLast")
            if x.dim() != 4:
                raise ValueError(f"ChannelsLast: key {k!r} must be 4-D, got {tuple(x.shape)}")
            out.set(k, x.contiguous(memory_format=torch.channels_last))
        return out

    def __repr__(self) -> str:
        return f"ChannelsLast(keys={self.keys})"


class DecodeJPEG:
    """Decode a batch of JPEG byte strings with ``torchvision.io.decode_jpeg`` onto a device.

    Input: ``batch[key]``, zero-padded encoded bytes ``(batch, max_length)`` uint8, and
    ``batch[lengths_key]`` (int64, the true length of each) — the layout the loader collates
    for ``ragged_keys`` (e.g. from :class:`accelfn.data.ImageFiles` with ``jpeg=True``). Both
    stay on the host (they are this transform's ``host_keys``); the decoded ``uint8``
    ``(batch, 3, height, width)`` images are written to ``out_key`` on ``device`` (default:
    the device of the batch's other tensors), with nvJPEG's batched decoder on CUDA. The byte
    keys are removed.

    Images of different sizes need ``size``: each is resized (shorter side to fit, antialiased)
    and centre-cropped to ``size`` before stacking (a per-image step: decode output is
    inherently a list).

    Args:
        key: key of the padded encoded bytes.
        lengths_key: key of the byte counts; default ``f"{key}_lengths"``.
        out_key: key for the decoded images.
        size: common ``(height, width)`` for images of different sizes.
        device: where to decode; default the batch's device.
        mode: ``"RGB"`` (3 channels), ``"GRAY"`` or ``"UNCHANGED"``.
    """

    def __init__(
        self,
        key: str = "jpeg",
        *,
        lengths_key: str | None = None,
        out_key: str = "image",
        size: int | Sequence[int] | None = None,
        device: torch.device | str | None = None,
        mode: str = "RGB",
    ) -> None:
        from torchvision.io import ImageReadMode

        if mode not in ("RGB", "GRAY", "UNCHANGED"):
            raise ValueError(f"mode must be 'RGB', 'GRAY' or 'UNCHANGED', got {mode!r}")
        self.key = key
        self.lengths_key = lengths_key or f"{key}_lengths"
        self.out_key = out_key
        self.size = None if size is None else _pair(size, "size")
        self.device = None if device is None else torch.device(device)
        self.mode = getattr(ImageReadMode, mode)
        self.host_keys = (self.key, self.lengths_key)

    def _device(self, batch: TensorDictBase) -> torch.device:
        if self.device is not None:
            return self.device
        if batch.device is not None:
            return batch.device
        for k, v in batch.items(include_nested=True, leaves_only=True):
            if k not in self.host_keys and isinstance(v, torch.Tensor):
                return v.device
        return torch.device("cpu")

    def _fit(self, img: torch.Tensor) -> torch.Tensor:
        from torchvision.transforms.v2.functional import center_crop, resize

        th, tw = self.size  # type: ignore[misc]
        h, w = img.shape[-2:]
        if (h, w) == (th, tw):
            return img
        s = max(th / h, tw / w)
        img = resize(img, [max(th, round(h * s)), max(tw, round(w * s))], antialias=True)
        return center_crop(img, [th, tw])

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        from torchvision.io import decode_jpeg

        data = _get(batch, self.key, "DecodeJPEG", min_dim=2)
        lengths = _get(batch, self.lengths_key, "DecodeJPEG", min_dim=1)
        if data.device.type != "cpu" or lengths.device.type != "cpu":
            raise ValueError(
                f"DecodeJPEG: keys {self.host_keys} must be on the CPU (the decoder reads host "
                "memory); the loader keeps a transform's host_keys there, or move them with "
                ".cpu() before calling"
            )
        if data.dtype != torch.uint8:
            raise TypeError(f"DecodeJPEG: key {self.key!r} must be uint8, got {data.dtype}")
        device = self._device(batch)
        blobs = [data[i, :n] for i, n in enumerate(lengths.tolist())]
        try:
            images = decode_jpeg(blobs, mode=self.mode, device=device)
        except RuntimeError as err:
            for i, blob in enumerate(blobs):
                try:
                    decode_jpeg(blob, mode=self.mode)
                except RuntimeError as one:
                    raise ValueError(
                        f"DecodeJPEG: sample {i} of the batch (key {self.key!r}, "
                        f"{blob.numel()} bytes) is not a decodable JPEG: {one}"
                    ) from None
            raise err
        if self.size is not None:
            images = [self._fit(img) for img in images]
        else:
            shapes = {tuple(img.shape) for img in images}
            if len(shapes) > 1:
                raise ValueError(
                    f"DecodeJPEG: the batch's images have different shapes {sorted(shapes)}; "
                    "pass size=(height, width) to resize and centre-crop them to one size"
                )
        out = batch.exclude(*self.host_keys)
        out.set(self.out_key, torch.stack(images))
        return out

    def __repr__(self) -> str:
        return f"DecodeJPEG({self.key!r} -> {self.out_key!r}, size={self.size})"
