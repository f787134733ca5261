"""Turning a run's event and metric streams (the rows the driver received) into ``summary.json`` and ``metrics.parquet``."""

from __future__ import annotations

import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

METRIC_COLUMNS = ("step", "loss", "step_seconds", "checkpoint_block_seconds", "log_append_seconds", "shadow_lag_steps",
                  "snapshot_interval_steps")


def recoveries(events: list[dict]) -> list[dict]:
    """Each worker recovery with its timings (seconds) and the failure it answers.

    ``seconds``: failure to restored state; ``restart_seconds``: failure to the restore beginning
    (detection, process restart, model and data loading in the new worker);
    ``load_seconds``/``replay_seconds``: loading the base state and replaying the logged tail;
    ``lost_steps``: durable steps not restored (0 unless something durable was lost);
    ``recompute_steps``: steps that ran before the failure and must run again (the work lost after
    the last durable point; 0 with a step log); a sharded (fsdp2) restore adds ``saved_world_size``
    and ``restored_state_sha256`` (the loaded state, re-gathered).
    """
    out, last_failure = [], None
    for e in events:
        if e["kind"] == "failure" and e["target"] == "worker":
            last_failure = e
        elif e["kind"] == "recovery":
            row = {k: e[k] for k in ("at_step", "restored_step", "source", "base_step", "replayed_steps")}
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
            out.append(row)
    return out


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

