"""Turning a run's event and metric streams (the rows the driver received) into ``summary.json`` and ``metrics.parquet``."""

from __future__ import annotations

import bisect
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from raycheck.job.config import JobConfig
from raycheck.orchestrator.preemption import preemption_records

METRIC_COLUMNS = ("step", "loss", "step_seconds", "checkpoint_block_seconds", "log_append_seconds", "shadow_lag_steps",
                  "snapshot_interval_steps")


BREAKDOWN = (
    ("detected_unix_s", "detection_s"),
    ("group_start_unix_s", "teardown_s"),
    ("process_created_unix_s", "scheduling_s"),
    ("workers_created_unix_s", "process_start_s"),
    ("group_ready_unix_s", "group_setup_s"),
    ("worker_start_unix_s", "launch_s"),
    ("imports_unix_s", "imports_s"),
    ("model_loaded_unix_s", "model_load_s"),
    ("data_loaded_unix_s", "data_load_s"),
    ("restore_began_unix_s", "log_setup_s"),
    ("state_loaded_unix_s", "state_transfer_s"),
    ("unix_s", "replay_s"),
    ("first_step_unix_s", "first_step_s"),
)
"""The recovery of a worker as a chain of stamps (unix seconds), each with the component that ends
there (it starts at the stamp before, the first at the failure event):

- ``detection_s``: until Ray Train's controller acts on the failure (``orchestrator.group_timeline``);
- ``teardown_s``: until the old worker group is shut down and the new one's start begins;
- ``scheduling_s``: until the replacement worker process exists (``psutil`` ``create_time``, 10 ms ticks);
- ``process_start_s``: until its Ray Train worker actor is up (interpreter start, Ray's imports);
- ``group_setup_s``: Ray Train's train contexts and torch process group;
- ``launch_s``: until our train function runs (unpickling it imports our training modules);
- ``imports_s``: ``transformers`` (what the model and tokenizer load import first);
- ``model_load_s``: the shipped model files fetched and the model built with its initial weights;
- ``data_load_s``: the data fetched from the object store (or the data wheel), tokenizer and encoder;
- ``log_setup_s``: the step log keeper joined, rank 0's local log made equal to it, the ranks' barrier;
- ``state_transfer_s``: the freshest state loaded (the shadow's image through the object store, or
  the newest snapshot from storage);
- ``replay_s``: the log tail replayed, the state moved to the device, the ``recovery`` event;
- ``first_step_s``: the first step after the restore, until its metric row.
"""


IN_PROCESS_BREAKDOWN = (
    ("detected_unix_s", "detection_s"),
    ("restore_began_unix_s", "log_setup_s"),
    ("state_loaded_unix_s", "state_transfer_s"),
    ("unix_s", "replay_s"),
    ("first_step_unix_s", "first_step_s"),
)
"""The chain of an in-process restart (``training.in_process``; a ``recovery`` event with ``path``
``in_process``): the process survives, so there is no Ray Train component, no process start, imports,
model or data load. ``detection_s``: until the train function caught the step's exception (its own
stamp, not Ray Train's); ``log_setup_s``: the decision and its event, rank 0's local log reopened and
made equal to the keeper's (or the background checkpoint write committed); the rest as in ``BREAKDOWN``."""


STANDBY_BREAKDOWN = (
    ("detected_unix_s", "detection_s"),
    ("promoted_unix_s", "promotion_s"),
    ("restore_began_unix_s", "log_setup_s"),
    ("state_loaded_unix_s", "state_transfer_s"),
    ("unix_s", "replay_s"),
    ("first_step_unix_s", "first_step_s"),
)
"""The chain of a warm standby's promotion (``workers.standby``; a ``recovery`` event with ``path``
``standby``): the standby's process, imports, model and data were loaded before the failure, and Ray Train
never restarts anything. ``detection_s``: until the supervisor's wait on the dead executor raised;
``promotion_s``: the promotion's budget claim and event, and the standby's ``run`` call reaching it (or the
rest of its load, when it was not loaded yet); ``log_setup_s``: the log keeper joined and rank 0's local
log opened and made equal to the keeper's; the rest as in ``BREAKDOWN``."""

