"""compiled: torch.compile of the model (whole, or block by block) and, on request, of the
optimizer step; its compiled code kept in a file that survives restarts.

Regional compilation (``regional=True``) compiles each repeated block of the model (found by
[`find_blocks`][], as ``checkpointed`` and FSDP find them) in place and leaves the rest eager:
the blocks run through one compiled function whose code dynamo caches once for every block of
a class, so compile time stays that of one block whatever the depth.

The compile cache (``cache=path``) is ``torch.compiler.save_cache_artifacts()``'s bytes behind
a one-line JSON header naming the torch version and the device kind they were compiled for.
The file is loaded (``torch.compiler.load_cache_artifacts``) before the first compiled step
when its header matches this run, and written atomically (temporary file, ``os.replace``) by
the main process after the first update, and again after any later update that compiled new
code (a cache miss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, overload

import torch
from torch import Tensor, nn

from ..core import compat
from ..core.engine import LossFn, Step
from ..core.modules import find_blocks, wrap_forward
from ..core.processes import is_main_process
from ..core.protocol import Hooks, Prepared, Transform, UpdateContext, configure
from ..core.state import TrainState

__all__ = ["compiled"]

CachePath = str | os.PathLike[str]
_SLOT = "compiled_cache"
_MAGIC = b"accelfn compile cache\n"
_FORMAT = 1
# Counters that grow when inductor or AOTAutograd compiled something the caches did not hold.
_MISSES = (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss"))


# ----------------------------------------------------------------------- regional compilation
def _call_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The region compiled for each block: its forward, with the wrappers of earlier phases
    (activation checkpointing) inside it and its module hooks (FSDP2's) outside."""
    return forward(*args, **kwargs)


def _run_compiled(module: nn.Module, forward: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> Any:
    compiled_call: Callable[..., Any] = module.__dict__["_accelfn_compiled"]
    return compiled_call(forward, *args, **kwargs)


def _compile_blocks(model: nn.Module, kwargs: dict[str, Any]) -> int:
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(
            f"compiled(regional=True) found no repeated blocks in {type(model).__name__} "
            "(children of an nn.ModuleList or nn.Sequential that share a class and have "
            "parameters); use compiled() to compile the whole model")
    # One compiled function for all blocks: dynamo keys its code on _call_forward's code and
    # guards on the block's class, not on the block, so blocks of a class share one graph.
    compiled_call = torch.compile(_call_forward, **kwargs)
    for _, block in blocks:
        block.__dict__["_accelfn_compiled"] = compiled_call
        wrap_forward(block, "compile", _run_compiled)
    return len(blocks)


# ----------------------------------------------------------------------- the cache file
def _fingerprint(device: torch.device) -> dict[str, str]:
    """What compiled code depends on beyond the model: torch's version and the device kind."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kind = f"cuda {props.name} sm_{props.major}{props.minor}"
    else:
        kind = f"{device.type} {platform.machine()}"
    found = {"torch": str(torch.__version__), "device": kind}
    if device.type == "cuda":  # Triton compiled the kernels: its version counts too
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found["triton"] = importlib.metadata.version("triton")
    return found


def read_cache(path: Path, expected: dict[str, str]) -> tuple[bytes | None, str | None]:
    """The artifacts in ``path`` when it was written for ``expected`` (see ``_fingerprint``);
    otherwise None and why not (None, None: there is no file)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    if not data.startswith(_MAGIC):
        return None, "is not an accelfn compile cache"
    end = data.find(b"\n", len(_MAGIC))
    try:
        header = json.loads(data[len(_MAGIC):end])
    except ValueError:
        header = None
    if end < 0 or not isinstance(header, dict):
        return None, "has a damaged header"
    if header.get("format") != _FORMAT:
        return None, f"has format {header.get('format')!r}, not {_FORMAT}"
    wrong = [f"{key} {header.get(key)!r} (this run: {value!r})"
             for key, value in expected.items() if header.get(key) != value]
    if wrong:
        return None, "was compiled for " + ", ".join(wrong)
    payload = data[end + 1:]
    if len(payload) != header.get("bytes") or \
            hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        return None, "is truncated or damaged"
    return payload, None


def write_cache(path: Path, fingerprint: dict[str, str], payload: bytes) -> None:
    """Write ``payload`` behind its header to ``path`` atomically: a reader sees the old file
    or the new one, never a part (temporary file beside it, fsync, ``os.replace``)."""
    header = {"format": _FORMAT, **fingerprint, "bytes": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _misses() -> int:
    counters = compat.compile_counters()
    return sum(counters.get(group, {}).get(key, 0) for group, key in _MISSES)


class _CacheRecord:
    """What ``compiled(cache=...)`` knows of this process' compiled code: the cache misses
    counted when the file was last loaded or written (None: it must be written at the next
    update). Not checkpointed: it describes this process, not the training."""

    def __init__(self) -> None:
        self.misses: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


def _load_cache(path: Path, device: torch.device, state: TrainState) -> None:
    record: _CacheRecord = state.slot(_SLOT, _CacheRecord)
    if path.is_dir():
        raise ValueError(f"compiled(cache={str(path)!r}) names a directory; name the file, "
                         f"e.g. compiled(cache={str(path / 'compile-cache.bin')!r})")
    payload, problem = read_cache(path, _fingerprint(device))
    if payload is not None and torch.compiler.load_cache_artifacts(payload) is None:
        problem = "could not be read by torch.compiler.load_cache_artifacts"
    if problem is not None:
        state.warn_once(_SLOT, (
            f"the compile cache {path} {problem}: compiling from scratch; the file will be "
            "replaced after the first update"))
        record.misses = None
    elif payload is not None:
        record.misses = _misses()  # hits from here on are the file's; misses are new code


def _save_cache(path: Path, device: torch.device, state: TrainState) -> None:
    record: _CacheRecord = state.slot(_SLOT, _CacheRecord)
    misses = _misses()
    if record.misses is not None and misses <= record.misses:
        return
    record.misses = misses
    if not is_main_process():
        return
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is None:  # nothing compiled by inductor in this process
        return
    try:
        write_cache(path, _fingerprint(device), artifacts[0])
    except OSError as error:
        state.warn_once(f"{_SLOT}.write", (
            f"the compile cache could not be written to {path} ({error}); training goes on, "
            "and a restart will compile from scratch"))


# ----------------------------------------------------------------------- the transform
def _compiled(mode: str | None, fullgraph: bool, dynamic: bool | None, backend: str,
              optimizer: bool, options: dict[str, Any] | None, regional: bool,
              cache: Path | None) -> Transform:
    def compile(prepared: Prepared, state: TrainState) -> Prepared:
        if cache is not None:
            _load_cache(cache, prepared.device, state)
        kwargs: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic,
                                  "backend": backend}
        if options:
            kwargs["options"] = options
        else:
            kwargs["mode"] = mode
        model = prepared.model
        if regional:  # in place, inside any DDP wrapper and FSDP2's per-block hooks
            _compile_blocks(state.model, kwargs)
        else:
            model = torch.compile(model, **kwargs)  # type: ignore[assignment]
        if not optimizer:
            return dataclasses.replace(prepared, model=model)
        for group in state.optimizer.param_groups:
            # A tensor learning rate lets schedulers change it without recompiling.
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]))
        inner = prepared.optimizer_step

        @torch.compile(fullgraph=False, backend=backend)
        def optimizer_step() -> None:
            inner()

        return dataclasses.replace(prepared, model=model, optimizer_step=optimizer_step)

    def after_update(ctx: UpdateContext, skipped: Tensor) -> None:
        assert cache is not None
        _save_cache(cache, ctx.device, ctx.state)

    hooks = Hooks(compile=compile)
    if cache is not None:
        hooks["after_update"] = after_update
    parts = [p for p in (
        mode,
        "fullgraph" if fullgraph else None,
        None if dynamic is None else f"dynamic={dynamic}",
        None if backend == "inductor" else backend,
        "optimizer" if optimizer else None,
        "regional" if regional else None,
        None if cache is None else "cache",
    ) if p]
    return Transform(
        "compiled", hooks,
        options=(("mode", mode), ("fullgraph", fullgraph), ("dynamic", dynamic),
                 ("backend", backend), ("optimizer", optimizer), ("options", options),
                 ("regional", regional), ("cache", None if cache is None else str(cache))),
        label=f"compiled({', '.join(parts)})" if parts else "compiled")


