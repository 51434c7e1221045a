"""Render benchmark JSON files as the Markdown results page (``docs/results.md``).

Every figure on the page comes from the JSON files given, each written by ``accelfn bench``,
``benchmarks/transforms.py``, ``benchmarks/gpt2.py``, ``benchmarks/overhead.py``,
``benchmarks/scale_out.py``, ``benchmarks/sharded_muon.py`` or
``benchmarks/gpu_suite.sh``; the page
says which file, machine, date and command each table comes from.

    python benchmarks/render_results.py benchmarks/results/*.json > docs/results.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _f(x: Any, spec: str = ",.1f", suffix: str = "") -> str:
    if x is None or isinstance(x, (str, bool)):
        return "-" if x is None else str(x)
    return f"{x:{spec}}{suffix}"


def _x(x: Any) -> str:
    return "-" if x is None else f"x{x:.2f}"


def _machine(m: dict[str, Any]) -> str:
    load = m.get("load_average")
    end = m.get("load_average_end")
    parts = [f"{m.get('device_name')} (`{m.get('device')}`)"]
    if m.get("device", "cpu") != "cpu":
        parts.append(f"CUDA {m.get('cuda')}, {m.get('device_count')} GPU(s)")
    parts += [f"{m.get('cpu_cores')} CPU cores", f"torch {m.get('torch')}",
              f"Python {m.get('python')}"]
    if load:
        parts.append(f"load average {load[0]} at the start"
                     + (f", {end[0]} at the end" if end else ""))
    return ", ".join(parts)


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def bench(r: dict[str, Any], name: str) -> str:
    c = r["config"]
    out = [f"### `accelfn bench`: {c['model']}, {c['image_size']} px, batch {c['batch_size']}",
           "",
           f"File `{name}`, {r['machine']['date']}. Machine: {_machine(r['machine'])}.",
           "",
           f"Command: `{r['command']}` ({c['steps']} timed steps after {c['warmup']} warm-up "
           f"steps per stage, {c.get('repeats', 1)} repeat(s); {r['seconds']} s in all).",
           ""]
    rows = []
    for s in r["stages"]:
        seed = s.get("seed_v100", {})
        seed_txt = (_x(seed.get("speedup_vs_previous")) if "speedup_vs_previous" in seed
                    else (f"{seed['samples_per_s']:.0f}/s" if seed else ""))
        if s["status"] != "ok":
            rows.append([f"`{s['name']}`", "-", "-", "-", "-", seed_txt, "-", "-",
                         f"{s['status']}: {s['reason']}"])
            continue
        note = []
        if s.get("samples_per_s_all"):
            note.append("repeats: " + ", ".join(f"{v:,.0f}" for v in s["samples_per_s_all"]))
        if s.get("first_step_s", 0) > 1:
            note.append(f"first step {s['first_step_s']:.1f} s")
        if s["name"] == "channels_last" and not s["techniques"]["compile"]:
            note.append("without compile")
        mem = (_f(s.get("peak_memory_mib"), ",.0f") if s.get("peak_memory_mib") is not None
               else "-")
        rows.append([f"`{s['name']}`", _f(s["samples_per_s"]), _f(s["step_ms"]),
                     _x(s.get("speedup_vs_previous")), _x(s.get("speedup_vs_baseline")),
                     seed_txt, mem, _f(s.get("activation_mib"), ",.1f"), "; ".join(note)])
    out.append(_table(["stage", "samples/s", "step ms", "vs previous", "vs baseline",
                       "published (V100)", "peak MiB", "activations MiB", "note"], rows))
    sm, o = r["summary"], r.get("overhead") or {}
    out.append("")
    if sm.get("single_device_speedup"):
        out.append(f"Best single-device stage: `{sm['best_single_device']}`, "
                   f"{_x(sm['single_device_speedup'])} over the baseline (the published "
                   f"ResNet-50 case study, one V100: "
                   f"{_x(sm['seed_v100_single_gpu_speedup'])}).")
    if "ratio" in o:
        out.append("")
        out.append(f"Overhead (`{o['stack']}`, fixed batches, {o['steps']} interleaved steps, "
                   f"medians): hand-written {o['hand_written_step_ms']:.2f} ms, accelfn "
                   f"{o['accelfn_step_ms']:.2f} ms per step (ratio {o['ratio']:.3f}); with "
                   f"`with_nonfinite(policy=\"off\")` ratio {o['ratio_guard_off']:.3f}; "
                   f"parameters equal to the hand-written loop's: "
                   f"{o['parameters_equal_guard_off']}.")
    return "\n".join(out)


def transforms(r: dict[str, Any], name: str) -> str:
    m = r["model"]
    present = [k for k in ("amp", "accumulation", "checkpoint", "compile") if k in r]
    model = ("" if present == ["compile"] else
             f": GPT {m['layers']} layers, {m['dim']} wide, {m['seq']} tokens, batch {m['batch']}")
    out = [f"### `benchmarks/transforms.py` ({', '.join(present)}){model}",
           "",
           f"File `{name}`, {r['machine']['date']}. Machine: {_machine(r['machine'])}. "
           f"Timing: {r['timing']}.",
           ""]
    for section in ("amp", "accumulation", "checkpoint"):
        sec = r.get(section)
        if not sec:
            continue
        if "sides" not in sec:
            out += [f"**{section}**: {sec.get('status')}: {sec.get('reason')}", ""]
            continue
        rows = []
        for side, v in sec["sides"].items():
            rows.append([f"`{side}`", _f(v["step_ms"], ".2f"), _x(v["speedup"]),
                         _f(v["activation_mib"], ".2f"),
                         _f(v.get("activation_ratio"), ".2f"),
                         _f(v.get("peak_step_mib"), ",.0f")])
        out += [f"**{section}** (baseline `{sec['baseline']}`, {sec['steps']} steps; "
                f"{sec.get('note', '')})", "",
                _table(["side", "step ms (median)", "speedup", "activations MiB",
                        "activations ratio", "peak MiB (CUDA)"], rows), ""]
        if section == "accumulation":
            out += [f"n=4 against n=1 (accelfn): time per update x{sec['n4_over_n1_time']:.2f}, "
                    f"activation memory x{sec['n4_over_n1_activation']:.2f}.", ""]
        if section == "checkpoint":
            out += [f"`checkpointed` against no checkpointing (accelfn): "
                    f"{sec['activation_saved_mib']:.2f} MiB of activations saved, "
                    f"{sec['time_added_ms']:+.2f} ms per step "
                    f"({sec['time_added_ratio'] * 100:+.0f}%).", ""]
    comp = r.get("compile")
    if comp and "cold" in comp:
        out += [f"**compile** ({comp.get('backend', 'inductor')} backend, "
                f"{comp['cold']['layers']}-layer model, {comp['cold']['dtype']}): steady-state "
                f"speedup over eager {_x(comp['speedup'])}; compile time "
                f"{comp['compile_s_cold']:.1f} s with a cold cache, "
                f"{comp['compile_s_warm']:.1f} s with the warm cache "
                f"(x{comp['warm_over_cold']:.2f}). {comp['note']}.", ""]
    elif comp:
        out += [f"**compile**: {comp.get('status')}: {comp.get('reason')}", ""]
    return "\n".join(out)


def gpt2(r: dict[str, Any], name: str) -> str:
    m = r["model"]
    out = [f"### `benchmarks/gpt2.py`: {m['parameters'] / 1e6:.2f}M parameters, "
           f"{m['layers']} layers, {m['seq']} tokens, batch {r['batch_size']}",
           "",
           f"File `{name}`, {r['machine']['date']}. Machine: {_machine(r['machine'])}. "
           f"{r['steps']} timed steps after {r['warmup']} warm-up steps per stage.",
           ""]
    rows = []
    for s in r["stages"]:
        if s["status"] != "ok":
            rows.append([f"`{s['name']}`", "-", "-", "-", "-", "-", "-",
                         f"{s['status']}: {s['reason']}"])
            continue
        rows.append([f"`{s['name']}`", _f(s["tokens_per_s"], ",.0f"), _f(s["step_ms"]),
                     f"{_x(s.get('speedup_vs_previous'))} vs `{s.get('compared_with')}`"
                     if s.get("compared_with") else "-",
                     _f(s.get("activation_mib"), ",.2f"),
                     _f(s.get("peak_memory_mib"), ",.0f"),
                     _f(None if s.get("mfu") is None else s["mfu"] * 100, ".1f", "%"),
                     f"first step {s['first_step_s']:.1f} s" if s["first_step_s"] > 1 else ""])
    out.append(_table(["stage", "tokens/s", "step ms", "speedup", "activations MiB",
                       "peak MiB", "MFU", "note"], rows))
    return "\n".join(out)


def _stage(result: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """The stage ``name`` of a bench or gpt2 result when it ran, else ``{}``."""
    for st in (result or {}).get("stages", []):
        if st.get("name") == name and st.get("status") == "ok":
            found: dict[str, Any] = st
            return found
    return {}


def _met(value: Any, ok: bool | None) -> str:
    return "-" if value is None or ok is None else ("yes" if ok else "**no**")


def headline(parts: dict[str, Any]) -> list[list[str]]:
    """Rows of the suite's figures against their targets: [figure, this run, target, met]."""
    res: dict[str, Any] = {k: v.get("result") for k, v in parts.items()}
    rows: list[list[str]] = []
    gpt = res.get("gpt2")
    base, same = _stage(gpt, "baseline"), _stage(gpt, "accelfn_fp32")
    if base and same:
        ratio = same["tokens_per_s"] / base["tokens_per_s"]
        rows.append(["GPT-2 small: accelfn step / hand-written loop (fp32, fused AdamW), "
                     "tokens/s", _x(ratio), ">= x0.99", _met(ratio, ratio >= 0.99)])
    bench_r = res.get("bench_resnet50") or {}
    o = bench_r.get("overhead") or {}
    if "ratio" in o:
        rows.append([f"ResNet-50: accelfn / hand-written step time (`{o['stack']}`)",
                     f"{o['ratio']:.3f}", "<= 1/0.99 = 1.010",
                     _met(o["ratio"], o["ratio"] <= 1 / 0.99)])
    best = max((st for st in (gpt or {}).get("stages", []) if st.get("status") == "ok"
                and st.get("mfu") is not None), key=lambda st: st["mfu"], default=None)
    if gpt and best:
        rows.append([f"GPT-2 small ({gpt['model']['parameters'] / 1e6:.0f}M): MFU, best stage "
                     f"`{best['name']}` ({best['tokens_per_s']:,.0f} tokens/s)",
                     f"{best['mfu'] * 100:.1f}%", ">= 45%", _met(best, best["mfu"] >= 0.45)])
    cap = res.get("captured")
    if cap:
        launch, met = cap["launch_bound"], cap["met"]
        rows.append([f"captured / hand-written loop, updates/s, launch-bound GPT "
                     f"({launch['config']['dim']} wide, {launch['config']['layers']} layers, "
                     f"batch {launch['batch']})", _x(launch["speedup_captured_vs_hand"]),
                     ">= x1.3", _met(launch, met["launch_bound_captured_vs_hand"])])
        rows.append(["same, captured / the same accelfn step eager",
                     _x(launch["speedup_captured_vs_eager"]), "", ""])
        if cap.get("gpt2"):
            rows.append(["GPT-2 small compiled: captured / eager accelfn step, tokens/s",
                         _x(cap["gpt2"]["speedup_captured_vs_eager"]), ">= x0.99",
                         _met(cap, met["gpt2_captured_vs_eager"])])
        rows.append(["captured against eager, fp32: largest parameter difference after "
                     f"{cap['equality']['steps']} updates",
                     f"{cap['equality']['max_abs_param_diff']:.1e}", "<= 1e-6",
                     _met(cap, met["max_abs_param_diff"])])
    f8 = res.get("float8")
    if f8:
        rows.append([f"float8 / bf16 tokens/s, GPT of {f8['model']['parameters'] / 1e6:.0f}M "
                     "parameters, both compiled", _x(f8["speedup"]), f">= x{f8['target']}",
                     _met(f8["speedup"], f8["meets_target"])])
    cl, fp32 = _stage(bench_r, "channels_last"), _stage(bench_r, "accelfn_data")
    if cl:
        compiled = cl.get("techniques", {}).get("compile")
        rows.append([f"ResNet-50 {'compiled ' if compiled else ''}bf16 channels_last, "
                     f"images/s (batch {bench_r['config']['batch_size']})",
                     _f(cl["samples_per_s"], ",.0f"), ">= 5,000",
                     _met(cl, cl["samples_per_s"] >= 5000)])
        if fp32:
            rows.append(["same, over fp32 eager (`accelfn_data`: data on the GPU)",
                         _x(cl["samples_per_s"] / fp32["samples_per_s"]), "", ""])
        if cl.get("speedup_vs_baseline") is not None:
            rows.append(["same, over the DataLoader fp32 eager baseline",
                         _x(cl["speedup_vs_baseline"]), "", ""])
    regional = (res.get("compile") or {}).get("regional")
    if regional:
        rows.append(["regional / whole-model cold compile time (GPT-2 small)",
                     _x(regional["compile_ratio"]), regional["targets"]["compile_ratio"],
                     _met(regional, regional["met"]["compile_ratio"])])
        rows.append(["regional / whole-model steady step time", _x(regional["steady_ratio"]),
                     regional["targets"]["steady_ratio"],
                     _met(regional, regional["met"]["steady_ratio"])])
    comp = (res.get("transforms") or {}).get("compile") or {}
    if "cold" in comp:
        rows.append([f"compile on a restart with the warm cache / cold "
                     f"({comp['cold']['layers']}-layer GPT)",
                     f"{_x(comp['warm_over_cold'])} ({comp['compile_s_warm']:.1f} s against "
                     f"{comp['compile_s_cold']:.1f} s)", "", ""])
    data = res.get("data")
    if data:
        rows.append(["`accelfn.data` / DataLoader samples/s to the GPU "
                     f"({data['setup']['image'][1]} px, augmentation)",
                     _x(data["ratio_samples_per_s"]), ">= x10",
                     _met(data, data["targets"]["ratio_at_least_10"])])
    tests = res.get("gpu_tests")
    if tests:
        rows.append(["GPU-only tests", f"{tests['passed']} passed, "
                     f"{tests['failures'] + tests['errors']} failed", "all pass",
                     _met(tests, not tests["failures"] and not tests["errors"])])
    return rows


