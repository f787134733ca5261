"""The log keeper: the replica of the step log on the driver's node, served over Ray.

Rank 0 appends every step record to its own node-local log (``JobConfig.scratch_dir``) and sends it to
the keeper (``workers.rank0_log``). The keeper appends it to the run directory's ``steplog.bin`` (the
keeper runs on the driver's node, so that file is local to it), fsynced, holds the records in memory
(84 bytes each) and serves them over Ray to the shadow (``KeeperLogSource``), to recovery and to the
failure injector; it also mirrors its log to the run's storage URI as segments
(``storage.log_segments.SegmentMirror``), so a driver on a fresh machine can resume from the bucket.

With ``commit_to_storage`` (durability ``cluster``) the mirror is synchronous: ``append_many`` returns
only once its records are in storage (the log's open tail uploaded as a segment). Uploads are group
commits: one runs at a time, and the appends that arrive while it is in flight are acknowledged together
by the next one (one upload per batch, not per record).

``LogKeeper`` is the plain logic (tested without Ray); ``LogKeeperActor`` is its Ray shell, started
by the controller on the driver's node; ``RemoteKeeper`` makes blocking calls to it by name.

The keeper is the only appender of its file and accepts records in order only: a record past its
end is a gap (``StepLogGapError``), a record for a step it holds must be byte-identical to the one it
holds (a re-send after a lost acknowledgement: accepted, nothing written) or it is refused
(``StepLogConflictError``). What it acknowledges (``append`` returned) is fsynced on its node.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
from collections.abc import Sequence

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError

from raycheck.storage.backend import Storage, StorageUnreachableError
from raycheck.storage.log_segments import PREFIX, SegmentMirror, read_segments, segment_of
from raycheck.storage.steplog import (
    RECORD_BYTES,
    StepLogConflictError,
    StepLogGapError,
    StepLogWriter,
    StepRecord,
    read_records,
    scan_records,
)
from raycheck.training.zo import ZOHyper, first_foreign_record

log = logging.getLogger(__name__)

MAX_RECORDS_PER_CALL = 4096
"""Records one ``records`` call returns at most (bounds a reply to ~300 KB)."""


def same_trajectory(a: dict, b: dict) -> bool:
    """Whether two log headers belong to the same run and trajectory (their ``log_id`` may differ:
    a log re-created for a resume from the bucket takes the bucket's)."""
    keys = ("run_id", "trajectory_sha256", "layout_sha256", "generator", "format_version")
    return all(a.get(k) == b.get(k) for k in keys)


class LogKeeper:
    """The replica of the step log in the local file ``path``, served from memory.

    Args:
        path: the log file (created with ``header`` when missing; a torn tail is cut on open).
        header: the header of a log to create (None: ``path`` must exist).
        resume_from: storage whose log segments (``read_segments``) the keeper first copies into its
            file when they hold more steps than it (a resume whose run directory lost its log).
        mirror_to: storage to mirror the log to as segments every ``mirror_every_s`` seconds (None: no mirror).
        mirror_every_s: seconds between mirror rounds; also the longest a record stays only local.
        commit_to_storage: acknowledge an append only once it is in ``mirror_to`` (durability ``cluster``).
        hyper: the run's ZO hyper-parameters; each record adopted from ``resume_from`` must carry them
            and the step seed of the file header's ``run_seed`` (``training.zo.check_records``; None: the
            seed only).

    Raises:
        ValueError: ``commit_to_storage`` without ``mirror_to``.
        FileNotFoundError: ``path`` is missing and no ``header`` is given.
        StepLogCorruptError, StepLogGapError: the file cannot be continued safely.
        StepLogConflictError: the segments in ``resume_from`` belong to another run or trajectory (by
            their header, or by a record to adopt that is not this run's: the message names the
            segment), or disagree with the file on a step both hold; nothing is adopted then.

    Storage that is unreachable at the start does not stop the keeper: it keeps its file's steps,
    logs why, and reports it in ``adopt_error`` (the mirror retries on its own rounds).
    """

    def __init__(self, path: str | pathlib.Path, header: dict | None = None, resume_from: Storage | None = None,
                 mirror_to: Storage | None = None, mirror_every_s: float = 2.0, commit_to_storage: bool = False,
                 hyper: ZOHyper | None = None) -> None:
        if commit_to_storage and mirror_to is None:
            raise ValueError("commit_to_storage needs storage to mirror to (mirror_to)")
        self.path = pathlib.Path(path)
        if not self.path.exists():
            if header is None:
                raise FileNotFoundError(f"{self.path}: no step log to keep (and no header to create one with)")
            StepLogWriter.create(self.path, header).close()
        self._writer = StepLogWriter.open(self.path)  # cuts a torn tail
        self.hyper = hyper
        self._data = bytearray(b"".join(r.encode() for r in read_records(self.path)))
        self._cond = threading.Condition()
        self.adopt_error: str | None = None
        """Why the segments in ``resume_from`` could not be read (storage unreachable), else None."""
        try:
            self.adopted_steps = self._adopt(resume_from) if resume_from is not None else 0
        except StorageUnreachableError as exc:  # the local log stands: a new run, or one whose log is here
            log.warning("the step log segments in storage could not be read (%s); keeping %d steps of %s", exc, self.end(), self.path)
            self.adopted_steps, self.adopt_error = 0, f"{type(exc).__name__}: {exc}"[:500]
        """Steps copied from the segments in ``resume_from`` when the keeper started."""
        self.mirror_to, self.mirror_every_s = mirror_to, mirror_every_s
        self.mirror: SegmentMirror | None = None  # built on the first sync that reaches storage (it lists the segments)
        self.mirror_error: str | None = None
        self._mirror_lock = threading.Lock()
        self.commit_to_storage = commit_to_storage
        self._upload = threading.Condition()  # group commit: guards the three fields below
        self._uploading = False
        self.uploads = 0
        """Group-commit uploads made (``commit_to_storage``)."""
        self.uploaded_steps = 0
        """Steps those uploads acknowledged; ``uploaded_steps / uploads`` records per upload."""

    # -- the log ------------------------------------------------------------------------------
    def header(self) -> dict:
        """The log's header (``prepare`` wrote it: run id, model layout, generator, trajectory hash)."""
        return dict(self._writer.header)

    def end(self) -> int:
        """Steps held (records ``0..end - 1``), each fsynced in ``path``."""
        with self._cond:
            return len(self._data) // RECORD_BYTES

    def append(self, record: StepRecord) -> int:
        """Append ``record`` durably (write + fsync) unless it is a re-send of a record held; returns ``end()``.

        Raises:
            StepLogGapError: ``record.step`` is past ``end()``.
            StepLogConflictError: a different record is held for ``record.step``.
        """
        return self.append_many([record])

    def append_many(self, records: Sequence[StepRecord]) -> int:
        """``append`` each of ``records`` in order (consecutive steps); returns ``end()``. With
        ``commit_to_storage``, returns once they are in storage too (``commit``).

        Raises:
            StepLogGapError, StepLogConflictError: as ``append``.
            StorageError: the upload failed (the records are in the local file; a re-send retries it).
        """
        end = self._append_local(records)
        if self.commit_to_storage:
            self.commit(end)
        return end

    def _append_local(self, records: Sequence[StepRecord]) -> int:
        """``append_many`` to the local file only; returns ``end()``."""
        with self._cond:
            for record in records:
                self._append(record)
            self._cond.notify_all()
            return len(self._data) // RECORD_BYTES

    def commit(self, end: int) -> None:
        """Return once steps ``0..end - 1`` are in storage: the caller waits while an upload is in
        flight, then either finds its steps uploaded by it or runs the next upload itself, which takes
        every record appended by then (group commit).

        Raises:
            StorageError: this caller's upload failed (a waiter then runs the next one).
        """
        with self._upload:
            while self._uploading:
                self._upload.wait()
            if self.mirror is not None and self.mirror.mirrored >= end:
                return
            self._uploading = True
        try:
            with self._mirror_lock:
                before = self._mirror().mirrored
            after = self._sync(final=True)
            with self._upload:
                self.uploads += 1
                self.uploaded_steps += after - before
        except Exception as exc:
            self.mirror_error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            with self._upload:
                self._uploading = False
                self._upload.notify_all()

    def _append(self, record: StepRecord) -> None:
        end = len(self._data) // RECORD_BYTES
        encoded = record.bound(self._writer.tag, self.path).encode()
        if record.step < end:
            held = self._data[record.step * RECORD_BYTES:(record.step + 1) * RECORD_BYTES]
            if held != encoded:
                raise StepLogConflictError(
                    f"{self.path}: step {record.step} is already logged with another record; the sender follows "
                    f"another trajectory than this log (a stale worker or scratch log): start it on a new --out")
            return
        if record.step > end:
            raise StepLogGapError(f"{self.path}: received step {record.step}, but the log ends at step {end - 1}; "
                                  f"steps {end}..{record.step - 1} must be sent first")
        self._writer.append(record)
        self._data += encoded

    def records(self, start: int, limit: int = MAX_RECORDS_PER_CALL) -> list[StepRecord]:
        """Records ``start..`` (at most ``limit``, capped at ``MAX_RECORDS_PER_CALL``); [] at or past the end."""
        limit = max(0, min(limit, MAX_RECORDS_PER_CALL))
        with self._cond:
            chunk = bytes(self._data[start * RECORD_BYTES:(start + limit) * RECORD_BYTES])
        return scan_records(chunk, 0, self.path, start, self._writer.tag)[0]

    def wait_for(self, end: int, timeout_s: float) -> int:
        """Block until at least ``end`` steps are held or ``timeout_s`` seconds passed; returns ``end()``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._data) // RECORD_BYTES < end and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return len(self._data) // RECORD_BYTES

    def _adopt(self, storage: Storage) -> int:
        """Copy the steps that the segments in ``storage`` hold past this log's end into it (the file is
        re-created with the segments' header when it holds no step yet); returns the steps copied."""
        seg_header, seg_records = read_segments(storage)
        if seg_header is None or len(seg_records) <= self.end():
            return 0
        if not same_trajectory(seg_header, self._writer.header):
            raise StepLogConflictError(
                f"{storage.url('log/')} holds the step log of another run or trajectory (run {seg_header.get('run_id')}, "
                f"trajectory {seg_header.get('trajectory_sha256')}) than {self.path}: resume with that run's settings")
        self._check_adopted(storage, seg_header, seg_records[self.end():])
        if self.end() == 0 and seg_header != self._writer.header:  # take the bucket's header (its log_id)
            self._writer.close()
            self.path.unlink()
            self._writer = StepLogWriter.create(self.path, seg_header)
        adopted = len(seg_records) - self.end()
        self._append_local(seg_records)  # refuses a segment that disagrees with a step held
        return adopted

    def _check_adopted(self, storage: Storage, seg_header: dict, records: Sequence[StepRecord]) -> None:
        """Refuse ``records`` (from the segments in ``storage``) unless each is this run's by the file
        header's ``run_seed`` and ``hyper`` (``training.zo.check_records``' rule, as resume, restore and
        replay check): a record spliced in from another run's log has a valid checksum and the right step."""
        run_seed = self._writer.header.get("run_seed")
        if not isinstance(run_seed, int):
            raise StepLogConflictError(f"{self.path}: its header names no run seed, so the records of the step log "
                                       f"segments in {storage.url(PREFIX)} cannot be checked as this run's; nothing adopted")
        if (foreign := first_foreign_record(records, run_seed, self.hyper, self._writer.tag)) is not None:
            step, why = foreign
            raise StepLogConflictError(f"{segment_of(storage, step)}: {why} (the segments' header names run {seg_header.get('run_id')}); "
                                       f"{self.path} adopts none of their steps: resume with this run's own storage")

    # -- the mirror to storage ------------------------------------------------------------------
    def sync_mirror(self, final: bool = False) -> None:
        """Upload what the segments lack (``SegmentMirror.sync``); a failure is kept in ``mirror_error``
        (and logged) and retried on the next call. ``final``: wait for storage, upload the open tail."""
        if self.mirror_to is None:
            return
        try:
            if final:
                self.mirror_to.wait_until_usable()
            self._sync(final)
        except Exception as exc:  # surfaced through status(); retried on the next round
            log.warning("mirroring the step log failed: %s", exc)
            self.mirror_error = f"{type(exc).__name__}: {exc}"

    def _sync(self, final: bool) -> int:
        """One mirror round (``SegmentMirror.sync``); returns the steps mirrored. Raises what storage raised."""
        with self._mirror_lock:
            mirrored = self._mirror().sync(final=final)
        self.mirror_error = None
        return mirrored

    def _mirror(self) -> SegmentMirror:
        """The mirror to ``mirror_to``, built on first use (it lists the segments there)."""
        if self.mirror is None:
            if self.mirror_to is None:
                raise ValueError("this log keeper mirrors to no storage (mirror_to None)")
            self.mirror = SegmentMirror(self.mirror_to, self.path, max_age_s=self.mirror_every_s)
        return self.mirror

    def status(self) -> dict:
        """``end``, ``adopted_steps``, ``adopt_error``, and with a mirror ``log_mirrored_steps`` (steps known to be in
        storage: none before storage first answered) and ``log_mirror_error`` (None when the last round worked);
        with ``commit_to_storage`` also ``log_uploads`` and ``log_uploaded_steps`` (group commits, steps they took)."""
        status = {"end": self.end(), "adopted_steps": self.adopted_steps, "adopt_error": self.adopt_error}
        if self.mirror_to is not None:
            status.update(log_mirrored_steps=self.mirror.mirrored if self.mirror else 0, log_mirror_error=self.mirror_error)
        if self.commit_to_storage:
            with self._upload:
                status.update(log_uploads=self.uploads, log_uploaded_steps=self.uploaded_steps)
        return status

    def flush(self) -> dict:
        """A final mirror round (waits for storage through its breaker); returns ``status()``."""
        self.sync_mirror(final=True)
        return self.status()

    def close(self) -> None:
        self._writer.close()


class LogKeeperActor:
    """Ray shell around a ``LogKeeper`` (``keeper``; the arguments are ``LogKeeper``'s):
    ``ray.remote(LogKeeperActor).options(num_cpus=0, max_concurrency=8, name=...)``, pinned to the
    driver's node (``orchestrator.controller``). Mirrors on a thread every ``mirror_every_s`` seconds
    (unless every append commits to storage); ``status`` adds the node it runs on (``node_id``)."""

    def __init__(self, *args, **kwargs) -> None:
        self.keeper = LogKeeper(*args, **kwargs)
        self.node_id = ray.get_runtime_context().get_node_id()
        if self.keeper.mirror_to is not None and not self.keeper.commit_to_storage:
            threading.Thread(target=self._mirror_loop, name="log-mirror", daemon=True).start()

    def _mirror_loop(self) -> None:
        while True:
            time.sleep(self.keeper.mirror_every_s)
            self.keeper.sync_mirror(final=False)

    def header(self) -> dict:
        """``LogKeeper.header``."""
        return self.keeper.header()

    def end(self) -> int:
        """``LogKeeper.end``."""
        return self.keeper.end()

    def append(self, record: StepRecord) -> int:
        """``LogKeeper.append``."""
        return self.keeper.append(record)

    def append_many(self, records: Sequence[StepRecord]) -> int:
        """``LogKeeper.append_many``."""
        return self.keeper.append_many(records)

    def records(self, start: int, limit: int = MAX_RECORDS_PER_CALL) -> list[StepRecord]:
        """``LogKeeper.records``."""
        return self.keeper.records(start, limit)

    def wait_for(self, end: int, timeout_s: float) -> int:
        """``LogKeeper.wait_for``."""
        return self.keeper.wait_for(end, timeout_s)

    def flush(self) -> dict:
        """``LogKeeper.flush`` (its status), with the node it runs on (``node_id``) as ``status`` has it."""
        return {**self.keeper.flush(), "node_id": self.node_id}

    def status(self) -> dict:
        """``LogKeeper.status`` and the node it runs on (``node_id``)."""
        return {**self.keeper.status(), "node_id": self.node_id}


class RemoteKeeper:
    """Blocking calls to the log keeper actor ``name`` (in ``namespace``; None: the caller's), with the
    methods of ``LogKeeper``. The handle is looked up by name, again after a call failed.

    Raises (every method):
        ValueError: no keeper of that name is registered.
        RayActorError, GetTimeoutError: it died or did not answer within ``timeout_s`` seconds.
    """

    def __init__(self, name: str, namespace: str | None = None, timeout_s: float = 120.0) -> None:
        self.name, self.namespace, self.timeout_s = name, namespace, timeout_s
        self._handle: ActorHandle | None = None

    def _call(self, method: str, *args, timeout_s: float | None = None):
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        try:
            return ray.get(getattr(self._handle, method).remote(*args), timeout=timeout_s or self.timeout_s)
        except (RayActorError, GetTimeoutError):
            self._handle = None
            raise

    def header(self) -> dict:
        return self._call("header")

    def end(self) -> int:
        return self._call("end")

    def append_many(self, records: Sequence[StepRecord]) -> int:
        return self._call("append_many", list(records))

    def records(self, start: int, limit: int = MAX_RECORDS_PER_CALL) -> list[StepRecord]:
        return self._call("records", start, limit)

    def wait_for(self, end: int, timeout_s: float) -> int:
        return self._call("wait_for", end, timeout_s, timeout_s=timeout_s + self.timeout_s)


def read_range(keeper: LogKeeper | RemoteKeeper, start: int, end: int) -> list[StepRecord]:
    """Records ``start..end - 1`` of ``keeper`` (a ``LogKeeper`` or ``RemoteKeeper``), fetched in bounded calls.

    Raises:
        StepLogGapError: the keeper holds fewer than ``end`` steps.
    """
    out: list[StepRecord] = []
    while start + len(out) < end:
        chunk = keeper.records(start + len(out), end - start - len(out))
        if not chunk:
            raise StepLogGapError(f"the log keeper ends at step {start + len(out) - 1}, steps up to {end - 1} were asked for")
        out.extend(chunk)
    return out


class KeeperLogSource:
    """The keeper-backed log source of the shadow (``actors.shadow.LogSource``): ``poll`` returns the
    records the keeper holds past ``next_step`` (at most ``MAX_RECORDS_PER_CALL`` a call)."""

    def __init__(self, keeper, start_step: int = 0) -> None:
        self.keeper = keeper
        self.header = keeper.header()
        self.next_step = start_step

    def seek(self, step: int) -> None:
        self.next_step = step

    def poll(self) -> list[StepRecord]:
        records = self.keeper.records(self.next_step)
        self.next_step += len(records)
        return records