CHAINS = {"in_process": IN_PROCESS_BREAKDOWN, "standby": STANDBY_BREAKDOWN}
"""The breakdown chain of each recovery ``path`` that has its own stamps only (no worker group started)."""


RAY_TRAIN_COMPONENTS = frozenset({"detection", "teardown", "scheduling", "process_start", "group_setup", "launch"})
"""The components (``BREAKDOWN``, without ``_s``) that are Ray Train's restart of the worker group, not our code."""


def breakdown(failure_unix_s: float, stamps: dict, chain: tuple = BREAKDOWN) -> tuple[dict[str, float], list[str]]:
    """The recovery breakdown (pure): seconds per component of ``chain`` (``BREAKDOWN``, or
    ``IN_PROCESS_BREAKDOWN``), from the failure at ``failure_unix_s`` to the latest of ``stamps`` (stamp
    name -> unix seconds) that is there.

    A missing stamp cannot separate its two components: they are one field named by both
    (``log_setup+state_transfer_s``); components after the last stamp given are left out. A stamp
    earlier than the one before it (e.g. a worker process Ray had started before the failure) gives its
    component 0 s and counts from the earlier one on; such components are returned in the list.

    The components add up to the last stamp minus the failure exactly, in float64: every stamp is a
    multiple of 2**-22 s in [2**30, 2**31) s (any unix time from 2004 to 2038), so each difference and
    each partial sum is exact.
    """
    parts, merged, clamped, prev = {}, [], [], failure_unix_s
    for stamp, part in chain:
        merged.append(part.removesuffix("_s"))
        t = stamps.get(stamp)
        if t is None:
            continue
        if t < prev:
            clamped.append(part)
            t = prev
        parts["+".join(merged) + "_s"] = t - prev
        merged, prev = [], t
    return parts, clamped


def first_step_unix_s(recovery: dict, executions: Sequence[dict], before_unix_s: float = math.inf) -> float | None:
    """When the first step after ``recovery`` (a ``recovery`` event) was done: the ``unix_s`` of the
    first of ``executions`` (metric rows in time order) of its restored step stamped after it and
    before ``before_unix_s`` (the next worker failure); None when there is none (not yet, or that
    worker failed first)."""
    return next((r["unix_s"] for r in executions
                 if r["step"] == recovery["restored_step"] and recovery["unix_s"] < r["unix_s"] < before_unix_s), None)


def group_stamps(events: list[dict], after_unix_s: float, before_unix_s: float) -> dict:
    """The stamps of the last ``worker_group`` event whose group start lies between the two times (the
    group that a recovery's worker belongs to); ``{}`` when none."""
    groups = [e for e in events if e["kind"] == "worker_group" and after_unix_s <= e.get("group_start_unix_s", -1.0) <= before_unix_s]
    return {k: v for k, v in groups[-1].items() if k.endswith("_unix_s")} if groups else {}


def recoveries(events: list[dict], executions: Sequence[dict] = ()) -> list[dict]:
    """Each worker recovery with its timings (seconds) and the failure it answers: one per failure and
    restored step (with replica groups every rank that restores records it; the first one counts). A
    ``resume`` event (a new driver) starts afresh: the restores after it answer the resume, not an
    earlier failure, so they have no failure fields (its restore is not timed from a failure that an
    earlier incarnation had already recovered from).

    ``seconds``: failure to restored state; ``restart_seconds``: failure to the restore beginning
    (detection, process restart, model and data loading in the new worker);
    ``load_seconds``/``replay_seconds``: loading the base state and replaying the logged tail;
    ``lost_steps``: durable steps not restored (0 unless something durable was lost);
    ``recompute_steps``: steps that ran before the failure and must run again (the work lost after
    the last durable point; 0 with a step log); a sharded (fsdp2) restore adds ``saved_world_size``
    and ``restored_state_sha256`` (the loaded state, re-gathered).

    ``path`` (when the event names it): ``new_process`` (Ray Train started a replacement worker),
    ``in_process`` (the worker's process rolled back and went on, ``training.in_process``) or ``standby``
    (a warm standby executor took over from a dead one, ``workers.standby``).

    For a recovery whose event carries the worker's stamps, also ``breakdown`` (``breakdown``: the
    component seconds, from the ``worker_group`` event of its group, its own stamps and the first
    step's metric row in ``executions``; an in-process or standby one's over its ``CHAINS`` entry, from its own
    stamps), ``first_step_seconds`` (failure to the first step done,
    None until it is, or when the worker failed again before) and ``breakdown_clamped`` (only when a component was clamped to 0).
    """
    return list({id(row): row for row in recovery_of_event(events, executions).values()}.values())


