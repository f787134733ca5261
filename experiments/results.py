"""Raw experiment results from one run directory: a row for ``runs.parquet`` and rows for
``recoveries.parquet`` (the schema ``experiments.report`` reads).

Pure functions over a run's ``summary.json``, ``events.jsonl`` and ``metrics.jsonl`` (every
execution of every step, re-executions after a restart included), so they are tested without Ray.
All durations are seconds, sizes bytes, positions steps.
"""

from __future__ import annotations

import math
import statistics

from raycheck.orchestrator.summary import checkpoint_bytes
from raycheck.policies.strategies import RunStrategy
from raycheck.storage.steplog import RECORD_BYTES

LOG_STRATEGIES = ("shadow", "log-only")


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _step_start(row: dict) -> float:
    """Wall-clock start of the step a metric row describes (the row is written after the step)."""
    return row["unix_s"] - row["step_seconds"] - row["checkpoint_block_seconds"]


def run_row(summary: dict, executions: list[dict]) -> dict:
    """The ``runs.parquet`` row of one strategy run.

    ``executions``: every metric row of the run in time order (``metrics.jsonl``), so the checkpoint
    stalls of re-executed steps are counted too.
    """
    strategy = summary["strategy"]
    logged = strategy in LOG_STRATEGIES
    block = [r["checkpoint_block_seconds"] for r in executions]
    due = [r["checkpoint_block_seconds"] for r in executions if r.get("checkpoint_due")]
    worker = summary.get("worker_checkpoints") or {}
    persisted = summary.get("snapshots") or {}
    log_bytes = RECORD_BYTES * len(executions) if logged else 0
    appends = [r["log_append_seconds"] for r in executions] if logged else []
    if logged:
        snapshots = persisted.get("written", 0)
        snapshot_s = persisted["write_seconds"] / snapshots if snapshots else math.nan
        bytes_written = persisted.get("bytes_written", 0) + log_bytes
        per_checkpoint = _mean(appends)
        checkpoints = len(executions)
    else:
        snapshots = len(due)
        per_checkpoint = _mean(due)
        bytes_per = _incarnation_bytes(worker) / worker["checkpoints"] if worker.get("checkpoints") else math.nan
        bytes_written = round(bytes_per * snapshots) if snapshots else 0
        snapshot_s = per_checkpoint if strategy == "full-sync" else _mean(worker.get("write_seconds", []))
        checkpoints = snapshots
    recs = summary.get("recoveries", [])
    replayed = sum(r["replayed_steps"] for r in recs if r["source"] != "object_store")
    replay_step_s = summary.get("shadow_replay_seconds_per_step") if strategy == "shadow" else (
        sum(r["replay_seconds"] for r in recs) / replayed if strategy == "log-only" and replayed else math.nan)
    interval = summary["config"]["snapshot"]["every_steps"]
    if strategy == "shadow" and summary.get("replans"):
        interval = summary["replans"][-1]["interval_steps"]
    return {
        "run_id": summary["config"]["run_id"],
        "strategy": strategy,
        "model": summary["config"]["model"],
        "durability": summary["config"].get("durability", "") if logged else "",  # "": no step log, or results from before
        "steps": summary["config"]["steps"],
        "interval_steps": 0 if strategy == "log-only" else interval,
        "failures": sum(1 for f in summary["failures"] if f["target"] in ("worker", "both")),
        "bitwise_equal": bool(summary.get("bitwise_equal")),
        "wall_s": summary["wall_seconds"],
        "mean_step_s": summary["mean_step_seconds"],
        "block_s_total": sum(block),
        "block_s_per_step": _mean(block),
        "checkpoints": checkpoints,
        "snapshots": snapshots,
        "block_s_per_checkpoint": per_checkpoint,
        "bytes_written": int(bytes_written),
        "snapshot_s": snapshot_s,
        "stall_s": _mean(worker.get("stage_seconds", [])) if strategy == "full-async" else 0.0,
        "replay_step_s": replay_step_s if replay_step_s is not None else math.nan,
        "log_append_s": _mean(appends) if logged else 0.0,
        "log_append_median_s": statistics.median(appends) if appends else math.nan,
    }


