"""PreemptionGuard: a signal becomes a checkpoint at the next step boundary and exit status 75.

The multi-process agreement under torchrun is in test_resume.py (one rank is signalled,
both stop at the same step).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import resume_worker as worker
import torch
from resume_worker import ENV, WORKER, assert_same_run
from resume_worker import load_result as load

from accelfn import checkpointing as ckpt
from accelfn.checkpointing import preemption
from accelfn.checkpointing.preemption import EXIT_PREEMPTED, PreemptionGuard


def test_a_signal_sets_the_flag_and_handlers_are_put_back():
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert not guard.requested and not guard.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # the handler runs between bytecodes of the main thread
        assert guard.requested and guard.signal == signal.SIGUSR1
        assert guard.should_stop() and guard.should_stop()  # and stays so
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before


def test_a_handler_installed_before_is_still_called():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with PreemptionGuard(signals=[signal.SIGTERM]) as guard:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        assert guard.requested and seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_request_and_time_limit_also_stop(monkeypatch):
    guard = PreemptionGuard(time_limit_s=100.0).install()
    try:
        assert not guard.should_stop()
        clock = time.monotonic()
        monkeypatch.setattr(preemption.time, "monotonic", lambda: clock + 101.0)
        assert guard.requested and guard.should_stop()
    finally:
        guard.uninstall()
    other = PreemptionGuard()
    other.request()
    assert other.should_stop()


def test_several_processes_agree_every_check_every_calls(monkeypatch):
    """Simulated peers: the all-reduce (MAX) says another process was signalled."""
    reduces = []

    def all_reduce(tensor, op):
        reduces.append(int(tensor.item()))
        tensor.fill_(1)  # the other process requested a stop

    monkeypatch.setattr(preemption, "_world", lambda: 2)
    monkeypatch.setattr(preemption.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(preemption.dist, "all_reduce", all_reduce)
    guard = PreemptionGuard(check_every=3)
    decisions = [guard.should_stop() for _ in range(4)]
    assert decisions == [False, False, True, True]  # the third boundary communicates
    assert reduces == [0]  # once, carrying this process' (unset) flag


def test_checkpoint_and_exit_saves_then_exits_75(tmp_path, capsys):
    state, loader, step = worker.build()
    it = worker.batches(loader)
    guard = PreemptionGuard()
    guard.request()
    step(state, next(it))
    with pytest.raises(SystemExit) as exited, \
            pytest.warns(RuntimeWarning, match="preempted at step 1"):
        guard.exit_if_requested(tmp_path, state, loader=loader, step=step)
    assert exited.value.code == EXIT_PREEMPTED == 75
    assert ckpt.latest(tmp_path).name == "step-000000001"


@pytest.mark.parametrize("launcher", ["python", "torchrun", "accelfn launch"])
def test_the_exit_message_names_accelfn_launch_under_plain_torchrun(tmp_path, monkeypatch,
                                                                     launcher):
    # torchrun's agent sets TORCHELASTIC_RUN_ID in its workers; accelfn launch runs the same
    # agent and also names the marker folder: only plain torchrun hides the 75 (it exits 1)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(preemption.MARKER_ENV, raising=False)
    if launcher != "python":
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    if launcher == "accelfn launch":
        (tmp_path / "markers").mkdir()
        monkeypatch.setenv(preemption.MARKER_ENV, str(tmp_path / "markers"))
    state, loader, step = worker.build()
    guard = PreemptionGuard()
    guard.request()
    step(state, next(worker.batches(loader)))
    with pytest.raises(SystemExit), pytest.warns(RuntimeWarning) as warned:
        guard.exit_if_requested(tmp_path / "run", state, loader=loader, step=step)
    (message,) = [str(w.message) for w in warned if "preempted at step 1" in str(w.message)]
    hinted = "`accelfn launch`" in message
    assert hinted == (launcher == "torchrun"), message
    if hinted:
        assert "torchrun itself will exit 1, not 75" in message
        assert "accelfn launch --nproc_per_node=N train.py" in message


@pytest.mark.parametrize("kwargs,match", [
    ({"check_every": 0}, "check_every"),
    ({"signals": [signal.SIGKILL]}, "cannot handle"),
    ({"time_limit_s": -1.0}, "time_limit_s"),
    ({"exit_code": 0}, "exit_code"),
])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PreemptionGuard(**kwargs)


def test_handlers_need_the_main_thread():
    import threading

    errors = []

    def install_elsewhere():
        try:
            PreemptionGuard().install()
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=install_elsewhere)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in errors[0]


@pytest.mark.slow
def test_sigterm_mid_run_checkpoints_exits_75_and_resumes_exactly(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(WORKER), "preempt", str(run), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready for SIGTERM", line + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)  # after step 3 of 16, mid-epoch
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    assert code == EXIT_PREEMPTED, stderr[-3000:]
    assert "preempted at step 3" in stderr
    assert [p.name for p in ckpt.checkpoints(run)] == ["step-000000003"]
    resumed = subprocess.run([sys.executable, str(WORKER), "resume", str(run), str(out)],
                             capture_output=True, text=True, timeout=300, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = load(out / "resumed.pt")
    assert result["info"]["step"] == 3
    assert_same_run(load(out / "reference.pt"), result)
    assert torch.is_tensor(result["losses"][0])


def _calls_run():
    from helpers import Net, classify

    import accelfn as af

    torch.manual_seed(0)
    model = Net()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return state, af.with_accumulation(3, mode="calls")(af.with_clipping(max_norm=0.5)(classify))


def test_sigterm_mid_window_stops_at_the_windows_end_and_resumes_exactly(tmp_path):
    """Calls-mode accumulation: a SIGTERM while a window is open stops at the window's end
    (the first update boundary), with a checkpoint and status 75, not a crash."""
    from helpers import make_batch

    batches = [make_batch(seed=i) for i in range(9)]
    state, step = _calls_run()
    calls = 0
    with pytest.raises(SystemExit) as exited, PreemptionGuard() as guard:
        for batch in batches:
            step(state, batch)
            calls += 1
            if calls == 4:  # the second window has one call
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)
                assert guard.requested and not guard.should_stop(state)  # not mid-window
            guard.exit_if_requested(tmp_path, state, step=step)
    assert exited.value.code == EXIT_PREEMPTED
    assert calls == 6 and state.step == 2  # stopped when the window closed
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["step-000000002"]
    resumed, step2 = _calls_run()
    ckpt.load(tmp_path, resumed, step=step2)
    straight, step3 = _calls_run()
    for batch in batches:
        step3(straight, batch)
    for batch in batches[6:]:
        step2(resumed, batch)
    assert resumed.step == straight.step == 3
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)


def test_several_processes_agree_and_stop_at_the_same_window_end(monkeypatch):
    """The agreement's all-reduce runs as before (every check_every calls, whatever the
    window); the stop it agreed is taken at the first boundary, the same call everywhere."""
    from helpers import make_batch

    reduces = []

    def all_reduce(tensor, op):
        reduces.append(int(tensor.item()))
        tensor.fill_(1)

    monkeypatch.setattr(preemption, "_world", lambda: 2)
    monkeypatch.setattr(preemption.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(preemption.dist, "all_reduce", all_reduce)
    state, step = _calls_run()
    guard = PreemptionGuard(check_every=2)
    decisions = []
    for i in range(6):
        step(state, make_batch(seed=i))
        decisions.append(guard.should_stop(state))
    # agreed at call 2 (its window open), True at each update boundary from then on
    assert decisions == [False, False, True, False, False, True]
    assert reduces == [0]


def test_checkpoint_and_exit_mid_window_is_refused_before_saving(tmp_path):
    from helpers import make_batch

    state, step = _calls_run()
    step(state, make_batch())
    with pytest.raises(RuntimeError, match=r"window open.*exit_if_requested"):
        PreemptionGuard().checkpoint_and_exit(tmp_path / "run", state, step=step)
    assert not (tmp_path / "run").exists()
