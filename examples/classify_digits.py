"""Handwritten digits: a small CNN trained with accelfn on the embedded UCI digits data.

    python examples/classify_digits.py                                # one CPU or GPU
    accelfn launch --nproc_per_node=2 examples/classify_digits.py     # several processes
    python examples/classify_digits.py --resume runs/digits           # continue its newest run

Time: 7 s on a 2-core CPU shared with other work (load average 3), 8 epochs.

The step function is pure; speed comes from the transforms stacked on it. Batches come from
an accelfn.data pipeline that augments them on the device (random crop with padding,
normalisation). A progress bar runs while training (a resumed run's continues from where
it stood); after each epoch the held-out digits are evaluated, summed on the device and
logged with ``Monitor.log`` (val_loss, val_accuracy) beside the training rows. The final
report gives held-out accuracy, samples/s and the monitor's bottleneck verdict. The run
folder gets one JSON line per update (metrics.jsonl, continued by --resume) and a plot of
its whole history: loss with the validation loss, learning rate, validation accuracy,
throughput, data wait and memory (run.png, needs matplotlib), whose path is printed at the
end.

Each run writes into a folder of its own, ``runs/digits/<date>-<time>`` (``--out`` chooses
another; one holding another run's checkpoints is refused unless ``--overwrite``).
``--resume`` continues a run in its folder; a checkpoint written by another number of
processes needs ``--allow-resharding``. Resuming a finished run says so and trains nothing.
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
from tensordict import TensorDictBase
from torch import nn

import accelfn as af
from accelfn import data
from accelfn.data.datasets import digits
from accelfn.observe.threads import default_threads


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class DigitNet(nn.Module):
    """A tiny residual CNN for 1x8x8 images."""

    def __init__(self, width: int = 32, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        logits: torch.Tensor = self.head(h.mean(dim=(2, 3)))
        return logits


def digit_step(model: nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    """The pure step function: loss and accuracy of one batch."""
    logits = model(batch["image"])
    loss = F.cross_entropy(logits, batch["label"], label_smoothing=0.05)
    return {"loss": loss, "accuracy": (logits.argmax(-1) == batch["label"]).float().mean()}


def evaluate(step: af.Step, state: af.TrainState, loader: Iterable[TensorDictBase],
             device: torch.device) -> dict[str, torch.Tensor]:
    """Held-out loss and accuracy over every process's share, as device tensors: summed on
    the device (no host sync), to be read when written out."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    for batch in loader:
        result = step.evaluate(state, batch)
        n = torch.tensor(float(len(batch)), dtype=torch.float64, device=device)
        sums += torch.stack([result["loss"].double() * n, result["accuracy"].double() * n, n])
    if af.world_size() > 1:
        torch.distributed.all_reduce(sums)
    return {"val_loss": sums[0] / sums[2], "val_accuracy": sums[1] / sums[2]}


