"""Distillation: a small student learns from a frozen teacher's softened predictions.

    python examples/distill.py                                    # one CPU or GPU
    accelfn launch --nproc_per_node=2 examples/distill.py         # DDP around each model
    python examples/distill.py --steps 600 --resume runs/distill  # continue the newest run

Time: 5 s on a 2-core CPU with little else running, 150 teacher and 300 student updates.

The teacher (a wide MLP) is trained first, briefly, with a TrainState and a step of its own.
Then it is frozen (``requires_grad_(False)``, ``eval()``) and the student's step function
closes over it: the student is the only model its TrainState trains, and the teacher is an
ordinary module called under ``torch.no_grad()``. The loss is the usual one for knowledge
distillation, with temperature ``T`` and weight ``alpha``:

    alpha * KL(softmax(teacher / T) || softmax(student / T)) * T^2 + (1 - alpha) * CE(student)

``--alpha 0`` trains the same student on the labels alone, for comparison.
``tests/test_example_distill.py`` shows the student's step bitwise equal (fp32) to the plain
loop that computes this loss and calls ``backward()`` and the optimizer by hand. Each run
writes into ``runs/distill/<date>-<time>`` (``--out``, ``--resume``, ``--overwrite``,
``--allow-resharding`` as in classify_digits.py); the checkpoint is the student's state, with
the teacher's weights in its extra data (a resumed run does not train the teacher again).
The student's training rows go to the run's ``metrics.jsonl`` through an ``af.Monitor``
(its progress bar continues from where a resumed run stood), with its held-out loss and
accuracy every ``--eval-every`` updates, summed on the device and logged with
``Monitor.log``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import run_options  # examples/run_options.py: --out, --resume, --overwrite, --allow-resharding
import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from torch import nn

import accelfn as af
from accelfn import data
from accelfn.data.datasets import digits


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def classify(model: nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    """The teacher's step function: cross-entropy on the labels."""
    logits = model(batch["image"])
    return {"loss": F.cross_entropy(logits, batch["label"]),
            "accuracy": (logits.argmax(-1) == batch["label"]).float().mean()}