def float8(r: dict[str, Any], name: str) -> str:
    m = r["model"]
    rows = [[f"`{s['name']}`", f"`{s['stack']}`", _f(s["tokens_per_s"], ",.0f"),
             _f(s["step_ms"]), f"{s['first_step_s']:.1f}", _f(s.get("peak_memory_mib"), ",.0f"),
             f"{s['eval_loss']:.3f}"] for s in r["sides"]]
    return "\n".join([
        f"### `benchmarks/float8.py`: GPT of {m['parameters'] / 1e6:.0f}M parameters, "
        f"{m['layers']} layers, {m['dim']} wide, {m['seq']} tokens, batch {r['batch_size']}",
        "",
        f"{r['steps']} timed steps per side after {r['warmup']} warm-up steps, interleaved; "
        f"float8 recipe {r['float8']['recipe']}, left in bf16: "
        f"{', '.join(r['float8']['left_in_bf16'])}.",
        "",
        _table(["side", "stack", "tokens/s", "step ms (median)", "first step s", "peak MiB",
                "eval loss"], rows),
        "",
        f"float8 / bf16: {_x(r['speedup'])} (target x{r['target']}, met: "
        f"{r['meets_target']})."])


def regional_compile(r: dict[str, Any], name: str) -> str:
    g = r["regional"]
    m = r.get("model", {})
    sides = [("whole", "`compiled()`"), ("regional", "`compiled(regional=True)`"),
             ("nested", "`compiled(regional=\"nested\")`")]
    rows = [[label, _f(g[k]["compile_s"], ".1f"),
             _f(g["regional"].get(f"{k}_step_ms") if k != "whole" else g["whole"]["step_ms"],
                ".1f")] for k, label in sides if k in g]
    model = (f"GPT of {m['layers']} blocks, width {m['dim']}, sequence {m['seq']}, batch "
             f"{m['batch']}" if m else "GPT-2 small")
    return "\n".join([
        f"### `benchmarks/compile.py --only regional`: {model}",
        "",
        "Each side's cold compile in a fresh process with an empty inductor cache; steady "
        "step times interleaved in one process.",
        "",
        _table(["side", "cold compile s", "steady step ms"], rows),
        "",
        f"regional / whole: compile {_x(g['compile_ratio'])} (target "
        f"{g['targets']['compile_ratio']}), steady {_x(g['steady_ratio'])} (target "
        f"{g['targets']['steady_ratio']}, control "
        f"{_x(g.get('control_ratio'))}); nested / whole: compile "
        f"{_x(g.get('nested_compile_ratio'))}, steady {_x(g.get('nested_steady_ratio'))}."])


