"""Ray metrics of a run, for cluster dashboards (Prometheus names ``ray_raycheck_*``).

Emitted by the controller (the driver process), which outlives every worker, shadow and persister
failure, so the series do not reset when those restart. Every series is tagged with the run id and
the checkpointing strategy. They appear on each node's metrics export port, in Ray's Prometheus
and Grafana setup (``ray metrics launch-prometheus``) and in the dashboard's Metrics view.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge

TAGS = ("run", "strategy")


class RunMetrics:
    """The series of one run. Call ``step`` per completed step, ``event`` per run event, and
    ``storage`` with the persister's status."""

    def __init__(self, run_id: str, strategy: str) -> None:
        self.tags = {"run": run_id, "strategy": strategy}
        self.steps = Counter("raycheck_steps", "Training steps completed.", tag_keys=TAGS)
        self.stall_s = Counter(
            "raycheck_checkpoint_stall_seconds",
            "Seconds the training loop was blocked by checkpointing (step-log appends, or full-state saves and staging copies).",
            tag_keys=TAGS,
        )
        self.failures = Counter("raycheck_failures_injected", "Failures injected, by target.", tag_keys=TAGS + ("target",))
        self.recoveries = Counter("raycheck_recoveries", "Worker recoveries, by source.", tag_keys=TAGS + ("source",))
        self.recovery_s = Gauge("raycheck_recovery_seconds", "Seconds from the last worker failure to its restored state.", tag_keys=TAGS)
        self.shadow_lag = Gauge("raycheck_shadow_lag_steps", "Logged steps the shadow has not replayed yet.", tag_keys=TAGS)
        self.log_lag = Gauge("raycheck_log_lag_steps", "Logged steps not yet mirrored to remote storage (0: local storage).", tag_keys=TAGS)
        self.snapshot_age = Gauge("raycheck_snapshot_age_steps", "Steps since the newest durable snapshot.", tag_keys=TAGS)
        self.bytes = Gauge("raycheck_snapshot_bytes_persisted", "Snapshot bytes persisted by this run.", tag_keys=TAGS)
        self.interval = Gauge("raycheck_snapshot_interval_steps", "The snapshot interval in force.", tag_keys=TAGS)

    def step(self, row: dict, shadow_lag: int, interval: int) -> None:
        self.steps.inc(1.0, tags=self.tags)
        if row["checkpoint_block_seconds"] > 0:  # a Counter takes positive increments only
            self.stall_s.inc(row["checkpoint_block_seconds"], tags=self.tags)
        self.shadow_lag.set(shadow_lag, tags=self.tags)
        self.interval.set(interval, tags=self.tags)

    def event(self, event: dict, recovery_seconds: float | None = None) -> None:
        if event["kind"] == "failure":
            self.failures.inc(1.0, tags={**self.tags, "target": event["target"]})
        elif event["kind"] == "recovery":
            self.recoveries.inc(1.0, tags={**self.tags, "source": event["source"]})
            if recovery_seconds is not None:
                self.recovery_s.set(recovery_seconds, tags=self.tags)

    def storage(self, persister: dict, log_end: int) -> None:
        self.bytes.set(persister["bytes_written"], tags=self.tags)
        durable = persister["last_durable_step"]
        self.snapshot_age.set(log_end - (durable or 0), tags=self.tags)
        self.log_lag.set(log_end - persister.get("log_mirrored_steps", log_end), tags=self.tags)
