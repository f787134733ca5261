import os

import pytest

from storage.steplog import (
    RECORD_BYTES,
    StepLogBusyError,
    StepLogCorruptError,
    StepLogGapError,
    StepLogReader,
    StepLogWriter,
    StepRecord,
    read_header,
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
    assert RECORD_BYTES == 76


def test_append_refuses_a_gap_or_a_repeat(tmp_path):
    w = make_log(tmp_path / "log", 3)
    with pytest.raises(StepLogGapError, match="appending step 5, but the next step is 3"):
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
    with pytest.raises(StepLogCorruptError, match="followed by more data"):
        StepLogWriter.open(tmp_path / "log")


@pytest.mark.parametrize("torn_bytes", [0, RECORD_BYTES // 2])
def test_a_zero_filled_tail_longer_than_a_record_is_torn_and_cut(tmp_path, torn_bytes):
    """What some filesystems leave after a crash: the file extended with zeros, after a whole or a
    half-written last record. Every record before it is intact, so the log continues."""
    w = make_log(tmp_path / "log", 4)
    os.write(w._fd, rec(4).encode()[:torn_bytes] + bytes(3 * RECORD_BYTES + 5))
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


def test_a_non_zero_garbage_tail_longer_than_a_record_is_refused(tmp_path):
    w = make_log(tmp_path / "log", 2)
    os.write(w._fd, b"\xaa" * (2 * RECORD_BYTES))
    w.close()
    with pytest.raises(StepLogCorruptError, match="followed by more data"):
        StepLogWriter.open(tmp_path / "log")


def test_gap_in_the_file_is_refused_with_the_missing_steps(tmp_path):
    w = make_log(tmp_path / "log", 2)
    os.write(w._fd, rec(5).encode())  # bypass the writer's own check, as a foreign writer could
    w.close()
    with pytest.raises(StepLogGapError, match=r"is step 5, expected step 2; steps 2..4 are missing"):
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
    os.write(w._fd, rec(2).encode()[:30])
    assert r.poll() == []
    os.write(w._fd, rec(2).encode()[30:])
    w.next_step = 3
    w.append(rec(3))
    assert [x.step for x in r.poll()] == [2, 3]
    assert StepLogReader(tmp_path / "log", start_step=3).poll() == [rec(3)]


def test_create_refuses_to_overwrite(tmp_path):
    make_log(tmp_path / "log", 1).close()
    with pytest.raises(FileExistsError):
        StepLogWriter.create(tmp_path / "log", {})


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
