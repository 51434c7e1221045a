"""A DCGAN on the embedded digits: two models, two TrainStates, two steps.

    python examples/gan.py                                    # one CPU or GPU
    accelfn launch --nproc_per_node=2 examples/gan.py         # DDP around each model
    python examples/gan.py --steps 600 --resume runs/gan      # continue the newest run

Time: 9 s on a 2-core CPU with little else running, 300 iterations.

The shape of pytorch/examples' ``dcgan/main.py``, scaled down to 16x16 images (the 8x8
digits upsampled): its generator (transposed convolutions, BatchNorm, ReLU, Tanh) and
discriminator (strided convolutions, LeakyReLU, BatchNorm, Sigmoid) with three layers each
instead of five, ``BCELoss`` on real and fake labels, ``Adam(lr=2e-4, betas=(0.5, 0.999))``
for each model. Each iteration updates the discriminator on a real and a generated batch,
then the generator: ``d_step(state_d, batch)``, then ``g_step(state_g, batch)``.

- Each step applies its own loss's gradients only. The generator's loss runs through the
  discriminator, but its backward reaches the generator's parameters only; the
  discriminator's step draws its fake batch without gradients. Under ``torchrun`` each
  model is wrapped in DDP by its own step, and each update reduces only the gradients of the
  model it trains.
- The noise is drawn once per iteration, in the loop, into the batch: both steps see the
  same noise, as ``main.py``'s one ``fake = netG(noise)`` serves both of its updates.
- The cost: ``main.py`` runs the generator forward once per iteration and reuses ``fake``
  for both updates (detached for the discriminator). A step's graph ends with its update, so
  here the discriminator's step runs the generator once more, without gradients. At these
  sizes (batch 64, one thread of a 2-core CPU) that forward takes 2.7 ms, 11 to 12% of an
  iteration, and the iteration x1.11 to x1.16 the time of ``main.py``'s
  (``python benchmarks/gan.py``, three runs).
- BatchNorm: the discriminator's step draws its samples inside
  ``af.untracked_batchnorm(netG)`` (batch statistics, running statistics left alone), so the
  generator's running statistics count each iteration's batch once, as ``main.py``'s single
  forward does.

``tests/test_example_gan.py`` shows the two steps bitwise equal to ``main.py``'s loop
(parameters and buffers of both models) when both loops draw the noise alike: from torch's
global generator, seeded the same, once per iteration (``main.py`` between its two
discriminator forwards, this loop before its steps), nothing else drawing. Each run writes into
``runs/gan/<date>-<time>`` (``--out``, ``--resume``, ``--overwrite``, ``--allow-resharding``
as in classify_digits.py) with a grid of generated digits, ``samples.png``. One checkpoint
holds both states by name (``{"discriminator": state_d, "generator": state_g}``), each with
its step's transform stack, and resumes both.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import run_options  # examples/run_options.py: --out, --resume, --overwrite, --allow-resharding
import torch
import torch.nn.functional as F
import torchvision
from tensordict import TensorDict, TensorDictBase
from torch import nn

import accelfn as af
from accelfn import data
from accelfn.data.datasets import digits

NZ, NGF, NDF, NC = 16, 32, 32, 1  # noise size, generator and discriminator widths, channels
REAL, FAKE = 1.0, 0.0  # main.py's real_label and fake_label


class Generator(nn.Module):
    """main.py's Generator for 16x16 images: noise -> 4x4 -> 8x8 -> 16x16."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(NGF * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NGF),
            nn.ReLU(True),
            nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, noise: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.main(noise)
        return out


class Discriminator(nn.Module):
    """main.py's Discriminator for 16x16 images: 16x16 -> 8x8 -> 4x4 -> one probability."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(NC, NDF, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(NDF * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(NDF * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.main(image)
        return out.view(-1, 1).squeeze(1)


def weights_init(m: nn.Module) -> None:
    """main.py's initialisation: N(0, 0.02) convolutions, N(1, 0.02) BatchNorm scales."""
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


