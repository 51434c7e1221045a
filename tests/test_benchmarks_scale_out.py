"""benchmarks/scale_out.py: its options, its refusal of unknown sides before any launch, and a
tiny-model launch of 4 gloo processes whose measured state matches the HSDP formula."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scale_out.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scale_out_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_names_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _load().main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for option in ("--out", "--steps", "--warmup", "--batch-size", "--sides", "--tiny"):
        assert option in text
    assert "--worker" not in text  # the launcher's own option stays hidden


def test_an_unknown_side_is_refused_before_anything_is_launched(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    module = _load()

    def no_launch(*args: object) -> None:
        raise AssertionError("launched")

    monkeypatch.setattr(module, "launch", no_launch)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--sides", "ddp,zero3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown side(s) ['zero3']" in err and "plain_fsdp" in err
    with pytest.raises(SystemExit):
        module.main(["--warmup", "0"])
    assert "--warmup must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tiny_hsdp_launch_reports_the_state_the_formula_predicts(tmp_path: Path) -> None:
    out = tmp_path / "scale-out.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--sides", "hsdp", "--steps", "2",
         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (side,) = result["sides"]
    assert side["status"] == "ok" and side["side"] == "hsdp" and side["world"] == 4
    # the tiny GPT counted by hand: embeddings, 2 blocks of 12d^2 + 13d, the final LayerNorm
    d, vocab, seq, layers = 32, 256, 16, 2
    n = vocab * d + seq * d + layers * (12 * d * d + 13 * d) + 2 * d
    assert side["parameters"] == result["model"]["parameters"] == n
    # 2 replicas each sharded over 2 processes: 16 bytes per parameter * 2 / 4, plus AdamW's
    # step counters (one 4-byte scalar per parameter tensor: 28 of them)
    expected = 16 * n * 2 / 4 + 28 * 4
    states = [r["state_mib"] * 2**20 for r in side["per_rank"]]
    assert len(states) == 4
    for state in states:
        assert state == pytest.approx(expected, rel=1e-3)
    assert len(side["step_ms_all"]) == 2 and side["step_ms"] > 0
    assert side["peak_rss_steps_mib"] >= side["base_rss_mib"] > 0
    assert side["ru_maxrss_mib"] >= side["peak_rss_steps_mib"]
    assert result["step_time_ratios"] == {}  # no ddp side to compare with
    assert result["machine"]["load_average"] and result["machine"]["torch"]
    # the results page renders it: one row per side, with the formula it is held against
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render_results
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    page = render_results.render([out])
    assert "### Scale-out memory: GPT of 0.0M parameters on 4 CPU processes" in page
    # one row in the step-time table, one in the memory table
    timing, memory = [line for line in page.splitlines() if line.startswith("| `hsdp` |")]
    assert 'af.distributed(strategy="hsdp", replicate=2)' in timing and "(`16N*R/W`)" in memory
