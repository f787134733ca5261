"""Restoring a worker's state: the freshest complete state, then the durable log tail.

Order of preference (ZOCheck's recovery rule): the live shadow's image through Ray's object store,
when the shadow is alive, intact and catches up to the end of the durable log (a sharded shadow:
every shard's image of that step, assembled by ``actors.shards.assemble``); else the newest
verified snapshot in storage (or the initial weights when none exists) plus replay of the logged
tail. Either way the restored state is the one after every durable step: nothing logged is lost.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from orchestrator.config import JobConfig
from orchestrator.journal import RunChannel
from actors.shards import assemble
from orchestrator.shadow_keeper import find_shards
from storage.manifest import layout_of
from storage.snapshots import NoSnapshotError
from storage.steplog import read_header, read_records
from training.state import load_into
from training.zo import check_generator, replay_records_

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
        images = ray.get([s.image.remote(log_end, cfg.recovery_timeout_s) for s in shards], timeout=cfg.recovery_timeout_s + 30)
    except (RayActorError, RayTaskError, GetTimeoutError) as exc:
        log.warning("shadow cannot serve step %d (%s); falling back to storage", log_end, type(exc).__name__)
        return None
    state, problem = assemble(images, log_end)
    if problem:
        log.warning("%s; falling back to storage", problem)
        return None
    load_into(params, state)
    return {"source": "object_store", "base_step": log_end, "replayed_steps": 0,
            "load_seconds": time.perf_counter() - t0, "replay_seconds": 0.0}


def from_storage(params: "OrderedDict[str, torch.Tensor]", cfg: JobConfig, log_path, log_end: int | None) -> dict:
    """Load the newest verified snapshot of this run (at or before ``log_end`` when given, with the
    layout of ``params``; else keep the initial weights in ``params``), then replay the logged steps
    after it up to ``log_end``. Snapshots of other runs or layouts are skipped and named in ``skipped``.

    ``log_end=None`` (strategies without a step log): no replay; training resumes at the snapshot's
    step and the steps after it are recomputed.

    Raises:
        GeneratorMismatchError: the log's header names another noise generator (or none).
    """
    t0 = time.perf_counter()
    try:
        info, state, skipped = cfg.snapshot_store().load_latest(max_step=log_end, layout=layout_of(params))
        load_into(params, state)
        base, source = info.step, "storage"
    except (NoSnapshotError, OSError) as exc:  # OSError: storage unreachable; the local log still has every step
        log.warning("%s; restarting from the initial weights", exc)
        base, source, skipped = 0, "initial", [str(exc)]
    t1 = time.perf_counter()
    if log_end is not None:
        check_generator(read_header(log_path), str(log_path))
    replayed = replay_records_(params, read_records(log_path)[base:log_end]) if log_end is not None else 0
    return {"source": source, "base_step": base, "replayed_steps": replayed, "skipped": skipped,
            "load_seconds": t1 - t0, "replay_seconds": time.perf_counter() - t1}


def restore(params: "OrderedDict[str, torch.Tensor]", cfg: JobConfig, log_path, log_end: int | None) -> dict:
    """Restore ``params`` (holding the initial weights) to the freshest complete state.

    With a step log (``log_end`` = its complete records) that is the state after ``log_end`` steps:
    the live shadow's image when the strategy has one, else storage plus the log tail. Without a
    step log (``log_end=None``) it is the newest committed checkpoint.

    Returns ``{"source": "object_store" | "storage" | "initial", "base_step", "replayed_steps",
    "load_seconds", "replay_seconds", "seconds"}``; the restored state belongs to step
    ``base_step + replayed_steps``.
    """
    t0 = time.perf_counter()
    result = (from_shadow(params, cfg, log_end) if cfg.uses_shadow else None) or from_storage(params, cfg, log_path, log_end)
    result["seconds"] = time.perf_counter() - t0
    return result
