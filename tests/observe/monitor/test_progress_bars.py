"""Progress bars that start where a resumed run stood: the count continues from ``initial``
to the total, and the rate counts only the steps done since."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch
from machine import idle_machine  # noqa: F401  (autouse: an idle machine)

from accelfn.observe.monitor import Monitor, progress_bars
from accelfn.observe.monitor.progress_bars import LineBar, make_bar


class Terminal(io.StringIO):
    """A captured stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class Clock:
    """``time.perf_counter`` that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def counts(text: str, desc: str) -> list[tuple[int, int]]:
    """``(n, total)`` of each drawn ``desc ... n/total`` in ``text`` (lines or redraws)."""
    drawn = [re.search(r" (\d+)/(\d+) ", part) for part in re.split(r"[\r\n]", text)
             if part.startswith(desc)]
    return [(int(m.group(1)), int(m.group(2))) for m in drawn if m]


def test_a_line_bar_continues_from_initial_and_rates_the_steps_since(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(progress_bars.time, "perf_counter", clock)
    out = io.StringIO()
    bar = LineBar(20, "train", out, initial=12)
    for _ in range(8):  # 8 steps of 0.5 s: 2 it/s, not (12 + 8) / 4 s = 5 it/s
        clock.now += 0.5
        bar.update()
    bar.close()
    lines = out.getvalue().splitlines()
    # the next 10% mark after 12 of 20 is 14; the last line once, at close
    assert [line.split()[1] for line in lines] == ["14/20", "16/20", "18/20", "20/20"]
    assert "100% 2.0 it/s 4.0s" in lines[-1]
    assert "it/s 1.0s" in lines[0] and " 2.0 it/s" in lines[0]


def test_a_terminal_bar_starts_at_initial(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = Terminal()
    bar = make_bar(48, "train", tty, initial=20)
    for _ in range(28):
        bar.update(1)
    bar.close()
    seen = counts(tty.getvalue(), "train")
    assert seen[0] == (20, 48) and seen[-1] == (48, 48)  # tqdm, from 20 to the total
    assert all(n >= 20 for n, _ in seen)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the built-in bar
    tty = Terminal()
    bar = make_bar(48, "train", tty, initial=20)
    for _ in range(28):
        bar.update(1)
    bar.close()
    assert tty.getvalue().rstrip("\n").split("\r")[-1].startswith("train 48/48 [####")
    assert all(n >= 21 for n, _ in counts(tty.getvalue(), "train"))


def test_initial_outside_zero_to_the_total_is_refused() -> None:
    with pytest.raises(ValueError, match=r"initial=-1: the steps already done"):
        make_bar(10, "train", io.StringIO(), initial=-1)
    with pytest.raises(ValueError, match=r"initial=11: .* from 0 to the total \(10\)"):
        make_bar(10, "train", io.StringIO(), initial=11)
    with pytest.raises(ValueError, match=r"Monitor\(initial=30\): more steps done than total=20"):
        Monitor(total=20, initial=30)
    with pytest.raises(ValueError, match=r"Monitor\(initial=-2\): must be >= 0"):
        Monitor(initial=-2)


def test_a_resumed_monitor_counts_from_the_state_step_to_the_total() -> None:
    class State:  # resumed at update 28 of 48
        step = 28

    out = io.StringIO()
    mon = Monitor(total=48, initial=State.step, state=State(),  # type: ignore[arg-type]
                  file=out, log_every=5, sync_check=None, desc="run", warmup=0)
    with mon:
        for _ in range(20):
            State.step += 1
            mon.step({"loss": torch.tensor(1.0)}, samples=4)
    seen = counts(out.getvalue(), "run")
    # from 28 of 48: a line at each 10% mark still ahead (28.8, 33.6, ...) and 48/48 once
    assert seen == [(29, 48), (34, 48), (39, 48), (44, 48), (48, 48)]
    report = mon.report()
    assert report.steps == 20  # the steps of this process, which its rates are over
    assert [r["step"] for r in mon.rows] == list(range(29, 49))
