"""The objects a run's configuration describes, built from it: its snapshot store (or sharded store) and its
differential gradient records (``job.config.JobConfig`` describes and validates; it builds nothing itself). Each is
built fresh, so it is safe to call in any process (driver, actor, train worker)."""

from __future__ import annotations

from raycheck.job.config import JobConfig
from raycheck.storage.backend import Storage
from raycheck.storage.dcp_store import ShardedStore
from raycheck.storage.diffs import DiffStore, rank_prefix
from raycheck.storage.manifest import RunIdentity
from raycheck.storage.snapshots import SnapshotStore


def run_identity(cfg: JobConfig) -> RunIdentity:
    """What the run's stored objects are checked against: its run id and trajectory hash."""
    return RunIdentity(cfg.run_id, cfg.trajectory_sha256())


def snapshot_store(cfg: JobConfig, direct: bool = False) -> SnapshotStore:
    """The run's snapshot store: it writes and restores only this run's snapshots (``run_identity``), at
    ``cfg.writer_epoch``; a merge result only as the starting point of a run without a step log
    (``SnapshotStore``'s ``step_log``). ``direct``: its local writes bypass the page cache (``Storage``'s
    ``write_direct``)."""
    return SnapshotStore(Storage(cfg.storage.uri, write_direct=direct, **cfg.storage.options), keep_last=cfg.snapshot.keep,
                         identity=run_identity(cfg), epoch=cfg.writer_epoch, step_log=cfg.uses_step_log)


def sharded_store(cfg: JobConfig) -> ShardedStore:
    """The run's sharded checkpoints (``--fo-parallelism fsdp2``, ``storage.dcp_store``): its identity and
    writer epoch."""
    return ShardedStore(Storage(cfg.storage.uri, **cfg.storage.options), keep_last=cfg.snapshot.keep,
                        identity=run_identity(cfg), epoch=cfg.writer_epoch)


def checkpoint_store(cfg: JobConfig) -> SnapshotStore:
    """Where the run's states are committed: its sharded store under FSDP2, else its snapshot store."""
    return sharded_store(cfg) if cfg.algo == "fo" and cfg.fo.parallelism == "fsdp2" else snapshot_store(cfg)


def diff_store(cfg: JobConfig, rank: int | None = None) -> DiffStore:
    """The run's differential gradient records (strategy ``differential``), in its snapshot storage: it
    writes and replays only this run's batches (``run_identity``). ``rank`` (FSDP2): that rank's records of
    its gradient rows at the run's worker count, beside the sharded checkpoints (``storage.diffs.rank_prefix``)."""
    if rank is None:
        return DiffStore(Storage(cfg.storage.uri, **cfg.storage.options), identity=run_identity(cfg))
    return DiffStore(sharded_store(cfg).storage, rank_prefix(rank, cfg.workers), run_identity(cfg))
