"""accelfn bench and the GPU suite's dry run: they run, and their JSON holds every figure.

Benchmarks measure; nothing here asserts a timing or a speedup.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from accelfn.cli import bench
from accelfn.cli.main import main
from accelfn.observe.timing import SavedActivations

ROOT = Path(__file__).resolve().parents[2]


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


BUSY_LOAD = (os.cpu_count() or 1) + 1.5  # the load average the quick run is given


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """``accelfn bench --quick`` with its default outputs, in an empty folder, on a machine
    whose load average exceeds its cores; returns the folder, stdout and stderr."""
    tmp = tmp_path_factory.mktemp("bench")
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        mp.setattr(os, "getloadavg", lambda: (BUSY_LOAD, 1.0, 1.0))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["bench", "--quick", "--steps", "3", "--overhead-steps", "6"])
    assert code == 0, err.getvalue()[-3000:]
    return tmp, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick(quick_run: tuple[Path, str, str]) -> tuple[dict, Path, str]:
    tmp = quick_run[0]
    result = json.loads((tmp / "runs" / "bench" / "bench.json").read_text())
    return result, tmp / "runs" / "bench" / "bench.png", bench.format_table(result)


def test_quick_writes_the_json_and_png_it_prints(quick_run: tuple[Path, str, str]) -> None:
    tmp, out, _ = quick_run
    assert "JSON: runs/bench/bench.json" in out.splitlines()
    assert json.loads((tmp / "runs" / "bench" / "bench.json").read_text())["complete"] is True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp / "runs" / "bench" / "bench.png").exists()
    else:
        assert "plot: runs/bench/bench.png" in out.splitlines()


def test_quick_warns_when_the_load_exceeds_the_cores(quick_run: tuple[Path, str, str],
                                                    quick: tuple[dict, Path, str]) -> None:
    _, out, err = quick_run
    cores = os.cpu_count()
    said = f"the load average ({BUSY_LOAD:.2f} over the last minute) exceeds the {cores} CPU cores"
    assert said in err.splitlines()[0]  # before anything is measured
    assert any(line.startswith("warning: ") and said in line for line in out.splitlines())
    result = quick[0]
    assert len(result["warnings"]) == 1 and said in result["warnings"][0]
    assert "--repeats" in result["warnings"][0]  # and how to get steadier figures


def test_quick_runs_on_its_share_of_the_free_cores(quick: tuple[dict, Path, str]) -> None:
    result = quick[0]
    assert result["config"]["threads"] == 1  # the load exceeds the cores: one thread
    assert "--threads 1" in result["command"]


def test_threads_are_given_or_the_free_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert bench.BenchConfig(device="cpu").resolved().threads == 8
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 6.0, 6.0))  # six cores busy elsewhere
    assert bench.BenchConfig(device="cpu").resolved().threads == 2
    assert bench.BenchConfig(device="cpu", threads=3).resolved().threads == 3


def test_no_load_warning_on_an_idle_machine() -> None:
    assert bench.busy_machine_warning(1.9, 2) is None
    assert bench.busy_machine_warning(2.0, 2) is None
    assert "exceeds the 2 CPU cores" in (bench.busy_machine_warning(2.01, 2) or "")
    assert bench.busy_machine_warning(3.0, 0) is None  # cores unknown: nothing to compare


def test_output_options(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.add_bench(parser.add_subparsers())
    args = parser.parse_args(["bench", "--out", str(tmp_path / "o"), "--no-plot"])
    assert (args.out, args.json, args.plot) == (str(tmp_path / "o"), None, "")
    args = parser.parse_args(["bench", "--json", "-", "--plot", "x.png"])
    assert (args.out, args.json, args.plot) == ("runs/bench", "-", "x.png")


def test_the_png_goes_next_to_a_json_given_elsewhere(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "small.json"
    code = main(["bench", "--quick", "--device", "cpu", "--stages", "baseline,accelfn_data",
                 "--steps", "1", "--warmup", "1", "--batch-size", "8", "--samples", "16",
                 "--overhead-steps", "0", "--json", str(out)])
    assert code == 0
    assert [s["status"] for s in json.loads(out.read_text())["stages"]
            if s["name"] in ("baseline", "accelfn_data")] == ["ok", "ok"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not out.with_suffix(".png").exists()
    else:
        assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_quick_has_every_stage_with_numbers(quick: tuple[dict, Path, str]) -> None:
    result, _, _ = quick
    names = [s["name"] for s in result["stages"]]
    assert names == [s.name for s in bench.STAGES]
    by_name = {s["name"]: s for s in result["stages"]}
    for name in ("baseline", "dataloader_tuned", "accelfn_data", "amp", "channels_last"):
        s = by_name[name]
        assert s["status"] == "ok", s
        for key in ("samples_per_s", "step_ms", "first_step_s", "speedup_vs_baseline",
                    "activation_mib", "state_mib", "model_tflops_per_s"):
            assert _number(s[key]) and s[key] > 0, (name, key, s[key])
        assert s["speedup_vs_previous"] is None if name == "baseline" else _number(
            s["speedup_vs_previous"])
    assert by_name["baseline"]["speedup_vs_baseline"] == 1.0
    assert by_name["baseline"]["stack"] == "hand-written loop"
    assert "with_amp" in by_name["amp"]["stack"]
    # compile is left out by --quick, saying how to include it; later stages run without it
    assert by_name["compiled"]["status"] == "skipped"
    assert "--compile" in by_name["compiled"]["reason"]
    assert by_name["channels_last"]["techniques"]["compile"] is False
    # one CPU: DDP is skipped with the reason
    if not torch.cuda.is_available():
        assert by_name["ddp"]["status"] == "skipped"
        assert "GPU" in by_name["ddp"]["reason"]
    # the seeds' ratios sit next to the measured ones
    assert by_name["amp"]["seed_v100"]["speedup_vs_previous"] == pytest.approx(542 / 387, 1e-3)


def test_quick_measures_overhead_and_the_machine(quick: tuple[dict, Path, str]) -> None:
    result, _, _ = quick
    o = result["overhead"]
    for key in ("hand_written_step_ms", "accelfn_step_ms", "accelfn_guard_off_step_ms",
                "ratio", "ratio_guard_off", "added_us_per_step"):
        assert _number(o[key]), key
    assert o["parameters_equal_guard_off"] is True  # same maths as the hand-written loop
    assert result["machine"]["torch"] == torch.__version__
    assert result["machine"]["date"]
    assert result["command"].startswith("accelfn bench --quick")
    assert _number(result["summary"]["single_device_speedup"])


def test_quick_prints_a_table_and_plots(quick: tuple[dict, Path, str]) -> None:
    _, plot, table = quick
    for s in bench.STAGES:
        assert s.name in table
    assert "overhead" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not plot.exists()
    else:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_saved_activations_counts_what_autograd_keeps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    x = torch.randn(32, 64)
    with SavedActivations(model) as fp32:
        model(x).sum().backward()
    with SavedActivations(model) as bf16, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).sum().backward()
    # fp32 keeps the input and the hidden activation (relu output), not the weights
    assert fp32.bytes >= (32 * 64 + 32 * 256) * 4
    assert 0 < bf16.bytes < fp32.bytes


def test_bad_arguments_say_how_to_fix() -> None:
    with pytest.raises(ValueError, match="--stages"):
        bench.BenchConfig(stages=("nope",), device="cpu").resolved()
    with pytest.raises(ValueError, match="--samples"):
        bench.BenchConfig(quick=True, samples=4, device="cpu").resolved()
    assert main(["bench", "--quick", "--device", "cpu", "--warmup", "0"]) == 2


BAD_BENCH_ARGUMENTS = [  # each refused before anything runs, with what to pass
    (["--device", "bogus"], "--device 'bogus' is unknown; use auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], "--device 'cuda:x' is not understood"),
    (["--workers", "-1"], "--workers must be >= 0"),
    (["--overhead-steps", "-5"], "--overhead-steps must be >= 0"),
    (["--ddp-procs", "0"], "--ddp-procs must be >= 1"),
    (["--threads", "0"], "--threads 0: must be >= 1"),
    (["--ddp-procs", "-2"], "--ddp-procs must be >= 1"),
    (["--stages", ","], "--stages names no stage"),
    (["--stages="], "--stages names no stage"),
    (["--compile", "--compile-mode", "bogus"], "--compile-mode 'bogus' is unknown; use one of"),
]


@pytest.mark.parametrize(("args", "message"), BAD_BENCH_ARGUMENTS,
                         ids=[" ".join(a) for a, _ in BAD_BENCH_ARGUMENTS])
def test_bad_arguments_are_usage_errors(args: list[str], message: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_stage_runs_under_torchrun_on_two_cpu_processes(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    code = main(["bench", "--quick", "--device", "cpu", "--stages", "ddp", "--ddp-procs", "2",
                 "--steps", "2", "--warmup", "1", "--batch-size", "8", "--overhead-steps", "0",
                 "--json", str(out)])
    assert code == 0
    ddp = {s["name"]: s for s in json.loads(out.read_text())["stages"]}["ddp"]
    assert ddp["status"] == "ok", ddp
    assert ddp["world_size"] == 2 and ddp["processes"] == 2
    assert _number(ddp["samples_per_s"]) and "distributed" in ddp["stack"]


GPU_SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_suite_parses_and_its_cheap_parts_dry_run(tmp_path: Path) -> None:
    """The suite's script in seconds: its syntax, the parts its header lists are the parts it
    runs, and a dry run of two parts writes the report (the full dry run: gpu_suite marker)."""
    syntax = subprocess.run(["bash", "-n", str(GPU_SUITE)], capture_output=True, text=True,
                            check=False)
    assert syntax.returncode == 0, syntax.stderr
    script = GPU_SUITE.read_text()
    header = script.split("# Usage:")[0]
    listed = [m.group(1) for m in re.finditer(r"^#   (\w+) {2,}\S", header, re.M)]
    run = list(dict.fromkeys(re.findall(r"^\s*run_part (\w+) ", script, re.M)))
    assert listed == run == ["environment", "gpt2", "captured", "float8", "memory",
                             "gpu_tests", "bench_resnet50", "transforms", "data",
                             "sharded_muon", "compile"]
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(GPU_SUITE), "--dry-run", "--only", "environment,data", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["date"] and result["device"]
    assert list(result["parts"]) == ["environment", "data"]
    for name, part in result["parts"].items():
        assert part["status"] == "ok" and part["result"], (name, part)


@pytest.mark.slow
@pytest.mark.gpu_suite
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_suite_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(GPU_SUITE), "--dry-run", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True
    assert result["date"] and result["device"]
    parts = result["parts"]
    names = ["environment", "gpt2", "captured", "float8", "memory", "gpu_tests",
             "bench_resnet50", "transforms", "data", "sharded_muon", "compile"]
    assert list(parts) == names  # the figures only a GPU gives come first
    for name in names:
        assert parts[name]["status"] == "ok", (name, parts[name])
    assert [s["name"] for s in parts["float8"]["result"]["sides"]] == ["bf16", "float8"]
    assert parts["captured"]["result"]["equality"]["bitwise"]  # the tape on the CPU
    assert summary_has_captured(result)
    estimate = parts["memory"]["result"]["estimate"]
    assert estimate["meets_target"] and _number(estimate["ratio"])
    anchors = parts["memory"]["result"]["estimate_anchors"]
    assert all(anchors[name]["meets_target"] for name in ("gpt2_small", "resnet50"))
    regional = parts["compile"]["result"]["regional"]
    assert regional["whole"]["graphs"] == regional["regional"]["graphs"] == 1
    assert regional["nested"]["graphs"] == 1
    assert _number(regional["compile_ratio"]) and _number(regional["steady_ratio"])
    assert _number(regional["nested_compile_ratio"]) and _number(regional["nested_steady_ratio"])
    depth = parts["compile"]["result"]["depth"]
    assert depth["depths"] == [2, 3] and set(depth["fit"]) == {"whole", "regional", "nested"}
    # every stage ran (compile with the 'eager' backend), DDP skipped with its reason
    stages = {s["name"]: s for s in parts["bench_resnet50"]["result"]["stages"]}
    assert all(s["status"] == "ok" for n, s in stages.items() if n != "ddp"), stages
    assert {s["name"]: s["status"] for s in parts["gpt2"]["result"]["stages"]} == {
        **dict.fromkeys(("baseline", "accelfn_fp32", "amp", "compiled", "checkpointed",
                         "chunked_ce", "batch", "hand"), "ok"),
        "sdpa": "skipped"}  # no attention backend to choose on the CPU
    assert parts["gpt2"]["result"]["levers"]["batch_size"] == 8
    assert parts["sharded_muon"]["result"]["processes"] == 2
    transforms = parts["transforms"]["result"]
    for section in ("amp", "accumulation", "checkpoint"):
        assert transforms[section]["sides"], section
    assert _number(transforms["compile"]["compile_s_cold"])
    summary = result["summary"]
    assert summary["resnet50"]["images_per_s_by_stage"]
    assert summary["gpt2_small"]["tokens_per_s_by_stage"]
    assert _number(summary["float8"]["speedup"]) and summary["float8"]["target"] == 1.2
    assert summary["regional_compile"]["targets"]["compile_ratio"] == "<= 0.5"


def summary_has_captured(result: dict) -> bool:
    captured = result["summary"]["captured"]
    return (_number(captured["launch_bound_captured_vs_hand"])
            and captured["max_abs_param_diff"] == 0.0 and captured["met"]["max_abs_param_diff"])


def test_saved_activations_peak_is_one_micro_batch_under_accumulation() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    x = torch.randn(32, 64)
    with SavedActivations(model) as whole:
        model(x).sum().backward()
    with SavedActivations(model) as micro:
        for part in x.chunk(4):
            model(part.clone()).sum().backward()
    assert micro.bytes * 4 == pytest.approx(whole.bytes, rel=0.05)


def _render(path: Path) -> str:
    """docs/results.md's text for the JSON at ``path`` (benchmarks/render_results.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render_results
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return str(render_results.render([path]))


