"""Snapshot-interval formulas and the expected wasted time of each recovery strategy, in closed form.

Intervals are in seconds (``_s``) or training steps (``_steps``). Waste is a ratio: expected wasted
wall-clock seconds per second of productive training (0.05 means the run takes 5% longer than a
failure-free, checkpoint-free run), with background snapshot seconds charged at
``MeasuredCosts.background_weight``.

Failure model shared by every formula here and by ``policies.simulate``: failures arrive as a
Poisson process of rate lambda = 1/M in wall-clock time (the exact results below hold for
exponential inter-arrival times); a failure kills the job's processes, including the shadow and
any snapshot still being written, except that for the shadow a share 1 - p of the failures
(``MeasuredCosts.shadow_loss_fraction`` = p) leave the shadow alive: those take its live image and
replay only ``live_replay_steps``. Recovery costs D = restart_s + load_s plus any replay, and a
failure during recovery starts the recovery again. The building block, used throughout: the
expected wall-clock time until a window of w seconds passes without a failure is
(e^(lambda w) - 1) / lambda (Daly 2006, the complete cost model).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import StrEnum

from raycheck.policies.costs import InfeasibleError, MeasuredCosts
from raycheck.policies.strategies import RunStrategy


class Strategy(StrEnum):
    """How a job makes its progress durable: the run strategies (``policies.strategies.RunStrategy``,
    the same values) that this cost model has a closed form for. An enum of its own, not the run's:
    a strategy here has a waste model, and reading results accepts these only."""

    FULL_SYNC = RunStrategy.FULL_SYNC.value
    """Training stops while a full-state checkpoint is written; lost work is recomputed."""
    FULL_ASYNC = RunStrategy.FULL_ASYNC.value
    """Training stalls for a staging copy; the write runs in the background."""
    LOG_ONLY = RunStrategy.LOG_ONLY.value
    """Every step is logged; recovery replays the whole log from the initial weights."""
    SHADOW = RunStrategy.SHADOW.value
    """Every step is logged; a CPU shadow replays it and snapshots every k steps (ZOCheck)."""


INTERVAL_STRATEGIES = (Strategy.FULL_SYNC, Strategy.FULL_ASYNC, Strategy.SHADOW)


def _exp(x: float) -> float:
    """e^x, or inf where it overflows a float (x > ~709.78): a waste that large is never chosen."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _expm1(x: float) -> float:
    """e^x - 1, or inf where it overflows a float."""
    try:
        return math.expm1(x)
    except OverflowError:
        return math.inf


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0 or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number > 0 seconds, got {value!r}")


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum compute time between checkpoints, in seconds.

    Source: J. W. Young, "A first order approximation to the optimum checkpoint interval",
    CACM 17(9), 1974: T = sqrt(2 C M). Derivation: per interval T the checkpoint costs C and a
    failure (probability about T / M) loses T / 2 on average, so the waste rate is
    C / T + T / (2 M), minimal where its derivative -C / T^2 + 1 / (2 M) vanishes.

    Raises:
        ValueError: ``checkpoint_s`` or ``mtbf_s`` is not > 0.
    """
    _positive(checkpoint_s=checkpoint_s, mtbf_s=mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints, in seconds.

    Source: J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
    dumps", Future Generation Computer Systems 22(3), 2006, its higher-order estimate of tau_opt:
    T = sqrt(2 C M) [1 + (1/3) sqrt(C / (2M)) + (1/9) (C / (2M))] - C for C < 2M, and T = M
    otherwise. It approximates the minimiser of the exact exponential-failure wall time
    M e^(R/M) (e^((T + C)/M) - 1) T_s / T (``waste_full_sync``) to second order in sqrt(C / M).
    Daly's examples: M = 24 h, C = 5 min gives about 117 min; M = 6 h, 57 min; M = 15 min, 9.1 min.

    Raises:
        ValueError: ``checkpoint_s`` or ``mtbf_s`` is not > 0.
    """
    _positive(checkpoint_s=checkpoint_s, mtbf_s=mtbf_s)
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def steps_for(interval_s: float, step_s: float) -> int:
    """The whole number of steps (at least 1) closest to ``interval_s`` seconds of training."""
    return max(1, round(interval_s / step_s))


