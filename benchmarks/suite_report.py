"""Merge the parts of ``benchmarks/gpu_suite.sh`` into its one JSON file.

``gpu_suite.sh`` runs each part with a timeout, writes a line ``name<TAB>rc<TAB>seconds<TAB>
note`` to ``parts.tsv`` in its work directory, and leaves the part's JSON (``<name>.json``),
log (``<name>.log``) and, for the tests, a JUnit XML (``gpu_tests.xml``) there. This script
reads them all and writes one JSON: date, device, machine, every part with its status
(``ok``, ``error``, ``timeout``, ``skipped``), its result or the tail of its log, and a summary
of the headline figures (float8 against bf16, regional against whole-model compile, ResNet-50
images/s and MFU, GPT-2-small tokens/s and MFU, each stage's ratio).

    python benchmarks/suite_report.py --work DIR --out PATH [--dry-run] [--budget S]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _junit(path: Path) -> dict[str, Any] | None:
    """Counts and failing test ids from a pytest JUnit XML file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts[
        "skipped"]
    return {**counts, "failed": failed}


def _status(rc: int, note: str) -> str:
    if note.startswith("skipped"):
        return "skipped"
    if rc in (124, 137):
        return "timeout"
    return "ok" if rc == 0 else "error"


def _stages(result: dict[str, Any], rate: str) -> list[dict[str, Any]]:
    out = []
    for s in result.get("stages", []):
        row: dict[str, Any] = {"stage": s["name"], "status": s.get("status")}
        if s.get("status") == "ok":
            row.update({rate: s.get(rate), "speedup_vs_previous": s.get("speedup_vs_previous"),
                        "speedup_vs_baseline": s.get("speedup_vs_baseline"),
                        "mfu": s.get("mfu"), "peak_memory_mib": s.get("peak_memory_mib")})
        else:
            row["reason"] = s.get("reason")
        out.append(row)
    return out


