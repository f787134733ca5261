"""Rank 0's side of the replicated step log: its node-local log, kept equal to the log keeper's, and
the ordered sends of each new record to the keeper (``actors.log_keeper``).

Durability (``JobConfig.durability``) of a step before its update is applied:
  ``process``: the record is fsynced in rank 0's node-local log; it is sent to the keeper without
  waiting (in order, on a sender thread): it survives a crash of the worker process, not of its node.
  ``node``: also acknowledged by the keeper (fsynced on the driver's node) before ``commit`` returns,
  so it survives the loss of rank 0's node when the keeper runs on another one.
  ``cluster``: as ``node``, and the keeper acknowledges only once the record is in the remote storage
  (a log segment; ``LogKeeper.commit``, group commit): it survives the loss of every node.
A send that fails is retried (``SEND_TRIES`` times, the keeper looked up again by name each time);
after that the next ``commit`` raises ``KeeperUnreachableError``, so the worker fails and its restart
brings the keeper up to date from the local log (``open_local_log``): a record is never dropped.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raycheck.actors.log_keeper import MAX_RECORDS_PER_CALL, read_range
from raycheck.storage.steplog import StepLogConflictError, StepLogError, StepLogWriter, StepRecord, read_header, read_records

if TYPE_CHECKING:
    from raycheck.actors.log_keeper import LogKeeper, RemoteKeeper
    from raycheck.job.config import JobConfig

log = logging.getLogger(__name__)

SEND_TRIES = 5
"""Tries of one send to the keeper (``KeeperSender``: 0.5, 1, 2, 4 s between them) before ``KeeperUnreachableError``."""


def local_log_path(cfg: JobConfig) -> pathlib.Path:
    """Rank 0's node-local step log: ``steplog.bin`` in ``cfg.scratch_dir`` (a ``JobConfig``)."""
    return pathlib.Path(cfg.scratch_dir) / "steplog.bin"


class KeeperUnreachableError(RuntimeError):
    """Records could not be delivered to the log keeper; they stay in rank 0's local log."""


@dataclass(frozen=True)
class LocalLogOpened:
    """How rank 0's local log was made equal to the keeper's (``open_local_log``).

    Attributes:
        writer: the local log, open for appending; ``writer.next_step`` steps, the keeper's as many.
        local_steps: steps the local log held when opened (after a torn tail was cut).
        rebuilt_steps: steps copied from the keeper into it (it was shorter, missing or of another log).
        sent_steps: steps sent from it to the keeper (the keeper had missed them).
        discarded: why a local log found was replaced (another run's, or unreadable), else None.
    """

    writer: StepLogWriter
    local_steps: int
    rebuilt_steps: int
    sent_steps: int
    discarded: str | None


def _open_or_create(path: pathlib.Path, header: dict) -> tuple[StepLogWriter, str | None]:
    """Rank 0's local log at ``path`` for the keeper's ``header``: the one there if it is this log's
    (same header), else a new one (the old file is replaced; the reason is returned)."""
    discarded = None
    if path.exists():
        try:
            if read_header(path) == header:
                return StepLogWriter.open(path), None
            discarded = f"{path} belongs to another log (header differs)"
        except StepLogError as exc:
            discarded = f"{path} is unreadable ({type(exc).__name__}: {exc})"
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    return StepLogWriter.create(path, header), discarded


def open_local_log(path: str | pathlib.Path, keeper: LogKeeper | RemoteKeeper) -> LocalLogOpened:
    """Open rank 0's node-local log at ``path`` and make it and ``keeper`` (a ``LogKeeper`` or
    ``RemoteKeeper``) hold the same steps: the steps both hold are compared record by record (byte for
    byte); a shorter local log (a replacement on another node, a fresh scratch directory) is rebuilt
    from the keeper; a longer one (durability ``process``: the keeper missed the last sends) brings the
    keeper up to date.

    Raises:
        StepLogBusyError: another process still appends to the local log.
        StepLogConflictError: the local log and the keeper disagree on a step both hold (named), never a
            silent choice of one of them.
        ValueError, RayActorError, GetTimeoutError: the keeper cannot be reached (``RemoteKeeper``).
    """
    path = pathlib.Path(path)
    writer, discarded = _open_or_create(path, keeper.header())
    local, kept = writer.next_step, keeper.end()
    mine = read_records(path)
    both = min(local, kept)
    for first in range(0, both, MAX_RECORDS_PER_CALL):
        theirs = read_range(keeper, first, min(both, first + MAX_RECORDS_PER_CALL))
        if (step := next((r.step for r, t in zip(mine[first:], theirs) if r.encode() != t.encode()), None)) is not None:
            writer.close()
            raise StepLogConflictError(
                f"{path} and the log keeper's copy disagree at step {step}: one holds a record of another run or "
                f"trajectory; check both with raycheck inspect, then delete the wrong one (rank 0's copy is rebuilt "
                f"from the keeper's) or start a new --out")
    for record in read_range(keeper, local, kept):
        writer.append(record)
    missed = mine[kept:local] if local > kept else []
    for first in range(0, len(missed), MAX_RECORDS_PER_CALL):  # bounded messages
        keeper.append_many(missed[first:first + MAX_RECORDS_PER_CALL])
    return LocalLogOpened(writer, local, max(0, kept - local), max(0, local - kept), discarded)


