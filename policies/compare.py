"""Every strategy at its classical and its model-optimal interval, side by side, and the pick."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raycheck.policies.costs import InfeasibleError, MeasuredCosts
from raycheck.policies.models import (
    Strategy,
    checkfreq_interval_steps,
    daly_interval_s,
    expected_waste,
    optimal_interval_steps,
    steps_for,
    young_interval_s,
)

DAY_H = 24.0
MAX_WASTE_RATIO = 100.0
"""Above this expected waste ratio (the run would take more than 101 times as long as without
failures and snapshots; overhead above 10,000 %) an option counts as making no progress: it is
shown, never recommended."""


class NoProgressError(InfeasibleError):
    """No option makes progress (``MAX_WASTE_RATIO``) with these costs; the message names the best one."""


@dataclass(frozen=True, kw_only=True)
class Option:
    """One strategy at one interval rule, with its expected waste (None when infeasible)."""

    strategy: Strategy
    rule: str
    """How the interval was chosen: young, daly, checkfreq, optimal, or none (log-only)."""
    interval_steps: int | None
    step_s: float
    waste_ratio: float | None
    """Expected wasted seconds per productive second (``policies.models``)."""
    error: str | None = None

    @property
    def makes_progress(self) -> bool:
        """Feasible, with a waste ratio of at most ``MAX_WASTE_RATIO``."""
        return self.waste_ratio is not None and self.waste_ratio <= MAX_WASTE_RATIO

    @property
    def interval_s(self) -> float | None:
        return None if self.interval_steps is None else self.interval_steps * self.step_s

    @property
    def overhead_pct(self) -> float | None:
        return None if self.waste_ratio is None else 100 * self.waste_ratio

    @property
    def wasted_h_per_day(self) -> float | None:
        """Expected wasted hours in each day of wall-clock time: 24 w / (1 + w)."""
        w = self.waste_ratio
        return None if w is None else DAY_H if math.isinf(w) else DAY_H * w / (1 + w)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": str(self.strategy), "rule": self.rule, "interval_steps": self.interval_steps,
            "interval_s": self.interval_s, "waste_ratio": self.waste_ratio, "overhead_pct": self.overhead_pct,
            "wasted_h_per_day": self.wasted_h_per_day, "error": self.error,
        }


def _classical(rule: Callable[[float, float], float], costs: MeasuredCosts) -> int:
    """A classical rule's interval (C = ``snapshot_s``) in steps; 1 step when snapshots are free.

    Raises:
        InfeasibleError: the interval is too long to represent (C M overflows).
    """
    if costs.snapshot_s == 0:
        return 1
    interval_s = rule(costs.snapshot_s, costs.mtbf_s)
    if not math.isfinite(interval_s):
        raise InfeasibleError(f"a snapshot of {costs.snapshot_s:.3g} s with an MTBF of {costs.mtbf_s:.4g} s: the interval "
                              "overflows; a snapshot this slow never pays off")
    return steps_for(interval_s, costs.step_s)


def _option(strategy: Strategy, rule: str, costs: MeasuredCosts, choose: Callable[[], int | None], horizon_s: float) -> Option:
    try:
        k = choose()
        waste = expected_waste(strategy, costs, interval_steps=k, horizon_s=horizon_s)
    except InfeasibleError as exc:
        return Option(strategy=strategy, rule=rule, interval_steps=None, step_s=costs.step_s, waste_ratio=None, error=str(exc))
    return Option(strategy=strategy, rule=rule, interval_steps=k, step_s=costs.step_s, waste_ratio=waste)


def compare(costs: MeasuredCosts, *, horizon_s: float, max_overhead: float = 0.035) -> list[Option]:
    """The strategies at the intervals users pick today and at the model's optimum.

    Full sync at Young's and Daly's intervals (C = ``snapshot_s``); full async at the CheckFreq
    bound (``max_overhead``) and at its optimum; log-only over a run of ``horizon_s`` seconds of
    training; the shadow at Young's interval (C = ``snapshot_s``) and at its optimum.
    """
    def young() -> int:
        return _classical(young_interval_s, costs)

    choices = [
        (Strategy.FULL_SYNC, "young", young),
        (Strategy.FULL_SYNC, "daly", lambda: _classical(daly_interval_s, costs)),
        (Strategy.FULL_ASYNC, "checkfreq", lambda: checkfreq_interval_steps(costs, max_overhead)),
        (Strategy.FULL_ASYNC, "optimal", lambda: optimal_interval_steps(Strategy.FULL_ASYNC, costs)),
        (Strategy.LOG_ONLY, "none", lambda: None),
        (Strategy.SHADOW, "young", young),
        (Strategy.SHADOW, "optimal", lambda: optimal_interval_steps(Strategy.SHADOW, costs)),
    ]
    return [_option(strategy, rule, costs, choose, horizon_s) for strategy, rule, choose in choices]


def recommend(options: list[Option]) -> Option:
    """The option with the least expected waste among those that make progress (``Option.makes_progress``).

    Raises:
        NoProgressError: options are feasible but none makes progress (the message names the least
            wasteful one, its waste ratio, and what to change).
        InfeasibleError: no option is feasible (the errors of each are joined).
    """
    feasible = [(o.waste_ratio, i, o) for i, o in enumerate(options) if o.waste_ratio is not None]
    if not feasible:
        raise InfeasibleError("; ".join(f"{o.strategy}/{o.rule}: {o.error}" for o in options))
    best = min(feasible, key=lambda wio: wio[:2])[2]
    if not best.makes_progress:
        raise NoProgressError(
            f"no strategy makes progress with these costs: the least wasteful, {best.strategy}/{best.rule}, "
            f"expects {best.waste_ratio:.3g} wasted seconds per productive second (at most {MAX_WASTE_RATIO:g} "
            f"counts as progress): failures come before a recovery and the work after it can finish; make "
            f"failures rarer (a longer MTBF), or restarts, loads and snapshots faster")
    return best
