"""Image classification with a torchvision ResNet and every accelfn transform.

    python examples/classify_images.py                       # embedded digits, 16px, 60 updates
    python examples/classify_images.py --full                # 32px, 120 updates
    python examples/classify_images.py --folder path/to/images    # class-per-folder JPEGs
    python examples/classify_images.py --preloaded runs/images/<run>/cache  # reuse a preload
    accelfn launch --nproc_per_node=2 examples/classify_images.py --steps 50
    python examples/classify_images.py --resume runs/images   # continue the newest run

Time: 41 s on a 2-core CPU with little else running (load average 1), 8 min on the same
machine shared with other work (load average 7); val accuracy about 0.83. ``--full`` (32 px,
120 updates): 6.8 min (load average 2), val accuracy about 0.92.

By default the data are the embedded handwritten digits, resized once to 3 x size x size uint8.
``--folder`` preloads an image folder once into a memory-mapped TensorDict (uint8 stays uint8)
and trains from it. Augmentation (random crop with padding, horizontal flip) and
normalisation run on whole batches on the device. The model is a torchvision ResNet in
channels_last; the step stacks checkpointing, clipping, accumulation, AMP, distribution, EMA
and optionally compile. The EMA is warmed up (``with_ema(decay=0.99, warmup=True)``), so that
the average of a short run is not held back by the random initialisation; the report gives
the validation accuracy of the weights and of their EMA, with a line explaining the two.
Every ``--eval-every`` updates (and at the end) the validation loss and accuracy, summed on
the device, are logged with ``Monitor.log`` beside the training rows. Each run writes into
``runs/images/<date>-<time>`` (``--out``, ``--resume``, ``--overwrite``,
``--allow-resharding`` as in classify_digits.py): metrics.jsonl, continued by --resume, and
run.png of the whole run (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterable

import run_options  # examples/run_options.py: --out, --resume, --overwrite, --allow-resharding
import torch
import torch.nn.functional as F
import torchvision  # type: ignore[import-untyped]  # torchvision ships no py.typed marker
from tensordict import TensorDict, TensorDictBase

import accelfn as af
from accelfn import data
from accelfn.data.datasets import digits


def embedded_images(size: int = 32) -> TensorDict:
    """The embedded digits as 3-channel uint8 images of ``size`` x ``size``."""
    d = digits()
    images = F.interpolate(d["image"].float(), size=(size, size), mode="bilinear",
                           align_corners=False)
    images = images.round().clamp(0, 255).to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    return TensorDict({"image": images, "label": d["label"]}, batch_size=d.batch_size)


def dataset(args: argparse.Namespace, out: str | None) -> tuple[TensorDict, int] | None:
    """The images and the number of classes. A ``--folder`` is preloaded into the run folder
    ``out``: None while there is none yet (``out`` None)."""
    if args.preloaded:
        td = data.open_preloaded(args.preloaded)
    elif args.folder:
        if out is None:
            return None
        td = data.preload_image_folder(args.folder, os.path.join(out, "cache"), size=args.size)
    else:
        td = embedded_images(args.size)
    return td, int(td["label"].max()) + 1


def count_images(folder: str) -> int:
    """The images of an image folder; a usage error when it has none."""
    try:
        files = data.find_images(folder)[0]
    except FileNotFoundError:  # torchvision's: no class folder, or no image in them
        files = []
    if not files:
        run_options.refuse(f"--folder {folder}: no images found; it must hold one folder a "
                           f"class, each with images: {folder}/<class>/<image> (.jpg, .png, ...)")
    return len(files)


def held_out(samples: int) -> torch.Tensor:
    """Which samples are for validation: every fifth."""
    return torch.arange(samples) % 5 == 0


#: The torchvision models this example trains: ResNets, whose stem it replaces for small images.
RESNETS = tuple(name for name in ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
                                  "resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d",
                                  "wide_resnet50_2", "wide_resnet101_2")
                if hasattr(torchvision.models, name))


def ema_decay(text: str) -> float:
    """An argparse ``type``: a decay in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), e.g. 0.99; got {text}")
    return value


QUICK = {"size": 16, "steps": 60}   # the default: a first run of under a minute on a CPU
FULL = {"size": 32, "steps": 120}   # --full