def recovery_of_event(events: list[dict], executions: Sequence[dict] = ()) -> dict[int, dict]:
    """The index in ``events`` of each ``recovery`` event -> its row of ``recoveries`` (the ranks of a
    group restoring the same step share one row)."""
    out: dict[int, dict] = {}
    rows: dict[tuple[int, int], dict] = {}
    last_failure, boundary = None, None
    decisions: dict[int | None, dict] = {}  # each rank's standby decision so far (None: the driver's)
    failed_with: dict[int | None, dict] = {}  # those in force at the last failure: why it took its path
    failures_unix_s = [e["unix_s"] for e in events if e["kind"] == "failure" and e["target"] == "worker"]
    for i, e in enumerate(events):
        if e["kind"] == "standby_decision":
            decisions[e.get("rank")] = e
        elif e["kind"] == "failure" and e["target"] == "worker":
            last_failure = boundary = e
            failed_with = dict(decisions)
        elif e["kind"] == "resume":
            last_failure, boundary = None, e
        elif e["kind"] == "recovery" and (id(boundary), e["at_step"]) in rows:
            out[i] = rows[id(boundary), e["at_step"]]  # a group's other ranks restoring the same step: one recovery
        elif e["kind"] == "recovery":
            row = rows[id(boundary), e["at_step"]] = out[i] = {k: e[k] for k in ("at_step", "restored_step", "source", "base_step", "replayed_steps")}
            if "path" in e:
                row["path"], row["why"] = e["path"], path_reason(e, failed_with.get(e.get("rank"), failed_with.get(None)))
            if e.get("skipped"):
                row["skipped"] = e["skipped"]
            row.update({k: e[k] for k in ("saved_world_size", "restored_state_sha256") if k in e})  # fsdp2 restores
            row["restore_seconds"] = e["seconds"]
            row["load_seconds"] = e["load_seconds"]
            row["replay_seconds"] = e["replay_seconds"]
            if last_failure is not None:
                row["failure_step"] = last_failure["step"]
                row["seconds"] = e["unix_s"] - last_failure["unix_s"]
                row["restart_seconds"] = e["unix_s"] - e["seconds"] - last_failure["unix_s"]  # until the restore began
                row["lost_steps"] = max(0, last_failure["durable_steps"] - e["restored_step"])
                row["recompute_steps"] = max(0, last_failure["step"] - e["restored_step"])
                if "process_created_unix_s" in e or e.get("path") in CHAINS:
                    next_failure = min((t for t in failures_unix_s if t > e["unix_s"]), default=math.inf)
                    row.update(_breakdown_fields(last_failure, e, events, executions, next_failure))
    return out


def path_reason(recovery: dict, decision: dict | None) -> str:
    """Why a ``recovery`` event took its ``path`` (one line), given its rank's ``standby_decision`` event in force
    when the worker failed (None: none recorded)."""
    path = recovery["path"]
    if path == "standby":
        loading_s = recovery.get("standby_loaded_unix_s", 0.0) - recovery.get("detected_unix_s", math.inf)
        if loading_s > 0:
            return f"the executor's process died and the rank's standby, still loading ({loading_s:.1f} s more), took over"
        return "the executor's process died and the rank's loaded standby took over"
    if path == "in_process":
        return "the step raised with the process alive: rolled back in the same process"
    if decision is None:
        return "Ray Train restarted the worker"
    if not decision["keep"]:
        return f"Ray Train restarted the worker: {decision['reason']}"
    return "Ray Train restarted the worker: its supervisor's process or node was lost with the standby, or the promotion budget was spent"


