"""Throughput in the monitor's report: per process and over all processes; tokens/s from the
``"weight"`` a step returns (its token count) when the loop does not say."""

from __future__ import annotations

import pytest
import torch

from accelfn.observe.monitor import Monitor, reporting


def quiet(**kw) -> Monitor:
    return Monitor(progress=False, sync_check=None, warmup=0, **kw)


def test_tokens_are_the_weight_the_step_returns():
    mon = quiet()
    with mon:
        for n in (10, 20, 30):
            mon.step({"loss": torch.tensor(1.0), "weight": torch.tensor(n)}, samples=4)
    assert [r["tokens"] for r in mon.rows] == [10, 20, 30]
    report = mon.report()
    assert report.tokens_per_s is not None and report.tokens_per_s > 0
    assert "tokens/s" in str(report)
    mon = quiet()  # tokens= given: it wins over the weight
    with mon:
        mon.step({"loss": torch.tensor(1.0), "weight": torch.tensor(10)}, tokens=7)
    assert mon.rows[0]["tokens"] == 7


def test_global_throughput_is_beside_the_per_process_one(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(reporting, "world_size", lambda: 4)
    mon = quiet()
    with mon:
        for _ in range(3):
            mon.step({"loss": torch.tensor(1.0), "weight": torch.tensor(16)}, samples=8)
    report = mon.report()
    assert report.processes == 4
    assert report.global_samples_per_s == pytest.approx(4 * report.samples_per_s)
    assert report.global_tokens_per_s == pytest.approx(4 * report.tokens_per_s)
    text = str(report)
    assert "per process" in text and "all 4 processes" in text
    monkeypatch.setattr(reporting, "world_size", lambda: 1)
    single = quiet()
    with single:
        single.step({"loss": torch.tensor(1.0)}, samples=8)
    report = single.report()
    assert report.processes == 1 and report.global_samples_per_s == report.samples_per_s
    assert "all 1" not in str(report)
