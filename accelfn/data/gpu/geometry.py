"""Geometry on whole batches, with per-sample parameters: random crops and flips."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tensordict import TensorDictBase

from .base import as_keys, as_pair, same_size_images, uniform

__all__ = ["RandomCrop", "RandomHorizontalFlip", "RandomResizedCrop"]


# torchvision's padding modes (and torch's name for "edge") -> torch.nn.functional.pad's.
_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate",
              "replicate": "replicate"}


def _padding(padding: int | Sequence[int]) -> tuple[int, int, int, int]:
    """torchvision's ``padding`` (int, ``[p]``, ``[lr, tb]``, ``[l, t, r, b]``) as
    ``(left, top, right, bottom)``."""
    if isinstance(padding, int) and not isinstance(padding, bool):
        values: tuple[int, ...] = (padding,) * 4
    elif (
        isinstance(padding, Sequence)
        and not isinstance(padding, str)
        and len(padding) in (1, 2, 4)
        and all(isinstance(p, int) and not isinstance(p, bool) for p in padding)
    ):
        values = tuple(padding)
        values = values * 4 if len(values) == 1 else values * 2 if len(values) == 2 else values
    else:
        values = ()
    if len(values) != 4 or min(values) < 0:
        raise ValueError(
            "RandomCrop: padding must be an int or a sequence of 1, 2 or 4 ints >= 0, in "
            "torchvision's order (every side; [left_right, top_bottom]; [left, top, right, "
            f"bottom]), got {padding!r}"
        )
    return values[0], values[1], values[2], values[3]


class RandomCrop:
    """Pad by ``padding`` then crop ``size`` at a random offset, independently per sample.

    Equivalent to ``torchvision.transforms.v2.RandomCrop(size, padding, fill=fill,
    padding_mode=padding_mode)`` applied to each sample with a for-loop, but done as one
    ``gather`` over the batch. Keeps the dtype (uint8 stays uint8).

    Args:
        size: output ``(height, width)`` (or one int).
        padding: pixels added, in torchvision's order: an int (every side), ``[p]`` (every
            side), ``[left_right, top_bottom]``, or ``[left, top, right, bottom]``.
        fill: value of constant padding.
        padding_mode: ``"constant"``, ``"reflect"`` or ``"edge"`` (``"replicate"``, torch's
            name for it, is accepted too); torchvision's ``"symmetric"`` is not supported.
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
        self.size = as_pair(size, "size")
        self.padding = _padding(padding)
        if padding_mode not in _PAD_MODES:
            raise ValueError(
                "RandomCrop: padding_mode must be 'constant', 'reflect', 'edge' (or torch's "
                f"name for it, 'replicate'), got {padding_mode!r}; 'symmetric' is not supported"
            )
        self.fill = fill
        self.padding_mode = padding_mode
        self.keys = as_keys(keys)

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        xs = same_size_images(batch, self.keys, "RandomCrop")
        b, device = xs[0].shape[0], xs[0].device
        left, top, right, bottom = self.padding
        th, tw = self.size
        hp, wp = xs[0].shape[-2] + top + bottom, xs[0].shape[-1] + left + right
        if th > hp or tw > wp:
            raise ValueError(
                f"RandomCrop: crop size {self.size} is larger than the padded image "
                f"({hp}, {wp}); lower size or raise padding"
            )
        oy = (uniform(b, generator, device, "RandomCrop") * (hp - th + 1)).long()
        ox = (uniform(b, generator, device, "RandomCrop") * (wp - tw + 1)).long()
        rows = oy[:, None] + torch.arange(th, device=device)
        cols = ox[:, None] + torch.arange(tw, device=device)
        flat = (rows[:, :, None] * wp + cols[:, None, :]).reshape(b, 1, th * tw)
        out = batch.copy()
        for k, x in zip(self.keys, xs):
            lead = x.shape[1:-2]
            x = x.reshape(b, -1, *x.shape[-2:])
            if any(self.padding):
                pad = (left, right, top, bottom)
                if self.padding_mode == "constant":
                    x = F.pad(x, pad, value=self.fill)
                else:
                    x = F.pad(x, pad, mode=_PAD_MODES[self.padding_mode])
            x = x.reshape(b, x.shape[1], hp * wp)
            y = x.gather(2, flat.expand(b, x.shape[1], th * tw))
            out.set(k, y.reshape(b, *lead, th, tw))
        return out

    def __repr__(self) -> str:
        return (
            f"RandomCrop(size={self.size}, padding={self.padding}, fill={self.fill}, "
            f"padding_mode={self.padding_mode!r}, keys={self.keys})"
        )


