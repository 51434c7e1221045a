"""benchmarks/captured.py's dry run: its three sides and its equality check run on the CPU
(the tape records and replays), and the suite's report renders its figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import captured
import render_results


def test_the_dry_run_measures_every_side_and_finds_the_replay_bitwise(tmp_path):
    out = tmp_path / "captured.json"
    assert captured.main(["--dry-run", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["environment"]["device"] == "cpu"
    assert result["equality"]["bitwise"] and result["met"]["max_abs_param_diff"]
    launch = result["launch_bound"]
    assert set(launch["ms_per_update"]) == {"hand", "eager", "captured"}
    assert launch["speedup_captured_vs_eager"] > 0 and launch["speedup_captured_vs_hand"] > 0
    assert result["targets"]["launch_bound_captured_vs_hand"] == ">= 1.3"
    assert result["met"]["gpt2_captured_vs_eager"] is None  # not run in a dry run
    rows = render_results.headline({"captured": {"result": result}})
    assert [row[0].split(",")[0] for row in rows] == [
        "captured / hand-written loop", "same", "captured against eager"]
    assert rows[-1][1:] == ["0.0e+00", "<= 1e-6", "yes"]


def test_a_failing_section_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    """One GPU slot is not lost to one failure: the error is in the figures, written after
    each section, and the benchmark exits 1."""
    def broken(*args, **kwargs):
        raise RuntimeError("no recording")

    monkeypatch.setattr(captured, "equality", broken)
    out = tmp_path / "captured.json"
    assert captured.main(["--dry-run", "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert result["equality"] == {"error": "RuntimeError: no recording"}
    assert set(result["launch_bound"]["ms_per_update"]) == {"hand", "eager", "captured"}
    assert result["met"]["max_abs_param_diff"] is None
