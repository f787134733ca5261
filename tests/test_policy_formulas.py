"""The policy formulas against values worked by hand (pure, no Ray).

``tests/test_policies.py`` checks the closed forms against the simulator within a few percent; these
tests pin each formula to numbers computed by hand from its docstring, at a failure rate small
enough (MTBF 1e6 s) that the first-order expansion is exact to 1e-4, and check the bounds and the
messages of every validation. They kill the mutants that a 5% agreement with a simulation lets
through (see docs/testing.md).
"""

from __future__ import annotations

import logging
import math
import re

import pytest

from raycheck.policies.costs import InfeasibleError, MeasuredCosts
from raycheck.policies.interval import AdaptiveInterval, SnapshotSchedule
from raycheck.policies.models import (
    Strategy,
    checkfreq_interval_steps,
    daly_interval_s,
    expected_waste,
    shadow_interval_steps,
    steps_for,
    waste_full_async,
    waste_full_sync,
    waste_log_only,
    waste_shadow,
    young_interval_s,
)
from raycheck.policies.replan import Replanner

LAMBDA = 1e-6  # failures per second: MTBF 1e6 s


def costs(**changes) -> MeasuredCosts:
    """A 2 s step (so that step_s never cancels out), 10 s of downtime (restart 8 + load 2)."""
    base = dict(step_s=2.0, replay_step_s=1.0, snapshot_s=5.0, stall_s=1.0, restart_s=8.0, load_s=2.0,
                mtbf_s=1 / LAMBDA, log_append_s=0.0, background_weight=0.0)
    return MeasuredCosts(**{**base, **changes})


@pytest.mark.parametrize("formula", [young_interval_s, daly_interval_s])
def test_classical_intervals_refuse_non_positive_or_infinite_inputs_naming_the_argument(formula):
    assert formula(0.5, 0.75) > 0  # values in (0, 1] are valid
    for args, message in [((0.0, 1.0), "checkpoint_s must be a finite number > 0 seconds, got 0.0"),
                          ((1.0, -2.0), "mtbf_s must be a finite number > 0 seconds, got -2.0"),
                          ((1.0, math.inf), "mtbf_s must be a finite number > 0 seconds, got inf")]:
        with pytest.raises(ValueError) as err:
            formula(*args)
        assert str(err.value) == message


def test_young_and_daly_by_hand():
    assert young_interval_s(2.0, 100.0) == 20.0  # sqrt(2 x 2 x 100)
    # x = C / 2M = 0.01: 20 (1 + 0.1 / 3 + 0.01 / 9) - 2 = 18.68889
    assert daly_interval_s(2.0, 100.0) == pytest.approx(18.688889, rel=1e-7)
    assert daly_interval_s(2.0, 1.0) == 1.0  # C = 2M: capped at M (the expansion would give 0.889)
    assert daly_interval_s(2.5, 1.0) == 1.0


def test_steps_for_rounds_to_the_nearest_whole_step_and_at_least_one():
    assert steps_for(10.0, 2.5) == 4
    assert steps_for(7.4, 2.0) == 4  # 3.7 steps
    assert steps_for(0.4, 1.0) == 1  # rounds to 0, raised to 1


def test_checkfreq_by_hand_and_its_overhead_bound():
    c = costs(stall_s=0.5, snapshot_s=2.0)
    assert checkfreq_interval_steps(c, 0.035) == 8  # 0.5 s / (0.035 x 2 s) = 7.14 steps
    assert checkfreq_interval_steps(c.replace(background_weight=0.5), 0.035) == 22  # (0.5 + 1) / 0.07 = 21.4
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=f"max_overhead must be in \\(0, 1\\), e.g. 0.035 for 3.5%, got {bad}"):
            checkfreq_interval_steps(c, bad)


def test_shadow_interval_by_hand():
    # k* = sqrt(2 w S M / (r t)) = sqrt(2 x 0.5 x 10 x 3600 / (0.5 x 2)) = sqrt(36000) = 189.7
    c = costs(replay_step_s=0.5, snapshot_s=10.0, mtbf_s=3600.0, background_weight=0.5)
    assert shadow_interval_steps(c) == 190
    assert shadow_interval_steps(c.replace(mtbf_s=1.0)) == 5  # sqrt(10) = 3.2 steps, raised to the 5 a snapshot needs


