"""memory_snapshot: the allocations of the first updates recorded, dumped on an OOM."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelfn as af
from accelfn.observe.memory import estimate_memory
from accelfn.observe.memory_snapshots import memory_snapshot


class Wide(nn.Module):
    """Makes a (batch, 4096) activation, and runs out of memory above ``limit`` samples."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(8, 4096)
        self.down = nn.Linear(4096, 2)
        self.limit = limit

    def forward(self, x):
        wide = torch.relu(self.up(x))  # the largest tensor of an update
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CPU out of memory (test)")
        return self.down(wide)


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def _batch(n):
    g = torch.Generator().manual_seed(n)
    return {"x": torch.randn(n, 8, generator=g), "y": torch.randint(0, 2, (n,), generator=g)}


def test_an_oom_on_the_cpu_dumps_the_largest_live_tensors_and_where_they_were_made(tmp_path):
    model = Wide(limit=32)
    state = af.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = af.with_clipping(max_norm=1.0)(loss_fn)
    path = tmp_path / "oom.json"
    estimate = estimate_memory(step, state, _batch(16))
    kept = []
    with pytest.raises(torch.OutOfMemoryError) as raised:
        with memory_snapshot(path, updates=2, device="cpu", estimate=estimate, step=step,
                             top=10**6) as snapshot:  # all (other tests' tensors may live)
            for n in (16, 16):
                kept.append(step(state, _batch(n)))
                snapshot.updated()
                assert snapshot.recording == (snapshot.seen < 2)
            step(state, _batch(64))
    notes = "\n".join(raised.value.__notes__)
    assert str(path) in notes and "memory: peak" in notes and "Try:" in notes
    dump = json.loads(path.read_text())
    largest = dump["largest"]
    assert largest == sorted(largest, key=lambda e: -e["bytes"])
    assert dump["live_bytes"] >= sum(e["bytes"] for e in largest)
    # alive at the error: the failed forward's (64, 4096) activation, and the weight of `up`
    # (4096 x 8 fp32, made before recording)
    activation = next(e for e in largest if e["shape"] == [64, 4096])
    assert activation["bytes"] == 64 * 4096 * 4  # (made after the 2 recorded updates)
    weight = next(e for e in largest if e["shape"] == [4096, 8])
    assert weight["made at"].startswith("not recorded")
    # tensors of the recorded updates still alive (their returned metrics) name their line
    made = [e for e in largest if not e["made at"].startswith("not recorded")]
    assert made and all(".py:" in e["made at"] for e in made)


def test_a_snapshot_taken_by_hand_lists_a_live_activation_with_its_line(tmp_path):
    model = Wide(limit=10**6)
    path = tmp_path / "now.json"
    with memory_snapshot(path, device="cpu") as snapshot:
        kept = torch.relu(model.up(torch.randn(128, 8)))  # alive at the dump
        snapshot.dump()
    entry = next(e for e in json.loads(path.read_text())["largest"] if e["shape"] == [128, 4096])
    assert "test_memory_snapshots.py" in entry["made at"] and entry["dtype"] == "float32"
    assert kept.shape == (128, 4096)


def test_other_errors_pass_through_without_a_dump(tmp_path):
    path = tmp_path / "none.json"
    with pytest.raises(ValueError, match="boom"), memory_snapshot(path, device="cpu"):
        raise ValueError("boom")
    assert not path.exists()


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="updates"):
        memory_snapshot("x.json", updates=0)
    with pytest.raises(ValueError, match="step="):
        memory_snapshot("x.json", estimate=object())  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_allocator_history_is_dumped_for_the_memory_viewer(tmp_path):
    import pickle

    path = tmp_path / "oom.pickle"
    with pytest.raises(torch.OutOfMemoryError), memory_snapshot(path, device="cuda"):
        kept = torch.empty(1 << 20, device="cuda")
        raise torch.OutOfMemoryError("CUDA out of memory (test)")
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"] and kept.numel() == 1 << 20
