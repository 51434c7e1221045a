"""What ``accelfn bench`` trains: preloaded images, the models, the optimizer, the two data
pipelines (the baseline's ``DataLoader``, accelfn's loader) and the step of each stage."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from .config import MEAN, MODELS, STD, BenchConfig, Stage

__all__ = [
    "TinyCNN",
    "accelfn_loader",
    "amp_dtype",
    "build_model",
    "build_step",
    "classify",
    "endless",
    "make_images",
    "make_optimizer",
    "prepare_model",
    "torch_dataloader",
]


def make_images(kind: str, samples: int, size: int, classes: int = 10,
                seed: int = 0) -> TensorDict:
    """Preloaded uint8 images ``[samples, 3, size, size]`` and int64 labels.

    ``"synthetic"``: uniform random pixels and labels from ``seed``. ``"digits"``: the
    embedded handwritten digits (8x8, 17 grey levels) upscaled bilinearly to ``size`` and
    repeated over 3 channels (and over the dataset, past its 1,797 images).
    """
    g = torch.Generator().manual_seed(seed)
    if kind == "synthetic":
        images = torch.randint(0, 256, (samples, 3, size, size), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, classes, (samples,), generator=g)
    elif kind == "digits":
        from ...data.datasets import digits

        d = digits()
        idx = torch.arange(samples) % d.batch_size[0]
        small = d["image"][idx].float() * (255.0 / 16.0)
        images = F.interpolate(small, size=(size, size), mode="bilinear", align_corners=False)
        images = images.round().clamp_(0, 255).to(torch.uint8).expand(-1, 3, -1, -1)
        images = images.contiguous()
        labels = d["label"][idx] % classes
    else:
        raise ValueError(f"unknown data {kind!r}; use 'synthetic' or 'digits'")
    return TensorDict({"image": images, "label": labels}, batch_size=[samples])


class TinyCNN(nn.Module):
    """A small convolutional net (three conv-BN-ReLU layers, pooling, a linear head)."""

    def __init__(self, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            layers += [nn.Conv2d(cin, cout, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                       nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(
            torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))
        return logits


def build_model(name: str, image_size: int, classes: int = 10, seed: int = 0) -> nn.Module:
    """``resnet50``/``resnet18`` (torchvision, random init), ``cnn`` (:class:`TinyCNN`) or
    ``mlp`` (two hidden layers of 512 over the flattened image)."""
    torch.manual_seed(seed)
    if name in ("resnet50", "resnet18"):
        import torchvision  # type: ignore[import-untyped]  # ships no py.typed

        model: nn.Module = getattr(torchvision.models, name)(weights=None, num_classes=classes)
        return model
    if name == "cnn":
        return TinyCNN(classes)
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size * image_size, 512),
                             nn.ReLU(inplace=True), nn.Linear(512, 512), nn.ReLU(inplace=True),
                             nn.Linear(512, classes))
    raise ValueError(f"unknown model {name!r}; use one of {MODELS}")


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum, fused (one kernel for the update; lets accelfn skip on the device)."""
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)


def classify(model: nn.Module, batch: Any) -> torch.Tensor:
    """The step function of every stage: cross-entropy of the model's logits."""
    return F.cross_entropy(model(batch["image"]), batch["label"])


class _TensorImages(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The baseline's dataset: preloaded uint8 images, a per-sample torchvision transform."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Any) -> None:
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[i]), self.labels[i]


def torch_dataloader(data: TensorDict, cfg: BenchConfig, device: torch.device,
                     tuned: bool) -> torch.utils.data.DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    """The baseline's ``DataLoader``: per-sample crop, flip and normalisation (torchvision);
    ``tuned`` adds workers, pinned memory, persistent workers and prefetching."""
    from torchvision.transforms import v2  # type: ignore[import-untyped]  # ships no py.typed

    size = int(cfg.image_size or 32)
    transform = v2.Compose([
        v2.RandomCrop(size, padding=max(1, size // 8)),
        v2.RandomHorizontalFlip(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])
    workers = int(cfg.workers or 0) if tuned else 0
    return torch.utils.data.DataLoader(
        _TensorImages(data["image"], data["label"], transform),
        batch_size=cfg.batch_size, shuffle=True, drop_last=True,
        num_workers=workers,
        pin_memory=tuned and device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=2 if workers > 0 else None,
        generator=torch.Generator().manual_seed(cfg.seed),
    )


def accelfn_loader(data: TensorDict, cfg: BenchConfig, device: torch.device,
                   channels_last: bool, rank: int | None = None,
                   world: int | None = None) -> Any:
    """accelfn's loader of the same images: one gather per batch, the augmentation on whole
    batches on the device (and NHWC batches with ``channels_last``)."""
    from ... import data as ad

    size = int(cfg.image_size or 32)
    transforms: list[Any] = [ad.RandomCrop(size, padding=max(1, size // 8)),
                             ad.RandomHorizontalFlip(), ad.Normalize(MEAN, STD)]
    if channels_last:
        transforms.append(ad.ChannelsLast())
    return ad.loader(data, batch_size=int(cfg.batch_size or 1), device=device,
                     transform=ad.Compose(*transforms), seed=cfg.seed, rank=rank,
                     world_size=world)


def endless(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch, without end."""
    while True:
        yield from loader


def amp_dtype(cfg: BenchConfig, device: torch.device) -> torch.dtype:
    """The AMP stages' dtype: ``--amp-dtype``, or bf16 unless the GPU lacks it (then fp16)."""
    if cfg.amp_dtype == "fp16":
        return torch.float16
    if cfg.amp_dtype == "bf16":
        return torch.bfloat16
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def build_step(stage: Stage, cfg: BenchConfig, device: torch.device,
               nonfinite: bool = True, compile_: bool | None = None) -> Any:
    """The accelfn step of ``stage``: :func:`classify` lifted, then AMP, compile and DDP as
    the stage has them (``compile_`` overrides the stage's; ``nonfinite=False`` turns the
    non-finite guard off)."""
    import accelfn as af

    step: Any = af.lift(classify)
    if stage.amp:
        step = af.with_amp(dtype=amp_dtype(cfg, device))(step)
    if stage.compile if compile_ is None else compile_:
        step = af.compiled(mode=cfg.compile_mode, backend=cfg.compile_backend)(step)
    if stage.ddp:
        step = af.distributed(step)
    if not nonfinite:
        step = af.with_nonfinite(policy="off")(step)
    return step


def prepare_model(cfg: BenchConfig, init: dict[str, torch.Tensor], device: torch.device,
                  channels_last: bool) -> nn.Module:
    """A fresh model of ``cfg`` holding the weights ``init``, on ``device`` (NHWC with
    ``channels_last``)."""
    from ...recipes.memory_format import channels_last as to_channels_last

    assert cfg.model is not None and cfg.image_size is not None
    model = build_model(cfg.model, cfg.image_size, cfg.classes, cfg.seed)
    model.load_state_dict(init)
    model.to(device)
    if channels_last:
        model = to_channels_last(model)
    return model

