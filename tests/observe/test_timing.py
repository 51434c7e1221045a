"""Benchmark timing: every timed call starts from an idle device."""

from __future__ import annotations

import pytest
import torch

from accelfn.observe import timing


def test_interleaved_drains_work_queued_before_the_first_timed_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(timing, "sync", lambda device: events.append("sync"))
    fns = [lambda: events.append("a"), lambda: events.append("b")]
    times = timing.interleaved(fns, steps=2, device=torch.device("cuda", 0))
    assert [len(t) for t in times] == [2, 2]
    # the work queued before (a model's set-up, a previous measurement) is not timed as a's
    assert events == ["sync", "a", "sync", "b", "sync", "b", "sync", "a", "sync"]
    events.clear()
    timing.interleaved(fns, steps=1, device=None)  # the CPU: nothing to drain
    assert events == ["a", "b"]


def test_time_steps_refuses_counts_it_cannot_honour() -> None:
    calls: list[int] = []
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="warmup=0"):  # the first call is always warm-up
        timing.time_steps(lambda: calls.append(1), warmup=0, steps=3, device=cpu)
    with pytest.raises(ValueError, match="steps=0"):
        timing.time_steps(lambda: calls.append(1), warmup=1, steps=0, device=cpu)
    assert calls == []
    t = timing.time_steps(lambda: calls.append(1), warmup=2, steps=3, device=cpu)
    assert len(calls) == 5 and len(t.per_step_s) == 3 and t.elapsed_s >= sum(t.per_step_s)
