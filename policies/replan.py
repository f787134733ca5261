"""Online re-planning: robust cost estimates from the running job, and an interval that follows them.

Pure decisions: the caller passes measurements and counters in (seconds, steps, failures) and
gets a decision back; nothing here reads clocks or counts events itself. State round-trips
through ``state_dict`` / ``load_state_dict`` (plain JSON-compatible values).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raycheck.policies.costs import InfeasibleError, MeasuredCosts
from raycheck.policies.models import Strategy, expected_waste, optimal_interval_steps

MEASURED = ("step_s", "replay_step_s", "snapshot_s", "stall_s", "log_append_s", "restart_s", "load_s")
"""The ``MeasuredCosts`` fields a running job can measure (seconds); the MTBF comes from counters."""


class RobustEwma:
    """Exponentially weighted mean of the median of the last ``window`` samples.

    The median drops isolated outliers (fewer than half the window: a GC pause, one slow write);
    the EWMA with weight ``alpha`` smooths what remains and follows a sustained change within
    about ``window / 2 + 1 / alpha`` samples.
    """

    def __init__(self, *, alpha: float = 0.2, window: int = 5) -> None:
        if not 0 < alpha <= 1 or window < 1:
            raise ValueError(f"alpha must be in (0, 1] and window >= 1, got {alpha!r}, {window!r}")
        self.alpha, self.window = alpha, window
        self.samples: list[float] = []
        self.value: float | None = None
        self.count = 0

    def update(self, sample: float) -> float:
        """Add one sample; returns the new estimate."""
        self.samples = (self.samples + [float(sample)])[-self.window:]
        median = statistics.median(self.samples)
        self.value = median if self.value is None else self.value + self.alpha * (median - self.value)
        self.count += 1
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"samples": list(self.samples), "value": self.value, "count": self.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.samples, self.value, self.count = list(state["samples"]), state["value"], state["count"]


@dataclass(frozen=True, kw_only=True)
class ReplanRecord:
    """One change of plan and the inputs it was computed from."""

    step: int
    previous_interval_steps: int | None
    interval_steps: int
    expected_waste_ratio: float
    reason: str
    inputs: dict[str, float]
    """The estimated ``MeasuredCosts`` fields (seconds) the plan was computed from."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The plan after one update: the interval, the record when it changed, and why the current
    estimates admit no plan (the previous plan is kept), if they do not."""

    interval_steps: int
    record: ReplanRecord | None = None
    infeasible: str | None = None


class Replanner:
    """Keeps the snapshot interval at the cost model's optimum for the estimated costs, with hysteresis.

    A new plan is adopted only when the optimum for the current estimates differs from the plan
    in force by more than ``threshold`` (relative), and at least ``cooldown_steps`` steps after
    the last change. Each measured cost is a ``RobustEwma``; it replaces the initial value once it
    has ``min_samples`` samples. The MTBF estimate is (prior_failures M0 + elapsed_s) /
    (prior_failures + failures): the initial MTBF M0 counts as ``prior_failures`` failures seen,
    so a short failure-free stretch does not send it to infinity.

    Raises (constructor):
        ValueError: bad thresholds. InfeasibleError: no plan for the initial costs.
    """

    def __init__(self, initial: MeasuredCosts, *, strategy: Strategy = Strategy.SHADOW, threshold: float = 0.2,
                 cooldown_steps: int = 0, min_samples: int = 3, prior_failures: float = 1.0,
                 alpha: float = 0.2, window: int = 5) -> None:
        if not threshold >= 0 or cooldown_steps < 0 or min_samples < 1 or not prior_failures > 0:
            raise ValueError(
                f"need threshold >= 0, cooldown_steps >= 0, min_samples >= 1, prior_failures > 0; got "
                f"{threshold!r}, {cooldown_steps!r}, {min_samples!r}, {prior_failures!r}"
            )
        self.initial, self.strategy = initial, Strategy(strategy)
        self.threshold, self.cooldown_steps, self.min_samples = threshold, cooldown_steps, min_samples
        self.prior_failures = prior_failures
        self.estimates = {name: RobustEwma(alpha=alpha, window=window) for name in MEASURED}
        self.failures, self.elapsed_s = 0, 0.0
        self.interval_steps = optimal_interval_steps(self.strategy, initial)
        self.last_change_step = 0
        self.first_record = self._record(0, None, self.interval_steps, initial, "initial plan from the configured costs")

    def estimated_costs(self) -> MeasuredCosts:
        """The initial costs with every well-sampled measurement and the MTBF estimate in place."""
        changes = {n: e.value for n, e in self.estimates.items() if e.count >= self.min_samples and e.value is not None}
        mtbf_s = (self.prior_failures * self.initial.mtbf_s + self.elapsed_s) / (self.prior_failures + self.failures)
        return self.initial.replace(**changes, mtbf_s=mtbf_s)

    def update(self, step: int, measurements: Mapping[str, float] | None = None, *,
               failures: int | None = None, elapsed_s: float | None = None) -> Decision:
        """Feed measurements (``MEASURED`` names, seconds) and the job's counters at ``step``:
        ``failures`` so far and ``elapsed_s`` of wall-clock time so far. Returns the plan.

        Raises:
            ValueError: an unknown measurement name, or a negative value.
        """
        for name, value in (measurements or {}).items():
            if name not in self.estimates:
                raise ValueError(f"unknown measurement {name!r}: expected one of {', '.join(MEASURED)}")
            if not value >= 0:
                raise ValueError(f"measurement {name} must be >= 0 seconds, got {value!r}")
            self.estimates[name].update(value)
        self.failures = self.failures if failures is None else failures
        self.elapsed_s = self.elapsed_s if elapsed_s is None else elapsed_s
        costs = self.estimated_costs()
        try:
            candidate = optimal_interval_steps(self.strategy, costs)
        except InfeasibleError as exc:
            return Decision(interval_steps=self.interval_steps, infeasible=str(exc))
        moved = abs(candidate - self.interval_steps) / self.interval_steps
        if moved <= self.threshold or step - self.last_change_step < self.cooldown_steps:
            return Decision(interval_steps=self.interval_steps)
        reason = f"the optimum moved {moved:.0%} (more than {self.threshold:.0%})"
        record = self._record(step, self.interval_steps, candidate, costs, reason)
        self.interval_steps, self.last_change_step = candidate, step
        return Decision(interval_steps=candidate, record=record)

    def _record(self, step: int, previous: int | None, interval: int, costs: MeasuredCosts, reason: str) -> ReplanRecord:
        waste = expected_waste(self.strategy, costs, interval_steps=interval)
        return ReplanRecord(step=step, previous_interval_steps=previous, interval_steps=interval,
                            expected_waste_ratio=waste, reason=reason, inputs=costs.to_dict())

    def state_dict(self) -> dict[str, Any]:
        return {
            "interval_steps": self.interval_steps,
            "last_change_step": self.last_change_step,
            "failures": self.failures,
            "elapsed_s": self.elapsed_s,
            "estimates": {n: e.state_dict() for n, e in self.estimates.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.interval_steps, self.last_change_step = state["interval_steps"], state["last_change_step"]
        self.failures, self.elapsed_s = state["failures"], state["elapsed_s"]
        for name, est in state["estimates"].items():
            self.estimates[name].load_state_dict(est)
