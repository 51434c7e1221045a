"""The monitor's picture of a run: loss, learning rate, throughput, iteration time against
data wait, memory and GPU busy per step, in one PNG (matplotlib, drawn off-screen).

It draws any report with the fields of [`Drawn`][] (a
[`MonitorReport`][accelfn.observe.monitor.report.MonitorReport] has them) and imports nothing
of the report's module: ``MonitorReport.plot`` calls it, not the other way round."""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Drawn", "figure", "plot_report"]

Panel = Callable[[Any], None]


class Limits(Protocol):
    """The checklist's limits the plot draws as targets (a ``Thresholds``)."""

    @property
    def data_wait_share(self) -> float: ...
    @property
    def gpu_busy(self) -> float: ...


class Drawn(Protocol):
    """What the plot reads of a report (a ``MonitorReport``)."""

    @property
    def rows(self) -> list[dict[str, Any]]: ...
    @property
    def logged_rows(self) -> list[dict[str, Any]]: ...
    @property
    def rows_per_point(self) -> int: ...
    @property
    def warmup(self) -> int: ...
    @property
    def verdict(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def tokens_per_s(self) -> float | None: ...
    @property
    def data_wait_share(self) -> float | None: ...
    @property
    def gpu_samples(self) -> Sequence[tuple[float, float, float, float | None]]: ...
    @property
    def thresholds(self) -> Limits: ...


def _smooth(values: list[float | None], window: int) -> list[float | None]:
    """The mean of the last ``window`` values at each point (``None`` values skipped)."""
    out: list[float | None] = []
    recent: list[float] = []
    for v in values:
        if v is not None:
            recent = [*recent[-(window - 1):], v] if window > 1 else [v]
        out.append(sum(recent) / len(recent) if recent else None)
    return out


def _from_zero(ax: Any, *series: list[Any]) -> None:
    """Start the y axis at 0 with headroom above the largest value (flat lines show)."""
    top = max((v for values in series for v in values if v is not None), default=0.0)
    ax.set_ylim(0, 1.15 * top if top > 0 else 1.0)


def _interp(t: float, pairs: list[tuple[float, int]]) -> float:
    """Step coordinate of time ``t`` from (time, step) pairs (boundary times)."""
    if not pairs:
        return 0.0
    if t <= pairs[0][0]:
        return pairs[0][1] - 1 + t / max(pairs[0][0], 1e-9)
    for (t0, s0), (t1, s1) in itertools.pairwise(pairs):
        if t0 <= t <= t1:
            return s0 + (s1 - s0) * (t - t0) / max(t1 - t0, 1e-9)
    return float(pairs[-1][1])


def _panels(report: Drawn, steps: list[int]) -> list[Panel]:
    """One drawing function per panel, in the order users read them."""
    rows, th = report.rows, report.thresholds
    panels: list[Panel] = []

    def metric(key: str) -> list[float | None]:
        return [r.get(key) if isinstance(r.get(key), (int, float)) else None for r in rows]

    logged = report.logged_rows
    names = list(dict.fromkeys(k for r in logged for k in r if k not in ("step", "probed")))
    losses = [k for k in names if "loss" in k]

    def draw_logged(ax: Any, keys: list[str], first_colour: int) -> None:
        for i, k in enumerate(keys):
            points = [(r["step"], r[k]) for r in logged if isinstance(r.get(k), (int, float))]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3,
                    color=f"C{(first_colour + i) % 10}", label=k)

    if any(r.get("loss") is not None for r in rows) or losses:
        loss = metric("loss")
        window = max(1, len(rows) // 25)
        per = report.rows_per_point

        def draw_loss(ax: Any) -> None:
            if window > 1:
                ax.plot(steps, loss, color="C0", alpha=0.3, lw=0.8,
                        label="per step" if per == 1 else f"mean of {per} steps")
                ax.plot(steps, _smooth(loss, window), color="C0",
                        label=f"mean of {window * per} steps")
            else:
                ax.plot(steps, loss, color="C0", marker="." if len(rows) < 50 else None,
                        label="training loss")
            draw_logged(ax, losses, 1)
            if window > 1 or losses:
                ax.legend(loc="upper right", fontsize=8)
            ax.set_title("training loss" + (" and " + ", ".join(losses) if losses else ""))
        panels.append(draw_loss)
    others = [k for k in names if k not in losses]
    if others:
        def draw_others(ax: Any) -> None:
            draw_logged(ax, others, 3)
            ax.legend(loc="best", fontsize=8)
            ax.set_title("logged values")
        panels.append(draw_others)
    if any(r.get("lr") is not None for r in rows):
        def draw_lr(ax: Any) -> None:
            lr = metric("lr")
            ax.plot(steps, lr, color="C6")
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
            _from_zero(ax, lr)
            ax.set_title("learning rate")
        panels.append(draw_lr)

    def draw_throughput(ax: Any) -> None:
        key, unit = ("tokens_per_s", "tokens/s") if report.tokens_per_s else \
            ("samples_per_s", "samples/s")
        rate = metric(key)
        ax.plot(steps, rate, color="C2")
        ax.set_ylabel(unit)
        _from_zero(ax, rate)
        ax.set_title("throughput per step")

    def draw_time(ax: Any) -> None:
        step_ms = [1e3 * r["step_s"] for r in rows]
        ax.plot(steps, step_ms, color="C1", label="iteration")
        ax.plot(steps, [1e3 * r["data_wait_s"] for r in rows], color="C3", label="data wait")
        ax.set_ylabel("ms")
        _from_zero(ax, step_ms)
        ax.set_title(f"iteration and data wait (share {100 * (report.data_wait_share or 0):.0f}"
                     f"%, target < {100 * th.data_wait_share:.0f}%)")
        ax.legend(loc="upper right", fontsize=8)

    gpu = report.gpu_samples
    pairs = [(r["time_s"], r["step"]) for r in rows]
    gpu_steps = [_interp(s[0], pairs) for s in gpu]

    def draw_memory(ax: Any) -> None:
        mem, used = metric("mem_gib"), [s[2] for s in gpu]
        ax.plot(steps, mem, color="C4",
                label="allocated" if report.device.startswith("cuda") else "resident (RSS)")
        if gpu:
            ax.plot(gpu_steps, used, color="C5", ls="--", label="GPU used (nvml)")
        ax.set_ylabel("GiB")
        _from_zero(ax, mem, used)
        ax.set_title("memory")
        ax.legend(loc="lower right", fontsize=8)

    panels += [draw_throughput, draw_time, draw_memory]
    if gpu:
        def draw_gpu(ax: Any) -> None:
            ax.plot(gpu_steps, [s[1] for s in gpu], color="C5")
            ax.axhline(100 * th.gpu_busy, color="k", ls=":", lw=1)
            ax.set_ylim(0, 105)
            ax.set_ylabel("%")
            ax.set_title("GPU busy (pynvml)")
        panels.append(draw_gpu)
    return panels


def figure(report: Drawn, *, title: str | None = None) -> Any:
    """The ``matplotlib.figure.Figure`` of ``report`` (two panels a row, drawn off-screen)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("MonitorReport.plot needs matplotlib: "
                          "pip install 'accelfn[plot]'") from exc
    rows = report.rows
    if not rows:
        raise ValueError("MonitorReport.plot: no steps recorded (with history=..., none in "
                         "that file)")
    steps = [int(r["step"]) for r in rows]
    panels = _panels(report, steps)
    n_rows = (len(panels) + 1) // 2
    fig = Figure(figsize=(12, 2.6 * n_rows + 0.8), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(n_rows, 2, sharex=True, squeeze=False).flat)
    warm = steps[:-(-report.warmup // report.rows_per_point)]  # the points holding them
    probed = [r["step"] for r in rows if r.get("probed")]
    for ax, draw in zip(axes, panels):
        if warm:
            ax.axvspan(min(steps) - 0.5, max(warm) + 0.5, color="0.9", lw=0)
        for s in probed:
            ax.axvspan(s - 0.5, s + 0.5, color="#fde0c5", lw=0)
        draw(ax)
    for ax in axes[len(panels):]:  # an odd number of panels: the last cell stays empty
        fig.delaxes(ax)
        axes[len(panels) - 2].xaxis.set_tick_params(labelbottom=True)
    fig.supxlabel("step (grey: warm-up, orange: sync probe; neither in the summary)",
                  fontsize=9)
    # a long verdict is wrapped to the figure's width (about 7 pixels a character at 10 pt)
    heading = title or f"verdict: {report.verdict}"
    fig.suptitle(textwrap.fill(heading, 160, break_long_words=False), fontsize=10)
    return fig


def plot_report(report: Drawn, path: str | Path, *, title: str | None = None) -> Path:
    """Write [`figure`][] of ``report`` as a PNG to ``path`` (see
    [`MonitorReport.plot`][accelfn.observe.monitor.report.MonitorReport.plot]); return the path."""
    fig = figure(report, title=title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
