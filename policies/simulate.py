"""Discrete-event Monte Carlo simulation of a long run with failures, for any strategy and interval.

The simulated system is the one ``policies.models`` describes (see its module docstring), played
out event by event: failures (exponential or Weibull inter-arrival times in wall-clock seconds,
a renewal process started afresh with each run), recoveries that a failure restarts, steps,
snapshot captures and the moments snapshots become durable. Between two failures the schedule is
deterministic, so the simulator jumps from failure to failure and counts what completed in
between. For the shadow it follows the running code (``actors.shadow.ShadowLoop``): a snapshot is
taken when the shadow has replayed a multiple of k steps, and a failure that loses the shadow kills
the snapshot being written. The workers recover from the newest durable snapshot; the shadow then
restarts from it while training goes on, replays the log behind it (its lag shrinking by
1 - r / u steps per replayed step) and takes the snapshots it passes, late. Each failure loses
the shadow with probability ``MeasuredCosts.shadow_loss_fraction``; one that does not (a worker
alone) is recovered from the live image in restart + load + the replay of ``live_replay_steps``
or, while a restarted shadow is still behind, of its lag, while the shadow goes on replaying and
snapshotting.

Seeded: the i-th failure gap depends only on the seed, and so does whether the i-th failure loses
the shadow (a second stream, drawn only when the share is strictly between 0 and 1), so intervals
compared with one seed share their failures (common random numbers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from raycheck.policies.costs import MeasuredCosts
from raycheck.policies.models import Strategy, check_background, check_shadow


@dataclass(frozen=True, kw_only=True)
class Exponential:
    """Memoryless failures: exponential inter-arrival times (constant failure rate)."""

    def sample(self, rng: np.random.Generator, mean_s: float, size: int) -> np.ndarray:
        return rng.exponential(mean_s, size)


@dataclass(frozen=True, kw_only=True)
class Weibull:
    """Weibull inter-arrival times with the given mean; ``shape`` < 1 gives bursts of failures
    (infant mortality, as measured on large clusters), 1 is exponential."""

    shape: float

    def __post_init__(self) -> None:
        if not self.shape > 0:
            raise ValueError(f"shape must be > 0, got {self.shape!r}")

    def sample(self, rng: np.random.Generator, mean_s: float, size: int) -> np.ndarray:
        return mean_s / math.gamma(1 + 1 / self.shape) * rng.weibull(self.shape, size)


FailureModel = Exponential | Weibull


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """Totals over all simulated runs, in seconds."""

    strategy: Strategy
    interval_steps: int | None
    runs: int
    failures: int
    useful_s: float
    """Productive training: steps times ``step_s``."""
    wall_s: float
    """Wall-clock time of the runs, failures and recoveries included."""
    charged_s: float
    """Background snapshot seconds charged at ``background_weight``."""

    @property
    def waste_ratio(self) -> float:
        """Wasted seconds per productive second: the quantity ``policies.models`` predicts."""
        return (self.wall_s + self.charged_s - self.useful_s) / self.useful_s


class _Gaps:
    """The seeded stream of failure inter-arrival times, drawn in blocks."""

    def __init__(self, failures: FailureModel, mean_s: float, seed: int) -> None:
        self._failures, self._mean_s = failures, mean_s
        self._rng = np.random.default_rng(seed)
        self._block: list[float] = []

    def __call__(self) -> float:
        if not self._block:
            self._block = self._failures.sample(self._rng, self._mean_s, 4096).tolist()[::-1]
        return self._block.pop()


@dataclass
class _Run:
    """What one run adds up; a strategy's run function fills it in."""

    wall_s: float = 0.0
    charged_s: float = 0.0
    failures: int = 0


def _run_checkpoints(costs: MeasuredCosts, k: int, steps: int, gaps: _Gaps, asynchronous: bool) -> _Run:
    """Full-state checkpoints every k steps: each failure-free period yields the checkpoints that
    became durable in it; the next period restarts from the last of them."""
    blocking = costs.stall_s if asynchronous else costs.snapshot_s
    persist = costs.snapshot_s if asynchronous else 0.0
    charge = costs.background_weight * costs.snapshot_s if asynchronous else 0.0
    segment_s = k * costs.step_s + blocking
    run, done, offset = _Run(), 0, 0.0
    while True:
        gap, left = gaps(), steps - done
        checkpoints_left = math.ceil(left / k) - 1
        finish_s = offset + left * costs.step_s + checkpoints_left * blocking
        if gap >= finish_s:
            run.wall_s += finish_s
            run.charged_s += checkpoints_left * charge
            return run
        run.wall_s += gap
        run.failures += 1
        run.charged_s += max(0, math.floor((gap - offset) / segment_s)) * charge
        done += k * max(0, math.floor((gap - offset - persist) / segment_s))
        offset = costs.downtime_s


