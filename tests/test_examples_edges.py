"""The examples' edges: refusals that write nothing, resumes of checkpoints that are not the
example's own, and throughput that counts only what was trained on."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from test_examples import load_example

from accelfn import checkpointing

TINY_GPT = ["--text-bytes", "3000", "--seq-len", "32", "--dim", "32", "--depth", "1", "--quiet"]


def refused(name: str, args: list[str], capsys) -> str:
    """The one-line error of ``name``'s main(args): exit status 2, no traceback."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        load_example(name).main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], err  # <script>: error: ...
    return lines[0]


def write_images(folder, per_class: int = 3) -> None:
    from torchvision.io import encode_jpeg, write_file

    g = torch.Generator().manual_seed(0)
    for label in ("cat", "dog"):
        os.makedirs(folder / label)
        for i in range(per_class):
            image = torch.randint(0, 256, (3, 20, 24), dtype=torch.uint8, generator=g)
            write_file(str(folder / label / f"{i}.jpg"), encode_jpeg(image))


REFUSED_BATCHES = [  # (example, arguments, what the error says)
    ("classify_digits", ["--batch-size", "5000", "--quiet"], "--batch-size 5000 is larger"),
    ("classify_digits", ["--batch-size", "1", "--accumulation", "2", "--quiet"],
     "--accumulation 2 cannot split"),
    ("classify_images", ["--batch-size", "5000", "--quiet"], "--batch-size 5000 is larger"),
    ("classify_images", ["--batch-size", "50", "--quiet", "--folder", "{folder}"],
     "--batch-size 50 is larger than the 4 training samples"),
    ("gpt", ["--batch-size", "5000", *TINY_GPT], "--batch-size 5000 is larger"),
]


@pytest.mark.parametrize(("name", "args", "message"), REFUSED_BATCHES,
                         ids=[f"{n}{' '.join(a[:4])}" for n, a, _ in REFUSED_BATCHES])
def test_a_refused_batch_size_writes_no_run_folder(name, args, message, tmp_path, monkeypatch,
                                                   capsys):
    """The default run folder (runs/<name>/<date>-<time>) used to be made before the check,
    and stayed behind empty (with a half-made preload cache under --folder)."""
    folder = tmp_path / "folder"
    write_images(folder)  # 6 images: 4 train, 2 val
    monkeypatch.chdir(tmp_path)
    line = refused(name, [a.replace("{folder}", str(folder)) for a in args], capsys)
    assert message in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("layout", ["no class folders", "class folders without images"])
