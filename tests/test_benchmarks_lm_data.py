"""The results page's language-model data section, rendered from benchmarks/lm_data.py's
JSON: the loader ratio and the padded-against-packed training table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import render_results  # noqa: E402


def test_the_training_table_shows_each_arm_from_the_json(tmp_path):
    result = json.loads((ROOT / "benchmarks" / "results" / "cpu-lm-data.json").read_text())
    training = result["training"]
    page = render_results.render([ROOT / "benchmarks" / "results" / "cpu-lm-data.json"])
    assert f"**x{result['token_loader_vs_np_memmap']['ratio']}**" in page
    for arm in ("pad", "best_fit_same_updates", "best_fit_same_rows"):
        row = next(line for line in page.splitlines()
                   if f"`{training['options'][arm]}`" in line)
        assert f"| {training[arm]['updates']} |" in row
        assert f"{training[arm]['val_loss']['mean']} ({training[arm]['val_loss']['stdev']})" in row
    del result["training"]  # a run of the loader part only: no table
    only = tmp_path / "cpu-lm-data.json"
    only.write_text(json.dumps(result))
    assert "minus padded" not in render_results.render([only])
