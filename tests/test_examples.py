"""The bundled examples: they run, learn, resume, and run under torchrun with 2 processes."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from conftest import Net, as_dict, classify, make_batch

import accelfn as af
from accelfn import checkpointing
from accelfn.testing import check_transform, plain_update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def final_model(out: str) -> dict:
    """The model weights of the newest checkpoint in a run folder."""
    path = checkpointing.latest(out)
    return torch.load(path / "state.pt", weights_only=True)["state"]["model"]


def test_custom_transform_equals_noise_written_by_hand():
    example = load_example("custom_transform")
    torch.manual_seed(0)
    base = Net()
    m1, m2 = copy.deepcopy(base), copy.deepcopy(base)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    state = af.TrainState(m1, o1)
    step = example.with_gradient_noise(std=0.05, seed=3)(af.with_clipping(max_norm=0.5)(
        classify))
    gen = torch.Generator().manual_seed(3)
    for i in range(3):
        batch = make_batch(seed=i)
        step(state, batch)
        classify(m2, as_dict(batch))["loss"].backward()
        for p in m2.parameters():  # user gradient transforms run before clipping
            p.grad.add_(torch.randn(p.grad.shape, generator=gen), alpha=0.05)
        torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.5)
        o2.step()
        o2.zero_grad(set_to_none=True)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="std"):
        example.with_gradient_noise(std=0)


def test_custom_transform_passes_the_contract_kit():
    example = load_example("custom_transform")

    def by_hand(model, optimizer, batch):
        gen = by_hand.generator

        def noise(m):
            for p in m.parameters():
                p.grad.add_(torch.randn(p.grad.shape, generator=gen), alpha=0.05)

        plain_update(model, optimizer, batch, classify, edit_grads=noise)

    def reference(model, optimizer, batch):
        if not any(optimizer.state.values()):  # a fresh run: a fresh generator
            by_hand.generator = torch.Generator().manual_seed(3)
        by_hand(model, optimizer, batch)

    report = check_transform(example.with_gradient_noise(std=0.05, seed=3),
                             reference=reference, loss_fn=classify,
                             make_model=lambda: (torch.manual_seed(0), Net())[1],
                             make_batch=lambda i: make_batch(seed=i))
    assert report.passed[0] == "reference" and report.orders == 24


def test_custom_transform_resumes_with_the_same_noise(tmp_path):
    example = load_example("custom_transform")
    step = example.with_gradient_noise(std=0.05)(classify)
    batches = [make_batch(seed=i) for i in range(4)]

    def fresh():
        torch.manual_seed(0)
        model = Net()
        return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))

    straight = fresh()
    for b in batches:
        step(straight, b)
    first = fresh()
    for b in batches[:2]:
        step(first, b)
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    resumed = fresh()
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    for b in batches[2:]:
        step(resumed, b)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_digits_example_learns_and_resumes_exactly(tmp_path):
    example = load_example("classify_digits")
    straight = str(tmp_path / "straight")
    report = example.main(["--steps", "40", "--out", straight, "--quiet"])
    assert report["updates"] == 40
    assert report["held_out_accuracy"] > 0.8  # chance is 0.1
    split = str(tmp_path / "split")
    example.main(["--steps", "40", "--stop-at", "15", "--out", split, "--quiet"])
    resumed = example.main(["--steps", "40", "--out", split, "--quiet",
                            "--resume", split])
    assert resumed["updates"] == 40
    a, b = final_model(straight), final_model(split)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_hand_written_loop_example(tmp_path):
    example = load_example("hand_written_loop")
    out = str(tmp_path / "loop")
    report = example.main(["--epochs", "2", "--out", out])
    assert report["held_out_accuracy"] > 0.8
    assert os.path.exists(os.path.join(out, "log.csv"))
    again = example.main(["--epochs", "3", "--out", out, "--resume",
                          out])
    assert again["updates"] == report["updates"] * 3 // 2


@pytest.mark.slow
def test_gpt_example_learns_and_resumes_exactly(tmp_path):
    example = load_example("gpt")
    small = ["--text-bytes", "60000", "--batch-size", "8", "--seq-len", "32", "--dim", "32",
             "--depth", "2", "--accumulation", "2", "--quiet"]
    straight = str(tmp_path / "straight")
    report = example.main([*small, "--steps", "12", "--out", straight])
    assert report["val_bits_per_byte"] < 8.0  # uniform over 256 bytes is 8 bits
    split = str(tmp_path / "split")
    example.main([*small, "--steps", "12", "--stop-at", "5", "--out", split])
    example.main([*small, "--steps", "12", "--out", split, "--resume",
                  split])
    a, b = final_model(straight), final_model(split)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_image_example_from_an_image_folder_and_resume(tmp_path):
    from torchvision.io import encode_jpeg, write_file

    g = torch.Generator().manual_seed(0)
    for label in ("cat", "dog"):
        os.makedirs(tmp_path / "folder" / label)
        for i in range(12):
            image = torch.randint(0, 256, (3, 20, 24), dtype=torch.uint8, generator=g)
            write_file(str(tmp_path / "folder" / label / f"{i}.jpg"), encode_jpeg(image))
    example = load_example("classify_images")
    small = ["--size", "16", "--batch-size", "8", "--accumulation", "2", "--quiet",
             "--steps", "4", "--out", str(tmp_path / "run")]
    report = example.main([*small, "--folder", str(tmp_path / "folder"), "--stop-at", "2"])
    assert report["updates"] == 2
    cache = str(tmp_path / "run" / "cache")
    again = example.main([*small, "--preloaded", cache, "--resume",
                          str(tmp_path / "run")])
    assert again["updates"] == 4 and 0.0 <= again["val_accuracy"] <= 1.0


TORCHRUN_CASES = {
    "classify_digits": ["--steps", "6", "--quiet"],
    "custom_transform": ["--steps", "6"],
    "hand_written_loop": ["--epochs", "1"],
    "classify_images": ["--steps", "2", "--size", "16", "--batch-size", "8", "--quiet"],
    "gpt": ["--steps", "3", "--fsdp", "--text-bytes", "30000", "--batch-size", "8",
            "--seq-len", "32", "--dim", "32", "--depth", "2", "--quiet"],
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(TORCHRUN_CASES))
def test_examples_run_under_torchrun(name, tmp_path):
    from conftest import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           os.path.join(ROOT, "examples", f"{name}.py"), *TORCHRUN_CASES[name],
           "--out", str(tmp_path / name)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "distributed(" in proc.stdout


@pytest.mark.slow
def test_digits_example_writes_a_plot_prints_its_path_and_continues_its_log(tmp_path, capsys):
    import json

    example = load_example("classify_digits")
    out = tmp_path / "digits"
    example.main(["--steps", "12", "--stop-at", "7", "--out", str(out)])
    first = capsys.readouterr()
    assert f"plot: {out / 'run.png'}" in first.out.splitlines()
    assert (out / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the progress bar on a captured (non-terminal) stderr: plain lines, the last one once
    assert "\r" not in first.err
    bar = [line for line in first.err.splitlines() if line.startswith("digits ")]
    assert bar and bar[-1].startswith("digits 7/7 [") and sum("7/7" in b for b in bar) == 1
    report = example.main(["--steps", "12", "--out", str(out), "--resume", str(out)])
    assert report["plot"] == str(out / "run.png")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))  # the resumed run continued it


@pytest.mark.slow
def test_examples_with_the_sync_check_off_print_nothing_about_it(tmp_path, capsys):
    gpt = load_example("gpt")
    gpt.main(["--text-bytes", "30000", "--batch-size", "8", "--seq-len", "32", "--dim", "32",
              "--depth", "2", "--steps", "2", "--quiet", "--out", str(tmp_path / "gpt")])
    images = load_example("classify_images")
    images.main(["--steps", "2", "--size", "16", "--batch-size", "8", "--quiet",
                 "--out", str(tmp_path / "images")])
    printed = capsys.readouterr().out
    assert printed.count("accelfn monitor report") == 2
    assert "host_syncs" not in printed and "probed for host syncs" not in printed