def _taps(
    n_out: int, size: int, start: torch.Tensor, length: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of ``n_out`` outputs reads along one axis of ``size`` pixels, resampling the
    span ``[start, start + length)`` of each sample (float ``(b,)``, integer-valued): source
    indices ``(b, n_out, taps)`` and their weights, ``dtype``.

    The weights are those of ``torch.nn.functional.interpolate(mode="bilinear",
    align_corners=False, antialias=True)`` of the span alone (a triangle filter widened by
    the scale when shrinking, truncated at the span's ends and normalised): plain bilinear
    interpolation when enlarging. Every index is inside the span; a tap past the span's end
    has weight 0 and reads the span's last pixel.
    """
    device = start.device
    length = length.to(dtype)
    scale = (length / n_out)[:, None]  # (b, 1): input pixels per output pixel
    support = scale.clamp(min=1.0)  # the filter's half-width in input pixels
    center = scale * (torch.arange(n_out, device=device, dtype=dtype) + 0.5)  # (b, n_out)
    # the first pixel within the support: as torch's (int64)(center - support + 0.5), >= 0
    first = (center - support + 0.5).floor().clamp_(min=0)
    # the support, an open interval 2 * support wide, holds at most ceil(2 * support) pixels;
    # the widest span is the whole axis
    taps = min(size, math.ceil(2 * max(size / n_out, 1.0)))
    j = first[..., None] + torch.arange(taps, device=device, dtype=dtype)  # (b, n_out, taps)
    w = (1 - ((j - center[..., None] + 0.5) / support[..., None]).abs()).clamp_(min=0)
    w = torch.where(j < length[:, None, None], w, 0)
    total = w[..., 0]
    for k in range(1, taps):  # in a fixed order, whatever the batch (no reduction kernel)
        total = total + w[..., k]
    w = w / total[..., None]
    index = torch.minimum(j, (length - 1)[:, None, None]) + start.to(dtype)[:, None, None]
    return index.long(), w


def _resample_rows(x: torch.Tensor, index: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Resample ``x`` ``(b, c, n, m)`` along ``n`` with ``_taps``' ``index`` and weights ``w``
    ``(b, n_out, taps)``: ``(b, c, n_out, m)``, the weighted rows added in tap order."""
    b, c, n, m = x.shape
    n_out, taps = index.shape[1:]
    lines = x.reshape(b * c * n, m)
    base = n * torch.arange(b * c, device=index.device).view(b, c, 1)
    out = x.new_empty(b, c, n_out, m)
    part = torch.empty_like(out) if taps > 1 else out
    for k in range(taps):  # in a fixed order, whatever the batch (no reduction kernel)
        dst = out if k == 0 else part
        rows = (base + index[:, None, :, k]).reshape(-1)
        torch.index_select(lines, 0, rows, out=dst.view(b * c * n_out, m))
        dst.mul_(w[:, None, :, k, None])
        if k:
            out.add_(part)
    return out


def resized_crops(x: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The box ``(x1, y1, x2, y2)`` (integer-valued floats, ``(b, 4)``) of each image of ``x``
    ``(b, c, h, w)``, resized to ``size``: float32 (float64 for float64 ``x``).

    Per sample, ``torchvision.transforms.v2.functional.resized_crop(x[i], y1, x1, y2 - y1,
    x2 - x1, size, antialias=True)`` (crop, then ``interpolate(mode="bilinear",
    antialias=True)``: bilinear when enlarging, the triangle filter widened to the scale when
    shrinking) up to float rounding; only pixels inside the box are read. Separable and
    batched (per axis and filter tap: one selection of rows, a multiply and an add, with
    per-sample weights), no host sync; each sample's result does not depend on the others in
    the batch.
    """
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    _, _, height, width = x.shape
    th, tw = size
    x1, y1, x2, y2 = boxes.unbind(1)
    # columns first, as rows of the transposed image (transposed before the conversion of
    # integer pixels: the smaller copy), then the rows of the result
    cols = x.transpose(2, 3).contiguous().to(work)
    y = _resample_rows(cols, *_taps(tw, width, x1, x2 - x1, work))  # (b, c, tw, height)
    y = y.transpose(2, 3).contiguous()
    return _resample_rows(y, *_taps(th, height, y1, y2 - y1, work))


class RandomResizedCrop:
    """Crop a random area and aspect ratio, then resize to ``size``, independently per sample.

    The box is drawn as in ``torchvision.transforms.v2.RandomResizedCrop`` (area fraction
    uniform in ``scale``, log-aspect uniform in ``log(ratio)``, 10 tries, then a centre crop
    clamped to ``ratio``), vectorised over the batch. Images are resampled as torchvision's
    ``resized_crop(..., antialias=True)`` (its default) does it per sample: the box alone,
    resized with ``interpolate(mode="bilinear", align_corners=False, antialias=True)``
    (bilinear when enlarging, the triangle filter widened to the scale when shrinking), so
    only pixels inside the box are read, at its edges too. Batched and separable, with
    per-sample weights (no loop over samples, no host sync); float32 and float64 images are
    resampled in their dtype, others in float32, and integer images rounded back to their
    dtype. Compared with ``torchvision.transforms.v2.functional.resized_crop(x[i], y1, x1,
    y2 - y1, x2 - x1, size, antialias=True)`` with the same box (tested on the CPU): float32
    images in [0, 1] within 1e-5 (measured: 4e-7), float64 within float64 rounding, uint8
    images within one level (torchvision resizes uint8 on the CPU with fixed-point weights).
    The ``nearest`` keys (segmentation masks, label maps) are
    resampled with nearest-neighbour sampling instead, as one ``gather`` from the same boxes:
    values stay in their label set, dtype kept, bitwise equal to torchvision's
    ``resized_crop`` of a ``tv_tensors.Mask`` (``InterpolationMode.NEAREST``).

    Args:
        size: output ``(height, width)`` (or one int).
        scale: range of the crop's area as a fraction of the image.
        ratio: range of the crop's aspect ratio (width / height).
        keys: batch keys to crop (all with the same boxes per sample).
        nearest: the keys among ``keys`` resampled with nearest-neighbour sampling; by
            default ``"mask"`` if it is one of ``keys``, else none. ``nearest=()`` resamples
            every key bilinearly.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        *,
        keys: str | Sequence[str] = ("image",),
        nearest: str | Sequence[str] | None = None,
    ) -> None:
        self.size = as_pair(size, "size")
        self.keys = as_keys(keys)
        if nearest is None:
            self.nearest: tuple[str, ...] = ("mask",) if "mask" in self.keys else ()
        else:
            self.nearest = (nearest,) if isinstance(nearest, str) else tuple(nearest)
        missing = [k for k in self.nearest if k not in self.keys]
        if missing:
            raise ValueError(
                f"RandomResizedCrop: nearest names {missing}, which are not among keys "
                f"{self.keys}; add them to keys or leave them out of nearest"
            )
        if not (0 < scale[0] <= scale[1] <= 1):
            raise ValueError(f"scale must satisfy 0 < low <= high <= 1, got {scale}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"ratio must satisfy 0 < low <= high, got {ratio}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))

    def boxes(
        self, b: int, height: int, width: int, generator: torch.Generator | None,
        device: torch.device,
    ) -> torch.Tensor:
        """Draw ``b`` crop boxes ``(x1, y1, x2, y2)`` in pixels, float32, shape ``(b, 4)``."""
        return self._draw(b, height, width, self._fallback(height, width), generator, device)

    def boxes_per_sample(
        self, sizes: Sequence[tuple[int, int]], generator: torch.Generator | None,
        device: torch.device,
    ) -> torch.Tensor:
        """Draw one box per ``(height, width)`` of ``sizes``, each in its own image (images
        of different sizes, e.g. decoded JPEGs): float32 ``(len(sizes), 4)`` on ``device``.

        Sizes all equal give the boxes of [`boxes`][] for that size, bitwise, from the same
        generator state. The sizes go to the device in one non-blocking copy (no host sync).
        """
        table = torch.tensor(
            [(h, w, *self._fallback(h, w)) for h, w in sizes], dtype=torch.float32
        ).view(-1, 6)
        if device.type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        else:
            table = table.to(device)
        height, width, fw, fh, fx, fy = table.unbind(1)
        return self._draw(len(sizes), height, width, (fw, fh, fx, fy), generator, device)

    def _fallback(self, height: int, width: int) -> tuple[int, int, int, int]:
        """``(width, height, left, top)`` of the largest centred crop whose aspect ratio is
        within ``ratio`` (torchvision's box when no try fits)."""
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            fw, fh = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            fw, fh = round(height * self.ratio[1]), height
        else:
            fw, fh = width, height
        return fw, fh, (width - fw) // 2, (height - fh) // 2

    def _draw(
        self, b: int, height: int | torch.Tensor, width: int | torch.Tensor,
        fallback: tuple[int | torch.Tensor, ...], generator: torch.Generator | None,
        device: torch.device,
    ) -> torch.Tensor:
        """The boxes of images of one size (``height``, ``width`` ints) or of a size each
        (float32 tensors ``(b,)``), ``fallback`` the ``(w, h, x, y)`` used when no try fits."""
        tries = 10
        if isinstance(height, torch.Tensor) and isinstance(width, torch.Tensor):
            # float32 products of exact integers round as the int product cast to float32
            area: float | torch.Tensor = (height * width)[:, None]
            h_max: int | torch.Tensor = height[:, None]
            w_max: int | torch.Tensor = width[:, None]
        else:
            area, h_max, w_max = float(height * width), height, width
        u = uniform(b * tries * 4, generator, device, "RandomResizedCrop").view(4, b, tries)
        target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[0])
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = torch.exp(lo + (hi - lo) * u[1])
        w = torch.sqrt(target * aspect).round()
        h = torch.sqrt(target / aspect).round()
        ok = (w > 0) & (h > 0) & (w <= w_max) & (h <= h_max)
        first = ok.int().argmax(dim=1, keepdim=True)
        any_ok = ok.any(dim=1)
        w = w.gather(1, first).squeeze(1)
        h = h.gather(1, first).squeeze(1)
        ty = (u[2].gather(1, first).squeeze(1) * (height - h + 1)).floor()
        tx = (u[3].gather(1, first).squeeze(1) * (width - w + 1)).floor()
        fw, fh, fx, fy = (
            f if isinstance(f, torch.Tensor) else torch.full_like(w, f) for f in fallback
        )
        w = torch.where(any_ok, w, fw)
        h = torch.where(any_ok, h, fh)
        ty = torch.where(any_ok, ty, fy)
        tx = torch.where(any_ok, tx, fx)
        return torch.stack([tx, ty, tx + w, ty + h], dim=1)

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        xs = same_size_images(batch, self.keys, "RandomResizedCrop")
        b, device = xs[0].shape[0], xs[0].device
        height, width = xs[0].shape[-2:]
        boxes = self.boxes(b, height, width, generator, device)
        flat = self._nearest_index(boxes, width) if self.nearest else None
        out = batch.copy()
        for k, x in zip(self.keys, xs):
            lead = x.shape[1:-2]
            x4 = x.reshape(b, -1, height, width)
            if flat is not None and k in self.nearest:
                x3 = x4.reshape(b, x4.shape[1], height * width)
                y = x3.gather(2, flat.expand(b, x3.shape[1], flat.shape[-1]))
                out.set(k, y.reshape(b, *lead, *self.size))
                continue
            y = resized_crops(x4, boxes, self.size)
            if not x.dtype.is_floating_point:
                info = torch.iinfo(x.dtype)
                y = y.round_().clamp_(info.min, info.max)
            out.set(k, y.to(x.dtype).reshape(b, *lead, *self.size))
        return out

    def _nearest_index(self, boxes: torch.Tensor, width: int) -> torch.Tensor:
        """Flat source indices ``(b, 1, out_h * out_w)`` of nearest-neighbour resampling.

        As ``torch.nn.functional.interpolate(mode="nearest")`` computes them, in float32:
        ``min(floor(i * (in / out)), in - 1)`` along each axis, offset by the box's corner.
        """
        th, tw = self.size
        starts = boxes[:, :2].long()
        extent = (boxes[:, 2:] - boxes[:, :2]).float()  # (w, h), integer-valued

        def axis(n: int, length: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
            scale = (length / n)[:, None]
            i = torch.arange(n, device=boxes.device, dtype=torch.float32)
            src = (i * scale).floor_().long()
            return torch.minimum(src, length.long()[:, None] - 1) + start[:, None]

        rows = axis(th, extent[:, 1], starts[:, 1])
        cols = axis(tw, extent[:, 0], starts[:, 0])
        return (rows[:, :, None] * width + cols[:, None, :]).reshape(boxes.shape[0], 1, th * tw)

    def __repr__(self) -> str:
        return (
            f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"keys={self.keys}, nearest={self.nearest})"
        )


# Flipped by selection: bool, and the unsigned types wider than uint8, which torch cannot
# multiply or add.
_SELECTED = (torch.bool, torch.uint16, torch.uint32, torch.uint64)


class RandomHorizontalFlip:
    """Mirror each sample left-right with probability ``p`` (one masked select, no loop).

    Per sample, bitwise ``torchvision.transforms.v2.functional.horizontal_flip`` (or the
    sample unchanged), for every dtype (floats, bool, signed and unsigned integers of every
    width).
    """

    def __init__(self, p: float = 0.5, *, keys: str | Sequence[str] = ("image",)) -> None:
        if not 0 <= p <= 1:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.p = float(p)
        self.keys = as_keys(keys)

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        xs = same_size_images(batch, self.keys, "RandomHorizontalFlip")
        b, device = xs[0].shape[0], xs[0].device
        flip = uniform(b, generator, device, "RandomHorizontalFlip") < self.p
        out = batch.copy()
        for k, x in zip(self.keys, xs):
            mask = flip.view(b, *([1] * (x.dim() - 1)))
            if x.dtype.is_floating_point or x.dtype in _SELECTED:
                y = torch.where(mask, x.flip(-1), x)
            else:
                # Exact for integers (one term is always zero) and faster than torch.where
                # on CPU for uint8; not used for floats, where 0 * inf would give nan.
                m = mask.to(x.dtype)
                y = x.flip(-1) * m + x * (1 - m)
            out.set(k, y)
        return out

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p}, keys={self.keys})"