def summary(parts: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of the parts that produced results."""
    out: dict[str, Any] = {}
    bench = parts.get("bench_resnet50", {}).get("result")
    if bench:
        out["resnet50"] = {
            "images_per_s_by_stage": _stages(bench, "samples_per_s"),
            "single_device_speedup": bench.get("summary", {}).get("single_device_speedup"),
            "seed_v100_single_gpu_speedup": bench.get("summary", {}).get(
                "seed_v100_single_gpu_speedup"),
            "overhead_ratio": (bench.get("overhead") or {}).get("ratio"),
        }
    gpt = parts.get("gpt2", {}).get("result")
    if gpt:
        out["gpt2_small"] = {"tokens_per_s_by_stage": _stages(gpt, "tokens_per_s"),
                             "levers": gpt.get("levers"),
                             "parameters": gpt.get("model", {}).get("parameters")}
    captured = parts.get("captured", {}).get("result")
    if captured:
        out["captured"] = {
            "launch_bound_captured_vs_hand": captured["launch_bound"]["speedup_captured_vs_hand"],
            "launch_bound_captured_vs_eager": captured["launch_bound"][
                "speedup_captured_vs_eager"],
            "gpt2_captured_vs_eager": (captured.get("gpt2") or {}).get(
                "speedup_captured_vs_eager"),
            "max_abs_param_diff": captured["equality"]["max_abs_param_diff"],
            "targets": captured.get("targets"), "met": captured.get("met")}
    float8 = parts.get("float8", {}).get("result")
    if float8:
        out["float8"] = {k: float8.get(k) for k in ("speedup", "target", "meets_target")}
        out["float8"]["parameters"] = float8.get("model", {}).get("parameters")
        out["float8"]["by_width"] = {
            str(w.get("width")): {k: w.get(k) for k in ("speedup", "target", "meets_target")}
            for w in float8.get("widths") or []}
        sweep = float8.get("per_shape") or {}
        if sweep:
            out["float8"]["shapes"] = {k: sweep.get(k) for k in (
                "rule", "rule_converts_but_loses", "rule_leaves_out_but_wins", "measured_boxes")}
    regional = (parts.get("compile", {}).get("result") or {}).get("regional")
    if regional:
        out["regional_compile"] = {
            k: regional.get(k) for k in ("compile_ratio", "steady_ratio", "targets", "met",
                                         "nested_compile_ratio", "nested_steady_ratio")}
    memory_result = parts.get("memory", {}).get("result") or {}
    memory = memory_result.get("estimate")
    if memory:
        out["memory_estimate"] = {k: memory.get(k) for k in ("ratio", "target", "meets_target")}
        for name, anchor in (memory_result.get("estimate_anchors") or {}).items():
            out["memory_estimate"][name] = {k: anchor.get(k) for k in ("ratio", "meets_target")}
    muon = parts.get("sharded_muon", {}).get("result")
    if muon:
        out["sharded_muon"] = {k: muon.get(k) for k in (
            "processes", "ratio_optimizer_step", "target_optimizer_step_ratio", "meets_target")}
    jpeg = (parts.get("data", {}).get("result") or {}).get("jpeg")
    if jpeg:
        out["jpeg_pipeline"] = {
            "images_per_s": {k: (jpeg.get(k) or {}).get("images_per_s")
                             for k in ("dataloader", "accelfn", "decode_only", "read_only")},
            "ratio_accelfn_to_dataloader": jpeg.get("ratio_accelfn_to_dataloader"),
            "targets": jpeg.get("targets")}
    tests = parts.get("gpu_tests", {}).get("result")
    if tests:
        out["gpu_tests"] = {k: tests[k] for k in ("passed", "failures", "errors", "skipped")}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--started", default=None)
    p.add_argument("--seconds", type=float, default=None)
    args = p.parse_args(argv)

    from accelfn.observe.timing import environment

    machine: dict[str, Any]
    try:
        machine = environment()
    except Exception as exc:  # the report must be written whatever broke
        machine = {"error": f"{type(exc).__name__}: {exc}"}
    parts: dict[str, Any] = {}
    tsv = args.work / "parts.tsv"
    lines = tsv.read_text().splitlines() if tsv.exists() else []
    for line in lines:
        name, rc_text, seconds, *rest = line.split("\t")
        note = rest[0] if rest else ""
        rc = int(rc_text)
        entry: dict[str, Any] = {"status": _status(rc, note), "rc": rc,
                                 "seconds": float(seconds)}
        if note:
            entry["note"] = note
        if name == "gpu_tests":
            junit = _junit(args.work / "gpu_tests.xml")
            if junit is not None:
                entry["result"] = junit
            if rc == 5:  # pytest: no tests collected
                entry["status"] = "ok"
                entry["note"] = "no GPU-only tests collected"
        else:
            js = args.work / f"{name}.json"
            if js.exists():
                try:
                    entry["result"] = json.loads(js.read_text())
                except json.JSONDecodeError as exc:
                    entry["status"] = "error"
                    entry["error"] = f"invalid JSON: {exc}"
            elif entry["status"] == "ok":
                entry["status"] = "error"
                entry["error"] = "the part wrote no JSON"
        if entry["status"] in ("error", "timeout"):
            entry["log_tail"] = _tail(args.work / f"{name}.log")
        parts[name] = entry

    # A copy of the tree without git (a snapshot sent to a GPU machine) names its commit in
    # ACCELFN_GIT_COMMIT.
    commit = os.environ.get("ACCELFN_GIT_COMMIT") or None
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                    text=True, check=False,
                                    cwd=Path(__file__).resolve().parents[1]
                                    ).stdout.strip() or None
        except OSError:
            pass
    report = {
        "suite": "benchmarks/gpu_suite.sh",
        "date": args.started or machine.get("date"),
        "device": machine.get("device_name"),
        "dry_run": args.dry_run,
        "git_commit": commit,
        "budget_s": args.budget,
        "seconds": args.seconds,
        "machine": machine,
        "summary": summary(parts),
        "parts": parts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    failed = [n for n, e in parts.items() if e["status"] in ("error", "timeout")]
    print(f"gpu suite: {len(parts)} parts, {len(failed)} failed {failed}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
