"""A user-written transform: gradient noise, composed with the built-ins.

    python examples/custom_transform.py
    accelfn launch --nproc_per_node=2 examples/custom_transform.py
    python examples/custom_transform.py --steps 300 --resume runs/noise

Time: 4.5 s on a 2-core CPU shared with other work (load average 3), 200 updates.

``with_gradient_noise`` is an ``accelfn.Transform`` of the user's: a name, an update of the
gradients (after unscaling, micro-batch weighting and the reduction across processes,
before clipping), and a state (its random generator's), which the TrainState keeps and
checkpoints. ``tests/test_examples.py`` checks it against the noise written by hand and runs
``accelfn.testing.check_transform`` on it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import run_options  # examples/run_options.py: --out, --resume, --overwrite, --allow-resharding
import torch
import torch.nn.functional as F
from tensordict import TensorDictBase
from torch import nn

import accelfn as af
from accelfn import data
from accelfn.data.datasets import digits


def with_gradient_noise(*, std: float = 0.01, seed: int = 0) -> af.Transform:
    """Equivalent to ``p.grad += std * randn_like(p.grad)`` for every parameter, before
    clipping and the optimizer step."""
    if not std > 0:
        raise ValueError(f"with_gradient_noise(std={std!r}) must be > 0")

    def init(params: list[torch.Tensor]) -> dict[str, Any]:
        generator = torch.Generator(params[0].device).manual_seed(seed)
        return {"rng": generator.get_state()}

    def add_noise(grads: list[torch.Tensor], params: list[torch.Tensor],
                  state: dict[str, Any]) -> dict[str, Any]:
        generator = torch.Generator(grads[0].device)
        generator.set_state(state["rng"])
        for g in grads:
            g.add_(torch.randn(g.shape, generator=generator, device=g.device, dtype=g.dtype),
                   alpha=std)
        return {"rng": generator.get_state()}  # the new state: kept if the update applies

    return af.Transform("with_gradient_noise", update=add_noise, init=init,
                        label=f"with_gradient_noise({std:g})")


def mlp_step(model: nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
    logits = model(batch["image"].flatten(1))
    loss = F.cross_entropy(logits, batch["label"])
    return {"loss": loss, "accuracy": (logits.argmax(-1) == batch["label"]).float().mean()}


def main(argv: list[str] | None = None) -> dict[str, float | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=run_options.positive_int, default=200)
    parser.add_argument("--std", type=run_options.positive_float, default=0.01)
    run_options.add_arguments(parser)
    args = parser.parse_args(argv)

    device = af.init_distributed()
    run = run_options.open_run(args, "noise")
    out = str(run.path)
    torch.manual_seed(0)
    dataset = digits()
    train = data.loader(dataset, batch_size=32, device=device,
                        transform=data.Normalize(mean=[0.3], std=[0.38]))
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = af.TrainState(model, optimizer)
    step = af.distributed(af.with_clipping(max_norm=1.0)(with_gradient_noise(std=args.std)(
        mlp_step)))
    run_options.resume(args, state, loader=train, step=step)
    if af.is_main_process():
        print(af.describe(step))
        if state.step >= args.steps:
            print(run_options.nothing_to_train(
                out, state.step, args.steps, args.steps,
                f"Pass --steps N with N > {state.step} (and --resume) to train longer"))
    trained = state.step < args.steps
    metrics = None
    while state.step < args.steps:
        for batch in train:
            metrics = step(state, batch)
            if state.step >= args.steps:
                break
    summary: dict[str, float | None] = {
        "updates": state.step,
        "loss": None if metrics is None else float(metrics["loss"]),
        "accuracy": None if metrics is None else float(metrics["accuracy"])}
    if trained:
        run.save(state, loader=train, step=step)
    if af.is_main_process():
        print(json.dumps(summary))
    train.close()  # stop background threads before the process group goes
    if af.world_size() > 1:
        torch.distributed.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