def torch_threads() -> int:
    """torch's intra-op threads for this process: what ``OMP_NUM_THREADS`` says when it is set
    (``torchrun`` sets 1 for several processes), else as many as the free cores allow
    (``default_threads``: the usable cores less the load of other work, shared by this
    machine's processes of the job), a count the monitor's verdict does not call
    oversubscribed. torch's default, one per core, is oversubscribed on a loaded machine."""
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(default_threads(int(os.environ.get("LOCAL_WORLD_SIZE") or 1)))
    return torch.get_num_threads()


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=run_options.positive_int, default=8)
    parser.add_argument("--steps", type=run_options.positive_int, default=None,
                        help="train for this many updates")
    parser.add_argument("--stop-at", type=run_options.positive_int, default=None,
                        help="save and stop after this many updates (resume with --resume)")
    parser.add_argument("--batch-size", type=run_options.positive_int, default=64)
    parser.add_argument("--accumulation", type=run_options.positive_int, default=2)
    parser.add_argument("--lr", type=run_options.positive_float, default=3e-3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--fp16", action="store_true", help="fp16 with loss scaling, not bf16")
    run_options.add_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    threads = torch_threads()
    device = af.init_distributed()
    main_process = af.is_main_process()
    dataset = digits()
    held_out = torch.arange(len(dataset)) % 5 == 0          # 20% for evaluation
    train_set, test_set = dataset[~held_out], dataset[held_out]
    run_options.check_batch(args.batch_size, len(train_set), args.accumulation)
    run = run_options.open_run(args, "digits")  # after every refusal: it makes the folder
    out = str(run.path)
    torch.manual_seed(args.seed)

    augment = data.Compose(
        data.RandomCrop(8, padding=1),
        data.Normalize(mean=[0.3], std=[0.38], dtype=torch.float32),
    )
    train = data.loader(train_set, batch_size=args.batch_size, shuffle=True, seed=args.seed,
                        device=device, transform=augment)
    test = data.loader(test_set, batch_size=len(test_set) // af.world_size(), shuffle=False,
                       drop_last=False, device=device,
                       transform=data.Normalize(mean=[0.3], std=[0.38]))

    model = DigitNet().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=af.scale_lr(args.lr, args.batch_size,
                                                                      args.batch_size),
                                  weight_decay=1e-4, fused=True)
    total = args.steps or args.epochs * len(train)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total)
    state = af.TrainState(model, optimizer, scheduler=scheduler)

    step = af.with_clipping(max_norm=1.0)(digit_step)
    step = af.with_accumulation(args.accumulation)(step)
    step = af.with_amp(dtype=torch.float16 if args.fp16 else None)(step)
    step = af.distributed(step)
    if args.compile:
        step = af.compiled(step)

    # the schedule spans `total` updates: a run planned for another number is refused
    # before anything is loaded; checkpoints of this run record it (run.extra)
    run_options.resume(args, state, loader=train, step=step, total=total)
    if main_process:
        print(f"step: {af.describe(step)}")
        print(f"data: {len(train_set)} train / {len(test_set)} held-out digits on {device}, "
              f"{af.world_size()} process(es), {threads} torch thread(s) each")

    stop = min(total, args.stop_at or total)
    monitor: af.Monitor | None = None
    elapsed = 0.0
    if state.step >= stop:  # a resumed run with nothing left to train
        if main_process:
            print(run_options.nothing_to_train(
                out, state.step, stop, total,
                "Its learning-rate schedule ends there: to train longer, start a new run "
                f"(without --resume) with more updates, e.g. --steps {2 * total}"))
    else:
        monitor = af.Monitor(total=stop, initial=state.step,  # a resumed run's bar goes on
                             progress=not args.quiet, desc="digits",
                             throughput=af.Throughput(
                                 samples_per_step=args.batch_size),
                             log_every=10,  # one step runs under the host-sync probe:
                             sync_check=af.SyncCheck(step=3),
                             state=state,  # rows numbered by state.step: a resume continues
                             # and the plot draws the whole file
                             sinks=[af.JsonlSink(run.metrics_file)], plot=run.plot_file)
        start = time.perf_counter()
        with monitor, af.PreemptionGuard() as guard:  # SIGTERM: checkpoint, exit 75
            while state.step < stop:
                for batch in monitor.iterate(train):
                    metrics = step(state, batch)
                    monitor.step(metrics)
                    guard.exit_if_requested(out, state, loader=train, step=step,
                                            extra=run.extra)
                    if state.step >= stop:
                        break
                # the end of an epoch (or of the run): the held-out digits, beside the rows
                monitor.log(evaluate(step, state, test, device))
        elapsed = time.perf_counter() - start
        state.sync()  # settle the last update's deferred non-finite decision

    accuracy = float(evaluate(step, state, test, device)["val_accuracy"])

    report: dict[str, float | str] = {
        "updates": state.step,
        "held_out_accuracy": round(accuracy, 4),
        "train_seconds": round(elapsed, 2),
        "skipped_updates": state.slots["nonfinite"].skipped if "nonfinite" in state.slots
        else 0,
        "processes": af.world_size(),
        "device": str(device),
        "out": out,
    }
    plot = None
    if monitor is not None:  # something was trained: save it
        measured = monitor.report()  # this process' rate, and every process' together
        report["samples_per_s"] = round(measured.samples_per_s or 0.0, 1)
        report["global_samples_per_s"] = round(measured.global_samples_per_s or 0.0, 1)
        run.save(state, loader=train, step=step)
        plot = monitor.plot_file  # the whole run's, the steps before a resume too
        if plot is not None:
            report["plot"] = str(plot)
    if main_process:
        if monitor is not None:
            print(monitor.report())
        print(json.dumps(report, indent=2))
        if plot is not None:
            print(f"plot: {plot}")
    train.close()  # stop background threads before the process group goes
    test.close()
    if af.world_size() > 1:
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