def exact_by_design(summary: dict) -> bool:
    """Whether the run's strategy restores the very state it checkpointed: every first-order one but
    ``layerwise`` (a composite of units from different steps) and ``differential`` with top-k records."""
    config = summary["config"]
    if summary["strategy"] == RunStrategy.DIFFERENTIAL:
        return not (config.get("differential") or {}).get("topk")
    return summary["strategy"] != RunStrategy.LAYERWISE


def _incarnation_bytes(worker: dict) -> int:
    """The bytes the last worker incarnation's checkpointer wrote (``summary.json``'s ``worker_checkpoints``:
    ``incarnation_bytes``, or ``bytes`` in a summary from before the run's total went there)."""
    return int(worker.get("incarnation_bytes", worker.get("bytes", 0)))


def loss_deviation(executions: list[dict], reference: list[dict], from_step: int | None) -> dict:
    """The relative deviation of a run's per-step training loss from the failure-free reference's,
    (loss - reference) / reference at each step from ``from_step`` (the step the run's last recovery
    restored: every step after it ran on the trajectory the run ended on; None: no recovery, nothing
    compared) to the last, each step's loss from its last execution (the one the run continued from).
    Returns ``dev_from_step`` (-1 for None), ``dev_steps`` (steps compared), ``loss_dev_mean_abs`` and
    ``loss_dev_max_abs`` (fractions, NaN when none), ``first_deviating_step`` (the first step of the whole
    run whose last execution's loss differs from the reference's at all, -1: none: the run is on the
    reference's trajectory up to its last step), ``final_loss``, ``reference_final_loss`` and
    ``final_loss_dev`` (signed, at the last step). A single run's values are one sample each."""
    last = {r["step"]: r["loss"] for r in executions}
    ref = {r["step"]: r["loss"] for r in reference}
    steps = [s for s in sorted(last) if from_step is not None and s >= from_step and s in ref and ref[s]]
    devs = [abs(last[s] - ref[s]) / abs(ref[s]) for s in steps]
    final = max(last, default=None)
    final_ref = ref.get(final) if final is not None else None
    return {"dev_from_step": -1 if from_step is None else from_step, "dev_steps": len(steps),
            "loss_dev_mean_abs": _mean(devs), "loss_dev_max_abs": max(devs, default=math.nan),
            "first_deviating_step": next((s for s in sorted(last) if s in ref and last[s] != ref[s]), -1),
            "final_loss": last[final] if final is not None else math.nan,
            "reference_final_loss": final_ref if final_ref is not None else math.nan,
            "final_loss_dev": (last[final] - final_ref) / abs(final_ref) if final_ref else math.nan}


def fo_run_row(summary: dict, executions: list[dict], events: list[dict], reference: list[dict]) -> dict:
    """The ``runs.parquet`` row of one first-order strategy run (``raycheck experiment --algo fo``).

    ``executions``: every metric row in time order (re-executions included); ``events``: the run's
    ``events.jsonl``; ``reference``: the failure-free reference run's metric rows. Columns: the run
    (``strategy``, ``model``, ``steps``, ``interval_steps``, ``failures``, ``wall_s``, ``mean_step_s``),
    the loop stall (``block_s_total``: seconds blocked by checkpointing over every execution,
    ``compute_s_total``: their step seconds, ``block_share`` = the quotient, ``block_s_max``), bytes
    (``bytes_written``, ``orchestrator.summary.checkpoint_bytes``'s rule), exactness (``exact_by_design``, ``bitwise_equal``:
    the final state's sha256 against the reference's) and ``loss_deviation``'s columns from the
    last recovery's restored step.
    """
    block = [r["checkpoint_block_seconds"] for r in executions]
    compute = sum(r["step_seconds"] for r in executions)
    recoveries = [e for e in events if e["kind"] == "recovery"]
    config = summary["config"]
    return {
        "run_id": config["run_id"],
        "strategy": summary["strategy"],
        "algo": "fo",
        "model": config["model"],
        "steps": config["steps"],
        "interval_steps": config["snapshot"]["every_steps"],
        "failures": sum(1 for f in summary["failures"] if f["target"] in ("worker", "both")),
        "recoveries": len(recoveries),
        "exact_by_design": exact_by_design(summary),
        "bitwise_equal": bool(summary.get("bitwise_equal")),
        "wall_s": summary["wall_seconds"],
        "mean_step_s": summary["mean_step_seconds"],
        "compute_s_total": compute,
        "block_s_total": sum(block),
        "block_share": sum(block) / compute if compute > 0 else math.nan,
        "block_s_max": max(block, default=0.0),
        "bytes_written": checkpoint_bytes(executions, events, _incarnation_bytes(summary.get("worker_checkpoints") or {})),
        **loss_deviation(executions, reference, recoveries[-1]["restored_step"] if recoveries else None),
    }


