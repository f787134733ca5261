"""Snapshot interval policies: pure decisions over step counts.

``FixedInterval`` applies a number of steps chosen by hand; ``AdaptiveInterval`` follows a
``policies.replan.Replanner`` that keeps the interval at the cost model's optimum for the costs
measured while the job runs. Both answer ``due(step, last_snapshot_step)`` after each replayed step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from policies.replan import ReplanRecord, Replanner

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FixedInterval:
    """Snapshot every ``every_steps`` steps (0 disables snapshots: log-only recovery)."""

    every_steps: int

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps must be >= 0, got {self.every_steps}")

    def due(self, step: int, last_snapshot_step: int) -> bool:
        """True when the state after ``step`` steps should be snapshotted."""
        return self.every_steps > 0 and step > last_snapshot_step and step % self.every_steps == 0


class AdaptiveInterval:
    """Snapshot once ``every_steps`` steps have passed since the last snapshot, where
    ``every_steps`` is the re-planner's current plan.

    Feed it with ``observe``; ``records`` lists the initial plan and every re-plan with its inputs
    (``ReplanRecord.to_dict()`` for metrics), and each re-plan is logged at INFO.
    """

    def __init__(self, replanner: Replanner) -> None:
        self.replanner = replanner
        self.records: list[ReplanRecord] = [replanner.first_record]
        self._infeasible = False

    @property
    def every_steps(self) -> int:
        """The interval in force, in steps."""
        return self.replanner.interval_steps

    def due(self, step: int, last_snapshot_step: int) -> bool:
        """True when the state after ``step`` steps should be snapshotted."""
        return step - last_snapshot_step >= self.every_steps

    def observe(self, step: int, *, failures: int | None = None, elapsed_s: float | None = None,
                **measurements: float) -> ReplanRecord | None:
        """Pass measurements (``policies.replan.MEASURED`` names, seconds) and the job's counters
        (failures so far, elapsed wall-clock seconds) at ``step``; returns the re-plan, if any.

        Raises:
            ValueError: an unknown measurement name or a negative value.
        """
        decision = self.replanner.update(step, measurements, failures=failures, elapsed_s=elapsed_s)
        if decision.infeasible and not self._infeasible:
            log.warning("keeping the %d-step interval: %s", self.every_steps, decision.infeasible)
        self._infeasible = decision.infeasible is not None
        if decision.record is not None:
            log.info("re-plan at step %d: %s; inputs %s", step, decision.record.reason, decision.record.inputs)
            self.records.append(decision.record)
        return decision.record

    def state_dict(self) -> dict:
        return {"replanner": self.replanner.state_dict(), "records": [r.to_dict() for r in self.records]}

    def load_state_dict(self, state: dict) -> None:
        self.replanner.load_state_dict(state["replanner"])
        self.records = [ReplanRecord(**r) for r in state["records"]]