def test_an_image_folder_without_images_is_a_usage_error(layout, tmp_path, monkeypatch,
                                                         capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    if layout == "class folders without images":
        (folder / "cat").mkdir()
        (folder / "cat" / "notes.txt").write_text("not an image")
    monkeypatch.chdir(tmp_path)
    line = refused("classify_images", ["--folder", str(folder), "--quiet"], capsys)
    assert f"--folder {folder}: no images" in line and "<class>/<image>" in line
    assert not (tmp_path / "runs").exists()


def test_an_out_that_is_a_file_is_refused_before_training(tmp_path, capsys):
    """--out naming a file trained the whole run, then failed to save it (FileExistsError)."""
    (tmp_path / "taken").write_text("")
    line = refused("custom_transform", ["--steps", "3", "--out", str(tmp_path / "taken")],
                   capsys)
    assert f"--out {tmp_path / 'taken'}: is a file" in line


@pytest.mark.slow
def test_hand_written_loop_refuses_another_examples_checkpoint(tmp_path, capsys):
    noise = str(tmp_path / "noise")
    load_example("custom_transform").main(["--steps", "2", "--out", noise])
    line = refused("hand_written_loop", ["--epochs", "2", "--resume", noise], capsys)
    assert f"--resume {noise}" in line and "different model" in line
    assert "start a new run (without --resume)" in line
    assert checkpoint_names(noise) == ["step-000000002"]  # nothing written there


@pytest.mark.slow
def test_hand_written_loop_refuses_a_checkpoint_that_records_no_epoch(tmp_path, capsys,
                                                                      monkeypatch):
    """A checkpoint of the same model and step but saved by another loop (its ``extra``
    without "epoch") raised a bare KeyError after loading."""
    loop = load_example("hand_written_loop")
    out = str(tmp_path / "loop")
    save = checkpointing.save

    def save_as_another_loop(*args, extra=None, **kwargs):
        return save(*args, extra={"total_steps": 22}, **kwargs)

    monkeypatch.setattr(checkpointing, "save", save_as_another_loop)
    loop.main(["--epochs", "1", "--out", out])
    monkeypatch.setattr(checkpointing, "save", save)
    line = refused("hand_written_loop", ["--epochs", "2", "--resume", out], capsys)
    assert f"{out}{os.sep}step-" in line and "records no epoch" in line
    assert "hand_written_loop.py" in line and "without --resume" in line


def test_a_checkpoint_of_another_step_is_a_usage_error(tmp_path, capsys):
    """Resuming with options that change the step (here --std) was a CheckpointError
    traceback; every example resumes through run_options.resume."""
    out = str(tmp_path / "noise")
    example = load_example("custom_transform")
    example.main(["--steps", "2", "--out", out])
    line = refused("custom_transform", ["--steps", "4", "--std", "0.5", "--resume", out],
                   capsys)
    assert f"--resume {out}{os.sep}step-000000002 does not fit this run" in line
    assert "with_gradient_noise(0.5)" in line
    assert checkpoint_names(out) == ["step-000000002"]


def checkpoint_names(folder) -> list[str]:
    return [p.name for p in checkpointing.checkpoints(folder)]


@pytest.mark.slow
@pytest.mark.parametrize("packing", ["pad", "best-fit"])
def test_gpt_tokens_per_s_counts_only_real_tokens(tmp_path, capsys, packing):
    """Padded rows (--packing pad) hold padding at document ends, packed rows only at the end
    of the data; tokens/s counted batch x seq_len positions would include padding: the
    example and the monitor count the real targets (the step's "weight"). With the whole
    training set in every batch, each update trains on every real target of it."""
    gpt = load_example("gpt")
    documents, _ = gpt.split(gpt.stdlib_text(3000))
    if packing == "pad":
        train = gpt.pad_rows(documents, 32)
        rows, real = len(train), int((train["targets"] != -100).sum())
    else:  # every byte of a document is a target (the last one's is EOT), in full rows
        real = sum(map(len, documents))
        rows = -(-real // 32)
    positions = rows * 32
    assert real < positions  # the data have padding to leave out
    report = gpt.main([*TINY_GPT, "--batch-size", str(rows), "--accumulation", "2",
                       "--steps", "3", "--packing", packing, "--out", str(tmp_path / "gpt")])
    assert report["real_tokens"] == 3 * real
    assert report["padding_share"] == pytest.approx(1 - real / positions, abs=1e-4)
    assert "tokens_per_s" not in report  # the old name counted padding
    seconds = report["train_seconds"]  # rounded to 0.01 s: the rate lies within its bounds
    assert 3 * real / (seconds + 0.005) - 0.1 <= report["real_tokens_per_s"] <= (
        3 * real / (seconds - 0.005) + 0.1)
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.rindex("\n{"):])["real_tokens"] == 3 * real
    assert "padding excluded" in printed and "padding share" in printed
    # the monitor's tokens/s, from each update's "weight" metric: the real targets
    monitor_rate = re.search(r"[\d.]+ [kMGT]?tokens/s", printed.split("verdict:")[0])
    assert monitor_rate is not None


def make_dry_run(*targets: str) -> str:
    """What ``make -B -n <targets>`` would run (every rule, as on a fresh checkout)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(["make", "-B", "-n", "-C", root, *targets], capture_output=True,
                          text=True, check=True)
    return proc.stdout


def test_make_run_installs_what_the_example_needs_not_the_test_extra():
    run = make_dry_run("run")
    installs = [line for line in run.splitlines() if "pip install" in line]
    assert installs and all("'.[plot]'" in line for line in installs), run
    assert "test" not in "".join(installs)  # no lightning, accelerate, wandb, mlflow, mypy
    assert "examples/classify_digits.py" in run
    assert "'.[test]'" in make_dry_run("test")


def test_the_digits_example_runs_torch_within_the_free_cores(monkeypatch):
    """Without OMP_NUM_THREADS, as many threads as the free cores allow, the count that its
    monitor's verdict does not call oversubscribed; with it, what it says."""
    from accelfn.observe import threads

    example = load_example("classify_digits")
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "usable_cores", lambda: 2)
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        for load, expected in ((0.1, 2), (1.2, 1), (6.0, 1)):
            monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
            assert example.torch_threads() == expected == torch.get_num_threads()
            cpu = threads.cpu_load()  # the verdict's check, once the loop runs them
            verdict = threads.oversubscription(cpu, own_load=cpu.threads)
            assert verdict.severity == "ok" or "within the free cores already" in verdict.fix
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        assert example.torch_threads() == 1  # the user's (or torchrun's) choice stands
    finally:
        torch.set_num_threads(before)