def _breakdown_fields(failure: dict, recovery: dict, events: list[dict], executions: Sequence[dict], next_failure_unix_s: float) -> dict:
    first_step = first_step_unix_s(recovery, executions, next_failure_unix_s)
    chain: tuple[tuple[str, str], ...]
    if recovery.get("path") in CHAINS:  # its own stamps only: no worker group started
        stamps, chain = {**recovery, "first_step_unix_s": first_step}, CHAINS[recovery["path"]]
    else:
        stamps, chain = {**group_stamps(events, failure["unix_s"], recovery["worker_start_unix_s"]), **recovery,
                         "first_step_unix_s": first_step}, BREAKDOWN
    parts, clamped = breakdown(failure["unix_s"], stamps, chain)
    fields = {"breakdown": parts, "first_step_seconds": None if first_step is None else first_step - failure["unix_s"]}
    return {**fields, "breakdown_clamped": clamped} if clamped else fields


def durability(level: str, keeper: dict, events: list[dict]) -> dict:
    """The step log's durability in ``summary.json``: ``level`` (``JobConfig.durability``), the log
    keeper's node (``node_id`` of its last ``status`` ``keeper``), rank 0's node in each of its
    incarnations (``step_log`` events), and ``node_held``: whether level ``node`` (or ``cluster``, which
    waits for the keeper too) really held, i.e. the keeper never ran on a node of rank 0 (with both on
    one node a lost node takes both copies). For ``cluster`` also the keeper's group commits: ``uploads``,
    ``uploaded_steps`` (the steps they acknowledged) and ``records_per_upload`` (their mean; None before any)."""
    rank0 = [e["node_id"] for e in events if e["kind"] == "step_log"]
    keeper_node_id = keeper.get("node_id")
    out = {"level": level, "keeper_node_id": keeper_node_id, "rank0_node_ids": rank0,
           "node_held": level in ("node", "cluster") and bool(rank0) and keeper_node_id is not None and keeper_node_id not in rank0}
    if level == "cluster":
        uploads, steps = keeper.get("log_uploads", 0), keeper.get("log_uploaded_steps", 0)
        out.update(uploads=uploads, uploaded_steps=steps, records_per_upload=steps / uploads if uploads else None)
    return out


def write_metrics(executions: list[dict], per_step: dict[str, dict[int, int]], path: pathlib.Path) -> list[dict]:
    """One row per executed step of ``executions`` (the metric rows in time order; the last execution
    if a step ran twice) as Parquet, with the controller's per-step columns ``per_step`` (column ->
    step -> value) added; returns the rows."""
    rows: dict[int, dict] = {}
    for r in executions:
        rows[r["step"]] = {**r, **{col: values.get(r["step"]) for col, values in per_step.items()}}
    ordered = [rows[k] for k in sorted(rows)]
    columns = list(METRIC_COLUMNS) + sorted({k for r in ordered for k in r} - set(METRIC_COLUMNS))
    table = pa.table({c: [r.get(c) for r in ordered] for c in columns})
    pq.write_table(table, path)
    return ordered



def checkpoint_bytes(executions: list[dict], events: list[dict], final_bytes: int) -> int:
    """Checkpoint bytes a first-order run wrote (shards, gradient records, manifests' shards; bytes): per
    worker incarnation (a ``recovery`` event starts the next) the most its checkpointer had committed at
    any step row (``checkpoint_bytes``), the last incarnation's from ``final_bytes`` (its checkpointer's
    total after ``close``) when larger. A write still in flight when a worker died is not counted."""
    cuts = sorted(e["unix_s"] for e in events if e["kind"] == "recovery")
    per: dict[int, int] = {}
    for r in executions:
        i = bisect.bisect(cuts, r["unix_s"])
        per[i] = max(per.get(i, 0), int(r.get("checkpoint_bytes") or 0))
    per[len(cuts)] = max(per.get(len(cuts), 0), int(final_bytes or 0))
    return sum(per.values())


def run_checkpoints(checkpoints: Any, executions: list[dict], events: list[dict]) -> Any:
    """A worker's ``final`` event's ``checkpoints`` (its checkpointer's ``close``: the last worker
    incarnation's alone, 0 bytes for one that committed nothing) with ``bytes`` made the run's, summed
    over the incarnations (``checkpoint_bytes``), and the last incarnation's own in ``incarnation_bytes``;
    anything else (None: no checkpointer) as it is. What ``summary.json``'s ``worker_checkpoints`` and the
    printed ``final`` line show."""
    if not isinstance(checkpoints, dict) or "bytes" not in checkpoints:
        return checkpoints
    return {**checkpoints, "bytes": checkpoint_bytes(executions, events, checkpoints["bytes"]),
            "incarnation_bytes": checkpoints["bytes"]}


