"""Console output: plain progress lines outside a terminal, redrawn bars in one, and no
report line about a sync check that was turned off."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch
from machine import idle_machine  # noqa: F401  (autouse: an idle machine)

from accelfn.observe.monitor import Monitor, SyncCheck
from accelfn.observe.monitor.progress_bars import LineBar, is_terminal, make_bar, progress


class Terminal(io.StringIO):
    """A captured stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def lines_of(text: str) -> list[tuple[int, str]]:
    """``(n, line)`` for each progress line (``desc n/total ...``)."""
    return [(int(m.group(1)), line) for line in text.splitlines()
            if (m := re.search(r" (\d+)(?:/\d+)? ", line))]


def test_a_non_terminal_gets_a_plain_line_every_ten_percent_and_the_last_once() -> None:
    out = io.StringIO()
    assert not is_terminal(out)
    mon = Monitor(total=20, file=out, log_every=1, sync_check=None, desc="train")
    with mon:
        for i in range(20):
            mon.step({"loss": torch.tensor(float(i))}, samples=1)
    text = out.getvalue()
    assert "\r" not in text  # tqdm is installed, and still not used here
    got = lines_of(text)
    assert [n for n, _ in got] == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert all(line.startswith(f"train {n}/20 [") for n, line in got)
    last = got[-1][1]
    assert "100%" in last and "loss=19 " in last  # the final loss, read at close
    assert sum("20/20" in line for _, line in got) == 1


def test_a_run_stopped_on_a_mark_does_not_repeat_its_last_line() -> None:
    out = io.StringIO()
    mon = Monitor(total=10, file=out, log_every=1, sync_check=None)
    with mon:
        for i in range(5):  # stops at 50%: written by update, not again by close
            mon.step({"loss": torch.tensor(float(i))}, samples=1)
    assert [n for n, _ in lines_of(out.getvalue())] == [1, 2, 3, 4, 5]


def test_progress_in_a_non_terminal() -> None:
    out = io.StringIO()
    assert list(progress(range(50), desc="work", file=out)) == list(range(50))
    assert [n for n, _ in lines_of(out.getvalue())] == [5, 10, 15, 20, 25, 30, 35, 40, 45, 50]
    out = io.StringIO()
    list(progress(range(8), desc="work", file=out, every=0.5))
    assert [n for n, _ in lines_of(out.getvalue())] == [4, 8]
    with pytest.raises(ValueError, match="every=0"):
        list(progress(range(3), file=out, every=0))


def test_an_unknown_total_writes_a_line_per_interval() -> None:
    out = io.StringIO()
    bar = LineBar(None, "stream", out, interval=0.0)
    for _ in range(3):
        bar.update()
    bar.close()
    bar.close()
    assert [line.split()[:2] for line in out.getvalue().splitlines()] == [
        ["stream", "1"], ["stream", "2"], ["stream", "3"]]
    out = io.StringIO()
    bar = LineBar(None, "stream", out, interval=3600.0)
    for _ in range(3):
        bar.update()
    bar.close()
    assert [line.split()[:2] for line in out.getvalue().splitlines()] == [["stream", "3"]]


def test_a_terminal_gets_a_redrawn_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    tty = Terminal()
    bar = make_bar(4, "train", tty)
    for _ in range(4):
        bar.update(1)
    bar.close()
    assert "\r" in tty.getvalue()  # tqdm redraws its line
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the built-in bar
    tty = Terminal()
    assert list(progress(range(5), desc="work", file=tty)) == [0, 1, 2, 3, 4]
    assert "\rwork 5/5 [####################] 100%" in tty.getvalue()
    assert tty.getvalue().count("\n") == 1  # one line, redrawn


def test_no_report_line_about_a_sync_check_turned_off() -> None:
    def report(**kw: object) -> str:
        mon = Monitor(progress=False, warmup=0, **kw)  # type: ignore[arg-type]
        with mon:
            for _ in range(4):
                mon.step({"loss": torch.tensor(1.0)}, samples=1)
        r = mon.report()
        assert (r.syncs is None) and r.verdict.startswith("compute-bound")
        return str(r)

    off = report(sync_check=None)
    assert "host_syncs" not in off and "probed" not in off
    # asked for, but the loop gave no step to probe (no iterate/measure): say how
    on = report(sync_check=SyncCheck(step=1))
    assert "[INFO   ] host_syncs: no step was probed for host syncs" in on
