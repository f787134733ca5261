"""Durable local file writes: the one atomic write of the project (``atomic_write``; ``atomic_write_pieces``
for bytes that arrive in pieces), the chunked synced write under it (``write_synced_pieces``, buffered or
direct) and the folder fsync (``fsync_dir``). Plain ``os`` calls (and ``fcntl``, ``mmap``, ``logging``
of the standard library) and nothing else, so that the light processes (the run's journal actor) import
it at no cost.

Direct I/O (``direct=True``, Linux ``O_DIRECT``, ``open(2)``): the writing thread's own ``write`` moves
the bytes to the device (no page-cache copy, no dirty pages for the kernel's flusher threads to write
back later at their own priority, none for an ext4 journal commit in ``data=ordered`` mode to wait
for). Its buffer, file offsets and lengths must be multiples of ``DIRECT_ALIGN_BYTES``; a file system
that refuses ``O_DIRECT`` (``EINVAL``: some FUSE ones; tmpfs before Linux 6.6) gets the buffered write,
said once per device in the log."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import uuid
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raycheck.storage.backend import WritePacer

TEMP_MARK = ".tmp-"
"""What ``atomic_write``'s temp names hold (``<name>.tmp-<8 hex>``): readers skip such names."""

DIRECT_ALIGN_BYTES = 4096
"""What a direct write's buffer address, file offset and length are multiples of (bytes): the page size,
a multiple of every common logical block size (512, 4096)."""

DIRECT_BUFFER_BYTES = 1 << 18
"""Bytes per write of a direct write with no chunked sync (``chunk_bytes`` None): 256 KiB."""

_log = logging.getLogger(__name__)
_buffered_devices: set[int] = set()
"""Devices (``st_dev``) whose refusal of ``O_DIRECT`` was logged already (once per device and process)."""


def write_synced(fd: int, data: bytes | memoryview, chunk_bytes: int | None, pacer: WritePacer | None = None) -> None:
    """Write all of ``data`` to the open file ``fd`` (``write_synced_pieces`` of the one piece ``data``).

    Raises:
        OSError: a write or sync failed (the file then holds an unknown prefix of ``data``).
    """
    write_synced_pieces(fd, (data,), chunk_bytes, pacer)


def write_synced_pieces(fd: int, pieces: Iterable[bytes | memoryview], chunk_bytes: int | None,
                        pacer: WritePacer | None = None, direct: bool = False) -> None:
    """Write the concatenation of ``pieces`` (byte strings or contiguous buffers, consumed once, one at a
    time: the whole is never held in memory) to the open, empty file ``fd`` in chunks of ``chunk_bytes``
    (the last may be shorter; a chunk may span pieces), ``os.fdatasync`` after each (after ``pacer.wait``
    before each write, when given), then ``os.fsync`` the file (its metadata too). ``chunk_bytes`` None:
    one write per piece, no ``fdatasync``.

    ``direct``: switch ``fd`` to ``O_DIRECT`` (``enable_direct``; where refused, the buffered write
    above) and copy the pieces into one page-aligned buffer of ``chunk_bytes`` (None:
    ``DIRECT_BUFFER_BYTES``, and no ``fdatasync``), each full buffer one write; the last is padded with
    zeros to ``DIRECT_ALIGN_BYTES`` and the file then truncated to the true size.

    Raises:
        ValueError: ``direct`` with a ``chunk_bytes`` that is not a multiple of ``DIRECT_ALIGN_BYTES``.
        OSError: a write or sync failed (the file then holds an unknown prefix of the bytes).
    """
    if direct and chunk_bytes is not None and chunk_bytes % DIRECT_ALIGN_BYTES:
        raise ValueError(f"a direct write's chunk_bytes must be a multiple of {DIRECT_ALIGN_BYTES}, got {chunk_bytes}")
    aligned = _AlignedPieces(pieces, chunk_bytes or DIRECT_BUFFER_BYTES) if direct and enable_direct(fd) else None
    _write_chunks(fd, pieces if aligned is None else aligned, chunk_bytes, pacer)
    if aligned is not None and aligned.bytes % DIRECT_ALIGN_BYTES:
        os.ftruncate(fd, aligned.bytes)  # drop the last chunk's padding
    os.fsync(fd)


