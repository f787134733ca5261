"""Local puts write in chunks and fdatasync each one (``storage.files.write_synced``), optionally paced
(``WritePacer``), so that a snapshot never leaves hundreds of MB in flight in front of a step log fsync;
the commit rules (temp name, fsync, rename, folder fsync) still make an object visible whole or not at all."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import raycheck.storage.backend as backend
import raycheck.storage.files as files
from raycheck.job.run_dir import RunDir
from raycheck.storage.backend import LOCAL_WRITE_CHUNK_BYTES, TEMP_MAX_AGE_S, RetryPolicy, Storage, StorageError, WritePacer
from raycheck.storage.diffs import DiffStore
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.files import atomic_write, write_synced

ONE_TRY = RetryPolicy(attempts=1)


def blob(size_bytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8).tobytes()


@pytest.fixture()
def fdatasyncs(monkeypatch):
    """Every ``os.fdatasync`` of the backend, recorded as the file's size at that moment (then run)."""
    sizes: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        sizes.append(os.fstat(fd).st_size)
        real(fd)

    monkeypatch.setattr(backend.os, "fdatasync", counting)
    return sizes


@pytest.mark.parametrize(("size_bytes", "chunk_bytes", "synced_sizes"), [
    (10_500, 1000, [1000 * k for k in range(1, 11)] + [10_500]),  # a short last chunk
    (3000, 1000, [1000, 2000, 3000]),
    (0, 1000, []),
    (2 * LOCAL_WRITE_CHUNK_BYTES + 7, None, [LOCAL_WRITE_CHUNK_BYTES, 2 * LOCAL_WRITE_CHUNK_BYTES,
                                              2 * LOCAL_WRITE_CHUNK_BYTES + 7]),  # the default chunk
])
def test_a_put_fdatasyncs_each_chunk_as_it_is_written_and_reads_back_byte_identical(
        tmp_path, fdatasyncs, size_bytes, chunk_bytes, synced_sizes):
    store = Storage(str(tmp_path), **({"write_chunk_bytes": chunk_bytes} if chunk_bytes else {}))
    data = blob(size_bytes)
    store.put("a/shard.safetensors", data)
    assert fdatasyncs == synced_sizes  # one sync per chunk, right after that chunk's bytes
    assert hashlib.sha256(store.get("a/shard.safetensors")).hexdigest() == hashlib.sha256(data).hexdigest()
    assert sorted(os.listdir(tmp_path / "a")) == ["shard.safetensors"]  # no temp file left


def test_one_go_writer_syncs_once_at_the_end(tmp_path, fdatasyncs):
    store = Storage(str(tmp_path), write_chunk_bytes=None)
    data = blob(5000)
    store.put("x", data)
    assert fdatasyncs == []
    assert store.get("x") == data


def test_a_failed_chunk_sync_leaves_no_object_and_the_previous_one_intact(tmp_path, monkeypatch):
    store = Storage(str(tmp_path), retry=ONE_TRY, write_chunk_bytes=1000)
    old = blob(2500, seed=1)
    store.put("obj", old)
    calls = []

    def failing_from_the_third(fd: int) -> None:  # the first put fails at its third chunk, the second at its first
        calls.append(fd)
        if len(calls) >= 3:
            raise OSError(errno.EIO, "injected I/O error")

    monkeypatch.setattr(backend.os, "fdatasync", failing_from_the_third)
    with pytest.raises(StorageError, match="injected I/O error"):
        store.put("obj", blob(9000, seed=2))
    with pytest.raises(StorageError, match="injected I/O error"):
        store.put("new", blob(9000, seed=3))
    assert store.list() == ["obj"]
    assert sorted(os.listdir(tmp_path)) == ["obj"]  # the temp files were removed
    assert store.get("obj") == old


KILLED_MID_PUT = """
import os, sys
import raycheck.storage.backend as backend
from raycheck.job.run_dir import RunDir
from raycheck.storage.backend import Storage

real, synced = os.fdatasync, []
def gate(fd):
    real(fd)
    synced.append(fd)
    if len(synced) == 2:  # two chunks are on disk: say so, then block until SIGKILLed
        print("two chunks", flush=True)
        sys.stdin.read()
backend.os.fdatasync = gate
Storage(sys.argv[1], write_chunk_bytes=1000).put("snap/shard", bytes(5000))
"""