def min_background_steps(costs: MeasuredCosts) -> int:
    """The shortest interval, in steps, in which a background snapshot finishes before the next is
    due: ceil(snapshot_s / step_s), at least 1."""
    return max(1, math.ceil(costs.snapshot_s / costs.step_s - 1e-9))


def search_bound_steps(costs: MeasuredCosts) -> int:
    """The longest interval the model considers, in steps: 50 MTBFs of training (at most 5e13 steps, since
    ``MeasuredCosts`` takes at most ``MAX_MTBF_STEPS``)."""
    return math.ceil(50 * costs.mtbf_s / costs.step_s)


def check_background(costs: MeasuredCosts, interval_steps: int) -> None:
    """Raise unless a background snapshot (``snapshot_s``) fits in ``interval_steps`` steps.

    Raises:
        InfeasibleError: snapshots would queue up without bound; says the smallest interval.
    """
    if interval_steps < 1:
        raise InfeasibleError(f"interval_steps must be >= 1, got {interval_steps}")
    if costs.snapshot_s > interval_steps * costs.step_s:
        raise InfeasibleError(
            f"a snapshot takes snapshot_s={costs.snapshot_s:g} s but one is due every {interval_steps} steps "
            f"x step_s={costs.step_s:g} s = {interval_steps * costs.step_s:g} s: it would not finish before the next; "
            f"snapshot every >= {min_background_steps(costs)} steps, or make snapshots faster"
        )


def check_shadow(costs: MeasuredCosts, interval_steps: int | None = None) -> None:
    """Raise unless the shadow keeps up with training (and, given an interval, its snapshots fit).

    Raises:
        InfeasibleError: ``replay_step_s >= step_s`` (the shadow's lag grows without bound), or a
            snapshot does not finish within ``interval_steps`` steps.
    """
    if costs.replay_step_s >= costs.step_s:
        raise InfeasibleError(
            f"the shadow replays a step in replay_step_s={costs.replay_step_s:g} s but training takes "
            f"step_s={costs.step_s:g} s: its lag grows without bound; make replay faster than a step "
            f"(fused replay, a sharded shadow on more CPUs) or use full-async snapshots"
        )
    if interval_steps is not None:
        check_background(costs, interval_steps)


def checkfreq_interval_steps(costs: MeasuredCosts, max_overhead: float = 0.035) -> int:
    """CheckFreq-style interval: the most frequent asynchronous snapshots whose overhead stays under a bound.

    Source: J. Mohan, A. Phanishayee, V. Chidambaram, "CheckFreq: Frequent, Fine-Grained DNN
    Checkpointing", FAST'21, its checkpoint-frequency policy: choose the frequency from profiled
    iteration and checkpoint times so that the overhead stays under a target p (3.5% there), and
    never start a checkpoint before the previous persist is done. CheckFreq measures the overhead
    as the iterations' slowdown, which includes the persist's interference; here a snapshot costs
    its stall c plus the charged background time w P, so (c + w P) / (k step_s) <= p gives
    k >= (c + w P) / (p step_s); the persist must also fit in k steps, k >= P / step_s.

    Raises:
        ValueError: ``max_overhead`` not in (0, 1).
    """
    if not 0 < max_overhead < 1:
        raise ValueError(f"max_overhead must be in (0, 1), e.g. 0.035 for 3.5%, got {max_overhead!r}")
    per_snapshot_s = costs.stall_s + costs.background_weight * costs.snapshot_s
    return max(math.ceil(per_snapshot_s / (max_overhead * costs.step_s) - 1e-9), min_background_steps(costs))


def shadow_interval_steps(costs: MeasuredCosts) -> int:
    """The shadow-snapshot model's first-order optimum interval, in steps.

    Source: ZOCheck (arXiv 2026), CPU-shadow checkpointing; its cost model as ``docs/algorithms.md`` states it.
    With step time t_s, replay time per step r, snapshot cost S charged at weight w, failure rate
    lambda: a snapshot every k steps costs w S / (k t_s) per unit of training time, and a failure
    that loses the shadow (a share p, ``shadow_loss_fraction``) costs on average (k / 2) r of replay
    plus restart and load. The sum is minimal at k* = sqrt(2 w S / (lambda p r t_s)); with r = t_s,
    w = 1 and p = 1 this is Young's interval. With p = 0 no failure needs a snapshot: k* is the bound
    ``optimal_interval_steps`` searches up to, ``search_bound_steps``. The result is raised to
    ``min_background_steps`` so that a snapshot finishes before the next is due.

    Raises:
        InfeasibleError: ``replay_step_s >= step_s``.
    """
    check_shadow(costs)
    charged = 2 * costs.background_weight * costs.snapshot_s * costs.mtbf_s
    replayed = costs.shadow_loss_fraction * costs.replay_step_s * costs.step_s
    if charged == 0:  # snapshots cost the loop nothing: as often as a write can finish
        return min_background_steps(costs)
    k = search_bound_steps(costs) if replayed == 0 else math.sqrt(charged / replayed)
    return max(round(k), min_background_steps(costs))


