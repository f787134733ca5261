"""The controller's side of the cost-model snapshot policy: measurements in, a frozen plan status out.

The decision itself is ``policies`` code (``AdaptiveInterval`` over a ``Replanner``); this module
only gathers what the running job measured (step time, shadow replay time per step, snapshot write
time, log-append time, restart and load times of recoveries, failures and elapsed time), feeds it,
and reports the plan as an ``orchestrator.control.PlanStatus``, from which ``orchestrator.control.step``
decides what the controller does.
"""

from __future__ import annotations

from typing import TypedDict

from raycheck.orchestrator.control import InfeasiblePlan, PlanStatus, worker_failures_and_recoveries
from raycheck.orchestrator.summary import recoveries
from raycheck.policies.costs import MeasuredCosts
from raycheck.policies.interval import AdaptiveInterval
from raycheck.policies.models import Strategy
from raycheck.policies.replan import ReplanRecord, Replanner

class _InitialCosts(TypedDict):
    step_s: float
    replay_step_s: float
    snapshot_s: float
    restart_s: float
    load_s: float


INITIAL_COSTS = _InitialCosts(step_s=5.0, replay_step_s=0.05, snapshot_s=5.0, restart_s=20.0, load_s=2.0)
"""Costs assumed until measured (seconds; about SmolLM2-135M on 2 CPU cores, with a replay time
small enough to be feasible for any step time). Each is replaced by its robust estimate after three
samples; the MTBF comes from the configuration and the failures seen."""


class SnapshotPlanner:
    """Feeds one run's measurements to an ``AdaptiveInterval`` and reports its re-plans.

    Args:
        mtbf_s: the job's assumed mean time between failures, seconds (updated by observed failures).
        cooldown_steps: minimum steps between two re-plans (hysteresis with the 20% threshold).
    """

    def __init__(self, mtbf_s: float, cooldown_steps: int = 5) -> None:
        costs = MeasuredCosts(mtbf_s=mtbf_s, **INITIAL_COSTS)
        self.policy = AdaptiveInterval(Replanner(costs, strategy=Strategy.SHADOW, cooldown_steps=cooldown_steps))
        self._recoveries_seen = 0
        self._elapsed_before_s = 0.0
        """Wall-clock seconds of the run's earlier drivers (``load_state_dict``): a resumed run's MTBF estimate
        counts the failure-free time before the resume too."""
        self.fed_through = -1
        """The newest step fed (``observe_rows``), -1 before the first: a resumed driver does not feed a step twice."""
        self.calibration_requested = False
        """Whether the calibration snapshot was taken (``orchestrator.control.TakeSnapshot``): once a run."""

    def state_dict(self) -> dict:
        """The measured costs, the interval in force and its re-plans, the recoveries counted, the newest
        step fed, whether the calibration snapshot was taken and the elapsed seconds: what ``load_state_dict``
        needs to go on where this planner stopped."""
        return {"policy": self.policy.state_dict(), "recoveries_seen": self._recoveries_seen,
                "elapsed_s": self.policy.replanner.elapsed_s, "fed_through": self.fed_through,
                "calibration_requested": self.calibration_requested}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state_dict``'s ``state`` (a resumed run): its estimates, interval and re-plans; later
        ``observe`` calls add their ``elapsed_s`` to the elapsed seconds saved."""
        self.policy.load_state_dict(state["policy"])
        self._recoveries_seen = state["recoveries_seen"]
        self._elapsed_before_s = state["elapsed_s"]
        self.fed_through = state.get("fed_through", -1)  # both absent in the state of a driver before they were saved
        self.calibration_requested = state.get("calibration_requested", True)

    def interval_at(self, step: int) -> int:
        """The interval planned once ``step`` was fed, in steps (the newest re-plan at or before it)."""
        return [r for r in self.policy.records if r.step <= step][-1].interval_steps

    @property
    def every_steps(self) -> int:
        return self.policy.every_steps

    @property
    def infeasible(self) -> str | None:
        """Why the plan is kept (``AdaptiveInterval.infeasible``), None while the measurements admit one."""
        return self.policy.infeasible

    def observe(self, step: int, metric: dict, shadow: dict, persister: dict, recoveries: list[dict],
                failures: int, elapsed_s: float) -> ReplanRecord | None:
        """One executed step's measurements (``elapsed_s``: seconds since this driver started); returns a
        re-plan when the interval changes."""
        measured = {
            "step_s": metric["step_seconds"],
            "log_append_s": metric["log_append_seconds"],
        }
        if shadow.get("replay_seconds_per_step"):
            measured["replay_step_s"] = shadow["replay_seconds_per_step"]
        if persister.get("written"):
            measured["snapshot_s"] = persister["write_seconds"] / (persister["written"] + persister["failed"])
        for rec in recoveries[self._recoveries_seen:]:  # each recovery is one sample
            measured["load_s"] = rec["load_seconds"]
            if "restart_seconds" in rec:
                measured["restart_s"] = rec["restart_seconds"]
        self._recoveries_seen = len(recoveries)
        return self.policy.observe(step, failures=failures, elapsed_s=self._elapsed_before_s + elapsed_s, **measured)

    def observe_rows(self, rows: list[dict], events: list[dict], shadow: dict, persister: dict, *, t_start: float,
                     in_force_steps: int) -> PlanStatus:
        """Feed the metric rows of steps not fed yet (``rows``: the run's ``metrics.jsonl`` rows, each with
        ``step``, ``step_seconds``, ``log_append_seconds``, ``unix_s``), with the shadow's and persister's
        last statuses, the run's events (its failures and recoveries) and ``t_start`` (this driver's start,
        unix seconds); returns the plan (``in_force_steps``: the shadow's interval), with the re-plans and
        infeasible spells of these steps."""
        failures, _ = worker_failures_and_recoveries(events)
        done = recoveries(events)
        replans: list[ReplanRecord] = []
        spells: list[InfeasiblePlan] = []
        for row in (r for r in rows if r["step"] > self.fed_through):
            feasible = self.infeasible is None
            record = self.observe(row["step"], row, shadow, persister, done, failures, elapsed_s=row["unix_s"] - t_start)
            replans += [record] if record is not None else []
            if feasible and self.infeasible:  # the first step of a spell, as the policy's warning
                spells.append(InfeasiblePlan(row["step"], self.every_steps, self.infeasible))
            self.fed_through = row["step"]
        return PlanStatus(step=self.fed_through, interval_steps=self.every_steps, in_force_steps=in_force_steps,
                          replans=tuple(replans), infeasible=tuple(spells), calibration_requested=self.calibration_requested,
                          snapshots_written=persister.get("written", 0))
