"""Monitor(memory_snapshot=...): the first updates recorded, a dump on an out-of-memory error.

The model runs out of memory (``torch.OutOfMemoryError``, as CUDA's allocator raises it) above
a batch size, so the CPU shows what a GPU run would: the error names the dump, the dump lists
the live tensors, the report says where it went. A run that does not fail trains exactly as
the plain loop.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference import reference_update
from torch import nn

import accelfn as af
from accelfn.observe.memory import estimate_memory
from accelfn.observe.memory_snapshots import MemorySnapshot, memory_snapshot
from accelfn.observe.monitor import Monitor


class Wide(nn.Module):
    """A (batch, 2048) activation with dropout; out of memory above ``limit`` samples."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(8, 2048)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(2048, 2)
        self.limit = limit

    def forward(self, x):
        wide = self.drop(torch.relu(self.up(x)))  # the largest tensor of an update
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CPU out of memory (test)")
        return self.down(wide)


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def batches(*sizes):
    for i, n in enumerate(sizes):
        g = torch.Generator().manual_seed(i)
        yield {"x": torch.randn(n, 8, generator=g), "y": torch.randint(0, 2, (n,), generator=g)}


def _setup(limit=32):
    model = Wide(limit)
    return model, af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _run(mon, state, step, sizes):
    with mon:
        for batch in mon.iterate(batches(*sizes)):
            mon.step(step(state, batch))


def _notes(error):
    return "\n".join(getattr(error, "__notes__", ()))


def test_an_oom_in_the_loop_dumps_the_live_tensors_and_the_report_says_where(tmp_path):
    _, state = _setup()
    path = tmp_path / "oom.json"
    mon = Monitor(memory_snapshot=path, progress=False, sync_check=None, device="cpu")
    with pytest.raises(torch.OutOfMemoryError) as raised:
        _run(mon, state, af.with_clipping(max_norm=1.0)(loss_fn), (16, 16, 64))
    assert f"the memory snapshot is in {path}" in _notes(raised.value)
    dump = json.loads(path.read_text())
    largest = dump["largest"]
    assert largest == sorted(largest, key=lambda e: -e["bytes"])
    # alive when the error left the loop: the failed forward's (64, 2048) activation, made
    # in the third update, the last recorded one: by the line of Wide.forward
    activation = next(e for e in largest if e["shape"] == [64, 2048])
    assert activation["bytes"] == 64 * 2048 * 4
    assert "test_monitor_memory.py" in activation["made at"]
    assert "in forward" in activation["made at"]
    report = mon.report()  # final: the monitor closed as the error left it
    assert f"memory_snapshot: the out-of-memory error's snapshot is in {path}" in str(report)
    assert [r["step"] for r in report.rows] == [1, 2]


def test_the_step_given_makes_the_error_name_the_peak_by_kind_and_the_fixes(tmp_path):
    _, state = _setup()
    step = af.with_clipping(max_norm=1.0)(loss_fn)
    expected = estimate_memory(step, state, next(batches(16)))  # the state is not changed
    snapshot = memory_snapshot(tmp_path / "oom.json", step=step, updates=2, device="cpu")
    mon = Monitor(state=state, memory_snapshot=snapshot, progress=False,
                  sync_check=None)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        _run(mon, state, step, (16, 16, 16, 64))
    assert snapshot.estimate == expected  # made on the first batch, before its update
    assert snapshot.seen == 3 and not snapshot.recording  # recorded the first 2 only
    notes = _notes(raised.value)
    assert str(expected) in notes and "Try:" in notes and "with_accumulation(2)" in notes
    assert "checkpointed" in notes  # the stack has no checkpointing
    text = str(mon.report())
    assert f"memory_estimate: {str(expected).removeprefix('memory: ')}" in text


def test_a_run_without_error_trains_as_the_plain_loop_and_dumps_nothing(tmp_path):
    model, state = _setup(limit=10**6)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    path = tmp_path / "oom.json"
    snapshot = memory_snapshot(path, step=loss_fn, device="cpu")
    mon = Monitor(state=state, memory_snapshot=snapshot, progress=False, sync_check=None)
    torch.manual_seed(1)  # dropout: the estimate must not draw from the generator
    _run(mon, state, af.lift(loss_fn), (16, 16, 16, 16))
    torch.manual_seed(1)
    for batch in batches(16, 16, 16, 16):
        reference_update(reference, ref_opt, batch, loss_fn)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    assert snapshot.estimate is not None and not path.exists()
    assert "no out-of-memory error, nothing dumped" in str(mon.report())