def differential_full_interval_steps(costs: MeasuredCosts, batch_steps: int = 1) -> int:
    """First-order optimum interval, in steps, between the full checkpoints of a differential scheme.

    Differential checkpoints (LowDiff, SC'25, arXiv:2509.04084, which tunes its checkpoint frequency and
    batching size while training; Check-N-Run, Eisenman et al., NSDI'22) persist every step's
    gradient record and a full checkpoint every k steps; recovery loads the newest full checkpoint and
    replays the records after it. This first-order model is ours: Young's argument (CACM 1974) with
    the replay in place of the recompute: a full checkpoint costs its stall c plus the charged background write w P once per
    k t_s seconds of training, and a failure replays on average k / 2 records at r each, so the waste
    rate c + w P over k t_s plus lambda (k / 2) r is minimal at k* = sqrt(2 (c + w P) M / (r t_s)).
    (The records' own per-step cost and the up to ``batch_steps`` - 1 unbatched steps a failure loses
    do not depend on k.) The result is raised to ``min_background_steps`` (a full write finishes before
    the next is due) and rounded to a multiple of ``batch_steps`` (records still pending at a full
    checkpoint are superseded by it, so other multiples would write them for nothing).

    Args:
        costs: ``step_s`` (t_s), ``replay_step_s`` (r: replaying one record: read, decode, one optimizer
            step), ``stall_s`` (c: the full checkpoint's staging copy), ``snapshot_s`` (P: its background
            write), ``background_weight`` (w), ``mtbf_s`` (M); seconds.
        batch_steps: records per written object (>= 1).

    Raises:
        ValueError: ``batch_steps`` < 1.
    """
    if batch_steps < 1:
        raise ValueError(f"batch_steps must be >= 1, got {batch_steps}")
    per_full_s = costs.stall_s + costs.background_weight * costs.snapshot_s
    k = math.sqrt(2 * per_full_s * costs.mtbf_s / (costs.replay_step_s * costs.step_s))
    return max(round(k / batch_steps), math.ceil(min_background_steps(costs) / batch_steps)) * batch_steps


def waste_full_sync(costs: MeasuredCosts, interval_steps: int) -> float:
    """Expected waste ratio of synchronous full-state checkpoints every ``interval_steps`` steps.

    Source: Daly 2006 (FGCS 22), the complete model's wall time, exact for exponential failures. A segment is tau =
    k step_s of training followed by the blocking checkpoint C = ``snapshot_s``; a failure loses
    the segment in progress. Completing one segment needs a failure-free window of a = tau + C;
    after a failure also D before it, so (building block) each durable segment takes
    e^(lambda D) (e^(lambda a) - 1) / lambda seconds on average, and
    waste = e^(lambda D) (e^(lambda a) - 1) / (lambda tau) - 1.
    """
    lam, tau = costs.failure_rate_per_s, interval_steps * costs.step_s
    return _exp(lam * costs.downtime_s) * _expm1(lam * (tau + costs.snapshot_s)) / (lam * tau) - 1


