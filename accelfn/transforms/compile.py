"""compiled: torch.compile of the model (whole, or block by block) and, on request, of the
optimizer step; its compiled code kept in a file that survives restarts.

Regional compilation (``regional=True``) compiles the code of the model's repeated blocks
(found by [`find_blocks`][], as ``checkpointed`` and FSDP find them) once, so compile time does
not grow with depth. In one process the whole model is compiled with every block a nested
compile region (``torch.compiler.nested_compile_region``: torch's hierarchical compilation,
one traced and compiled region called for each block), so the step runs as one graph, at the
whole model's speed. Under DDP or FSDP2 each block is compiled in place instead, inside the
wrappers and per-block hooks the sharding put there, and the rest stays eager: the blocks run
through one compiled function whose code dynamo caches once for every block of a class. So
too with a backend that does not compile through AOTAutograd (``"eager"``): torch's
invoke_subgraph, run as traced, traces its region again at every call to build its schema;
and for blocks that update running statistics in training (BatchNorm's: a torchvision
ResNet's), whose buffer updates torch's nested regions refuse.

The compile cache (``cache=path``) is ``torch.compiler.save_cache_artifacts()``'s bytes and a
zip of the C++ kernels this process loaded from inductor's cache directory, behind a one-line
JSON header naming the torch version and the device kind (with the CPU's vector instruction
set) they were compiled for. torch's artifacts hold the generated code but not inductor's
compiled C++ kernels, which a fresh machine would rebuild; the zip puts them (and the results
of inductor's probes of the CPU's vector instructions) back where inductor looks for them
(``<cache dir>/<key[1:3]>/<key>.so``, only when missing), with the C++ header inductor
precompiled during this run (``precompiled_headers/<hash>.h.gch``, ~150 MB, ~25 MB zipped;
6 s to rebuild on a 2-core CPU even when every kernel is found; its name hashes the header,
the compiler and the flags, so another toolchain never uses it). The file is loaded before
the first compiled step when its header matches this run, and written atomically (temporary
file, ``os.replace``) by the main process after the first update, and again after any later
update that compiled new code (a cache miss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import re
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, overload

import torch
from torch import Tensor, nn

from ..core import compat
from ..core.engine import LossFn, Step
from ..core.modules import find_blocks, inner_forward, running_stat_modules, wrap_forward
from ..core.processes import is_main_process
from ..core.protocol import Hooks, Prepared, Transform, UpdateContext, configure
from ..core.state import TrainState

__all__ = ["compiled"]

CachePath = str | os.PathLike[str]
_SLOT = "compiled_cache"
_MAGIC = b"accelfn compile cache\n"
_FORMAT = 2
# A kernel in inductor's cache directory (<key[1:3]>/<key>.<suffixes>.so|.o) or ISA probe mark
_KERNEL = re.compile(r"[a-z0-9]{2}/[a-z0-9]+(\.[a-z0-9_]+)*\.(so|o|so\.load_ok)")
# A header inductor precompiled, in its header directory: <hash>.h and <hash>.h.gch
_HEADERS = "precompiled_headers"
_HEADER = re.compile(_HEADERS + r"/[a-z0-9]+\.h(\.gch)?")
# The backends that compile a nested region once (AOTAutograd's); others: blocks in place.
_NESTING = frozenset({"inductor", "aot_eager", "aot_eager_decomp_partition"})
# Counters that grow when inductor or AOTAutograd compiled something the caches did not hold.
_MISSES = (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss"))


# ----------------------------------------------------------------------- regional compilation
def _call_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The region compiled for each block: its forward, with the wrappers of earlier phases
    (activation checkpointing) inside it and its module hooks (FSDP2's) outside."""
    return forward(*args, **kwargs)


def _run_compiled(module: nn.Module, forward: Callable[..., Any], *args: Any,
                  **kwargs: Any) -> Any:
    return module.__dict__["_accelfn_compiled"](forward, *args, **kwargs)