def data_part(r: dict[str, Any], name: str) -> str:
    st, a, d = r["setup"], r["accelfn"], r["dataloader"]
    rows = [["`accelfn.data`", _f(a["samples_per_s"], ",.0f"), _f(a["first_batch_ms"]),
             _f(a["epoch_boundary_max_ms"])],
            ["DataLoader", _f(d["samples_per_s"], ",.0f"), _f(d["first_batch_ms"]),
             _f(d["epoch_boundary_max_ms"])]]
    return "\n".join([
        f"### `benchmarks/data.py`: {st['samples']:,} {st['dtype']} images "
        f"{'x'.join(str(v) for v in st['image'])}, batch {st['batch_size']}, to `{st['device']}`",
        "",
        f"Augmentation: {st['augmentation']}; {st['workers']} workers each; {st['repeats']} "
        "interleaved epochs of each, medians.",
        "",
        _table(["pipeline", "samples/s", "first batch ms", "longest epoch boundary ms"], rows),
        "",
        f"accelfn.data / DataLoader: {_x(r['ratio_samples_per_s'])}; targets: "
        + ", ".join(f"{k} {v}" for k, v in r["targets"].items()) + "."])


def suite(r: dict[str, Any], name: str) -> str:
    m = r.get("machine") or {}
    env = ((r["parts"].get("environment") or {}).get("result") or {})
    versions = env.get("versions") or {}
    driver = (env.get("driver") or {}).get("version")
    libs = ", ".join(f"{k} {versions[k]}" for k in ("tensordict", "torchdata")
                     if versions.get(k))
    out = [f"### GPU suite: {r.get('device')}, {(r.get('date') or '')[:10]}", "",
           f"File `{name}`, started {r.get('date')}, {r.get('seconds')} s of a "
           f"{r.get('budget_s')} s budget, commit `{r.get('git_commit')}`.", "",
           f"Machine: {_machine(m)}" + (f", driver {driver}" if driver else "") + ".", "",
           f"These figures were measured with torch {m.get('torch')}"
           + (f" ({libs})" if libs else "") + ".", ""]
    rows = [[f"`{k}`", v["status"], _f(v.get("seconds"), ".0f"), v.get("note", "")]
            for k, v in r["parts"].items()]
    out.append(_table(["part", "status", "seconds", "note"], rows))
    out.append("")
    head = headline(r["parts"])
    if head:
        out += ["Figures against their targets (each ratio from sides run in this suite):",
                "", _table(["figure", "this run", "target", "met"], head), ""]
    tests = (r["parts"].get("gpu_tests") or {}).get("result") or {}
    if tests.get("failed"):
        out += ["Failing GPU-only tests: " + ", ".join(f"`{t}`" for t in tests["failed"])
                + ".", ""]
    renderers = {"gpt2": gpt2, "float8": float8, "bench_resnet50": bench,
                 "data": data_part, "compile": regional_compile, "transforms": transforms}
    for key, render_part in renderers.items():
        part = r["parts"].get(key, {})
        if not part.get("result"):
            continue
        if key == "compile" and "regional" not in part["result"]:
            continue
        out += [render_part(part["result"], name).replace("### ", "#### "), ""]
    return "\n".join(out).rstrip("\n")


