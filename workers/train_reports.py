"""raycheck's committed snapshots as Ray Train checkpoints, without copying their bytes.

Ray Train v2 keeps only checkpoints inside its run's experiment directory (``ray.train.report`` refuses
any other with ``NO_UPLOAD``, and a ``checkpoint_upload_fn`` must return one there), while raycheck's
snapshots live in the run's own storage (a folder, a bucket) and follow its retention and fencing. So
each committed snapshot is reported as a *pointer checkpoint*, the pattern Ray's own message recommends
(``storage.pointers``): a folder named as the snapshot (``step-<10 digits>-<hex>``) holding one small
JSON file with the snapshot's URI. Ray uploads those few hundred bytes into the experiment directory;
``Result.checkpoint``, ``get_all_reported_checkpoints()``, ``ray.train.get_checkpoint()`` and the Train
dashboard list it; ``workers.own_loop.load_checkpoint`` and ``raycheck export`` follow it to the
snapshot. A snapshot deleted later by raycheck's retention leaves its pointer valid for Ray (its folder
exists); following it then names the store's newest.

Ray Train v2 requires every rank to call ``ray.train.report`` the same number of times: every rank builds
a ``TrainReports`` and calls ``report`` at the same steps; rank 0 attaches the pointer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from raycheck.actors.shadow_actor import find_shards
from raycheck.job.stores import checkpoint_store
from raycheck.storage.pointers import POINTER_FILE, checkpoint_uri, pointer
from raycheck.storage.snapshots import SnapshotInfo, SnapshotStore

if TYPE_CHECKING:
    from raycheck.actors.journal import RunChannel
    from raycheck.job.config import JobConfig

log = logging.getLogger(__name__)


def ray_train_context() -> Any | None:
    """Ray Train's context in a Ray Train worker, None elsewhere."""
    try:
        import ray.train

        return ray.train.get_context()
    except (RuntimeError, ImportError, AttributeError):
        return None


