"""RunFolder: a folder per run, no two runs mixed in one, resume of the newest run, checks made
before anything is loaded (plan, number of processes), and the same folder or the same
refusal on every process (2 gloo processes)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import Net, classify, make_batch, torchrun_results

import accelfn as af
from accelfn import checkpointing
from accelfn.checkpointing.runs import PlanMismatchError, RunFolder, RunFolderError

WORKER = Path(__file__).with_name("run_folder_worker.py")


def setup(seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    state = af.TrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          scheduler=None)
    return model, state, af.with_clipping(max_norm=1.0)(classify)


def train(state, step, updates: int) -> None:
    batches = make_batch(8 * 8, seed=3)
    for _ in range(updates):
        i = state.step % 8
        step(state, batches[8 * i: 8 * (i + 1)])


def names(folder) -> list[str]:
    return [p.name for p in checkpointing.checkpoints(folder)]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    RunFolder.add_arguments(parser)
    return parser.parse_args(argv)


def test_each_run_gets_a_new_folder_and_another_runs_folder_is_refused(tmp_path):
    first = RunFolder("tiny", root=tmp_path)
    second = RunFolder("tiny", root=tmp_path)  # within the same second: a -1 suffix
    assert first.path != second.path and first.path.parent == second.path.parent == \
        tmp_path / "tiny"
    assert first.checkpoint is None and first.path.is_dir()
    _, state, step = setup()
    train(state, step, 2)
    first.save(state, step=step)
    assert names(first.path) == ["step-000000002"]

    with pytest.raises(RunFolderError) as refused:  # flags from the command line
        RunFolder.from_args(parse("--out", str(first.path)), "tiny", root=tmp_path)
    message = str(refused.value)
    assert f"{first.path} holds the checkpoints of another run (step-000000002)" in message
    assert f"--resume {first.path}" in message and "--overwrite" in message
    with pytest.raises(RunFolderError, match=r"pass resume='.*' to continue it, "
                                             r"overwrite=True"):  # keywords in Python
        RunFolder("tiny", out=first.path, root=tmp_path)
    assert names(first.path) == ["step-000000002"]  # untouched

    again = RunFolder("tiny", out=first.path, overwrite=True, root=tmp_path)
    assert again.path == first.path and names(first.path) == []

    (tmp_path / "file").write_text("")
    with pytest.raises(RunFolderError, match="is a file, not a folder"):
        RunFolder("tiny", out=tmp_path / "file", root=tmp_path)
    with pytest.raises(RunFolderError, match=r"--resume .*nothing: no complete checkpoint"):
        RunFolder.from_args(parse("--resume", str(tmp_path / "nothing")), "tiny")
    with pytest.raises(ValueError, match="keep=0"):
        RunFolder("tiny", root=tmp_path, keep=0)


def test_resume_takes_a_checkpoint_a_run_folder_or_the_newest_run(tmp_path):
    old, new = RunFolder("tiny", root=tmp_path), RunFolder("tiny", root=tmp_path)
    for run, updates in ((old, 3), (new, 1)):
        _, state, step = setup()
        train(state, step, updates)
        run.save(state, step=step)
    os.utime(checkpointing.latest(old.path), (1, 1))  # `new` saved last
    by_name = RunFolder("tiny", resume=tmp_path / "tiny", root=tmp_path)
    assert (by_name.path, by_name.checkpoint) == (new.path, checkpointing.latest(new.path))
    by_folder = RunFolder("tiny", resume=old.path, root=tmp_path)
    assert (by_folder.path, by_folder.checkpoint) == (old.path, old.path / "step-000000003")
    by_checkpoint = RunFolder("tiny", resume=old.path / "step-000000003", root=tmp_path)
    assert by_checkpoint.path == old.path
    assert len(list((tmp_path / "tiny").iterdir())) == 2  # a resume makes no new folder
    # a checkpoint copied or renamed (best/, abandoned-step-…) is a checkpoint too, as load()
    # takes it; its folder is the run's
    shutil.copytree(old.path / "step-000000003", old.path / "best")
    by_copy = RunFolder("tiny", resume=old.path / "best", root=tmp_path)
    assert (by_copy.path, by_copy.checkpoint) == (old.path, old.path / "best")


def test_a_resumed_run_continues_exactly_and_keeps_its_plan(tmp_path):
    model, state, step = setup()
    train(state, step, 6)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    run = RunFolder("tiny", root=tmp_path, keep=1)
    _, state, step = setup()
    assert run.resume(state, step=step, plan={"total_steps": 6}) is None
    train(state, step, 3)
    run.save(state, step=step)

    again = RunFolder.from_args(parse("--resume", str(run.path)), "tiny", root=tmp_path,
                                keep=1)
    model, state, step = setup(seed=1)  # other initial weights: all come from the checkpoint
    info = again.resume(state, step=step, plan={"total_steps": 6})
    assert info is not None and info.extra == {"total_steps": 6} and state.step == 3
    assert again.resharded_from is None
    train(state, step, 3)
    again.save(state, step=step, extra={"note": "x"})
    assert names(run.path) == ["step-000000006"]  # keep=1 kept the newest only
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    saved = torch.load(checkpointing.latest(run.path) / "state.pt", weights_only=True)
    assert saved["extra"] == {"total_steps": 6, "note": "x"}


def test_a_resume_planned_otherwise_is_refused_before_anything_is_loaded(tmp_path):
    run = RunFolder("tiny", root=tmp_path)
    _, state, step = setup()
    run.resume(state, step=step, plan={"total_steps": 11})
    train(state, step, 2)
    run.save(state, step=step)

    again = RunFolder.from_args(parse("--resume", str(run.path)), "tiny", root=tmp_path)
    model, state, step = setup(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlanMismatchError, match=r"planned with total_steps=11 and this one has "
                                                r"total_steps=22: .* \(without --resume\)") as err:
        again.resume(state, step=step, plan={"total_steps": 22})
    assert (err.value.key, err.value.saved, err.value.wanted) == ("total_steps", 11, 22)
    assert state.step == 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_checkpoint_that_does_not_fit_names_the_option(tmp_path):
    run = RunFolder("tiny", root=tmp_path)
    _, state, step = setup()
    train(state, step, 1)
    run.save(state, step=step)
    other = torch.nn.Linear(6, 4)
    state = af.TrainState(other, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(RunFolderError, match=r"resume='.*step-000000001' does not fit this "
                                             r"run: .*without resume=True"):
        RunFolder("tiny", resume=run.path, root=tmp_path).resume(state, step=step)


def test_history_keeps_every_session_of_the_folder(tmp_path):
    run = RunFolder("tiny", root=tmp_path)
    assert run.history() == []
    rows = [{"step": 0, "loss": 3.0}, {"step": 1, "loss": 2.0}, {"step": 1, "loss": 1.5},
            {"step": 2, "loss": 1.0}]
    run.metrics_file.write_text("\n".join(map(json.dumps, rows)) + "\n{\"step\": 3, \"lo")
    assert run.history() == [rows[0], rows[2], rows[3]]  # a torn last line is skipped
    assert run.plot_file == run.path / "run.png"


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_share_a_folder_and_one_process_resumes_it_or_refuses_first(tmp_path):
    sys.path.insert(0, str(WORKER.parent))
    import run_folder_worker as worker

    ranks = torchrun_results(WORKER, tmp_path)
    assert ranks[0]["path"] == ranks[1]["path"]  # one new folder for both processes
    assert ranks[0]["saved"] == ranks[1]["saved"]
    refused = ranks[0]["refused"]
    assert "holds the checkpoints of another run" in refused and refused == ranks[1]["refused"]
    out = Path(ranks[0]["path"])

    # one process: its plan (an epoch is twice as many updates) differs, and the number of
    # processes too; the plan is refused first, with nothing loaded
    torch.manual_seed(5)
    model = Net()  # the worker's model, optimizer and step
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.distributed(classify)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PlanMismatchError, match="total_steps=3 and this one has total_steps=6"):
        RunFolder.from_args(parse("--resume", str(out), "--allow-resharding"), "tiny").resume(
            state, step=step, plan={"total_steps": worker.planned_updates(1)})
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    with pytest.raises(RunFolderError, match=r"written by 2 process\(es\) and this run has 1: "
                                             "pass --allow-resharding"):
        RunFolder.from_args(parse("--resume", str(out)), "tiny").resume(
            state, step=step, plan={"total_steps": worker.planned_updates(2)})
    assert state.step == 0

    run = RunFolder.from_args(parse("--resume", str(out), "--allow-resharding"), "tiny")
    info = run.resume(state, step=step, plan={"total_steps": worker.planned_updates(2)})
    assert info is not None and run.resharded_from == 2 and state.step == worker.STEPS
    for key, value in model.state_dict().items():
        assert torch.equal(value, ranks[0]["weights"][key]), key


def test_resume_logs_the_step_and_the_checkpoint_it_resumed_from(tmp_path, caplog):
    run = RunFolder("tiny", root=tmp_path)
    _, state, step = setup()
    with caplog.at_level("INFO", logger="accelfn.checkpointing"):
        run.resume(state, step=step)  # a new run: nothing resumed, nothing said
    assert not [r for r in caplog.records if "resumed" in r.getMessage()]
    train(state, step, 3)
    saved = run.save(state, step=step)
    again = RunFolder("tiny", resume=run.path, root=tmp_path)
    _, state, step = setup(seed=1)
    with caplog.at_level("INFO", logger="accelfn.checkpointing"):
        again.resume(state, step=step)
    said = [r.getMessage() for r in caplog.records if r.name == "accelfn.checkpointing"]
    assert f"resumed from step 3 ({saved})" in said


def test_a_plan_refused_in_python_names_the_keywords_and_replan(tmp_path):
    run = RunFolder("tiny", root=tmp_path)
    _, state, step = setup()
    run.resume(state, step=step, plan={"total_steps": 11})
    train(state, step, 2)
    run.save(state, step=step)
    again = RunFolder("tiny", resume=run.path, root=tmp_path)
    _, state, step = setup(seed=1)
    with pytest.raises(PlanMismatchError) as err:
        again.resume(state, step=step, plan={"total_steps": 22})
    message = str(err.value)
    assert "resume=True" not in message  # resume= takes a path: a new run leaves it out
    assert "without resume=" in message and "replan=('total_steps',)" in message
    assert state.step == 0


def test_replan_extends_a_warmup_stable_decay_run_from_its_stable_phase(tmp_path):
    def built(total: int, seed: int = 0):
        torch.manual_seed(seed)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = af.TrainState(model, opt, scheduler=af.warmup_stable_decay(
            opt, warmup_steps=2, decay_steps=total // 4, total_steps=total))
        return model, state, af.with_clipping(max_norm=1.0)(classify)

    model, state, step = built(16)  # planned for 16 from the start: the reference
    rates = []
    for _ in range(16):
        rates.append(state.optimizer.param_groups[0]["lr"])
        train(state, step, 1)
    run = RunFolder("tiny", root=tmp_path)
    _, first, step = built(8)  # planned for 8 (decay from update 6 on), saved at update 4
    run.resume(first, step=step, plan={"total_steps": 8})
    train(first, step, 4)
    run.save(first, step=step)
    again = RunFolder("tiny", resume=run.path, root=tmp_path)
    resumed_model, resumed, step = built(16, seed=1)
    info = again.resume(resumed, step=step, plan={"total_steps": 16}, replan=("total_steps",))
    assert info is not None and resumed.step == 4
    got = []
    for _ in range(12):
        got.append(resumed.optimizer.param_groups[0]["lr"])
        train(resumed, step, 1)
    assert got == rates[4:]  # the rates of a run planned for 16 updates from the start
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    saved = torch.load(again.save(resumed, step=step) / "state.pt", weights_only=True)
    assert saved["extra"] == {"total_steps": 16}  # the new plan from here on
