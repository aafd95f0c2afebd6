"""The dump folder a run owns: usable (a writable folder) and held by one run at a time.

Checks, before the model is built, each a one-line :class:`RunFolderError`: the dump folder (or a
parent) exists as a file; it cannot be created; it is read-only (a file cannot be created in it:
permissions, a read-only mount).

The lock. One run per dump folder: rank 0 takes an exclusive ``flock`` on ``<dump_folder>/.run.lock``
(through the ``filelock`` package) and holds it for the run's life, writing its pid, host and start
time into ``<dump_folder>/.run.owner``. A second run's rank 0 fails to take it and stops with one
line naming the first run's pid and host. The kernel releases a flock whatever way the process
ends (kill -9 included), so a crashed run never leaves the folder locked; :meth:`RunLock.release`
(or the process's exit) frees it. A stale owner record (the lock is free but the record names a
process, or a lock still held while the record names a dead pid on this host: only a leftover child
process can still hold it then) is reported as such in the message. With fault tolerance every
replica group holds its own lock (``.run.lock`` + ``-replica-<id>``), so groups may share a folder.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path

import filelock
from trainer.errors import RunFolderError  # noqa: F401  (defined on the ground floor)

logger = logging.getLogger("trainer")


def check_dump_folder(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and check that files can be written in it; returns it.

    Raises RunFolderError naming the folder and what is wrong (a file in the way, read-only)."""
    folder = Path(path)
    for p in (folder, *folder.parents):
        if p.exists() and not p.is_dir():
            what = "is a file" if p == folder else f"is under {p}, which is a file"
            raise RunFolderError(f"--job.dump_folder {folder}: {what}, not a folder")
        if p.exists():
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunFolderError(f"--job.dump_folder {folder}: cannot be created ({exc.strerror or exc})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise RunFolderError(f"--job.dump_folder {folder}: is read-only, cannot write in it "
                             f"({exc.strerror or exc})") from None
    return folder


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class RunLock:
    """The exclusive lock of one run on ``folder`` (see the module docstring).

    Args:
        folder: the dump folder (it must exist).
        suffix: distinguishes locks that may coexist in one folder (fault-tolerance replica groups).

    Raises:
        RunFolderError: another run holds the lock (the message names its pid and host).
    """

    def __init__(self, folder: str | os.PathLike, suffix: str = "") -> None:
        folder = Path(folder)
        self.path = folder / f".run.lock{suffix}"
        self.owner_path = folder / f".run.owner{suffix}"
        self._lock = filelock.FileLock(str(self.path), timeout=0)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise RunFolderError(self._held_message(folder)) from None
        stale = self._read_owner()
        if stale and stale.get("host") == socket.gethostname() and stale.get("pid") != os.getpid():
            logger.info("%s: the previous run (pid %s) ended without releasing it; taking it over", self.owner_path,
                        stale.get("pid"))
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        tmp = self.owner_path.with_name(self.owner_path.name + ".tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, self.owner_path)

    def _read_owner(self) -> dict | None:
        try:
            return json.loads(self.owner_path.read_text())
        except (OSError, ValueError):
            return None

    def _held_message(self, folder: Path) -> str:
        owner = self._read_owner() or {}
        pid, host = owner.get("pid", "?"), owner.get("host", "?")
        msg = (f"--job.dump_folder {folder}: another run (pid {pid} on {host}, started {owner.get('started', '?')}) "
               f"is using it; wait for it to end or choose another --job.dump_folder")
        if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            msg += (f" (pid {pid} is dead: a process it started still holds {self.path}; end that process, "
                    f"e.g. fuser {self.path})")
        return msg

    def release(self) -> None:
        """Remove the owner record and release the lock (safe to call twice)."""
        if self._lock.is_locked:
            try:
                if (self._read_owner() or {}).get("pid") == os.getpid():
                    self.owner_path.unlink()
            except OSError:
                pass
            self._lock.release()
