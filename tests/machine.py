"""A faked machine for the checks that read the CPU load (the monitor's verdict, doctor).

``idle_machine`` is an autouse fixture: a test module that imports it sees an idle 64-core
machine, so that its verdicts do not depend on what else runs; ``loaded`` fakes another.
"""

from __future__ import annotations

import os

import pytest


def loaded(monkeypatch: pytest.MonkeyPatch, *, load: float, cores: int) -> None:
    """Make ``os`` report a 1-minute load average of ``load`` on ``cores`` usable cores."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded(monkeypatch, load=0.0, cores=64)
