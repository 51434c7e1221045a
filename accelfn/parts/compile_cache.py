"""The compile cache file of ``compiled(cache=path)``: compiled code that survives restarts.

The file is ``torch.compiler.save_cache_artifacts()``'s bytes and a zip of the C++ kernels
this process loaded from inductor's cache directory, behind a one-line JSON header naming
the torch version and the device kind (with the CPU's vector instruction set) they were
compiled for. torch's artifacts hold the generated code but not inductor's
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
from pathlib import Path
from typing import Any

import torch

from ..core import compat
from ..core.processes import is_main_process
from ..core.state import TrainState

__all__ = ["CacheFile", "load", "pack_kernels", "read_cache", "save", "unpack_kernels",
           "write_cache"]

_SLOT = "compiled_cache"
_MAGIC = b"accelfn compile cache\n"
_FORMAT = 2
# A kernel in inductor's cache directory (<key[1:3]>/<key>.<suffixes>.so|.o) or ISA probe mark
_KERNEL = re.compile(r"[a-z0-9]{2}/[a-z0-9]+(\.[a-z0-9_]+)*\.(so|o|so\.load_ok)")
# A header inductor precompiled, in its header directory: <hash>.h and <hash>.h.gch
_HEADERS = "precompiled_headers"
_HEADER = re.compile(_HEADERS + r"/[a-z0-9]+\.h(\.gch)?")
# Counters that grow when inductor or AOTAutograd compiled something the caches did not hold.
_MISSES = (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss"))


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


def load(path: Path, device: torch.device, state: TrainState) -> None:
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


def save(path: Path, device: torch.device, state: TrainState) -> None:
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


