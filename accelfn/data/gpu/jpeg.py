"""JPEG decoding of whole batches with ``torchvision.io.decode_jpeg`` (nvJPEG on CUDA)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDictBase

from .base import as_pair, fit_image, image
from .geometry import RandomResizedCrop, resized_crops

__all__ = ["DecodeJPEG"]


class DecodeJPEG:
    """Decode a batch of JPEG byte strings with ``torchvision.io.decode_jpeg`` onto a device.

    Input: ``batch[key]``, zero-padded encoded bytes ``(batch, max_length)`` uint8, and
    ``batch[lengths_key]`` (int64, the true length of each) — the layout the loader collates
    for ``ragged_keys`` (e.g. from [`accelfn.data.ImageFiles`][] with ``jpeg=True``). Both
    stay on the host (they are this transform's ``host_keys``); the decoded ``uint8``
    ``(batch, 3, height, width)`` images are written to ``out_key`` on ``device`` (default:
    the device of the batch's other tensors), with nvJPEG's batched decoder on CUDA. The byte
    keys are removed.

    Images of different sizes need ``size`` or ``crop``. With ``size`` each is resized
    (shorter side to fit, antialiased) and centre-cropped to ``size`` before stacking (a
    per-image step: decode output is inherently a list). With ``crop``, a
    [`RandomResizedCrop`][], each image gets a random box drawn on its own size (as
    ``crop.boxes_per_sample``, from the loader's ``generator``) and resized to ``crop.size``:
    ImageNet's training crop of the whole decoded image, equal bitwise to ``crop`` applied to
    each decoded image alone with that box (and to ``crop`` of the decoded batch when all the
    images have one size), so torchvision's ``resized_crop`` (``antialias=True``) of the
    decoded image within one level (see [`RandomResizedCrop`][]). One resampling per image,
    reading only the pixels inside its box, so no image is resized first.

    Args:
        key: key of the padded encoded bytes.
        lengths_key: key of the byte counts; default ``f"{key}_lengths"``.
        out_key: key for the decoded images.
        size: common ``(height, width)`` for images of different sizes (centre crops).
        crop: a [`RandomResizedCrop`][] taken from each decoded image (its ``size``,
            ``scale`` and ``ratio``; its ``keys`` do not apply); not with ``size``.
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
        crop: RandomResizedCrop | None = None,
    ) -> None:
        from torchvision.io import ImageReadMode  # type: ignore[import-untyped]

        if mode not in ("RGB", "GRAY", "UNCHANGED"):
            raise ValueError(f"mode must be 'RGB', 'GRAY' or 'UNCHANGED', got {mode!r}")
        if crop is not None and not isinstance(crop, RandomResizedCrop):
            raise TypeError(
                f"DecodeJPEG: crop must be a RandomResizedCrop, got {crop!r}; apply other "
                "transforms after DecodeJPEG (with size= for images of different sizes)"
            )
        if crop is not None and size is not None:
            raise ValueError(
                "DecodeJPEG: pass either size= (resize and centre-crop every image) or crop= "
                "(a random resized crop of every image), not both"
            )
        self.crop = crop
        self.key = key
        self.lengths_key = lengths_key or f"{key}_lengths"
        self.out_key = out_key
        self.size = None if size is None else as_pair(size, "size")
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

    def __call__(
        self, batch: TensorDictBase, generator: torch.Generator | None = None
    ) -> TensorDictBase:
        from torchvision.io import decode_jpeg  # type: ignore[import-untyped]

        data = image(batch, self.key, "DecodeJPEG", min_dim=2)
        lengths = image(batch, self.lengths_key, "DecodeJPEG", min_dim=1)
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
        if self.crop is not None:
            out = batch.exclude(*self.host_keys)
            out.set(self.out_key, self._random_resized_crops(images, generator, device))
            return out
        if self.size is not None:
            size = self.size
            images = [fit_image(img, size) for img in images]
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

    def _random_resized_crops(
        self, images: list[torch.Tensor], generator: torch.Generator | None,
        device: torch.device,
    ) -> torch.Tensor:
        """``crop`` of each image (a list of uint8 ``(C, H, W)`` of any sizes), stacked: as
        ``RandomResizedCrop.__call__`` does it for uint8, a box per image on its own size."""
        crop = self.crop
        assert crop is not None
        sizes = [(int(img.shape[-2]), int(img.shape[-1])) for img in images]
        boxes = crop.boxes_per_sample(sizes, generator, device)
        # each image is a batch of one, its box a view (no kernel)
        y = torch.cat([
            resized_crops(img[None], boxes[i:i + 1], crop.size) for i, img in enumerate(images)
        ])
        return y.round_().clamp_(0, 255).to(torch.uint8)

    def __repr__(self) -> str:
        what = f"crop={self.crop}" if self.crop is not None else f"size={self.size}"
        return f"DecodeJPEG({self.key!r} -> {self.out_key!r}, {what})"