def recovery_rows(summary: dict, events: list[dict], executions: list[dict]) -> list[dict]:
    """The ``recoveries.parquet`` rows of one run: for each worker recovery, the measured latency from
    the failure to the start of the first step that had not run before it (``latency_s``), and its
    parts: ``restart_s``, ``load_s``, ``replay_s`` (logged steps replayed) and ``recompute_s``
    (steps re-executed since the last checkpoint, up to the first new step); its ``path``
    (``in_process``: the failed process restored itself, ``training.in_process``; ``new_process``: Ray
    Train started a replacement, also for events of runs older than the warm path); and the recovery's
    breakdown (``breakdown_columns``) from ``summary.json``'s recoveries."""
    failures = [e for e in events if e["kind"] == "failure" and e["target"] == "worker"]
    recovered = [e for e in events if e["kind"] == "recovery"]
    summarised = summary.get("recoveries", [])  # one per recovery event, in the same order
    out = []
    for i, (failure, rec) in enumerate(zip(failures, recovered)):
        first_new = next((r for r in executions if r["step"] == failure["step"] and r["unix_s"] > rec["unix_s"]), None)
        if first_new is None:
            continue
        first_new_start = _step_start(first_new)
        out.append({
            "run_id": summary["config"]["run_id"],
            "strategy": summary["strategy"],
            "at_step": failure["step"],
            "restored_step": rec["restored_step"],
            "source": rec["source"],
            "path": rec.get("path", "new_process"),
            "latency_s": first_new_start - failure["unix_s"],
            "restart_s": rec["unix_s"] - rec["seconds"] - failure["unix_s"],  # detection, restart, model and data load
            "load_s": rec["load_seconds"],
            "replay_s": rec["replay_seconds"],
            "replayed_steps": rec["replayed_steps"],
            "recompute_s": max(0.0, first_new_start - rec["unix_s"]) if failure["step"] > rec["restored_step"] else 0.0,
            "recompute_steps": max(0, failure["step"] - rec["restored_step"]),
            **breakdown_columns(summarised[i] if i < len(summarised) else {}),
        })
    return out


def shard_rows(summary: dict) -> list[dict]:
    """The ``shards.parquet`` rows of one shadow run: per shard of its ``shadow_shards`` K, the units
    it holds, their elements, its replay seconds per step and that over the run's mean step time."""
    shards = summary.get("shadow_shards") or []
    return [{"run_id": summary["config"]["run_id"], "shards": len(shards), "shard": f["shard"], "units": f["units"],
             "elements": f["elements"], "replay_step_s": f["replay_seconds_per_step"], "replay_over_step": f["replay_over_step"],
             "shadow_equal": bool(summary.get("shadow_equal"))} for f in shards]


BREAKDOWN_PREFIX = "bd_"


def breakdown_columns(recovery: dict) -> dict:
    """The breakdown of one ``summary.json`` recovery (``orchestrator.summary.recoveries``) as columns:
    ``bd_<component>_s`` seconds each (e.g. ``bd_detection_s``), ``first_step_s`` (failure to the first
    step done); ``{}`` for a recovery without one."""
    if "breakdown" not in recovery:
        return {}
    return {**{BREAKDOWN_PREFIX + k: v for k, v in recovery["breakdown"].items()},
            "first_step_s": recovery["first_step_seconds"]}
