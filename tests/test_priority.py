"""Idle CPU and I/O priority for the snapshot persister's process (``storage.priority``), checked on real
child processes (never on the test process: an unprivileged process cannot raise its priority back)."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from raycheck.actors.persister import PersisterActor
from raycheck.job.config import SnapshotConfig
from raycheck.job.stores import snapshot_store
from raycheck.storage.priority import lower_to_idle, priorities

THREADS = """
import threading, time
for _ in range(2):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
"""
READY = """
print("ready", flush=True)
import sys
sys.stdin.readline()  # a line from the test: start one more thread
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("started", flush=True)
time.sleep(60)
"""


def child(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_every_thread_of_a_child_process_is_lowered_and_a_later_thread_inherits_it():
    proc = child(THREADS + READY)
    try:
        before = priorities(proc.pid)
        assert len(before) == 3 and not any(p.idle for p in before.values())
        assert (before[proc.pid].policy, before[proc.pid].nice) == (os.SCHED_OTHER, os.getpriority(os.PRIO_PROCESS, 0))
        assert lower_to_idle(proc.pid) == sorted(before)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "started\n"
        after = priorities(proc.pid)
        assert len(after) == 4 and all(p.idle for p in after.values()), after
        assert (after[proc.pid].policy, after[proc.pid].nice, after[proc.pid].io_class) == (
            os.SCHED_IDLE, 19, psutil.IOPRIO_CLASS_IDLE)
        assert not priorities(os.getpid())[os.getpid()].idle  # the caller is untouched
    finally:
        proc.kill()
        proc.wait()


def test_an_idle_persister_lowers_every_thread_of_its_process_its_writer_included(tmp_path):
    code = (THREADS + "from raycheck.actors.persister import PersisterActor\n"
            + "from raycheck.storage.snapshots import SnapshotStore\n"
            + f"actor = PersisterActor(SnapshotStore({str(tmp_path / 'store')!r}), priority='idle')\n"
            + "assert any(t.name == 'snapshot-persister' for t in threading.enumerate())\n" + READY)
    proc = child(code)
    try:
        lowered = priorities(proc.pid)
        assert len(lowered) >= 4 and all(p.idle for p in lowered.values()), lowered  # main, 2 threads, the writer
    finally:
        proc.kill()
        proc.wait()


def test_unknown_priorities_are_refused():
    with pytest.raises(ValueError, match="persister priority 'low': choose one of normal, idle"):
        PersisterActor(None, priority="low")  # type: ignore[arg-type]  # refused before the store is used
    with pytest.raises(ValueError, match="snapshot.persister_priority 'low': choose normal or idle"):
        SnapshotConfig(persister_priority="low")


def test_the_persister_s_store_writes_direct_by_default_and_the_run_s_other_stores_buffered(tmp_path, monkeypatch):
    """``start_persister`` hands the persister ``snapshot_store(direct=snapshot.persister_direct_io)``
    (default on; ``--no-persister-direct-io`` off); the store travels pickled, its direct writes with it."""
    import pickle

    import raycheck.orchestrator.components as controller
    from raycheck.job.config import JobConfig

    class Handle:
        def options(self, **_) -> Handle:
            return self

        def remote(self, store, priority: str) -> tuple:
            return pickle.loads(pickle.dumps(store)).storage.write_direct, priority

    monkeypatch.setattr(controller.ray, "remote", lambda cls: Handle())
    placement = type("Placement", (), {"replica": {}})()
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), storage={"uri": str(tmp_path / "s")})
    assert cfg.snapshot.persister_direct_io and not snapshot_store(cfg).storage.write_direct
    assert controller.start_persister(cfg, placement) == (True, "normal")
    off = cfg.replace(**{"snapshot.persister_direct_io": False, "snapshot.persister_priority": "idle"})
    assert controller.start_persister(off, placement) == (False, "idle")
