"""The step log on object storage: immutable segments, since objects cannot be appended to.

The worker appends to its local log file (``storage.steplog``: write + fsync per record). A
``SegmentMirror`` copies it to a ``Storage`` as segment objects ``log/segment-<first>-<last>.bin``,
each a self-contained step log (the header, then records ``first..last``). A segment is closed
after ``records_per_segment`` records; the open tail is re-uploaded as a shorter segment with the
same ``first`` whenever it is older than ``max_age_s``, and superseded tail segments are deleted
after the longer one is written.

Durability: a record is durable locally when the worker's ``append`` returns (it survives any crash
of the worker processes) and durable in object storage when a segment containing it has been
uploaded: at most ``records_per_segment`` records, or ``max_age_s`` seconds of them, exist only on
the local disk. Losing that disk loses those records and nothing earlier.

``read_segments`` validates each segment (header and record checksums, each record's trajectory tag,
identical headers) and the
step continuity across segments, and refuses a gap with ``StepLogGapError``.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from raycheck.storage.backend import Storage
from raycheck.storage.steplog import RECORD_BYTES, StepLogCorruptError, StepLogGapError, StepRecord, decode_header, header_tag, scan_records

PREFIX = "log/"
_NAME = re.compile(r"^log/segment-(\d{10})-(\d{10})\.bin$")


def segment_name(first: int, last: int) -> str:
    return f"{PREFIX}segment-{first:010d}-{last:010d}.bin"


def _segments(storage: Storage) -> dict[int, tuple[int, str]]:
    """first step -> (last step, name) of the longest segment starting there."""
    best: dict[int, tuple[int, str]] = {}
    for name in storage.list(PREFIX):
        m = _NAME.match(name)
        if m:
            first, last = int(m.group(1)), int(m.group(2))
            if last > best.get(first, (-1, ""))[0]:
                best[first] = (last, name)
    return best


def segment_of(storage: Storage, step: int) -> str | None:
    """The URL of the segment that ``read_segments`` takes step ``step`` from; None when none holds it."""
    end = 0
    for first, (last, name) in sorted(_segments(storage).items()):
        if first < end:
            continue  # overlapped by a longer earlier segment, as read_segments skips it
        if first <= step <= last:
            return storage.url(name)
        end = last + 1
    return None


def read_segments(storage: Storage) -> tuple[dict[str, Any] | None, list[StepRecord]]:
    """(header, records) of the log mirrored in ``storage``; (None, []) when there is none.

    Raises:
        StepLogCorruptError: a segment fails a checksum, or headers differ between segments.
        StepLogGapError: a step is missing between segments.
    """
    header: dict[str, Any] | None = None
    records: list[StepRecord] = []
    for first, (last, name) in sorted(_segments(storage).items()):
        if first > len(records):
            raise StepLogGapError(
                f"{storage.url(name)} starts at step {first}, but the segments before it end at step "
                f"{len(records) - 1}: steps {len(records)}..{first - 1} are missing"
            )
        if first < len(records):
            continue  # overlapped by a longer earlier segment
        data = storage.get(name)
        seg_header, start = decode_header(data, storage.url(name))
        if header is not None and seg_header != header:
            raise StepLogCorruptError(f"{storage.url(name)}: header differs from the first segment's")
        header = seg_header
        seg_records, end = scan_records(data, start, storage.url(name), first, header_tag(seg_header))
        if end != len(data) or len(seg_records) != last - first + 1:
            raise StepLogCorruptError(f"{storage.url(name)}: expected steps {first}..{last}, found {len(seg_records)} records")
        records.extend(seg_records)
    return header, records


class SegmentMirror:
    """Copies a local step log into ``storage`` as segments. Call ``sync`` periodically and once with
    ``final=True`` at the end; it uploads what is new and returns the number of steps now mirrored."""

    def __init__(self, storage: Storage, local_log: str | os.PathLike[str], records_per_segment: int = 100, max_age_s: float = 10.0) -> None:
        if records_per_segment < 1:
            raise ValueError(f"records_per_segment must be >= 1, got {records_per_segment}")
        self.storage, self.local_log = storage, local_log
        self.records_per_segment, self.max_age_s = records_per_segment, max_age_s
        self._names: dict[int, list[tuple[int, str]]] = {}  # first step -> (last step, name) of the segments held
        for name in storage.list(PREFIX):  # listed once: later uploads track their own names
            if m := _NAME.match(name):
                self._names.setdefault(int(m.group(1)), []).append((int(m.group(2)), name))
        self.mirrored = max((last + 1 for held in self._names.values() for last, _ in held), default=0)
        self._tail_since = time.monotonic()

    def sync(self, final: bool = False) -> int:
        with open(self.local_log, "rb") as fh:
            data = fh.read()
        header, header_end = decode_header(data, self.local_log)
        available = len(scan_records(data, header_end, self.local_log, 0, header_tag(header))[0])  # a torn tail is not mirrored
        head = data[:header_end]
        first = (self.mirrored // self.records_per_segment) * self.records_per_segment
        while first < available:
            last = min(available, first + self.records_per_segment) - 1
            full = last - first + 1 == self.records_per_segment
            if not (full or final or time.monotonic() - self._tail_since >= self.max_age_s) or last < self.mirrored:
                break
            body = data[header_end + first * RECORD_BYTES : header_end + (last + 1) * RECORD_BYTES]
            name = segment_name(first, last)
            self.storage.put(name, head + body)
            self._supersede(first, last, name)
            self.mirrored = last + 1
            self._tail_since = time.monotonic()
            first = last + 1
        return self.mirrored

    def _supersede(self, first: int, last: int, name: str) -> None:
        """Delete the shorter segments starting at ``first`` now that ``name`` (steps ``first..last``) is written."""
        held = self._names.setdefault(first, [])
        for shorter in [h for h in held if h[0] < last]:
            self.storage.delete(shorter[1])
            held.remove(shorter)
        if (last, name) not in held:
            held.append((last, name))
