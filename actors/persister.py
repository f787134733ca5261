"""The snapshot persister: writes shadow images to storage on its own thread, never blocking anyone.

``SnapshotPersister`` is the plain logic (tested without Ray); ``PersisterActor`` is its Ray shell.

Backpressure: one image is written at a time and at most one waits; a newer image replaces a waiting
one (counted in ``superseded``), so memory stays bounded however slow storage is. Images may arrive out
of step order (Ray does not order calls to a threaded actor, nor calls through different handles): one
older than the image waiting, being written or last written is dropped on arrival (also counted in
``superseded``), so a late image never replaces a newer one nor becomes the last durable step. A failed
write is counted and surfaced (``failed``, ``last_error``); the snapshot is simply not committed, so the
previous one stays the restore point.

Sharded shadow (K shards, ``submit_part``), the commit rule (``ShardParts``): the parts of one step
are combined into ONE state, written as one snapshot under one manifest, only once all K parts of
that step have arrived; a partial set is never written, so it can never become the latest snapshot.
A complete step drops every older incomplete one (a shard that died or lagged will not deliver it,
and the newer state is the better restore point), a part of a step older than the newest complete
one is dropped on arrival, and at most ``ShardParts.max_pending_steps`` incomplete steps are held
(the oldest dropped first), so memory stays bounded while a shard is down. Shards snapshot on a
shared interval grid (``actors.shadow.AlignedSchedule``), so their parts meet at the same steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import numpy as np

from raycheck.job.config import PERSISTER_PRIORITIES
from raycheck.storage.priority import lower_to_idle
from raycheck.storage.snapshots import SnapshotStore
from raycheck.training.node import this_node

log = logging.getLogger(__name__)


class ShardParts:
    """Collects the shards' parts of snapshots and yields a step's state once all its parts are in
    (the commit rule of the module docstring). Pure logic; counts what it drops in ``dropped``.

    Args:
        max_pending_steps: incomplete steps held at most (>= 1).
    """

    def __init__(self, max_pending_steps: int = 2) -> None:
        self.max_pending_steps = max_pending_steps
        self.pending: dict[int, dict[int, Mapping[str, np.ndarray]]] = {}
        self.complete_step: int | None = None
        self.dropped = 0
        """Parts dropped (their step was superseded or never completed)."""

    def add(self, step: int, shard: int, shards: int, part: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Take shard ``shard`` of ``shards``'s ``part`` (name -> array) of ``step``; returns the whole
        state of ``step`` (the parts in shard order: the canonical order) once every part is in."""
        if self.complete_step is not None and step < self.complete_step:
            self.dropped += 1
            return None
        parts = self.pending.setdefault(step, {})
        parts[shard] = part
        if len(parts) < shards:
            while len(self.pending) > self.max_pending_steps:
                self.dropped += len(self.pending.pop(min(self.pending)))
            return None
        del self.pending[step]
        for older in [s for s in self.pending if s < step]:
            self.dropped += len(self.pending.pop(older))
        self.complete_step = step
        return {name: array for i in range(shards) for name, array in parts[i].items()}


