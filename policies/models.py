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
failure during recovery starts the recovery again. A shadow that a failure lost restarts from the
newest durable snapshot when training resumes and catches up while training goes on (``waste_shadow``);
until it has, a failure replays its remaining lag. The building block, used throughout: the
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
            f"a snapshot takes {costs.snapshot_s:.3g} s but one is due every {interval_steps} steps of "
            f"{costs.step_s:.3g} s = {interval_steps * costs.step_s:.3g} s: it would not finish before the next; "
            f"snapshot every >= {min_background_steps(costs)} steps, or make snapshots faster"
        )


def check_shadow(costs: MeasuredCosts, interval_steps: int | None = None) -> None:
    """Raise unless the shadow keeps up with training (and, given an interval, its snapshots fit and a
    restarted shadow catches up: ``catch_up_ratio`` < 1).

    Raises:
        InfeasibleError: ``replay_step_s >= step_s`` (the shadow's lag grows without bound), a
            snapshot does not finish within ``interval_steps`` steps, or the catch-up after a failure
            that loses the shadow outlasts the MTBF (says the longest interval that catches up).
    """
    if costs.replay_step_s >= costs.step_s:
        raise InfeasibleError(
            f"the shadow replays a step in {costs.replay_step_s:.3g} s but training takes {costs.step_s:.3g} s "
            f"a step: its lag grows without bound; give the shadow more CPUs (--shadow-threads, --shadow-shards) "
            f"or use --strategy full-async"
        )
    if interval_steps is None:
        return
    check_background(costs, interval_steps)
    ratio = catch_up_ratio(costs, interval_steps)
    if ratio >= 1:
        longest = longest_shadow_interval_steps(costs)
        shorter = f"snapshot every <= {longest} steps, " if longest >= min_background_steps(costs) else ""
        raise InfeasibleError(
            f"a shadow restarted from its snapshot (every {interval_steps} steps) catches up at "
            f"{1 - costs.replay_step_s / _step_with_append_s(costs):.3g} steps per replayed step "
            f"(a replay of {costs.replay_step_s:.3g} s against a step of {costs.step_s:.3g} s): its expected catch-up of "
            f"{ratio * costs.mtbf_s:.3g} s outlasts the MTBF of {costs.mtbf_s:.4g} s, so it is almost always behind; "
            f"{shorter}give the shadow more CPUs (--shadow-threads, --shadow-shards) or use --strategy full-async"
        )


def _step_with_append_s(costs: MeasuredCosts) -> float:
    """u = step_s + log_append_s: one step of the log-based strategies, in seconds."""
    return costs.step_s + costs.log_append_s


def catch_up_s_per_step(costs: MeasuredCosts) -> float:
    """Seconds a restarted shadow needs to make up one step of lag while training goes on.

    The shadow replays a step in r = ``replay_step_s`` while training logs one every u = ``step_s`` +
    ``log_append_s``, so its lag shrinks by 1 - r / u steps per replayed step: a lag of L steps takes
    L r / (1 - r / u) = L c seconds, c = r u / (u - r). Needs r < ``step_s`` (``check_shadow``).
    """
    u = _step_with_append_s(costs)
    return costs.replay_step_s * u / (u - costs.replay_step_s)


def mean_lost_replay_steps(costs: MeasuredCosts, interval_steps: int) -> float:
    """E[j]: steps a failure that loses a caught-up shadow replays, on average, with a snapshot every
    ``interval_steps`` (k) steps: (k - 1) / 2 from the last snapshot, plus k while the newest one is
    not durable yet (a share delta / (k u) of the cycle, delta = min(r + S, k u)): (k - 1) / 2 + delta / u."""
    u = _step_with_append_s(costs)
    return (interval_steps - 1) / 2 + min(shadow_lag_s(costs), interval_steps * u) / u