def test_waste_full_sync_to_first_order_by_hand():
    # tau = 10 x 2 = 20 s, C = 5 s, D = 10 s: (1 + C / tau) (1 + lambda ((tau + C) / 2 + D)) - 1
    assert waste_full_sync(costs(), 10) == pytest.approx(0.25 + 1.25 * 22.5 * LAMBDA, rel=1e-7)


def test_waste_full_async_to_first_order_by_hand():
    # tau = 20 s, a = tau + stall = 21 s, P = 5 s: (a / tau) (1 + lambda (D + P + a / 2)) + w P (1 + lambda P) / tau - 1
    assert waste_full_async(costs(), 10) == pytest.approx(0.05 + 1.05 * 25.5 * LAMBDA, rel=1e-7)
    charged = waste_full_async(costs(background_weight=0.5), 10)
    assert charged == pytest.approx(0.05 + 1.05 * 25.5 * LAMBDA + 0.125 * (1 + 5 * LAMBDA), rel=1e-7)


def test_waste_log_only_to_first_order_by_hand():
    # A failure costs half a step (u / 2 = 1 s), D = 10 s and the replay of j steps, j uniform on 0..n-1.
    assert waste_log_only(costs(), 20.0) == pytest.approx(LAMBDA * (1 + 10 + 4.5), rel=1e-4)  # n = 10 steps
    assert waste_log_only(costs(), 2.0) == pytest.approx(LAMBDA * 11, rel=1e-4)  # n = 1: nothing to replay
    assert waste_log_only(costs(), 0.5) == pytest.approx(LAMBDA * 11, rel=1e-4)  # a quarter step still counts as 1


def test_waste_shadow_to_first_order_by_hand():
    # u = 2.5 s (step + log append); per failure: u / 2 + D + r ((k - 1) / 2 + delta / u), delta = r + S = 6 s,
    # k = 10; to first order (u / t) (1 + lambda (1.25 + 10 + 4.5 + 2.4)) - 1.
    c = costs(log_append_s=0.5)
    assert waste_shadow(c, 10) - 0.25 == pytest.approx(1.25 * 18.15 * LAMBDA, rel=1e-3)  # the failure terms alone
    # With the snapshot charged at w = 0.5: w S / (k t) = 0.125, plus the rewrite of one cut off by a failure,
    # w S x lambda u x S / (k u) / t.
    charged = waste_shadow(costs(background_weight=0.5), 10)
    assert charged - 0.125 == pytest.approx(18.5 * LAMBDA + 2.5 * LAMBDA * 2.0 * 5.0 / 20.0 / 2.0, rel=1e-3)


def test_a_waste_past_the_float_range_is_inf_not_an_overflow_error():
    """lambda tau beyond ~709.78 overflows e^(lambda tau): the waste is inf, so no planner picks that interval; just
    below it the waste is finite (a cut-off below the float range would call it inf)."""
    far = costs(mtbf_s=1.0, restart_s=0.5, load_s=0.5, snapshot_s=0.5)  # lambda = 1 per second, D = 1 s
    assert waste_full_sync(far, interval_steps=1000) == math.inf  # lambda (tau + C) = 2000.5
    assert waste_full_async(far, interval_steps=1000) == math.inf
    near = waste_full_sync(far, interval_steps=353)  # lambda (tau + C) = 706.5: e^1 (e^706.5 - 1) / 706 - 1
    assert near == pytest.approx(math.e * math.expm1(706.5) / 706 - 1, rel=1e-12) and math.isfinite(near)


def test_snapshot_schedule_bounds():
    every = SnapshotSchedule(every_steps=1, last_step=0)
    assert [s for s in range(1, 4) if every.take_if_due(s)] == [1, 2, 3]
    assert not SnapshotSchedule(every_steps=10, last_step=10).take_if_due(10)  # already snapshotted at that step
    assert not any(SnapshotSchedule(every_steps=0, last_step=0).take_if_due(s) for s in range(1, 50))  # 0: log-only
    with pytest.raises(ValueError) as err:
        SnapshotSchedule(every_steps=-1)
    assert str(err.value) == "every_steps must be >= 0, got -1"
    # a loop that skips steps (a shard, a postponed check): the gap counts from the step of the last snapshot taken
    gaps = SnapshotSchedule(every_steps=3, last_step=0)
    assert gaps.take_if_due(3) and gaps.last_step == 3 and gaps.due(6) and not gaps.due(5)
    gaps.taken(5)  # on demand, outside the schedule
    assert gaps.last_step == 5 and not gaps.due(7) and gaps.take_if_due(8)