HEADER = """# Benchmark results

Figures measured by the scripts in `benchmarks/` and by `accelfn bench`, each with the
machine, date and command it came from. This page is generated from the JSON files in
`benchmarks/results/` by `python benchmarks/render_results.py benchmarks/results/*.json`;
nothing on it is typed by hand. How to read them: [performance guide](performance.md).

Timings on a CPU, and above all on a small shared machine, vary with what else runs there:
each table gives the load average at its start and end, and `--repeats` (bench) or
interleaved sides (transforms) keep the comparisons within one run fair. The **published
(V100)** column gives, per stage, the ResNet-50 case study published for one V100
(312 -> 387 -> 542 -> 798 images/s; 2832 on 4 GPUs): its speedups come from GPUs; on CPUs
expect different ratios (see the performance guide).

"""


def overhead(r: dict[str, Any], name: str) -> str:
    sides = ("accelfn", "same_features", "fabric", "accelerate", "plain_again")
    labels = {"accelfn": "accelfn", "same_features": "hand-written, same features",
              "fabric": "Lightning Fabric", "accelerate": "HF Accelerate",
              "plain_again": "control: plain loop again"}
    rows = ["| model | precision | plain loop us/step | "
            + " | ".join(f"{labels[s]} ratio" for s in sides) + " | accelfn added us |",
            "|---|---|---:|" + "---:|" * len(sides) + "---:|"]
    for c in r["configs"]:
        cells = [f"{c[s]['ratio']:.3f}" if s in c else "not run" for s in sides]
        if "ratio_quartiles" in c["accelfn"]:
            low, high = c["accelfn"]["ratio_quartiles"]
            cells[0] += f" ({low:.3f}-{high:.3f})"
        rows.append(f"| {c['model']}, batch {c['batch']} | {c['precision']} | "
                    f"{c['plain_step_us']:,.0f} | " + " | ".join(cells)
                    + f" | {c['accelfn']['added_us']:,.0f} |")
    bitwise = all(c["parameters_bitwise_equal_to_plain"] for c in r["configs"])
    load = r["load_average"]
    text = (f"### Step overhead against the plain loop ({r['date']}, {r['machine']}, load "
            f"average {load[0]:.2f} at the start, {load[3]:.2f} at the end)\n\n"
            f"`python benchmarks/overhead.py` -> `{name}`. Baseline: {r['baseline']}. accelfn: "
            f"{r['accelfn']}. {r['timing']} (accelfn's quartiles of per-round ratios in "
            "brackets; the control runs the plain loop again on its own model copy: its "
            "distance from 1 is the noise floor; accelfn makes torch's public calls, as the "
            "plain loop does: loss.backward(), clip_grad_norm_, optimizer.step(), "
            "zero_grad(set_to_none=True)). Parameters bitwise equal to the plain loop: "
            f"{bitwise}. Targets: tiny <= {r['targets']['tiny']}, medium <= "
            f"{r['targets']['medium']}.\n\n" + "\n".join(rows))
    operators = r.get("operators")
    if operators:
        rows = ["| model | precision | plain loop operators/update | accelfn ratio | "
                "hand-written, same features ratio | accelfn's that differ (plain, accelfn) |",
                "|---|---|---:|---:|---:|---|"]
        for c in operators:
            differ = ", ".join(f"{op} {a:g}/{b:g}"
                               for op, (a, b) in c["accelfn_differs_from_plain"].items())
            rows.append(f"| {c['model']}, batch {c['batch']} | {c['precision']} | "
                        f"{c['operators_per_update']['plain']:g} | {c['accelfn_ratio']:.3f} | "
                        f"{c['same_features_ratio']:.3f} | {differ} |")
        text += ("\n\nATen operators dispatched per update (counted under a dispatch mode; the "
                 f"same at any load). Target: <= {r['targets'].get('operators', 1.02)}.\n\n"
                 + "\n".join(rows))
    counted = r.get("instructions")
    if not counted:
        return text
    rows = ["| model | precision | plain loop instructions/update | accelfn ratio | "
            "hand-written, same features ratio | accelfn added |",
            "|---|---|---:|---:|---:|---:|"]
    for c in counted:
        rows.append(f"| {c['model']}, batch {c['batch']} | {c['precision']} | "
                    f"{c['instructions_per_update']['plain']:,} | {c['accelfn_ratio']:.3f} | "
                    f"{c['same_features_ratio']:.3f} | {c['accelfn_added']:,} |")
    return (text + "\n\nInstructions per update, counted by valgrind's callgrind "
            "(`--instructions`; each side's updates alone after a warm-up): unlike time, they "
            "do not move with the machine's load (repeated runs agree within about 2%).\n\n"
            + "\n".join(rows))