def test_results_page_renders_the_bench_json(quick: tuple[dict, Path, str],
                                             tmp_path: Path) -> None:
    result, _, _ = quick
    path = tmp_path / "cpu-bench.json"
    path.write_text(json.dumps(result))
    page = _render(path)
    assert page.startswith("# Benchmark results")
    for s in bench.STAGES:
        assert f"`{s.name}`" in page
    assert result["command"] in page


def test_readme_says_what_bench_writes() -> None:
    readme = (ROOT / "README.md").read_text()
    quick = next(line for line in readme.splitlines() if line.startswith("accelfn bench --quick"))
    for name in ("bench.json", "bench.png"):
        assert f"{bench.DEFAULT_OUT}/{name}" in quick
    assert "load average" in readme and "--repeats" in readme


def test_results_page_renders_overhead_times_and_instructions(tmp_path: Path) -> None:
    side = {"ratio": 1.05, "added_us": 100.0, "step_us": 2100.0}
    config = {"model": "MLP 32-64-64-10", "batch": 64, "micro_batches": 4, "precision": "fp32",
              "plain_step_us": 2000.0, "same_features": side,
              "accelfn": {**side, "ratio_quartiles": [1.04, 1.06]},
              "plain_again": {**side, "ratio": 0.998}, "accelfn_vs_same_features": 1.0,
              "parameters_bitwise_equal_to_plain": True}
    counted = {"model": "MLP 32-64-64-10", "batch": 64, "precision": "fp32",
               "updates_counted": 50, "accelfn_ratio": 1.0391, "same_features_ratio": 1.0802,
               "accelfn_added": 269068, "same_features_added": 547785,
               "instructions_per_update": {"plain": 6888636, "accelfn": 7157705,
                                           "same_features": 7436422}}
    result = {"benchmark": "overhead", "baseline": "plain", "accelfn": "stack", "timing": "t",
              "date": "2026-12-01 00:00 UTC", "machine": "x86_64, 2 cores",
              "load_average": [1.0] * 6, "targets": {"tiny": 1.03, "medium": 1.01},
              "configs": [config], "instructions": [counted],
              "operators": [{"model": "MLP 32-64-64-10", "batch": 64, "precision": "fp32",
                             "operators_per_update": {"plain": 262.0, "accelfn": 266.0,
                                                      "same_features": 286.0},
                             "accelfn_ratio": 1.0153, "same_features_ratio": 1.0916,
                             "accelfn_differs_from_plain": {"stack": [1.0, 2.0]}}]}
    path = tmp_path / "cpu-overhead.json"
    path.write_text(json.dumps(result))
    page = _render(path)
    assert ("| MLP 32-64-64-10, batch 64 | fp32 | 2,000 | 1.050 (1.040-1.060) | 1.050 | not run "
            "| not run | 0.998 | 100 |") in page
    assert "| MLP 32-64-64-10, batch 64 | fp32 | 6,888,636 | 1.039 | 1.080 | 269,068 |" in page
    assert "| MLP 32-64-64-10, batch 64 | fp32 | 262 | 1.015 | 1.092 | stack 1/2 |" in page
    del result["instructions"]
    path.write_text(json.dumps(result))
    assert "callgrind" not in _render(path)
