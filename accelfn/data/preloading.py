"""Preloading: write a dataset once into a memory-mapped TensorDict, then train from it.

A preloaded dataset is a directory holding one memory-mapped file per key (written by
tensordict: ``TensorDict.memmap_like``) plus ``accelfn_preload.json``, written last, that
marks it complete. Opening it (:func:`open_preloaded`) maps the files without reading them:
the operating system pages data in as batches are gathered, and keeps hot pages cached.
Dtypes are kept (uint8 images stay uint8: 4x smaller than float32, converted on the GPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase

from .gpu.base import as_pair, fit_image
from .pipeline import _as_source, loader

__all__ = [
    "ImageFiles",
    "find_images",
    "open_preloaded",
    "preload",
    "preload_image_folder",
    "preload_info",
]

MARKER = "accelfn_preload.json"
#: 2: the marker records what the preload was built with ("options") and each key's
#: per-sample "shapes" and "dtypes", checked before a preload is reused.
_FORMAT = 2


def _marker(path: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return None
    if not isinstance(info, dict) or not isinstance(info.get("num_samples"), int):
        raise ValueError(
            f"{path / MARKER} is not a preload marker (a JSON object with num_samples); "
            "preload again with overwrite=True"
        )
    return info


def open_preloaded(path: str | os.PathLike[str]) -> TensorDict:
    """Open a dataset written by [`preload`][] as a memory-mapped TensorDict (no copy).

    Raises:
        FileNotFoundError: nothing was preloaded at ``path``.
        ValueError: the preload at ``path`` did not finish (it was interrupted): run
            [`preload`][] again with ``overwrite=True``.
    """
    path = Path(path)
    info = _marker(path)
    if info is None:
        if (path / "meta.json").exists():
            raise ValueError(
                f"{path} holds an unfinished preload (no {MARKER}); run preload(..., "
                "overwrite=True) again"
            )
        raise FileNotFoundError(f"no preloaded dataset at {path} (run accelfn.data.preload)")
    td = TensorDict.load_memmap(path)
    if td.batch_size[0] != info["num_samples"]:
        raise ValueError(
            f"{path}: {td.batch_size[0]} rows but {MARKER} says {info['num_samples']}; "
            "preload again with overwrite=True"
        )
    return td


def _describe_callable(fn: Callable[..., Any] | None) -> str | None:
    """A plain description of ``fn`` for the marker: its repr when it describes it (e.g. a
    torchvision transform and its parameters), else its qualified name."""
    if fn is None:
        return None
    text = repr(fn)
    if " at 0x" not in text and len(text) <= 2000:
        return text
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"


def _layout(td: TensorDictBase) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Per-sample shape and dtype of each leaf of ``td`` (keys as in the marker)."""
    shapes, dtypes = {}, {}
    for key in td.keys(include_nested=True, leaves_only=True):
        name = key if isinstance(key, str) else ".".join(key)
        value = td.get(key)
        shapes[name] = list(value.shape[td.batch_dims:])
        dtypes[name] = str(value.dtype)
    return shapes, dtypes