def metric_coverage(logged_steps: int, rows: list[dict]) -> dict:
    """``summary.json``'s ``metrics`` (pure): of the steps ``0..logged_steps - 1`` that the step log holds,
    those without a metrics row in ``rows`` (one per step): ``missing_step_count`` and ``missing_steps``,
    inclusive ``[first, last]`` ranges of step numbers. Such a step was logged (durable) just before an
    interrupt, so ``--resume`` does not execute it again, but its row never reached the driver: its
    timings are unknown and none are invented (``metrics.parquet`` has no row for it)."""
    have = {r["step"] for r in rows}
    missing = [step for step in range(logged_steps) if step not in have]
    ranges: list[list[int]] = []
    for step in missing:
        if ranges and ranges[-1][1] == step - 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    return {"missing_step_count": len(missing), "missing_steps": ranges}


def missing_steps_line(coverage: dict) -> str | None:
    """One line naming the steps ``metric_coverage`` found without a metrics row (``17, 20..22``); None
    when none is missing."""
    if not coverage["missing_step_count"]:
        return None
    steps = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in coverage["missing_steps"])
    return (f"{coverage['missing_step_count']} step(s) in the step log have no metrics row (logged just before an "
            f"interrupt, not executed again after the resume; their timings are unknown): {steps}")


def mean_step_seconds(rows: list[dict]) -> float | None:
    """The mean ``step_seconds`` of the metric rows ``rows`` (None without any)."""
    return sum(r["step_seconds"] for r in rows) / len(rows) if rows else None


@dataclass(frozen=True)
class Collected:
    """What the controller collected by the end of a run whose ``fit`` returned."""

    ok: bool
    """Whether ``fit`` returned without an error."""
    error: str | None
    """``<ErrorType>: message`` of a ``fit`` that raised."""
    events: list[dict]
    """The run's event stream, in time order."""
    executions: list[dict]
    """The metric rows as received (a step run twice appears twice)."""
    rows: list[dict]
    """One metric row per step (``write_metrics``'s)."""
    shadow: dict
    """The shadow's final figures (``shadow_state_sha256``, ``shadow_shards``, ...); empty without a shadow."""
    persisted: dict
    """The snapshot persister's status after its final flush."""
    mirror: dict
    """The step log mirror's fields of the log keeper's status (``log_mirror*``)."""
    keeper: dict | None
    """The log keeper's last status; None when the run had no log keeper."""
    durability_level: str
    """``JobConfig.durability``."""
    task: str
    """``JobConfig.data.task``."""
    base: dict
    """The fields known whatever happened (phase, restarts, placement, configuration, ...), last in the summary."""
    newest_snapshot: tuple[int, str] | None = None
    """(step, URI) of the newest committed snapshot in the run's storage at the end; None: none, or unreadable."""
    ray_train_checkpoint: dict | None = None
    """``Result.checkpoint`` of the run (``workers.train_reports.checkpoint_record``); None: none reported."""


def placement_record(policy: str | None, driver: dict | None, persister: list[dict], shadow_shards: list[list[dict]] | None,
                     events: list[dict]) -> dict:
    """Where each component ran (pure): ``policy`` (``orchestrator.cluster.Placement.policy``), ``driver``,
    ``persister`` (one entry per incarnation), ``shadow_shards`` (per shard, one per incarnation that
    answered; None without a shadow) and ``workers`` (one per worker start, from the ``placement`` events:
    ``rank``, ``unix_s``); each entry has ``node_id`` and ``node_ip``."""
    return {"policy": policy, "driver": driver, "persister": persister, "shadow_shards": shadow_shards,
            "workers": [{k: e[k] for k in ("rank", "node_id", "node_ip", "unix_s")}
                        for e in events if e["kind"] == "placement" and e["component"] == "worker"]}


