"""The bundled examples: they run, learn, resume, and run under torchrun with 2 processes."""

from __future__ import annotations

import copy
import csv
import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import Net, as_dict, classify, make_batch

import accelfn as af
from accelfn import checkpointing
from accelfn.testing import check_transform, plain_update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:  # the examples import their sibling run_options.py
    sys.path.insert(0, EXAMPLES)
SCRIPTS = sorted(f[:-3] for f in os.listdir(EXAMPLES)
                 if f.endswith(".py") and f != "run_options.py")


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
    with open(os.path.join(out, "log.csv")) as f:  # the resumed run continued the log
        rows = list(csv.DictReader(f))
    # counted from 1, as the monitor's metrics.jsonl counts its steps
    assert [int(r["update"]) for r in rows] == list(range(1, again["updates"] + 1))
    assert [r["epoch"] for r in rows][-1] == "2"


def assert_no_word_of_the_sync_check(printed: str, reports: int) -> None:
    """The examples run with the monitor's sync check off (sync_check=None): ``reports``
    monitor reports are printed, and nothing about host syncs."""
    assert printed.count("accelfn monitor report") == reports
    assert "host_syncs" not in printed and "probed for host syncs" not in printed


@pytest.mark.slow
def test_gpt_example_learns_and_resumes_exactly(tmp_path, capsys):
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
    assert_no_word_of_the_sync_check(capsys.readouterr().out, reports=3)


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


TINY_GPT = ["--text-bytes", "30000", "--batch-size", "8", "--seq-len", "32", "--dim", "32",
            "--depth", "2", "--quiet"]
TINY_IMAGES = ["--size", "16", "--batch-size", "8", "--quiet"]
TINY_MUON = ["--batch-size", "8", "--seq-len", "16"]
TINY_HF = ["--batch-size", "8", "--seq-len", "16", "--dim", "32", "--quiet"]
# name: (the 2-process run, the 1-process resume of it, the updates the resume ends at)
PLANNED = "planned"  # the updates the run planned: an epoch of 2 processes' batches
TORCHRUN_CASES = {
    # an epoch of 1 process is twice the updates of 2: the resume with --epochs 1 is refused
    # (planned_resume_is_refused_before_saying_it_resumed), then the one with --steps planned
    # is refused without --allow-resharding and resumes with it
    "classify_digits": (["--epochs", "1", "--stop-at", "2", "--quiet"],
                        ["--epochs", "1", "--quiet"], PLANNED),
    "custom_transform": (["--steps", "6"], ["--steps", "8"], 8),
    "hand_written_loop": (["--epochs", "1"], ["--epochs", "2"], None),
    "classify_images": (["--steps", "4", "--stop-at", "2", *TINY_IMAGES],
                        ["--steps", "4", *TINY_IMAGES], 4),
    "gpt": (["--steps", "4", "--stop-at", "2", "--fsdp", *TINY_GPT],
            ["--steps", "4", "--fsdp", *TINY_GPT], 4),
    "gan": (["--steps", "4"], ["--steps", "6"], 6),  # two states, each model in its own DDP
    "distill": (["--steps", "4", "--teacher-steps", "10"],
                ["--steps", "6", "--teacher-steps", "10"], 6),
    "muon_adamw": (["--steps", "6", "--stop-at", "3", *TINY_MUON], ["--steps", "6", *TINY_MUON],
                   6),
    # DDP of a transformers LlamaForCausalLM, the loss from model.model(...)'s states
    "finetune_hf": (["--steps", "4", "--stop-at", "2", *TINY_HF], ["--steps", "4", *TINY_HF], 4),
}
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(TORCHRUN_CASES))
def test_examples_run_under_torchrun_and_resume_in_one_process(name, tmp_path, capsys):
    from helpers import free_port

    run, resume, updates = TORCHRUN_CASES[name]
    out = tmp_path / name
    default_folder = name == "custom_transform"  # the processes agree on a new runs/noise/<t>
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           os.path.join(EXAMPLES, f"{name}.py"), *run,
           *([] if default_folder else ["--out", str(out)])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path if default_folder else ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "distributed(" in proc.stdout
    # DDP's bucket views take the parameters' strides (a channels_last ResNet's 1x1 weights)
    assert "Grad strides do not match bucket view strides" not in proc.stderr
    if default_folder:
        (out,) = (tmp_path / "runs" / "noise").iterdir()  # one folder for both processes
    saved = checkpointing.latest(out)
    assert saved is not None

    example = load_example(name)
    if updates == PLANNED:
        updates = planned_resume_is_refused_before_saying_it_resumed(example, out, capsys)
        resume = ["--steps", str(updates), "--quiet"]
    with pytest.raises(SystemExit) as refused:  # 2 processes wrote it, 1 resumes it
        example.main([*resume, "--resume", str(out)])
    assert refused.value.code == 2  # a usage error
    assert "written by 2 process(es) and this run has 1: pass --allow-resharding" in str(
        refused.value)
    capsys.readouterr()
    report = example.main([*resume, "--resume", str(out), "--allow-resharding"])
    assert f"resumed {saved}, written by 2 process(es), in 1" in capsys.readouterr().out
    done = int(saved.name.split("-")[1])
    if updates is None:  # epochs: the second one, all of it in one process
        assert report["updates"] > done
    else:
        assert report["updates"] == updates > done
    assert checkpointing.latest(out).name == f"step-{report['updates']:09d}"