def _check_reuse(path: Path, info: dict[str, Any], n: int, options: dict[str, Any],
                 source: Any, keys: Sequence[str] | None) -> None:
    """Raise unless the complete preload at ``path`` (its marker ``info``) is what this call
    would write: same number of samples, same options, and, for a TensorDict source, the same
    keys, shapes and dtypes."""
    fix = (f"pass overwrite=True to rebuild it, or delete the directory {path}, or choose "
           "another path")
    if info["num_samples"] != n:
        raise ValueError(
            f"{path} already holds a preload of {info['num_samples']} samples but the source "
            f"has {n}; {fix}"
        )
    if not isinstance(info.get("options"), dict):
        raise ValueError(
            f"{path} holds a preload written by an older accelfn, whose marker does not record "
            f"the options it was built with (size, keys, sample_transform, ...), so it cannot "
            f"be told apart from what this call asks for; {fix}"
        )
    built = info["options"]
    diff = [k for k in sorted(set(built) | set(options)) if built.get(k) != options.get(k)]
    if diff:
        detail = "; ".join(
            f"{k}: built with {built.get(k)!r}, asked for {options.get(k)!r}" for k in diff
        )
        raise ValueError(
            f"{path} already holds a preload built with other options ({detail}); {fix}"
        )
    if isinstance(source, TensorDictBase):
        selected = source if keys is None else source.select(*keys)
        shapes, dtypes = _layout(selected)
        for what, here, there in (("shape", shapes, info.get("shapes")),
                                  ("dtype", dtypes, info.get("dtypes"))):
            if here != there:
                raise ValueError(
                    f"{path} already holds a preload whose samples differ from the source's: "
                    f"per-sample {what}s {there} there, {here} in the source; {fix}"
                )


def preload(
    source: Any,
    path: str | os.PathLike[str],
    *,
    keys: Sequence[str] | None = None,
    sample_transform: Callable[[Any], Any] | None = None,
    batch_size: int = 256,
    num_workers: int | None = None,
    worker_type: Literal["thread", "process"] = "thread",
    overwrite: bool = False,
    metadata: dict[str, Any] | None = None,
) -> TensorDict:
    """Write ``source`` once to ``path`` as a memory-mapped TensorDict and return it opened.

    ``source`` is a TensorDict, a dict of tensors, or a map-style dataset whose samples all
    have the same keys, shapes and dtypes (loaded in parallel workers and checked like in
    [`accelfn.data.loader`][], in dataset order). If ``path`` already holds a complete
    preload of the same number of samples it is opened instead of rewritten ("write once");
    ``overwrite=True`` rewrites it.

    A preload is reused only if it was built with the same ``keys`` and ``sample_transform``
    (compared by its repr, or by its qualified name when the repr is an address: a function
    changed in place is not detected) and, for a TensorDict source, the same per-sample
    shapes and dtypes; otherwise a ``ValueError`` names what differs (nothing is rewritten
    unless ``overwrite=True``). The marker records them (see [`preload_info`][]).

    Args:
        source: the dataset.
        path: directory to write (created; must be empty, or a previous preload).
        keys: keys to keep / names of tuple fields (as in ``loader``).
        sample_transform: per-sample function applied before writing (e.g. decode + resize).
        batch_size: samples written per chunk.
        num_workers: loader workers (default: ``loader``'s default).
        worker_type: ``"thread"`` or ``"process"``.
        overwrite: rewrite an existing preload.
        metadata: JSON-serialisable extras stored in the marker (e.g. class names); read them
            back with [`preload_info`][].

    Raises:
        ValueError: ``path`` exists and is not a preload, an existing preload has a different
            size or was built with other options (or by an accelfn that did not record them),
            or a sample is inconsistent with the first (named by its index).
        TypeError: ``source`` is an iterable without a length.
    """
    options = {"keys": None if keys is None else list(keys),
               "sample_transform": _describe_callable(sample_transform)}
    return _preload(source, path, options=options, keys=keys,
                    sample_transform=sample_transform, batch_size=batch_size,
                    num_workers=num_workers, worker_type=worker_type, overwrite=overwrite,
                    metadata=metadata)


