"""benchmarks/compile.py: its depth section's line fits and the command lines it refuses."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _render(path: Path) -> str:
    """docs/results.md's text for the JSON at ``path`` (benchmarks/render_results.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render_results
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return str(render_results.render([path]))


# what each side's cold compile costs in the stand-in below: seconds at no block, per block
COSTS = {"whole": (4.0, 1.5), "regional": (4.5, 0.25), "nested": (5.0, 0.5)}


def test_compile_benchmark_depth_section_fits_a_line_per_side(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The depth section's sweep, line fits, JSON and rendered section, in this process: each
    fresh process's cold compile is replaced by its known cost (the fresh processes run in
    the GPU suite's dry run, ``make test-gpu-suite``)."""
    bench = _compile_benchmark()
    probed = []

    def probe(args, kind, cache_file, log, machine=None, first_only=False, layers=None):
        probed.append((kind, layers))
        if kind == "prepare":  # the machine the others copy
            Path(machine).mkdir()
            return {}
        base, per_block = COSTS[kind]
        return {"compile_s": base + per_block * layers}

    monkeypatch.setattr(bench, "_run_probe", probe)
    out = tmp_path / "cpu-compile-depth.json"
    assert bench.main(["--quick", "--backend", "eager", "--only", "depth", "--depths", "2,4",
                       "--json", str(out)]) == 0
    assert probed == [("prepare", None)] + [(side, d) for d in (2, 4) for side in COSTS]
    depth = json.loads(out.read_text())["depth"]
    assert depth["depths"] == [2, 4]
    for side, (base, per_block) in COSTS.items():
        assert depth[f"{side}_compile_s"] == [base + 2 * per_block, base + 4 * per_block]
        assert depth["fit"][side]["s_per_block"] == pytest.approx(per_block, abs=1e-3)
        assert depth["fit"][side]["intercept_s"] == pytest.approx(base, abs=1e-3)
    assert depth["per_block_ratio"] == pytest.approx(0.25 / 1.5, abs=1e-3)
    page = _render(out)
    assert "### Compile time against depth" in page and "| each block adds |" in page
    assert "regional / whole-model cold compile time" not in page  # no ratios section ran


def _compile_benchmark() -> Any:
    """benchmarks/compile.py as a module (its ``main`` parses the command line), imported
    without leaving its folders on ``sys.path``."""
    path = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(
            "accelfn_benchmark_compile", ROOT / "benchmarks" / "compile.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


@pytest.mark.parametrize("depths", ["12", "12,12", "12,1", "6,x"])
def test_compile_benchmark_refuses_depths_it_cannot_fit(
        depths: str, capsys: pytest.CaptureFixture[str]) -> None:
    # the command line is refused before anything runs: in this process (argparse's exit 2)
    with pytest.raises(SystemExit) as refused:
        _compile_benchmark().main(["--only", "depth", "--depths", depths])
    assert refused.value.code == 2
    assert "at least two different numbers of blocks, each at least 2" in capsys.readouterr().err
