"""``accelfn bench``'s result: the repeats of a stage combined, the JSON document, the text
table and the bar chart."""

from __future__ import annotations

import contextlib
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .config import SEED_CASE_STUDY, BenchConfig, cli_args

__all__ = [
    "assemble",
    "busy_machine_warning",
    "combine_repeats",
    "format_table",
    "plot_bench",
    "round_or_none",
]


def round_or_none(x: float | None, digits: int = 3) -> float | None:
    """``x`` rounded to ``digits`` decimals, ``None`` kept."""
    return None if x is None else round(float(x), digits)


def busy_machine_warning(load_average: float | None = None,
                         cores: int | None = None) -> str | None:
    """The warning for a machine whose 1-minute load average (``os.getloadavg()[0]``) exceeds its
    CPU cores (``os.cpu_count()``), or ``None`` when it does not (or the load is unknown).

    Timings taken while other processes want more CPU than there is vary from run to run by
    large factors, so the warning says how to get figures worth comparing.
    """
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except (OSError, AttributeError):  # not every platform has a load average
            return None
    cores = os.cpu_count() if cores is None else cores
    if not cores or load_average <= cores:
        return None
    return (f"the load average ({load_average:.2f} over the last minute) exceeds the {cores} CPU "
            f"cores: other processes compete for the CPU, so the figures (speedups included) "
            f"will vary from run to run; rerun on an idle machine, or add --repeats 5 to report "
            f"each stage's median")


