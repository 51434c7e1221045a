"""accelfn's transforms inside your own loop: your evaluation, your logging, your schedule.

    python examples/hand_written_loop.py
    accelfn launch --nproc_per_node=2 examples/hand_written_loop.py
    python examples/hand_written_loop.py --epochs 6 --resume runs/loop

Time: 4.5 s on a 2-core CPU shared with other work (load average 3), 4 epochs.

Nothing here is owned by accelfn but the step: the loop, the epoch structure, when to
evaluate, what to log (read from the device every ``--log-every`` updates only), and when to
save are plain Python. Each run writes into ``runs/loop/<date>-<time>`` (``--out``,
``--resume``, ``--overwrite``, ``--allow-resharding`` as in classify_digits.py).
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from collections.abc import Iterable

import run_options  # examples/run_options.py: --out, --resume, --overwrite, --allow-resharding
import torch
import torch.nn.functional as F
from tensordict import TensorDict, TensorDictBase
from torch import nn

import accelfn as af
from accelfn import checkpointing, data
from accelfn.data.datasets import digits


def loss_fn(model: nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    logits = model(batch["image"].flatten(1))
    loss = F.cross_entropy(logits, batch["label"])
    return {"loss": loss, "accuracy": (logits.argmax(-1) == batch["label"]).float().mean()}


def evaluate(step: af.Step, state: af.TrainState, batches: Iterable[TensorDictBase]) -> float:
    """Held-out accuracy, summed over processes."""
    device = state.device
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        result = step.evaluate(state, batch)
        totals += torch.stack([result["accuracy"].double() * len(batch),
                               torch.tensor(float(len(batch)), device=device)])
    if af.world_size() > 1:
        torch.distributed.all_reduce(totals)
    return float(totals[0] / totals[1])


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=run_options.positive_int, default=4)
    parser.add_argument("--log-every", type=run_options.positive_int, default=10)
    run_options.add_arguments(parser)
    args = parser.parse_args(argv)

    device = af.init_distributed()
    out = run_options.run_folder(args, "loop")
    torch.manual_seed(0)
    dataset = digits()
    is_test = torch.arange(len(dataset)) % 5 == 0
    train = data.loader(dataset[~is_test], batch_size=64, device=device, seed=1,
                        transform=data.Normalize(mean=[0.3], std=[0.38]))
    test = data.loader(dataset[is_test], batch_size=90, shuffle=False, drop_last=False,
                       device=device, transform=data.Normalize(mean=[0.3], std=[0.38]))

    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    state = af.TrainState(model, optimizer)  # no scheduler: this loop sets the lr itself
    step = af.distributed(af.with_amp(af.with_accumulation(2)(af.with_clipping(loss_fn))))

    start_epoch = 0
    # epochs restart the loader; "resumed in N processes" is said once the epoch is checked
    info = run_options.resume(args, state, loader=None, step=step, announce=False)
    if info is not None:
        saved = info.extra if isinstance(info.extra, dict) else {}
        if not isinstance(saved.get("epoch"), int):  # another loop's checkpoint of this model
            run_options.refuse(
                f"--resume {info.path}: the checkpoint records no epoch (its extra data: "
                f"{saved or None}), so hand_written_loop.py did not write it: resume a run of "
                "this example (runs/loop/<run>), or start a new run (without --resume)")
        start_epoch = saved["epoch"] + 1
    run_options.announce_resumed(args)

    if af.is_main_process():
        print(f"step: {af.describe(step)}")
        if start_epoch >= args.epochs:
            print(f"{out}: the run already trained its {start_epoch} epoch(s); nothing to "
                  f"train. Pass --epochs N with N > {start_epoch} (and --resume) to train "
                  "longer")
    log_rows: list[dict[str, float]] = []
    pending: list[tuple[int, TensorDict]] = []  # device metrics, read every log_every
    main_process = af.is_main_process()
    accuracy = evaluate(step, state, test) if start_epoch >= args.epochs else 0.0
    def flush(epoch: int) -> None:
        for update, metrics in pending:               # one read for many updates
            log_rows.append({"update": update, "epoch": epoch,
                             **{k: round(float(v), 5) for k, v in metrics.items()
                                if isinstance(v, torch.Tensor)}})  # metrics are flat
        pending.clear()

    for epoch in range(start_epoch, args.epochs):
        for group in optimizer.param_groups:           # a hand-written step decay
            group["lr"] = 3e-3 * (0.5 ** epoch)
        t0 = time.perf_counter()
        for batch in train:
            metrics = step(state, batch)
            pending.append((state.step, metrics))        # updates counted from 1
            if len(pending) == args.log_every:
                flush(epoch)
        flush(epoch)                                  # the epoch's last few
        accuracy = evaluate(step, state, test)
        if main_process:
            print(f"epoch {epoch}: held-out accuracy {accuracy:.3f} "
                  f"({time.perf_counter() - t0:.1f} s)")
        checkpointing.save(out, state, step=step, keep=1, extra={"epoch": epoch})
    if main_process and log_rows:
        path = os.path.join(out, "log.csv")
        continued = info is not None and os.path.exists(path)  # a resumed run appends
        with open(path, "a" if continued else "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(log_rows[0]))
            if not continued:
                writer.writeheader()
            writer.writerows(log_rows)
    train.close()  # stop background threads before the process group goes
    test.close()
    if af.world_size() > 1:
        torch.distributed.destroy_process_group()
    return {"updates": state.step, "held_out_accuracy": accuracy}


if __name__ == "__main__":
    main()