def enable_direct(fd: int) -> bool:
    """Switch the open file ``fd`` to ``O_DIRECT`` (``fcntl`` ``F_SETFL``). Returns False, and logs it
    once per device, where its file system refuses (``EINVAL``): ``fd`` is then unchanged.

    Raises:
        OSError: ``fcntl`` failed otherwise.
    """
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        device = os.fstat(fd).st_dev
        if device not in _buffered_devices:
            _buffered_devices.add(device)
            _log.warning("device %d:%d refuses O_DIRECT: its local writes are buffered", os.major(device), os.minor(device))
        return False
    return True


class _AlignedPieces:
    """``pieces`` copied into one page-aligned buffer (``mmap``) of ``size`` bytes (a multiple of
    ``DIRECT_ALIGN_BYTES``), yielded whenever full and, at the end, the rest padded with zeros to
    ``DIRECT_ALIGN_BYTES``: every view is the same buffer, to be written before the next is asked for.
    ``bytes``: how many bytes of ``pieces`` were consumed (the true size)."""

    def __init__(self, pieces: Iterable[bytes | memoryview], size: int) -> None:
        self.pieces, self.size, self.bytes = pieces, size, 0

    def __iter__(self) -> Iterator[memoryview]:
        buffer = memoryview(mmap.mmap(-1, self.size))  # freed with the last view of it
        filled = 0
        for piece in self.pieces:
            view = memoryview(piece).cast("B")
            self.bytes += len(view)
            while view:
                n = min(len(view), self.size - filled)
                buffer[filled:filled + n], view = view[:n], view[n:]
                filled += n
                if filled == self.size:
                    yield buffer
                    filled = 0
        if filled:
            padded = -(-filled // DIRECT_ALIGN_BYTES) * DIRECT_ALIGN_BYTES
            buffer[filled:padded] = bytes(padded - filled)
            yield buffer[:padded]


def _write_chunks(fd: int, pieces: Iterable[bytes | memoryview], chunk_bytes: int | None,
                  pacer: WritePacer | None) -> None:
    """``write_synced_pieces``'s buffered write, without the final ``fsync``."""
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


def atomic_write(path: str | os.PathLike[str], data: bytes | memoryview, chunk_bytes: int | None = None,
                 pacer: WritePacer | None = None) -> None:
    """Replace the local file ``path`` with ``data``, atomically and durably (``atomic_write_pieces`` of
    the one piece ``data``). The one atomic write of the project (storage objects, the step log's
    creation, the run directory's JSON files).

    Raises:
        OSError: as ``atomic_write_pieces``.
    """
    atomic_write_pieces(path, (data,), chunk_bytes, pacer)


def atomic_write_pieces(path: str | os.PathLike[str], pieces: Iterable[bytes | memoryview], chunk_bytes: int | None = None,
                        pacer: WritePacer | None = None, direct: bool = False) -> None:
    """Replace the local file ``path`` with the concatenation of ``pieces``, atomically and durably: the
    bytes go to a temp name unique to this call in the same folder (``write_synced_pieces``: written, then
    fsynced), the temp file is renamed over ``path``, then the folder is fsynced so that the rename itself
    survives a crash. A reader sees the old bytes or the new ones, never a part.

    Args:
        pieces: byte strings or contiguous buffers, consumed once (never joined in memory).
        chunk_bytes, pacer, direct: as ``write_synced_pieces`` (None: no ``fdatasync``, one fsync;
            ``direct``: ``O_DIRECT`` where the file system allows it).

    Raises:
        ValueError: as ``write_synced_pieces`` (nothing is written).
        OSError: a write, sync or rename failed; ``path`` is unchanged and the temp file removed (a
            temp file a crash leaves is never read: it has another name; ``Storage.remove_stale_temp_files``
            deletes it once it is old). An exception raised by ``pieces`` propagates the same way.
    """
    path = os.fspath(path)
    tmp = f"{path}{TEMP_MARK}{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            write_synced_pieces(fd, pieces, chunk_bytes, pacer, direct)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``os.fsync`` the folder ``path`` (makes the names created or renamed in it durable).

    Raises:
        OSError: the folder cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
