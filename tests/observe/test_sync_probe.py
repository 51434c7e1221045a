"""The sync probe: planted host syncs found with their line, clean steps silent (CPU)."""

from __future__ import annotations

import inspect
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accelfn.core.syncs import deferred_read, in_deferred_read
from accelfn.observe.sync_probe import SyncProbe


def _line_of(fn, text: str) -> int:
    """Line number of the first source line of ``fn`` containing ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_probe_catches_planted_item_with_its_line() -> None:
    model = nn.Linear(8, 1)

    def step() -> float:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        return loss.item()  # planted sync

    with SyncProbe(mode="emulate") as probe:
        step()
    assert len(probe.syncs) == 1
    sync = probe.syncs[0]
    assert sync.op.startswith("Tensor.item")
    assert sync.location.endswith(f":{_line_of(step, 'planted sync')} in step")
    assert "loss.item()" in (sync.code or "")
    assert "keep the value on the device" in sync.fix
    (finding,) = probe.findings()
    assert finding.severity == "warning" and finding.check == "host_syncs"


def test_probe_catches_bool_mask_cpu_and_tolist() -> None:
    x = torch.randn(16)

    def step() -> None:
        if x.sum() > 0:  # bool(tensor)
            pass
        _ = x[x > 0]  # boolean mask
        _ = torch.nonzero(x)
        _ = x.cpu()
        _ = x.tolist()

    with SyncProbe(mode="emulate") as probe:
        step()
    ops = [s.op for s in probe.syncs]
    assert any(o.startswith("Tensor.item") for o in ops)  # bool() goes through item
    assert "boolean-mask indexing (aten.index)" in ops
    assert "aten.nonzero" in ops
    assert "Tensor.cpu" in ops and "Tensor.tolist" in ops
    assert len(probe.syncs) == 5
    mask = next(s for s in probe.syncs if "mask" in s.op)
    assert "torch.where" in mask.fix


def test_probe_is_silent_on_a_clean_step_and_restores_tensor_methods() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    original = (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy)

    def step() -> torch.Tensor:
        loss = F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step()
    with SyncProbe(mode="emulate") as probe:
        step()
    assert probe.syncs == []
    assert probe.findings()[0].severity == "ok"
    assert (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy) == original


def test_probe_counts_repeats_and_rejects_bad_mode() -> None:
    x = torch.ones(3)
    with SyncProbe(mode="emulate") as probe:
        for _ in range(3):
            x.sum().item()
    assert [s.count for s in probe.syncs] == [3]
    with SyncProbe(mode="emulate", allow=["test_sync_probe.py"]) as probe:
        x.sum().item()
    assert probe.syncs == [] and probe.findings()[0].severity == "ok"
    with pytest.raises(ValueError, match="'auto', 'cuda' or 'emulate'"):
        SyncProbe(mode="gpu")  # type: ignore[arg-type]


# -- reads marked as deferred -------------------------------------------------------------------


def test_emulated_probe_leaves_out_reads_inside_deferred_read_only() -> None:
    flags = torch.zeros(2)  # stands for flags copied to pinned host memory an update ago

    def step() -> None:
        with deferred_read():
            flags.tolist()  # deferred: already on the host
            bool(flags.any())
            flags.sum().item()
        flags.sum().item()  # not marked: a sync

    with SyncProbe(mode="emulate") as probe:
        step()
    (sync,) = probe.syncs
    assert sync.op.startswith("Tensor.item") and sync.count == 1
    assert sync.location.endswith(f"test_sync_probe.py:{_line_of(step, 'not marked')} in step")


def test_deferred_read_is_per_thread_and_restored_after_an_error() -> None:
    x = torch.ones(3)
    seen: list[int] = []

    def other_thread() -> None:
        with SyncProbe(mode="emulate") as probe:
            x.sum().item()  # outside any deferred_read in this thread
        seen.append(len(probe.syncs))

    with deferred_read():
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert seen == [1]
    with pytest.raises(RuntimeError), deferred_read():
        raise RuntimeError("boom")
    assert not in_deferred_read()
    with SyncProbe(mode="emulate") as probe:
        x.sum().item()
    assert len(probe.syncs) == 1
