"""Ray metrics of a run, for cluster dashboards (Prometheus names ``ray_raycheck_*``).

Emitted by the controller (the driver process), which outlives every worker, shadow and persister
failure, so the series do not reset when those restart. Every series is tagged with the run id and
the checkpointing strategy. They appear on each node's metrics export port, in Ray's Prometheus
and Grafana setup (``ray metrics launch-prometheus``) and in the dashboard's Metrics view;
``docs/grafana/raycheck.json`` is a Grafana dashboard of them (it names only ``prometheus_names()``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ray.util.metrics import Counter, Gauge

from raycheck.orchestrator.summary import BREAKDOWN

TAGS = ("run", "strategy")


@dataclass(frozen=True)
class Series:
    """One series the controller emits: its Ray metric name, kind (``counter`` or ``gauge``),
    description and tag keys beyond ``TAGS``."""

    name: str
    kind: str
    description: str
    extra_tags: tuple[str, ...] = ()

    @property
    def prometheus_name(self) -> str:
        """The name Prometheus scrapes: Ray prefixes ``ray_``; a counter gets ``_total``."""
        return f"ray_{self.name}" + ("_total" if self.kind == "counter" else "")

    def make(self) -> Counter | Gauge:
        return (Counter if self.kind == "counter" else Gauge)(self.name, self.description, tag_keys=TAGS + self.extra_tags)


SERIES = (
    Series("raycheck_steps", "counter", "Training steps completed."),
    Series("raycheck_checkpoint_stall_seconds", "counter",
           "Seconds the training loop was blocked by checkpointing (step-log appends, or full-state saves and staging copies)."),
    Series("raycheck_failures_injected", "counter", "Failures injected, by target.", ("target",)),
    Series("raycheck_recoveries", "counter", "Worker recoveries, by source.", ("source",)),
    Series("raycheck_recovery_seconds", "gauge", "Seconds from the last worker failure to its restored state."),
    Series("raycheck_recovery_first_step_seconds", "gauge",
           "Seconds from the last worker failure to the first step done after its restore."),
    Series("raycheck_recovery_component_seconds", "gauge",
           "Seconds of each component of the last worker recovery (orchestrator.summary.BREAKDOWN), by component.",
           ("component",)),
    Series("raycheck_shadow_lag_steps", "gauge", "Logged steps the shadow has not replayed yet."),
    Series("raycheck_log_lag_steps", "gauge", "Logged steps not yet mirrored to remote storage (0: local storage)."),
    Series("raycheck_snapshot_age_steps", "gauge", "Steps since the newest durable snapshot."),
    Series("raycheck_snapshot_bytes_persisted", "gauge", "Snapshot bytes persisted by this run."),
    Series("raycheck_snapshot_interval_steps", "gauge", "The snapshot interval in force."),
)
"""Every series ``RunMetrics`` emits (the Grafana dashboard's test checks its queries against these)."""


def prometheus_names() -> set[str]:
    """The Prometheus names of ``SERIES``."""
    return {s.prometheus_name for s in SERIES}


class RunMetrics:
    """The series of one run. Call ``step`` per completed step, ``event`` per run event, ``recoveries``
    with the run's recoveries so far, and ``storage`` with the persister's status."""

    def __init__(self, run_id: str, strategy: str) -> None:
        self.tags = {"run": run_id, "strategy": strategy}
        self.series = {s.name.removeprefix("raycheck_"): s.make() for s in SERIES}
        self.recoveries_emitted = 0

    def _set(self, name: str, value: float, **tags) -> None:
        series = self.series[name]
        if not isinstance(series, Gauge):
            raise TypeError(f"{name} is a counter: it is incremented, not set")
        series.set(value, tags={**self.tags, **tags})

    def _inc(self, name: str, value: float, **tags) -> None:
        series = self.series[name]
        if not isinstance(series, Counter):
            raise TypeError(f"{name} is a gauge: it is set, not incremented")
        series.inc(value, tags={**self.tags, **tags})

    def step(self, row: dict, shadow_lag: int, interval: int) -> None:
        self._inc("steps", 1.0)
        if row["checkpoint_block_seconds"] > 0:  # a Counter takes positive increments only
            self._inc("checkpoint_stall_seconds", row["checkpoint_block_seconds"])
        self._set("shadow_lag_steps", shadow_lag)
        self._set("snapshot_interval_steps", interval)

    def event(self, event: dict, recovery_seconds: float | None = None) -> None:
        if event["kind"] == "failure":
            self._inc("failures_injected", 1.0, target=event["target"])
        elif event["kind"] == "recovery":
            self._inc("recoveries", 1.0, source=event["source"])
            if recovery_seconds is not None:
                self._set("recovery_seconds", recovery_seconds)

    def recoveries(self, rows: list[dict]) -> None:
        """Set the breakdown gauges from each recovery row (``orchestrator.summary.recoveries``) not yet
        emitted, in order, once its breakdown is complete: its first step is done, or a later recovery
        came (its worker failed before). A component of ``BREAKDOWN`` the row does not have is set to 0
        (an in-process restart has no Ray Train or process-start component), so the gauges are the last
        recovery's."""
        for i, row in enumerate(rows[self.recoveries_emitted:], start=self.recoveries_emitted):
            if "breakdown" in row and row["first_step_seconds"] is None and i == len(rows) - 1:
                return
            if "breakdown" in row:  # the components it did not have (an in-process restart's Ray Train ones) took 0 s
                for component, seconds in {**dict.fromkeys((part for _, part in BREAKDOWN), 0.0), **row["breakdown"]}.items():
                    self._set("recovery_component_seconds", seconds, component=component.removesuffix("_s"))
            if row.get("first_step_seconds") is not None:
                self._set("recovery_first_step_seconds", row["first_step_seconds"])
            self.recoveries_emitted += 1

    def storage(self, persister: dict, log_end: int) -> None:
        self._set("snapshot_bytes_persisted", persister["bytes_written"])
        durable = persister["last_durable_step"]
        self._set("snapshot_age_steps", log_end - (durable or 0))
        self._set("log_lag_steps", log_end - persister.get("log_mirrored_steps", log_end))