class SnapshotPersister:
    """Persists ``(step, state)`` images into ``store`` asynchronously.

    ``submit`` returns at once; ``status`` reports the last durable step, counts, bytes and errors;
    ``flush`` waits until nothing is waiting or being written.
    """

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self._cond = threading.Condition()
        self._waiting: tuple[int, Mapping[str, np.ndarray]] | None = None
        self._writing = False
        self._newest_taken: int | None = None  # the step waiting, being written or last written (None: none)
        self.last_submitted_step: int | None = None
        self.last_durable_step: int | None = None
        self.written = 0
        self.superseded = 0
        self.failed = 0
        self.last_error: str | None = None
        self.bytes_written = 0
        self.write_seconds = 0.0
        self.parts = ShardParts()
        threading.Thread(target=self._run, name="snapshot-persister", daemon=True).start()

    def submit(self, step: int, state: Mapping[str, np.ndarray]) -> None:
        """Queue the image of ``step``, replacing a waiting older one; an image older than the one
        waiting, being written or last written arrives late and is dropped (both counted in ``superseded``)."""
        with self._cond:
            if self._newest_taken is not None and step < self._newest_taken:
                self.superseded += 1
                return
            if self._waiting is not None:
                self.superseded += 1
            self._waiting, self._newest_taken = (step, state), step
            self.last_submitted_step = step
            self._cond.notify_all()

    def submit_part(self, step: int, shard: int, shards: int, part: Mapping[str, np.ndarray]) -> None:
        """Take a shadow shard's ``part`` of ``step``; the step is queued (``submit``) once all
        ``shards`` parts are in (``ShardParts``)."""
        with self._cond:
            state = self.parts.add(step, shard, shards, part)
        if state is not None:
            self.submit(step, state)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None:
                    self._cond.wait()
                step, state = self._waiting
                self._waiting, self._writing = None, True
            self.store.storage.wait_until_usable()  # an open breaker: wait for its probe (bounded), not a refusal
            t0 = time.perf_counter()
            try:
                info = self.store.write(step, state)
                with self._cond:
                    self.last_durable_step = step
                    self.written += 1
                    self.bytes_written += info.bytes
            except Exception as exc:  # counted and surfaced through status(); the thread keeps going
                log.exception("persisting snapshot of step %d failed", step)
                with self._cond:
                    self.failed += 1
                    self.last_error = f"step {step}: {type(exc).__name__}: {exc}"
                    if self._waiting is None:  # an older image may be written again (e.g. a restarted shadow's)
                        self._newest_taken = self.last_durable_step
            finally:
                del state
                with self._cond:
                    self.write_seconds += time.perf_counter() - t0
                    self._writing = False
                    self._cond.notify_all()

    def status(self) -> dict:
        with self._cond:
            return {
                "last_submitted_step": self.last_submitted_step,
                "last_durable_step": self.last_durable_step,
                "written": self.written,
                "superseded": self.superseded,
                "failed": self.failed,
                "last_error": self.last_error,
                "bytes_written": self.bytes_written,
                "write_seconds": self.write_seconds,
                "busy": self._writing or self._waiting is not None,
                "parts_pending_steps": sorted(self.parts.pending),
                "parts_dropped": self.parts.dropped,
                "storage": self.store.storage.breaker.state(),
            }

    def flush(self, timeout_s: float) -> dict:
        """Wait until idle (or ``timeout_s``); returns ``status()``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._writing or self._waiting is not None) and time.monotonic() < deadline:
                self._cond.wait(0.2)
        return self.status()


class PersisterActor:
    """Ray shell around a ``SnapshotPersister`` of ``store``:
    ``ray.remote(PersisterActor).options(num_cpus=0, max_concurrency=4, name=...)``.

    The constructor never touches storage, so a persister (re)started while storage is unreachable
    starts all the same: its status reports the outage (``last_error``, the breaker's ``storage``
    state) and it keeps retrying through the breaker until storage answers. (The step log's mirror to
    storage is the log keeper's: ``actors.log_keeper``.)

    Args:
        store: where the snapshots go.
        priority: ``normal``, or ``idle``: first put every thread of this actor's process (its own Ray
            worker process) at idle CPU and I/O priority (``storage.priority.lower_to_idle``; the
            writer thread started after inherits it), so snapshot writes use only CPU time the training
            leaves (``JobConfig.snapshot.persister_priority``). Never for a persister inside a training
            process: a starved thread holding the GIL would stall the loop.

    Raises:
        ValueError: an unknown ``priority``.
    """

    def __init__(self, store: SnapshotStore, priority: str = "normal") -> None:
        if priority not in PERSISTER_PRIORITIES:
            raise ValueError(f"persister priority {priority!r}: choose one of {', '.join(PERSISTER_PRIORITIES)}")
        if priority == "idle":
            lower_to_idle()
        self.persister = SnapshotPersister(store)

    def submit(self, step: int, state: Mapping[str, np.ndarray]) -> None:
        """``SnapshotPersister.submit``."""
        self.persister.submit(step, state)

    def submit_part(self, step: int, shard: int, shards: int, part: Mapping[str, np.ndarray]) -> None:
        """``SnapshotPersister.submit_part``."""
        self.persister.submit_part(step, shard, shards, part)

    def flush(self, timeout_s: float) -> dict:
        """``SnapshotPersister.flush``."""
        return self.persister.flush(timeout_s)

    def check_storage(self) -> dict:
        """Probe the store from this actor's node (write, read back and delete a small object; the
        controller asks once, at the run's start); returns ``training.node.this_node()``.

        Raises:
            what ``storage.backend.Storage.probe`` raises, e.g. ``StorageError`` without credentials.
        """
        self.persister.store.storage.probe()
        return this_node()

    def status(self) -> dict:
        """``SnapshotPersister.status`` and where it runs (``node_id``, ``node_ip``)."""
        return {**self.persister.status(), **this_node()}