def compile_(r: dict[str, Any], name: str) -> str:
    parts = [compile_ratios(r, name)] if "regional" in r else []
    if "depth" in r:
        parts.append(compile_depth(r, name))
    return "\n\n".join(parts)


def compile_depth(r: dict[str, Any], name: str) -> str:
    d, m = r["depth"], r["model"]
    load = r["machine"]["load_average"]
    fit = d["fit"]
    nested = "nested_compile_s" in d  # results before regional="nested" had two sides
    head = ("| blocks | whole-model cold compile s | regional (in place) s | regional / whole |"
            + (" nested s | nested / whole |" if nested else ""))
    rows = [head, "|---:|---:|---:|---:|" + ("---:|---:|" if nested else "")]
    for i, n in enumerate(d["depths"]):
        row = (f"| {n} | {d['whole_compile_s'][i]:.1f} | {d['regional_compile_s'][i]:.1f} | "
               f"{_x(d['compile_ratio_by_depth'][i])} |")
        if nested:
            row += (f" {d['nested_compile_s'][i]:.1f} | "
                    f"{_x(d['nested_compile_ratio_by_depth'][i])} |")
        rows.append(row)
    row = (f"| each block adds | {fit['whole']['s_per_block']:.2f} | "
           f"{fit['regional']['s_per_block']:.2f} | {_x(d['per_block_ratio'])} |")
    rows.append(row + (f" {fit['nested']['s_per_block']:.2f} | "
                       f"{_x(d['nested_per_block_ratio'])} |" if nested else ""))
    row = (f"| any depth costs | {fit['whole']['intercept_s']:.1f} | "
           f"{fit['regional']['intercept_s']:.1f} | |")
    rows.append(row + (f" {fit['nested']['intercept_s']:.1f} | |" if nested else ""))
    return (f"### Compile time against depth ({r['machine']['date'][:10]}, "
            f"{r['machine']['cpu']}, {r['machine']['cpu_cores']} cores, load average "
            f"{load[0]:.2f})\n\n`{r['command']}` -> `{name}`. The same GPT (width {m['dim']}, "
            f"sequence {m['seq']}, batch {m['batch']}) at {len(d['depths'])} depths; each cold "
            f"compile in a fresh process on a machine that has compiled before, median of "
            f"{d['repeats']}. The last two rows are the least-squares line through each "
            f"column: the seconds each block adds, and the seconds a compile costs at any "
            f"depth.\n\n" + "\n".join(rows))