def checkpoint_names(folder) -> list[str]:
    return [p.name for p in checkpointing.checkpoints(folder)]


def test_every_example_has_the_run_options(capsys):
    for name in SCRIPTS:
        with pytest.raises(SystemExit) as done:
            load_example(name).main(["--help"])
        assert done.value.code == 0
        printed = capsys.readouterr().out
        for flag in ("--out", "--resume", "--overwrite", "--allow-resharding"):
            assert flag in printed, (name, flag)


@pytest.mark.slow
def test_each_run_writes_a_folder_of_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    example = load_example("custom_transform")
    example.main(["--steps", "3"])
    example.main(["--steps", "3"])  # most likely within the same second as the first
    runs = sorted((tmp_path / "runs" / "noise").iterdir())
    assert len(runs) == 2
    for run in runs:  # no step-000000003.1: each run has its own
        assert checkpoint_names(run) == ["step-000000003"]

    with pytest.raises(SystemExit) as refused:  # another run's folder
        example.main(["--steps", "3", "--out", str(runs[0])])
    message = str(refused.value)
    assert refused.value.code == 2
    assert f"{runs[0]} holds the checkpoints of another run (step-000000003)" in message
    assert f"--resume {runs[0]}" in message and "--overwrite" in message
    assert checkpoint_names(runs[0]) == ["step-000000003"]  # untouched

    example.main(["--steps", "4", "--out", str(runs[0]), "--overwrite"])
    assert checkpoint_names(runs[0]) == ["step-000000004"]
    # runs/noise names the run whose checkpoint is newest; it continues in its own folder
    again = example.main(["--steps", "6", "--resume", "runs/noise"])
    assert again["updates"] == 6
    assert checkpoint_names(runs[0]) == ["step-000000004", "step-000000006"]
    assert checkpoint_names(runs[1]) == ["step-000000003"]
    assert sorted((tmp_path / "runs" / "noise").iterdir()) == runs

    with pytest.raises(SystemExit, match="no complete checkpoint"):
        example.main(["--resume", str(tmp_path / "nothing-here")])