def waste_full_async(costs: MeasuredCosts, interval_steps: int) -> float:
    """Expected waste ratio of asynchronous full-state snapshots every ``interval_steps`` steps.

    Derivation (renewal-reward over failure-free periods, exact for exponential failures; the
    model of CheckFreq, FAST'21, with the persist latency of Daly's framework): each segment is
    tau = k step_s of training and a stall c = ``stall_s``, a = tau + c; the snapshot taken at a
    segment's end is durable P = ``snapshot_s`` later. From a restart the i-th snapshot is durable
    at D + i a + P, so a failure-free period X yields tau floor((X - D - P) / a)^+ of durable
    work; for exponential X, E[floor((X - b) / a)^+] = e^(-lambda (b + a)) / (1 - e^(-lambda a)).
    The period starts floor((X - D) / a)^+ background writes, each charged w P. Dividing the
    expected period M plus the charge by the expected durable work:
    waste = (1 - e^(-lambda a)) e^(lambda (D + P + a)) / (lambda tau) + w P e^(lambda P) / tau - 1.

    Raises:
        InfeasibleError: a persist does not finish within the interval.
    """
    check_background(costs, interval_steps)
    lam, tau, p = costs.failure_rate_per_s, interval_steps * costs.step_s, costs.snapshot_s
    a = tau + costs.stall_s
    durable = -math.expm1(-lam * a) * _exp(lam * (costs.downtime_s + p + a)) / (lam * tau)
    return durable + costs.background_weight * p * _exp(lam * p) / tau - 1


def _log_based_waste(costs: MeasuredCosts, mean_exp_replay: float, charge_per_step_s: float) -> float:
    """Waste ratio of a strategy that logs every step and replays j steps after a failure.

    Each step takes u = step_s + log_append_s and needs a failure-free window of u: per completed
    step, (e^(lambda u) - 1) / lambda seconds of training and e^(lambda u) - 1 failures, each
    followed by a recovery that needs a failure-free window of D + j r, i.e.
    (e^(lambda (D + j r)) - 1) / lambda seconds. Summed, the seconds per completed step are
    (e^(lambda u) - 1) e^(lambda D) E[e^(lambda r j)] / lambda plus the charged background time.
    """
    lam = costs.failure_rate_per_s
    u = costs.step_s + costs.log_append_s
    per_step = _expm1(lam * u) * _exp(lam * costs.downtime_s) * mean_exp_replay / lam + charge_per_step_s
    return per_step / costs.step_s - 1


def _mean_exp(q: float, n: int) -> float:
    """(1/n) sum_{i<n} e^(q i), the mean of e^(q j) for j uniform on 0..n-1; inf once e^(q n) would
    overflow a float (the replay then outlasts any failure-free stretch: no progress)."""
    if not q > 0:
        return 1.0
    total = _expm1(q * n)  # finite only for q n < ~709.78, and then so is e^q - 1 (n >= 1)
    return total / (n * math.expm1(q)) if total < math.inf else math.inf


def waste_log_only(costs: MeasuredCosts, horizon_s: float) -> float:
    """Expected waste ratio of log-only recovery over a run of ``horizon_s`` seconds of training.

    Derivation (ZOCheck's log replay without snapshots; exact for exponential failures): a failure
    during step n + 1 replays all n logged steps from the initial weights, j = n. Every step index
    sees the same expected number of failures, so over N = horizon_s / step_s steps j is uniform on
    0..N-1 and E[e^(lambda r j)] = (e^(lambda r N) - 1) / (N (e^(lambda r) - 1)) in
    ``_log_based_waste``. The waste grows with the run: nothing bounds the replay.

    Raises:
        ValueError: ``horizon_s`` is not > 0.
    """
    _positive(horizon_s=horizon_s)
    n = max(1, round(horizon_s / costs.step_s))
    return _log_based_waste(costs, _mean_exp(costs.failure_rate_per_s * costs.replay_step_s, n), 0.0)


def shadow_lag_s(costs: MeasuredCosts) -> float:
    """Seconds after step k*m is logged until its snapshot is durable: replay it, then write it."""
    return costs.replay_step_s + costs.snapshot_s