class KeeperSender:
    """Sends rank 0's records to the keeper in order. With ``wait`` (durability ``node``, ``cluster``) ``send``
    delivers the record itself and returns once the keeper acknowledged it (no thread hand-off on the
    training loop's critical path); without, it queues the record for a sender thread, which delivers
    every record queued as one batch per call.

    Args:
        keeper: a ``RemoteKeeper`` (or ``LogKeeper``) with ``append_many``.
        acked: steps the keeper holds already.
        wait: wait for each acknowledgement (durability ``node`` and ``cluster``).
        tries: tries of one send; ``backoff_s`` seconds before the second, doubling after each failure.
    """

    def __init__(self, keeper, acked: int, wait: bool, tries: int = SEND_TRIES, backoff_s: float = 0.5) -> None:
        self.keeper, self.wait = keeper, wait
        self.tries, self.backoff_s = tries, backoff_s
        self.acked = acked
        self.error: str | None = None
        self._queue: list[StepRecord] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = None if wait else threading.Thread(target=self._run, name="log-keeper-sender", daemon=True)
        if self._thread is not None:
            self._thread.start()

    def send(self, record: StepRecord) -> None:
        """With ``wait``, deliver ``record`` and return once the keeper holds it; else queue it.

        Raises:
            KeeperUnreachableError: an earlier send failed for good, or this one did (``wait``).
        """
        with self._cond:
            self._raise_if_failed()
            if not self.wait:
                self._queue.append(record)
                self._cond.notify_all()
                return
        end = self._deliver([record])
        with self._cond:
            self._raise_if_failed()  # None from _deliver: error is set
            if end is not None:
                self.acked = end

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise KeeperUnreachableError(f"the step log keeper did not take records after {self.tries} tries: {self.error}; "
                                         "they are in rank 0's local log, which a restarted worker sends again")

    def _wait_acked(self, end: int) -> None:
        while self.acked < end and self.error is None:
            self._cond.wait()
        self._raise_if_failed()

    def flush(self) -> int:
        """Wait until every queued record is acknowledged (nothing to wait for with ``wait``); returns the
        steps the keeper holds.

        Raises:
            KeeperUnreachableError: a send failed for good.
        """
        with self._cond:
            if self._queue:
                self._wait_acked(self._queue[-1].step + 1)
            self._raise_if_failed()
            return self.acked

    def close(self) -> None:
        """Wait until every queued record is acknowledged, then stop the sender thread.

        Raises:
            KeeperUnreachableError: a send failed for good.
        """
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._raise_if_failed()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = list(self._queue)
            end = self._deliver(batch)
            with self._cond:
                if end is None:
                    self._cond.notify_all()
                    return
                self.acked = end
                del self._queue[:len(batch)]
                self._cond.notify_all()

    def _deliver(self, batch: list[StepRecord]) -> int | None:
        """``append_many(batch)`` with retries; the keeper's end, or None (``error`` set) when every try failed."""
        failure = None
        for attempt in range(self.tries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self.keeper.append_many(batch)
            except Exception as exc:  # retried, then surfaced by the next send: never dropped
                failure = exc
                log.warning("sending steps %d..%d to the log keeper failed (try %d of %d): %s", batch[0].step,
                            batch[-1].step, attempt + 1, self.tries, exc)
        with self._cond:
            self.error = f"{type(failure).__name__}: {failure}"[:500]
        return None


def replicated_append(writer: StepLogWriter, sender: KeeperSender) -> Callable[[StepRecord], float]:
    """A ``commit`` for ``workers.zo_session.mezo_step_``: the local append (write + fsync), then the send to
    the keeper (with durability ``node`` or ``cluster``, until it acknowledged); returns the seconds it blocked."""
    def commit(record: StepRecord) -> float:
        t0 = time.perf_counter()
        writer.append(record)
        sender.send(record)
        return time.perf_counter() - t0

    return commit