class TrainReports:
    """``ray.train.report`` calls of one Ray Train worker, rank 0 attaching the newest committed snapshot
    of ``store`` (a pointer checkpoint) when it was not reported yet.

    Rank 0 lists the store on a background thread every ``refresh_s`` seconds, so a report in the
    training loop does no storage I/O (an unreachable bucket costs the loop nothing; the failed listing is
    logged); the last report (``final``) lists it now. A checkpoint is attached only where Ray Train's
    storage is reachable from this node (its validation marker is there): a local ``storage_path`` on a
    cluster of several nodes is not, and Ray Train would fail the worker; it is told once.

    Args:
        store: the run's snapshot store (its ``list()``: this run's committed snapshots); read by rank 0 only.
        rank: this worker's world rank.
        reported: the snapshot folder already reported, not attached again (default, rank 0: the folder name
            of ``ray.train.get_checkpoint()``, an earlier incarnation's last report).
        periodic: reports during training as well as the last one (False: the last one only; ZO replica
            groups, where a worker replaced alone re-executes steps the others reported already).
        refresh_s: seconds between rank 0's background listings.
    """

    def __init__(self, store: SnapshotStore, rank: int, reported: str | None = None, periodic: bool = True,
                 refresh_s: float = 2.0) -> None:
        if reported is None and rank == 0:
            import ray.train

            earlier = ray.train.get_checkpoint()
            reported = os.path.basename(earlier.path.rstrip("/")) if earlier is not None else None
        self.store, self.rank, self.reported, self.periodic = store, rank, reported, periodic
        self._latest: SnapshotInfo | None = None
        self._stop = threading.Event()
        self.attach = rank == 0 and storage_reachable()
        if self.attach:
            threading.Thread(target=self._refresh, args=(refresh_s,), name="raycheck-train-reports", daemon=True).start()

    def _refresh(self, refresh_s: float) -> None:
        while True:
            self.newest()
            if self._stop.wait(refresh_s):
                return

    def newest(self) -> SnapshotInfo | None:
        """List the store now (rank 0 with a reachable Ray Train storage) and return its newest committed
        snapshot of this run (None: none, elsewhere, or the listing failed: logged)."""
        return self._list_now()[0]

    def _list_now(self) -> tuple[SnapshotInfo | None, bool]:
        """``newest()``, and whether the listing succeeded (True where nothing is listed: not rank 0, or
        Ray Train's storage unreachable)."""
        if not self.attach:
            return None, True
        try:
            own = self.store.list()
        except OSError as exc:
            log.warning("the snapshots could not be listed for Ray Train's report: %s", exc)
            return None, False
        self._latest = own[-1] if own else None
        return self._latest, True

    def wait_for(self, step: int, timeout_s: float, poll_s: float = 0.2) -> bool:
        """Rank 0: wait until a snapshot of ``step`` (or later) is committed, at most ``timeout_s`` seconds
        (e.g. the shadow's snapshot of the final step, before the last report), and no longer once a listing
        fails after its retries (storage unreachable: nothing commits there either). True: it is (True
        elsewhere)."""
        deadline = time.monotonic() + timeout_s
        while self.attach:
            newest, listed = self._list_now()
            if newest is not None and newest.step >= step:
                return True
            if not listed or time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    @contextlib.contextmanager
    def following(self, interval_s: float = 5.0) -> Iterator[None]:
        """While the block runs, a thread reports each new committed snapshot within ``interval_s`` seconds
        (its ``step``: the snapshot's). For a one-worker group whose training runs in another process (a
        warm standby's supervisor, ``workers.standby``; several supervisors are ZO replica groups, which
        report at the end only): with several ranks the reports would not be in lockstep."""
        stop = threading.Event()

        def follow() -> None:
            while not stop.wait(interval_s):
                newest = self._latest
                if newest is not None and newest.folder != self.reported:
                    self.report(newest.step)

        thread = threading.Thread(target=follow, name="raycheck-train-follow", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def report(self, steps_done: int, metrics: Mapping[str, Any] | None = None, final: bool = False) -> str | None:
        """Report ``metrics`` (plain numbers) with ``step`` (= ``steps_done``), ``checkpoint_step`` and
        ``checkpoint_snapshot`` (the newest committed snapshot's step and URI, rank 0: the last background
        listing's, or with ``final`` a listing now, after which the background one stops); rank 0 attaches
        that snapshot's pointer when it is new. Every rank must call it at the same steps. Returns the
        folder attached (None: none)."""
        import ray.train

        newest = self.newest() if final else self._latest
        if final:
            self._stop.set()
        row = {**dict(metrics or {}), "step": steps_done, "checkpoint_step": newest.step if newest is not None else None,
               "checkpoint_snapshot": self.store.storage.url(newest.folder) if newest is not None else None}
        if newest is None or newest.folder == self.reported:
            ray.train.report(row)
            return None
        with tempfile.TemporaryDirectory(prefix="raycheck-pointer-") as folder:
            with open(os.path.join(folder, POINTER_FILE), "w") as f:
                json.dump(pointer(self.store, newest), f)
            ray.train.report(row, checkpoint=ray.train.Checkpoint.from_directory(folder), checkpoint_dir_name=newest.folder)
        self.reported = newest.folder
        return newest.folder


def storage_reachable() -> bool:
    """Whether Ray Train's storage is reachable from this worker: its validation marker, which Ray Train's
    controller wrote, is there (it is not for a local ``storage_path`` on another node, where Ray Train
    would refuse a checkpoint and fail the worker). Told once when not."""
    from ray.train.v2._internal.constants import VALIDATE_STORAGE_MARKER_FILENAME  # the marker Ray Train checks itself

    ctx = ray_train_context()
    if ctx is None:
        return False
    sc = ctx.get_storage()
    try:
        import pyarrow.fs

        found = sc.storage_filesystem.get_file_info(f"{sc.experiment_fs_path}/{VALIDATE_STORAGE_MARKER_FILENAME}").type == pyarrow.fs.FileType.File
    except OSError:
        found = False
    if not found:
        log.warning("Ray Train's storage %s is not reachable from this node (a local storage_path on a cluster of several "
                    "nodes?): its reports carry no checkpoint (the snapshots stay in raycheck's storage); give RunConfig a "
                    "storage_path every node reaches (s3://...; raycheck run: --ray-train-storage s3://...) for Ray Train to list them",
                    sc.experiment_fs_path)
    return found


def checkpoint_record(checkpoint: Any, metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``Result.checkpoint`` for a run's summary: ``path`` (its URI in Ray Train's storage), ``snapshot`` and
    ``step`` (the snapshot it points to, from the last report's ``metrics``: no file is read). None when no
    checkpoint was reported."""
    if checkpoint is None:
        return None
    metrics = metrics or {}
    return {"path": checkpoint_uri(checkpoint), "snapshot": metrics.get("checkpoint_snapshot"), "step": metrics.get("checkpoint_step")}


FINAL_SNAPSHOT_WAIT_S = 60.0
"""How long rank 0's last report waits for the shadow's snapshot of the final step (seconds)."""


def ask_final_snapshot(cfg: JobConfig, run: RunChannel) -> None:
    """Ask every shard of the run's shadow for a snapshot of the final step (``ShadowActor.snapshot_at``:
    taken once its replay gets there), unless its fixed interval takes one there anyway. A shadow that
    does not answer within ``FINAL_SNAPSHOT_WAIT_S`` is logged and left (the driver snapshots the final
    state after the workers end, as before)."""
    every = cfg.snapshot.every_steps
    if cfg.snapshot.policy == "fixed" and (every == 0 or cfg.steps % every == 0):
        return  # snapshots off, or the schedule takes the final step
    shards = find_shards(run, cfg.namespace, timeout_s=FINAL_SNAPSHOT_WAIT_S)
    try:
        if shards is None:
            raise GetTimeoutError(f"no live shadow within {FINAL_SNAPSHOT_WAIT_S:.0f} s")
        ray.get([s.snapshot_at.remote(cfg.steps) for s in shards], timeout=FINAL_SNAPSHOT_WAIT_S)
    except RayError as exc:
        log.warning("the shadow was not asked for a snapshot of step %d (%s): Ray Train's last checkpoint is an older one",
                    cfg.steps, exc)


def train_reports(cfg: JobConfig, rank: int) -> TrainReports | None:
    """A ``raycheck run`` worker's reports (ZO: ``workers.zo_session``, every ``snapshot.every_steps`` steps
    and at ``close``; a warm standby's supervisor: ``TrainReports.following``), rank 0 attaching the run's
    newest committed snapshot; None outside a Ray Train worker (a warm standby's step executor). With
    replica groups the last report only (``periodic`` False): a worker replaced alone re-executes steps
    from its restore while the others wait for it in the step exchange, so a report of its own there
    would wait for theirs (Ray Train v2 takes reports in lockstep) and stall the run; at the end every
    worker reports once."""
    if ray_train_context() is None:
        return None
    return TrainReports(checkpoint_store(cfg), rank, periodic=not cfg.replica_groups)


def last_report(cfg: JobConfig, reports: TrainReports, run: RunChannel) -> None:
    """The run's last report, every rank: with a shadow, rank 0 first has it snapshot the final step
    (``ask_final_snapshot``, unless one of the final step is committed already: a second would be a copy) and
    waits for that snapshot's commit (at most ``FINAL_SNAPSHOT_WAIT_S``), so that ``Result.checkpoint`` is the
    trained state."""
    snapshots = cfg.snapshot.policy == "adaptive" or cfg.snapshot.every_steps > 0
    if reports.rank == 0 and cfg.uses_shadow and snapshots:
        committed = reports.newest()
        if committed is None or committed.step < cfg.steps:  # taken already (the adaptive schedule's, an earlier incarnation's)
            ask_final_snapshot(cfg, run)
        if not reports.wait_for(cfg.steps, FINAL_SNAPSHOT_WAIT_S):
            log.warning("the snapshot of step %d is not committed (waited at most %.0f s; a failed listing is logged above): "
                        "Ray Train's last checkpoint is an older one", cfg.steps, FINAL_SNAPSHOT_WAIT_S)
    reports.report(cfg.steps, final=True)
