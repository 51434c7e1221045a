"""accelfn's logging: records through the ``logging`` module (captured with caplog), nothing
printed unless configured, rank 0 only by default, warnings kept as warnings, and the
monitor's progress bar still its own console output."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from machine import idle_machine  # noqa: F401  (autouse: an idle machine)

from accelfn.observe import logs
from accelfn.observe.logs import configure_logging, get_logger
from accelfn.observe.monitor import Monitor

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    yield
    root = logging.getLogger("accelfn")
    if logs._HANDLER is not None:
        root.removeHandler(logs._HANDLER)
        logs._HANDLER = None
    logs._FILTER.all_ranks = False
    root.setLevel(logging.NOTSET)


def run(**kw: object) -> Monitor:
    mon = Monitor(sync_check=None, warmup=0, log_every=2, **kw)  # type: ignore[arg-type]
    with mon:
        for i in range(3):
            mon.step({"loss": torch.tensor(float(i))}, samples=4)
    return mon


def test_the_monitor_logs_to_its_package_logger(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="accelfn")
    mon = run(progress=False)
    records = [r for r in caplog.records if r.name == "accelfn.observe"]
    messages = [r.getMessage() for r in records]
    assert messages == ["monitor: rows from step 1 to no sink",
                        f"monitor: {mon.report().verdict}"]
    assert all(r.levelno == logging.INFO and r.rank == 0 for r in records)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_nothing_is_printed_unless_logging_is_configured() -> None:
    # one fresh process: the run before logging is configured, a line on stdout, then the
    # same run after logging.basicConfig (what was printed before the line came from the first)
    code = (
        "import logging, sys, torch\n"
        "from accelfn.observe.monitor import Monitor\n"
        "def run():\n"
        "    mon = Monitor(progress=False, sync_check=None)\n"
        "    with mon:\n"
        "        mon.step({'loss': torch.tensor(1.0)})\n"
        "    logging.getLogger('accelfn.observe').warning('a warning record')\n"
        "    sys.stdout.flush(); sys.stderr.flush()\n"
        "run()\n"
        "print('configured', flush=True)\n"
        "sys.stderr.write('configured\\n'); sys.stderr.flush()\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "run()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=True)
    quiet_out, _, _ = proc.stdout.partition("configured\n")
    quiet_err, marked, configured = proc.stderr.partition("configured\n")
    assert (quiet_out, quiet_err) == ("", "") and marked
    assert "INFO:accelfn.observe:monitor: rows from step 1" in configured
    assert "WARNING:accelfn.observe:a warning record" in configured


def test_other_ranks_are_silent_unless_all_ranks(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="accelfn")
    monkeypatch.setenv("RANK", "1")  # as torchrun sets it, before init_process_group
    get_logger("checkpointing").info("saved")
    run(progress=False)
    assert [r for r in caplog.records if r.name.startswith("accelfn")] == []
    stream = io.StringIO()
    configure_logging("INFO", all_ranks=True, stream=stream)
    get_logger("checkpointing").info("saved")
    assert "accelfn.checkpointing [rank 1] INFO: saved" in stream.getvalue()
    assert [r.getMessage() for r in caplog.records] == ["saved"]


def test_configure_logging_adds_one_handler_at_its_level() -> None:
    stream = io.StringIO()
    configure_logging("WARNING", stream=stream)
    handler = configure_logging(logging.WARNING, stream=stream)  # replaces, never doubles
    assert logging.getLogger("accelfn").handlers.count(handler) == 1
    assert sum(isinstance(h, logging.StreamHandler)
               for h in logging.getLogger("accelfn").handlers) == 1
    get_logger("observe").info("not shown")
    get_logger("observe").warning("shown")
    assert stream.getvalue().count("\n") == 1 and "accelfn.observe WARNING: shown" in \
        stream.getvalue()
    with pytest.raises(ValueError, match=r"level='LOUD'\): not a logging level"):
        configure_logging("LOUD")


def test_warnings_stay_warnings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="accelfn")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.warns(UserWarning, match=r"needs matplotlib.*no plot written"):
        run(progress=False, plot=tmp_path / "run.png")
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_the_progress_bar_is_the_monitors_own_output(caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    run(progress=True, total=3, file=out)  # logging left unconfigured
    assert out.getvalue().splitlines()[-1].startswith("train 3/3")
    assert not [r for r in caplog.records if "3/3" in r.getMessage()]
