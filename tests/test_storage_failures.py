"""Storage that fails: hangs, refuses connections, loses its bucket, stops mid-run, or has its writer
SIGKILLed mid-snapshot: the failures users of other checkpointing systems report."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
from moto.server import ThreadedMotoServer

from raycheck.actors.persister import SnapshotPersister
from conftest import free_port, make_bucket
from raycheck.storage.backend import RetryPolicy, Storage, StorageError, StorageTimeoutError, StorageUnavailableError
from raycheck.storage.snapshots import SnapshotStore
from raycheck.training.state import state_sha256

FAST = RetryPolicy(attempts=2, base_delay_s=0.01, timeout_s=2.0, max_consecutive_failures=2)
# against a live server: few, quick retries, but no timeout that a loaded machine could reach (only the
# hanging-endpoint tests are about a timeout)
PATIENT = RetryPolicy(attempts=2, base_delay_s=0.01, timeout_s=60.0, max_consecutive_failures=2)


def small_state(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {f"model.layers.{i}.w": rng.standard_normal(64).astype(np.float32) for i in range(4)}


@pytest.fixture()
def silent_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers (a hung endpoint)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    conns, stop = [], threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(sock.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    for c in conns:
        c.close()
    sock.close()


def test_hanging_endpoint_times_out_then_the_store_is_refused(silent_server):
    storage = Storage("s3://hung/run", retry=FAST, endpoint_url=silent_server)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="failed after 2 tries"):
        storage.put("x", b"1")
    assert time.monotonic() - t0 < 15
    with pytest.raises(StorageError):
        storage.get("x")
    with pytest.raises(StorageUnavailableError, match="2 storage operations failed in a row; refusing list .*breaker open"):
        storage.list()


def test_timeouts_are_reported_as_such(silent_server):
    storage = Storage("s3://hung/run", retry=RetryPolicy(attempts=1, timeout_s=1.0), endpoint_url=silent_server)
    with pytest.raises(StorageError, match=r"^put s3://hung/run/x failed after 1 try: StorageTimeoutError: put s3://hung/run/x: "
                                           r"no answer within 1 s$") as info:
        storage.put("x", b"1")
    assert type(info.value.__cause__) is StorageTimeoutError


def test_a_start_up_bucket_check_waits_10_s_a_try_not_the_operations_timeout(silent_server):
    """``check_bucket`` (before a run starts, and in ``inspect``) against an endpoint that accepts connections and never
    answers: each try is bounded by ``CHECK_TIMEOUT_S`` (10 s), not by the policy's 120 s for a snapshot's write."""
    storage = Storage("s3://hung/run", retry=RetryPolicy(attempts=1, timeout_s=120.0), endpoint_url=silent_server)
    with pytest.raises(StorageError, match=r"^check bucket s3://hung failed after 1 try: StorageTimeoutError: check bucket "
                                           r"s3://hung: no answer within 10 s$"):
        storage.check_bucket()


def test_unreachable_endpoint_names_it():
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    storage = Storage("s3://bucket/run", retry=FAST, endpoint_url=endpoint)
    with pytest.raises(StorageError, match=r"put s3://bucket/run/x failed after 2 tries"):
        storage.put("x", b"1")


def test_missing_bucket_is_a_clear_error_and_not_retried(s3_endpoint):
    storage = Storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run", retry=PATIENT, endpoint_url=s3_endpoint)
    with pytest.raises(FileNotFoundError, match="(?i)bucket"):
        storage.put("x", b"1")
    assert storage.breaker.consecutive_failures == 0


def test_s3_outage_during_persists_is_counted_and_the_restore_point_survives():
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    bucket = f"outage-{uuid.uuid4().hex[:8]}"  # moto keeps buckets across server instances in one process
    make_bucket(endpoint, bucket)
    store = SnapshotStore(Storage(f"s3://{bucket}/run", retry=PATIENT, endpoint_url=endpoint), keep_last=1)
    persister = SnapshotPersister(store)
    persister.submit(1, small_state(1))
    assert persister.flush(30)["last_durable_step"] == 1
    server.stop()  # the storage goes away mid-run
    persister.submit(2, small_state(2))
    status = persister.flush(60)
    assert (status["failed"], status["last_durable_step"], status["last_submitted_step"]) == (1, 1, 2)
    assert "step 2" in status["last_error"]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()  # storage is back: the restore point written before the outage still loads
    try:
        fresh = SnapshotStore(Storage(f"s3://{bucket}/run", retry=PATIENT, endpoint_url=endpoint))
        assert [i.step for i in fresh.list()] == [1]
        assert state_sha256(fresh.load_latest().state) == state_sha256(small_state(1))
    finally:
        server.stop()


WRITER = """
import sys, threading, numpy as np
from raycheck.storage.backend import Storage
from raycheck.storage.snapshots import SnapshotStore

FIRST = threading.Lock()  # shard puts run on several threads: exactly one of them reports

class StopAfterAShardOfStep2(Storage):  # the kill point is forced: a shard of step 2 is stored, no manifest
    def put_stream(self, rel, pieces):  # every put, shards streamed or not, goes through it
        written = super().put_stream(rel, pieces)
        if rel.startswith("step-0000000002-") and rel.endswith(".safetensors"):
            if FIRST.acquire(blocking=False):
                print("shard", rel, flush=True)
            threading.Event().wait()  # every shard put of step 2 blocks here until the SIGKILL
        return written

store = SnapshotStore(StopAfterAShardOfStep2(sys.argv[1], **({"endpoint_url": sys.argv[2]} if len(sys.argv) > 2 else {})))
state = {f"model.layers.{i}.w": np.full(1000, i, dtype=np.float32) for i in range(8)}
store.write(1, {k: v[:10] for k, v in state.items()})
print("committed", flush=True)
store.write(2, state)  # killed while writing these shards
"""


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_sigkill_mid_snapshot_never_exposes_it_and_a_retry_does_not_mix(backend, tmp_path, s3_endpoint):
    if backend == "file":
        uri, extra, storage = str(tmp_path / "store"), [], Storage(str(tmp_path / "store"))
    else:
        bucket = f"rc-{uuid.uuid4().hex[:12]}"
        make_bucket(s3_endpoint, bucket)
        uri, extra = f"s3://{bucket}/run", [s3_endpoint]
        storage = Storage(uri, endpoint_url=s3_endpoint)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, uri, *extra], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert proc.stdout.readline().strip() == "committed"
        kind, shard = proc.stdout.readline().split()
        assert kind == "shard" and shard in storage.list()  # step 2 is half written
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = SnapshotStore(storage)
    assert [i.step for i in store.list()] == [1]
    assert store.load_latest().info.step == 1
    leftovers = {p.split("/")[0] for p in storage.list() if p.startswith("step-0000000002")}
    assert len(leftovers) == 1
    retry = store.write(2, small_state(2))  # the retry writes under its own attempt name
    assert retry.folder not in leftovers
    assert all(u["path"].startswith(retry.folder + "/") for u in retry.manifest["units"].values())
    assert state_sha256(store.load(retry)) == state_sha256(small_state(2))
    store.write(3, small_state(3))  # committing a newer snapshot cleans the failed attempt
    assert not any(p.split("/")[0] in leftovers for p in storage.list())