def summary_base(cfg: JobConfig, *, phase: str, shadow_restarts: list[dict] | None, persister_restarts: int, config_stored: bool,
                 wall_seconds: float, placement: dict) -> dict:
    """The summary fields known whatever happened (pure; ``Collected.base``, last in ``run_summary`` and
    ``failed_summary``): the phase, the algorithm, strategy and dtype, the shadow's and persister's restarts,
    whether the configuration is in the remote storage, the snapshot policy, the storage consistency, the
    driver's wall-clock seconds, the trajectory hash, where each component ran (``placement_record``) and
    the configuration."""
    return {
        "phase": phase,
        "algo": cfg.algo,
        "strategy": cfg.strategy,
        "dtype": cfg.dtype,
        "shadow_restarts": shadow_restarts,
        "persister_restarts": persister_restarts,
        "config_stored": config_stored,
        "snapshot_policy": cfg.snapshot.policy,
        "storage_consistency": cfg.storage.consistency,
        "wall_seconds": wall_seconds,
        "trajectory_sha256": cfg.trajectory_sha256(),
        "placement": placement,
        "config": cfg.to_dict(),
    }


def run_summary(c: Collected) -> dict:
    """The ``summary.json`` of a run whose ``fit`` returned (pure): the worker's final state and
    accuracy (its ``final`` event), whether the shadow's state hash equals the worker's, failures,
    recoveries (``recoveries``), lost steps, step and checkpoint-block times (seconds), snapshot and
    durability figures, re-plans and resumes, the steps of the step log without a metrics row
    (``metrics``: ``metric_coverage`` of the log keeper's ``end``; None without a keeper), then ``c.base``. ``reference_state_sha256`` and
    ``bitwise_equal`` are None (``orchestrator.runs.run_job`` fills them with ``verify``)."""
    events, rows = c.events, c.rows
    final: dict = next((e for e in reversed(events) if e["kind"] == "final"), {})
    block_s = [r["checkpoint_block_seconds"] for r in rows]
    recs = recoveries(events, c.executions)
    shadow_sha = c.shadow.get("shadow_state_sha256")
    return {
        "ok": c.ok,
        "error": c.error,
        "final_step": final.get("step"),
        "state_sha256": final.get("state_sha256"),
        "shadow_state_sha256": None,
        "shadow_equal": shadow_sha is not None and shadow_sha == final.get("state_sha256") if c.shadow else None,
        "reference_state_sha256": None,
        "bitwise_equal": None,
        "failures": [{k: e[k] for k in ("step", "target", "how")} for e in events if e["kind"] == "failure"],
        "recoveries": recs,
        "standby": [{k: e[k] for k in ("rank", "keep", "reason", "saved_core_s", "cost_core_s") if k in e}
                    for e in events if e["kind"] == "standby_decision"],
        "preemptions": preemption_records(events, list(c.executions)),
        "lost_steps": sum(r.get("lost_steps", 0) for r in recs),
        "torn_tails_cut": [e for e in events if e["kind"] == "torn_tail_cut"],
        "accuracy_before": next((e["value"] for e in events if e["kind"] == "accuracy"), None),
        "accuracy_after": final.get("accuracy_after"),
        "eval_metric": "loss" if c.task == "causal-lm" else "accuracy",  # what accuracy_before/after hold
        "mean_step_seconds": mean_step_seconds(rows),
        "mean_log_append_seconds": sum(r["log_append_seconds"] for r in rows) / len(rows) if rows else None,
        "checkpoint_block_seconds_total": sum(block_s),
        "mean_checkpoint_block_seconds": sum(block_s) / len(block_s) if block_s else None,
        "worker_checkpoints": run_checkpoints(final.get("checkpoints"), c.executions, events),
        "worker_cpu_capability": final.get("cpu_capability"),
        **c.shadow,
        "worker_hashes": {str(r["step"] + 1): r["state_sha256"] for r in rows if "state_sha256" in r},
        "snapshots": {**c.persisted, **c.mirror},
        "final_snapshot": c.newest_snapshot[1] if c.newest_snapshot and final and c.newest_snapshot[0] == final.get("step") else None,
        "ray_train_checkpoint": c.ray_train_checkpoint,
        "durability": durability(c.durability_level, c.keeper, events) if c.keeper is not None else None,
        "replans": [e for e in events if e["kind"] == "replan"],
        "resumes": [e for e in events if e["kind"] == "resume"],
        "metrics": metric_coverage(c.keeper["end"], rows) if c.keeper is not None and "end" in c.keeper else None,
        **c.base,
    }