def _run_logged(costs: MeasuredCosts, k: int | None, steps: int, gaps: _Gaps, lost: Callable[[], bool]) -> _Run:
    """Every step logged; with k, a shadow snapshot every k steps (else log-only: replay from 0).

    Training resumes at time t from step n; the shadow has then replayed ``shadow`` <= n steps and
    replays step m > shadow by t + max((m - shadow) r, (m - n) u + r) (it replays in order, each step
    once it is logged), snapshotting the multiples of k it passes (durable S later). A failure for
    which ``lost()`` is false leaves the shadow alive: the recovery takes its image once it has
    replayed its lag (at least ``live_replay_steps``), and its snapshots in flight go on. One that
    loses it recovers the workers from the newest durable snapshot; the shadow restarts from that
    snapshot when training resumes and catches up while training goes on."""
    u, r, snap = costs.step_s + costs.log_append_s, costs.replay_step_s, costs.snapshot_s
    charge = costs.background_weight * snap
    run = _Run()
    t, next_fail = 0.0, gaps()
    n = durable = shadow = snapped = 0  # snapped: the last multiple of k the shadow has snapshotted
    pending: list[tuple[int, float]] = []  # (snapshot step, time it becomes durable)

    def replayed(at: float, upto: int) -> int:
        """Steps the shadow has replayed by time ``at`` (of the ``upto`` logged)."""
        behind = shadow + math.floor((at - t) / r)
        return min(upto, behind, max(n, n + math.floor((at - t - r) / u)))

    while True:
        finish = t + (steps - n) * u
        if next_fail >= finish:
            if k:
                run.charged_s += charge * ((steps - 1) // k - snapped // k)
            run.wall_s = finish
            return run
        failed_at = next_fail
        reached = n + math.floor((failed_at - t) / u)
        durable = max([durable] + [m for m, at in pending if at <= failed_at])
        shadow_lost = lost()
        if k and not shadow_lost:  # the shadow goes on replaying every logged step and snapshots on its grid
            taken = [(m, t + max((m - shadow) * r, (m - n) * u + r) + snap) for m in _multiples(k, snapped, reached)]
            run.charged_s += charge * len(taken)
            pending = [(m, at) for m, at in pending if at > failed_at] + taken
            snapped = reached // k * k
        elif k:  # the snapshots it took before it died count; the newest durable one is the restore point
            newest = replayed(failed_at, reached) // k * k
            run.charged_s += charge * (max(0, newest - snapped) // k)
            written = replayed(failed_at - snap, reached) // k * k
            if written > snapped:
                durable = max(durable, written)
        run.failures += 1
        next_fail = failed_at + gaps()
        while not shadow_lost:  # recovery from the live image; a failure restarts it (and may lose the shadow)
            behind = reached - shadow - math.floor((failed_at - t) / r)  # a restarted shadow's lag; <= 0 once caught up
            live_s = costs.downtime_s + max(costs.live_replay_steps, behind) * r
            if next_fail >= failed_at + live_s:
                t, n = failed_at + live_s, reached
                shadow = reached  # it has replayed the whole log by now
                break
            durable = max([durable] + [m for m, at in pending if at <= next_fail])
            failed_at = next_fail
            run.failures += 1
            next_fail = failed_at + gaps()
            shadow_lost = lost()
        if shadow_lost:
            pending = []  # the shadow is gone, and its snapshots in flight with it
            n, t = reached, failed_at
        while shadow_lost:  # recovery: restart, load the durable snapshot, replay to n; a failure restarts it
            end = t + costs.downtime_s + (n - durable) * r
            if next_fail >= end:
                t, shadow, snapped = end, durable, durable  # the shadow restarts from the snapshot, behind
                break
            t = next_fail
            run.failures += 1
            next_fail = t + gaps()


def _shadow_losses(share: float, seed: int) -> Callable[[], bool]:
    """Whether each failure in turn loses the shadow: always (share 1), never (0), else seeded draws."""
    if share >= 1 or share <= 0:
        return lambda: share >= 1
    rng = np.random.default_rng([seed, 1])
    return lambda: bool(rng.random() < share)


def _multiples(k: int | None, after: int, upto: int) -> range:
    """Multiples of k in (after, upto]; none without k."""
    return range((after // k + 1) * k, upto + 1, k) if k else range(0)


def simulate(strategy: Strategy, costs: MeasuredCosts, *, horizon_s: float, interval_steps: int | None = None,
             runs: int = 1, failures: FailureModel = Exponential(), seed: int = 0) -> SimResult:
    """Simulate ``runs`` runs of ``horizon_s`` seconds of productive training each.

    ``interval_steps`` is required for every strategy but log-only. For a steady-state estimate of
    an interval strategy use one long run (thousands of MTBFs); log-only depends on the run length,
    so use many runs of the length of interest.

    Raises:
        ValueError: a missing interval, or ``horizon_s``/``runs`` not positive.
        InfeasibleError: the strategy's constraints fail (as in ``policies.models``).
    """
    if not horizon_s > 0 or runs < 1:
        raise ValueError(f"horizon_s must be > 0 and runs >= 1, got {horizon_s!r}, {runs!r}")
    k: int | None = None
    if strategy is not Strategy.LOG_ONLY:
        if interval_steps is None:
            raise ValueError(f"{strategy} needs interval_steps")
        k = interval_steps
        if strategy is Strategy.SHADOW:
            check_shadow(costs, k)
        elif strategy is Strategy.FULL_ASYNC:
            check_background(costs, k)
        elif strategy is Strategy.FULL_SYNC and k < 1:
            raise ValueError(f"interval_steps must be >= 1, got {k}")
    steps = max(1, round(horizon_s / costs.step_s))
    gaps = _Gaps(failures, costs.mtbf_s, seed)
    lost = _shadow_losses(1.0 if strategy is Strategy.LOG_ONLY else costs.shadow_loss_fraction, seed)
    one_run: Callable[[], _Run]
    if strategy in (Strategy.FULL_SYNC, Strategy.FULL_ASYNC) and k is not None:  # k: set for both, checked above
        interval, asynchronous = k, strategy is Strategy.FULL_ASYNC
        one_run = lambda: _run_checkpoints(costs, interval, steps, gaps, asynchronous=asynchronous)  # noqa: E731
    else:  # log-only (k None) or shadow
        one_run = lambda: _run_logged(costs, k, steps, gaps, lost)  # noqa: E731
    done = [one_run() for _ in range(runs)]
    return SimResult(
        strategy=strategy, interval_steps=k, runs=runs, failures=sum(d.failures for d in done),
        useful_s=runs * steps * costs.step_s, wall_s=sum(d.wall_s for d in done),
        charged_s=sum(d.charged_s for d in done),
    )