@overload
def compiled(fn: LossFn | Step, /) -> Step: ...
@overload
def compiled(*, mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None,
             backend: str = "inductor", optimizer: bool = False,
             options: dict[str, Any] | None = None, regional: bool = False,
             cache: CachePath | None = None) -> Transform: ...
def compiled(
    fn: LossFn | Step | None = None,
    /,
    *,
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    backend: str = "inductor",
    optimizer: bool = False,
    options: dict[str, Any] | None = None,
    regional: bool = False,
    cache: CachePath | None = None,
) -> Step | Transform:
    """Equivalent to ``model = torch.compile(model, mode=..., fullgraph=..., dynamic=...)``
    before the loop (and, with ``optimizer=True``, ``torch.compile`` of ``optimizer.step``
    with the learning rate held as a tensor so that schedules never recompile).

    The compiled model is what the step function receives, in training and in
    ``step.evaluate``; the wrap happens once, after checkpoint wrapping and after DDP/FSDP,
    whatever the stacking order. Steps of equal shapes do not recompile.

    ``regional=True`` instead compiles each repeated block in place (``torch.compile`` of the
    block's forward, one compiled code shared by the blocks of a class) and runs the rest of
    the model eager: compile time is that of one block whatever the depth; ``state_dict``
    keys do not change. ``cache=path`` keeps the compiled code in a file (put it in the
    checkpoint directory): loaded before the first compiled step when it was written by the
    same torch version for the same device kind (otherwise a warning, and a fresh compile),
    written atomically after the first update, so a restarted job starts warm.
    """
    if mode is not None and mode not in compat.compile_modes():
        raise ValueError(f"compiled(mode={mode!r}) is unknown; use one of {compat.compile_modes()}")
    if mode is not None and options is not None:
        raise ValueError("compiled takes mode or options, not both (torch.compile's rule)")
    if not all(isinstance(b, bool) for b in (fullgraph, optimizer, regional)):
        raise TypeError("compiled(fullgraph=..., optimizer=..., regional=...) take booleans")
    if dynamic not in (None, True, False):
        raise TypeError("compiled(dynamic=...) takes None, True or False")
    backends = compat.compile_backends()
    if backend not in backends:
        raise ValueError(f"compiled(backend={backend!r}) is unknown; use one of {backends}")
    path = None
    if cache is not None:
        if not isinstance(cache, (str, os.PathLike)) or not os.fspath(cache):
            raise TypeError(f"compiled(cache={cache!r}) takes the path of a file, e.g. "
                            "compiled(cache='runs/x/compile-cache.bin')")
        if backend != "inductor":
            raise ValueError(f"compiled(cache=...) keeps inductor's compiled code, and "
                             f"backend={backend!r} makes none; use backend='inductor' or "
                             "leave cache out")
        path = Path(os.fspath(cache))
    return configure("compiled", fn, _compiled(mode, fullgraph, dynamic, backend, optimizer,
                                               options, regional, path))
