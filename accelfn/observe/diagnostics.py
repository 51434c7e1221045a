"""Training diagnostics: findings, host-sync detection, gradients, initialisation and data.

Everything here follows one rule: **nothing is read on the host during a normal step.**

* :class:`Finding` is the unit every checker in accelfn reports (doctor, monitor, diagnostics):
  what was checked, how bad it is, what was seen and how to fix it.
* :class:`SyncProbe` runs around one step and lists every point where the step forces the
  host to wait for the device (``.item()``, ``.cpu()``, ``bool(tensor)``, boolean-mask
  indexing, ...). On a GPU it uses torch's own ``torch.cuda.set_sync_debug_mode("warn")``;
  on the CPU, where nothing ever synchronises, it *emulates* the check by intercepting the
  aten operators and ``Tensor`` methods that would synchronise on a GPU, so the same
  mistakes are caught by CPU tests.
* :class:`Diagnostics` samples per-layer gradient norms every ``every`` steps (computed on the
  device, read only in :meth:`Diagnostics.report`), and checks initialisation, input ranges
  and label balance, reporting exploding, vanishing or dead layers.
* :func:`check_init`, :func:`check_batch` and :func:`check_model` are the same checks on
  demand.
"""

from __future__ import annotations

import contextlib
import linecache
import math
import os
import sys
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "Diagnostics",
    "DiagnosticsReport",
    "Finding",
    "Severity",
    "SyncPoint",
    "SyncProbe",
    "check_batch",
    "check_init",
    "check_model",
    "format_findings",
    "layer_grad_norms",
    "worst_severity",
]

Severity = Literal["ok", "info", "warning", "error"]
_RANK: dict[str, int] = {"ok": 0, "info": 1, "warning": 2, "error": 3}


@dataclass(frozen=True)
class Finding:
    """One result of a check: ``check`` (a short id), ``severity``, ``message`` and ``fix``.

    ``severity`` is ``"ok"`` (the check passed), ``"info"`` (worth knowing), ``"warning"``
    (costs speed or correctness, training still runs) or ``"error"`` (broken).
    """

    check: str
    severity: Severity
    message: str
    fix: str | None = None

    def __str__(self) -> str:
        head = f"[{self.severity.upper():7}] {self.check}: {self.message}"
        return head + (f"\n          fix: {self.fix}" if self.fix else "")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def worst_severity(findings: Iterable[Finding]) -> Severity:
    """The most serious severity among ``findings`` (``"ok"`` when there are none)."""
    worst: Severity = "ok"
    for f in findings:
        if _RANK[f.severity] > _RANK[worst]:
            worst = f.severity
    return worst


def format_findings(findings: Iterable[Finding], *, min_severity: Severity = "ok") -> str:
    """Findings as text, most serious first, dropping those below ``min_severity``."""
    kept = [f for f in findings if _RANK[f.severity] >= _RANK[min_severity]]
    kept.sort(key=lambda f: -_RANK[f.severity])
    return "\n".join(str(f) for f in kept) if kept else "(no findings)"


# --------------------------------------------------------------------------------------------
# Host-sync detection
# --------------------------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_SKIP_FILES = (_THIS_FILE, contextlib.__file__, threading.__file__)


@dataclass(frozen=True)
class SyncPoint:
    """One place where a step makes the host wait for the device.

    ``op`` names what synchronised (``"Tensor.item"``, ``"aten.nonzero"``, ...), ``location``
    is the first frame outside torch (``"file.py:12 in fn"``), ``code`` its source line,
    ``via`` the torch function in between when the sync happened inside torch, and ``count``
    how often it happened in the probed step.
    """

    op: str
    location: str
    code: str | None = None
    via: str | None = None
    count: int = 1

    @property
    def fix(self) -> str:
        """How to remove this sync point."""
        op = self.op
        if op.startswith(("Tensor.item", "Tensor.tolist", "Tensor.numpy", "Tensor.cpu",
                          "to(cpu)", "copy to cpu")):
            return ("keep the value on the device and read it only when logging (the step "
                    "returns device tensors; accelfn.Monitor reads them every log_every "
                    "steps); replace Python branches on tensor values with torch.where / "
                    "masking")
        if any(k in op for k in ("nonzero", "masked_select", "index", "unique", "repeat")):
            return ("boolean-mask indexing and data-dependent shapes need the host: use "
                    "torch.where(mask, x, 0) or multiply by the mask and divide by "
                    "mask.sum() instead of x[mask]; pass output_size= to repeat_interleave")
        if "equal" in op:
            return "compare on the device with (a == b).all() and keep the result as a tensor"
        if "grad_scaler" in (self.via or ""):
            return ("torch.amp.GradScaler.step reads found_inf on the host; use bf16 "
                    "(with_amp(dtype=torch.bfloat16)) which needs no loss scaling, or "
                    "accelfn's device-side non-finite policy")
        return ("find the line above and keep its tensors on the device; use "
                "non_blocking=True copies from pinned memory for host-to-device transfers")

    def __str__(self) -> str:
        times = f" x{self.count}" if self.count > 1 else ""
        via = f" (via {self.via})" if self.via else ""
        code = f"  `{self.code}`" if self.code else ""
        return f"{self.op}{times} at {self.location}{via}{code}"


