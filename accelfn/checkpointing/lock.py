"""One writer per run folder: a lock file naming its holder (pid and host), with a heartbeat.

``save()`` holds ``<dir>/.lock`` (on rank 0) from before it writes
its temporary directory until its checkpoint is committed and rotation is done. A second
writer (a requeued job overlapping the old one's final save, two runs pointed at one folder)
gets ``CheckpointLockedError`` naming the holder. A lock whose holder is gone is taken
over:

* on the same machine (host name, boot and pid namespace all equal), when its process is
  dead (or its pid now belongs to a process started later);
* from another machine, where a process cannot be asked, when the holder's heartbeat stopped:
  a holder touches the lock every ``HEARTBEAT_S`` seconds, and a lock untouched for
  ``STALE_AFTER_S`` (by the file system's clock) is stale.

The lock appears whole or not at all (written aside, then ``os.link``-ed into place, which
fails if a lock exists; ``O_EXCL`` where links are not supported), which is also safe on NFS.

Why not ``filelock``: its ``FileLock`` is an ``flock`` lock, which names no holder and on NFS
(where the run folders of several machines live) depends on the server's lock manager. Its
``SoftFileLease`` (``filelock >= 3.30``) has the holder record and the heartbeat, but a
contender takes an expired lease only after watching it unchanged for the lease's duration
on its own clock, so ``save()`` would block that long (or fail) where a dead holder's lock is
taken over at once here (same machine: its process is gone; another machine: the file
system's clock says the heartbeat stopped); and torch requires ``filelock`` without a
version, so relying on it would add a floor to accelfn's dependencies. These are the reasons
it stays written here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["HEARTBEAT_S", "LOCK_FILE", "STALE_AFTER_S", "CheckpointLockedError", "WriterLock"]

LOCK_FILE = ".lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 120.0


class CheckpointLockedError(OSError):
    """Another live process is saving into this checkpoint folder (``holder`` names it)."""

    def __init__(self, message: str, holder: dict[str, Any], path: Path) -> None:
        super().__init__(errno.EBUSY, message)
        self.holder = holder
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)


def _read(path: Path) -> str | None:
    with contextlib.suppress(OSError):
        return path.read_text()
    return None


def _proc_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), or None."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[19]) if len(fields) > 19 else None


def _identity() -> dict[str, Any]:
    pid = os.getpid()
    pidns = None
    with contextlib.suppress(OSError):
        pidns = os.readlink("/proc/self/ns/pid")
    boot = _read(Path("/proc/sys/kernel/random/boot_id"))
    return {"pid": pid, "host": socket.gethostname(), "boot": boot.strip() if boot else None,
            "pidns": pidns, "start": _proc_start(pid), "created": time.time(),
            "token": secrets.token_hex(8)}


def _parse(text: str | None) -> dict[str, Any] | None:
    if text is None or len(text) > 4096:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int) \
            or not isinstance(holder.get("host"), str) or not isinstance(holder.get("token"), str):
        return None
    return holder


def _alive(pid: int, start: Any) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    stat = _read(Path(f"/proc/{pid}/stat"))
    if stat is not None:
        fields = stat.rsplit(")", 1)[-1].split()
        if fields and fields[0] in ("Z", "X"):  # exited, not yet reaped
            return False
        if isinstance(start, int) and len(fields) > 19 and int(fields[19]) != start:
            return False  # the pid was reused by a later process
    return True


def _fs_now(root: Path) -> float:
    """The file system's clock (what it stamps a new file with), for comparing mtimes."""
    probe = root / f"{LOCK_FILE}.probe-{secrets.token_hex(4)}"
    try:
        probe.touch()
        try:
            return probe.stat().st_mtime
        finally:
            probe.unlink()
    except OSError:
        return time.time()


def _describe(holder: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("created", 0))))
    return f"pid {holder['pid']} on {holder['host']} (since {since})"


class WriterLock:
    """The lock of one save: ``acquire()``, ``check()`` before committing, ``release()``.

    Use it as a context manager. While held, a thread refreshes the lock's mtime every
    ``HEARTBEAT_S`` seconds.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / LOCK_FILE
        self.me = _identity()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # ------------------------------------------------------------------ taking it
    def acquire(self) -> WriterLock:
        body = json.dumps(self.me)
        for _ in range(5):
            if self._create(body):
                try:
                    self._beat = threading.Thread(target=self._heartbeat, daemon=True,
                                                  name="accelfn-checkpoint-lock")
                    self._beat.start()
                except BaseException:  # interrupted: the lock must not outlive this call
                    self.release()
                    raise
                return self
            text = _read(self.path)
            if text is None:
                continue  # released (or taken over) meanwhile: try again
            holder = _parse(text)
            if holder is not None and holder["token"] == self.me["token"]:
                return self
            if not self._stale(holder):
                shown = _describe(holder) if holder else "an unreadable lock"
                raise CheckpointLockedError(
                    f"{self.root} is being written by {shown}: another process is saving "
                    "checkpoints into this folder. Two runs must not save into one folder; "
                    "wait for that save to finish, give this run its own folder, or delete "
                    f"{self.path} if that process is gone", holder or {}, self.path)
            self._take_over(text)
        raise CheckpointLockedError(f"{self.root}: could not take the checkpoint lock "
                                    f"{self.path} (other writers kept taking it)", {}, self.path)

    def _create(self, body: str) -> bool:
        aside = self.root / f"{LOCK_FILE}.{self.me['token']}"
        try:
            aside.write_text(body)
            os.link(aside, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here: exclusive create instead
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(body)
            return True
        finally:
            with contextlib.suppress(OSError):
                aside.unlink()

    def _stale(self, holder: dict[str, Any] | None) -> bool:
        same_machine = holder is not None and all(
            holder.get(k) == self.me[k] for k in ("host", "boot", "pidns"))
        if holder is not None and same_machine:
            return not _alive(int(holder["pid"]), holder.get("start"))
        try:  # another machine (or an unreadable lock): by its heartbeat
            age = _fs_now(self.root) - self.path.stat().st_mtime
        except OSError:
            return False
        return age > STALE_AFTER_S

    def _take_over(self, stale_text: str) -> None:
        """Move the stale lock aside; put it back if it turned out to be a fresh one."""
        aside = self.root / f"{LOCK_FILE}.stale-{secrets.token_hex(4)}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read(aside) != stale_text:  # someone replaced the stale lock meanwhile
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        with contextlib.suppress(OSError):
            aside.unlink()

    # ------------------------------------------------------------------ holding it
    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self.holds():
                with contextlib.suppress(OSError):
                    os.utime(self.path)

    def holds(self) -> bool:
        holder = _parse(_read(self.path))
        return holder is not None and holder["token"] == self.me["token"]

    def check(self) -> None:
        """Raise CheckpointLockedError unless this save still holds the lock."""
        if not self.holds():
            holder = _parse(_read(self.path)) or {}
            who = _describe(holder) if holder else "nobody"
            raise CheckpointLockedError(
                f"{self.root}: this save lost its lock (now held by {who}) while it was "
                "stalled; nothing was committed", holder, self.path)

    def release(self) -> None:
        """Give the lock up (nothing if this save does not hold it): also after an
        interrupted [`acquire`][], which may have taken it."""
        self._stop.set()
        if self._beat is not None and self._beat.is_alive():
            self._beat.join()
        if self.holds():
            with contextlib.suppress(OSError):
                self.path.unlink()
        with contextlib.suppress(OSError):  # the aside copy an interrupted _create left
            (self.root / f"{LOCK_FILE}.{self.me['token']}").unlink()

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