def resnet_step(model: torch.nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    logits = model(batch["image"])
    loss = F.cross_entropy(logits, batch["label"], label_smoothing=0.1)
    return {"loss": loss, "accuracy": (logits.argmax(-1) == batch["label"]).float().mean()}


def evaluate(step: af.Step, state: af.TrainState, loader: Iterable[TensorDictBase],
             device: torch.device, **options: str) -> dict[str, torch.Tensor]:
    """Validation loss and accuracy over every process's share (``weights="ema"``: of the
    EMA), as device tensors: summed on the device, read only when written out."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    for batch in loader:
        result = step.evaluate(state, batch, **options)
        n = torch.tensor(float(len(batch)), dtype=torch.float64, device=device)
        sums += torch.stack([result["loss"].double() * n, result["accuracy"].double() * n, n])
    if af.world_size() > 1:
        torch.distributed.all_reduce(sums)
    return {"val_loss": sums[0] / sums[2], "val_accuracy": sums[1] / sums[2]}


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default=None, help="an image folder (one folder a class)")
    parser.add_argument("--preloaded", default=None, help="a folder written by preload")
    parser.add_argument("--full", action="store_true",
                        help=f"the longer run: --size {FULL['size']} --steps {FULL['steps']} "
                             f"(default: --size {QUICK['size']} --steps {QUICK['steps']})")
    parser.add_argument("--size", type=run_options.positive_int, default=None,
                        help="image side in pixels")
    parser.add_argument("--model", default="resnet18", choices=RESNETS,
                        help="a torchvision ResNet (default resnet18)")
    parser.add_argument("--steps", type=run_options.positive_int, default=None,
                        help="optimizer updates")
    parser.add_argument("--stop-at", type=run_options.positive_int, default=None,
                        help="save and stop after this many updates (continue with --resume)")
    parser.add_argument("--batch-size", type=run_options.positive_int, default=64)
    parser.add_argument("--eval-batch-size", type=run_options.positive_int, default=256,
                        help="images per evaluation batch (no gradients kept: larger than "
                             "training's)")
    parser.add_argument("--accumulation", type=run_options.positive_int, default=2)
    parser.add_argument("--lr", type=run_options.positive_float, default=0.1)
    parser.add_argument("--ema-decay", type=ema_decay, default=0.99,
                        help="the EMA's decay (warmed up: min(decay, (1 + n) / (10 + n)))")
    parser.add_argument("--eval-every", type=run_options.positive_int, default=30,
                        help="log the validation loss and accuracy every this many updates")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    run_options.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.folder and args.preloaded:
        parser.error("pass --folder or --preloaded, not both")
    for flag, folder in (("--folder", args.folder), ("--preloaded", args.preloaded)):
        if folder and not os.path.isdir(folder):
            parser.error(f"{flag} {folder}: no such folder")
    preset = FULL if args.full else QUICK
    args.size = args.size or preset["size"]
    args.steps = args.steps or preset["steps"]

    device = af.init_distributed()
    found = dataset(args, None)  # None for a --folder: it is preloaded into the run folder
    samples = count_images(args.folder) if found is None else len(found[0])
    run_options.check_batch(args.batch_size, int((~held_out(samples)).sum()), args.accumulation)
    run = run_options.open_run(args, "images")  # after every refusal: it makes the folder
    out = str(run.path)
    torch.manual_seed(0)
    found = found or dataset(args, out)
    assert found is not None
    images, classes = found
    is_val = held_out(len(images))
    train_set, val_set = images[~is_val], images[is_val]
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    augment = data.Compose(
        data.RandomCrop(args.size, padding=args.size // 8),
        data.RandomHorizontalFlip(),
        data.Normalize(mean, std),
        data.ChannelsLast(),
    )
    train = data.loader(train_set, batch_size=args.batch_size, device=device, transform=augment)
    val = data.loader(val_set, batch_size=args.eval_batch_size, shuffle=False, drop_last=False,
                      device=device, transform=data.Compose(data.Normalize(mean, std),
                                                            data.ChannelsLast()))

    model = getattr(torchvision.models, args.model)(num_classes=classes)
    model.conv1 = torch.nn.Conv2d(3, 64, 3, padding=1, bias=False)  # small images: no stem
    model.maxpool = torch.nn.Identity()
    model = af.channels_last(model.to(device))
    lr = af.scale_lr(args.lr, args.batch_size, base_batch_size=256)
    optimizer = torch.optim.SGD(af.param_groups(model, weight_decay=5e-4), lr=lr, momentum=0.9,
                                nesterov=True, fused=True)
    warmup = min(max(1, args.steps // 20), args.steps - 1)  # none for a single update
    scheduler = af.warmup_cosine(optimizer, warmup_steps=warmup, total_steps=args.steps)
    state = af.TrainState(model, optimizer, scheduler=scheduler)

    step = af.checkpointed(every=2)(resnet_step)
    step = af.with_clipping(max_norm=2.0)(step)
    step = af.with_accumulation(args.accumulation)(step)
    step = af.with_amp(step)
    step = af.distributed(sync_batchnorm=af.world_size() > 1 and device.type == "cuda")(step)
    # warmup=True: the n-th average uses min(decay, (1 + n) / (10 + n)), so a short run's
    # average forgets the random initialisation; a plain 0.99 still held 0.99^120 = 30% of it
    step = af.with_ema(decay=args.ema_decay, warmup=True)(step)
    if args.compile:
        step = af.compiled(step)

    # the schedule spans --steps updates: a run planned for another number is refused
    # before anything is loaded; checkpoints of this run record it (run.extra)
    run_options.resume(args, state, loader=train, step=step, total=args.steps)
    main_process = af.is_main_process()
    if main_process:
        print(f"step: {af.describe(step)}")
        print(f"data: {len(train_set)} train / {len(val_set)} val images of {args.size}px, "
              f"{classes} classes; {af.world_size()} process(es) on {device}")

    stop = min(args.steps, args.stop_at or args.steps)
    monitor: af.Monitor | None = None
    final: dict[str, torch.Tensor] | None = None
    elapsed = 0.0
    if state.step >= stop:  # a resumed run with nothing left to train
        if main_process:
            print(run_options.nothing_to_train(
                out, state.step, stop, args.steps,
                "Its learning-rate schedule ends there: to train longer, start a new run "
                f"(without --resume) with more updates, e.g. --steps {2 * args.steps}"))
    else:
        monitor = af.Monitor(total=stop, initial=state.step,  # a resumed run's bar goes on
                             progress=not args.quiet, desc=args.model,
                             log_every=10, sync_check=None,
                             throughput=af.Throughput(
                                 samples_per_step=args.batch_size),
                             state=state, sinks=[af.JsonlSink(run.metrics_file)],
                             plot=run.plot_file)
        start = time.perf_counter()
        with monitor, af.PreemptionGuard() as guard:
            while state.step < stop:
                for batch in monitor.iterate(train):
                    monitor.step(step(state, batch))
                    guard.exit_if_requested(out, state, loader=train, step=step,
                                            extra=run.extra)
                    if state.step >= stop:
                        break
                    if state.step % args.eval_every == 0:
                        monitor.log(evaluate(step, state, val, device))
            final = evaluate(step, state, val, device)  # the trained weights', logged too
            monitor.log(final)
        elapsed = time.perf_counter() - start
        state.sync()

    own = (final or evaluate(step, state, val, device))["val_accuracy"]
    ema = evaluate(step, state, val, device, weights="ema")["val_accuracy"]
    report: dict[str, float | str] = {
        "updates": state.step,
        "val_accuracy": round(float(own), 4),
        "val_accuracy_ema": round(float(ema), 4),
        "train_seconds": round(elapsed, 2),
        "processes": af.world_size(),
        "out": out,
    }
    if monitor is not None:  # something was trained: save it
        measured = monitor.report()  # this process' rate, and every process' together
        report["samples_per_s"] = round(measured.samples_per_s or 0.0, 1)
        report["global_samples_per_s"] = round(measured.global_samples_per_s or 0.0, 1)
        run.save(state, loader=train, step=step)
        if monitor.plot_file is not None:  # the whole run's, the steps before a resume too
            report["plot"] = str(monitor.plot_file)
    if main_process:
        if monitor is not None:
            print(monitor.report())
        print(json.dumps(report, indent=2))
        n = max(0, state.step - 1)  # averages before the last one (one after each update)
        used = min(args.ema_decay, (1 + n) / (10 + n))  # with_ema(warmup=True)'s decay
        print(f"val accuracy {report['val_accuracy']:.3f} with the trained weights, "
              f"{report['val_accuracy_ema']:.3f} with their EMA, an average of about the "
              f"last {1 / (1 - used):.0f} updates (decay min({args.ema_decay:g}, (1 + n) / "
              f"(10 + n)) = {used:.3f} at n = {n}: the warm-up lets a short run's average "
              "forget the random initialisation)")
    train.close()  # stop background threads before the process group goes
    val.close()
    if af.world_size() > 1:
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