def _preload(
    source: Any,
    path: str | os.PathLike[str],
    *,
    options: dict[str, Any],
    keys: Sequence[str] | None,
    sample_transform: Callable[[Any], Any] | None,
    batch_size: int,
    num_workers: int | None,
    worker_type: Literal["thread", "process"],
    overwrite: bool,
    metadata: dict[str, Any] | None,
) -> TensorDict:
    """[`preload`][], with the ``options`` that define the result (recorded in the marker,
    and compared with an existing preload's before it is reused)."""
    path = Path(path)
    if isinstance(source, Mapping) and any(isinstance(k, str) for k in source):
        source = _as_source(source)[1]  # a dict of columns, as a TensorDict (checked)
    if isinstance(source, TensorDictBase):
        if sample_transform is not None:  # refused before anything is written or reused
            raise ValueError(
                "sample_transform applies to map-style datasets, loaded one sample at a time; "
                "a TensorDict (or dict of tensors) is written as it is: transform its columns "
                "first, or wrap it in a map-style dataset"
            )
        n = source.batch_size[0] if source.batch_dims else 0
    elif isinstance(source, torch.utils.data.IterableDataset) or not hasattr(source, "__len__"):
        raise TypeError(
            "preload needs a sized source (a TensorDict or a map-style dataset); turn the "
            "iterable into a list or a map-style dataset first"
        )
    else:
        n = len(source)
    if n == 0:
        raise ValueError("cannot preload an empty dataset")

    if path.exists() and any(path.iterdir()):
        try:
            info = _marker(path)
        except ValueError:
            if not overwrite:
                raise
            info = {}  # a damaged marker: rewritten below, like an unfinished preload
        if info is None and not (path / "meta.json").exists():
            raise ValueError(
                f"{path} exists and is not a preloaded dataset; choose a new or empty directory"
            )
        if info and not overwrite:
            _check_reuse(path, info, n, options, source, keys)
            return open_preloaded(path)
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)

    batches = loader(
        source,
        batch_size=min(batch_size, n),
        shuffle=False,
        drop_last=False,
        num_workers=num_workers,
        worker_type=worker_type,
        keys=keys,
        sample_transform=sample_transform,
        ragged_keys=(),
        rank=0,
        world_size=1,
    )
    out: TensorDict | None = None
    start = 0
    try:
        for batch in batches:
            if out is None:
                proto = batch.apply(lambda t: t[0].expand(n, *t.shape[1:]), batch_size=[n])
                assert proto is not None  # apply() returns None only with inplace / out=
                out = proto.memmap_like(path)
            stop = start + batch.batch_size[0]
            out[start:stop] = batch
            start = stop
    finally:
        batches.close()
    assert out is not None and start == n
    shapes, dtypes = _layout(out)
    info = {
        "format": _FORMAT,
        "num_samples": n,
        "keys": sorted(map(str, out.keys(include_nested=True, leaves_only=True))),
        "shapes": shapes,
        "dtypes": dtypes,
        "options": options,
        "metadata": metadata or {},
    }
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path / MARKER)
    return open_preloaded(path)


