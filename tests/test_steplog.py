import hashlib
import json
import os
import re
import struct
import zlib
from types import SimpleNamespace

import pytest

from raycheck.storage import steplog
from raycheck.storage.steplog import (
    RECORD_BYTES,
    StepLogBusyError,
    StepLogCorruptError,
    StepLogGapError,
    StepLogReader,
    StepLogWriter,
    StepRecord,
    read_header,
    read_log,
    read_prefix,
    read_record,
    read_records,
)


def rec(step: int) -> StepRecord:
    return StepRecord(step=step, seed=1000 + step, projected_grad=0.1 * step - 0.3, loss_plus=0.7, loss_minus=0.69,
                      lr=1e-6, eps=1e-3, weight_decay=0.0, batch_id=77 + step)


def make_log(path, n: int) -> StepLogWriter:
    w = StepLogWriter.create(path, {"model": "x"})
    for i in range(n):
        w.append(rec(i))
    return w


def test_roundtrip_keeps_every_field_exactly(tmp_path):
    make_log(tmp_path / "log", 5).close()
    assert read_records(tmp_path / "log") == [rec(i) for i in range(5)]
    assert read_header(tmp_path / "log")["model"] == "x"
    assert RECORD_BYTES == 84


def test_one_record_is_read_by_its_place_and_a_missing_or_damaged_one_is_refused(tmp_path):
    w = make_log(tmp_path / "log", 5)
    w.write_torn(5)
    w.close()
    assert [read_record(tmp_path / "log", i) for i in (4, 0, 2)] == [rec(4), rec(0), rec(2)]
    for step in (5, 9):  # torn, and past the end
        with pytest.raises(StepLogGapError, match="no complete record of step"):
            read_record(tmp_path / "log", step)
    data = bytearray((tmp_path / "log").read_bytes())
    data[-RECORD_BYTES // 2 - RECORD_BYTES - 30] ^= 0xFF  # inside step 3's record
    (tmp_path / "log").write_bytes(bytes(data))
    assert read_record(tmp_path / "log", 4) == rec(4)
    with pytest.raises(StepLogCorruptError, match="fails its checksum"):
        read_record(tmp_path / "log", 3)


def test_append_refuses_a_gap_or_a_repeat(tmp_path):
    w = make_log(tmp_path / "log", 3)
    with pytest.raises(StepLogGapError, match=f"^{re.escape(str(tmp_path / 'log'))}: appending step 5, but the next step is 3"):
        w.append(rec(5))
    with pytest.raises(StepLogGapError):
        w.append(rec(2))


def test_torn_tail_is_cut_on_open_and_the_log_continues(tmp_path):
    w = make_log(tmp_path / "log", 4)
    w.write_torn(4)
    w.close()
    size = os.path.getsize(tmp_path / "log")
    assert read_records(tmp_path / "log") == [rec(i) for i in range(4)]  # readers stop before it
    w = StepLogWriter.open(tmp_path / "log")
    assert (w.cut_bytes, w.next_step) == (RECORD_BYTES // 2, 4)
    assert os.path.getsize(tmp_path / "log") == size - RECORD_BYTES // 2
    w.append(rec(4))
    w.close()
    assert read_records(tmp_path / "log") == [rec(i) for i in range(5)]


def test_bad_checksum_on_the_last_record_is_a_torn_tail(tmp_path):
    make_log(tmp_path / "log", 3).close()
    with open(tmp_path / "log", "r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        fh.write(b"\xff\xff\xff")
    w = StepLogWriter.open(tmp_path / "log")
    assert (w.next_step, w.cut_bytes) == (2, RECORD_BYTES)


def test_corruption_before_good_records_is_refused(tmp_path):
    make_log(tmp_path / "log", 3).close()
    with open(tmp_path / "log", "r+b") as fh:
        fh.seek(-RECORD_BYTES - 40, os.SEEK_END)  # inside step 1's projected gradient
        fh.write(b"\xaa")
    with pytest.raises(StepLogCorruptError, match=r"record at byte \d+ \(after step 0\) fails its checksum and is followed by more data"):
        StepLogWriter.open(tmp_path / "log")


@pytest.mark.parametrize("torn_bytes", [0, RECORD_BYTES // 2])
def test_a_zero_filled_tail_longer_than_a_record_is_torn_and_cut(tmp_path, torn_bytes):
    """What some filesystems leave after a crash: the file extended with zeros, after a whole or a
    half-written last record. Every record before it is intact, so the log continues."""
    w = make_log(tmp_path / "log", 4)
    os.write(w._fd, rec(4).bound(w.tag, w.path).encode()[:torn_bytes] + bytes(3 * RECORD_BYTES + 5))
    w.close()
    assert read_records(tmp_path / "log") == [rec(i) for i in range(4)]
    w = StepLogWriter.open(tmp_path / "log")
    assert (w.next_step, w.cut_bytes) == (4, torn_bytes + 3 * RECORD_BYTES + 5)
    w.append(rec(4))
    w.close()
    assert read_records(tmp_path / "log") == [rec(i) for i in range(5)]


@pytest.mark.parametrize("filler", [b"\0", b"\xaa"])
def test_a_bad_region_before_good_records_is_refused_even_when_zero(tmp_path, filler):
    make_log(tmp_path / "log", 4).close()
    with open(tmp_path / "log", "r+b") as fh:
        fh.seek(-3 * RECORD_BYTES, os.SEEK_END)  # steps 1 and 2 overwritten, step 3 intact after them
        fh.write(filler * (2 * RECORD_BYTES))
    with pytest.raises(StepLogCorruptError, match="record at byte .* fails its checksum and is followed by more data"):
        StepLogWriter.open(tmp_path / "log")
    with pytest.raises(StepLogCorruptError):
        read_records(tmp_path / "log")


@pytest.mark.parametrize("garbage", [b"\xaa", b"X", b"\x01"])
def test_a_non_zero_garbage_tail_longer_than_a_record_is_refused(tmp_path, garbage):
    """Only zeros after a bad record make a torn tail; any other byte is corruption."""
    w = make_log(tmp_path / "log", 2)
    os.write(w._fd, garbage * (2 * RECORD_BYTES))
    w.close()
    with pytest.raises(StepLogCorruptError, match="followed by more data"):
        StepLogWriter.open(tmp_path / "log")


def test_gap_in_the_file_is_refused_with_the_missing_steps(tmp_path):
    w = make_log(tmp_path / "log", 2)
    os.write(w._fd, rec(5).bound(w.tag, w.path).encode())  # bypass the writer's own check, as a foreign writer could
    w.close()
    with pytest.raises(StepLogGapError, match=r"is step 5, expected step 2; steps 2\.\.4 are missing, so the log cannot be "
                                              r"replayed past step 1$"):
        read_records(tmp_path / "log")


def test_swapped_records_are_refused_as_out_of_order_not_as_missing(tmp_path):
    """Steps 0, 1, 3, 2, 4: step 2 is in the file, after step 3, so the records are out of order; "steps
    2..2 are missing" (what it said before) sent the reader looking for a lost record."""
    w = make_log(tmp_path / "log", 2)
    start = os.lseek(w._fd, 0, os.SEEK_CUR)
    for step in (3, 2, 4):
        os.write(w._fd, rec(step).bound(w.tag, w.path).encode())
    w.close()
    with pytest.raises(StepLogGapError, match=rf"record at byte {start} is step 3, expected step 2, and step 2 follows it at "
                                              rf"byte {start + RECORD_BYTES}: the records are out of order, so the log "
                                              r"cannot be replayed past step 1$"):
        read_records(tmp_path / "log")


def test_header_corruption_is_detected(tmp_path):
    make_log(tmp_path / "log", 1).close()
    with open(tmp_path / "log", "r+b") as fh:
        fh.seek(14)
        fh.write(b"#")
    with pytest.raises(StepLogCorruptError, match="header checksum"):
        read_records(tmp_path / "log")


def test_reader_follows_appends_and_waits_on_a_partial_record(tmp_path):
    w = make_log(tmp_path / "log", 2)
    r = StepLogReader(tmp_path / "log")
    assert [x.step for x in r.poll()] == [0, 1]
    os.write(w._fd, rec(2).bound(w.tag, w.path).encode()[:30])
    assert r.poll() == []
    os.write(w._fd, rec(2).bound(w.tag, w.path).encode()[30:])
    w.next_step = 3
    w.append(rec(3))
    assert [x.step for x in r.poll()] == [2, 3]
    assert StepLogReader(tmp_path / "log", start_step=3).poll() == [rec(3)]


def test_create_refuses_to_overwrite(tmp_path):
    make_log(tmp_path / "log", 1).close()
    with pytest.raises(FileExistsError, match=f"^{re.escape(str(tmp_path / 'log'))}: step log already exists"):
        StepLogWriter.create(tmp_path / "log", {})


class FakeClock:
    """``time`` as ``storage.steplog`` sees it, on a simulated clock: ``sleep`` advances it at once
    and then runs ``on_sleep`` (what happens elsewhere while the writer waits)."""

    def __init__(self, monkeypatch, on_sleep=lambda: None) -> None:
        self.now_s, self.sleeps, self.on_sleep = 0.0, 0, on_sleep
        monkeypatch.setattr(steplog, "time", SimpleNamespace(monotonic=lambda: self.now_s, sleep=self.sleep))

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds
        self.sleeps += 1
        self.on_sleep()


def test_a_busy_log_is_retried_every_0_2_s_until_more_than_the_timeout_has_passed(tmp_path, monkeypatch):
    path = tmp_path / "log"
    first = StepLogWriter.create(path, {})
    for timeout_s, sleeps in ((None, 600), (0.4, 3)):  # None: the default, 120 s; 0.2 + 0.2 == 0.4 exactly
        clock = FakeClock(monkeypatch)
        with pytest.raises(StepLogBusyError, match=f"^{re.escape(str(path))}: another process is appending"):
            StepLogWriter.open(path) if timeout_s is None else StepLogWriter.open(path, lock_timeout_s=timeout_s)
        assert clock.sleeps == sleeps
    first.close()


def test_a_writer_waiting_for_the_lock_gets_it_once_the_stray_writer_exits(tmp_path, monkeypatch):
    path = tmp_path / "log"
    stray = make_log(path, 2)
    clock = FakeClock(monkeypatch, on_sleep=stray.close)  # the stray writer exits during the first wait
    w = StepLogWriter.open(path, lock_timeout_s=5.0)
    assert clock.sleeps == 1 and (w.next_step, w.header, w.path) == (2, read_header(path), path)
    w.append(rec(2))
    w.close()
    assert read_records(path) == [rec(i) for i in range(3)]


def test_one_appender_at_a_time(tmp_path):
    """A second writer (e.g. a restarted worker while a stray one still runs) waits for the lock, then gives up clearly."""
    path = tmp_path / "log.bin"
    first = StepLogWriter.create(path, {"run_id": "x"})
    with pytest.raises(StepLogBusyError, match="another process is appending"):
        StepLogWriter.open(path, lock_timeout_s=0.3)
    first.close()
    second = StepLogWriter.open(path, lock_timeout_s=0.3)
    assert second.next_step == 0
    second.close()


class FsyncSpy:
    """Wraps ``os.fsync``: for each fsync of a watched file or folder, what the test asks at that moment."""

    def __init__(self, monkeypatch, watch: dict) -> None:
        self.real, self.watch, self.seen = os.fsync, watch, []  # watch: inode -> (label, question)
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd: int) -> None:
        self.real(fd)
        label, question = self.watch.get(os.fstat(fd).st_ino, (None, None))
        if label is not None:
            self.seen.append((label, question()))


def test_an_append_is_fsynced_after_the_whole_record_is_written_and_before_it_returns(tmp_path, monkeypatch):
    path = tmp_path / "log"
    w = make_log(path, 2)
    spy = FsyncSpy(monkeypatch, {os.stat(path).st_ino: ("log", lambda: os.path.getsize(path))})
    size = os.path.getsize(path)
    w.append(rec(2))
    assert spy.seen == [("log", size + RECORD_BYTES)]
    w.close()


def test_creating_a_log_fsyncs_it_and_then_its_folder_once_it_has_its_name(tmp_path, monkeypatch):
    path = tmp_path / "log"
    spy = FsyncSpy(monkeypatch, {os.stat(tmp_path).st_ino: ("folder", path.exists)})
    StepLogWriter.create(path, {"model": "x"}).close()
    assert spy.seen == [("folder", True)]  # the rename is durable: the log survives a crash of the node


def test_cutting_a_torn_tail_is_fsynced_before_open_returns(tmp_path, monkeypatch):
    path = tmp_path / "log"
    w = make_log(path, 2)
    clean_size = os.path.getsize(path)
    w.write_torn(2)
    w.close()
    spy = FsyncSpy(monkeypatch, {os.stat(path).st_ino: ("log", lambda: os.path.getsize(path))})
    StepLogWriter.open(path).close()
    assert spy.seen == [("log", clean_size)]
    StepLogWriter.open(path).close()  # now clean: opening it writes nothing
    assert spy.seen == [("log", clean_size)]


def test_every_read_error_names_the_log(tmp_path):
    """Each reader's error names the file it read: a bad header seen by each, a gap seen by ``read_log``,
    by the writer opening the log and by a following ``StepLogReader``."""
    path = tmp_path / "named.log"
    path.write_bytes(b"not a step log at all")
    for read in (read_header, read_log, StepLogReader, StepLogWriter.open):
        with pytest.raises(StepLogCorruptError, match=f"^{re.escape(str(path))}: not a raycheck step log"):
            read(path)
    path.unlink()
    w = make_log(path, 2)
    gap_at = os.path.getsize(path)
    reader = StepLogReader(path, start_step=2)
    os.write(w._fd, rec(4).bound(w.tag, w.path).encode())
    w.close()
    with pytest.raises(StepLogGapError, match=f"^{re.escape(str(path))}: record at byte \\d+ is step 4, expected step 2"):
        reader.poll()
    for read in (read_log, StepLogWriter.open):
        with pytest.raises(StepLogGapError, match=f"^{re.escape(str(path))}: record at byte {gap_at} is step 4, expected step 2"):
            read(path)


def test_read_log_reports_the_bytes_of_a_torn_tail(tmp_path):
    w = make_log(tmp_path / "log", 3)
    w.write_torn(3)
    w.close()
    header, records, torn_bytes = read_log(tmp_path / "log")
    assert (header["model"], records, torn_bytes) == ("x", [rec(i) for i in range(3)], RECORD_BYTES // 2)


def test_read_prefix_returns_the_records_before_a_gap_and_the_gap(tmp_path):
    w = make_log(tmp_path / "log", 3)
    os.write(w._fd, rec(5).bound(w.tag, w.path).encode() + rec(6).bound(w.tag, w.path).encode())
    w.close()
    prefix = read_prefix(tmp_path / "log")
    assert (prefix.header["model"], prefix.records, prefix.torn_bytes) == ("x", [rec(i) for i in range(3)], 0)
    assert isinstance(prefix.damage, StepLogGapError) and str(prefix.damage).startswith(
        f"{tmp_path / 'log'}: record at byte ") and "is step 5, expected step 3" in str(prefix.damage)
    (tmp_path / "header").write_bytes(b"RCLOGxx")
    with pytest.raises(StepLogCorruptError, match=f"^{re.escape(str(tmp_path / 'header'))}: not a raycheck step log"):
        read_prefix(tmp_path / "header")
    with pytest.raises(StepLogGapError):  # the strict readers are unchanged
        read_log(tmp_path / "log")


def test_read_prefix_stops_at_a_corrupt_record_and_reports_a_torn_tail_of_an_intact_log(tmp_path):
    w = make_log(tmp_path / "log", 6)
    w.close()
    data = bytearray((tmp_path / "log").read_bytes())
    data[len(data) - 2 * RECORD_BYTES + 3] ^= 0xFF  # step 4's record; step 5's follows it
    (tmp_path / "log").write_bytes(bytes(data))
    prefix = read_prefix(tmp_path / "log")
    assert prefix.records == [rec(i) for i in range(4)] and prefix.torn_bytes == 0
    assert isinstance(prefix.damage, StepLogCorruptError) and "after step 3" in str(prefix.damage)

    w = make_log(tmp_path / "torn", 2)
    w.write_torn(2)
    w.close()
    prefix = read_prefix(tmp_path / "torn")
    assert (prefix.records, prefix.torn_bytes, prefix.damage) == ([rec(0), rec(1)], RECORD_BYTES // 2, None)


def test_a_torn_append_is_the_first_half_of_a_zeroed_record_of_its_step(tmp_path):
    """What ``write_torn`` (the ``torn`` failure) leaves: the step number, then zeros, cut mid-record."""
    w = make_log(tmp_path / "log", 1)
    size = os.path.getsize(tmp_path / "log")
    w.write_torn(1)
    w.close()
    tail = (tmp_path / "log").read_bytes()[size:]
    assert tail == (1).to_bytes(8, "little") + bytes(RECORD_BYTES // 2 - 8)


def test_the_file_is_laid_out_as_documented(tmp_path):
    """The bytes on disk, decoded by hand from the module docstring's layout (what another reader
    relies on): magic, u32 header length, sorted JSON header, its crc32, then one 84-byte record per
    step: the fields little-endian, the trajectory tag (sha256 of [run id, trajectory hash], its first
    8 bytes, lowest bit set), then the crc32 of those 80 bytes."""
    make_log(tmp_path / "log", 2).close()
    data = (tmp_path / "log").read_bytes()
    assert data[:8] == b"RCSTEPLG"
    n = int.from_bytes(data[8:12], "little")
    body = data[12 : 12 + n]
    assert body == json.dumps({"format_version": 2, "model": "x", "record_bytes": 84}, sort_keys=True).encode()
    assert int.from_bytes(data[12 + n : 16 + n], "little") == zlib.crc32(body)
    records = data[16 + n :]
    assert len(records) == 2 * 84
    tag = int.from_bytes(hashlib.sha256(b"[null, null]").digest()[:8], "little") | 1
    for step in range(2):
        fields, crc = records[84 * step : 84 * step + 80], records[84 * step + 80 : 84 * (step + 1)]
        r = rec(step)
        assert fields == struct.pack("<QQddddddQQ", r.step, r.seed, r.projected_grad, r.loss_plus, r.loss_minus, r.lr, r.eps,
                                     r.weight_decay, r.batch_id, tag)
        assert int.from_bytes(crc, "little") == zlib.crc32(fields)


@pytest.mark.parametrize("cut, problem", [(10, "bad magic"), (12, "header is truncated (12 of"), (-5, "header is truncated")])
def test_a_short_header_is_refused_with_what_is_missing(tmp_path, cut, problem):
    make_log(tmp_path / "log", 0).close()
    data = (tmp_path / "log").read_bytes()
    (tmp_path / "log").write_bytes(data[:cut])
    with pytest.raises(StepLogCorruptError, match=re.escape(problem)):
        read_header(tmp_path / "log")


def write_header_only(path, header: dict) -> None:
    body = json.dumps(header).encode()
    path.write_bytes(b"RCSTEPLG" + len(body).to_bytes(4, "little") + body + zlib.crc32(body).to_bytes(4, "little"))


def test_a_header_of_another_format_version_is_refused(tmp_path):
    write_header_only(tmp_path / "log", {"format_version": 3})
    with pytest.raises(StepLogCorruptError, match="format version 3, expected 2"):
        read_records(tmp_path / "log")


def test_a_log_of_format_version_1_is_refused_saying_why_and_what_to_do(tmp_path):
    """raycheck before issue 32 wrote 76-byte records that do not name their trajectory."""
    write_header_only(tmp_path / "log", {"format_version": 1, "record_bytes": 76})
    for read in (read_records, read_prefix, StepLogWriter.open):
        with pytest.raises(StepLogCorruptError, match=r"a step log of format version 1, whose records do not name their "
                                                      r"trajectory; this raycheck reads version 2: .* or start a new --out$"):
            read(tmp_path / "log")


def test_a_short_write_raises_naming_the_step_and_its_torn_half_is_cut_on_reopen(tmp_path, monkeypatch):
    """What a full disk does to ``os.write``: only part of the record lands. The append raises, the
    writer does not count the step, and reopening the log cuts the partial record."""
    path = tmp_path / "log"
    w = make_log(path, 2)
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:RECORD_BYTES // 2]))
    with pytest.raises(OSError, match=f"^{re.escape(str(path))}: short write while appending step 2$"):
        w.append(rec(2))
    monkeypatch.undo()
    assert w.next_step == 2
    w.close()
    w = StepLogWriter.open(path)
    assert (w.next_step, w.cut_bytes) == (2, RECORD_BYTES // 2)
    w.close()
