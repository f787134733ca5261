"""Cost models of the snapshot interval: classical formulas, closed-form waste, and the simulator."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raycheck.policies.compare import compare, recommend
from raycheck.policies.costs import InfeasibleError, MeasuredCosts
from raycheck.policies.models import (
    INTERVAL_STRATEGIES,
    Strategy,
    _lost_replay_mgf,
    catch_up_ratio,
    catch_up_s_per_step,
    checkfreq_interval_steps,
    daly_interval_s,
    differential_full_interval_steps,
    expected_waste,
    longest_shadow_interval_steps,
    min_background_steps,
    optimal_interval_steps,
    shadow_interval_steps,
    waste_full_async,
    waste_log_only,
    waste_shadow,
    young_interval_s,
)
from raycheck.policies.simulate import Exponential, Weibull, simulate

MIN, HOUR = 60.0, 3600.0


def costs(**changes) -> MeasuredCosts:
    base = dict(step_s=1.0, replay_step_s=0.3, snapshot_s=60.0, stall_s=6.0, restart_s=300.0, load_s=30.0,
                mtbf_s=HOUR, log_append_s=0.001)
    return MeasuredCosts(**{**base, **changes})


@pytest.mark.parametrize("mtbf_s, daly_min, young_min", [(24 * HOUR, 117, 120.0), (6 * HOUR, 57, 60.0), (15 * MIN, 9.1, 12.25)])
def test_young_and_daly_reproduce_dalys_worked_examples(mtbf_s, daly_min, young_min):
    assert daly_interval_s(5 * MIN, mtbf_s) / MIN == pytest.approx(daly_min, abs=0.35)
    assert young_interval_s(5 * MIN, mtbf_s) / MIN == pytest.approx(young_min, abs=0.01)


def test_daly_is_capped_at_the_mtbf_and_approximates_the_exact_sync_optimum():
    assert daly_interval_s(3 * HOUR, HOUR) == HOUR
    for mtbf_s in (15 * MIN, 6 * HOUR, 24 * HOUR):
        c = costs(snapshot_s=5 * MIN, mtbf_s=mtbf_s, restart_s=10 * MIN)
        exact = optimal_interval_steps(Strategy.FULL_SYNC, c)
        assert exact == pytest.approx(daly_interval_s(5 * MIN, mtbf_s), rel=0.005)


def test_differential_full_interval_is_youngs_with_the_replay_rounded_to_whole_batches():
    c = costs(step_s=4.0, replay_step_s=0.5, stall_s=1.0, snapshot_s=15.0)  # k* = sqrt(2 * 16 * 3600 / 2) = 240
    assert differential_full_interval_steps(c) == differential_full_interval_steps(c, 5) == 240
    assert differential_full_interval_steps(c, 7) == 238  # round(240 / 7) = 34 batches
    assert differential_full_interval_steps(c.replace(mtbf_s=915.0625)) == 121  # k* = 4 sqrt(M): an odd interval of single steps
    assert differential_full_interval_steps(c.replace(background_weight=0.0), 2) == round(math.sqrt(2 * 3600 / 2) / 2) * 2
    assert differential_full_interval_steps(c.replace(replay_step_s=2.0)) == 120  # 4x the replay: half the interval
    # a full write of 100 s cannot finish within fewer than 25 steps of 4 s, whatever the MTBF: 13 whole batches of 2
    assert differential_full_interval_steps(c.replace(snapshot_s=100.0, mtbf_s=1.0), 2) == 26
    with pytest.raises(ValueError, match="batch_steps"):
        differential_full_interval_steps(c, 0)


def test_shadow_model_is_youngs_interval_when_replay_costs_a_step_and_close_to_the_exact_optimum():
    slow_shadow = costs(replay_step_s=0.999999, mtbf_s=24 * HOUR)
    assert shadow_interval_steps(slow_shadow) == round(young_interval_s(60.0, 24 * HOUR))
    c = costs(mtbf_s=24 * HOUR)
    assert shadow_interval_steps(c) == round(math.sqrt(2 * 60 * 24 * HOUR / 0.3))
    assert optimal_interval_steps(Strategy.SHADOW, c) == pytest.approx(shadow_interval_steps(c), rel=0.05)


def test_checkfreq_bounds_the_overhead_and_waits_for_the_previous_persist():
    c = costs(stall_s=0.5, snapshot_s=2.0, background_weight=0.0)
    assert checkfreq_interval_steps(c, 0.035) == math.ceil(0.5 / 0.035)  # 15 steps: stall / step <= 3.5%
    assert checkfreq_interval_steps(costs(stall_s=0.0, snapshot_s=7.5, background_weight=0.0)) == 8
    charged = costs(stall_s=0.5, snapshot_s=2.0, background_weight=1.0)
    assert checkfreq_interval_steps(charged, 0.05) == 50  # (0.5 + 2.0) / (0.05 * 1.0)


def test_the_model_optimum_beats_the_classical_interval_for_the_shadow():
    c = costs()
    young = round(young_interval_s(c.snapshot_s, c.mtbf_s) / c.step_s)
    best = optimal_interval_steps(Strategy.SHADOW, c)
    assert waste_shadow(c, best) < 0.97 * waste_shadow(c, young)
    sim = {k: simulate(Strategy.SHADOW, c, interval_steps=k, horizon_s=2000 * c.mtbf_s, seed=3).waste_ratio for k in (best, young)}
    assert sim[best] < sim[young]


GRID = [
    costs(mtbf_s=m, snapshot_s=s, stall_s=s / 10, load_s=s / 2, restart_s=r, replay_step_s=rp)
    for m in (15 * MIN, HOUR, 6 * HOUR, 24 * HOUR)
    for s, r, rp in ((300.0, 600.0, 0.2), (20.0, 60.0, 0.6))
]


@pytest.mark.parametrize("strategy", INTERVAL_STRATEGIES, ids=str)
def test_analytic_waste_agrees_with_simulation_within_5_percent(strategy):
    for c in GRID:
        k = optimal_interval_steps(strategy, c)
        for interval in (k, 2 * k):
            predicted = expected_waste(strategy, c, interval_steps=interval)
            sim = simulate(strategy, c, interval_steps=interval, horizon_s=8000 * c.mtbf_s, seed=11)
            assert sim.failures > 6000
            assert sim.waste_ratio == pytest.approx(predicted, rel=0.05), (c, interval)


@pytest.mark.parametrize("share, live_steps", [(0.0, 0.0), (0.0, 3.0), (0.3, 1.0)])
def test_shadow_waste_with_failures_that_leave_the_shadow_alive_agrees_with_simulation_within_5_percent(share, live_steps):
    """``shadow_loss_fraction`` p: a share 1 - p of the failures (a worker alone) recover from the live
    image, replaying ``live_replay_steps``; the simulator draws each failure's kind (seeded)."""
    for c in GRID:
        c = MeasuredCosts(**{**c.__dict__, "shadow_loss_fraction": share, "live_replay_steps": live_steps})
        k = optimal_interval_steps(Strategy.SHADOW, costs(mtbf_s=c.mtbf_s))  # p = 1's optimum: snapshots still taken
        predicted = waste_shadow(c, k)
        sim = simulate(Strategy.SHADOW, c, interval_steps=k, horizon_s=8000 * c.mtbf_s, seed=11)
        assert sim.failures > 6000
        assert sim.waste_ratio == pytest.approx(predicted, rel=0.05), (c, k)