def preload_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The marker of a preload: ``num_samples``, ``keys``, each key's per-sample ``shapes`` and
    ``dtypes``, the ``options`` it was built with (checked before it is reused) and the
    ``metadata`` passed in."""
    info = _marker(Path(path))
    if info is None:
        raise FileNotFoundError(f"no preloaded dataset at {path}")
    return info


# --------------------------------------------------------------------------------------------
# Image files


def find_images(root: str | os.PathLike[str]) -> tuple[list[str], list[int], list[str]]:
    """List an image folder laid out as ``root/<class>/<image>`` (torchvision ``ImageFolder``).

    Returns ``(files, labels, classes)`` with classes sorted by name and labels their indices.
    """
    from torchvision.datasets.folder import (  # type: ignore[import-untyped]
        IMG_EXTENSIONS,
        find_classes,
        make_dataset,
    )

    classes, class_to_idx = find_classes(os.fspath(root))
    items = make_dataset(os.fspath(root), class_to_idx, extensions=IMG_EXTENSIONS)
    return [f for f, _ in items], [label for _, label in items], classes


class ImageFiles(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """A map-style dataset over image files (JPEG, PNG, ...), loaded with ``torchvision.io``.

    * ``jpeg=False`` (default): each sample is ``{"image": uint8 (3, H, W), "label": int64}``,
      decoded on the CPU; with ``size``, resized (shorter side, antialiased) and centre-cropped
      to ``size`` so that samples stack. Use it to preload a folder
      ([`preload_image_folder`][]).
    * ``jpeg=True``: each sample is the file's encoded bytes ``{"jpeg": uint8 (n_bytes,),
      "label"}``, declared in ``ragged_keys`` so the loader collates them padded with
      ``"jpeg_lengths"``; decode them on the GPU with
      [`accelfn.data.DecodeJPEG`][]. Reading bytes is cheap I/O, so threads suffice.

    Args:
        files: image paths.
        labels: one int per file (default all 0).
        size: ``(height, width)`` or int for decoded samples.
        jpeg: yield encoded bytes instead of decoded pixels.
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike[str]],
        labels: Sequence[int] | None = None,
        *,
        size: int | Sequence[int] | None = None,
        jpeg: bool = False,
    ) -> None:
        self.files = [os.fspath(f) for f in files]
        if labels is not None and len(labels) != len(self.files):
            raise ValueError(f"got {len(self.files)} files but {len(labels)} labels")
        self.labels = list(labels) if labels is not None else [0] * len(self.files)
        self.size = None if size is None else as_pair(size, "size")
        self.jpeg = jpeg
        self.ragged_keys = ("jpeg",) if jpeg else ()

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_image  # type: ignore[import-untyped]

        path = self.files[index]
        # Python's own read (it releases the GIL) and checks on the bytes: a third of the
        # cost of torchvision.io.read_file and tensor-by-tensor checks, per sample in threads.
        with open(path, "rb") as f:
            raw = bytearray(f.read())
        label = torch.tensor(self.labels[index], dtype=torch.int64)
        if self.jpeg and raw[:2] != b"\xff\xd8":
            raise ValueError(
                f"sample {index}: {path} is not a JPEG file; use jpeg=False to decode it "
                "on the CPU (any format), or convert it to JPEG"
            )
        empty = torch.empty(0, dtype=torch.uint8)
        data = torch.frombuffer(raw, dtype=torch.uint8) if raw else empty
        if self.jpeg:
            return {"jpeg": data, "label": label}
        img = decode_image(data, mode=ImageReadMode.RGB)
        if self.size is not None:
            img = fit_image(img, self.size)
        return {"image": img, "label": label}


def preload_image_folder(
    root: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    size: int | Sequence[int],
    num_workers: int | None = None,
    overwrite: bool = False,
) -> TensorDict:
    """Decode an ``ImageFolder``-style tree once into a preloaded uint8 dataset.

    Every image is decoded on the CPU (in parallel threads), resized and centre-cropped to
    ``size``, and written as ``"image"`` uint8 ``(N, 3, H, W)`` with ``"label"`` int64. Class
    names are kept in the marker: ``preload_info(path)["metadata"]["classes"]``. Train with
    ``loader(open_preloaded(path), ..., transform=<GPU augmentation>)``.

    An existing preload at ``path`` is reused only if it was built from the same files (names
    and labels) with the same ``size``; otherwise a ``ValueError`` names what differs
    (``overwrite=True`` rebuilds it).
    """
    files, labels, classes = find_images(root)
    if not files:
        raise ValueError(f"no images found under {root} (expected root/<class>/<image>)")
    images = ImageFiles(files, labels, size=size)
    assert images.size is not None
    # What the result depends on (the root's place does not): compared before a reuse.
    listing = "\n".join(
        f"{os.path.relpath(f, root)}\t{label}" for f, label in zip(files, labels)
    )
    options = {
        "keys": None,
        "sample_transform": None,
        "size": list(images.size),
        "classes": classes,
        "files": hashlib.sha256(listing.encode()).hexdigest(),
    }
    return _preload(
        images,
        path,
        options=options,
        keys=None,
        sample_transform=None,
        batch_size=256,
        num_workers=num_workers,
        worker_type="thread",
        overwrite=overwrite,
        metadata={"classes": classes, "root": os.fspath(root)},
    )
