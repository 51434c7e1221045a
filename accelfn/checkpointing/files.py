"""Atomic files and digests: writing, fsyncing, checksumming, listing and rotating checkpoints.

A save writes into a hidden temporary directory, fsyncs every file and the directory, renames
it to its final name and writes the ``COMMITTED`` marker (the size and SHA-256 of every file)
last. ``checkpoints()`` and ``latest()`` only see directories with a marker, and
``read_verified()`` hands out a file's bytes only when they match it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .format import (
    MARKER,
    MAX_JSON_BYTES,
    TMP_PREFIX,
    CheckpointError,
    check_marker,
    loads_json,
    parse_name,
)

__all__ = [
    "check_files",
    "checkpoints",
    "digest",
    "digest_file",
    "final_name",
    "fsync_dir",
    "is_committed",
    "latest",
    "memory_available",
    "read_torch",
    "read_verified",
    "remove_checkpoint",
    "rotate",
    "verify_written",
    "write_bytes",
    "write_json",
    "write_torch",
]

Digest = dict[str, Any]
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
Digests = dict[str, Digest]


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed, deleted files) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms that cannot open directories (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def digest(data: bytes) -> Digest:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def digest_file(path: Path) -> Digest:
    """Size and SHA-256 of a file, read in chunks (a symbolic link is not followed)."""
    h, size = hashlib.sha256(), 0
    with os.fdopen(os.open(path, os.O_RDONLY | _NOFOLLOW), "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def write_torch(path: Path, obj: Any) -> Digest:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    write_bytes(path, data)
    return digest(data)


def write_json(path: Path, obj: Any) -> Digest:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    write_bytes(path, data)
    return digest(data)


def verify_written(root: Path, listed: Mapping[str, Digest]) -> None:
    """Raise OSError unless every file in ``listed`` is in ``root`` as written: a regular file
    (not a link) of the recorded size and SHA-256. What a save checks before it commits."""
    for rel, expected in sorted(listed.items()):
        file = root / rel
        try:
            info = os.lstat(file)
            problem = None
            if not stat.S_ISREG(info.st_mode):
                problem = "is no longer a regular file"
            elif info.st_size != expected["size"]:
                problem = f"has {info.st_size} bytes, {expected['size']} were written"
            elif digest_file(file) != expected:
                problem = "does not match the checksum of what was written"
        except FileNotFoundError:
            problem = "disappeared"
        if problem is not None:
            raise OSError(
                f"{rel} in {root} {problem} after this save wrote it (another process writing "
                "into this folder, or a failing disk); nothing was committed"
            )


def memory_available() -> int | None:
    """Bytes this machine can still allocate (``MemAvailable``), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _open_own(root: Path, rel: str) -> io.BufferedReader:
    """``root/rel`` opened for reading, refusing symbolic links (the file's and its folder's)
    and anything but a regular file: a checkpoint's files are its own."""
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        part = "/".join(parts[:i])
        try:
            info = os.lstat(root / part)
        except FileNotFoundError as error:
            raise CheckpointError(f"{root} is damaged: {rel} is missing; load an earlier "
                                  "checkpoint") from error
        except OSError as error:
            raise CheckpointError(f"{root} is damaged: {rel} cannot be read ({error}); load an "
                                  "earlier checkpoint") from error
        if stat.S_ISLNK(info.st_mode):
            raise CheckpointError(
                f"{root} is refused: {part} is a symbolic link (to {os.readlink(root / part)}); "
                "a checkpoint holds only its own files, a link could lead to files that no "
                "checksum covers"
            )
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{root} is damaged: {rel} is not a regular file")
    try:
        fd = os.open(root / rel, os.O_RDONLY | _NOFOLLOW)
    except OSError as error:
        raise CheckpointError(f"{root} is refused: {rel} cannot be opened as its own file "
                              f"({error})") from error
    return os.fdopen(fd, "rb")


def _read_bounded(f: io.BufferedReader, root: Path, rel: str, size: int | None,
                  limit: int | None, bound: str) -> bytes:
    actual = os.fstat(f.fileno()).st_size
    if size is not None and actual != size:
        raise CheckpointError(f"{root} is damaged: {rel} has {actual} bytes, {size} were "
                              "written; load an earlier checkpoint")
    if limit is not None and actual > limit:
        raise CheckpointError(f"{root} is refused: {rel} has {actual} bytes, more than {bound} "
                              f"({limit}); it is forged or damaged")
    return f.read(actual + 1)  # one byte more: a file that grew since is caught


def read_verified(root: Path, rel: str, files: Mapping[str, Any]) -> bytes:
    """The bytes of ``root/rel``, checked against the digest the commit marker recorded, read
    only when the file is the checkpoint's own (no links) and fits in memory."""
    expected = files.get(rel)
    size = expected.get("size") if isinstance(expected, dict) else None
    limit: int | None
    if rel.endswith(".json"):
        limit, bound = MAX_JSON_BYTES, "a checkpoint's metadata ever has"
    else:
        limit, bound = memory_available(), "this machine has memory available"
    with _open_own(root, rel) as f:
        data = _read_bounded(f, root, rel, size, limit, bound)
    if digest(data) != expected:
        raise CheckpointError(
            f"{root} is damaged: {rel} does not match the checksum recorded when it was "
            "saved (changed or corrupted since); load an earlier checkpoint"
        )
    return data


