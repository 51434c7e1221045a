"""Ray Train: an accelfn loop as the training function of ``ray.train.torch.TorchTrainer``.

    python examples/ray_train.py                          # local Ray, 2 CPU workers
    python examples/ray_train.py --workers 4 --steps 120
    python examples/ray_train.py --crash-at 25            # the last worker dies at update 25, once
    python examples/ray_train.py --resume runs/ray_digits  # continue its newest run

Time: 38 s on a 2-core CPU (idle; 83 s at load average 5 to 8), 60 updates, of which the
training takes a few seconds: the rest is Ray starting its processes (importing Ray,
``ray.init``, the worker group). Needs ``pip install 'accelfn[ray]'``.

``train_loop`` is the accelfn loop as a torchrun script has it: ``af.init_distributed()``
takes the process group Ray's TorchTrainer set up (gloo on CPUs, nccl with ``--gpu``),
``af.distributed`` wraps the model in DDP over it, the loader shards the digits by rank, and
a ``RunFolder`` holds the run's checkpoints. Ray adds two calls: ``ray.train.report`` after
each checkpoint, with rank 0 handing Ray a copy of it (named as accelfn names it, kept under
``<run>/ray/``), and Ray's ``FailureConfig`` restarting the worker group when a worker dies.

How the two split the work: accelfn's run folder (a path every worker can read: any local
path with one machine, a shared file system across machines) holds the exact checkpoints a
restarted group resumes from (weights, optimizer, schedule, loader position, each rank's RNG
states), so the run ends with the parameters of an uninterrupted one. Ray's copies are its
bookkeeping: ``Result.checkpoint`` and ``Result.metrics`` of ``trainer.fit()``; in one
process ``accelfn.checkpointing.load(result.checkpoint.path, state, allow_resharding=True)``
loads the trained weights.

``--crash-at N`` shows a restart: the last worker kills itself (SIGKILL) at update N the first time;
Ray restarts the group, which resumes from the run's newest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import run_options  # examples/run_options.py: --out, --resume, --overwrite, --allow-resharding
import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from torch import nn

import accelfn as af
from accelfn import checkpointing, data
from accelfn.checkpointing import RunFolder
from accelfn.data.datasets import digits


def digit_model() -> nn.Module:
    """A small MLP over the 8x8 digits (no batch norm: DDP equals one process on the same
    rows)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def digit_step(model: nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    """The pure step function: loss and accuracy of one batch."""
    logits = model(batch["image"])
    loss = F.cross_entropy(logits, batch["label"])
    return {"loss": loss, "accuracy": (logits.argmax(-1) == batch["label"]).float().mean()}


def split(dataset: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
    """(train, held out): every fifth digit is held out."""
    held_out = torch.arange(len(dataset)) % 5 == 0
    return dataset[~held_out], dataset[held_out]


MEAN, STD = [0.3], [0.38]  # the digits' pixel statistics


def restart_point(out: str, start: str | None, before: str | None) -> str | None:
    """The checkpoint a worker group resumes: the newest in ``out`` when this run saved it (a
    group Ray restarted), else ``start`` (the ``--resume`` the run began from, or None).
    ``before`` is the newest checkpoint in ``out`` when the run began."""
    newest = checkpointing.latest(out)
    if newest is not None and newest.name != before:
        return str(newest)
    return start


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: the accelfn loop of a torchrun script, plus ``ray.train.report``
    after each checkpoint (every worker calls it: it is a barrier)."""
    import ray.train

    device = af.init_distributed()  # the process group TorchTrainer set up
    torch.manual_seed(config["seed"])
    model = digit_model().to(device)
    train_set, held_out = split(digits())
    train = data.loader(train_set, batch_size=config["batch_size"], shuffle=True,
                        seed=config["seed"], device=device,
                        transform=data.Normalize(mean=MEAN, std=STD))
    total = config["steps"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config["lr"],
                                                    total_steps=total)
    state = af.TrainState(model, optimizer, scheduler=scheduler)
    step = af.distributed(af.with_clipping(max_norm=1.0)(digit_step))

    # a group Ray restarted resumes from the newest checkpoint this run saved
    run = RunFolder("ray_digits", out=config["out"],
                    resume=restart_point(config["out"], config["start"], config["before"]),
                    allow_resharding=config["allow_resharding"])
    info = run.resume(state, loader=train, step=step, plan={"total_steps": total})
    crash = Path(config["out"]) / f".crashed-at-{config['crash_at']}"
    rank = torch.distributed.get_rank() if af.world_size() > 1 else 0

    def report(metrics: TensorDictBase | None, *, final: bool) -> None:
        row: dict[str, float] = {"step": state.step}
        if metrics is not None:  # a collective: every worker reduces, at a checkpoint only
            reduced = af.reduce_metrics(metrics)
            row.update({str(k): float(reduced[k]) for k in reduced.keys()})
            saved = run.save(state, loader=train, step=step)
        if final:
            row["resumed_from"] = 0 if info is None else info.step
            images = data.Normalize(mean=MEAN, std=STD)(held_out.to(device))
            row["held_out_accuracy"] = float(step.evaluate(state, images)["accuracy"])
        if metrics is None:  # a resumed run with nothing left to train
            ray.train.report(row)
            return
        checkpoint = ray.train.Checkpoint.from_directory(str(saved)) if rank == 0 else None
        ray.train.report(row, checkpoint=checkpoint, checkpoint_dir_name=saved.name)

    metrics = None
    while state.step < total:
        for batch in train:
            metrics = step(state, batch)
            if (state.step == config["crash_at"] and rank == af.world_size() - 1
                    and not crash.exists()):
                crash.touch()  # the first time only: the restarted group goes past it
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step >= total:
                break
            if state.step % config["save_every"] == 0:
                report(metrics, final=False)
    report(metrics, final=True)
    train.close()  # stop the loader's threads; Ray destroys the process group


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=run_options.positive_int, default=2,
                        help="Ray Train workers (processes), one CPU (or GPU) each")
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker (nccl)")
    parser.add_argument("--steps", type=run_options.positive_int, default=60)
    parser.add_argument("--batch-size", type=run_options.positive_int, default=32,
                        help="per worker")
    parser.add_argument("--lr", type=run_options.positive_float, default=3e-3)
    parser.add_argument("--save-every", type=run_options.positive_int, default=20,
                        help="checkpoint (and report to Ray) every this many updates")
    parser.add_argument("--crash-at", type=run_options.positive_int, default=None,
                        help="the last worker kills itself at this update, the first time "
                             "only: Ray restarts the group, which resumes from the newest "
                             "checkpoint")
    parser.add_argument("--max-failures", type=run_options.non_negative_int, default=1,
                        help="worker group restarts Ray allows (FailureConfig)")
    parser.add_argument("--seed", type=int, default=0)
    run_options.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.crash_at is not None and args.workers < 2:
        run_options.refuse("--crash-at needs --workers 2 or more (the last worker dies)")
    samples = len(split(digits())[0])
    if args.batch_size * args.workers > samples:
        run_options.refuse(f"--batch-size {args.batch_size} on {args.workers} workers is more "
                           f"than the {samples} training digits: lower --batch-size")

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    run = run_options.open_run(args, "ray_digits")  # decided here, before any worker starts
    newest = checkpointing.latest(run.path)
    config = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
              "save_every": args.save_every, "crash_at": args.crash_at, "seed": args.seed,
              "out": str(run.path.resolve()), "start": args.resume,
              "before": None if newest is None else newest.name,
              "allow_resharding": args.allow_resharding}
    started = not ray.is_initialized()
    if started:  # a local Ray instance; ray.init(address=...) beforehand joins a cluster
        ray.init(num_cpus=args.workers, include_dashboard=False)  # the GPUs found
    try:
        trainer = TorchTrainer(
            train_loop, train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
            run_config=RunConfig(name="ray", storage_path=config["out"],
                                 failure_config=FailureConfig(max_failures=args.max_failures),
                                 checkpoint_config=CheckpointConfig(num_to_keep=run.keep)))
        result = trainer.fit()
    finally:
        if started:
            ray.shutdown()
    metrics = dict(result.metrics or {})
    report = {"updates": int(metrics.get("step", 0)),
              "loss": metrics.get("loss"),
              "held_out_accuracy": metrics.get("held_out_accuracy"),
              "resumed_from": metrics.get("resumed_from"),
              "workers": args.workers,
              "out": config["out"],
              "ray_checkpoint": None if result.checkpoint is None else result.checkpoint.path}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
