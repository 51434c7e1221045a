"""captured's options and mechanism: one update recorded as CUDA graphs and replayed.

A replay reruns the device work that was recorded, on the same memory, and no Python: what
the update decides on the host (a value read with ``.item()``, a shape that depends on the
data, a rate held as a Python float) is fixed at the recording. This module holds what
makes that safe: the options ([`Capture`][]), the refusals of a state whose update a replay
cannot reproduce ([`check`][]), the host reads stopped where they happen during the warm-up
calls ([`host_reads_refused`][]), the learning rates made device tensors a scheduler writes
in place ([`device_rates`][]), what a recording depends on ([`fingerprint`][]), and the
recorder of CUDA graphs ([`CudaGraphs`][]). The engine's captured sequence is
``accelfn.step.captured``; ``accelfn.testing.TapeRecorder`` replays on the CPU.

torch has the graphs (``torch.cuda.CUDAGraph``) and a compiler that records them per
compiled region (``torch.compile(mode="reduce-overhead")``), but nothing that records a
whole training update with its optimizer step and decides what may be recorded: that is
written here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from ..core import compat
from ..core.state import TrainState

__all__ = ["Capture", "CudaGraphs", "Recorder", "changed", "check", "fingerprint",
           "host_read_error", "host_reads_refused", "prepare_optimizers", "uncaptured_steps"]

T = TypeVar("T")


class Recorder(Protocol):
    """Records the device work of functions called in turn and replays each (``CudaGraphs``;
    on the CPU, ``accelfn.testing.TapeRecorder``). ``record`` runs ``fn`` once, its device
    work recorded and not applied, and returns its outputs (tensors each replay rewrites in
    place; a later recording may read them); ``replay(i)`` applies the ``i``-th recording
    once more (the recordings replayed in the order they were made); ``warming`` surrounds
    the calls before the recording."""

    def warming(self) -> contextlib.AbstractContextManager[Any]: ...
    def record(self, fn: Callable[[], T]) -> T: ...
    def replay(self, index: int) -> None: ...


@dataclass(frozen=True, slots=True, repr=False)
class Capture:
    """``captured``'s options: the eager updates before the recording (``warmup``: the first
    finds host reads, the others let lazy state, compiled code and libraries' workspaces
    settle) and the ``recorder`` (None: CUDA graphs)."""

    warmup: int = 3
    recorder: Callable[[torch.device], Recorder] | None = None

    def __post_init__(self) -> None:
        warmup = self.warmup
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"captured(warmup={warmup!r}) must be an int >= 1: the eager "
                             "updates run before the update is recorded")
        if self.recorder is not None and not callable(self.recorder):
            raise TypeError(f"captured(recorder={self.recorder!r}) takes a class or function "
                            "recorder(device) (accelfn.testing.TapeRecorder on the CPU)")

    def __repr__(self) -> str:
        extra = [] if self.warmup == 3 else [f"warmup={self.warmup}"]
        if self.recorder is not None:
            extra.append(getattr(self.recorder, "__name__", repr(self.recorder)))
        return f"captured({', '.join(extra)})" if extra else "captured"


def check(options: Capture, state: TrainState, checks_flags: bool) -> None:
    """Refuse a state whose update cannot be recorded, before anything changes: no CUDA
    device (and no recorder given), or an optimizer that cannot run in a graph (its step
    counter on the host) or, when the update is checked for NaN/Inf (``checks_flags``),
    cannot skip on the device."""
    device = state.device
    if options.recorder is None and device.type != "cuda":
        raise ValueError(
            f"captured() records the update as CUDA graphs, and the model is on {device}; "
            "move it to a CUDA device, or test the captured step on the CPU with "
            "captured(recorder=accelfn.testing.TapeRecorder)")
    for optimizer in state.optimizers:
        for group in optimizer.param_groups:
            fused, capturable = group.get("fused"), group.get("capturable")
            name = type(optimizer).__name__
            if checks_flags and not (fused and compat.step_supports_amp_scaling(optimizer)):
                raise ValueError(
                    f"captured() skips a non-finite update on the device, which {name} "
                    f"cannot do unless fused: build it with fused=True (e.g. "
                    "torch.optim.AdamW(params, fused=True)), or leave the check out with "
                    "with_nonfinite(policy='off')")
            if not (fused or capturable):
                raise ValueError(
                    f"captured() replays {name}'s step, which counts its steps on the host "
                    f"unless fused or capturable: build it with fused=True or "
                    "capturable=True")


# the device tensor made for each group's rate, kept so that a float put back into the group
# (a hand-written schedule, load_state_dict) is filled into it rather than a new tensor
_RATES: weakref.WeakKeyDictionary[TrainState, dict[int, tuple[dict[str, Any], Tensor]]] = (
    weakref.WeakKeyDictionary())


def prepare_optimizers(state: TrainState) -> None:
    """Make the optimizers' groups what a recording replays, before each call: every learning
    rate a tensor on its parameters' device (torch's schedulers fill it in place, and each
    replay reads it; a float put back is filled into the same tensor), and every fused group
    ``capturable`` (torch refuses a step inside a capture otherwise; the fused kernel
    computes the same with it)."""
    made = _RATES.get(state, {})
    kept: dict[int, tuple[dict[str, Any], Tensor]] = {}
    for optimizer in state.optimizers:
        for group in optimizer.param_groups:
            lr, params = group["lr"], group["params"]
            device = params[0].device if params else state.device
            if isinstance(lr, Tensor):
                if lr.device != device:
                    group["lr"] = lr.detach().to(device)
            else:
                old = made.get(id(group))
                if old is not None and old[0] is group and old[1].device == device:
                    old[1].fill_(float(lr))
                    group["lr"] = old[1]
                else:
                    group["lr"] = torch.tensor(float(lr), device=device)
            kept[id(group)] = (group, group["lr"])
            if group.get("fused") and not group.get("capturable", True):
                group["capturable"] = True
    _RATES[state] = kept


@contextlib.contextmanager
def uncaptured_steps() -> Iterator[None]:
    """Around the warm-up calls' optimizer steps: torch warns once that a capturable
    optimizer stepped outside a capture, which is what a warm-up is for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*without .* graph capture")
        yield


