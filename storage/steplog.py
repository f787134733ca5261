"""The durable step log: one fixed-size, checksummed record per ZO step, appended with fsync.

File layout (little-endian)::

    b"RCSTEPLG"  u32 header_len  header_json[header_len]  u32 crc32(header_json)
    record*      each RECORD_BYTES (84) bytes: the fields of StepRecord (72 bytes), u64 trajectory tag,
                 then u32 crc32 of those 80 bytes

Every record names its trajectory: its tag (``trajectory_tag``) is a hash of the log header's run id
and trajectory hash (``JobConfig.trajectory_sha256``: seed, batch size, lr, ... so the batch schedule
too). A reader refuses a record whose tag is not its header's (``StepLogForeignError``, naming the
step), so a record spliced in from another run's log, even one of the same seed, is never replayed.
Logs of format version 1 (records without a tag) are refused with a message saying so.

Durability point: ``StepLogWriter.append`` returns only after ``os.write`` of the whole record and
``os.fsync`` of the file have returned, so a record is durable (survives a crash of the process, the
node's OS, or power loss where the disk honours flushes) before the worker applies that step's update
and before the next step begins. The directory entry is fsynced once when the log is created.

What a crash can leave: at most one torn (partial or unchecksummable) record at the tail, possibly
followed by zero bytes (some filesystems extend a file with zero-filled blocks whose data never reached
the disk). Opening the log for writing cuts that tail (``StepLogWriter.open``) and reports the bytes
cut; a reader stops before it. A bad record followed by anything but zeros is corruption, and a step
number that does not follow its predecessor is a gap: both raise, because replay past them would not
be exact.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any
from dataclasses import astuple, dataclass, field, replace

from raycheck.storage.files import atomic_write

MAGIC = b"RCSTEPLG"
FORMAT_VERSION = 2
"""Version 2 adds the trajectory tag to every record (version 1: raycheck before issue 32)."""
_FIELDS = struct.Struct("<QQddddddQQ")
_CRC = struct.Struct("<I")
RECORD_BYTES = _FIELDS.size + _CRC.size


class StepLogError(Exception):
    """Base class of step log errors."""


class StepLogBusyError(StepLogError):
    """Another live process holds the log's writer lock (e.g. a worker of a driver that died)."""


class StepLogCorruptError(StepLogError):
    """A record or the header fails its checksum and is not a torn tail."""


class StepLogGapError(StepLogError):
    """Step numbers are not consecutive: replay past the gap is impossible."""


class StepLogForeignError(StepLogCorruptError):
    """A checksummed record whose trajectory tag is not its log's: a record of another run or trajectory."""


class StepLogConflictError(StepLogError):
    """A record differs from the one a log already holds for its step (two trajectories, one log)."""


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """Everything needed to replay ZO step ``step`` exactly (80 bytes + 4 of checksum).

    Attributes:
        step: 0-based step number; the record turns state_step into state_(step+1).
        seed: the step seed s_t from which every z is derived (``training.zo.noise``).
        projected_grad: g_t = (loss_plus - loss_minus) / (2 eps), float64.
        loss_plus, loss_minus: the two losses (float64), for audit and plots.
        lr, eps, weight_decay: the step's hyper-parameters.
        batch_id: identity (hash of sample indices) of the step's batch.
        trajectory: the tag of the log the record belongs to (``trajectory_tag``); 0 until a log binds it:
            ``StepLogWriter.append`` and the log keeper bind a new record to their log, a record read from
            a log carries that log's tag. Not compared by ``==`` (two records of one step are equal
            when their values are; ``encode`` tells their logs apart).
    """

    step: int
    seed: int
    projected_grad: float
    loss_plus: float
    loss_minus: float
    lr: float
    eps: float
    weight_decay: float
    batch_id: int
    trajectory: int = field(default=0, compare=False)

    def bound(self, tag: int, path: str | os.PathLike[str]) -> "StepRecord":
        """This record bound to the log of trajectory tag ``tag`` (at ``path``, named in errors).

        Raises:
            StepLogForeignError: the record is bound to another trajectory already.
        """
        if self.trajectory == tag:
            return self
        if self.trajectory:
            raise StepLogForeignError(f"{path}: the record of step {self.step} belongs to trajectory {self.trajectory:016x}, "
                                      f"not to this log's {tag:016x}: a record of another run")
        return replace(self, trajectory=tag)

    def encode(self) -> bytes:
        """The record's 84 bytes (``RECORD_BYTES``). Raises ValueError: it is not bound to a log yet."""
        if not self.trajectory:
            raise ValueError(f"the record of step {self.step} is not bound to a log (StepRecord.bound) and cannot be encoded")
        body = _FIELDS.pack(*astuple(self))
        return body + _CRC.pack(zlib.crc32(body))


