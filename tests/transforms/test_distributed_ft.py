"""distributed(fault_tolerance=...): replica groups made fault tolerant by torchft.

The run test starts torchft's lighthouse here and two replica groups, each its own torchrun
job of one gloo process (tests/transforms/ft_worker.py). Group 1 is SIGKILLed in the middle
of an update and restarted by torchrun; group 0 never stops. After group 1 healed from group
0, both hold the same parameters, optimizer and scheduler state bitwise, group 0 lost at most
the update in flight, and the record says which updates ran with one group. The other tests
are the refusals, which change nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from helpers import Net, classify, free_port, make_batch

import accelfn as af
from accelfn.parts.distributed.ft import Record
from accelfn.transforms.distributed import FaultTolerance, fault_tolerance_report

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ft_worker.py")


def _state() -> af.TrainState:
    torch.manual_seed(0)
    model = Net(dim=8, depth=1)
    return af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("options, match", [
    (dict(min_replicas=0), "min_replicas=0"),
    (dict(replicas=True), "replicas=True"),
    (dict(timeout=0), "timeout=0"),
    (dict(connect_timeout="5"), "connect_timeout='5'"),
    (dict(replicas=2, min_replicas=3), "min_replicas=3"),
    (dict(lighthouse=""), "lighthouse=''"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        FaultTolerance(**options)


@pytest.mark.parametrize("options", [dict(strategy="hsdp"),
                                     dict(strategy="fsdp", offload="cpu")])
def test_a_layout_it_cannot_combine_with_is_refused(options):
    with pytest.raises(ValueError, match=r"replicate dimension.*strategy='fsdp'"):
        af.distributed(**options, fault_tolerance=FaultTolerance(lighthouse="h:1"))
    assert "fault_tolerant" in repr(af.distributed(
        strategy="fsdp", fault_tolerance=FaultTolerance(lighthouse="h:1"))(classify))


def test_options_of_another_type_are_refused():
    with pytest.raises(TypeError, match="FaultTolerance"):
        af.distributed(fault_tolerance={"lighthouse": "h:1"})


def test_no_lighthouse_is_refused_saying_how_to_start_one(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match="torchft_lighthouse --min_replicas 1"):
        af.distributed(fault_tolerance=True)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "somewhere:29510")  # the environment's is taken
    assert "fault_tolerant" in repr(af.distributed(fault_tolerance=True)(classify))


def test_without_torchft_the_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'accelfn\[ft\]'"):
        af.distributed(fault_tolerance=FaultTolerance(lighthouse="h:1"))


def test_an_unreachable_lighthouse_is_named_within_the_timeout_and_changes_nothing():
    address = f"http://127.0.0.1:{free_port()}"
    step = af.distributed(fault_tolerance=FaultTolerance(lighthouse=address,
                                                         connect_timeout=0.5))(classify)
    state = _state()
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    initialized = dist.is_initialized()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="torchft_lighthouse") as caught:
        step(state, make_batch(n=4))
    assert time.monotonic() - start < 20
    assert address in str(caught.value)
    assert dist.is_initialized() == initialized  # no process group, no wrapping, no update
    assert state.step == 0 and not state.optimizer.state
    for k, v in state.model.state_dict().items():
        assert torch.equal(v, before[k])
    assert type(state.model) is Net and state.model.inp.weight.grad is None


def test_a_second_fault_tolerant_state_in_a_process_is_refused(monkeypatch):
    from accelfn.parts.distributed import ft

    other = torch.nn.Linear(1, 1)  # a state already trained with fault tolerance here
    monkeypatch.setattr(ft, "RUNTIMES", weakref.WeakKeyDictionary({other: object()}))
    step = af.distributed(fault_tolerance=FaultTolerance(lighthouse="h:1"))(classify)
    state = _state()
    with pytest.raises(ValueError, match="one replica group"):
        step(state, make_batch(n=4))
    assert state.step == 0 and type(state.model) is Net


# ----------------------------------------------------------------------------- the record
def test_the_record_runs_and_report():
    record = Record()
    for update, replicas, committed in [(0, 2, True), (1, 2, True), (2, 2, False),
                                        (3, 1, True), (4, 1, True), (5, 2, True)]:
        record.add(update, replicas, committed)
    record.healed.append(5)
    report = record.report(None)
    assert report["runs"] == [{"first": 0, "last": 2, "replicas": 2},
                              {"first": 3, "last": 4, "replicas": 1},
                              {"first": 5, "last": 5, "replicas": 2}]
    assert report["fewer_replicas"] == [{"first": 3, "last": 4, "replicas": 1}]
    assert report["updates_with_fewer_replicas"] == 2 and report["updates"] == 6
    assert report["not_applied"] == [2] and report["healed_at"] == [5]
    assert record.report(3)["updates_with_fewer_replicas"] == 6  # the run has 3 groups
    copy = Record()
    copy.load_state_dict(record.state_dict())
    assert copy.report(None) == report
    state = _state()
    assert fault_tolerance_report(state)["updates"] == 0  # nothing recorded yet


# ----------------------------------------------------------------------------- the run
@pytest.mark.distributed
@pytest.mark.slow
def test_a_killed_group_rejoins_heals_and_equals_the_survivor(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=1000)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lighthouse.address()}
    try:
        runs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
             f"--max-restarts={group}", "--master_addr=127.0.0.1",
             f"--master_port={free_port()}", WORKER, str(tmp_path), str(group)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for group in (0, 1)]
        outputs = [run.communicate(timeout=240)[0] for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
        lighthouse.shutdown()
    for run, output in zip(runs, outputs):
        assert run.returncode == 0, output[-4000:]
    survivor, healed = (torch.load(tmp_path / f"group{g}.pt", weights_only=True)
                        for g in (0, 1))
    assert survivor["attempt"] == 0 and healed["attempt"] == 1  # killed once, restarted
    # healed from the survivor: the same update, bitwise the same state
    assert survivor["step"] == healed["step"]
    for key, value in survivor["model"].items():
        assert torch.equal(value, healed["model"][key]), key
    buffers = [(s["momentum_buffer"], h["momentum_buffer"]) for s, h in zip(
        survivor["optimizer"]["state"].values(), healed["optimizer"]["state"].values())]
    assert buffers and all(torch.equal(s, h) for s, h in buffers)
    assert survivor["scheduler"] == healed["scheduler"]
    # the survivor's record: both, then group 0 alone from the kill, then both again;
    # at most the update in flight at the kill was not applied
    report = survivor["report"]
    counts = [run["replicas"] for run in report["runs"]]
    both = counts.index(2)
    assert counts[-1] == 2 and 1 in counts[both:]
    killed = next(run for run in report["runs"][both:] if run["replicas"] == 1)
    assert report["not_applied"] in ([], [killed["first"] - 1])
    assert killed in [dict(f) for f in report["fewer_replicas"]]
    assert healed["report"]["runs"] == report["runs"]  # the record travelled with the state
    assert healed["report"]["healed_at"][-1] == report["runs"][-1]["first"]
    written = (tmp_path / "report0.json").read_text()
    assert f'"first": {killed["first"]}' in written  # the JSON the user reads