def fingerprint(state: TrainState) -> tuple[tuple[str, Any], ...]:
    """What a recording holds fixed and a call may have changed since, each entry named: the
    optimizers' state and groups (``load_state_dict`` replaces them), their hyperparameters
    (recorded as numbers), their rates' tensors, and where each parameter's data lives."""
    out: list[tuple[str, Any]] = []
    for optimizer in state.optimizers:
        name = type(optimizer).__name__
        out.append((f"{name}'s state", id(optimizer.state)))
        for i, group in enumerate(optimizer.param_groups):
            where = f"{name}'s group {i}"
            out.append((where, id(group)))
            out.extend((f"{where} {k!r}", id(v) if isinstance(v, Tensor) else v)
                       for k, v in group.items() if k != "params")
            out.append((f"{where}'s parameters' memory",
                        tuple(p.data_ptr() for p in group["params"])))
    return tuple(out)


def changed(before: tuple[tuple[str, Any], ...], after: tuple[tuple[str, Any], ...]
            ) -> list[str]:
    """The names of the entries of two fingerprints that differ (all of them when the
    optimizers' groups are not the same ones)."""
    if [name for name, _ in before] != [name for name, _ in after]:
        return ["the optimizers' groups"]
    return [name for (name, a), (_, b) in zip(before, after) if a != b]


# ----------------------------------------------------------------- host reads
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