def compile_ratios(r: dict[str, Any], name: str) -> str:
    g, c, m = r["regional"], r["cache"], r["model"]
    prepared = r.get("prepared")
    load = r["machine"]["load_average"]
    repeats = g.get("repeats", 1)
    whole_s = g.get("whole_compile_s_median", g["whole"]["compile_s"])
    regional_s = g.get("regional_compile_s_median", g["regional"]["compile_s"])
    nested = "nested_compile_ratio" in g  # results before regional="nested" had two sides
    rows = ["| measurement | value | target | met |", "|---|---:|---|---|",
            f"| regional / whole-model cold compile time, fresh machine | "
            f"{_x(g['compile_ratio'])} | {g['targets']['compile_ratio']} | "
            f"{g['met']['compile_ratio']} |"]
    if prepared:
        rows.append(f"| same, on a machine that has compiled before | "
                    f"{_x(prepared['compile_ratio'])} | {prepared['target']} | "
                    f"{prepared['met']} |")
    control = (f" (control {_x(g['control_ratio'])})" if "control_ratio" in g else "")
    rows.append(f"| regional / whole-model steady step time | {_x(g['steady_ratio'])}"
                f"{control} | {g['targets']['steady_ratio']} | {g['met']['steady_ratio']} |")
    if nested:
        rows.append(f"| nested / whole-model cold compile time, fresh machine | "
                    f"{_x(g['nested_compile_ratio'])} | | |")
        if prepared and "nested_compile_ratio" in prepared:
            rows.append(f"| same, on a machine that has compiled before | "
                        f"{_x(prepared['nested_compile_ratio'])} | | |")
        rows.append(f"| nested / whole-model steady step time | "
                    f"{_x(g['nested_steady_ratio'])} | | |")
    rows += [f"| first compiled step after resume, cache file / cold | "
             f"{_x(c['first_step_ratio'])} | {c['target']} | {c['met']} |",
             f"| same, restart that finds its own inductor cache / cold | "
             f"{_x(c['same_machine_ratio'])} | | |"]
    sides = (f"regional (`compiled(regional=True)`, blocks in place) {regional_s:.0f} s"
             + (f", nested (`regional=\"nested\"`) {g['nested_compile_s_median']:.0f} s"
                if nested else ""))
    text = (f"### Compilation ({r['machine']['date'][:10]}, {r['machine']['cpu']}, "
            f"{r['machine']['cpu_cores']} cores, load average {load[0]:.2f})\n\n"
            f"`{r['command']}` -> `{name}`. GPT of {m['layers']} blocks, width {m['dim']}, "
            f"sequence {m['seq']}, batch {m['batch']}; each measurement in a fresh process "
            f"with an empty inductor cache; ratios are medians of {repeats} back-to-back "
            f"pair(s). Whole-model cold compile {whole_s:.0f} s, {sides} "
            f"(medians); first step from the cache file "
            f"{c.get('warm_first_step_s_median', c['warm']['first_step_s']):.0f} s against "
            f"{c.get('cold_first_step_s_median', c['cold']['first_step_s']):.0f} s cold.")
    if prepared:
        text += (f" On machines that have compiled before: whole model "
                 f"{prepared['whole_compile_s_median']:.0f} s, regional "
                 f"{prepared['regional_compile_s_median']:.0f} s"
                 + (f", nested {prepared['nested_compile_s_median']:.0f} s"
                    if "nested_compile_s_median" in prepared else "")
                 + f"; a fresh machine's one-time work (vector instruction probes, "
                 f"precompiled header) {prepared['machine_one_time_s']:.0f} s.")
    return text + "\n\n" + "\n".join(rows)


def checkpoint(r: dict[str, Any], name: str) -> str:
    load = r["load_average"]
    before = load["before"][0] if isinstance(load, dict) else load[0]
    return (f"### Asynchronous checkpoints ({r['date']}, {r['machine']}, load average "
            f"{before:.2f})\n\n`{r['command']}` -> `{name}`. {r['model']}, "
            f"{r['parameters'] / 1e6:.1f}M parameters ({r['bytes'] / 2**20:,.0f} MiB); "
            f"{r['timing']}.\n\n"
            "| save | blocking s (median) |\n|---|---:|\n"
            f"| synchronous | {r['sync_blocking_s']:.3f} |\n"
            f"| `asynchronous=True` | {r['async_blocking_s']:.3f} |\n\n"
            f"Ratio {_x(r['ratio'])} (target <= {r['target']}, met: {r['meets_target']}); the "
            f"asynchronous save committed {r['async_time_to_commit_s']:.2f} s after the call.")


