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
boundary, and accelfn's data-wait share. Prints one JSON object.

Run: ``python benchmarks/data.py`` (``--help`` for sizes).
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
from pathlib import Path

import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accelfn.data as ad

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="epochs of each, interleaved")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="workers of both")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)

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
    result = {
        "benchmark": "data",
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
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