def catch_up_ratio(costs: MeasuredCosts, interval_steps: int) -> float:
    """rho: the expected catch-up of a shadow restarted after a failure that loses it, over the MTBF;
    0 when no failure loses it (``shadow_loss_fraction`` 0). To first order rho = c E[j] / M: the
    replay such a failure leaves (``mean_lost_replay_steps`` E[j]) times ``catch_up_s_per_step`` c; with
    its snapshots durable S after it replays them, exactly rho = lambda c (E[j] - S / u) + c (e^(lambda S) - 1) / u.
    At rho >= 1 the replay after such failures grows without bound (``waste_shadow``): the shadow is infeasible."""
    if costs.shadow_loss_fraction == 0:
        return 0.0
    lam, u, c = costs.failure_rate_per_s, _step_with_append_s(costs), catch_up_s_per_step(costs)
    excess = mean_lost_replay_steps(costs, interval_steps) - costs.snapshot_s / u
    return lam * c * excess + c * _expm1(lam * costs.snapshot_s) / u


def longest_shadow_interval_steps(costs: MeasuredCosts) -> int:
    """The longest interval, in steps, at which a restarted shadow catches up (``catch_up_ratio`` < 1),
    at most ``search_bound_steps``; 0 when none does. Requires r < ``step_s`` (``check_shadow``)."""
    lo, hi = 0, search_bound_steps(costs)  # the ratio grows with the interval: bisect on it
    if catch_up_ratio(costs, hi) < 1:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if catch_up_ratio(costs, mid) < 1 else (lo, mid)
    return lo


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
    ``min_background_steps`` so that a snapshot finishes before the next is due. A restarted shadow's
    catch-up (``waste_shadow``) adds a waste of second order in lambda, so it does not move this
    first-order optimum (nor is it checked here: ``check_shadow`` with an interval does); where r is
    close to t_s that term is large, and ``optimal_interval_steps`` minimises the whole waste.

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
    """(1/n) sum_{i<n} e^(q i), the mean of e^(q j) for j uniform on 0..n-1, for any real q; inf once
    e^(q n) would overflow a float (the replay then outlasts any failure-free stretch: no progress)."""
    if q == 0:
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


def _lost_replay_mgf(costs: MeasuredCosts, k: int, s: float) -> float:
    """E[e^(s j)] for the replay j of a failure that loses a caught-up shadow (``waste_shadow``), any real s:
    (1/k) sum_{i<k} e^(s i) + (e^(s k) - 1) / (k u) integral_0^delta e^(s floor(phi/u)) dphi."""
    u = _step_with_append_s(costs)
    delta = min(shadow_lag_s(costs), k * u)
    whole = math.floor(delta / u)
    rest = delta - whole * u  # 0 when the lag is whole steps: then e^(s whole) may be inf, and 0 x inf is nan
    lag_integral = u * whole * _mean_exp(s, whole) + (rest * _exp(s * whole) if rest > 0 else 0.0) if whole else delta
    return _mean_exp(s, k) + _expm1(s * k) * lag_integral / (k * u)