def _display(path: str) -> str:
    """``path`` relative to the working directory when below it, else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if rel.startswith("..") else rel


def _caller_site() -> tuple[str, str | None, str | None]:
    """(location, code, via) of the first frame outside torch and this module."""
    frame = sys._getframe(2)
    via: str | None = None
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename.startswith(_TORCH_DIR):
            rel = filename[len(_TORCH_DIR):]
            plumbing = rel.startswith("_") and not rel.startswith("_tensor_str")
            plumbing = plumbing or rel.startswith(("utils" + os.sep + "_", "overrides.py"))
            if via is None and not plumbing:
                via = f"torch/{rel}:{frame.f_code.co_name}"
            frame = frame.f_back
            continue
        if filename in _SKIP_FILES or frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
            continue
        code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() or None
        return f"{_display(filename)}:{frame.f_lineno} in {frame.f_code.co_name}", code, via
    return "<unknown>", None, via


# aten operators that make the host wait on a CUDA device (their output shape or value is
# needed on the host). The emulated probe reports them wherever they run.
_SYNC_OPS = {
    "_local_scalar_dense": "Tensor.item (or bool()/float()/int() of a tensor)",
    "nonzero": "aten.nonzero",
    "nonzero_static": None,
    "masked_select": "aten.masked_select",
    "_unique": "aten.unique",
    "_unique2": "aten.unique",
    "unique_dim": "aten.unique",
    "unique_consecutive": "aten.unique_consecutive",
    "equal": "aten.equal",
    "is_nonzero": "Tensor.item (or bool()/float()/int() of a tensor)",
}


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


class _EmulatedSyncMode(TorchDispatchMode):
    """Records aten operators that would synchronise a CUDA device."""

    def __init__(self, probe: SyncProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        op: str | None = None
        if name in _SYNC_OPS:
            op = _SYNC_OPS[name]
        elif name == "repeat_interleave" and isinstance(args[0], Tensor) and \
                kwargs.get("output_size") is None and len(args) < 4:
            op = "aten.repeat_interleave (no output_size)"
        elif name in ("index", "index_put", "index_put_") and _has_bool_index(args[1]):
            op = "boolean-mask indexing (aten.index)"
        elif name == "_to_copy" and args[0].device.type != "cpu" and \
                str(kwargs.get("device", args[0].device)) == "cpu":
            op = "to(cpu)"
        elif name == "copy_" and args[0].device.type == "cpu" and \
                args[1].device.type != "cpu" and not (args[2] if len(args) > 2 else
                                                      kwargs.get("non_blocking", False)):
            op = "copy to cpu"
        if op is not None and not self.probe._in_method.active:
            self.probe._record(op)
        return func(*args, **kwargs)


# Emulation cannot tell a tensor that would live on the GPU from one that stays on the CPU
# by design. torch's optimizers keep their step counters on the CPU and read them with
# ``.item()``: not a sync on a GPU, so not reported.
_CPU_BY_DESIGN = ("torch/optim/",)
# The non-finite guard's deferred read (fused optimizers): flags copied to pinned host memory
# one update earlier, read after their event has completed. Reading host memory is not a
# sync on a GPU; emulation would report it because everything is a CPU tensor there.
_DEFERRED_BY_DESIGN = (f"accelfn{os.sep}core{os.sep}engine.py", " in settle")


class _InMethod(threading.local):
    active: bool = False


class SyncProbe:
    """Context manager listing host-device sync points in the code it encloses.

    >>> with SyncProbe() as probe:
    ...     metrics = step(state, batch)
    >>> probe.syncs            # [SyncPoint('Tensor.item', 'train.py:31 in my_step', ...)]

    ``mode="cuda"`` uses ``torch.cuda.set_sync_debug_mode("warn")`` and records torch's
    warnings; ``mode="emulate"`` intercepts, on any device, the aten operators that
    synchronise a GPU (``_local_scalar_dense`` behind ``item``/``bool``/``float``, ``nonzero``,
    ``masked_select``, ``unique``, boolean-mask indexing, ...) and the ``Tensor.cpu``,
    ``Tensor.numpy`` and ``Tensor.tolist`` methods (patched only while the probe is active).
    ``"auto"`` picks ``"cuda"`` when CUDA is available and ``"emulate"`` otherwise.
    ``allow`` lists substrings of locations (or ops) whose syncs you accept.

    The probe slows the step it encloses; run it on one step, not all of them. Emulation
    uses a ``TorchDispatchMode``: run it on an eager (not ``torch.compile``-d) step. As it
    cannot tell which tensors would live on a GPU, it ignores reads inside ``torch.optim``
    (optimizers keep their step counters on the CPU on purpose).
    """

    def __init__(self, mode: Literal["auto", "cuda", "emulate"] = "auto", *,
                 allow: Iterable[str] = ()) -> None:
        if mode not in ("auto", "cuda", "emulate"):
            raise ValueError(f"SyncProbe(mode={mode!r}): use 'auto', 'cuda' or 'emulate'")
        if mode == "auto":
            mode = "cuda" if torch.cuda.is_available() else "emulate"
        self.mode: str = mode
        self.allow = tuple(allow)
        self._counts: dict[tuple[str, str], list[Any]] = {}
        self._in_method = _InMethod()
        self._stack: contextlib.ExitStack | None = None
        self._warnings: list[warnings.WarningMessage] | None = None
        self._prev_debug_mode: int = 0

    @property
    def syncs(self) -> list[SyncPoint]:
        """The sync points seen, in the order first seen, merged by (op, location).

        Points whose location, ``via`` or op contains one of the ``allow`` strings are left
        out (syncs you accept, e.g. a documented read once per step).
        """
        out = [SyncPoint(op, loc, code, via, n)
               for (op, loc), (code, via, n) in self._counts.items()]
        return [s for s in out if not any(a in f"{s.location} {s.via} {s.op}"
                                          for a in self.allow)]

    def _record(self, op: str) -> None:
        loc, code, via = _caller_site()
        if self.mode == "emulate" and via is not None and via.startswith(_CPU_BY_DESIGN):
            return
        if self.mode == "emulate" and loc.endswith(_DEFERRED_BY_DESIGN[1]) \
                and _DEFERRED_BY_DESIGN[0] in loc:
            return
        entry = self._counts.get((op, loc))
        if entry is None:
            self._counts[(op, loc)] = [code, via, 1]
        else:
            entry[2] += 1

    def _patch(self, stack: contextlib.ExitStack, name: str, op: str) -> None:
        original = getattr(torch.Tensor, name)
        probe = self

        def wrapper(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            if probe._in_method.active:
                return original(self, *args, **kwargs)
            probe._record(op)
            probe._in_method.active = True
            try:
                return original(self, *args, **kwargs)
            finally:
                probe._in_method.active = False

        wrapper.__name__ = name
        wrapper.__doc__ = original.__doc__
        setattr(torch.Tensor, name, wrapper)
        stack.callback(setattr, torch.Tensor, name, original)

    def __enter__(self) -> SyncProbe:
        stack = contextlib.ExitStack()
        if self.mode == "cuda":
            self._prev_debug_mode = torch.cuda.get_sync_debug_mode()
            self._warnings = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            stack.callback(torch.cuda.set_sync_debug_mode, self._prev_debug_mode)
        else:
            for name, op in (("cpu", "Tensor.cpu"), ("numpy", "Tensor.numpy"),
                             ("tolist", "Tensor.tolist")):
                self._patch(stack, name, op)
            stack.enter_context(_EmulatedSyncMode(self))
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None
        if self._warnings is not None:
            for w in self._warnings:
                text = str(w.message)
                if "synchroniz" not in text:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
                    continue
                loc = f"{_display(os.path.abspath(w.filename))}:{w.lineno}"
                code = linecache.getline(w.filename, w.lineno).strip() or None
                key = ("cuda sync: " + text.splitlines()[0][:80], loc)
                entry = self._counts.setdefault(key, [code, None, 0])
                entry[2] += 1
            self._warnings = None

    def findings(self) -> list[Finding]:
        """One warning per sync point, or one ``ok`` finding when there were none."""
        if not self.syncs:
            return [Finding("host_syncs", "ok",
                            f"no host-device sync points in the probed step ({self.mode})")]
        return [Finding("host_syncs", "warning", f"host sync: {s}", s.fix) for s in self.syncs]


# --------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------


def _layer_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else "(root)"


def _layer_groups(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[str],
                                             list[int]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layers: list[str] = []
    index: list[int] = []
    for n, _ in named:
        layer = _layer_of(n)
        if layer not in layers:
            layers.append(layer)
        index.append(layers.index(layer))
    return named, layers, index


def _group_norms(norms: Sequence[Tensor], index: Sequence[int], n_layers: int) -> Tensor:
    """Per-layer L2 norms from per-parameter norms (on their device, no host read)."""
    stacked = torch.stack([n.float() for n in norms])
    idx = torch.tensor(list(index), device=stacked.device)
    sq = torch.zeros(n_layers, device=stacked.device).index_add_(0, idx, stacked * stacked)
    return sq.sqrt()


def layer_grad_norms(model: nn.Module) -> dict[str, Tensor]:
    """Per-layer L2 norms of the current ``.grad`` of ``model``, as device scalars.

    A layer is a module owning parameters directly (``"encoder.0"`` holds ``weight`` and
    ``bias``). Nothing is read on the host; call ``float()`` on the values when reporting.
    Parameters without a gradient are left out.
    """
    named, _, _ = _layer_groups(model)
    with_grad = [(n, p) for n, p in named if p.grad is not None]
    if not with_grad:
        return {}
    layers: list[str] = []
    index: list[int] = []
    for n, _ in with_grad:
        if _layer_of(n) not in layers:
            layers.append(_layer_of(n))
        index.append(layers.index(_layer_of(n)))
    with torch.no_grad():
        norms = torch._foreach_norm([p.grad for _, p in with_grad])  # type: ignore[misc]
        grouped = _group_norms(norms, index, len(layers))
    return dict(zip(layers, grouped.unbind(0)))


class _DiagnosticsTransform:
    """The accelfn step-transform form of :class:`Diagnostics` (see ``Diagnostics.transform``).

    It reads gradients in the step's ``on_grads`` phase, after loss-scale unscaling and
    micro-batch weighting (orders 0 and 10) and before clipping (30), so the norms are the
    true, unclipped gradients of the update.
    """

    name = "diagnostics"
    grads_order = 20

    def __init__(self, diag: Diagnostics) -> None:
        self.diag = diag

    def on_grads(self, ctx: Any) -> None:
        if self.diag._armed:
            self.diag._capture_from_grads()

    def __repr__(self) -> str:
        return f"diagnostics(every={self.diag.every})"


@dataclass
class DiagnosticsReport:
    """What :meth:`Diagnostics.report` found.

    ``layer_norms`` holds the last sampled per-layer gradient norm, ``history`` every sample
    as ``{"step": s, "norms": {layer: norm}}``, ``inputs`` per-key statistics of the sampled
    batches and ``labels`` the class counts seen in them.
    """

    findings: list[Finding]
    layer_norms: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    inputs: dict[str, dict[str, float]] = field(default_factory=dict)
    labels: dict[int, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = asdict(self)
        out["findings"] = [f.to_dict() for f in self.findings]
        out["labels"] = {str(k): v for k, v in self.labels.items()}
        return out

    def __str__(self) -> str:
        lines = ["Training diagnostics", "===================="]
        if self.layer_norms:
            lines.append("gradient norm per layer (last sample):")
            width = max(len(k) for k in self.layer_norms)
            for k, v in self.layer_norms.items():
                lines.append(f"  {k:<{width}}  {v:.3e}")
        for key, st in self.inputs.items():
            lines.append(f"input {key}: min {st['min']:.3g} max {st['max']:.3g} "
                         f"mean {st['mean']:.3g} std {st['std']:.3g}")
        if self.labels:
            lines.append("labels: " + ", ".join(f"{k}:{v}" for k, v in
                                                sorted(self.labels.items())))
        lines.append(format_findings(self.findings))
        return "\n".join(lines)


_LABEL_KEYS = ("label", "labels", "target", "targets", "y")


def _batch_tensors(batch: Any) -> list[tuple[str, Tensor]]:
    """Flat (key, tensor) pairs of a TensorDict, mapping or (inputs, labels) sequence."""
    if hasattr(batch, "items") and callable(batch.items):
        try:
            items = batch.items(include_nested=True, leaves_only=True)  # TensorDict
        except TypeError:
            items = batch.items()
        out = []
        for k, v in items:
            key = ".".join(k) if isinstance(k, tuple) else str(k)
            if isinstance(v, Tensor):
                out.append((key, v))
            elif isinstance(v, Mapping):
                out.extend((f"{key}.{kk}", vv) for kk, vv in _batch_tensors(v))
        return out
    if isinstance(batch, Tensor):
        return [("input", batch)]
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        tensors = [b for b in batch if isinstance(b, Tensor)]
        if len(tensors) >= 2 and not tensors[-1].is_floating_point():
            return [(f"input{i}" if len(tensors) > 2 else "input", t)
                    for i, t in enumerate(tensors[:-1])] + [("label", tensors[-1])]
        return [(f"input{i}", t) for i, t in enumerate(tensors)]
    return []


def _split_batch(batch: Any, label_key: str | None) -> tuple[list[tuple[str, Tensor]],
                                                            Tensor | None]:
    pairs = _batch_tensors(batch)
    labels = None
    inputs = []
    for k, v in pairs:
        is_label = (k == label_key) if label_key else (
            k.rsplit(".", 1)[-1] in _LABEL_KEYS and not v.is_floating_point())
        if is_label and labels is None:
            labels = v
        elif v.numel() > 1 and (v.is_floating_point() or v.dtype == torch.uint8):
            inputs.append((k, v))
    return inputs, labels


def _input_stats(x: Tensor) -> Tensor:
    """[min, max, mean, std, all_finite, integer_valued] on the device, float32."""
    f = x.detach().float()
    finite = torch.isfinite(f).all().float()
    g = torch.nan_to_num(f, nan=0.0, posinf=0.0, neginf=0.0)
    integral = (g == g.round()).all().float()
    return torch.stack([g.amin(), g.amax(), g.mean(),
                        g.std() if g.numel() > 1 else g.new_zeros(()), finite, integral])


def _input_findings(key: str, dtype: torch.dtype, st: Sequence[float]) -> list[Finding]:
    lo, hi, _mean, std, finite, integral = st
    out: list[Finding] = []
    if finite < 1:
        out.append(Finding("inputs", "error", f"input {key!r} contains NaN or Inf",
                           "check the data source and any division in preprocessing"))
    if dtype == torch.uint8 or (lo >= 0 and 2 < hi <= 255 and integral >= 1):
        what = "is uint8" if dtype == torch.uint8 else f"holds integers in [{lo:g}, {hi:g}]"
        out.append(Finding(
            "inputs", "warning" if dtype != torch.uint8 else "info",
            f"input {key!r} {what}: looks like unnormalised 0-255 pixels",
            "normalise on the device before the model: x.float().div(255).sub(mean).div(std) "
            "(accelfn.data's GPU preprocessing does this for whole batches)"))
    elif max(abs(lo), abs(hi)) > 1e3:
        out.append(Finding("inputs", "warning",
                           f"input {key!r} spans [{lo:.3g}, {hi:.3g}]: large magnitudes slow "
                           "convergence and overflow fp16",
                           "standardise it: (x - mean) / std computed over the training set"))
    elif std == 0 and hi == lo:
        out.append(Finding("inputs", "warning", f"input {key!r} is constant ({lo:g})",
                           "check the loader: every sample has the same value"))
    return out


def _label_findings(counts: dict[int, int], num_classes: int | None,
                    imbalance: float) -> list[Finding]:
    if not counts:
        return []
    total = sum(counts.values())
    present = {k: v for k, v in counts.items() if v > 0}
    out: list[Finding] = []
    if len(present) == 1 and total > 1:
        (only,) = present
        out.append(Finding("labels", "warning",
                           f"every sampled label is class {only} ({total} samples)",
                           "shuffle the data (sampler shuffle=True) and check the label key"))
        return out
    if num_classes is not None:
        missing = [c for c in range(num_classes) if counts.get(c, 0) == 0]
        if missing and total >= 10 * num_classes:
            out.append(Finding("labels", "warning",
                               f"classes never seen in {total} sampled labels: "
                               f"{missing[:10]}{'...' if len(missing) > 10 else ''}",
                               "check num_classes and the label mapping"))
    lo, hi = min(present.values()), max(present.values())
    if hi / lo > imbalance:
        out.append(Finding("labels", "warning",
                           f"labels are imbalanced: most frequent class {hi} vs least {lo} "
                           f"samples ({hi / lo:.0f}x)",
                           "re-weight the loss (cross_entropy(weight=...)) or sample with "
                           "torch.utils.data.WeightedRandomSampler"))
    if not out:
        out.append(Finding("labels", "ok",
                           f"{len(present)} classes, most/least frequent ratio {hi / lo:.1f}"))
    return out


class Diagnostics:
    """Samples gradients and data every ``every`` steps; reports problems on demand.

    >>> diag = Diagnostics(model, every=100)
    >>> for batch in loader:
    ...     metrics = step(state, batch)
    ...     diag.step(metrics, batch)
    >>> print(diag.report())

    On a sampled step, per-parameter gradient norms are taken in a
    ``register_post_accumulate_grad_hook`` as soon as backward has finished accumulating
    each gradient (so it also works when the step sets gradients to ``None`` after the
    update). The hooks exist only during sampled steps: other steps run untouched. With
    fp16 loss scaling the hook sees scaled gradients; a ``loss_scale`` metric passed to
    :meth:`step` is divided out. Alternatively add :attr:`transform` to an accelfn step: it
    reads the unscaled, micro-batch-weighted, unclipped gradients inside the step.

    Gradients are sampled before any all-reduce (per-rank values) under DDP.

    Args:
        model: the model whose gradients and initialisation are checked.
        every: sample one step in ``every`` (the first step is always sampled).
        explode: a layer whose gradient norm exceeds this is exploding.
        vanish: a layer whose gradient norm is below this (but not zero) is vanishing.
        ratio: a layer ``ratio`` times above (below) the median layer norm is an outlier.
        label_key / num_classes: which batch key holds integer labels (found by name
            ``label(s)``/``target(s)``/``y`` when not given) and how many classes there are.
        imbalance: the most/least frequent class ratio above which labels are imbalanced.
        check_initialisation: run :func:`check_init` now, before training changes weights.
    """

    def __init__(self, model: nn.Module, *, every: int = 100, explode: float = 1e3,
                 vanish: float = 1e-7, ratio: float = 1e3, label_key: str | None = None,
                 num_classes: int | None = None, imbalance: float = 10.0,
                 check_initialisation: bool = True) -> None:
        if every < 1:
            raise ValueError(f"Diagnostics(every={every}): sample at least every 1 step")
        self.model = model
        self.every = every
        self.explode = explode
        self.vanish = vanish
        self.ratio = ratio
        self.label_key = label_key
        self.num_classes = num_classes
        self.imbalance = imbalance
        self._named, self._layers, self._index = _layer_groups(model)
        self._steps = 0
        self._armed = False
        self._unscaled = False
        self._handles: list[Any] = []
        self._param_norms: dict[int, Tensor] = {}
        self._samples: list[tuple[int, Tensor, list[bool], frozenset[str]]] = []
        self._inputs: dict[str, tuple[torch.dtype, list[Tensor]]] = {}
        self._labels: list[Tensor] = []
        self.init_findings = check_init(model) if check_initialisation else []
        self._arm()

    @property
    def transform(self) -> _DiagnosticsTransform:
        """A step transform (accelfn protocol: ``on_grads`` at ``grads_order`` 20)."""
        return _DiagnosticsTransform(self)

    # -- sampling -----------------------------------------------------------------------------

    def _arm(self) -> None:
        self._armed = True
        self._param_norms = {}
        for i, (_, p) in enumerate(self._named):
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook(i)))

    def _hook(self, i: int) -> Any:
        def hook(p: Tensor) -> None:
            if p.grad is not None:
                with torch.no_grad():
                    self._param_norms[i] = torch.linalg.vector_norm(p.grad.detach().float())
        return hook

    def _disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._armed = False

    def _capture_from_grads(self) -> None:
        self._unscaled = True
        with torch.no_grad():
            for i, (_, p) in enumerate(self._named):
                if p.grad is not None:
                    self._param_norms[i] = torch.linalg.vector_norm(p.grad.detach().float())

    def step(self, metrics: Mapping[str, Any] | None = None, batch: Any = None) -> None:
        """Mark the end of one training step (cheap unless this step is sampled).

        On a sampled step this stacks the gradient norms seen (on the device) and, when a
        ``batch`` is given, its input statistics and labels. Nothing is read on the host.
        """
        if self._armed:
            self._disarm()
            norms, self._param_norms = self._param_norms, {}
            unscaled, self._unscaled = self._unscaled, False
            missing = frozenset(self._named[i][0] for i in range(len(self._named))
                                if i not in norms)
            if norms:
                idx = sorted(norms)
                grouped = _group_norms([norms[i] for i in idx],
                                       [self._index[i] for i in idx], len(self._layers))
                scale = metrics.get("loss_scale") if metrics is not None and hasattr(
                    metrics, "get") else None
                if isinstance(scale, Tensor) and not unscaled:
                    grouped = grouped / scale.float().to(grouped.device)
                present = [False] * len(self._layers)
                for i in idx:
                    present[self._index[i]] = True
                self._samples.append((self._steps, grouped, present, missing))
            if batch is not None:
                self._sample_batch(batch)
        self._steps += 1
        if self._steps % self.every == 0:
            self._arm()

    def _sample_batch(self, batch: Any) -> None:
        inputs, labels = _split_batch(batch, self.label_key)
        with torch.no_grad():
            for key, x in inputs:
                self._inputs.setdefault(key, (x.dtype, []))[1].append(_input_stats(x))
            if labels is not None:
                self._labels.append(labels.detach().reshape(-1).clone())

    # -- reporting ----------------------------------------------------------------------------

    def report(self) -> DiagnosticsReport:
        """Read the samples (the only host reads) and turn them into findings."""
        findings: list[Finding] = list(self.init_findings)
        history: list[dict[str, Any]] = []
        unused: set[str] = set()
        for step, norms, present, missing in self._samples:
            values = norms.tolist()
            history.append({"step": step, "norms": {k: v for k, v, ok in
                                                    zip(self._layers, values, present) if ok}})
            unused |= missing
        findings += self._grad_findings(history)
        if unused and history:
            findings.append(Finding(
                "gradients", "info",
                f"{len(unused)} parameter(s) got no gradient on sampled steps: "
                f"{sorted(unused)[:5]}{'...' if len(unused) > 5 else ''}",
                "unused parameters: remove them, or DDP needs find_unused_parameters=True"))
        inputs: dict[str, dict[str, float]] = {}
        for key, (dtype, stats) in self._inputs.items():
            mat = torch.stack(stats)  # on the device: one host read per key, below
            agg = torch.stack([mat[:, 0].min(), mat[:, 1].max(), mat[:, 2].mean(),
                               mat[:, 3].mean(), mat[:, 4].min(), mat[:, 5].min()]).tolist()
            inputs[key] = dict(zip(("min", "max", "mean", "std"), agg[:4]))
            findings += _input_findings(key, dtype, agg)
        counts: dict[int, int] = {}
        if self._labels:
            labels = torch.cat(self._labels).long().cpu()  # one transfer
            if labels.numel() and labels.min() >= 0:
                bins = torch.bincount(labels, minlength=self.num_classes or 0).tolist()
                counts = dict(enumerate(bins))
                if self.num_classes is None:
                    counts = {k: v for k, v in counts.items() if v}
                findings += _label_findings(counts, self.num_classes, self.imbalance)
        last = history[-1]["norms"] if history else {}
        return DiagnosticsReport(findings, dict(last), history, inputs, counts)

    def _grad_findings(self, history: list[dict[str, Any]]) -> list[Finding]:
        if not history:
            return [Finding("gradients", "info", "no gradients sampled yet",
                            "call diag.step() after each training step")]
        out: list[Finding] = []
        flagged: set[tuple[str, str]] = set()

        def add(kind: str, layer: str, sev: Severity, msg: str, fix: str) -> None:
            if (kind, layer) not in flagged:
                flagged.add((kind, layer))
                out.append(Finding("gradients", sev, msg, fix))

        explode_fix = ("clip gradients (accelfn.with_clipping(max_norm=1.0)), lower the "
                       "learning rate or warm it up, check this layer's initialisation and "
                       "any unnormalised input feeding it")
        vanish_fix = ("use residual connections and normalisation layers, ReLU/GELU instead "
                      "of saturating activations, and a Kaiming/Xavier initialisation")
        for sample in history:
            step, norms = sample["step"], sample["norms"]
            finite = [v for v in norms.values() if math.isfinite(v)]
            median = sorted(finite)[len(finite) // 2] if finite else 0.0
            # Next to exploding layers every normal layer looks small: compare with the
            # median only when nothing in this sample explodes.
            exploding = any(not math.isfinite(v) or v > self.explode or
                            (median > 0 and v > self.ratio * median) for v in norms.values())
            for layer, v in norms.items():
                if not math.isfinite(v):
                    add("nonfinite", layer, "error",
                        f"non-finite gradient in layer {layer!r} at step {step}",
                        "enable the non-finite policy (skip the update) and fix the source: "
                        "log(0), division by zero or fp16 overflow")
                elif v > self.explode:
                    add("explode", layer, "error",
                        f"exploding gradient in layer {layer!r} at step {step}: norm "
                        f"{v:.3e} > {self.explode:g}", explode_fix)
                elif median > 0 and v > self.ratio * median:
                    add("explode", layer, "warning",
                        f"layer {layer!r} gradient norm {v:.3e} is {v / median:.0f}x the "
                        f"median layer ({median:.3e}) at step {step}", explode_fix)
                elif v == 0:
                    add("dead", layer, "warning",
                        f"layer {layer!r} has an all-zero gradient at step {step}",
                        "dead units (ReLU stuck at 0), a detached branch or a zero-initialised "
                        "layer after which nothing learns")
                elif v < self.vanish or (not exploding and median > 0
                                         and v < median / self.ratio):
                    add("vanish", layer, "warning",
                        f"vanishing gradient in layer {layer!r} at step {step}: norm "
                        f"{v:.3e} (median layer {median:.3e})", vanish_fix)
        if len(history) >= 2:
            first, last = history[0]["norms"], history[-1]["norms"]
            tot0 = math.sqrt(sum(v * v for v in first.values() if math.isfinite(v)))
            tot1 = math.sqrt(sum(v * v for v in last.values() if math.isfinite(v)))
            if tot0 > 0 and tot1 > 100 * tot0:
                out.append(Finding("gradients", "warning",
                                   f"total gradient norm grew {tot1 / tot0:.0f}x from step "
                                   f"{history[0]['step']} to {history[-1]['step']}",
                                   explode_fix))
        if not out:
            v = history[-1]["norms"]
            finite = [x for x in v.values() if math.isfinite(x)]
            rng = f"{min(finite):.2e}..{max(finite):.2e}" if finite else "n/a"
            out.append(Finding("gradients", "ok",
                               f"{len(history)} sample(s), layer gradient norms {rng}"))
        return out

    def close(self) -> None:
        """Remove any hooks still registered."""
        self._disarm()


# --------------------------------------------------------------------------------------------
# On-demand checks
# --------------------------------------------------------------------------------------------


def _fan_in(w: Tensor) -> int:
    return int(w.shape[1] * (w[0][0].numel() if w.dim() > 2 else 1))


def check_init(model: nn.Module, *, low: float = 0.1, high: float = 10.0) -> list[Finding]:
    """Check weights of linear and convolution layers against ``1/sqrt(fan_in)``.

    For a layer with fan-in ``n``, common initialisations give a weight std between about
    ``0.4/sqrt(n)`` (Xavier with a wide output) and ``1.4/sqrt(n)`` (Kaiming for ReLU);
    PyTorch's default is ``0.58/sqrt(n)``. A ratio ``std * sqrt(n)`` outside
    ``[low, high]``, all-zero or constant weights, and NaN/Inf in any parameter are reported.
    Reads values on the host: call it once, not per step.
    """
    out: list[Finding] = []
    checked: list[tuple[str, Tensor]] = []
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, Tensor) or w.dim() < 2 or isinstance(mod, nn.Embedding):
            continue
        if isinstance(mod, (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd)) or \
                type(mod).__name__.endswith(("Linear", "Conv1d", "Conv2d", "Conv3d")):
            checked.append((name or "(root)", w))
    if checked:
        with torch.no_grad():
            stats = torch.stack([torch.stack([w.detach().float().std(),
                                              w.detach().float().abs().amax()])
                                 for _, w in checked]).tolist()
        for (name, w), (std, amax) in zip(checked, stats):
            fan_in = _fan_in(w)
            ratio = std * math.sqrt(fan_in)
            if amax == 0:
                out.append(Finding(
                    "init", "warning", f"layer {name!r} weights are all zero",
                    "zero weights give zero gradients to everything before this layer; use "
                    "the default or nn.init.kaiming_normal_ unless zero-init is intended "
                    "(last layer of a residual branch)"))
            elif std == 0 or not math.isfinite(std):
                out.append(Finding("init", "error" if not math.isfinite(std) else "warning",
                                   f"layer {name!r} weights are constant or non-finite",
                                   "identical weights stay identical (no symmetry breaking): "
                                   "initialise randomly, e.g. nn.init.kaiming_normal_"))
            elif not (low <= ratio <= high):
                out.append(Finding(
                    "init", "warning",
                    f"layer {name!r} weight std {std:.3g} is {ratio:.3g}/sqrt(fan_in="
                    f"{fan_in}); expected about 0.4-1.4/sqrt(fan_in)",
                    "re-initialise with nn.init.kaiming_normal_(w, nonlinearity='relu') or "
                    "nn.init.xavier_uniform_(w), or remove the custom scaling"))
    nonfinite = [n for n, p in model.named_parameters()
                 if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all())]
    if nonfinite:
        out.append(Finding("init", "error", f"non-finite values in parameters {nonfinite[:5]}",
                           "reload the checkpoint or re-initialise these parameters"))
    if not out:
        out.append(Finding("init", "ok", f"{len(checked)} linear/conv layer(s) initialised "
                           "within 0.1-10x of 1/sqrt(fan_in)"))
    return out


def check_batch(batch: Any, *, label_key: str | None = None, num_classes: int | None = None,
                imbalance: float = 10.0) -> list[Finding]:
    """Check one batch now: input ranges (unnormalised or non-finite) and label balance.

    ``batch`` is a TensorDict, a mapping of tensors or an ``(inputs, labels)`` sequence.
    Reads values on the host: call it on demand, e.g. on the first batch.
    """
    inputs, labels = _split_batch(batch, label_key)
    out: list[Finding] = []
    with torch.no_grad():
        for key, x in inputs:
            out += _input_findings(key, x.dtype, _input_stats(x).tolist())
        if labels is not None:
            lab = labels.detach().reshape(-1).long().cpu()
            if lab.numel() and lab.min() >= 0:
                bins = torch.bincount(lab, minlength=num_classes or 0).tolist()
                counts = {k: v for k, v in enumerate(bins) if v or num_classes}
                out += _label_findings(counts, num_classes, imbalance)
    if not out:
        out.append(Finding("inputs", "ok", f"{len(inputs)} input tensor(s) in range"))
    return out


def check_model(model: nn.Module) -> list[Finding]:
    """:func:`check_init` plus the distributed BatchNorm check of the seeds' checklist.

    Under an initialised ``torch.distributed`` group of more than one process, plain
    BatchNorm layers normalise with per-GPU statistics; they should be SyncBatchNorm.
    """
    out = check_init(model)
    bns = [n for n, m in model.named_modules()
           if isinstance(m, nn.modules.batchnorm._BatchNorm)
           and not isinstance(m, nn.SyncBatchNorm)]
    dist = torch.distributed
    if bns and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out.append(Finding(
            "sync_batchnorm", "warning",
            f"{len(bns)} BatchNorm layer(s) use per-GPU statistics in a "
            f"{dist.get_world_size()}-process run: {bns[:3]}",
            "model = nn.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping in DDP"))
    return out