def read_torch(root: Path, rel: str, files: Mapping[str, Any]) -> Any:
    """``torch.load(weights_only=True)`` of a verified file (on the CPU)."""
    data = read_verified(root, rel, files)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"{root / rel} cannot be read safely ({type(error).__name__}: {error}); the "
            "checkpoint is corrupt or not an accelfn checkpoint"
        ) from error


def is_committed(path: Path) -> bool:
    return (path / MARKER).is_file()


def checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Equivalent to the ``step-*`` directories with a commit marker, oldest first (by step).

    A ``step-*`` entry that is a symbolic link is not the run's own checkpoint (it could lead
    to any folder): it is never listed, so never loaded as the newest nor deleted by rotation,
    and a warning names it."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        key = parse_name(entry.name)
        if key is not None and entry.is_symlink():
            warnings.warn(f"{entry} is a symbolic link (to {os.readlink(entry)}), not a "
                          "checkpoint of this run: it is ignored", RuntimeWarning, stacklevel=2)
            continue
        if key is not None and entry.is_dir() and is_committed(entry):
            found.append((key, entry))
    return [path for _, path in sorted(found)]


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint in ``directory``, or None: equivalent to
    ``checkpoints(directory)[-1]`` (directories without a commit marker are never returned)."""
    found = checkpoints(directory)
    return found[-1] if found else None


def final_name(root: Path, step: int) -> Path:
    """``root/step-<step>``, or ``step-<step>.<n>`` when that step was saved before, ``n``
    past every earlier one's (the newest at a step is always the last by name)."""
    base = f"step-{step:09d}"
    taken = [found[1] for entry in root.iterdir()
             if (found := parse_name(entry.name)) is not None and found[0] == step]
    return root / base if not taken else root / f"{base}.{max(taken) + 1}"


def remove_checkpoint(path: Path) -> None:
    marker = path / MARKER
    if marker.exists():  # uncommit first: a crash mid-delete leaves an ignored directory
        marker.unlink()
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)


def rotate(root: Path, keep: int | None, newest: Path) -> None:
    """Delete earlier checkpoints of ``newest``'s step (it replaces them: saving twice at one
    step keeps one checkpoint, and evicts nothing else), then checkpoints beyond the newest
    ``keep``, and leftovers of crashed saves."""
    named = parse_name(newest.name)
    for entry in root.iterdir():
        if entry == newest or not entry.is_dir():
            continue
        if entry.name.startswith(TMP_PREFIX) or (
                parse_name(entry.name) is not None and not is_committed(entry)):
            shutil.rmtree(entry, ignore_errors=True)
    if named is not None:  # only once the new one is committed: there is always one
        for old in checkpoints(root):
            found = parse_name(old.name)
            if old != newest and found is not None and found[0] == named[0]:
                remove_checkpoint(old)
        _set_aside_later(root, newest, named[0])
    if keep is not None:
        committed = [p for p in checkpoints(root) if p != newest]
        for old in committed[: max(0, len(committed) - (keep - 1))]:
            remove_checkpoint(old)
    fsync_dir(root)


ABANDONED_PREFIX = "abandoned-"


def _set_aside_later(root: Path, newest: Path, step: int) -> None:
    """Rename the committed checkpoints of a step past ``step`` to ``abandoned-step-…``.

    They are a branch the run went back from (an earlier checkpoint was loaded and training
    went on into this folder): ordered by step they would stay the newest, so ``latest()`` and
    a requeued job would resume the branch given up and ``keep=`` would evict the checkpoint
    gone back to. Renamed whole with their marker, they still load by path; nothing is
    deleted."""
    later = [old for old in checkpoints(root)
             if (found := parse_name(old.name)) is not None and found[0] > step]
    for old in later:
        aside = root / f"{ABANDONED_PREFIX}{old.name}"
        n = 0
        while aside.exists():
            n += 1
            aside = root / f"{ABANDONED_PREFIX}{old.name}.{n}"
        os.rename(old, aside)
        warnings.warn(
            f"{old} was saved at a later step than {newest.name}, the checkpoint just "
            f"committed: it belongs to a run that went back to an earlier checkpoint, so it was "
            f"renamed {aside.name} (latest() and keep= now follow the run saved last; load it "
            "by its path, or delete it when it is no longer wanted)",
            RuntimeWarning, stacklevel=4)


def check_files(path: Path) -> dict[str, Any]:
    """The commit marker, after checking that every file it lists is there, the checkpoint's
    own (no links, no names leading elsewhere) and full size."""
    try:
        with _open_own(path, MARKER) as f:
            data = _read_bounded(f, path, MARKER, None, MAX_JSON_BYTES,
                                 "a commit marker ever has")
    except CheckpointError as error:
        raise CheckpointError(f"the commit marker of {path} is unreadable: {error}") from error
    marker = check_marker(loads_json(data, str(path / MARKER)), str(path / MARKER))
    for rel, entry in marker["files"].items():
        with _open_own(path, rel) as f:
            size = os.fstat(f.fileno()).st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{path} is damaged: {rel} has {size} bytes, {entry['size']} were "
                "written; load an earlier checkpoint"
            )
    return marker