def distillation(teacher: nn.Module, *, temperature: float,
                 alpha: float) -> Callable[[nn.Module, TensorDictBase], dict[str, torch.Tensor]]:
    """The student's step function; it closes over the frozen ``teacher``."""

    def distill(model: nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        logits = model(batch["image"])
        with torch.no_grad():
            target = teacher(batch["image"])
        soft = F.kl_div(F.log_softmax(logits / temperature, dim=-1),
                        F.log_softmax(target / temperature, dim=-1),
                        reduction="batchmean", log_target=True) * temperature ** 2
        hard = F.cross_entropy(logits, batch["label"])
        return {"loss": alpha * soft + (1 - alpha) * hard, "soft": soft, "hard": hard,
                "accuracy": (logits.argmax(-1) == batch["label"]).float().mean()}

    return distill


def train(step: af.Step, state: af.TrainState, loader: data.BatchLoader, updates: int) -> None:
    while state.step < updates:
        for batch in loader:
            step(state, batch)
            if state.step >= updates:
                break


def evaluate(model: nn.Module, loader: data.BatchLoader) -> dict[str, torch.Tensor]:
    """Held-out cross-entropy and accuracy over every process, as device tensors: summed on
    the device, read only when written out (``Monitor.log``) or printed."""
    device = next(model.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    with torch.no_grad():
        for batch in loader:
            logits = model(batch["image"])
            loss = F.cross_entropy(logits, batch["label"], reduction="sum")
            hits = (logits.argmax(-1) == batch["label"]).sum()
            n = torch.tensor(float(len(batch)), dtype=torch.float64, device=device)
            sums += torch.stack([loss.double(), hits.double(), n])
    if af.world_size() > 1:
        torch.distributed.all_reduce(sums)
    return {"val_loss": sums[0] / sums[2], "val_accuracy": sums[1] / sums[2]}


def accuracy(model: nn.Module, loader: data.BatchLoader) -> float:
    """Held-out accuracy, counted over every process."""
    return round(float(evaluate(model, loader)["val_accuracy"]), 4)


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=run_options.positive_int, default=300,
                        help="student updates")
    parser.add_argument("--teacher-steps", type=run_options.positive_int, default=150)
    parser.add_argument("--temperature", type=run_options.positive_float, default=4.0)
    parser.add_argument("--alpha", type=float, default=0.9,
                        help="weight of the teacher's soft targets (0: the labels alone)")
    parser.add_argument("--eval-every", type=run_options.positive_int, default=100,
                        help="log the student's held-out loss and accuracy every this many "
                             "updates")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    run_options.add_arguments(parser)
    args = parser.parse_args(argv)
    if not 0.0 <= args.alpha <= 1.0:
        parser.error(f"argument --alpha: must be in [0, 1], got {args.alpha:g}")

    device = af.init_distributed()
    main_process = af.is_main_process()
    dataset = digits()
    held_out = torch.arange(len(dataset)) % 5 == 0
    run = run_options.open_run(args, "distill")
    out = str(run.path)
    normalize = data.Normalize(mean=[0.3], std=[0.38])

    def loader(seed: int) -> data.BatchLoader:
        return data.loader(dataset[~held_out], batch_size=64, device=device, seed=seed,
                           transform=normalize)

    test = data.loader(dataset[held_out], batch_size=90, shuffle=False, drop_last=False,
                       device=device, transform=normalize)
    torch.manual_seed(args.seed)
    teacher, student = mlp(512).to(device), mlp(32).to(device)
    state = af.TrainState(student, torch.optim.AdamW(student.parameters(), lr=3e-3))
    step = af.distributed(distillation(teacher, temperature=args.temperature, alpha=args.alpha))
    train_loader = loader(args.seed)

    info = run_options.resume(args, state, loader=train_loader, step=step)
    if info is not None:  # the teacher rides in the student's checkpoint
        teacher.load_state_dict(info.extra["teacher"])
    else:  # train the teacher first, with a state and a step of its own
        teacher_state = af.TrainState(teacher, torch.optim.AdamW(teacher.parameters(), lr=1e-3))
        teacher_loader = loader(args.seed + 1)
        start = time.perf_counter()
        train(af.distributed(classify), teacher_state, teacher_loader, args.teacher_steps)
        teacher_loader.close()
        if main_process:
            print(f"teacher: {args.teacher_steps} updates in {time.perf_counter() - start:.1f} s")
    teacher.requires_grad_(False).eval()  # frozen: the student's step only calls it

    if main_process:
        print(f"student: {af.describe(step)}, T={args.temperature:g}, alpha={args.alpha:g}")
        if state.step >= args.steps:
            print(run_options.nothing_to_train(
                out, state.step, args.steps, args.steps,
                f"Pass --steps N with N > {state.step} (and --resume) to train longer"))
    trained = state.step < args.steps
    start = time.perf_counter()
    if trained:  # the student's rows and its held-out loss go to the run's metrics.jsonl
        monitor = af.Monitor(total=args.steps, initial=state.step,  # a resume's bar goes on
                             progress=not args.quiet, desc="student", log_every=50,
                             sync_check=None,
                             throughput=af.Throughput(samples_per_step=64),
                             state=state, sinks=[af.JsonlSink(run.metrics_file)])
        with monitor:
            while state.step < args.steps:
                for batch in monitor.iterate(train_loader):
                    monitor.step(step(state, batch))
                    if state.step % args.eval_every == 0 or state.step >= args.steps:
                        monitor.log(evaluate(student, test))
                    if state.step >= args.steps:
                        break
    elapsed = time.perf_counter() - start

    report: dict[str, float | str] = {
        "updates": state.step,
        "teacher_accuracy": accuracy(teacher, test),
        "student_accuracy": accuracy(student, test),
        "student_parameters": sum(p.numel() for p in student.parameters()),
        "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
        "train_seconds": round(elapsed, 2),
        "processes": af.world_size(),
        "out": out,
    }
    if trained:
        run.save(state, loader=train_loader, step=step, extra={"teacher": teacher.state_dict()})
    if main_process:
        print(json.dumps(report, indent=2))
    train_loader.close()  # stop background threads before the process group goes
    test.close()
    if af.world_size() > 1:
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