def combine_repeats(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One stage's figures over its repeats: the median rate (and each one), the first
    repeat's first step (the cold compile), the largest memory."""
    if len(results) == 1:
        return dict(results[0])
    rates = [r["samples_per_s"] for r in results]
    mid = sorted(results, key=lambda r: r["samples_per_s"])[(len(results) - 1) // 2]
    out = dict(mid)
    out["samples_per_s"] = statistics.median(rates)
    out["step_ms"] = statistics.median(r["step_ms"] for r in results)
    out["samples_per_s_all"] = rates
    out["first_step_s"] = results[0]["first_step_s"]
    medians = [r["step_ms_median"] for r in results if r.get("step_ms_median") is not None]
    out["step_ms_median"] = statistics.median(medians) if medians else None
    for key in ("peak_memory_mib", "activation_mib"):
        values = [r[key] for r in results if r.get(key) is not None]
        out[key] = max(values) if values else None
    return out


def assemble(info: dict[str, Any], stages: list[dict[str, Any]],
              overhead: dict[str, Any] | None, complete: bool) -> dict[str, Any]:
    """The JSON result from the stages measured so far."""
    cfg: BenchConfig = info["cfg"]
    ok = [s for s in stages if s.get("status") == "ok"]
    base = next((s for s in ok if s["name"] == "baseline"), ok[0] if ok else None)
    prev = None
    for s in ok:
        s["speedup_vs_previous"] = (None if prev is None
                                    else s["samples_per_s"] / prev["samples_per_s"])
        s["speedup_vs_baseline"] = None if base is None else (
            s["samples_per_s"] / base["samples_per_s"])
        prev = s
    single = [s for s in ok if not s["techniques"]["ddp"]]
    seed = SEED_CASE_STUDY
    summary = {
        "baseline_samples_per_s": base["samples_per_s"] if base else None,
        "best_single_device": max(single, key=lambda s: s["samples_per_s"])["name"]
        if single else None,
        "single_device_speedup": (max(s["samples_per_s"] for s in single)
                                  / base["samples_per_s"]) if single and base else None,
        "total_speedup": (ok[-1]["samples_per_s"] / base["samples_per_s"]) if ok and base
        else None,
        "seed_v100_single_gpu_speedup": seed["compiled"]["samples_per_s"]
        / seed["baseline"]["samples_per_s"],
        "seed_total_speedup_4_gpus": seed["ddp"]["samples_per_s"]
        / seed["baseline"]["samples_per_s"],
    }
    env = dict(info["env"])
    with contextlib.suppress(OSError, AttributeError):
        env["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    quick = ["--quick"] if cfg.quick else []
    command = shlex.join(["accelfn", "bench", *quick,
                          *cli_args(cfg, exclude={"notes", "classes", "ddp_procs"})])
    peak, dtype = info["peak"], info["dtype"]
    return {
        "benchmark": "accelfn bench",
        "complete": complete,
        "command": command,
        "machine": env,
        "config": {k: v for k, v in asdict(cfg).items() if k != "notes"},
        "model_flops_per_sample": info["flops"],
        "mfu_peak": None if peak is None else {"dtype": str(dtype).replace("torch.", ""),
                                               "flop_per_s": peak},
        "stages": [_rounded(s) for s in stages],
        "summary": _rounded(summary),
        "overhead": None if overhead is None else _rounded(overhead),
        "warnings": list(info.get("warnings", ())),
        "notes": [*cfg.notes, *_notes(cfg, info["device"])],
        "seconds": round(time.perf_counter() - info["t_all"], 1),
    }


def _notes(cfg: BenchConfig, device: torch.device) -> list[str]:
    notes = [
        "samples/s = steps x batch / wall time of the timed steps, data loading included "
        "(with --repeats: the median over the repeats); step_ms_median (CPU only): the median "
        "single step, steadier on a busy machine",
        "stages are cumulative: each adds one technique to the previous stage",
        "peak_memory_mib: torch.cuda.max_memory_allocated over the stage; activation_mib: "
        "bytes autograd saved for backward in one step (parameters excluded); state_mib: "
        "parameters, buffers and optimizer state",
        "seed_v100: the published ResNet-50 case study on one V100 (312 -> 387 -> 542 -> 798 "
        "images/s; ddp: 2832 on 4 GPUs); compare "
        "ratios, not absolute numbers, across machines",
    ]
    if device.type != "cuda":
        notes.append("CPU run: AMP is bf16 autocast (its speed depends on the CPU's bf16 "
                     "support); no allocator peak (peak_memory_mib is null) and no MFU")
    return notes


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, float):
            out[k] = round(v, 6) if abs(v) < 1 else round(v, 3)
        elif isinstance(v, dict):
            out[k] = _rounded(v)
        else:
            out[k] = v
    return out


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(result: dict[str, Any]) -> str:
    """The stages as a text table, the overhead line and the summary."""
    head = ("stage", "samples/s", "step ms", "vs prev", "vs base", "V100 pub.", "peak MiB",
            "act. MiB", "MFU", "note")
    rows: list[tuple[str, ...]] = []
    for s in result["stages"]:
        seed = s.get("seed_v100", {})
        seed_txt = (f"x{seed['speedup_vs_previous']:.2f}" if "speedup_vs_previous" in seed
                    else (f"{seed['samples_per_s']:.0f}/s" if seed else ""))
        if s["status"] != "ok":
            rows.append((s["name"], "-", "-", "-", "-", seed_txt, "-", "-", "-",
                         f"{s['status']}: {s['reason']}"))
            continue
        notes = [f"{s['world_size']} processes"] if s.get("world_size") else []
        if s["first_step_s"] > 1:
            notes.append(f"first step {s['first_step_s']:.1f} s")
        if s["techniques"]["compile"] is False and s["name"] == "channels_last":
            notes.append("without compile")
        note = "; ".join(notes)
        rows.append((
            s["name"], _fmt(s["samples_per_s"], ",.1f"), _fmt(s["step_ms"], ".1f"),
            _fmt(s["speedup_vs_previous"], ".2f", "x"), _fmt(s["speedup_vs_baseline"], ".2f", "x"),
            seed_txt, _fmt(s["peak_memory_mib"], ",.0f"), _fmt(s["activation_mib"], ",.1f"),
            _fmt(None if s["mfu"] is None else s["mfu"] * 100, ".1f", "%"), note))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    o = result.get("overhead")
    if o and "ratio" in o:
        lines.append("")
        lines.append(
            f"overhead ({o['stack']}): hand-written {o['hand_written_step_ms']:.2f} ms, "
            f"accelfn {o['accelfn_step_ms']:.2f} ms per step (x{o['ratio']:.3f}, "
            f"{o['added_us_per_step']:+.0f} us); guard off x{o['ratio_guard_off']:.3f}")
    elif o:
        lines.append(f"overhead: {o.get('status')}: {o.get('reason')}")
    sm = result["summary"]
    if sm.get("single_device_speedup"):
        lines.append(
            f"single device: x{sm['single_device_speedup']:.2f} over the baseline "
            f"(published, ResNet-50 on a V100: x{sm['seed_v100_single_gpu_speedup']:.2f})")
    m = result["machine"]
    lines += [f"warning: {w}" for w in result.get("warnings", ())]
    lines.append(f"{m['device_name']} ({m['device']}), torch {m['torch']}, "
                 f"{m['cpu_cores']} CPU cores, load {m.get('load_average')}, "
                 f"{result['seconds']} s")
    return "\n".join(lines)


def plot_bench(result: dict[str, Any], path: str | Path) -> Path | None:
    """A bar chart of samples/s per stage with speedups over the baseline (and the published
    ratios); returns ``None`` (and says so) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'accelfn[plot]')",
              file=sys.stderr)
        return None
    ok = [s for s in result["stages"] if s["status"] == "ok"]
    skipped = [s["name"] for s in result["stages"] if s["status"] != "ok"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(ok) + 2), 4.2))
    names = [s["name"] for s in ok]
    rates = [s["samples_per_s"] for s in ok]
    colors = ["#9e9e9e" if s["techniques"]["data"].startswith("dataloader") else "#1f77b4"
              for s in ok]
    bars = ax.bar(names, rates, color=colors)
    for bar, s in zip(bars, ok):
        label = f"x{s['speedup_vs_baseline']:.2f}"
        seed = s.get("seed_v100", {}).get("speedup_vs_previous")
        if s["speedup_vs_previous"] is not None:
            label += f"\n(prev x{s['speedup_vs_previous']:.2f}"
            label += f"; V100 x{seed:.2f})" if seed else ")"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    m, c = result["machine"], result["config"]
    ax.set_ylabel("samples/s")
    ax.set_ylim(0, max(rates or [1]) * 1.3)
    ax.set_title(f"accelfn bench: {c['model']} {c['image_size']}px, batch {c['batch_size']} "
                 f"on {m['device_name']}", fontsize=9)
    if skipped:
        ax.text(0.01, 0.97, "skipped: " + ", ".join(skipped), transform=ax.transAxes,
                fontsize=7, va="top", color="#555555")
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
