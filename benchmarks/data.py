"""Data loading: accelfn.data against torch.utils.data.DataLoader on preloaded uint8 images.

Both pipelines read the same preloaded uint8 images (synthetic, CIFAR-shaped by default),
apply the same augmentation (random crop with 4-pixel padding, horizontal flip, normalise to
float32) and deliver shuffled batches to the same device, on the same CPU cores:

* baseline: ``DataLoader(dataset, num_workers=<cores>, persistent_workers=True,
  pin_memory=<cuda>)`` with per-sample ``torchvision.transforms.v2`` in the workers, then
  ``.to(device, non_blocking=True)`` in the loop;
* accelfn: ``loader(open_preloaded(path), device=..., num_workers=<cores>,
  transform=Compose(RandomCrop, RandomHorizontalFlip, Normalize))``: one gather per batch
  from the memory map, the augmentation on whole batches on the device (on a CPU-only
  machine: on the host, in ``num_workers`` threads).

Epochs of the two alternate (interleaved) and repeat; the median epoch gives samples/s.
Also measured: time to first batch (from building the loader), the longest wait at an epoch
boundary, and accelfn's data-wait share.

``--parts preloaded,jpeg`` adds the real-JPEG pipeline (``"jpeg"`` in the JSON): ImageNet-like
JPEG files written into a temporary folder (``--jpeg-images`` of them, of sizes around
``--jpeg-size`` 375x500, a quarter portrait, encoded by ``torchvision.io.encode_jpeg`` at
quality 90, in 10 class folders), read every epoch, on at most ``--cores`` cores (16; the
process is pinned to them), in batches of ``--jpeg-batch-size``, four stages:

* ``dataloader``: what one writes without accelfn: ``torchvision.datasets.ImageFolder`` (PIL
  decode) with ``RandomResizedCrop(224)``, ``RandomHorizontalFlip``, ``ToTensor``,
  ``Normalize`` per sample in ``DataLoader(num_workers=<workers>, pin_memory=<cuda>,
  persistent_workers=True, shuffle=True)``, each batch ``.to(device, non_blocking=True)``;
* ``accelfn``: ``loader(ImageFiles(files, labels, jpeg=True), device=..., num_workers=<workers>,
  transform=Compose(DecodeJPEG(crop=RandomResizedCrop(224)), RandomHorizontalFlip(),
  Normalize(...)))``: threads read the encoded bytes, collated padded; decoding (nvJPEG's
  batched decoder on CUDA; the CPU decoder in the loader's threads elsewhere), the crop of
  each image on its own size, the flip and the normalisation on the device. Both sides end
  in the same float32 ``(batch, 3, 224, 224)`` batches on the device;
* ``decode_only``: ``torchvision.io.decode_jpeg(<a batch of encoded bytes>, device=...)`` alone
  on bytes already in memory (one thread: on a CPU that is one core's rate);
* ``read_only``: accelfn's loader of the encoded bytes alone (``ImageFiles(jpeg=True)``, the
  same threads, batches left on the host, no transform): with ``decode_only``, which of the
  two bounds the ``accelfn`` stage.

Rounds of the stages are interleaved after a warm-up epoch of each; medians give images/s.
The JSON records the cores, the device, the images (count, sizes, bytes) and issue 42's
targets (accelfn >= 6,500 images/s on <= 16 cores, decode >= 8,000 images/s, accelfn >= 10x
the DataLoader), met or not: meaningful on a GPU only (the JSON says so on a CPU).
``--dry-run`` runs the JPEG part tiny (64 images of about 40x50, crops of 16, batches of 16,
one round, one worker unless ``--workers``), alone unless ``--parts`` names others: what CI
runs (the GPU suite's dry run adds ``--parts preloaded,jpeg`` and the preloaded part's sizes).

Prints one JSON object. Run: ``python benchmarks/data.py`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accelfn.data as ad

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
JPEG_STAGES = ("dataloader", "accelfn", "decode_only", "read_only")
#: issue 42 item 4, on a GPU: images/s of the accelfn pipeline (on <= 16 cores), of the
#: decode alone, and the pipeline's ratio to the DataLoader.
JPEG_TARGETS = {"accelfn_images_per_s": 6500, "decode_only_images_per_s": 8000,
                "ratio_accelfn_to_dataloader": 10}


class TensorImages(torch.utils.data.Dataset):
    """The baseline's dataset: preloaded uint8 images, per-sample torchvision transform."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), self.labels[i]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def epoch(batches, device: torch.device, unpack) -> tuple[int, float, list[float]]:
    """Consume one epoch; return (samples, seconds, per-batch gaps in seconds)."""
    n, gaps = 0, []
    t0 = last = time.perf_counter()
    for batch in batches:
        x, _ = unpack(batch)
        n += x.shape[0]
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    sync(device)
    return n, time.perf_counter() - t0, gaps


