"""The controller's side of the cost-model snapshot policy: measurements in, interval decisions out.

The decision itself is ``policies`` code (``AdaptiveInterval`` over a ``Replanner``); this module
only gathers what the running job measured (step time, shadow replay time per step, snapshot write
time, log-append time, restart and load times of recoveries, failures and elapsed time) and feeds it.
"""

from __future__ import annotations

from typing import TypedDict

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

    def state_dict(self) -> dict:
        """The measured costs, the interval in force and its re-plans, the recoveries counted and the
        elapsed seconds: what ``load_state_dict`` needs to go on where this planner stopped."""
        return {"policy": self.policy.state_dict(), "recoveries_seen": self._recoveries_seen,
                "elapsed_s": self.policy.replanner.elapsed_s}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state_dict``'s ``state`` (a resumed run): its estimates, interval and re-plans; later
        ``observe`` calls add their ``elapsed_s`` to the elapsed seconds saved."""
        self.policy.load_state_dict(state["policy"])
        self._recoveries_seen = state["recoveries_seen"]
        self._elapsed_before_s = state["elapsed_s"]

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