@pytest.mark.slow
def test_resuming_a_finished_run_says_so_and_writes_nothing(tmp_path, capsys):
    noise = load_example("custom_transform")
    out = str(tmp_path / "noise")
    noise.main(["--steps", "3", "--out", out])
    capsys.readouterr()
    noise.main(["--steps", "3", "--resume", out])
    assert (f"{out}: the run already reached its last update (3 of 3); nothing to train. "
            "Pass --steps N with N > 3 (and --resume) to train longer"
            in capsys.readouterr().out.splitlines())
    assert checkpoint_names(out) == ["step-000000003"]  # no second copy of the same step
    assert noise.main(["--steps", "5", "--resume", out])["updates"] == 5  # as it said

    digits = load_example("classify_digits")  # a schedule spanning --steps
    out = str(tmp_path / "digits")
    digits.main(["--steps", "4", "--stop-at", "2", "--out", out, "--quiet"])
    capsys.readouterr()
    digits.main(["--steps", "4", "--stop-at", "2", "--resume", out, "--quiet"])
    assert (f"{out}: already at --stop-at 2 (2 of 4 updates); raise --stop-at or leave it out "
            "to continue" in capsys.readouterr().out.splitlines())
    assert digits.main(["--steps", "4", "--resume", out, "--quiet"])["updates"] == 4
    capsys.readouterr()
    report = digits.main(["--steps", "4", "--resume", out, "--quiet"])
    printed = capsys.readouterr().out
    assert (f"{out}: the run already reached its last update (4 of 4); nothing to train. Its "
            "learning-rate schedule ends there: to train longer, start a new run (without "
            "--resume) with more updates, e.g. --steps 8" in printed.splitlines())
    assert report["updates"] == 4 and 0.0 <= report["held_out_accuracy"] <= 1.0
    assert "plot" not in report and checkpoint_names(out) == ["step-000000002",
                                                               "step-000000004"]
    with pytest.raises(SystemExit, match=r"belongs to a run of 4 updates .* resume with "
                                         r"--steps 4, or start a new run"):
        digits.main(["--steps", "8", "--resume", out, "--quiet"])

    loop = load_example("hand_written_loop")
    out = str(tmp_path / "loop")
    loop.main(["--epochs", "1", "--out", out])
    capsys.readouterr()
    again = loop.main(["--epochs", "1", "--resume", out])
    assert (f"{out}: the run already trained its 1 epoch(s); nothing to train. Pass --epochs N "
            "with N > 1 (and --resume) to train longer" in capsys.readouterr().out.splitlines())
    assert again["held_out_accuracy"] > 0.5 and len(checkpoint_names(out)) == 1


@pytest.mark.slow
def test_image_example_ema_keeps_up_with_the_weights(tmp_path, capsys):
    images = load_example("classify_images")
    report = images.main(["--steps", "25", "--size", "12", "--quiet",
                          "--out", str(tmp_path / "run")])
    assert report["val_accuracy"] > 0.5  # it learned: chance is 0.1 (0.69 measured)
    # the average of a short run forgets its random start: a plain decay of 0.99 would keep
    # 0.99^25 = 78% of it (EMA accuracy 0.68 against 0.69 here, with the warm-up)
    assert report["val_accuracy_ema"] >= report["val_accuracy"] - 0.05
    lines = [line for line in capsys.readouterr().out.splitlines() if "with their EMA" in line]
    assert len(lines) == 1
    assert f"val accuracy {report['val_accuracy']:.3f} with the trained weights, " \
           f"{report['val_accuracy_ema']:.3f} with their EMA" in lines[0]


def test_every_example_states_how_long_it_takes_on_a_cpu():
    readme = open(os.path.join(ROOT, "README.md")).read()
    index = open(os.path.join(ROOT, "docs", "index.md")).read()
    timed = re.compile(r"\d+(\.\d+)? (min|s) on a (shared )?(\d-core )?CPU")
    for name in SCRIPTS:
        doc = load_example(name).__doc__
        assert timed.search(doc), f"{name}.py: its docstring gives no CPU time"
        for page, text in (("README.md", readme), ("docs/index.md", index)):
            lines = [ln for ln in text.splitlines() if f"{name}.py" in ln]
            assert lines, f"{page} does not list {name}.py"
            assert any(re.search(r"\(?\d+(\.\d+)? (min|s)\b", ln) for ln in lines), \
                f"{page}: no time for {name}.py"


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
    # the resumed run's bar continues from update 7 to 12, the last line once
    bar = [line for line in capsys.readouterr().err.splitlines() if line.startswith("digits ")]
    assert [line.split()[1] for line in bar] == ["8/12", "9/12", "10/12", "11/12", "12/12"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in rows if "iter_s" in r]
    assert [r["step"] for r in training] == list(range(1, 13))  # the resumed run continued it
    # each run logged the held-out digits at its last update, beside the training rows
    logged = [r for r in rows if "iter_s" not in r]
    assert [(r["step"], sorted(r)) for r in logged] == [
        (s, ["step", "val_accuracy", "val_loss"]) for s in (7, 12)]
    assert round(logged[-1]["val_accuracy"], 4) == report["held_out_accuracy"]


