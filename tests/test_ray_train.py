"""Ray Train: examples/ray_train.py under ray.train.torch.TorchTrainer with 2 CPU workers on a
local Ray instance, against plain PyTorch in one process on the same rows.

One run serves the module (Ray's start-up takes most of the time): 8 updates, a checkpoint
every 4, the last worker SIGKILLed at update 6 the first time. Its step-4 checkpoint, written
before the kill, shows 2 workers equal to one process; its step-8 checkpoint, written by the
group Ray restarted, which resumed from step 4, shows the restarted run equal to the
uninterrupted one, bitwise.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys

import pytest
import torch

import accelfn as af
from accelfn import checkpointing, data
from accelfn.data.sampling import epoch_indices

ray = pytest.importorskip("ray", reason="Ray Train's tests need accelfn[ray]")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:  # the example imports its sibling run_options.py
    sys.path.insert(0, EXAMPLES)

STEPS, SAVE_EVERY, CRASH_AT, BATCH = 8, 4, 6, 32  # BATCH per worker; 2 workers


def load_example():
    spec = importlib.util.spec_from_file_location(
        "ray_train", os.path.join(EXAMPLES, "ray_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def saved_model(out, step: int) -> dict:
    path = out / f"step-{step:09d}" / "state.pt"
    return torch.load(path, weights_only=True)["state"]["model"]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """The example's run whose last worker is killed at update 6: (its report, its folder)."""
    out = tmp_path_factory.mktemp("ray") / "run"
    # a loaded machine can take a minute to start a worker group (Ray's default limit)
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "600"
    # ray.init gives this process a SIGTERM handler that exits (sys.exit(15)), and keeps it
    # after shutdown: put back the one before, or a later test's handler chains into it
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        report = load_example().main([
            "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--batch-size", str(BATCH),
            "--crash-at", str(CRASH_AT), "--out", str(out)])
    finally:
        ray.shutdown()
        del os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"]
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return report, out


def one_process(halves: bool) -> dict[int, dict]:
    """The example's training written in plain PyTorch in one process, each update on the
    64 rows of the two workers' batches (the loader's seeded order): the parameters after
    each update. ``halves``: the gradient is the mean of the two workers' batch-mean
    gradients, as DDP computes it; else the gradient of the mean over the 64 rows."""
    example = load_example()
    train_set, _ = example.split(data.datasets.digits())
    order = epoch_indices(len(train_set), shuffle=True, seed=0, epoch=0)
    normalize = data.Normalize(mean=example.MEAN, std=example.STD)
    torch.manual_seed(0)
    model = example.digit_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=STEPS)
    after = {}
    for i in range(STEPS):
        rows = order[i * 2 * BATCH:(i + 1) * 2 * BATCH]
        parts = [rows[r::2] for r in range(2)] if halves else [rows]  # rank r: order[r::2]
        grads = []
        for part in parts:
            model.zero_grad(set_to_none=True)
            example.digit_step(model, normalize(train_set[part]))["loss"].backward()
            grads.append([p.grad for p in model.parameters()])
        for p, *each in zip(model.parameters(), *grads):
            p.grad = sum(each) / len(each)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        after[i + 1] = {k: v.clone() for k, v in model.state_dict().items()}
    return after


pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_ray_workers_equal_one_process_on_the_same_rows(crashed):
    _, out = crashed
    got = saved_model(out, SAVE_EVERY)  # written by the first worker group, before the kill
    halves, whole = one_process(halves=True), one_process(halves=False)
    assert got.keys() == halves[SAVE_EVERY].keys()
    for name, value in halves[SAVE_EVERY].items():
        assert torch.equal(got[name], value), name
    for name, value in whole[SAVE_EVERY].items():  # 2.2e-8 apart measured
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_a_killed_worker_resumes_from_accelfns_checkpoint_exactly(crashed):
    report, out = crashed
    assert (out / f".crashed-at-{CRASH_AT}").exists()  # the last worker was killed at 6
    assert report["updates"] == STEPS and report["workers"] == 2
    assert report["resumed_from"] == SAVE_EVERY  # Ray's new group resumed, not started over
    assert [p.name for p in checkpointing.checkpoints(out)] == ["step-000000004",
                                                                 "step-000000008"]
    got = saved_model(out, STEPS)
    uninterrupted = one_process(halves=True)[STEPS]  # 2 workers' updates, as the test above
    for name, value in uninterrupted.items():
        assert torch.equal(got[name], value), name
    # Ray's copy of the last checkpoint, named as accelfn names it, is the same checkpoint
    assert report["ray_checkpoint"] == str(out / "ray" / "step-000000008")
    copy = torch.load(os.path.join(report["ray_checkpoint"], "state.pt"), weights_only=True)
    for name, value in got.items():
        assert torch.equal(copy["state"]["model"][name], value), name


class Context:
    """Ray Train's context in a worker of ``workers`` (here in the driver, which is none)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def get_world_size(self) -> int:
        return self.workers


def test_a_ray_train_worker_without_a_process_group_is_refused(monkeypatch):
    # what DataParallelTrainer gives each of its workers: Ray's context says 2, torch has
    # no process group (and no torchrun variables): each worker would train alone
    import ray.train
    import ray.train.torch

    monkeypatch.setattr(ray.train, "get_context", lambda: Context(2))
    monkeypatch.setattr(ray.train.torch, "get_device", lambda: torch.device("cpu"))
    for variable in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(variable, raising=False)
    with pytest.raises(RuntimeError, match=r"one of 2 Ray Train workers but has no "
                                           r"torch.distributed process group.*TorchTrainer"):
        af.init_distributed()
    monkeypatch.undo()
    assert af.init_distributed() == torch.device("cpu")  # the driver: one process


def test_a_ray_train_cpu_worker_trains_on_the_cpu_on_a_machine_with_gpus(monkeypatch):
    # Ray leaves a worker given no GPU the machine's GPUs visible: torchrun's LOCAL_RANK bound
    # it to cuda:LOCAL_RANK (rank 1 of 2 CPU workers failed on a machine with one GPU)
    import ray.train
    import ray.train.torch

    from accelfn.parts.sharding import _check_device

    monkeypatch.setattr(ray.train, "get_context", lambda: Context(1))
    monkeypatch.setattr(ray.train.torch, "get_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert af.init_distributed() == torch.device("cpu")
    _check_device(torch.device("cpu"))  # distributed takes a model on Ray's device


def test_a_preemption_guard_in_a_ray_train_worker_says_to_leave_it_out(monkeypatch):
    # Ray Train runs the training function in a thread of the worker: no signal handler there
    import threading

    import ray.train

    monkeypatch.setattr(ray.train, "get_context", lambda: Context(2))
    raised: list[BaseException] = []

    def guarded() -> None:
        try:
            with af.PreemptionGuard():
                pass
        except RuntimeError as error:
            raised.append(error)

    thread = threading.Thread(target=guarded)
    thread.start()
    thread.join()
    assert len(raised) == 1
    assert "under Ray Train" in str(raised[0]) and "leave the guard out" in str(raised[0])
    assert "FailureConfig" in str(raised[0])
