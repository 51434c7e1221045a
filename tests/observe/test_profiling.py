"""Profiler windows write traces TensorBoard and Perfetto open (Chrome trace JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from accelfn.observe.profiling import Profiler, profiled


def _work(model: nn.Module) -> torch.Tensor:
    loss = model(torch.randn(8, 32)).sum()
    loss.backward()
    return loss.detach()


def test_window_writes_one_chrome_trace_with_the_active_steps(tmp_path: Path) -> None:
    model = nn.Linear(32, 16)
    with Profiler(tmp_path / "prof", wait=1, warmup=1, active=2) as prof:
        assert prof.activities == (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
        for i in range(6):
            with torch.profiler.record_function(f"train_step_{i}"):
                _work(model)
            prof.step()
            assert prof.done == (i >= 3)
    (trace,) = prof.trace_files
    assert trace.parent == tmp_path / "prof" and trace.name.endswith(".pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"aten::addmm", "aten::mm"} <= names  # forward and backward recorded
    # exactly the active steps 2 and 3: not the wait/warm-up ones, not the ones after
    assert {n for n in names if n and n.startswith("train_step_")} == {"train_step_2",
                                                                       "train_step_3"}
    assert "aten::addmm" in prof.summary()


def test_profiled_wrapper_and_repeat(tmp_path: Path) -> None:
    model = nn.Linear(32, 16)

    def step(m: nn.Module) -> torch.Tensor:
        return _work(m)

    step.evaluate = lambda m: "eval"  # type: ignore[attr-defined]
    pstep = profiled(dir=tmp_path, wait=0, warmup=1, active=1, repeat=2, use_gzip=True)(step)
    for _ in range(6):
        pstep(model)
    assert pstep.profiler.done
    assert len(pstep.profiler.trace_files) == 2
    assert all(f.name.endswith(".pt.trace.json.gz") for f in pstep.profiler.trace_files)
    assert pstep.evaluate(model) == "eval"
    assert pstep.__name__ == "step"


def test_bad_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="repeat=0 would profile forever"):
        Profiler(active=1, repeat=0)
    with pytest.raises(ValueError, match="wait=-1"):
        Profiler(wait=-1)
    with pytest.raises(ValueError, match="unknown activity 'tpu'"):
        Profiler(activities=["tpu"])
    with pytest.raises(RuntimeError, match="use `with Profiler"):
        Profiler().step()