# name: (its arguments, the names it logs, the report's key for the last logged value's)
LOGGING_CASES = {
    "classify_images": ([*TINY_IMAGES], ["val_accuracy", "val_loss"], "val_accuracy"),
    "distill": (["--teacher-steps", "10", "--quiet"], ["val_accuracy", "val_loss"],
                "student_accuracy"),
    "muon_adamw": ([*TINY_MUON], ["val_bits_per_byte", "val_loss"], "val_bits_per_byte"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOGGING_CASES))
def test_examples_log_held_out_metrics_beside_the_training_rows(name, tmp_path, capsys):
    """Every --eval-every updates and at the end, in the run's metrics.jsonl, a resumed run's
    after the first run's; the last is the value the report gives. Nothing is printed about
    host syncs (the sync check is off)."""
    import json

    args, names, key = LOGGING_CASES[name]
    example = load_example(name)
    out = str(tmp_path / name)
    first = ["--steps", "3"] if name == "distill" else ["--steps", "6", "--stop-at", "3"]
    example.main([*args, *first, "--eval-every", "2", "--out", out])
    report = example.main([*args, "--steps", "6", "--eval-every", "2", "--resume", out])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows if "iter_s" in r] == list(range(1, 7))
    logged = [r for r in rows if "iter_s" not in r]
    # after updates 2 and 3 (the first run's end), 4 and 6: at the latest training row
    assert [(r["step"], sorted(r)) for r in logged] == [(s, ["step", *names]) for s in (2, 3, 4, 6)]
    assert round(logged[-1][names[0]], 4) == report[key]
    # classify_images prints its monitor's report, the others only their own lines
    assert_no_word_of_the_sync_check(capsys.readouterr().out,
                                     reports=2 if name == "classify_images" else 0)


