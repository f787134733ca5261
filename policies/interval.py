"""Snapshot interval policies: pure decisions over step counts.

``snapshot_due`` is the one rule that decides whether a snapshot (or a worker checkpoint) is due;
``SnapshotSchedule`` applies it to a state that advances one step at a time (the shadow, the worker
checkpointers), and ``AdaptiveInterval`` follows a ``policies.replan.Replanner`` that keeps the
interval at the cost model's optimum for the costs measured while the job runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from raycheck.policies.replan import ReplanRecord, Replanner

log = logging.getLogger(__name__)


def snapshot_due(steps_done: int, last_snapshot_step: int, interval_steps: int) -> bool:
    """True when the state after ``steps_done`` steps should be snapshotted.

    A snapshot is due when the steps since the last snapshot reach the interval in force now:
    ``steps_done - last_snapshot_step >= interval_steps``. ``last_snapshot_step`` is the step of the
    last snapshot taken, or the step the state was restored from (durable by construction).
    Because the gap is measured against the current interval, a re-plan never lengthens the current
    gap beyond the new interval: a shorter interval that the gap already reaches makes a snapshot due
    at once, a longer one moves it to ``last_snapshot_step + interval_steps``. (A rule of multiples,
    ``steps_done % interval_steps == 0``, would move the target past the current step at each re-plan.)

    Args:
        steps_done: steps applied to the state (>= 0).
        last_snapshot_step: steps applied to the state when it was last snapshotted or restored.
        interval_steps: the interval in steps; 0 disables snapshots (log-only recovery).
    """
    return interval_steps > 0 and steps_done - last_snapshot_step >= interval_steps


@dataclass(kw_only=True)
class SnapshotSchedule:
    """``snapshot_due`` for one state that advances a step at a time, keeping its last snapshot step.

    Attributes:
        every_steps: the interval in force, steps (>= 0; 0: never); may change between steps (a re-plan).
        last_step: the step of the last snapshot taken, or of the restore; None: the step before the
            first one ``take_if_due`` sees (a loop that starts at step s starts from a state restored at s).

    Raises:
        ValueError: ``every_steps`` < 0 (also from ``set_interval``).
    """

    every_steps: int
    last_step: int | None = None

    def __post_init__(self) -> None:
        self.set_interval(self.every_steps)

    def set_interval(self, every_steps: int) -> None:
        """Follow a new interval (steps) from now on; the current gap counts against it."""
        if every_steps < 0:
            raise ValueError(f"every_steps must be >= 0, got {every_steps}")
        self.every_steps = every_steps

    def due(self, steps_done: int) -> bool:
        """True when a snapshot is due after ``steps_done`` steps (nothing counts as taken: a caller
        that cannot take it now asks again at the next step, when it is still due)."""
        if self.last_step is None:
            self.last_step = steps_done - 1
        return snapshot_due(steps_done, self.last_step, self.every_steps)

    def take_if_due(self, steps_done: int) -> bool:
        """True (and the snapshot counts as taken at ``steps_done``) when one is due after ``steps_done`` steps."""
        if not self.due(steps_done):
            return False
        self.last_step = steps_done
        return True

    def taken(self, step: int) -> None:
        """A snapshot of the state after ``step`` steps was taken outside the schedule (e.g. on demand)."""
        self.last_step = step


class AdaptiveInterval:
    """The interval in force (``every_steps``) is the re-planner's current plan; a ``SnapshotSchedule``
    follows it (``set_interval``), so snapshots fall by ``snapshot_due`` at each step's plan.

    Feed it with ``observe``; ``records`` lists the initial plan and every re-plan with its inputs
    (``ReplanRecord.to_dict()`` for metrics), and each re-plan is logged at INFO. ``infeasible`` is the
    reason the plan is kept while the measurements admit none (``policies.costs.InfeasibleError``'s
    message, e.g. a shadow that replays slower than a step), None while they do; the first observation of
    each such spell is logged at WARNING.
    """

    def __init__(self, replanner: Replanner) -> None:
        self.replanner = replanner
        self.records: list[ReplanRecord] = [replanner.first_record]
        self.infeasible: str | None = None

    @property
    def every_steps(self) -> int:
        """The interval in force, in steps."""
        return self.replanner.interval_steps

    def observe(self, step: int, *, failures: int | None = None, elapsed_s: float | None = None,
                **measurements: float) -> ReplanRecord | None:
        """Pass measurements (``policies.replan.MEASURED`` names, seconds) and the job's counters
        (failures so far, elapsed wall-clock seconds) at ``step``; returns the re-plan, if any.

        Raises:
            ValueError: an unknown measurement name or a negative value.
        """
        decision = self.replanner.update(step, measurements, failures=failures, elapsed_s=elapsed_s)
        if decision.infeasible and self.infeasible is None:
            log.warning("the snapshot interval stays at %d steps: %s", self.every_steps, decision.infeasible)
        self.infeasible = decision.infeasible
        if decision.record is not None:
            log.info("re-plan at step %d: %s; inputs %s", step, decision.record.reason, decision.record.inputs)
            self.records.append(decision.record)
        return decision.record

    def state_dict(self) -> dict[str, Any]:
        return {"replanner": self.replanner.state_dict(), "records": [r.to_dict() for r in self.records]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.replanner.load_state_dict(state["replanner"])
        self.records = [ReplanRecord(**r) for r in state["records"]]