INITIAL = MeasuredCosts(step_s=1.0, replay_step_s=0.2, snapshot_s=10.0, restart_s=60.0, load_s=5.0, mtbf_s=3600.0)


def test_adaptive_interval_passes_the_failure_counters_and_logs_each_replan(caplog):
    policy = AdaptiveInterval(Replanner(INITIAL, threshold=0.2, prior_failures=1.0))
    k0 = policy.every_steps
    with caplog.at_level(logging.INFO, logger="raycheck.policies.interval"):
        record = policy.observe(500, failures=9, elapsed_s=6000.0)  # 10 failures in 9600 s: MTBF 960 s
    assert policy.replanner.estimated_costs().mtbf_s == 960.0
    assert record is not None and policy.every_steps == record.interval_steps < k0
    assert [r.getMessage() for r in caplog.records] == [
        f"re-plan at step 500: {record.reason}; inputs {record.inputs}"]


def test_adaptive_interval_warns_once_per_infeasible_spell(caplog):
    policy = AdaptiveInterval(Replanner(INITIAL))
    k0 = policy.every_steps
    with caplog.at_level(logging.WARNING, logger="raycheck.policies.interval"):
        assert policy.infeasible is None
        reasons = [policy.observe(step, replay_step_s=1.5) for step in range(1, 8)]  # replay slower than a step
        assert reasons == [None] * 7 and policy.every_steps == k0
        assert policy.infeasible.startswith("the shadow replays a step in 1.5 s but training takes 1 s a step")
        for step in range(8, 40):  # feasible again: the estimate comes back under a step (it may re-plan)
            policy.observe(step, replay_step_s=0.2)
        assert policy.infeasible is None
        for step in range(40, 48):  # a second spell (the estimate crosses a step once, re-planning on its way)
            policy.observe(step, replay_step_s=1.5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert warnings[0].startswith(f"the snapshot interval stays at {k0} steps: the shadow replays a step in 1.5 s")
    assert re.match(r"the snapshot interval stays at \d+ steps: the shadow replays a step in 1\.\d+ s", warnings[1])
    assert all("its lag grows without bound" in w for w in warnings)


def test_waste_shadow_exactly_at_a_high_failure_rate_by_hand():
    """lambda = ln 2 per second makes most exponentials powers of 2, so the exact formula is worked by hand.

    r = 1 s, so q = lambda r = ln 2; u = step = 4 s, so e^(lambda u) - 1 = 15; D = 1 s, so e^(lambda D) = 2.
    k = 1: a snapshot is durable delta = r + S = 2 s after its step, half of the 4 s cycle, so J is 0 or 1,
    each with probability 1/2: beta(q) = 1/2 + 2/2 = 3/2, E[J] = 1/2.
    Catch-up (every failure loses the shadow, p = 1): c = r u / (u - r) = 4/3 s per step of lag, a = lambda c;
    the snapshot write S = 1 s gives pi = e^(-lambda S) = 1/2, and rho = lambda c (E[J] - S / u) + c (e^(lambda S) - 1) / u
    = ln 2 / 3 + 1 / 3. e(q) = lambda (e^(b S) - 1) / b with b = q / u - lambda = -3 ln 2 / 4: e(q) = 4/3 (1 - 2^(-3/4)).
    Den(q) = (a + q)(1 - e(q)) - pi a beta(q) = ln 2 (4/9) (7 x 2^(-3/4) - 4), K = pi (1 - rho) = (2 - ln 2) / 6,
    E[e^(q R)] = beta(q) q K / Den(q) = 9 (2 - ln 2) / (16 (7 x 2^(-3/4) - 4)) (about 4.53: the catch-up, near
    critical here, more than triples the replay's 3/2). Seconds per step 15 x 2 x E / ln 2, over a 4 s step.
    Charging the 1 s snapshot at w = 1 adds w S (1 / k + 15 x min(S, k u) / (k u)) / t = (1 + 15 / 4) / 4 = 19 / 16.
    """
    c = costs(step_s=4.0, replay_step_s=1.0, snapshot_s=1.0, restart_s=0.5, load_s=0.5, mtbf_s=1 / math.log(2))
    mean_exp = 9 * (2 - math.log(2)) / (16 * (7 * 2 ** -0.75 - 4))
    exact = 30 * mean_exp / (4 * math.log(2)) - 1
    assert waste_shadow(c, 1) == pytest.approx(exact, rel=1e-12)
    assert waste_shadow(c.replace(background_weight=1.0), 1) == pytest.approx(exact + 19 / 16, rel=1e-12)
    # a term of weight 0 stays 0 where its exponential overflows: a live lag of 1e9 steps when every failure loses
    # the shadow, a 2000-step interval when none does (E = 1: seconds per step 15 x 2 / ln 2, over 4 s; nothing to catch up)
    assert waste_shadow(c.replace(live_replay_steps=1e9), 1) == pytest.approx(exact, rel=1e-12)
    assert waste_shadow(c.replace(shadow_loss_fraction=0.0), 2000) == pytest.approx(7.5 / math.log(2) - 1, rel=1e-12)
    # half the failures leave the shadow alive (a lag of 2 steps, or the restarted shadow's, if longer): in between
    half = waste_shadow(c.replace(shadow_loss_fraction=0.5, live_replay_steps=2.0), 1)
    assert 7.5 / math.log(2) - 1 < half < exact


def test_feasibility_bounds_and_their_messages():
    with pytest.raises(InfeasibleError, match="replays a step in 2 s but training takes 2 s a step"):
        waste_shadow(costs(replay_step_s=2.0), 10)  # replay as slow as a step: the lag still grows
    assert waste_full_async(costs(snapshot_s=5.0), 3) > 0  # 5 s fits in 3 steps of 2 s
    with pytest.raises(InfeasibleError, match=r"one is due every 2 steps of 2 s = 4 s: it would not finish"):
        waste_full_async(costs(snapshot_s=5.0), 2)
    assert waste_full_async(costs(snapshot_s=1.0), 1) > 0  # one step is a valid interval
    with pytest.raises(InfeasibleError) as err:
        waste_full_async(costs(), 0)
    assert str(err.value) == "interval_steps must be >= 1, got 0"
    # A snapshot durable within its own step (delta = r + S = 3 s < u = 10 s), k = 1: to first order
    # lambda (u / 2 + D + r delta / u) = lambda (5 + 10 + 0.3).
    assert waste_shadow(costs(step_s=10.0, snapshot_s=2.0), 1) == pytest.approx(15.3 * LAMBDA, rel=1e-3)


def test_expected_waste_dispatches_with_its_arguments():
    c = costs()
    assert expected_waste(Strategy.LOG_ONLY, c, horizon_s=20.0) == waste_log_only(c, 20.0)
    assert expected_waste(Strategy.SHADOW, c, interval_steps=10) == waste_shadow(c, 10)
    assert expected_waste(Strategy.FULL_SYNC, c, interval_steps=10) == waste_full_sync(c, 10)
    assert expected_waste(Strategy.FULL_ASYNC, c, interval_steps=10) == waste_full_async(c, 10)
    for strategy, message in [(Strategy.LOG_ONLY, "log-only waste grows with the run: pass horizon_s (seconds of training)"),
                              (Strategy.SHADOW, "shadow waste depends on the interval: pass interval_steps")]:
        with pytest.raises(ValueError) as err:
            expected_waste(strategy, c)
        assert str(err.value) == message


def test_adaptive_interval_warns_when_its_very_first_estimate_is_infeasible(caplog):
    policy = AdaptiveInterval(Replanner(INITIAL, min_samples=1))
    with caplog.at_level(logging.WARNING, logger="raycheck.policies.interval"):
        assert policy.observe(1, replay_step_s=1.5) is None
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"the snapshot interval stays at {policy.every_steps} steps: the shadow replays a step in 1.5 s")
