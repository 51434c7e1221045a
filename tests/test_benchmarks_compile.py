"""benchmarks/compile.py: its depth section's line fits and the command lines it refuses.

Its own module (not tests/cli/test_bench.py, whose tests share the quick bench run and so go
to one pytest-xdist worker together): the depth sweep's fresh processes run on the other
worker beside them.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
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


@pytest.mark.slow
def test_compile_benchmark_depth_section_fits_a_line_per_side(tmp_path: Path) -> None:
    # the depth sweep checked with the 'eager' backend (its times are not compile times)
    out = tmp_path / "cpu-compile-depth.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile.py"), "--quick", "--backend",
         "eager", "--only", "depth", "--depths", "2,4", "--steps", "2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    depth = json.loads(out.read_text())["depth"]
    assert depth["depths"] == [2, 4]
    for side in ("whole", "regional", "nested"):
        times = depth[f"{side}_compile_s"]
        fit = depth["fit"][side]
        slope = (times[1] - times[0]) / 2  # two points: the line passes through both
        assert fit["s_per_block"] == pytest.approx(slope, abs=1e-3)
        assert fit["intercept_s"] == pytest.approx(times[0] - 2 * slope, abs=1e-3)
    assert "(2 blocks)" in proc.stderr and "(4 blocks)" in proc.stderr
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