BAD_ARGUMENTS = [  # (example, arguments, what its one-line error says)
    ("classify_digits", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("classify_digits", ["--epochs", "-1"], "argument --epochs: must be >= 1, got -1"),
    ("classify_digits", ["--stop-at", "0"], "argument --stop-at: must be >= 1, got 0"),
    ("classify_digits", ["--lr", "-1"], "argument --lr: must be > 0, got -1"),
    ("classify_digits", ["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    ("classify_digits", ["--accumulation", "0"], "argument --accumulation: must be >= 1"),
    ("classify_digits", ["--batch-size", "1", "--accumulation", "2"],
     "--accumulation 2 cannot split a batch of 1 samples into 2 micro-batches"),
    ("classify_digits", ["--batch-size", "5000"],
     "--batch-size 5000 is larger than the 1437 training samples of each of the 1 process(es)"),
    ("classify_digits", ["--resume", "no/such/run"], "--resume no/such/run: no complete"),
    ("classify_images", ["--model", "nope"], "argument --model: invalid choice: 'nope'"),
    ("classify_images", ["--ema-decay", "1"], "argument --ema-decay: must be in [0, 1)"),
    ("classify_images", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("classify_images", ["--folder", "no/such/folder"], "--folder no/such/folder: no such folder"),
    ("classify_images", ["--preloaded", "no/such/cache"], "--preloaded no/such/cache: no such"),
    ("gpt", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("gpt", ["--dim", "30"], "--dim 30 must be a multiple of the 4 attention heads"),
    ("gpt", ["--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
    ("custom_transform", ["--std", "0"], "argument --std: must be > 0, got 0"),
    ("custom_transform", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("hand_written_loop", ["--epochs", "0"], "argument --epochs: must be >= 1, got 0"),
    ("hand_written_loop", ["--log-every", "0"], "argument --log-every: must be >= 1, got 0"),
    ("gan", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("gan", ["--batch-size", "5000"],
     "--batch-size 5000 is larger than the 1797 training samples of each of the 1 process(es)"),
    ("distill", ["--alpha", "2"], "argument --alpha: must be in [0, 1], got 2"),
    ("distill", ["--temperature", "0"], "argument --temperature: must be > 0, got 0"),
    ("muon_adamw", ["--accumulation", "9", "--batch-size", "8"],
     "--accumulation 9 cannot split a batch of 8 samples into 9 micro-batches"),
    ("finetune_hf", ["--tp", "2"], "--tp shards the decoder layers inside FSDP2's mesh: pass "
                                   "--fsdp too"),
    ("finetune_hf", ["--from", "no/such/folder"], "--from no/such/folder: no config.json"),
    ("finetune_hf", ["--text", "no_such_module"], "--text no_such_module: not a module of "
                                                  "Python source"),
]
NO_QUIET = ("custom_transform", "hand_written_loop", "gan", "muon_adamw")


@pytest.mark.parametrize(("name", "args", "message"), BAD_ARGUMENTS,
                         ids=[f"{n}{' '.join(a)}" for n, a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_usage_errors_that_say_what_to_pass(name, args, message, tmp_path,
                                                              monkeypatch, capsys):
    """Exit status 2 and one line naming the option, before any training (no traceback)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as refused:
        load_example(name).main([*args, "--out", str(tmp_path / "run"), "--quiet"]
                                if name not in NO_QUIET
                                else [*args, "--out", str(tmp_path / "run")])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_one_update_and_one_block_run(tmp_path, capsys):
    """--steps 1 left the schedules no room (a zero-length cosine, a warm-up as long as the
    run) and gpt's --depth 1 gave checkpointing no repeated block to find."""
    gpt = load_example("gpt").main(["--steps", "1", *TINY_GPT, "--depth", "1",
                                    "--out", str(tmp_path / "gpt")])
    assert gpt["updates"] == 1 and math.isfinite(float(gpt["val_loss"]))
    images = load_example("classify_images").main(["--steps", "1", *TINY_IMAGES,
                                                   "--out", str(tmp_path / "images")])
    assert images["updates"] == 1


def planned_resume_is_refused_before_saying_it_resumed(example, out, capsys) -> int:
    """A run of 2 processes resumed in 1 (``out``, written by classify_digits --epochs 1):
    an epoch of 1 process is twice the updates of 2, the schedule's plan differs, and the
    resume is refused before anything is loaded or printed. The planned updates, with which
    the caller resumes (test_examples_run_under_torchrun_and_resume_in_one_process, whose
    torchrun launch this shares)."""
    planned = torch.load(checkpointing.latest(out) / "state.pt",
                         weights_only=True)["extra"]["total_steps"]
    with pytest.raises(SystemExit) as refused:
        example.main(["--epochs", "1", "--resume", str(out), "--allow-resharding", "--quiet"])
    printed = capsys.readouterr()
    assert refused.value.code == 2
    assert f"belongs to a run of {planned} updates" in str(refused.value)
    assert f"resume with --steps {planned}" in str(refused.value)
    assert "resumed" not in printed.out + printed.err
    return int(planned)


@pytest.mark.slow
def test_a_resumed_run_plots_its_whole_history(tmp_path, monkeypatch, capsys):
    from accelfn.observe.monitor import plots

    drawn: list[list[int]] = []
    plot = plots.plot_report

    def spy(report, path, **kwargs):
        drawn.append([r["step"] for r in report.rows])
        return plot(report, path, **kwargs)

    monkeypatch.setattr(plots, "plot_report", spy)
    example = load_example("classify_digits")
    out = tmp_path / "digits"
    example.main(["--steps", "8", "--stop-at", "5", "--out", str(out), "--quiet"])
    drawn.clear()
    report = example.main(["--steps", "8", "--out", str(out), "--resume", str(out), "--quiet"])
    assert drawn[-1] == list(range(1, 9))  # the steps before the resume too
    assert report["plot"] == str(out / "run.png")
    assert (out / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