def test_sigkill_mid_chunked_put_leaves_no_visible_object(tmp_path):
    root = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_PUT, str(root)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert proc.stdout.readline().strip() == "two chunks"
        (tmp,) = os.listdir(root / "snap")
        assert ".tmp-" in tmp and os.path.getsize(root / "snap" / tmp) == 2000  # half written, under a temp name
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = Storage(str(root))
    assert store.list() == []
    assert not store.exists("snap/shard")


def plant_temp(path, size_bytes: int, age_s: float) -> str:
    """A temp file of ``atomic_write`` at ``path``, as a killed writer leaves it, last modified ``age_s`` ago."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temp = f"{path}{files.TEMP_MARK}0123abcd"
    with open(temp, "wb") as f:
        f.write(bytes(size_bytes))
    then = time.time() - age_s
    os.utime(temp, (then, then))
    return temp


def test_retention_and_diff_collection_delete_old_temp_files_of_killed_writes_and_keep_fresh_ones(tmp_path):
    store = SnapshotStore(str(tmp_path))
    first = store.write(1, {"model.norm.weight": np.ones(4, np.float32)})
    old = [plant_temp(tmp_path / first.folder / "layer.000.safetensors", 300, TEMP_MAX_AGE_S + 60),
           plant_temp(tmp_path / "index.json", 10, TEMP_MAX_AGE_S + 60),
           plant_temp(tmp_path / "sharded" / "step-x" / "__0_0.distcp", 20, TEMP_MAX_AGE_S + 60)]
    fresh = plant_temp(tmp_path / first.folder / "norm.safetensors", 200, TEMP_MAX_AGE_S - 600)  # its writer may live
    assert [t.bytes for t in store.storage.temp_files()] == [10, 20, 300, 200]  # by path: index, sharded, step-
    store.write(2, {"model.norm.weight": np.zeros(4, np.float32)})  # commits, then retains
    assert not any(os.path.exists(p) for p in old)
    assert os.path.exists(fresh) and [t.path for t in store.storage.temp_files()] == [os.path.relpath(fresh, tmp_path)]

    diffs = DiffStore(store.storage)
    diffs.write_batch([(0, {"w": np.ones(3, np.float32)})])
    old_diff = plant_temp(tmp_path / "diffs" / "0000000001-0000000001-0123abcd.safetensors", 50, TEMP_MAX_AGE_S + 1)
    fresh_diff = plant_temp(tmp_path / "diffs" / "0000000002-0000000002-0123abcd.safetensors", 50, 1)
    assert diffs.collect_garbage(1) == 2  # the batch and its commit record; temp files are not counted
    assert not os.path.exists(old_diff) and os.path.exists(fresh_diff) and os.path.exists(fresh)  # its prefix only
    removed = store.storage.remove_stale_temp_files(0)  # 0 s: every one
    assert sorted(t.path for t in removed) == sorted(os.path.relpath(p, tmp_path) for p in (fresh, fresh_diff))
    assert store.storage.temp_files() == []
    with pytest.raises(ValueError, match="max_age_s"):
        store.storage.remove_stale_temp_files(-1)


def test_write_synced_waits_on_the_pacer_before_each_chunk(tmp_path):
    waited = []

    class Recorder:
        def wait(self, nbytes: int) -> None:
            waited.append(nbytes)

    with open(tmp_path / "f", "wb", buffering=0) as fh:
        write_synced(fh.fileno(), blob(2500), 1000, Recorder())
    assert waited == [1000, 1000, 500]
    assert (tmp_path / "f").read_bytes() == blob(2500)


def test_atomic_write_paces_each_chunk_and_creates_a_file_that_the_umask_alone_restricts(tmp_path):
    """The pacer reaches every chunk of an atomic write (a capped ``Storage`` puts through it); the file
    is created with mode 0o666 less the umask (not executable, as ``open`` would make it)."""
    waited = []

    class Recorder:
        def wait(self, nbytes: int) -> None:
            waited.append(nbytes)

    old = os.umask(0)
    try:
        atomic_write(tmp_path / "f", blob(2500), 1000, Recorder())
    finally:
        os.umask(old)
    assert waited == [1000, 1000, 500] and (tmp_path / "f").read_bytes() == blob(2500)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o666


def test_atomic_write_of_a_bare_file_name_syncs_the_current_folder(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(files, "fsync_dir", lambda path: synced.append(os.path.realpath(path)))
    monkeypatch.chdir(tmp_path)
    atomic_write("state.json", b"{}")
    assert synced == [str(tmp_path.resolve())] and (tmp_path / "state.json").read_bytes() == b"{}"
    assert os.listdir(tmp_path) == ["state.json"]  # no temp file left


def test_pacer_reserves_consecutive_slots_at_the_capped_rate():
    now, slept = [10.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    pacer = WritePacer(1000.0, clock=lambda: now[0], sleep=sleep)
    pacer.wait(500)  # the first slot starts at once: 10.0 .. 10.5
    pacer.wait(1000)  # waits for 10.5, its slot ends at 11.5
    now[0] += 2.0  # idle longer than the schedule: no debt, no burst credit
    pacer.wait(250)
    pacer.wait(250)
    assert slept == [0.5, 0.25]


def test_write_settings_travel_with_a_pickled_store_and_bad_ones_are_refused(tmp_path):
    store = pickle.loads(pickle.dumps(Storage(str(tmp_path), write_chunk_bytes=4096, write_rate_bytes_per_s=5e6)))
    assert (store.write_chunk_bytes, store.write_rate_bytes_per_s) == (4096, 5e6)
    with pytest.raises(ValueError, match="write_chunk_bytes must be >= 1"):
        Storage(str(tmp_path), write_chunk_bytes=0)
    with pytest.raises(ValueError, match="write rate must be > 0"):
        Storage(str(tmp_path), write_rate_bytes_per_s=0)


def test_the_benchmark_compares_the_one_go_writer_the_chunked_ones_and_the_cpu_work_alone(tmp_path):
    from raycheck.experiments.durability_bench import writers

    chosen = writers([LOCAL_WRITE_CHUNK_BYTES, 1 << 20], [50])
    assert list(chosen) == ["one-go", "chunked", "chunks of 1 MiB", "chunked, capped at 50 MB/s", "no disk (memory://)"]
    stores = [make(tmp_path / str(i)) for i, make in enumerate(chosen.values())]
    assert [(s.protocol, s.write_chunk_bytes, s.write_rate_bytes_per_s) for s in stores] == [
        ("file", None, None), ("file", LOCAL_WRITE_CHUNK_BYTES, None), ("file", 1 << 20, None),
        ("file", LOCAL_WRITE_CHUNK_BYTES, 50e6), ("memory", LOCAL_WRITE_CHUNK_BYTES, None)]


def test_a_run_directory_json_file_is_replaced_whole_and_its_folder_synced_once_it_has_the_new_value(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    RunDir.write_json(path, {"ok": False})
    seen, real = [], os.fsync

    def spy(fd: int) -> None:
        real(fd)
        if os.fstat(fd).st_ino == os.stat(tmp_path).st_ino:
            seen.append(path.read_text())

    monkeypatch.setattr(os, "fsync", spy)
    RunDir.write_json(path, {"ok": True})
    assert seen == ['{\n  "ok": true\n}']  # the folder is synced after the rename: the new value survives a crash

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        RunDir.write_json(path, {"ok": "half"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temp file left
    assert path.read_text() == '{\n  "ok": true\n}'  # the old value stays


@pytest.mark.parametrize("name", ["chunked, own process, idle priority", "direct, one sync, own process, idle"])
def test_the_benchmark_writes_snapshots_from_a_process_of_its_own_at_idle_priority(tmp_path, name):
    """``--process-writers``: the child loads the state file, lowers itself, and writes whole snapshots
    (loadable, bitwise the state) once the measured records start, until it is stopped; chunked and
    direct (``O_DIRECT``) alike."""
    from raycheck.experiments.durability_bench import process_writers
    from raycheck.storage.snapshots import SnapshotStore
    from raycheck.storage.tensor_files import save_file
    from raycheck.training.state import state_sha256

    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    save_file(state, str(tmp_path / "state.safetensors"))
    chosen = process_writers(tmp_path / "state.safetensors")
    assert list(chosen) == ["chunked, own process", "chunked, own process, idle priority", "direct, own process",
                            "direct, own process, idle priority", "direct, one sync, own process, idle"]
    write = chosen[name]
    prepared, measuring, done, written_s = threading.Event(), threading.Event(), threading.Event(), []
    thread = threading.Thread(target=write, args=(tmp_path / "snapshots", state, prepared, measuring, done, written_s))
    thread.start()
    assert prepared.wait(120) and written_s == []  # nothing is written before the measured records start
    measuring.set()
    deadline = time.monotonic() + 120  # a bound on a hang, not a timed assertion
    while not written_s and time.monotonic() < deadline:
        time.sleep(0.05)
    done.set()
    thread.join()
    assert written_s
    loaded = SnapshotStore(str(tmp_path / "snapshots")).load_latest()
    assert state_sha256(dict(sorted(loaded.state.items()))) == state_sha256(dict(sorted(state.items())))  # bitwise, by name


def test_the_benchmark_s_raw_log_layouts_hold_the_same_records_one_grown_one_overwritten_in_zeros(tmp_path):
    """``--log-layouts``: both files hold the warm-up and measured records back to back; the pre-zeroed
    one is ``PREZERO_BYTES`` long, zeros after the records (an overwrite never grew it)."""
    from raycheck.experiments.durability_bench import LOG_LAYOUTS, PREZERO_BYTES, WARMUP_RECORDS, raw_append_s, record

    grown, prezeroed = ((tmp_path / str(i) / "raw.bin") for i in range(2))
    for i, layout in enumerate(LOG_LAYOUTS):
        assert len(raw_append_s(layout, tmp_path / str(i), 5)) == 5
    expected = record(0).encode() * (WARMUP_RECORDS + 5)
    assert grown.read_bytes() == expected
    assert prezeroed.read_bytes() == expected + bytes(PREZERO_BYTES - len(expected))


# -- direct I/O (Storage(write_direct=True): O_DIRECT through a page-aligned buffer) ---------------------------------

def direct_io_allowed(folder) -> bool:
    """Whether ``folder``'s file system takes ``O_DIRECT`` (tmpfs does since Linux 6.6)."""
    try:
        os.close(os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError as e:
        assert e.errno == errno.EINVAL
        return False
    finally:
        os.unlink(folder / "probe")


@pytest.fixture()
def direct_writes(monkeypatch):
    """Every ``os.write`` of the storage modules, recorded as (bytes asked, O_DIRECT set on the fd) (then run)."""
    seen: list[tuple[int, bool]] = []
    real = os.write

    def spy(fd: int, data) -> int:
        seen.append((len(data), bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return real(fd, data)

    monkeypatch.setattr(files.os, "write", spy)
    return seen


def split(data: bytes, cuts: tuple[int, ...]) -> list[memoryview]:
    """``data`` cut at the offsets ``cuts`` (clipped to its size): pieces of uneven sizes, some empty."""
    edges = [0, *(min(c, len(data)) for c in cuts), len(data)]
    return [memoryview(data)[a:b] for a, b in zip(edges, edges[1:])]


CHUNK = 3 * 4096
DIRECT_SIZES = (0, 1, 4095, 4096, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 4 * CHUNK + 5, 2 * LOCAL_WRITE_CHUNK_BYTES + 4097)


@pytest.mark.parametrize("chunk_bytes", [CHUNK, LOCAL_WRITE_CHUNK_BYTES, None])
@pytest.mark.parametrize("size_bytes", DIRECT_SIZES)
def test_a_direct_put_writes_whole_aligned_chunks_and_reads_back_byte_identical(tmp_path, direct_writes, fdatasyncs,
                                                                               size_bytes, chunk_bytes):
    store = Storage(str(tmp_path / "store"), write_direct=True, write_chunk_bytes=chunk_bytes)
    data = blob(size_bytes, seed=size_bytes)
    pieces = split(data, (1, 5000, 5001, CHUNK + 3, 3 * CHUNK))  # pieces span chunks and end mid-chunk
    assert store.put_stream("a/shard", lambda: pieces) == (size_bytes, hashlib.sha256(data).hexdigest())
    assert hashlib.sha256(store.get("a/shard")).hexdigest() == hashlib.sha256(data).hexdigest()
    assert os.path.getsize(tmp_path / "store" / "a" / "shard") == size_bytes  # the last chunk's padding is cut off
    assert os.listdir(tmp_path / "store" / "a") == ["shard"]  # no temp file left
    buffer = chunk_bytes or files.DIRECT_BUFFER_BYTES
    whole, rest = divmod(size_bytes, buffer)
    expected = [buffer] * whole + ([-(-rest // 4096) * 4096] if rest else [])  # full buffers, the last padded
    assert direct_writes == [(n, direct_io_allowed(tmp_path)) for n in expected]
    synced = [min(buffer * k, size_bytes) for k in range(1, whole + 1 + bool(rest))]
    ends = [-(-s // 4096) * 4096 for s in synced]  # the file's size at each sync: padded, not yet truncated
    assert fdatasyncs == (ends if chunk_bytes else [])


def test_a_direct_put_to_tmpfs_and_one_where_o_direct_is_refused_write_the_same_bytes(tmp_path, monkeypatch, caplog):
    """/dev/shm (tmpfs: O_DIRECT taken since Linux 6.6, refused before) round-trips either way; a file
    system that refuses (EINVAL from ``fcntl``, as some FUSE ones) gets the buffered write, logged once."""
    data = blob(3 * 4096 + 100)
    shm = Storage(f"/dev/shm/raycheck-test-{os.getpid()}-{tmp_path.name}", write_direct=True, write_chunk_bytes=8192)
    try:
        shm.put("x", data)
        assert shm.get("x") == data and shm.list() == ["x"] and shm.temp_files() == []
    finally:
        shutil.rmtree(shm.root)

    real_fcntl = fcntl.fcntl

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(files.fcntl, "fcntl", refusing)
    monkeypatch.setattr(files, "_buffered_devices", set())
    store = Storage(str(tmp_path), write_direct=True, write_chunk_bytes=8192)
    with caplog.at_level("WARNING", logger="raycheck.storage.files"):
        store.put("a", data)
        store.put("b", data[:5])
    assert store.get("a") == data and store.get("b") == data[:5] and sorted(os.listdir(tmp_path)) == ["a", "b"]
    assert [r.getMessage().endswith("refuses O_DIRECT: its local writes are buffered") for r in caplog.records] == [True]


@pytest.mark.parametrize("fails", ["write", "pieces"])
def test_a_failed_direct_put_leaves_no_object_no_temp_file_and_the_previous_one_intact(tmp_path, monkeypatch, fails):
    store = Storage(str(tmp_path), retry=ONE_TRY, write_direct=True, write_chunk_bytes=4096)
    old = blob(10_000, seed=1)
    store.put("obj", old)
    real, writes = os.write, []

    def failing_third_write(fd: int, data) -> int:
        writes.append(len(data))
        if len(writes) == 3:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(fd, data)

    def failing_pieces():
        yield blob(9000, seed=2)
        raise OSError(errno.ECONNRESET, "source failed (injected)")

    if fails == "write":
        monkeypatch.setattr(files.os, "write", failing_third_write)
    for rel in ("obj", "new"):
        with pytest.raises(StorageError, match="injected"):
            store.put_stream(rel, (lambda: (blob(20_000, seed=3),)) if fails == "write" else failing_pieces)
        writes.clear()
    assert sorted(os.listdir(tmp_path)) == ["obj"] and store.temp_files() == []
    assert store.get("obj") == old


def test_direct_writes_travel_with_a_pickled_store_and_unaligned_chunks_are_refused(tmp_path):
    store = pickle.loads(pickle.dumps(Storage(str(tmp_path), write_direct=True, write_chunk_bytes=8192)))
    assert (store.write_direct, store.write_chunk_bytes) == (True, 8192)
    assert pickle.loads(pickle.dumps(Storage(str(tmp_path)))).write_direct is False
    with pytest.raises(ValueError, match="multiple of 4096 for direct writes, got 1000"):
        Storage(str(tmp_path), write_direct=True, write_chunk_bytes=1000)
    with pytest.raises(ValueError, match="multiple of 4096, got 1000"):
        files.atomic_write_pieces(tmp_path / "f", (b"x",), 1000, direct=True)
    assert os.listdir(tmp_path) == []  # refused before a byte was written; the temp file removed