@pytest.mark.parametrize("speed", [0.1, 0.5, 0.95], ids=lambda x: f"r/t_s={x}")
@pytest.mark.parametrize("share", [0.3, 1.0], ids=lambda x: f"p={x}")
def test_shadow_waste_with_a_restarted_shadow_catching_up_agrees_with_simulation_within_5_percent(speed, share):
    """After a failure that loses the shadow, it restarts from its snapshot and catches up while training goes on
    (1 - r / t_s steps of lag per replayed step): a failure meanwhile replays the rest of its lag, and its snapshots
    come late. Negligible at r / t_s = 0.1; at 0.95 the waste without the catch-up is 7 to 17% lower than simulated."""
    c = costs(step_s=1.0, replay_step_s=speed, snapshot_s=20.0, stall_s=2.0, restart_s=60.0, load_s=10.0,
              shadow_loss_fraction=share, live_replay_steps=1.0)
    k = optimal_interval_steps(Strategy.SHADOW, c)
    for interval in (k // 2, k):
        predicted = waste_shadow(c, interval)
        sim = simulate(Strategy.SHADOW, c, interval_steps=interval, horizon_s=8000 * c.mtbf_s, seed=11)
        assert sim.failures > 6000
        assert sim.waste_ratio == pytest.approx(predicted, rel=0.05), (c, interval)


def test_a_shadow_that_catches_up_for_hours_between_failures_an_hour_apart_is_infeasible_and_not_recommended():
    """r = 1.19 s against t_s = 1.2 s: the lag shrinks by 1/120 step per replayed step, so a shadow restarted
    649 steps back needs 649 x 1.19 x 1.2 / 0.01 s = 25.7 h to catch up (c = 142.8 s per step of lag)."""
    c = costs(step_s=1.2, replay_step_s=1.19, snapshot_s=30.0, stall_s=3.0, restart_s=300.0, load_s=30.0, log_append_s=0.0)
    assert catch_up_s_per_step(c) * 649 == pytest.approx(649 * 142.8, rel=1e-12)
    # at the shortest interval, 25 steps of 1.2 s (30 s, shorter than r + S = 31.19 s): E[j] = (25 - 1) / 2 + 30 / 1.2 = 37;
    # rho = lambda c (E[j] - S / u) + c (e^(lambda S) - 1) / u = 142.8 (12 / 3600 + (e^(30 / 3600) - 1) / 1.2), about 1.47
    lam = 1 / HOUR
    rho = lam * 142.8 * (37 - 30 / 1.2) + 142.8 * math.expm1(30 * lam) / 1.2
    assert catch_up_ratio(c, 25) == pytest.approx(rho, rel=1e-9) and rho > 1
    for call in (lambda: optimal_interval_steps(Strategy.SHADOW, c), lambda: waste_shadow(c, 25),
                 lambda: simulate(Strategy.SHADOW, c, interval_steps=25, horizon_s=1e5)):
        with pytest.raises(InfeasibleError, match=r"catches up at 0.00833 steps per replayed step .* outlasts the MTBF of 3600 s"):
            call()
    options = compare(c, horizon_s=7 * 24 * HOUR)
    assert all(o.waste_ratio is None and "outlasts the MTBF of 3600 s" in o.error for o in options if o.strategy is Strategy.SHADOW)
    assert recommend(options).strategy in (Strategy.FULL_SYNC, Strategy.FULL_ASYNC)
    # a 10 s snapshot allows intervals short enough to catch up (at most the longest), never Young's, never recommended
    quick = c.replace(snapshot_s=10.0, stall_s=1.0)
    longest = longest_shadow_interval_steps(quick)
    assert catch_up_ratio(quick, longest) < 1 <= catch_up_ratio(quick, longest + 1)
    assert min_background_steps(quick) <= optimal_interval_steps(Strategy.SHADOW, quick) <= longest
    options = {(o.strategy, o.rule): o for o in compare(quick, horizon_s=7 * 24 * HOUR)}
    assert f"snapshot every <= {longest} steps" in options[Strategy.SHADOW, "young"].error
    assert recommend(list(options.values())).strategy is not Strategy.SHADOW
    assert options[Strategy.SHADOW, "optimal"].waste_ratio > 2 * options[Strategy.FULL_ASYNC, "optimal"].waste_ratio


def test_a_live_shadow_takes_the_replay_out_of_the_waste_and_its_interval_follows_the_share():
    """First order: w S / (k t_s) + lambda (D + p (k / 2) r + (1 - p) j r) (docs/algorithms.md); p = 1 is
    the model where every failure loses the shadow, and p = 0 leaves no failure for a snapshot to serve."""
    c, k = costs(mtbf_s=24 * HOUR), 1000
    lost, live = (MeasuredCosts(**{**c.__dict__, "shadow_loss_fraction": p}) for p in (1.0, 0.0))
    lam = c.failure_rate_per_s
    first_order = lambda p: c.snapshot_s / (k * c.step_s) + lam * (c.downtime_s + p * k / 2 * c.replay_step_s) + c.log_append_s
    assert waste_shadow(c, k) == waste_shadow(lost, k) == pytest.approx(first_order(1.0), rel=0.01)
    assert waste_shadow(live, k) == pytest.approx(first_order(0.0), rel=0.01)
    assert waste_shadow(live, k) < waste_shadow(lost, k) - lam * 0.45 * k * c.replay_step_s
    half = MeasuredCosts(**{**c.__dict__, "shadow_loss_fraction": 0.25})
    assert shadow_interval_steps(half) == round(2 * shadow_interval_steps(c))  # k* ~ 1 / sqrt(p)
    assert shadow_interval_steps(live) == math.ceil(50 * c.mtbf_s / c.step_s)  # the search bound: no failure needs one
    assert optimal_interval_steps(Strategy.SHADOW, live) >= 0.9 * shadow_interval_steps(live)


def test_log_only_analytic_waste_agrees_with_simulation_and_grows_with_the_run():
    for c in GRID[::2]:
        predicted = waste_log_only(c, 2 * c.mtbf_s)
        sim = simulate(Strategy.LOG_ONLY, c, horizon_s=2 * c.mtbf_s, runs=6000, seed=5)
        assert sim.waste_ratio == pytest.approx(predicted, rel=0.05), c
        assert waste_log_only(c, 20 * c.mtbf_s) > 2 * predicted


def test_weibull_failures_of_shape_one_are_exponential_and_burstier_failures_waste_less_here():
    c = costs()
    k = optimal_interval_steps(Strategy.FULL_SYNC, c)
    runs = {name: simulate(Strategy.FULL_SYNC, c, interval_steps=k, horizon_s=4000 * c.mtbf_s, failures=f, seed=2).waste_ratio
            for name, f in (("exp", Exponential()), ("w1", Weibull(shape=1.0)), ("w07", Weibull(shape=0.7)))}
    assert runs["w1"] == pytest.approx(runs["exp"], rel=0.04)
    # Clustered failures hit the job while it is already down: fewer distinct losses per failure.
    assert runs["w07"] < 0.95 * runs["exp"]


@pytest.mark.parametrize("strategy", INTERVAL_STRATEGIES, ids=str)
def test_the_optimal_interval_minimises_simulated_waste(strategy):
    """Common random numbers: every interval sees the same failures for a given seed."""
    for c in (costs(), costs(step_s=2.0, replay_step_s=1.0, snapshot_s=20.0, stall_s=2.0, restart_s=60.0, mtbf_s=6 * HOUR)):
        k = optimal_interval_steps(strategy, c)
        seeds = range(8)
        waste = {
            f: np.array([simulate(strategy, c, interval_steps=round(f * k), horizon_s=1500 * c.mtbf_s, seed=s).waste_ratio
                         for s in seeds])
            for f in (0.5, 0.9, 1.0, 1.1, 2.0)
        }
        for f in (0.5, 0.9, 1.1, 2.0):
            diff = waste[f] - waste[1.0]
            se = diff.std(ddof=1) / math.sqrt(len(diff))
            assert diff.mean() > -2 * se, (strategy, f, diff.mean(), se)
            if f in (0.5, 2.0):
                assert diff.mean() > 5 * se  # the test can tell intervals apart


def test_the_optimum_search_spans_one_step_to_fifty_mtbfs_and_async_starts_at_its_shortest_feasible_interval():
    assert min_background_steps(costs(snapshot_s=0.5)) == 1  # a write shorter than a step: every step
    assert optimal_interval_steps(Strategy.FULL_SYNC, costs(step_s=100.0, snapshot_s=1.0, mtbf_s=200.0)) == 1
    # a blocking checkpoint may come sooner than a background write could finish: 4 steps < 10
    frail = costs(snapshot_s=10.0, mtbf_s=4.0, restart_s=1.0, load_s=1.0)
    assert (optimal_interval_steps(Strategy.FULL_SYNC, frail), min_background_steps(frail)) == (4, 10)
    assert optimal_interval_steps(Strategy.FULL_ASYNC, frail) == 10
    # a live shadow that no failure loses: the waste falls with k up to the search's bound, 50 MTBFs of 2 s steps
    live = MeasuredCosts(**{**costs(mtbf_s=24 * HOUR, step_s=2.0).__dict__, "shadow_loss_fraction": 0.0})
    assert optimal_interval_steps(Strategy.SHADOW, live) == 50 * 24 * HOUR // 2
    with pytest.raises(ValueError, match="^log-only has no snapshot interval$"):
        optimal_interval_steps(Strategy.LOG_ONLY, live)


@pytest.mark.parametrize("strategy", [Strategy.FULL_SYNC, Strategy.FULL_ASYNC, Strategy.SHADOW])
def test_the_optimum_search_finds_the_brute_force_minimum(strategy):
    for changes in (dict(mtbf_s=300.0, snapshot_s=3.0), dict(mtbf_s=900.0, snapshot_s=2.0, replay_step_s=0.9),
                    dict(mtbf_s=60.0, snapshot_s=1.0, restart_s=5.0, load_s=1.0), dict(mtbf_s=2000.0, snapshot_s=7.0)):
        c = costs(**changes)
        lo = 1 if strategy is Strategy.FULL_SYNC else min_background_steps(c)
        brute = min(range(lo, 2000), key=lambda k: feasible_waste(strategy, c, k))
        assert optimal_interval_steps(strategy, c) == brute, changes


def feasible_waste(strategy: Strategy, c: MeasuredCosts, k: int) -> float:
    """The expected waste, inf where the interval is infeasible (a shadow that would not catch up)."""
    try:
        return expected_waste(strategy, c, interval_steps=k)
    except InfeasibleError:
        return math.inf


def test_shadow_interval_without_a_snapshot_charge_is_the_shortest_a_write_allows_and_the_bound_counts_steps():
    free = costs(background_weight=0.0, snapshot_s=3.0)
    for p in (0.0, 1.0):
        assert shadow_interval_steps(free.replace(shadow_loss_fraction=p)) == 3
    live = costs(mtbf_s=24 * HOUR, step_s=2.0, shadow_loss_fraction=0.0)
    assert shadow_interval_steps(live) == 50 * 24 * HOUR // 2


def test_infeasible_inputs_raise_an_error_that_says_what_to_change():
    slow = costs(replay_step_s=1.2)
    for call in (lambda: shadow_interval_steps(slow), lambda: optimal_interval_steps(Strategy.SHADOW, slow),
                 lambda: waste_shadow(slow, 100), lambda: simulate(Strategy.SHADOW, slow, interval_steps=100, horizon_s=1e5)):
        with pytest.raises(InfeasibleError, match=r"replays a step in 1.2 s but training takes 1 s a step: its lag grows without bound; give the shadow more CPUs"):
            call()
    c = costs(snapshot_s=60.0)
    assert min_background_steps(c) == 60
    for call in (lambda: waste_full_async(c, 59), lambda: waste_shadow(c, 30)):
        with pytest.raises(InfeasibleError, match="would not finish before the next; snapshot every >= 60 steps"):
            call()
    assert optimal_interval_steps(Strategy.FULL_ASYNC, costs(snapshot_s=600.0, mtbf_s=24 * HOUR)) >= 600
    with pytest.raises(ValueError, match="max_overhead must be in"):
        checkfreq_interval_steps(c, 0.0)
    with pytest.raises(ValueError, match="pass horizon_s"):
        expected_waste(Strategy.LOG_ONLY, c)
    with pytest.raises(ValueError, match="pass interval_steps"):
        expected_waste(Strategy.SHADOW, c)


def test_shadow_waste_is_infinite_not_nan_when_the_snapshot_lag_is_whole_steps_and_replay_overflows():
    c = costs(snapshot_s=2e6, log_append_s=0.0, mtbf_s=600.0)  # lag = k steps exactly; e^(lambda r k) overflows
    assert _lost_replay_mgf(c, 2_000_000, c.failure_rate_per_s * c.replay_step_s) == math.inf
    # waste_shadow no longer gets there: a shadow restarted that far behind never catches up
    with pytest.raises(InfeasibleError, match="outlasts the MTBF of 600 s"):
        waste_shadow(c, 2_000_000)


@pytest.mark.parametrize("field, value, message", [
    ("step_s", 0.0, "step_s must be > 0 seconds"),
    ("restart_s", -1.0, "restart_s must be a finite number >= 0"),
    ("mtbf_s", math.inf, "mtbf_s must be a finite number >= 0"),
    ("background_weight", 1.5, r"background_weight must be in \[0, 1\]"),
    ("shadow_loss_fraction", 1.2, r"shadow_loss_fraction must be in \[0, 1\]"),
    ("accelerators", 0, "accelerators must be an integer >= 1"),
])
def test_costs_are_validated_with_errors_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        costs(**{field: value})


def test_job_mtbf_from_accelerators():
    c = MeasuredCosts.for_accelerators(accelerator_mtbf_s=16_384 * 3 * HOUR, accelerators=16_384, step_s=1.0,
                                       replay_step_s=0.3, snapshot_s=10.0, restart_s=60.0, load_s=5.0)
    assert (c.mtbf_s, c.accelerators, c.failure_rate_per_s, c.downtime_s) == (3 * HOUR, 16_384, 1 / (3 * HOUR), 65.0)