def scale_out(r: dict[str, Any], name: str) -> str:
    m, mach = r["model"], r["machine"]
    times, memory = [], []
    for s in r["sides"]:
        if s["status"] != "ok":
            times.append([f"`{s['side']}`", "-", "-", f"{s['status']}: {s['reason'][-200:]}"])
            memory.append([f"`{s['side']}`", "-", "-", "-", "-", "-", "-"])
            continue
        formula = s["formula"].split("(")[0].replace("host:", "").strip()
        where = " on the host" if "host:" in s["formula"] else ""
        low, high = min(s["step_ms_all"]), max(s["step_ms_all"])
        transient = (None if s["training_mib"] is None or s["state_mib"] is None
                     else s["training_mib"] - s["state_mib"])
        times.append([f"`{s['side']}`", s["what"],
                      f"{_f(s['step_ms'], ',.0f')} ({low:,.0f}-{high:,.0f})",
                      _x(r["step_time_ratios"].get(f"{s['side']}/ddp"))])
        memory.append([f"`{s['side']}`", _f(s["peak_rss_steps_mib"], ",.0f"),
                       _f(s["training_mib"], ",.0f"), _f(s["state_mib"], ",.0f"),
                       _f(transient, ",.0f"),
                       f"{_f(s['formula_mib'], ',.0f')} (`{formula}`{where})",
                       _f(s["ru_maxrss_mib"], ",.0f")])
    ratios = r["step_time_ratios"]
    plain = "; ".join(f"`{k}` {_x(v)}" for k, v in ratios.items() if "/plain_" in k)
    load = mach.get("load_average") or [None]
    end = mach.get("load_average_end") or [None]
    base = next((s["base_rss_mib"] for s in r["sides"] if s["status"] == "ok"), None)
    return "\n".join([
        f"### Scale-out memory: GPT of {m['parameters'] / 1e6:.1f}M parameters on "
        f"{r['world']} CPU processes",
        "",
        f"`{r['command']}` -> `{name}`, {mach['date']}, {mach['cpu']}, {mach['cpu_cores']} "
        f"cores, torch {mach['torch']}, load average {load[0]} at the start, {end[0]} at the "
        f"end. {m['layers']} blocks, {m['dim']} wide, vocabulary {m['vocab']} (tied head), "
        f"{r['batch_size']} x {m['seq']} tokens per process, {r['optimizer']}; {r['steps']} "
        f"timed updates after {r['warmup']} warm-up update(s); each side is one fresh launch "
        f"(gloo, one thread per process), the sides one after the other.",
        "",
        f"Step time: the slowest process' per update, median. Memory per process, the "
        f"largest of the {r['world']}: **peak**, resident over the timed updates (counted "
        f"after the warm-up, once `malloc_trim` has handed back the heap memory that "
        f"building the whole model left free); **training**, that peak less the resident "
        f"memory of a process that has imported torch and joined the group ({base} MiB "
        f"here); **state**, the storages of the process' parameters, gradients and AdamW "
        f"state, against the formula of the [distributed guide](distributed.md) (16 bytes "
        f"per parameter, `R` = {r['replicate']}, `W` = {r['world']}); **lifetime peak**, "
        f"`ru_maxrss`, which includes building the whole model before it is sharded. On a "
        f"CPU the device and the host are the same memory: `offload=\"cpu\"` keeps the "
        f"shards where FSDP keeps them and adds copies. **training - state** is what each "
        f"update holds for a while (activations, gathered blocks, unsharded gradients, "
        f"communication buffers). Step times are of sides launched one after the other on "
        f"a shared machine: a ratio within the range of the updates is no difference.",
        "",
        _table(["side", "what", "step ms (range)", "vs `ddp`"], times),
        "",
        _table(["side", "peak MiB", "training MiB", "state MiB", "training - state MiB",
                "formula MiB", "lifetime peak MiB"], memory),
        "",
        f"accelfn / plain step time: {plain}."])


def memory(r: dict[str, Any], name: str) -> str:
    """benchmarks/memory.py: the estimate against the measured peak, linear_cross_entropy's
    peak against the full logits', adaptive accumulation against its count set by hand."""
    m, e, lce, ad = r["model"], r["estimate"], r["linear_cross_entropy"], \
        r["adaptive_accumulation"]
    load = ", ".join(str(x) for x in r.get("load_average", []))
    mib = 2 ** 20
    return "\n".join([
        f"### Memory ({r['date']}, {r['machine']}, load average {load})",
        "",
        f"File `{name}`; `{r['command']}`. A GPT of {m['parameters'] / 1e6:.1f}M "
        f"parameters ({m['depth']} blocks, {m['dim']} wide, vocabulary {m['vocab']}, "
        f"{m['optimizer']}), measured as the {r['measured_by']}.",
        "",
        _table(["figure", "accelfn", "against", "ratio"], [
            ["`estimate_memory` peak vs measured", f"{e['peak_bytes'] / mib:,.1f} MiB",
             f"{e['measured_peak_bytes'] / mib:,.1f} MiB", f"{e['ratio']}"],
            [f"`linear_cross_entropy` peak vs full logits (SGD, batch {lce['sgd_batch']})",
             f"{lce['peak_bytes'] / mib:,.1f} MiB",
             f"{lce['full_logits_peak_bytes'] / mib:,.1f} MiB", f"{lce['ratio']}"],
            [f"the same with AdamW (batch {lce['adamw']['batch']}: the optimizer step's "
             "peak)", f"{lce['adamw']['peak_bytes'] / mib:,.1f} MiB",
             f"{lce['adamw']['full_logits_peak_bytes'] / mib:,.1f} MiB",
             f"{lce['adamw']['ratio']}"],
            [f"adaptive accumulation step (settles at {ad['chosen']} micro-batches) vs that "
             f"count by hand, median of {ad['rounds']} interleaved", f"{ad['adaptive_s']} s",
             f"{ad['by_hand_s']} s", f"{ad['ratio']} (target {ad['target']})"],
        ])])


def lm_data(r: dict[str, Any], name: str) -> str:
    """benchmarks/lm_data.py: the token loader against an np.memmap loop."""
    s, t = r["setup"], r["token_loader_vs_np_memmap"]
    return "\n".join([
        f"### Language-model data ({s['date']}, {s['machine']}, {s['cpu_cores']} cores, load "
        f"average {s['load_average_before']} before, {s['load_average_after']} after)",
        "",
        f"File `{name}`: `accelfn.data.token_loader` against nanoGPT's `np.memmap` "
        f"slicing loop, batches of {t['batch_size']} x {t['seq_len']} tokens, median of "
        f"{t['repeats']} interleaved repeats: {t['token_loader_tokens_per_s']:,} against "
        f"{t['np_memmap_tokens_per_s']:,} tokens/s, **x{t['ratio']}** (target >= 0.9). "
        "Packing against padding: docs/data.md's language-model section.",
        *lm_training(r.get("training")),
    ])