class _CatchUp:
    """The replays at a failure with a snapshot every ``k`` steps, given restarted shadows (``waste_shadow``).

    R, in steps: the replay a failure would need if it lost the shadow. After a failure that leaves the
    shadow alive it is caught up: R = J (MGF beta, ``_lost_replay_mgf``). After one that lost it with a
    replay L, the shadow restarts L steps behind and its snapshots become durable S after it replays
    them: a failure tau seconds later finds R = L + tau / u while tau < S (probability 1 - pi,
    pi = e^(-lambda S)), else R = J + (L - E)^+, E = (tau - S) / c exponential of rate a = lambda c
    (memoryless). With e(s) = (1 - pi) E[e^(s tau / u) | tau < S] = lambda (e^(b S) - 1) / b, b = s / u - lambda,
    the stationary MGF of R is
    E[e^(s R)] = beta(s) ((1 - p)(a + s) + s K) / Den(s),  Den(s) = (a + s)(1 - p e(s)) - p pi a beta(s),
    inf where Den(s) <= 0; K = p pi E[e^(-a R)] is Den'(0) = pi (1 - rho) for p = 1 (``catch_up_ratio``),
    and for p < 1 makes the numerator vanish at the root of Den in (-a, 0) (bisected). The shadow's
    own lag at a failure, (L - tau / c)^+ after a lost one (else 0), has the MGF
    (1 - p) + p (a E[e^(s R)] + s E[e^(-a R)]) / (a + s) and is 0 with probability 1 - p + p E[e^(-a R)].
    """

    def __init__(self, costs: MeasuredCosts, k: int) -> None:
        self.costs, self.k = costs, k
        self.p, self.lam = costs.shadow_loss_fraction, costs.failure_rate_per_s
        self.a = self.lam * catch_up_s_per_step(costs)
        self.pi = math.exp(-self.lam * costs.snapshot_s)
        if self.p == 1:
            self.K = self.pi * (1 - catch_up_ratio(costs, k))
        else:
            lo, hi = -1.0, 0.0  # Den(a x) is < 0 at x = -1 and a (1 - p) > 0 at x = 0
            while (mid := (lo + hi) / 2) not in (lo, hi):
                lo, hi = (mid, hi) if self._den(self.a * mid) < 0 else (lo, mid)
            self.K = -(1 - self.p) * (1 + hi) / hi

    def _den(self, s: float) -> float:
        b, snap = s / _step_with_append_s(self.costs) - self.lam, self.costs.snapshot_s
        early = self.lam * (_expm1(b * snap) / b if b else snap)
        return (self.a + s) * (1 - self.p * early) - self.p * self.pi * self.a * _lost_replay_mgf(self.costs, self.k, s)

    def replay_mgf(self, s: float) -> float:
        """E[e^(s R)]."""
        den = self._den(s)
        numerator = (1 - self.p) * (self.a + s) + s * self.K
        return _lost_replay_mgf(self.costs, self.k, s) * numerator / den if den > 0 else math.inf

    def shadow_lag_mgf(self, s: float) -> tuple[float, float]:
        """(E[e^(s W)], P(W = 0)) for the lag W of the shadow itself at a failure."""
        if self.p == 0:
            return 1.0, 1.0
        tail = self.K / (self.p * self.pi)  # E[e^(-a R)]
        return 1 - self.p + self.p * (self.a * self.replay_mgf(s) + s * tail) / (self.a + s), 1 - self.p + self.p * tail


