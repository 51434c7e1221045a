"""The ``accelfn`` command itself: help, version, and the console script installed for it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import accelfn
from accelfn.cli.main import COMMANDS, build_parser, main


def test_bare_command_prints_help_and_succeeds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: accelfn") and err == ""
    for command in ("doctor", "bench"):
        assert command in out
    assert "--version" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"accelfn {accelfn.__version__}"


@pytest.mark.slow
def test_module_entry_point_runs_the_same_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "accelfn", "--version"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"accelfn {accelfn.__version__}"
    # `python -m accelfn` alone is main() on an empty command line: the usage that
    # test_bare_command_prints_help_and_succeeds checks (a second process would repeat it)


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["nope"])
    assert exit_.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_every_listed_command_has_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert len(sub.choices) == len(COMMANDS)  # type: ignore[arg-type]
    for name, p in sub.choices.items():  # type: ignore[union-attr]
        assert p.description, name


@pytest.mark.parametrize("value", ["-3", "abc"])
def test_doctor_refuses_a_bad_worker_count(value: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["doctor", "--num-workers", value])
    assert exit_.value.code == 2
    assert "argument --num-workers:" in capsys.readouterr().err


def test_doctor_names_oversubscription_and_its_fix(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import os

    import torch

    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))  # a busy 2-core machine
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert main(["doctor"]) == 0  # a warning, not an error
    out = capsys.readouterr().out
    assert "[WARNING] threads: oversubscribed: 2 torch threads on 1 free core(s)" in out
    assert "fix: OMP_NUM_THREADS=1 in the environment" in out


_CASE = '''
import torch
import accelfn as af

def loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])

def memory_case():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    state = af.TrainState(model, torch.optim.AdamW(model.parameters()))
    batch = {"x": torch.randn(16, 32), "y": torch.randint(0, 10, (16,))}
    return af.with_accumulation(2)(loss), state, batch

if __name__ == "__main__":
    raise SystemExit("trained")
'''


def test_doctor_memory_estimates_a_scripts_update_without_training(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from accelfn.observe.memory import estimate_script, format_estimate

    script = tmp_path / "train.py"
    script.write_text(_CASE)
    main(["doctor", "--memory", str(script)])
    printed = capsys.readouterr().out
    assert format_estimate(estimate_script(script)) in printed  # the estimate's own line
    assert "memory: peak" in printed and "optimizer state" in printed
    (tmp_path / "none.py").write_text("x = 1\n")
    assert main(["doctor", "--memory", str(tmp_path / "none.py")]) == 2
    assert "defines no memory_case()" in capsys.readouterr().err
    assert main(["doctor", "--memory", str(tmp_path / "missing.py")]) == 2


def test_doctor_memory_runs_a_script_importing_its_siblings_and_prints_one_json(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    # the examples import a module beside them, as `python SCRIPT` allows; --json prints
    # one JSON object, the estimate under "memory"; a script that fails is said, exit 2
    import json

    (tmp_path / "sibling_options.py").write_text("HIDDEN = 64\n")
    script = tmp_path / "train.py"
    script.write_text("import sibling_options\n" + _CASE)
    main(["doctor", "--json", "--memory", str(script)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["memory"]["peak"] > 0 and "findings" in printed and "ok" in printed
    assert str(tmp_path) not in sys.path  # the path is put back
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    assert main(["doctor", "--memory", str(broken)]) == 2
    assert "ModuleNotFoundError" in capsys.readouterr().err