def waste_shadow(costs: MeasuredCosts, interval_steps: int) -> float:
    """Expected waste ratio of the CPU shadow with a snapshot every ``interval_steps`` steps.

    Source: ZOCheck (arXiv 2026) and the shadow model of ``docs/algorithms.md``, taken to exponential failures
    exactly except for the snapshot's durability lag, which is averaged (error of order lambda
    times that lag), and for a failure during a recovery, which repeats the recovery of the first one.
    A failure that loses the shadow (a share p, ``shadow_loss_fraction``) at phase phi of the k-step
    cycle (phi uniform on [0, k u)) replays j = floor(phi / u) steps from the last snapshot, plus k more
    when phi falls in the first delta = r + S seconds after a snapshot step, before that snapshot is
    durable; a snapshot lost that way is written again during recovery (charged once more). So
    E_lost[e^(lambda r j)] = (1/k) sum_{i<k} e^(lambda r i)
                             + (e^(lambda r k) - 1) / (k u) integral_0^delta e^(lambda r floor(phi/u)) dphi.
    A failure that leaves the shadow alive replays j = ``live_replay_steps`` (its image is live; its
    snapshots in flight survive), so E[e^(lambda r j)] = p E_lost + (1 - p) e^(lambda r j_live); the
    charge per step is w S (1/k + p (e^(lambda u) - 1) min(S, k u) / (k u)), and ``_log_based_waste``
    does the rest. To first order in lambda this is ``docs/algorithms.md``'s
    w S / (k t_s) + lambda (D + p (k / 2) r + (1 - p) j_live r), minimal at ``shadow_interval_steps``.

    Raises:
        InfeasibleError: the shadow does not keep up, or a snapshot does not fit in the interval.
    """
    check_shadow(costs, interval_steps)
    lam, k, r, p = costs.failure_rate_per_s, interval_steps, costs.replay_step_s, costs.shadow_loss_fraction
    u = costs.step_s + costs.log_append_s
    q = lam * r
    mean_exp = (1 - p) * _exp(q * costs.live_replay_steps) if p < 1 else 0.0  # (a term of weight 0 may be inf)
    lost_write = 0.0
    if p > 0:
        delta = min(shadow_lag_s(costs), k * u)
        whole = math.floor(delta / u)
        rest = delta - whole * u  # 0 when the lag is whole steps: then e^(q whole) may be inf, and 0 x inf is nan
        lag_integral = u * whole * _mean_exp(q, whole) + (rest * _exp(q * whole) if rest > 0 else 0.0) if whole else delta
        mean_exp += p * (_mean_exp(q, k) + _expm1(q * k) * lag_integral / (k * u))
        lost_write = p * _expm1(lam * u) * min(costs.snapshot_s, k * u) / (k * u)
    charge = costs.background_weight * costs.snapshot_s * (1 / k + lost_write)
    return _log_based_waste(costs, mean_exp, charge)


def expected_waste(strategy: Strategy, costs: MeasuredCosts, *, interval_steps: int | None = None,
                   horizon_s: float | None = None) -> float:
    """Expected waste ratio of ``strategy``: ``interval_steps`` for the interval strategies,
    ``horizon_s`` (seconds of training) for log-only.

    Raises:
        ValueError: the argument the strategy needs is missing.
        InfeasibleError: the strategy's constraints fail for these costs.
    """
    if strategy is Strategy.LOG_ONLY:
        if horizon_s is None:
            raise ValueError("log-only waste grows with the run: pass horizon_s (seconds of training)")
        return waste_log_only(costs, horizon_s)
    if interval_steps is None:
        raise ValueError(f"{strategy} waste depends on the interval: pass interval_steps")
    return _WASTE[strategy](costs, interval_steps)


_WASTE: dict[Strategy, Callable[[MeasuredCosts, int], float]] = {
    Strategy.FULL_SYNC: waste_full_sync,
    Strategy.FULL_ASYNC: waste_full_async,
    Strategy.SHADOW: waste_shadow,
}


def optimal_interval_steps(strategy: Strategy, costs: MeasuredCosts) -> int:
    """The interval, in steps, that minimises the closed-form waste of ``strategy``.

    Each waste is unimodal in k (a falling snapshot term plus a rising loss term), so an integer
    ternary search between the smallest feasible interval and 50 MTBFs finds the minimum.

    Raises:
        ValueError: ``strategy`` has no interval (log-only).
        InfeasibleError: the strategy's constraints fail for every interval.
    """
    if strategy not in INTERVAL_STRATEGIES:
        raise ValueError(f"{strategy} has no snapshot interval")
    lo = 1 if strategy is Strategy.FULL_SYNC else min_background_steps(costs)
    hi = max(lo, search_bound_steps(costs))
    waste = _WASTE[strategy]
    while hi - lo > 2:
        third = (hi - lo) // 3
        if waste(costs, lo + third) <= waste(costs, hi - third):
            hi -= third
        else:
            lo += third
    return min(range(lo, hi + 1), key=lambda k: waste(costs, k))