def waste_shadow(costs: MeasuredCosts, interval_steps: int) -> float:
    """Expected waste ratio of the CPU shadow with a snapshot every ``interval_steps`` steps.

    Source: ZOCheck (arXiv 2026) and the shadow model of ``docs/algorithms.md``, taken to exponential failures
    exactly except for the snapshot's durability lag, which is averaged (error of order lambda
    times that lag), for a failure during a recovery, which repeats the recovery of the first one,
    and for the phase of a restarted shadow's snapshots, below.
    A failure that loses a caught-up shadow (a share p, ``shadow_loss_fraction``) at phase phi of the k-step
    cycle (phi uniform on [0, k u)) replays j = J = floor(phi / u) steps from the last snapshot, plus k more
    when phi falls in the first delta = r + S seconds after a snapshot step, before that snapshot is
    durable; a snapshot lost that way is written again later (charged once more). So
    beta(s) = E[e^(s J)] = (1/k) sum_{i<k} e^(s i)
                           + (e^(s k) - 1) / (k u) integral_0^delta e^(s floor(phi/u)) dphi.
    Catch-up (``actors.shadow.ShadowLoop``): the workers recover from that snapshot; the shadow restarts
    from it when training resumes, L = j steps behind, and takes L c seconds (``catch_up_s_per_step``,
    c = r u / (u - r)) to catch up, taking the snapshots of the multiples of k as it replays them: late,
    not skipped, each durable S after. A failure tau seconds later that loses the shadow again replays
    R = L + tau / u while tau < S (no snapshot of the catch-up durable yet), else J + (L - (tau - S) / c)^+
    (J for the phase of the newest durable snapshot, as if uniform); one that leaves it alive replays the
    shadow's own lag (L - tau / c)^+ in place of j_live = ``live_replay_steps``, after which the shadow
    has caught up. ``_CatchUp`` solves this chain (a queue fed by the failures that lose the shadow and
    emptied by the others) for the MGFs E[e^(q R)] and E[e^(q W)] of the lost and the live replays, and
    P0 = P(W = 0); it is stable for ``catch_up_ratio`` rho < 1, and the shadow is infeasible otherwise.
    With q = lambda r,
    E[e^(q j)] = p E[e^(q R)] + (1 - p) (E[e^(q W)] + P0 (e^(q j_live) - 1));
    the charge per step is w S (1/k + p (e^(lambda u) - 1) min(S, k u) / (k u)), and ``_log_based_waste``
    does the rest. Neglected besides: the phase of the snapshots a restarted shadow takes (its first is
    k steps past its restore point, not uniformly placed, so early in a catch-up R is shorter than
    modelled: off by up to 5%, mostly high, where catch-ups fill much of the MTBF), the shadow's own restart
    before it replays, queueing at the persister while a catch-up passes snapshot steps every k r
    seconds, and 0 < W < j_live (a live failure then replays j_live). To first order in lambda this is
    ``docs/algorithms.md``'s w S / (k t_s) + lambda (D + p (k / 2) r + (1 - p) j_live r), minimal at
    ``shadow_interval_steps``; the catch-up adds lambda^2 r p (c E[J^2] + p S^2 / u) / 2 (a catch-up of
    the mean square replay, and failures within S of a restart), which is of second order in lambda
    but large when r / u is close to 1: ``optimal_interval_steps`` minimises the whole waste.

    Raises:
        InfeasibleError: the shadow does not keep up, a snapshot does not fit in the interval, or a
            restarted shadow does not catch up (``check_shadow``).
    """
    check_shadow(costs, interval_steps)
    lam, k, r, p = costs.failure_rate_per_s, interval_steps, costs.replay_step_s, costs.shadow_loss_fraction
    u = _step_with_append_s(costs)
    q = lam * r
    lags = _CatchUp(costs, k)
    mean_exp = 0.0
    if p < 1:  # (a term of weight 0 may be inf)
        live, caught_up = lags.shadow_lag_mgf(q)
        mean_exp = (1 - p) * (live + caught_up * _expm1(q * costs.live_replay_steps))
    lost_write = 0.0
    if p > 0:
        mean_exp += p * lags.replay_mgf(q)
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
    ternary search between the smallest feasible interval and 50 MTBFs (for the shadow, at most
    ``longest_shadow_interval_steps``) finds the minimum.

    Raises:
        ValueError: ``strategy`` has no interval (log-only).
        InfeasibleError: the strategy's constraints fail for every interval.
    """
    if strategy not in INTERVAL_STRATEGIES:
        raise ValueError(f"{strategy} has no snapshot interval")
    lo = 1 if strategy is Strategy.FULL_SYNC else min_background_steps(costs)
    hi = max(lo, search_bound_steps(costs))
    if strategy is Strategy.SHADOW:  # no longer than a restarted shadow catches up
        check_shadow(costs)
        hi = min(hi, longest_shadow_interval_steps(costs))
        if hi < lo:
            check_shadow(costs, lo)  # raises: not even the shortest interval catches up
    waste = _WASTE[strategy]
    while hi - lo > 2:
        third = (hi - lo) // 3
        if waste(costs, lo + third) <= waste(costs, hi - third):
            hi -= third
        else:
            lo += third
    return min(range(lo, hi + 1), key=lambda k: waste(costs, k))