def _block_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The nested region: ``module``'s forward with the wrappers of earlier phases inside,
    reached through ``module`` so that each block's parameters are the region's inputs (a
    forward bound to one block would be replayed with that block's weights for all)."""
    return inner_forward(module, "compile")(*args, **kwargs)


# Hierarchical compilation: inside a whole-model torch.compile, every block runs through this
# one nested compile region, traced and compiled once and called for each block.
_NESTED = torch.compiler.nested_compile_region(_block_forward)


def _run_nested(module: nn.Module, forward: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    return _NESTED(module, *args, **kw)


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(
            f"compiled(regional=True) found no repeated blocks in {type(model).__name__} "
            "(children of an nn.ModuleList or nn.Sequential that share a class and have "
            "parameters); use compiled() to compile the whole model")
    return blocks


def _wrap_blocks(model: nn.Module, kwargs: dict[str, Any], done: tuple[Any, ...]) -> None:
    """Each block compiled in place when ``done[0]`` (under DDP/FSDP2, inside their wrappers
    and hooks), otherwise marked as the nested compile region of a whole-model compile."""
    # One compiled function for all blocks: dynamo keys its code on _call_forward's code and
    # guards on the block's class, not on the block, so blocks of a class share one graph.
    compiled_call = torch.compile(_call_forward, **kwargs) if done[0] else None
    for _, block in _blocks(model):
        block.__dict__["_accelfn_regional"] = done
        if compiled_call is not None:
            block.__dict__["_accelfn_compiled"] = compiled_call
        wrap_forward(block, "compile", _run_compiled if done[0] else _run_nested)


def _check_regional(state: TrainState, backend: str, options: str, label: str) -> None:
    """Refuse a regional compile of blocks an earlier step compiled otherwise (in place, they
    hold one compiled function; nested regions hold no options, each step's compile has)."""
    blocks = _blocks(state.model)
    in_place, sharded, before, by = blocks[0][1].__dict__.get("_accelfn_regional", (None,) * 4)
    here = sharded or backend not in _NESTING or any(running_stat_modules(b) for _, b in blocks)
    if in_place is not None and (here != in_place or (here and options != before)):
        where = ("as nested regions", "in place")
        raise ValueError(
            f"{label} would compile the blocks {where[here]}, but another step on this "
            f"TrainState compiled them {where[in_place]} with {by} (in place: one compiled "
            "function for every step); use the same compiled(regional=True, ...) options in "
            "every step of a state, or build a new TrainState")


# ----------------------------------------------------------------------- the cache file
def _fingerprint(device: torch.device) -> dict[str, str]:
    """What compiled code depends on beyond the model: torch's version and the device kind
    (for a CPU, the vector instruction set inductor generates code for)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kind = f"cuda {props.name} sm_{props.major}{props.minor}"
    elif device.type == "cpu":
        kind = f"cpu {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
    else:
        kind = f"{device.type} {platform.machine()}"
    found = {"torch": str(torch.__version__), "device": kind}
    if device.type == "cuda":  # Triton compiled the kernels: its version counts too
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found["triton"] = importlib.metadata.version("triton")
    return found


@dataclasses.dataclass(frozen=True)
class CacheFile:
    """A compile cache file's contents: torch's artifacts, and a zip of compiled C++ kernels
    (paths relative to inductor's cache directory; empty when there are none)."""

    artifacts: bytes
    kernels: bytes = b""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_cache(path: Path, expected: dict[str, str]) -> tuple[CacheFile | None, str | None]:
    """The contents of ``path`` when it was written for ``expected`` (see ``_fingerprint``);
    otherwise None and why not (None, None: there is no file)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as error:  # a directory now, unreadable: compile from scratch
        return None, f"could not be read ({error})"
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
    body = data[end + 1:]
    size, kernel_size = header.get("bytes"), header.get("kernel_bytes")
    if not isinstance(size, int) or not isinstance(kernel_size, int) or size < 0 \
            or len(body) != size + kernel_size:
        return None, "is truncated or damaged"
    artifacts, kernels = body[:size], body[size:]
    if _digest(artifacts) != header.get("sha256") or \
            _digest(kernels) != header.get("kernel_sha256"):
        return None, "is truncated or damaged"
    return CacheFile(artifacts, kernels), None


def write_cache(path: Path, fingerprint: dict[str, str], contents: CacheFile) -> None:
    """Write ``contents`` behind its header to ``path`` atomically: a reader sees the old file
    or the new one, never a part (temporary file beside it, fsync, ``os.replace``)."""
    header = {"format": _FORMAT, **fingerprint, "bytes": len(contents.artifacts),
              "sha256": _digest(contents.artifacts), "kernel_bytes": len(contents.kernels),
              "kernel_sha256": _digest(contents.kernels)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n")
            f.write(contents.artifacts)
            f.write(contents.kernels)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def pack_kernels(since: float) -> bytes:
    """A zip of the compiled C++ kernels this process loaded (b"" when none), with the CPU
    vector instruction set probes that passed (the file's fingerprint names the instruction
    set, so they hold wherever the file is loaded) and, under ``precompiled_headers/``, the
    C++ headers inductor precompiled at or after ``since``."""
    files = compat.inductor_cpp_kernel_files()
    if not files:
        return b""
    files += compat.inductor_isa_probe_files()
    root = Path(compat.inductor_cache_dir())
    headers = Path(compat.inductor_header_dir())
    buffer = io.BytesIO()
    # level 1: a precompiled header is ~150 MB that deflates to ~25 MB in under 2 s at this
    # level, twice as fast as the default level for 10% more bytes
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for name in files:
            archive.write(root / name, name)
        for name in compat.inductor_precompiled_headers(since):
            archive.write(headers / name, f"{_HEADERS}/{name}")
    return buffer.getvalue()


def _target(name: str) -> Path | None:
    """Where a name of a :func:`pack_kernels` zip goes (None: not a kernel's or a header's)."""
    if _KERNEL.fullmatch(name):
        return Path(compat.inductor_cache_dir()) / name
    if _HEADER.fullmatch(name):
        return Path(compat.inductor_header_dir()) / name.split("/", 1)[1]
    return None


def unpack_kernels(kernels: bytes) -> list[str]:
    """Put the kernels and headers of a :func:`pack_kernels` zip where inductor looks for
    them, leaving files already there alone; returns the names written. Raises ValueError on
    a name that is not a kernel's or a header's, before writing anything."""
    if not kernels:
        return []
    written = []
    with zipfile.ZipFile(io.BytesIO(kernels)) as archive:
        targets = {name: _target(name) for name in archive.namelist()}
        bad = [name for name, target in targets.items() if target is None]
        if bad:
            raise ValueError(f"holds files that are not compiled kernels: {bad[:3]}")
        for name, target in targets.items():
            assert target is not None
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            try:
                tmp.write_bytes(archive.read(name))
                tmp.chmod(0o755)
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            written.append(name)
    return written


def _misses() -> int:
    counters = compat.compile_counters()
    return sum(counters.get(group, {}).get(key, 0) for group, key in _MISSES)


class _CacheRecord:
    """What ``compiled(cache=...)`` knows of this process' compiled code: the cache misses
    counted when the file was last loaded or written (None: it must be written at the next
    update). Not checkpointed: it describes this process, not the training."""

    def __init__(self) -> None:
        self.misses: int | None = None
        self.started = time.time()  # headers inductor precompiles from here on are this run's

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None


def _load_cache(path: Path, device: torch.device, state: TrainState) -> None:
    record: _CacheRecord = state.slot(_SLOT, _CacheRecord)
    contents, problem = read_cache(path, _fingerprint(device))
    if contents is not None:
        try:
            unpack_kernels(contents.kernels)
        except (ValueError, zipfile.BadZipFile, OSError) as error:
            problem = f"has kernels that could not be restored ({error})"
        else:
            if torch.compiler.load_cache_artifacts(contents.artifacts) is None:
                problem = "could not be read by torch.compiler.load_cache_artifacts"
    if problem is not None:
        state.warn_once(_SLOT, (
            f"the compile cache {path} {problem}: compiling from scratch; the file will be "
            "replaced after the first update"))
        record.misses = None
    elif contents is not None:
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
        write_cache(path, _fingerprint(device),
                    CacheFile(artifacts[0], pack_kernels(record.started)))
    except OSError as error:
        state.warn_once(f"{_SLOT}.write", (
            f"the compile cache could not be written to {path} ({error}); training goes on, "
            "and a restart will compile from scratch"))


# ----------------------------------------------------------------------- the transform
def _tensor_lrs(optimizer: torch.optim.Optimizer) -> None:
    """Every learning rate a tensor: schedulers change it without recompiling the step."""
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]))


def _compiled(mode: str | None, fullgraph: bool, dynamic: bool | None, backend: str,
              optimizer: bool, options: dict[str, Any] | None, regional: bool,
              cache: Path | None) -> Transform:
    kwargs: dict[str, Any] = {"fullgraph": fullgraph, "dynamic": dynamic, "backend": backend,
                              **({"options": options} if options else {"mode": mode})}

    def compile(prepared: Prepared, state: TrainState) -> Prepared:
        if cache is not None:
            _load_cache(cache, prepared.device, state)
        model, sharded = prepared.model, prepared.process_group is not None
        # sharded: each block compiled in place, inside the DDP wrapper and FSDP2's per-block
        # hooks, the rest eager (a compile of a sharded whole model traces the sharding's
        # hooks); so too with a backend that runs dynamo's graph as traced, and for blocks
        # updating running statistics (BatchNorm's), which nested regions refuse in training.
        # Otherwise one graph: the blocks' code compiled once, called for each.
        in_place = regional and (sharded or backend not in _NESTING or any(
            running_stat_modules(b) for _, b in _blocks(state.model)))
        if regional:  # what the check of a later step's regional compile compares with
            _wrap_blocks(state.model, kwargs, (in_place, sharded, repr(kwargs), label))
        if not in_place:
            model = torch.compile(model, **kwargs)  # type: ignore[assignment]
        if not optimizer:
            return dataclasses.replace(prepared, model=model)
        _tensor_lrs(optim := state.optimizer)
        inner = prepared.optimizer_step
        compiled_step = torch.compile(lambda: inner(), fullgraph=False, backend=backend)

        def optimizer_step() -> None:
            _tensor_lrs(optim)  # again: optimizer.load_state_dict puts back float rates
            compiled_step()

        return dataclasses.replace(prepared, model=model, optimizer_step=optimizer_step)

    def after_update(ctx: UpdateContext, skipped: Tensor) -> None:
        assert cache is not None
        _save_cache(cache, ctx.device, ctx.state)

    parts = [p for p in (
        mode, "fullgraph" if fullgraph else None,
        None if dynamic is None else f"dynamic={dynamic}",
        None if backend == "inductor" else backend, "optimizer" if optimizer else None,
        "regional" if regional else None, None if cache is None else "cache",
    ) if p]
    label = f"compiled({', '.join(parts)})" if parts else "compiled"
    hooks = Hooks(compile=compile)
    if regional:
        hooks["check"] = lambda s: _check_regional(s, backend, repr(kwargs), label)
    if cache is not None:
        hooks["after_update"] = after_update
    return Transform(
        "compiled", hooks,
        options=(("mode", mode), ("fullgraph", fullgraph), ("dynamic", dynamic),
                 ("backend", backend), ("optimizer", optimizer), ("options", options),
                 ("regional", regional), ("cache", None if cache is None else str(cache))),
        label=label,
        # its after_update (with cache=) only writes the compile cache's file; the scaler's
        # update, the EMA average and float8's scale precompute neither compile nor read it
        commutes=frozenset({"with_amp", "with_ema", "with_float8"}))


def _checked_options(options: Any, backend: str) -> dict[str, Any]:
    """A copy of ``options``, refused when it is no dict of names inductor knows."""
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise TypeError(f"compiled(options={options!r}) takes a dict of inductor options, "
                        "e.g. options={'epilogue_fusion': True}")
    try:  # torch.compile checks the names when it is called, before tracing anything
        if backend == "inductor" and options:
            torch.compile(_call_forward, backend=backend, options=options)
    except RuntimeError as error:
        raise ValueError(f"compiled(options=...): {error}"[:600]) from None
    return dict(options)


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

    ``regional=True`` compiles each repeated block's code once, whatever the depth: the
    blocks become nested compile regions (``torch.compiler.nested_compile_region``) of the
    whole-model compile (traced and compiled once, called for each block; the step runs as
    one graph, at the whole model's speed). Under ``distributed``, and with a backend other
    than inductor or aot_eager (``"eager"`` runs the regions as traced, tracing them again
    at every call), it compiles each block in place instead (``torch.compile`` of the
    block's forward inside the DDP wrapper and FSDP2's hooks, one compiled code shared by
    the blocks of a class) and runs the rest eager. ``state_dict`` keys do not change.

    ``cache=path`` keeps the compiled code, with inductor's compiled C++ kernels, in a file
    (put it in the checkpoint directory): loaded before the first compiled step when it was
    written by the same torch version for the same device kind (otherwise a warning, and a
    fresh compile), written atomically after the first update, so a restarted job on a fresh
    machine starts warm.
    """
    if mode is not None and mode not in compat.compile_modes():
        raise ValueError(f"compiled(mode={mode!r}) is unknown; use one of {compat.compile_modes()}")
    if mode is not None and options is not None:
        raise ValueError("compiled takes mode or options, not both (torch.compile's rule)")
    if not all(isinstance(b, bool) for b in (fullgraph, optimizer, regional)):
        raise TypeError("compiled(fullgraph=..., optimizer=..., regional=...) take booleans")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError("compiled(dynamic=...) takes None, True or False")
    backends = compat.compile_backends()
    if not isinstance(backend, str) or backend not in backends:
        raise ValueError(f"compiled(backend={backend!r}) is unknown; use one of {backends}")
    if options is not None:
        options = _checked_options(options, backend)
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
        if path.is_dir():
            raise ValueError(f"compiled(cache={str(path)!r}) names a directory; name the "
                             f"file, e.g. compiled(cache={str(path / 'compile-cache.bin')!r})")
    return configure("compiled", fn, _compiled(mode, fullgraph, dynamic, backend, optimizer,
                                               options, regional, path))
