"""One driver per run directory: ``raycheck run`` holds an exclusive lock on its ``--out`` while it runs.

Two drivers on one run directory fence each other's snapshots (the newer writer epoch wins,
``storage.snapshots``), overwrite each other's ``summary.json`` and end a healthy run as failed. So the
driver takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<out>/.driver.lock`` before it deletes or writes
anything there, and a second driver (a ``--resume`` while the first is alive, an ``--overwrite`` of a
live run) is refused in one line, naming the holder. The kernel drops the lock when the holding process
exits, however it exits (SIGKILL included), so a driver that died never blocks its ``--resume``.

The lock file is removed on release, so a refused or finished run leaves no trace of it. Removing it
races with a driver that opened the old file just before: after ``flock`` succeeds, the holder checks
that the path still names the file it locked, else it tries again on the new one (the usual
lock-then-verify pattern). ``flock`` is advisory and local to one machine's kernel: a run directory on
a network file system shared by drivers on two machines is not protected (raycheck's drivers write
their own, local run directory; ``docs/fault-domains.md``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import socket
from collections.abc import Iterator

LOCK_NAME = ".driver.lock"


class RunDirectoryError(RuntimeError):
    """This driver cannot use the run directory (a subclass says why)."""


class RunDirectoryBusyError(RunDirectoryError):
    """Another live driver holds the run directory's lock."""


class RunDirectoryUnusableError(RunDirectoryError):
    """The run directory cannot be created or its lock file cannot be written (e.g. a parent is a
    file, or the filesystem is read-only)."""


@contextlib.contextmanager
def driver_lock(out: pathlib.Path) -> Iterator[None]:
    """Hold the exclusive lock on the run directory ``out`` for the ``with`` block (the module docstring).
    Creates ``out`` if needed (removed again on exit when the block left it empty) and writes
    ``pid N on HOST`` into the lock file.

    Raises:
        RunDirectoryBusyError: another process holds the lock; the message names it.
        RunDirectoryUnusableError: ``out`` cannot be created, or the lock file cannot be opened.
    """
    created = not out.exists()
    path = out / LOCK_NAME
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = _acquire(path)
    except OSError as exc:
        raise RunDirectoryUnusableError(f"--out {out} cannot be used as a run directory: {exc.strerror or exc}") from exc
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
            yield
        finally:
            path.unlink(missing_ok=True)
            os.close(fd)
    finally:
        if created and not any(out.iterdir()):
            out.rmdir()


def _acquire(path: pathlib.Path) -> int:
    """An open descriptor of ``path`` that this process holds ``LOCK_EX`` on, the path still naming it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace") or "a process"
            os.close(fd)
            raise RunDirectoryBusyError(f"{path.parent} is in use by another raycheck driver ({holder}); wait for it to "
                                        "end, or stop it (Ctrl-C) and then --resume") from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass  # the holder before us removed it on release: lock the new file
        os.close(fd)
