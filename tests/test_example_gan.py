"""examples/gan.py: two TrainStates and two steps equal pytorch/examples' dcgan loop bitwise.

The reference is ``dcgan/main.py``'s loop as written there (``netD.zero_grad()``, two
backwards for the real and the fake batch, ``fake = netG(noise)`` once and reused, the
generator's update through ``netD(fake)``), plain torch. Both loops draw the noise from
torch's global generator, seeded alike, in the same order (one draw per iteration, nothing
else drawing): ``main.py`` draws it between its two discriminator forwards, the accelfn loop
before its discriminator step, which gives the same numbers.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
from example_modules import ROOT, load_example
from tensordict import TensorDict
from torch import nn

import accelfn as af
from accelfn import checkpointing

gan = load_example("gan")
BATCH, ITERATIONS = 16, 4


def models():
    torch.manual_seed(0)
    netG, netD = gan.Generator(), gan.Discriminator()
    netG.apply(gan.weights_init)
    netD.apply(gan.weights_init)
    return netG, netD


def real_batches():
    images = gan.images16(gan.digits())["image"]
    return [images[i * BATCH:(i + 1) * BATCH] for i in range(ITERATIONS)]


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=2e-4, betas=(0.5, 0.999))


def dcgan_main_loop(netG, netD, reals):
    """dcgan/main.py's loop body (its logging and image saving left out)."""
    criterion = nn.BCELoss()
    optimizerD, optimizerG = adam(netD), adam(netG)
    real_label, fake_label = 1, 0
    torch.manual_seed(1)
    history = []
    for real_cpu in reals:
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean()
        noise = torch.randn(batch_size, gan.NZ, 1, 1)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean()
        errD = errD_real + errD_fake
        optimizerD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean()
        optimizerG.step()
        history.append([t.detach().clone() for t in (errD, errG, D_x, D_G_z1, D_G_z2)])
    return history


def accelfn_loop(netG, netD, reals, *, untracked=True):
    state_d, state_g = af.TrainState(netD, adam(netD)), af.TrainState(netG, adam(netG))
    discriminator_loss, generator_loss = gan.gan_losses(netG, netD)
    if not untracked:  # the example's step without untracked_batchnorm(): the forward tracks
        def discriminator_loss(model, batch):
            with torch.no_grad():
                fake = netG(batch["noise"])
            out_real, out_fake = model(batch["image"]), model(fake)
            loss = (nn.functional.binary_cross_entropy(out_real, torch.ones_like(out_real))
                    + nn.functional.binary_cross_entropy(out_fake, torch.zeros_like(out_fake)))
            return {"loss": loss, "D_x": out_real.mean(), "D_G_z1": out_fake.mean()}
    d_step, g_step = af.distributed(discriminator_loss), af.distributed(generator_loss)
    torch.manual_seed(1)
    history = []
    for real in reals:
        batch = TensorDict({"image": real}, batch_size=[len(real)])
        batch["noise"] = torch.randn(len(batch), gan.NZ, 1, 1)  # as the example's loop
        d = d_step(state_d, batch)
        g = g_step(state_g, batch)
        history.append([d["loss"], g["loss"], d["D_x"], d["D_G_z1"], g["D_G_z2"]])
    return history


def assert_models_equal(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), f"{what}.{name}"


def assert_nested_equal(x, y, where: str) -> None:
    if isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            assert_nested_equal(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, torch.Tensor):
        assert torch.equal(x, y), where
    else:
        assert x == y, where


def test_two_steps_equal_dcgan_main_loop_bitwise():
    netG, netD = models()
    plainG, plainD = copy.deepcopy(netG), copy.deepcopy(netD)
    reals = real_batches()
    expected = dcgan_main_loop(plainG, plainD, reals)
    got = accelfn_loop(netG, netD, reals)
    assert_models_equal(plainG, netG, "netG")  # parameters and BatchNorm statistics
    assert_models_equal(plainD, netD, "netD")
    for i, (e, g) in enumerate(zip(expected, got)):  # Loss_D, Loss_G, D(x), D(G(z)) x 2
        assert [torch.equal(x, y) for x, y in zip(e, g)] == [True] * 5, i
    moved = [not torch.equal(p, q) for p, q in zip(netG.parameters(), models()[0].parameters())]
    assert all(moved)  # the comparison is of trained models


