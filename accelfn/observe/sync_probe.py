"""Host-sync detection: :class:`SyncProbe` lists where a step makes the host wait.

The probe runs around one step and lists every point where the step forces the host to wait
for the device (``.item()``, ``.cpu()``, ``bool(tensor)``, boolean-mask indexing, ...). On a
GPU it uses torch's own ``torch.cuda.set_sync_debug_mode("warn")``; on the CPU, where nothing
ever synchronises, it *emulates* the check by intercepting the aten operators and ``Tensor``
methods that would synchronise on a GPU, so the same mistakes are caught by CPU tests.

Reads of data already copied to the host (marked with
:func:`accelfn.core.syncs.deferred_read`) are left out of the emulated report.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal

import torch
from torch import Tensor

from ..core import compat
from ..core.syncs import GUARD_READ, in_deferred_read, read_label
from .findings import Finding

__all__ = ["SyncPoint", "SyncProbe"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_SKIP_FILES = (_THIS_FILE, os.path.abspath(compat.__file__), contextlib.__file__,
               threading.__file__)


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
        if self.via == GUARD_READ:
            return ("the non-finite guard reads its flags on the host once per update because "
                    "this optimizer cannot skip an update on the device: build it fused, e.g. "
                    "torch.optim.AdamW(params, fused=True) (Adam, AdamW and SGD have a fused "
                    "form) for a device-side skip, or drop the check with "
                    "with_nonfinite(policy='off')")
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
    frame: FrameType | None = sys._getframe(2)
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


def _emulated_sync(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """What the aten operator ``name`` called with ``args`` would synchronise on a CUDA
    device, as the op name reported (``None``: no sync)."""
    if name in _SYNC_OPS:
        return _SYNC_OPS[name]
    if name == "repeat_interleave" and isinstance(args[0], Tensor) and \
            kwargs.get("output_size") is None and len(args) < 4:
        return "aten.repeat_interleave (no output_size)"
    if name in ("index", "index_put", "index_put_") and _has_bool_index(args[1]):
        return "boolean-mask indexing (aten.index)"
    if name == "_to_copy" and args[0].device.type != "cpu" and \
            str(kwargs.get("device", args[0].device)) == "cpu":
        return "to(cpu)"
    if name == "copy_" and args[0].device.type == "cpu" and args[1].device.type != "cpu" and \
            not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
        return "copy to cpu"
    return None


# Emulation cannot tell a tensor that would live on the GPU from one that stays on the CPU
# by design. torch's optimizers keep their step counters on the CPU and read them with
# ``.item()``: not a sync on a GPU, so not reported.
_CPU_BY_DESIGN = ("torch/optim/",)
# Reads of data copied to the host earlier (the non-finite guard's deferred read with fused
# optimizers) are no syncs on a GPU; emulation would report them because everything is a CPU
# tensor there. Their code marks them with accelfn.core.syncs.deferred_read, which the
# emulated probe honours (in_deferred_read), wherever that code lives.


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
        if self.mode == "emulate" and in_deferred_read():
            return
        loc, code, via = _caller_site()
        if self.mode == "emulate" and via is not None and via.startswith(_CPU_BY_DESIGN):
            return
        via = read_label() or via
        entry = self._counts.get((op, loc))
        if entry is None:
            self._counts[(op, loc)] = [code, via, 1]
        else:
            entry[2] += 1

    def _on_aten(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        op = _emulated_sync(name, args, kwargs)
        if op is not None and not self._in_method.active:
            self._record(op)

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
            stack.enter_context(compat.aten_observer(self._on_aten))
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