def trajectory_tag(run_id: object, trajectory_sha256: object) -> int:
    """The 64-bit tag (never 0) every record of a log of run ``run_id`` and trajectory hash
    ``trajectory_sha256`` carries: equal for one run's logs and copies, unequal for any other run or
    trajectory (another seed, batch size, lr, ... or another run id)."""
    digest = hashlib.sha256(json.dumps([run_id, trajectory_sha256]).encode()).digest()
    return int.from_bytes(digest[:8], "little") | 1


def header_tag(header: dict[str, Any]) -> int:
    """``trajectory_tag`` of a log's header (its ``run_id`` and ``trajectory_sha256``)."""
    return trajectory_tag(header.get("run_id"), header.get("trajectory_sha256"))


def _encode_header(header: dict[str, Any]) -> bytes:
    body = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _CRC.pack(len(body)) + body + _CRC.pack(zlib.crc32(body))


def decode_header(data: bytes, path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """The header of a step log's bytes ``data`` (read from ``path``, named in errors): (header, byte
    offset of the first record).

    Raises:
        StepLogCorruptError: bad magic, a truncated header or a checksum mismatch.
    """
    if len(data) < len(MAGIC) + 4 or data[: len(MAGIC)] != MAGIC:
        raise StepLogCorruptError(f"{path}: not a raycheck step log (bad magic)")
    (n,) = _CRC.unpack_from(data, len(MAGIC))
    start = len(MAGIC) + 4
    end = start + n + 4
    if len(data) < end:
        raise StepLogCorruptError(f"{path}: header is truncated ({len(data)} of {end} bytes)")
    body = data[start : start + n]
    if _CRC.unpack_from(data, start + n)[0] != zlib.crc32(body):
        raise StepLogCorruptError(f"{path}: header checksum mismatch")
    header = json.loads(body)
    if header.get("format_version") == 1:
        raise StepLogCorruptError(f"{path}: a step log of format version 1, whose records do not name their trajectory; "
                                  f"this raycheck reads version {FORMAT_VERSION}: replay or finish that run with the raycheck "
                                  f"that wrote it, or start a new --out")
    if header.get("format_version") != FORMAT_VERSION:
        raise StepLogCorruptError(f"{path}: format version {header.get('format_version')}, expected {FORMAT_VERSION}")
    return header, end


def _later_record(data: bytes, offset: int, low: int, high: int) -> tuple[int, int] | None:
    """(step, byte offset) of the first checksummed record from byte ``offset`` of ``data`` on whose step
    is in ``low..high - 1``: a step that a record before it skipped comes later, so the log's records are
    out of order (swapped), not missing. None when no later record holds such a step."""
    for at in range(offset, len(data) - RECORD_BYTES + 1, RECORD_BYTES):
        body = data[at : at + _FIELDS.size]
        if _CRC.unpack_from(data, at + _FIELDS.size)[0] == zlib.crc32(body) and low <= (step := _FIELDS.unpack(body)[0]) < high:
            return step, at
    return None


def _records(data: bytes, offset: int, path: str | os.PathLike[str], first_step: int, tag: int) -> Iterator[tuple[StepRecord, int]]:
    """Decode records from byte ``offset`` of ``data``, numbered from ``first_step``, each of trajectory
    tag ``tag``: yields (record, byte offset just past it). Stops at a torn tail: a partial record, or a
    record that fails its checksum and is followed only by zero bytes (or nothing).

    Raises:
        StepLogForeignError: a checksummed record carries another trajectory tag (named by its step).
        StepLogCorruptError: a record fails its checksum and more data follows it.
        StepLogGapError: a record's step does not follow its predecessor's: a gap (the skipped steps are
            named as missing), or records out of order (a step repeated or going backwards, or a step
            ahead whose skipped steps come later in the file, e.g. steps 1, 3, 2: named as out of order).
    """
    expect = first_step
    while offset + RECORD_BYTES <= len(data):
        body = data[offset : offset + _FIELDS.size]
        (crc,) = _CRC.unpack_from(data, offset + _FIELDS.size)
        if crc != zlib.crc32(body):
            if data[offset + RECORD_BYTES :].strip(b"\0"):
                raise StepLogCorruptError(
                    f"{path}: record at byte {offset} (after step {expect - 1}) fails its checksum and is "
                    f"followed by more data; the log is corrupt, not torn"
                )
            return  # torn: the last record, or the last before a zero-filled tail
        rec = StepRecord(**dict(zip(StepRecord.__dataclass_fields__, _FIELDS.unpack(body))))
        if rec.trajectory != tag:
            raise StepLogForeignError(
                f"{path}: the record of step {rec.step} at byte {offset} belongs to another run or trajectory "
                f"(tag {rec.trajectory:016x}, this log's {tag:016x}): a record spliced in from another run's log; "
                f"the log cannot be replayed past step {expect - 1}"
            )
        if rec.step < expect:
            raise StepLogGapError(
                f"{path}: record at byte {offset} is step {rec.step} again or out of order, expected step {expect}; "
                f"the log cannot be replayed past step {expect - 1}"
            )
        if rec.step != expect:
            if (later := _later_record(data, offset + RECORD_BYTES, expect, rec.step)) is not None:
                raise StepLogGapError(
                    f"{path}: record at byte {offset} is step {rec.step}, expected step {expect}, and step {later[0]} "
                    f"follows it at byte {later[1]}: the records are out of order, so the log cannot be replayed past "
                    f"step {expect - 1}"
                )
            raise StepLogGapError(
                f"{path}: record at byte {offset} is step {rec.step}, expected step {expect}; "
                f"steps {expect}..{rec.step - 1} are missing, so the log cannot be replayed past step {expect - 1}"
            )
        expect += 1
        offset += RECORD_BYTES
        yield rec, offset


def scan_records(data: bytes, offset: int, path: str | os.PathLike[str], first_step: int, tag: int) -> tuple[list[StepRecord], int]:
    """Decode the records of step log bytes ``data`` from byte ``offset`` on, the first being step
    ``first_step``, each of trajectory tag ``tag`` (``header_tag`` of the log's header; ``path`` is
    named in errors); returns (records, byte offset just past the last good record). A torn last
    record ends the scan without an error (``_records``).

    Raises:
        StepLogForeignError, StepLogCorruptError, StepLogGapError: as ``_records``.
    """
    records, end = [], offset
    for rec, end in _records(data, offset, path, first_step, tag):
        records.append(rec)
    return records, end


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header of the step log at ``path``."""
    path = pathlib.Path(path)
    return decode_header(path.read_bytes(), path)[0]


def read_log(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[StepRecord], int]:
    """(header, complete checksummed records, bytes of a torn tail) of the log, read only.

    Raises:
        StepLogCorruptError, StepLogGapError: see the module docstring.
    """
    path = pathlib.Path(path)
    data = path.read_bytes()
    header, start = decode_header(data, path)
    records, end = scan_records(data, start, path, 0, header_tag(header))
    return header, records, len(data) - end


@dataclass(frozen=True)
class LogPrefix:
    """The intact prefix of a step log (``read_prefix``).

    Attributes:
        header: the log's header.
        records: the checksummed, consecutive records before the first damage (steps 0..len - 1).
        torn_bytes: bytes of a torn tail after the last record (0 when the log is damaged or clean).
        damage: the gap or corrupt record that ends the prefix (None: the whole log is intact).
    """

    header: dict[str, Any]
    records: list[StepRecord]
    torn_bytes: int
    damage: StepLogCorruptError | StepLogGapError | None


def read_prefix(path: str | os.PathLike[str]) -> LogPrefix:
    """The records of the log at ``path`` up to its first gap or corrupt record, and that damage,
    read only (``read_log`` raises on the damage instead; recovery uses it).

    Raises:
        StepLogCorruptError: the header is damaged (nothing can be read).
        OSError: the file cannot be read.
    """
    path = pathlib.Path(path)
    data = path.read_bytes()
    header, start = decode_header(data, path)
    records, end, damage = [], start, None
    try:
        for rec, end in _records(data, start, path, 0, header_tag(header)):
            records.append(rec)
    except (StepLogCorruptError, StepLogGapError) as exc:
        damage = exc
    return LogPrefix(header, records, 0 if damage else len(data) - end, damage)


def read_record(path: str | os.PathLike[str], step: int) -> StepRecord:
    """Step ``step``'s record of the log at ``path``, reading its header and that record only (records have
    a fixed size, ``RECORD_BYTES``): for a check of one step, without reading a long log.

    Raises:
        StepLogGapError: the log holds no complete record at step ``step``'s place (it is shorter), or the
            record there is another step's.
        StepLogCorruptError, StepLogForeignError: the header or that record is damaged, or another trajectory's.
    """
    with open(path, "rb") as fh:
        prefix = fh.read(len(MAGIC) + 4)
        n = _CRC.unpack_from(prefix, len(MAGIC))[0] if len(prefix) == len(MAGIC) + 4 else 0
        header, start = decode_header(prefix + fh.read(n + 4), path)
        fh.seek(start + step * RECORD_BYTES)
        data = fh.read(2 * RECORD_BYTES)  # and the next: a bad checksum with more data after it is damage, not a torn tail
    records, _ = scan_records(data, 0, path, step, header_tag(header))
    if not records:
        raise StepLogGapError(f"{path}: no complete record of step {step}")
    return records[0]


def read_records(path: str | os.PathLike[str]) -> list[StepRecord]:
    """All complete, checksummed records of the log (a torn tail is ignored, not cut)."""
    return read_log(path)[1]


class StepLogReader:
    """Follows a log file that another process appends to: the file-backed log source of the shadow
    (``actors.shadow.LogSource``), for tests and ``raycheck replay``. Not thread-safe.

    ``poll()`` returns the records that became complete since the last call, in order.
    """

    def __init__(self, path: str | os.PathLike[str], start_step: int = 0) -> None:
        self.path = pathlib.Path(path)
        data = self.path.read_bytes()
        self.header, self._records_offset = decode_header(data, self.path)
        self.seek(start_step)

    def seek(self, step: int) -> None:
        """Follow the log from ``step`` on: the next ``poll`` starts with that step's record."""
        self._offset = self._records_offset + step * RECORD_BYTES
        self.next_step = step

    def poll(self) -> list[StepRecord]:
        with open(self.path, "rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        records, end = scan_records(data, 0, self.path, self.next_step, header_tag(self.header))
        self._offset += end
        self.next_step += len(records)
        return records


class StepLogWriter:
    """The single appender of a step log (rank 0 of the training workers)."""

    def __init__(self, path: pathlib.Path, fd: int, header: dict[str, Any], next_step: int, cut_bytes: int) -> None:
        self.path = path
        self._fd = fd
        self.header = header
        self.tag = header_tag(header)
        """The trajectory tag every record of this log carries (``header_tag``)."""
        self.next_step = next_step
        self.cut_bytes = cut_bytes
        """Bytes of a torn tail removed when the log was opened (0 when it was clean)."""

    @classmethod
    def create(cls, path: str | os.PathLike[str], header: dict[str, Any]) -> "StepLogWriter":
        """Create a new log with ``header`` (atomically: written to a temp name, fsynced, renamed).

        Raises:
            FileExistsError: a log already exists at ``path``.
        """
        path = pathlib.Path(path)
        if path.exists():
            raise FileExistsError(f"{path}: step log already exists")
        header = {**header, "format_version": FORMAT_VERSION, "record_bytes": RECORD_BYTES}
        atomic_write(path, _encode_header(header))
        return cls.open(path)

    @classmethod
    def open(cls, path: str | os.PathLike[str], lock_timeout_s: float = 120.0) -> "StepLogWriter":
        """Open an existing log for appending, cutting a torn tail (made durable before returning).

        The writer holds an exclusive ``flock`` on the log until it closes or its process dies, so a
        log has one appender even when a stray worker outlives its driver: ``open`` waits up to
        ``lock_timeout_s`` seconds for the lock, and reads the log only once it holds it.

        Raises:
            StepLogBusyError: another process still holds the lock after ``lock_timeout_s``.
            StepLogCorruptError, StepLogGapError: the log cannot be continued safely.
        """
        path = pathlib.Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        deadline = time.monotonic() + lock_timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise StepLogBusyError(f"{path}: another process is appending to this step log") from None
                time.sleep(0.2)
        data = path.read_bytes()
        try:
            header, start = decode_header(data, path)
            records, end = scan_records(data, start, path, 0, header_tag(header))
        except StepLogError:
            os.close(fd)
            raise
        if end < len(data):
            os.ftruncate(fd, end)
            os.fsync(fd)
        return cls(path, fd, header, len(records), len(data) - end)

    def append(self, record: StepRecord) -> None:
        """Append ``record`` durably (write + fsync), bound to this log's trajectory tag (``StepRecord.bound``).
        See the module docstring for the durability point.

        Raises:
            StepLogGapError: ``record.step`` is not ``self.next_step``.
            StepLogForeignError: ``record`` is bound to another log's trajectory.
        """
        if record.step != self.next_step:
            raise StepLogGapError(f"{self.path}: appending step {record.step}, but the next step is {self.next_step}")
        data = record.bound(self.tag, self.path).encode()
        if os.write(self._fd, data) != len(data):
            raise OSError(f"{self.path}: short write while appending step {record.step}")
        os.fsync(self._fd)
        self.next_step += 1

    def write_torn(self, step: int) -> None:
        """Failure injection: write the first half of a record for ``step``, as a crash mid-write would."""
        os.write(self._fd, StepRecord(step=step, seed=0, projected_grad=0.0, loss_plus=0.0, loss_minus=0.0,
                                      lr=0.0, eps=0.0, weight_decay=0.0, batch_id=0, trajectory=self.tag).encode()[: RECORD_BYTES // 2])
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


