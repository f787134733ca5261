"""Durable local file writes: the one atomic write of the project (``atomic_write``; ``atomic_write_pieces``
for bytes that arrive in pieces), the chunked synced write under it (``write_synced_pieces``) and the
folder fsync (``fsync_dir``). Plain ``os`` calls and nothing else, so that the light processes (the run's
journal actor) import it at no cost."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raycheck.storage.backend import WritePacer

TEMP_MARK = ".tmp-"
"""What ``atomic_write``'s temp names hold (``<name>.tmp-<8 hex>``): readers skip such names."""


def write_synced(fd: int, data: bytes | memoryview, chunk_bytes: int | None, pacer: WritePacer | None = None) -> None:
    """Write all of ``data`` to the open file ``fd`` (``write_synced_pieces`` of the one piece ``data``).

    Raises:
        OSError: a write or sync failed (the file then holds an unknown prefix of ``data``).
    """
    write_synced_pieces(fd, (data,), chunk_bytes, pacer)


def write_synced_pieces(fd: int, pieces: Iterable[bytes | memoryview], chunk_bytes: int | None,
                        pacer: WritePacer | None = None) -> None:
    """Write the concatenation of ``pieces`` (byte strings or contiguous buffers, consumed once, one at a
    time: the whole is never held in memory) to the open file ``fd`` in chunks of ``chunk_bytes`` (the
    last may be shorter; a chunk may span pieces), ``os.fdatasync`` after each (after ``pacer.wait`` before
    each write, when given), then ``os.fsync`` the file (its metadata too). ``chunk_bytes`` None: one write
    per piece, no ``fdatasync``.

    Raises:
        OSError: a write or sync failed (the file then holds an unknown prefix of the bytes).
    """
    pending = 0  # bytes written since the last fdatasync
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while view:
            room = len(view) if chunk_bytes is None else chunk_bytes - pending
            chunk, view = view[:room], view[room:]
            if pacer is not None:
                pacer.wait(len(chunk))
            pending += len(chunk)
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
            if pending == chunk_bytes:
                os.fdatasync(fd)
                pending = 0
    if chunk_bytes is not None and pending:
        os.fdatasync(fd)
    os.fsync(fd)


def atomic_write(path: str | os.PathLike, data: bytes | memoryview, chunk_bytes: int | None = None,
                 pacer: WritePacer | None = None) -> None:
    """Replace the local file ``path`` with ``data``, atomically and durably (``atomic_write_pieces`` of
    the one piece ``data``). The one atomic write of the project (storage objects, the step log's
    creation, the run directory's JSON files).

    Raises:
        OSError: as ``atomic_write_pieces``.
    """
    atomic_write_pieces(path, (data,), chunk_bytes, pacer)


def atomic_write_pieces(path: str | os.PathLike, pieces: Iterable[bytes | memoryview], chunk_bytes: int | None = None,
                        pacer: WritePacer | None = None) -> None:
    """Replace the local file ``path`` with the concatenation of ``pieces``, atomically and durably: the
    bytes go to a temp name unique to this call in the same folder (``write_synced_pieces``: written, then
    fsynced), the temp file is renamed over ``path``, then the folder is fsynced so that the rename itself
    survives a crash. A reader sees the old bytes or the new ones, never a part.

    Args:
        pieces: byte strings or contiguous buffers, consumed once (never joined in memory).
        chunk_bytes, pacer: as ``write_synced_pieces`` (None: no ``fdatasync``, one fsync).

    Raises:
        OSError: a write, sync or rename failed; ``path`` is unchanged and the temp file removed (a
            temp file a crash leaves is never read: it has another name; ``Storage.remove_stale_temp_files``
            deletes it once it is old). An exception raised by ``pieces`` propagates the same way.
    """
    path = os.fspath(path)
    tmp = f"{path}{TEMP_MARK}{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            write_synced_pieces(fd, pieces, chunk_bytes, pacer)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str | os.PathLike) -> None:
    """``os.fsync`` the folder ``path`` (makes the names created or renamed in it durable).

    Raises:
        OSError: the folder cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