def failed_summary(error: str, shadow_shards: list[dict] | None, base: dict) -> dict:
    """The ``summary.json`` of a run that raised (pure): ``ok`` false, ``error`` (``<ErrorType>: message``),
    no final state or hashes, what is known of the shadow (``shadow_shards``: each shard's figures as
    last seen; None without a shadow), then ``base`` (``Collected.base``'s fields)."""
    return {"ok": False, "error": error, "final_step": None, "state_sha256": None, "shadow_equal": None,
            "bitwise_equal": None, "shadow_shards": shadow_shards, **base}


SUMMARY_FIELDS: dict[str, str] = {
    "ok": "Whether the run finished without an error (the exit code is 0 only when it did and, with ``--verify``, "
          "recovery was exact).",
    "error": "``<ErrorType>: message`` of a run that failed; null otherwise. Whatever fails inside a run (after the run "
             "directory is claimed), the driver still writes ``summary.json`` (``ok`` false, ``error``, ``phase`` "
             "``failed``), kills its shadow and persister, and exits 1.",
    "final_step": "The worker's last step (its ``final`` event); null for a failed run.",
    "state_sha256": "sha256 of the worker's final state.",
    "shadow_state_sha256": "sha256 of the shadow's final state (the assembled state with shards); null without a shadow.",
    "shadow_equal": "Whether the shadow's final state hash equals the worker's; null without a shadow.",
    "reference_state_sha256": "sha256 of the failure-free reference's final state (``--verify``; null without).",
    "bitwise_equal": "Whether the final state equals the failure-free reference's bit for bit (``--verify``; null without).",
    "failures": "The injected failures: ``[{step, target, how}]``.",
    "recoveries": "One entry per worker recovery (``recoveries``, below): ``at_step``, ``failure_step``, ``source`` "
                  "(``object_store`` | ``storage`` | ``initial``), ``path`` (``new_process``: Ray Train started a "
                  "replacement worker; ``in_process``: the worker's own process rolled back; ``standby``: a warm "
                  "standby executor took over), ``why`` (one line: why that path), ``seconds`` (failure to restored), ``restart_seconds`` (failure to the "
                  "restore beginning), ``load_seconds``, ``replay_seconds``, ``base_step``, ``replayed_steps``, "
                  "``recompute_steps``, ``breakdown`` (seconds per component from the failure to the first step done, "
                  "below; docs/recovery.md), ``first_step_seconds``.",
    "standby": "Each rank's warm standby decision (``workers.standby``; one entry without ``rank`` where the run keeps "
               "none, from the driver): ``keep``, ``reason`` (one line), and where measured ``saved_core_s`` and ``cost_core_s`` "
               "per failure (core-seconds, ``policies.standby.standby_decision``).",
    "preemptions": "One entry per preemption notice (a drained node that held a component; ``orchestrator.preemption."
                   "preemption_records``): ``node_id``, ``components``, ``notice_unix_s``, ``deadline_unix_s``, ``grace_s``, "
                   "``saved`` (``[{component, step, notice_to_safe_seconds}]``), ``unsaved`` (``[{component, error}]``), and "
                   "for a node with train workers ``restored_step`` and ``recomputed_steps``.",
    "lost_steps": "Durable steps that no recovery restored, summed over the recoveries (0 unless something durable was lost).",
    "torn_tails_cut": "The ``torn_tail_cut`` events: step-log appends cut short by a failure and cut off the log.",
    "accuracy_before": "Held-out accuracy before training (``eval_metric`` ``loss``: the held-out loss in nats per token).",
    "accuracy_after": "Held-out accuracy (or loss) after training.",
    "eval_metric": "What ``accuracy_before`` and ``accuracy_after`` hold: ``accuracy`` (classification) or ``loss`` (causal-lm).",
    "mean_step_seconds": "Mean step time without checkpointing, over the metric rows.",
    "mean_log_append_seconds": "Mean step-log append time (the loop blocked until the record is durable at ``--durability``).",
    "checkpoint_block_seconds_total": "Training-loop time blocked by checkpointing, summed over the steps.",
    "mean_checkpoint_block_seconds": "The same per step.",
    "worker_checkpoints": "Full-state and first-order strategies: the last worker incarnation's checkpointer, except "
                          "``bytes``: summed over the incarnations, the last one's in ``incarnation_bytes``; null otherwise.",
    "worker_cpu_capability": "The worker's torch CPU capability (``DEFAULT``, ``AVX2``, ...).",
    "shadow_replay_seconds_per_step": "The shadow's replay seconds per step (the slowest shard's).",
    "shadow_replay_over_step": "``shadow_replay_seconds_per_step`` over ``mean_step_seconds``: below 1 the shadow keeps up.",
    "shadow_max_lag_steps": "The most steps the shadow lagged behind the log.",
    "shadow_hashes": "The shadow's state sha256 per step (``--hash-every``; empty with shards: a shard holds part of the state).",
    "shadow_cpu_capability": "The shadow's torch CPU capability.",
    "shadow_shards": "Per shard: units, elements, replay seconds per step, replay over step, restarts, actor ids; null without a shadow.",
    "worker_hashes": "The worker's state sha256 after each hashed step (``--hash-every``), keyed by steps done.",
    "final_snapshot": "The committed snapshot of the final state (``<storage>/<folder>``), when the run's storage holds one "
                      "(null otherwise, e.g. a failed run or a strategy without snapshots): "
                      "``workers.own_loop.load_checkpoint(final_snapshot, model)`` loads it into your model in one call.",
    "ray_train_checkpoint": "Ray Train's ``Result.checkpoint`` of the run: ``path`` (a pointer checkpoint in Ray Train's storage, "
                            "``workers.train_reports``), the ``snapshot`` it points to and its ``step``; null when none was reported "
                            "(no snapshot committed). ``load_checkpoint(path, model)`` loads it. With a shadow, rank 0 has it snapshot the final "
                            "step before the last report (waiting up to 60 s): else ``final_snapshot`` may be newer.",
    "snapshots": "The persister's counts, bytes and last durable step, the storage circuit breaker's state (``storage``), "
                 "and the step log mirror's ``log_mirrored_steps``.",
    "durability": "The step log's level, the log keeper's node and rank 0's, ``node_held`` (``durability``, below); "
                  "null without a log keeper.",
    "replans": "The adaptive policy's re-plans (``replan`` events).",
    "resumes": "The ``resume`` events: one per ``raycheck run --resume``.",
    "metrics": "``missing_step_count`` and ``missing_steps`` (``[first, last]`` ranges): steps the step log holds without "
               "a metrics row, whose row was lost across Ctrl-C and ``--resume``; no timings are invented for them, "
               "and ``raycheck inspect`` names them too (``metric_coverage``, below).",
    "phase": "The controller's last state (``failed`` for a run that raised).",
    "algo": "``zo`` or ``fo``.",
    "strategy": "The checkpointing strategy.",
    "dtype": "The parameter dtype.",
    "shadow_restarts": "Restarts of the shadow (or its shards) by this driver; null without a shadow.",
    "persister_restarts": "Restarts of the snapshot persister by this driver.",
    "config_stored": "Whether the configuration is in the remote storage, so the run resumes from the bucket alone.",
    "snapshot_policy": "``fixed`` or ``adaptive`` (``--snapshot-policy``).",
    "storage_consistency": "``fenced``, or ``unfenced`` when ``--storage-consistency unfenced`` accepted a store without "
                           "conditional writes.",
    "wall_seconds": "The driver's wall time from its start to the summary, seconds (the failure-free reference that "
                    "``--verify`` runs afterwards not included: its own summary has its time).",
    "trajectory_sha256": "Hash of the settings that determine the trajectory (``job.config.JobConfig.trajectory_sha256``).",
    "placement": "Where each component ran: the policy, the driver, the persister, the shadow shards and the workers, "
                 "each with ``node_id`` and ``node_ip``.",
    "config": "The run's configuration (``config.json``'s nested form).",
}
"""Every top-level field of ``summary.json``, with what it holds: ``run_summary`` (and ``failed_summary``, a
subset) and the controller's ``Controller._summary_base`` and ``Controller._finish_shadow`` fields. The
summary reference of the documentation (docs/reference/summary.md) is written from this, and
tests/test_docs.py checks that it names exactly the fields the code writes."""