def gan_losses(netG: nn.Module, netD: nn.Module) -> tuple[Callable[..., dict[str, torch.Tensor]],
                                                          Callable[..., dict[str, torch.Tensor]]]:
    """The two step functions: the discriminator's (closing over the generator) and the
    generator's (closing over the discriminator)."""
    criterion = nn.BCELoss()

    def discriminator_loss(model: nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        with torch.no_grad(), af.untracked_batchnorm(netG):  # running statistics left alone
            fake = netG(batch["noise"])
        out_real, out_fake = model(batch["image"]), model(fake)
        err_real = criterion(out_real, torch.full_like(out_real, REAL))
        err_fake = criterion(out_fake, torch.full_like(out_fake, FAKE))
        return {"loss": err_real + err_fake, "D_x": out_real.mean(), "D_G_z1": out_fake.mean()}

    def generator_loss(model: nn.Module, batch: TensorDictBase) -> dict[str, torch.Tensor]:
        out = netD(model(batch["noise"]))
        return {"loss": criterion(out, torch.full_like(out, REAL)), "D_G_z2": out.mean()}

    return discriminator_loss, generator_loss


def images16(dataset: TensorDict) -> TensorDict:
    """The 8x8 digits as 16x16 images in [-1, 1] (the generator's Tanh range)."""
    image = F.interpolate(dataset["image"].float() / 255, size=16, mode="bilinear")
    return TensorDict({"image": image * 2 - 1}, batch_size=dataset.batch_size)


def main(argv: list[str] | None = None) -> dict[str, float | str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=run_options.positive_int, default=300,
                        help="iterations (one discriminator and one generator update each)")
    parser.add_argument("--batch-size", type=run_options.positive_int, default=64)
    parser.add_argument("--lr", type=run_options.positive_float, default=2e-4)
    parser.add_argument("--log-every", type=run_options.positive_int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    run_options.add_arguments(parser)
    args = parser.parse_args(argv)

    device = af.init_distributed()
    main_process = af.is_main_process()
    train_set = images16(digits())
    run_options.check_batch(args.batch_size, len(train_set))
    run = run_options.open_run(args, "gan")
    out = str(run.path)
    train = data.loader(train_set, batch_size=args.batch_size, device=device, seed=args.seed)

    torch.manual_seed(args.seed)
    netG, netD = Generator().to(device), Discriminator().to(device)
    netG.apply(weights_init)
    netD.apply(weights_init)
    fixed_noise = torch.randn(64, NZ, 1, 1, device=device)
    rank = torch.distributed.get_rank() if af.world_size() > 1 else 0
    torch.manual_seed(args.seed + 1 + rank)  # each process draws noise of its own
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(0.5, 0.999))
    state_d, state_g = af.TrainState(netD, optimizerD), af.TrainState(netG, optimizerG)
    discriminator_loss, generator_loss = gan_losses(netG, netD)
    d_step, g_step = af.distributed(discriminator_loss), af.distributed(generator_loss)

    states = {"discriminator": state_d, "generator": state_g}  # one checkpoint holds both
    steps = {"discriminator": d_step, "generator": g_step}
    run_options.resume(args, states, loader=train, step=steps)
    if main_process:
        print(f"D: {af.describe(d_step)}\nG: {af.describe(g_step)}")
        print(f"data: {len(train_set)} digits as 16x16 images on {device}, "
              f"{af.world_size()} process(es)")
        if state_d.step >= args.steps:
            print(run_options.nothing_to_train(
                out, state_d.step, args.steps, args.steps,
                f"Pass --steps N with N > {state_d.step} (and --resume) to train longer"))

    trained = state_d.step < args.steps
    report: dict[str, float | str] = {}
    start = time.perf_counter()
    while state_d.step < args.steps:
        for batch in train:
            batch["noise"] = torch.randn(len(batch), NZ, 1, 1, device=device)
            d_metrics = d_step(state_d, batch)  # (1) maximize log(D(x)) + log(1 - D(G(z)))
            g_metrics = g_step(state_g, batch)  # (2) maximize log(D(G(z)))
            i = state_d.step
            if i % args.log_every == 0 or i == args.steps:  # one host read every few updates
                d, g = af.reduce_metrics(d_metrics), af.reduce_metrics(g_metrics)
                report = {"updates": i, "loss_D": round(float(d["loss"]), 4),
                          "loss_G": round(float(g["loss"]), 4), "D_x": round(float(d["D_x"]), 4),
                          "D_G_z1": round(float(d["D_G_z1"]), 4),
                          "D_G_z2": round(float(g["D_G_z2"]), 4)}
                if main_process:
                    print(f"[{i}/{args.steps}] Loss_D: {report['loss_D']:.4f} "
                          f"Loss_G: {report['loss_G']:.4f} D(x): {report['D_x']:.4f} "
                          f"D(G(z)): {report['D_G_z1']:.4f} / {report['D_G_z2']:.4f}")
            if state_d.step >= args.steps:
                break
    elapsed = time.perf_counter() - start

    report.update({"updates": state_d.step,  # of each model: one per iteration
                   "train_seconds": round(elapsed, 2), "processes": af.world_size(),
                   "device": str(device), "out": out})
    if trained:
        run.save(states, loader=train, step=steps)
    if main_process:
        # main.py draws samples in training mode too; the running statistics stay as trained
        with torch.no_grad(), af.untracked_batchnorm(netG):
            samples = netG(fixed_noise)
        grid = torchvision.utils.make_grid(samples, nrow=8, normalize=True, value_range=(-1, 1))
        report["samples"] = os.path.join(out, "samples.png")
        torchvision.io.write_png((grid * 255).round().to(torch.uint8).cpu(), report["samples"])
        print(json.dumps(report, indent=2))
    train.close()  # stop background threads before the process group goes
    if af.world_size() > 1:
        torch.distributed.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