def build_dataloader(images, labels, args, device):
    from torchvision.transforms import v2

    transform = v2.Compose(
        [
            v2.RandomCrop(32, padding=4),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    )
    return torch.utils.data.DataLoader(
        TensorImages(images, labels, transform),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        pin_memory=device.type == "cuda",
        prefetch_factor=2 if args.workers > 0 else None,
    )


def build_accelfn(path, args, device):
    return ad.loader(
        ad.open_preloaded(path),
        batch_size=args.batch_size,
        device=device,
        transform=ad.Compose(
            ad.RandomCrop(32, padding=4),
            ad.RandomHorizontalFlip(),
            ad.Normalize(MEAN, STD),
        ),
        num_workers=args.workers,  # the same cores: threads gathering and augmenting batches
        prefetch=4,
    )


# --------------------------------------------------------------------------------------------
# Real JPEG files


def write_jpegs(root: Path, n: int, size: tuple[int, int], threads: int) -> dict:
    """Write ``n`` ImageNet-like JPEGs into ``root/<class>/<i>.jpg`` (10 classes); their sizes.

    Each image is a crop of one photo-like canvas (smooth colour fields, mid-frequency texture
    and sensor-like noise, so that JPEG sizes are ImageNet-like, not those of pure noise), of
    about ``size`` (each side times 0.8-1.2, a quarter portrait), with a per-image colour
    shift, encoded by ``torchvision.io.encode_jpeg`` at quality 90, in ``threads`` threads.
    """
    import torch.nn.functional as F
    from torchvision.io import encode_jpeg, write_file

    g = torch.Generator().manual_seed(0)
    h0, w0 = size
    side = int(max(h0, w0) * 1.2) + 1
    ch, cw = 2 * side, 2 * side
    low = torch.rand(1, 3, 12, 12, generator=g) * 255
    mid = (torch.rand(1, 3, max(ch // 8, 2), max(cw // 8, 2), generator=g) - 0.5) * 120
    canvas = F.interpolate(low, size=(ch, cw), mode="bicubic", align_corners=False)
    canvas += F.interpolate(mid, size=(ch, cw), mode="bilinear", align_corners=False)
    canvas += torch.randn(1, 3, ch, cw, generator=g) * 12
    canvas = canvas.clamp_(0, 255)[0]
    draws = torch.rand(n, 6, generator=g).tolist()
    for c in range(10):
        (root / f"class{c:02d}").mkdir(parents=True)

    def one(i: int) -> tuple[int, int, int]:
        a, b, portrait, y, x, shift = draws[i]
        h, w = max(8, round(h0 * (0.8 + 0.4 * a))), max(8, round(w0 * (0.8 + 0.4 * b)))
        if portrait < 0.25:
            h, w = w, h
        y0, x0 = int(y * (ch - h)), int(x * (cw - w))
        img = canvas[:, y0:y0 + h, x0:x0 + w] + (shift - 0.5) * 60
        data = encode_jpeg(img.clamp(0, 255).round().to(torch.uint8), quality=90)
        write_file(str(root / f"class{i % 10:02d}" / f"{i:06d}.jpg"), data)
        return h, w, data.numel()

    with ThreadPoolExecutor(threads) as pool:
        made = list(pool.map(one, range(n)))
    hs, ws, nbytes = (sorted(v) for v in zip(*made))
    return {
        "count": n,
        "classes": 10,
        "height_min_median_max": [hs[0], hs[n // 2], hs[-1]],
        "width_min_median_max": [ws[0], ws[n // 2], ws[-1]],
        "bytes_mean": round(sum(nbytes) / n),
        "quality": 90,
    }


def build_jpeg_dataloader(root: Path, args: argparse.Namespace, device: torch.device):
    """The baseline: ImageFolder + PIL + per-sample torchvision transforms in DataLoader
    worker processes."""
    from torchvision import datasets, transforms

    transform = transforms.Compose([
        transforms.RandomResizedCrop(args.crop),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])
    return torch.utils.data.DataLoader(
        datasets.ImageFolder(str(root), transform=transform),
        batch_size=args.jpeg_batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        pin_memory=device.type == "cuda",
    )


def build_jpeg_accelfn(root: Path, args: argparse.Namespace, device: torch.device):
    """accelfn: encoded bytes read in threads, decoded and augmented on the device."""
    files, labels, _ = ad.find_images(root)
    return ad.loader(
        ad.ImageFiles(files, labels, jpeg=True),
        batch_size=args.jpeg_batch_size,
        device=device,
        num_workers=args.workers,
        transform=ad.Compose(
            ad.DecodeJPEG(crop=ad.RandomResizedCrop(args.crop)),
            ad.RandomHorizontalFlip(),
            ad.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ),
    )


def build_jpeg_reader(root: Path, args: argparse.Namespace):
    """accelfn's reading alone: the encoded bytes, collated, on the host."""
    files, labels, _ = ad.find_images(root)
    return ad.loader(ad.ImageFiles(files, labels, jpeg=True), batch_size=args.jpeg_batch_size,
                     num_workers=args.workers)


def decode_batches(root: Path, args: argparse.Namespace) -> list[list[torch.Tensor]]:
    """The files' encoded bytes in memory, in batches of ``--jpeg-batch-size`` (whole ones)."""
    from torchvision.io import read_file

    files = ad.find_images(root)[0]
    blobs = [read_file(f) for f in files]
    b = args.jpeg_batch_size
    return [blobs[i:i + b] for i in range(0, len(blobs) - b + 1, b)]


def decode_epoch(batches: list[list[torch.Tensor]], device: torch.device) -> tuple[int, float]:
    """Decode every batch onto ``device`` (``torchvision.io.decode_jpeg``): (images, seconds)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    n = 0
    t0 = time.perf_counter()
    for blobs in batches:
        images = decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device)
        n += len(images)
    sync(device)
    return n, time.perf_counter() - t0


def describe_batch(x: torch.Tensor) -> dict:
    """Shape, dtype, device and value range of a batch's images (read after the timing)."""
    x = x.detach().float()
    return {"shape": list(x.shape), "dtype": str(x.dtype), "device": str(x.device),
            "min": round(x.min().item(), 3), "max": round(x.max().item(), 3),
            "mean": round(x.mean().item(), 3), "std": round(x.std().item(), 3)}


def jpeg_part(args: argparse.Namespace) -> dict:
    """The real-JPEG pipeline: the ``"jpeg"`` section of the JSON."""
    device = torch.device(args.device)
    cores = len(os.sched_getaffinity(0))
    workers = min(cores, args.cores) if args.workers is None else args.workers
    args = argparse.Namespace(**{**vars(args), "workers": workers})
    stages = list(args.jpeg_stages)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "jpeg"
        t = time.perf_counter()
        images = write_jpegs(root, args.jpeg_images, args.jpeg_size, threads=cores)
        write_s = time.perf_counter() - t

        last: dict[str, torch.Tensor] = {}
        runs = {}

        def unpack_dl(b):
            return b[0].to(device, non_blocking=True), b[1].to(device, non_blocking=True)

        def unpack_af(b):
            return b["image"], b["label"]

        def keep(name, unpack):
            def f(b):
                x, y = unpack(b)
                last[name] = x
                return x, y
            return f

        if "dataloader" in stages:
            dl = build_jpeg_dataloader(root, args, device)
            runs["dataloader"] = lambda: epoch(dl, device, keep("dataloader", unpack_dl))[:2]
        if "accelfn" in stages:
            af = build_jpeg_accelfn(root, args, device)
            runs["accelfn"] = lambda: epoch(af, device, keep("accelfn", unpack_af))[:2]
        if "decode_only" in stages:
            batches = decode_batches(root, args)
            runs["decode_only"] = lambda: decode_epoch(batches, device)
        if "read_only" in stages:
            reader = build_jpeg_reader(root, args)
            cpu = torch.device("cpu")
            runs["read_only"] = lambda: epoch(reader, cpu, lambda b: (b["jpeg"], b["label"]))[:2]

        rates: dict[str, list[float]] = {name: [] for name in runs}
        for name in stages:  # warm-up: worker start-up, nvJPEG's handles, page cache
            runs[name]()
        for _ in range(args.repeats):
            for name in stages:
                n, s = runs[name]()
                rates[name].append(n / s)
        if "accelfn" in runs:
            af.close()
        if "read_only" in runs:
            reader.close()
        if "dataloader" in runs:
            del dl  # stops its worker processes

    median = {name: statistics.median(r) for name, r in rates.items()}
    out: dict = {
        "setup": {
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cpu_cores": cores,
            "cpu_cores_machine": os.cpu_count(),
            "workers": workers,
            "torch_threads": torch.get_num_threads(),
            "batch_size": args.jpeg_batch_size,
            "crop": args.crop,
            "images": images,
            "augmentation": f"RandomResizedCrop({args.crop}) + horizontal flip + normalise "
                            "(float32), per image on its own size",
            "repeats": args.repeats,
            "stages": stages,
            "write_s": round(write_s, 2),
            "dry_run": args.dry_run,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }
    for name in stages:
        out[name] = {"images_per_s": round(median[name]),
                     "images_per_s_all": [round(r) for r in rates[name]]}
        if name in last:
            out[name]["batch"] = describe_batch(last[name])
    ratio = None
    if "accelfn" in median and "dataloader" in median:
        ratio = median["accelfn"] / median["dataloader"]
        out["ratio_accelfn_to_dataloader"] = round(ratio, 2)
    values = {"accelfn_images_per_s": median.get("accelfn"),
              "decode_only_images_per_s": median.get("decode_only"),
              "ratio_accelfn_to_dataloader": ratio}
    meaningful = device.type == "cuda" and cores <= 16 and not args.dry_run
    targets: dict = {
        "meaningful": meaningful,
        "note": "issue 42 item 4; figures on a GPU, with at most 16 cores" if meaningful else
                f"not meaningful here ({device.type} device, {cores} cores"
                f"{', dry run' if args.dry_run else ''}): the targets are for a CUDA GPU with "
                "at most 16 cores; met says what this run measured",
    }
    for key, target in JPEG_TARGETS.items():
        value = values[key]
        targets[key] = {"target": target,
                        "value": None if value is None else round(value, 2),
                        "met": None if value is None else value >= target}
    out["targets"] = targets
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=None,
                   help="comma-separated: preloaded (uint8 images), jpeg (JPEG files); "
                        "default preloaded, with --dry-run jpeg")
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="epochs of each, interleaved")
    p.add_argument("--workers", type=int, default=None,
                   help="workers of both (default: the cores; for jpeg at most --cores)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--jpeg-images", type=int, default=5000, help="JPEG files written")
    p.add_argument("--jpeg-size", default="375,500", help="typical height,width of the JPEGs")
    p.add_argument("--jpeg-batch-size", type=int, default=256)
    p.add_argument("--crop", type=int, default=224, help="RandomResizedCrop's size")
    p.add_argument("--jpeg-stages", default=",".join(JPEG_STAGES))
    p.add_argument("--cores", type=int, default=16,
                   help="the jpeg part runs on at most this many cores (pinned)")
    p.add_argument("--dry-run", action="store_true",
                   help="the jpeg part tiny, one round (seconds, for CI); alone unless --parts")
    args = p.parse_args(argv)
    parts = args.parts or ("jpeg" if args.dry_run else "preloaded")
    args.parts = [x for x in parts.split(",") if x]
    args.jpeg_stages = [x for x in args.jpeg_stages.split(",") if x]
    if args.dry_run:
        args.jpeg_images, args.jpeg_size, args.jpeg_batch_size = 64, "40,50", 16
        args.crop, args.repeats = 16, 1
        args.workers = 1 if args.workers is None else args.workers
    for part in args.parts:
        if part not in ("preloaded", "jpeg"):
            p.error(f"--parts: unknown part {part!r}; the parts are preloaded, jpeg")
    for stage in args.jpeg_stages:
        if stage not in JPEG_STAGES:
            p.error(f"--jpeg-stages: unknown stage {stage!r}; the stages are {JPEG_STAGES}")
    try:
        h, w = (int(v) for v in args.jpeg_size.split(","))
    except ValueError:
        p.error(f"--jpeg-size takes height,width (e.g. 375,500), got {args.jpeg_size!r}")
    args.jpeg_size = (h, w)
    if args.jpeg_images < args.jpeg_batch_size:
        p.error(f"--jpeg-images ({args.jpeg_images}) must be at least --jpeg-batch-size "
                f"({args.jpeg_batch_size}): whole batches only")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result: dict = {"benchmark": "data"}
    if "preloaded" in args.parts:
        result.update(preloaded_part(args))
    if "jpeg" in args.parts:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > args.cores:  # both sides (and their workers) on the same few cores
            os.sched_setaffinity(0, cores[: args.cores])
        result["jpeg"] = jpeg_part(args)
    print(json.dumps(result, indent=2))


def preloaded_part(args: argparse.Namespace) -> dict:
    """The preloaded uint8 comparison (the module's first part): its JSON fields."""
    device = torch.device(args.device)
    if args.workers is None:
        args = argparse.Namespace(**{**vars(args), "workers": os.cpu_count() or 1})

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.samples, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (args.samples,), generator=g)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "images"
        t = time.perf_counter()
        ad.preload(TensorDict({"image": images, "label": labels}, [args.samples]), path)
        preload_s = time.perf_counter() - t

        def unpack_dl(b):
            return b[0].to(device, non_blocking=True), b[1].to(device, non_blocking=True)

        def unpack_af(b):
            return b["image"], b["label"]

        # Time to first batch, from building the loader (fresh processes / threads), each
        # measured alone so that the other's background work does not slow it down.
        t = time.perf_counter()
        probe = build_accelfn(path, args, device)
        unpack_af(next(iter(probe)))
        sync(device)
        af_first = time.perf_counter() - t
        probe.close()
        del probe
        t = time.perf_counter()
        probe = build_dataloader(images, labels, args, device)
        unpack_dl(next(iter(probe)))
        sync(device)
        dl_first = time.perf_counter() - t
        del probe  # stops its worker processes

        dl = build_dataloader(images, labels, args, device)
        af = build_accelfn(path, args, device)

        # Warm-up epoch of each, then interleaved measured epochs.
        epoch(dl, device, unpack_dl)
        epoch(af, device, unpack_af)
        af.reset_timing()
        rates: dict[str, list[float]] = {"accelfn": [], "dataloader": []}
        boundary: dict[str, list[float]] = {"accelfn": [], "dataloader": []}
        max_gap: dict[str, float] = {"accelfn": 0.0, "dataloader": 0.0}
        for _ in range(args.repeats):
            for name, loader, unpack in (
                ("dataloader", dl, unpack_dl),
                ("accelfn", af, unpack_af),
            ):
                n, s, gaps = epoch(loader, device, unpack)
                rates[name].append(n / s)
                boundary[name].append(gaps[0])  # from iter() to the epoch's first batch
                max_gap[name] = max(max_gap[name], *gaps)
        wait_share = af.wait_share
        af.close()
        del dl

    af_rate = statistics.median(rates["accelfn"])
    dl_rate = statistics.median(rates["dataloader"])
    return {
        "setup": {
            "samples": args.samples,
            "image": [3, 32, 32],
            "dtype": "uint8",
            "batch_size": args.batch_size,
            "augmentation": "random crop 32 pad 4 + horizontal flip + normalise (float32)",
            "device": str(device),
            "cpu_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "workers": args.workers,
            "repeats": args.repeats,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "preload_s": round(preload_s, 3),
        "accelfn": {
            "samples_per_s": round(af_rate),
            "samples_per_s_all": [round(r) for r in rates["accelfn"]],
            "first_batch_ms": round(af_first * 1e3, 1),
            "epoch_boundary_max_ms": round(max(boundary["accelfn"]) * 1e3, 1),
            "max_gap_ms": round(max_gap["accelfn"] * 1e3, 1),
            "wait_share": round(wait_share, 3),
        },
        "dataloader": {
            "samples_per_s": round(dl_rate),
            "samples_per_s_all": [round(r) for r in rates["dataloader"]],
            "first_batch_ms": round(dl_first * 1e3, 1),
            "epoch_boundary_max_ms": round(max(boundary["dataloader"]) * 1e3, 1),
            "max_gap_ms": round(max_gap["dataloader"] * 1e3, 1),
        },
        "ratio_samples_per_s": round(af_rate / dl_rate, 2),
        "targets": {
            "ratio_at_least_10": af_rate / dl_rate >= 10,
            "first_batch_under_100ms": af_first < 0.1,
            "no_multi_second_epoch_gap": max(boundary["accelfn"]) < 1.0,
        },
    }


if __name__ == "__main__":
    main()