def test_the_extra_generator_forward_is_untracked_or_it_counts_each_batch_twice():
    """Without ``af.untracked_batchnorm``, the discriminator step's generator forward
    updates the generator's BatchNorm statistics a second time per iteration: parameters
    still equal, running statistics not (which is what ``untracked_batchnorm`` is for)."""
    netG, netD = models()
    plainG, plainD = copy.deepcopy(netG), copy.deepcopy(netD)
    reals = real_batches()
    dcgan_main_loop(plainG, plainD, reals)
    accelfn_loop(netG, netD, reals, untracked=False)
    for p, q in zip(plainG.parameters(), netG.parameters()):
        assert torch.equal(p, q)
    assert_models_equal(plainD, netD, "netD")
    assert int(netG.main[1].num_batches_tracked) == 2 * int(plainG.main[1].num_batches_tracked)
    assert not torch.equal(netG.main[1].running_var, plainG.main[1].running_var)


def test_each_step_applies_and_leaves_only_its_own_gradients():
    netG, netD = models()
    state_d, state_g = af.TrainState(netD, adam(netD)), af.TrainState(netG, adam(netG))
    discriminator_loss, generator_loss = gan.gan_losses(netG, netD)
    d_step, g_step = af.lift(discriminator_loss), af.lift(generator_loss)
    real = real_batches()[0]
    batch = TensorDict({"image": real, "noise": torch.randn(BATCH, gan.NZ, 1, 1)},
                       batch_size=[BATCH])
    before = copy.deepcopy(netD.state_dict())
    g_step(state_g, batch)  # its loss runs through netD: no gradient there, no change
    assert all(p.grad is None for p in netD.parameters())
    for name, p in netD.named_parameters():
        assert torch.equal(p, before[name]), name
    before = copy.deepcopy(netG.state_dict())
    d_step(state_d, batch)
    assert all(p.grad is None for p in netG.parameters())
    for name, p in netG.named_parameters():
        assert torch.equal(p, before[name]), name


@pytest.mark.slow
def test_gan_example_trains_and_resumes_exactly(tmp_path, capsys):
    straight = str(tmp_path / "straight")
    report = gan.main(["--steps", "6", "--log-every", "3", "--out", straight])
    assert report["updates"] == 6 and 0.0 < report["D_x"] < 1.0
    printed = capsys.readouterr().out
    assert "[3/6] Loss_D: " in printed and "[6/6] Loss_D: " in printed
    assert open(report["samples"], "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"
    split = str(tmp_path / "split")
    gan.main(["--steps", "3", "--out", split])
    resumed = gan.main(["--steps", "6", "--resume", split])
    assert resumed["updates"] == 6
    a = torch.load(checkpointing.latest(straight) / "state.pt", weights_only=True)
    b = torch.load(checkpointing.latest(split) / "state.pt", weights_only=True)
    assert sorted(a["states"]) == ["discriminator", "generator"]  # one checkpoint, both states
    for name in a["states"]:  # parameters and BatchNorm statistics; Adam's moments
        for part in ("model", "optimizer"):
            x, y = a["states"][name][part], b["states"][name][part]
            assert_nested_equal(x, y, f"{name}.{part}")
        assert a["states"][name]["step"] == b["states"][name]["step"] == 6


@pytest.mark.slow
def test_the_extra_forward_benchmark_runs_and_reports_its_ratios():
    spec = importlib.util.spec_from_file_location(
        "gan_benchmark", os.path.join(ROOT, "benchmarks", "gan.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        report = bench.main(["--rounds", "1", "--iterations", "2", "--batch-size", "8"])
    finally:
        torch.set_num_threads(threads)
    assert 0 < report["generator_forward_ms"] < report["accelfn_iteration_ms"]
    assert report["accelfn_over_plain"] > 0