def test_measure_without_with_dumps_once_and_other_errors_pass_untouched(tmp_path):
    _, state = _setup()
    path = tmp_path / "oom.json"
    mon = Monitor(memory_snapshot=path, progress=False, sync_check=None)
    mon.start()
    with pytest.raises(ValueError, match="boom"), mon.measure():
        raise ValueError("boom")
    assert not path.exists()
    batch = next(batches(64))
    with pytest.raises(torch.OutOfMemoryError) as raised, mon.measure():
        af.lift(loss_fn)(state, batch)
    assert _notes(raised.value).count("the memory snapshot is in") == 1
    assert path.exists()
    mon.close()
    assert f"snapshot is in {path}" in str(mon.report())


def test_an_oom_in_the_probed_step_ends_the_probe_and_still_dumps(tmp_path):
    _, state = _setup()
    path = tmp_path / "oom.json"
    step = af.lift(loss_fn)
    mon = Monitor(memory_snapshot=path, progress=False, sync_check=af.SyncCheck(step=1),
                  device="cpu")
    loop = mon.iterate(batches(16, 64))  # held: its probe is still on when the error leaves
    with pytest.raises(torch.OutOfMemoryError) as raised, mon:
        for batch in loop:
            mon.step(step(state, batch))
    assert any(e["shape"] == [64, 2048] for e in json.loads(path.read_text())["largest"])
    assert f"snapshot is in {path}" in _notes(raised.value)
    assert mon.report().syncs is not None  # the probed step's result reached the report
    # the modes are balanced: a new snapshot records; every live tensor listed (top=10**6)
    with memory_snapshot(tmp_path / "again.json", device="cpu", top=10**6) as again:
        kept = torch.relu(torch.randn(4, 8))
        again.dump()
    entry = next(e for e in json.loads((tmp_path / "again.json").read_text())["largest"]
                 if e["shape"] == [4, 8])
    assert "test_monitor_memory.py" in entry["made at"] and kept.shape == (4, 8)


def test_an_estimate_that_fails_warns_and_the_run_goes_on(tmp_path):
    def to_numpy(model, batch):  # fake tensors have no data to give numpy
        x = torch.from_numpy(batch["x"].numpy().copy())
        return F.cross_entropy(model(x), batch["y"])

    _, state = _setup(limit=10**6)
    snapshot = memory_snapshot(tmp_path / "oom.json", step=to_numpy, device="cpu")
    mon = Monitor(state=state, memory_snapshot=snapshot, progress=False, sync_check=None)
    with pytest.warns(RuntimeWarning, match="could not be estimated"):
        _run(mon, state, af.lift(to_numpy), (16, 16))
    assert state.step == 2 and snapshot.estimate is None
    assert "memory_estimate: not estimated" in str(mon.report())


def test_bad_options_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(TypeError, match="takes a path"):
        Monitor(memory_snapshot=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="state="):
        Monitor(memory_snapshot=memory_snapshot(tmp_path / "x.json", step=loss_fn))
    snapshot = memory_snapshot(tmp_path / "x.json", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Monitor(memory_snapshot=snapshot, progress=False).close()
    assert isinstance(snapshot, MemorySnapshot) and not snapshot.recording


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_monitor_dumps_the_allocator_history(tmp_path):
    import pickle

    torch.manual_seed(0)
    model = nn.Linear(8, 2).cuda()
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    path = tmp_path / "oom.pickle"
    mon = Monitor(memory_snapshot=path, progress=False, sync_check=None, device="cuda")

    def step(model, batch):
        if batch["x"].shape[0] > 16:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return F.cross_entropy(model(batch["x"]), batch["y"])

    cuda = ({k: v.cuda() for k, v in b.items()} for b in batches(16, 64))
    with pytest.raises(torch.OutOfMemoryError), mon:
        for batch in mon.iterate(cuda):
            mon.step(af.lift(step)(state, batch))
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"] and "PyTorch's memory viewer" in str(mon.report())


@pytest.mark.slow
@pytest.mark.distributed
def test_under_several_processes_each_rank_dumps_its_own_file(tmp_path):
    from helpers import torchrun

    torchrun(Path(__file__).with_name("memory_snapshot_worker.py"), tmp_path)
    assert not (tmp_path / "oom.json").exists()
    for rank in (0, 1):
        own = tmp_path / f"oom.rank{rank}.json"
        assert json.loads(own.read_text())["tensors"] > 0
        assert f"the memory snapshot is in {own}" in (tmp_path / f"notes{rank}.txt").read_text()