def _host_read(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why running ``op`` on ``args`` reads the device on the host (None: it does not)."""
    name = op.overloadpacket.__name__
    tags = op.tags
    if torch.Tag.data_dependent_output in tags or name == "is_nonzero":
        return "reads a tensor's value on the host (.item(), bool(), float(), if tensor:)"
    indices = (args[1] if len(args) > 1 and name in _INDEXING else None) or ()
    if indices and isinstance(args[0], Tensor) and args[0].device.type != "cpu" and any(
            isinstance(i, Tensor) and i.device.type == "cpu" and i.dim() > 0 for i in indices):
        return ("indexes a device tensor by a tensor on the host, which is copied to the "
                "device at each call (make the index on the device: device=...)")
    if torch.Tag.dynamic_output_shape in tags:
        if name in _INDEXING and not any(
                isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in indices):
            return None  # indexing by integer tensors: its shape is the index's
        return (f"makes a tensor whose shape depends on the values ({name}: a boolean mask, "
                "nonzero, unique, masked_select)")
    if name in ("_to_copy", "copy_") and args and isinstance(args[0], Tensor):
        source = args[1] if name == "copy_" else args[0]
        target = args[0].device if name == "copy_" else kwargs.get("device")
        target_cpu = target is not None and torch.device(target).type == "cpu"
        if isinstance(source, Tensor) and source.device.type != "cpu" and target_cpu:
            return "copies a tensor to the host (.cpu(), .tolist(), .numpy())"
        if isinstance(source, Tensor) and source.device.type == "cpu" and \
                target is not None and torch.device(target).type != "cpu":
            return ("copies a tensor from the host to the device (.to(device), .cuda(), a "
                    "tensor made without device=), which a replay would not repeat")
    return None


def _site() -> str:
    """The innermost frame outside torch and accelfn: where the user's code read."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((_TORCH_DIR, _OURS)) and not path.startswith("<"):
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def host_read_error(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> RuntimeError | None:
    """The refusal of aten operator ``op`` run on ``args`` when it reads the device on the
    host, naming the line that ran it (None: it does not)."""
    what = _host_read(op, args, kwargs)
    return None if what is None else _refused(what, _site())


def _refused(what: str, where: str) -> RuntimeError:
    return RuntimeError(
        f"captured(): the update {what}, at {where}. A recorded update replays without its "
        "Python, so the value read now would be used by every replay; the update was not "
        "applied. Keep the value on the device (torch.where instead of a branch, a mask "
        "multiplied in instead of indexing by it, metrics returned as tensors), or leave "
        "captured() out")


_METHODS = (("tolist", "copies a tensor to the host (.tolist())"),
            ("numpy", "copies a tensor to the host (.numpy())"),
            ("cpu", "copies a tensor to the host (.cpu())"))


@contextlib.contextmanager
def host_reads_refused(device: torch.device) -> Iterator[None]:
    """Raise at the first host read of the device inside the block, naming it and the line
    that made it. On the CPU, where ``.tolist()``, ``.numpy()`` and ``.cpu()`` dispatch no
    operator, those methods are stopped too (patched while the block runs)."""
    def handle(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        error = host_read_error(op, args, kwargs)
        if error is not None:
            raise error
        return op(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        if device.type == "cpu":
            for method, what in _METHODS:
                stack.callback(setattr, Tensor, method, getattr(Tensor, method))
                setattr(Tensor, method, _stopped(what))
        stack.enter_context(compat.aten_interceptor(handle))
        yield


def _stopped(what: str) -> Callable[..., Any]:
    def method(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        raise _refused(what, _site())
    return method


# ----------------------------------------------------------------- CUDA graphs
class CudaGraphs:
    """The recorder of CUDA graphs: warm-up calls on a side stream, each recording a
    ``torch.cuda.graph`` (the later ones in the first one's memory pool, as graphs replayed
    in the order they were captured may share it), replayed on the current stream. Other
    threads' CUDA calls (a data pipeline's) go on during a recording
    (``capture_error_mode="thread_local"``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # torch's default capture stream is one for the process, made on the device current
        # when first used: each recorder records on a stream of its own device
        self.capture = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.graphs: list[torch.cuda.CUDAGraph] = []

    @contextlib.contextmanager
    def warming(self) -> Iterator[None]:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:  # what the warm-up call did is done before the current stream goes on
            current.wait_stream(self.stream)

    def record(self, fn: Callable[[], T]) -> T:
        graph = torch.cuda.CUDAGraph()
        pool = self.graphs[0].pool() if self.graphs else None
        current = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.device(self.device), torch.cuda.graph(
                    graph, pool=pool, stream=self.capture, capture_error_mode="thread_local"):
                out = fn()
        finally:  # a capture that CUDA invalidated raises before torch puts the stream back
            if torch.cuda.current_stream(self.device) != current:
                torch.cuda.set_stream(current)
        self.graphs.append(graph)
        return out

    def replay(self, index: int) -> None:
        self.graphs[index].replay()
