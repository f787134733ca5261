"""Restoring a worker's state: the freshest complete state, then the durable log tail.

Order of preference (ZOCheck's recovery rule): the live shadow's image through Ray's object store,
when the shadow is alive, intact and catches up to the end of the durable log (a sharded shadow:
every shard's image of that step, assembled by ``actors.shards.assemble``); else the newest
verified snapshot in storage (or the initial weights when none exists) plus replay of the logged
tail (``log_tail``: from rank 0's node-local log, the log keeper, or the log segments in the bucket,
whichever holds every durable step). Either way the restored state is the one after every durable
step: nothing logged is lost.
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from raycheck.actors.journal import RunChannel
from raycheck.actors.log_keeper import RemoteKeeper, read_range
from raycheck.actors.shadow_actor import find_shards
from raycheck.actors.shards import assemble
from raycheck.job.config import JobConfig
from raycheck.job.names import log_keeper_name
from raycheck.job.stores import snapshot_store
from raycheck.storage.log_segments import read_segments
from raycheck.storage.manifest import layout_of
from raycheck.storage.snapshots import NoSnapshotError
from raycheck.storage.steplog import StepLogGapError, StepRecord, read_header, read_records, trajectory_tag
from raycheck.training.state import load_into
from raycheck.training.zo import ZOHyper, check_dtype, check_generator, check_records, replay_records_

log = logging.getLogger(__name__)


def from_shadow(params: "OrderedDict[str, torch.Tensor]", cfg: JobConfig, log_end: int) -> dict | None:
    """Load the shadow's image at ``log_end`` into ``params`` (the images of every shard, assembled);
    None, with the reason logged, when a shard is missing, fails, or cannot serve exactly that step."""
    shards = find_shards(RunChannel(cfg), cfg.namespace, timeout_s=0)
    if shards is None:
        log.warning("no live shadow (every shard of it); falling back to storage")
        return None
    t0 = time.perf_counter()  # load: the shards' catch-up to log_end (if any) and the object-store transfers
    try:
        images = ray.get([s.image.remote(log_end, cfg.faults.recovery_timeout_s) for s in shards], timeout=cfg.faults.recovery_timeout_s + 30)
    except (RayActorError, RayTaskError, GetTimeoutError) as exc:
        log.warning("shadow cannot serve step %d (%s); falling back to storage", log_end, type(exc).__name__)
        return None
    state, problem = assemble(images, log_end)
    if state is None:
        log.warning("%s; falling back to storage", problem)
        return None
    load_into(params, state)
    return {"source": "object_store", "base_step": log_end, "replayed_steps": 0,
            "load_seconds": time.perf_counter() - t0, "replay_seconds": 0.0, "state_loaded_unix_s": time.time()}


def log_tail(cfg: JobConfig, local_log: str | pathlib.Path | None, start: int, end: int) -> tuple[dict | None, list[StepRecord], str]:
    """(header, records ``start..end - 1``, where they came from) of the run's step log, from the first
    of these that holds ``end`` steps: ``local_log`` (rank 0's node-local log; None elsewhere), the log
    keeper (``log_keeper_name(cfg)``), the log segments in the run's storage (``cfg.storage.remote``).
    The header is None when the segments hold no log (``end`` 0: nothing to replay).

    Raises:
        StepLogGapError: none of them holds ``end`` steps (each one's reason is named).
    """
    reasons = []
    if local_log is not None and pathlib.Path(local_log).exists():
        records = read_records(local_log)
        if len(records) >= end:
            return read_header(local_log), records[start:end], "local"
        reasons.append(f"{local_log} holds {len(records)}")
    try:
        keeper = RemoteKeeper(log_keeper_name(cfg), cfg.namespace)
        return keeper.header(), read_range(keeper, start, end), "keeper"
    except (ValueError, RayActorError, GetTimeoutError, StepLogGapError) as exc:
        reasons.append(f"the log keeper: {type(exc).__name__}: {exc}")
    if cfg.storage.remote:
        header, records = read_segments(snapshot_store(cfg).storage)
        if len(records) >= end:
            return header, records[start:end], "segments"
        reasons.append(f"the segments in {cfg.storage.uri} hold {len(records)}")
    raise StepLogGapError(f"no copy of the step log holds the {end} durable steps: {'; '.join(reasons)}")


def from_storage(params: "OrderedDict[str, torch.Tensor]", cfg: JobConfig, local_log: str | pathlib.Path | None, log_end: int | None,
                 initial: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> dict:
    """Load the newest verified snapshot of this run (at or before ``log_end`` when given, with the
    layout of ``params``; else the initial weights: ``initial()`` loaded into ``params``, or, with
    ``initial`` None, those ``params`` hold already, a fresh worker's), then replay the logged steps
    after it up to ``log_end`` (``log_tail``: from ``local_log``, the log keeper or the bucket; the
    source is named in ``log_source``). Snapshots of other runs or layouts are skipped and named in ``skipped``.

    ``log_end=None`` (strategies without a step log): no replay; training resumes at the snapshot's
    step and the steps after it are recomputed.

    Raises:
        GeneratorMismatchError: the log's header names another noise generator (or none).
        DtypeMismatchError: the log's header names another parameter dtype than ``cfg.dtype``.
        StepLogGapError: no copy of the log holds ``log_end`` steps.
        StepLogCorruptError: a record to replay is not this run's (``training.zo.check_records``).
    """
    t0 = time.perf_counter()
    try:
        info, state, skipped = snapshot_store(cfg).load_latest(max_step=log_end, layout=layout_of(params))
        load_into(params, state)
        base, source = info.step, "storage"
    except (NoSnapshotError, OSError) as exc:  # OSError: storage unreachable; the local log still has every step
        log.warning("%s; restarting from the initial weights", exc)
        base, source, skipped = 0, "initial", [str(exc)]
        if initial is not None:
            load_into(params, initial())
    t1 = time.perf_counter()
    result = {"source": source, "base_step": base, "replayed_steps": 0, "skipped": skipped, "state_loaded_unix_s": time.time()}
    if log_end is not None:
        header, records, result["log_source"] = log_tail(cfg, local_log, base, log_end)
        if header is not None:  # None: no log written yet, nothing to replay or check
            check_generator(header, f"the step log ({result['log_source']})")
            check_dtype(header, cfg.dtype, f"the step log ({result['log_source']})")
        check_records(records, cfg.seed, f"the step log ({result['log_source']})", ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay),
                      trajectory_tag(cfg.run_id, cfg.trajectory_sha256()))
        result["replayed_steps"] = replay_records_(params, records)
    return {**result, "load_seconds": t1 - t0, "replay_seconds": time.perf_counter() - t1}


def restore(params: "OrderedDict[str, torch.Tensor]", cfg: JobConfig, local_log: str | pathlib.Path | None, log_end: int | None,
            initial: Callable[[], Mapping[str, torch.Tensor]] | None = None) -> dict:
    """Restore ``params`` (on the CPU, holding the initial weights; or any weights, with ``initial``
    returning the initial ones: an in-process restart, ``training.in_process``) to the freshest complete state.

    With a step log (``log_end`` = the steps the log keeper holds) that is the state after ``log_end``
    steps: the live shadow's image when the strategy has one, else storage plus the log tail
    (``from_storage``; ``local_log``: rank 0's node-local log, None on the other ranks). Without a
    step log (``log_end=None``) it is the newest committed checkpoint.

    Returns ``{"source": "object_store" | "storage" | "initial", "base_step", "replayed_steps",
    "load_seconds", "replay_seconds", "seconds", "restore_began_unix_s", "state_loaded_unix_s"}``
    (the last two: when the restore began and when its base state was loaded, unix seconds); the
    restored state belongs to step ``base_step + replayed_steps``.
    """
    t0, began_unix_s = time.perf_counter(), time.time()
    result = (from_shadow(params, cfg, log_end) if cfg.uses_shadow and log_end is not None else None) or from_storage(params, cfg, local_log, log_end, initial)
    result["seconds"] = time.perf_counter() - t0
    result["restore_began_unix_s"] = began_unix_s
    return result