def lm_training(tr: dict[str, Any] | None) -> list[str]:
    """benchmarks/lm_data.py's training part: examples/gpt.py, padded against packed rows."""
    if not tr:
        return []
    m = tr["model"]
    rows = []
    for arm, label in (("pad", "padded"), ("best_fit_same_updates", "best-fit, the same updates"),
                       ("best_fit_same_rows", "best-fit, the same batch shape")):
        a, d = tr[arm], tr[arm].get("minus_pad")
        rows.append([label, f"`{tr['options'][arm]}`", str(a["updates"]),
                     f"{a['real_tokens_mean']:,}",
                     f"{a['val_loss']['mean']} ({a['val_loss']['stdev']})",
                     "" if d is None else f"{d['mean']:+} ({d['standard_error']})"])
    return ["", f"`examples/gpt.py` trained at the same real tokens, {tr['runs_of_each']} runs of "
            f"each (`--seed 0, 1, ...`), `--seq-len {m['seq_len']} --dim {m['dim']} --depth "
            f"{m['depth']} --accumulation {m['accumulation']}` (padding share "
            f"{1 - tr['pad_density']:.1%}); validation loss on all {tr['validation_tokens']:,} "
            "held-out targets:", "",
            _table(["rows", "options", "updates", "real tokens", "validation loss (std. dev.)",
                    "minus padded (std. error)"], rows)]


# each benchmark's JSON ("benchmark" or "suite" field) -> the section it renders
def sharded_muon(r: dict[str, Any], name: str) -> str:
    m, env, sec = r["model"], r["environment"], r["seconds"]
    adamw = sec["adamw"]["optimizer"]
    sides = [("`adamw`", f"AdamW under FSDP2 on {r['processes']} processes", "adamw"),
             ("`muon`", "Muon (blocks' matrices, sharded) + AdamW, same layout", "muon"),
             ("`adamw_one`", "AdamW in one process, the global batch", "adamw_one"),
             ("`muon_one`", "Muon + AdamW in one process, the global batch", "muon_one")]
    rows = [[label, what, _f(sec[key]["optimizer"], ",.3f"),
             _x(sec[key]["optimizer"] / adamw), _f(sec[key]["ns_wall"], ",.3f"),
             _f(sec[key]["update"], ",.3f")] for label, what, key in sides]
    start = env.get("load_average_start") or [None]
    end = env.get("load_average") or [None]
    return "\n".join([
        f"### Sharded Muon: its optimizer step against AdamW's, GPT of "
        f"{m['parameters'] / 1e6:.1f}M parameters ({m['muon_matrices']} Muon matrices)",
        "",
        f"`python benchmarks/sharded_muon.py` -> `{name}`, {env['date'][:16]}, {env['cpu']}, "
        f"{env['cpu_cores']} cores, torch {env['torch']}, {r['backend']}, load average "
        f"{start[0]} at the start, {end[0]} at the end; {r['rounds']} interleaved rounds of "
        f"{r['updates_per_round']} updates, medians; seconds per update.",
        "",
        _table(["side", "what", "optimizer step (s)", "/ `adamw`", "in Newton-Schulz (s)",
                "whole update (s)"], rows),
        "",
        f"Target: the sharded step at most x{r['target_optimizer_step_ratio']} AdamW's "
        f"(met: {'yes' if r['meets_target'] else 'no'}). Newton-Schulz is "
        f"{r['newton_schulz_share_of_sharded_step']:.0%} of the sharded step"
        + (" and runs in bfloat16, which this CPU emulates" if not r["cpu_bf16_native"]
           else "") + f"; the sharding's own cost (the step less Newton-Schulz) is "
        f"{r['sharded_step_less_newton_schulz_seconds']:.3f} s, and sharded Muon's step is "
        f"x{r['ratio_optimizer_step_sharded_to_one_process_muon']:.2f} one-process Muon's.",
    ])


RENDERERS: dict[str, Callable[[dict[str, Any], str], str]] = {
    "accelfn bench": bench, "transforms": transforms, "gpt2": gpt2, "compile": compile_,
    "checkpoint": checkpoint, "overhead": overhead, "scale_out": scale_out, "memory": memory,
    "lm_data": lm_data, "sharded_muon": sharded_muon}


def render(paths: list[Path]) -> str:
    sections: list[str] = []
    gpu_runs: list[tuple[str, str]] = []
    for path in sorted(paths):
        r = json.loads(path.read_text())
        name = f"benchmarks/results/{path.name}"
        kind = r.get("benchmark") or r.get("suite")
        if kind in RENDERERS:
            sections.append(RENDERERS[kind](r, name))
        elif kind == "benchmarks/gpu_suite.sh" and not r.get("dry_run"):
            gpu_runs.append((r.get("date") or "", suite(r, name)))
    gpu = [text for _, text in sorted(gpu_runs)] or [
        "No GPU run is recorded yet: `benchmarks/gpu_suite.sh` writes "
        "`benchmarks/results/gpu-<date>.json` on a GPU machine, and this page then shows "
        "it."]
    return (HEADER + "## GPU\n\n" + "\n\n".join(gpu) + "\n\n## CPU\n\n"
            + "\n\n".join(sections) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    sys.stdout.write(render([f for f in args.files if f.suffix == ".json"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
