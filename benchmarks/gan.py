"""The DCGAN's extra generator forward: examples/gan.py against dcgan/main.py's loop.

``main.py`` runs the generator once per iteration and reuses ``fake`` for both updates; the
example's discriminator step runs it once more, without gradients (a step's graph ends with
its update). This prints, per iteration of the example's models at its batch size: the plain
loop's time, the two accelfn steps' time, and the time of that extra forward alone
(``torch.no_grad()``, BatchNorm untracked), with the ratios.

Every side runs the same iterations on the same batch, on its own copy of the models. Rounds
interleave the sides, rotating which goes first; each round gives each side's median thread
CPU time per iteration; the figures are medians over rounds. One intra-op thread by default.

    python benchmarks/gan.py [--rounds 9] [--iterations 20] [--batch-size 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from tensordict import TensorDict
from torch import nn

import accelfn as af

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import gan  # examples/gan.py: the models and step functions


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=2e-4, betas=(0.5, 0.999))


def plain_side(netG: nn.Module, netD: nn.Module, real: torch.Tensor) -> Callable[[], None]:
    """dcgan/main.py's iteration: one generator forward, ``fake`` reused."""
    criterion, optimizerD, optimizerG = nn.BCELoss(), adam(netD), adam(netG)

    def iteration() -> None:
        netD.zero_grad()
        label = torch.full((len(real),), 1.0)
        criterion(netD(real), label).backward()
        fake = netG(torch.randn(len(real), gan.NZ, 1, 1))
        label.fill_(0.0)
        criterion(netD(fake.detach()), label).backward()
        optimizerD.step()
        netG.zero_grad()
        label.fill_(1.0)
        criterion(netD(fake), label).backward()
        optimizerG.step()

    return iteration


def accelfn_side(netG: nn.Module, netD: nn.Module, real: torch.Tensor) -> Callable[[], None]:
    """examples/gan.py's iteration: the discriminator's step, then the generator's."""
    state_d, state_g = af.TrainState(netD, adam(netD)), af.TrainState(netG, adam(netG))
    discriminator_loss, generator_loss = gan.gan_losses(netG, netD)
    d_step, g_step = af.distributed(discriminator_loss), af.distributed(generator_loss)

    def iteration() -> None:
        batch = TensorDict({"image": real, "noise": torch.randn(len(real), gan.NZ, 1, 1)},
                           batch_size=[len(real)])
        d_step(state_d, batch)
        g_step(state_g, batch)

    return iteration


def forward_side(netG: nn.Module, real: torch.Tensor) -> Callable[[], None]:
    """The extra forward alone: the generator without gradients, BatchNorm untracked."""
    noise = torch.randn(len(real), gan.NZ, 1, 1)

    def forward() -> None:
        with torch.no_grad(), af.untracked_batchnorm(netG):
            netG(noise)

    return forward


def per_call(fn: Callable[[], None], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - start)
    return statistics.median(times) / 1e6


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    netG, netD = gan.Generator(), gan.Discriminator()
    netG.apply(gan.weights_init)
    netD.apply(gan.weights_init)
    real = gan.images16(gan.digits())["image"][:args.batch_size]
    sides = {"plain": plain_side(copy.deepcopy(netG), copy.deepcopy(netD), real),
             "accelfn": accelfn_side(copy.deepcopy(netG), copy.deepcopy(netD), real),
             "generator_forward": forward_side(copy.deepcopy(netG), real)}
    for fn in sides.values():  # warm up
        per_call(fn, 3)
    rounds: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rounds[name].append(per_call(sides[name], args.iterations))
    ms = {name: statistics.median(values) for name, values in rounds.items()}
    report: dict[str, object] = {
        "benchmark": "gan_extra_forward",
        "batch_size": args.batch_size, "threads": args.threads, "rounds": args.rounds,
        "iterations_per_round": args.iterations,
        "plain_iteration_ms": round(ms["plain"], 3),
        "accelfn_iteration_ms": round(ms["accelfn"], 3),
        "generator_forward_ms": round(ms["generator_forward"], 3),
        "accelfn_over_plain": round(ms["accelfn"] / ms["plain"], 3),
        "generator_forward_share_of_accelfn_iteration": round(
            ms["generator_forward"] / ms["accelfn"], 3),
        "torch": torch.__version__, "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
