"""Online re-planning: robust estimates, hysteresis, state round trips, the adaptive interval, and the one
rule that decides when a snapshot is due (``policies.interval.snapshot_due``)."""

from __future__ import annotations

import json
import logging

import pytest

from raycheck.policies.costs import InfeasibleError, MeasuredCosts
from raycheck.policies.interval import AdaptiveInterval, SnapshotSchedule, snapshot_due
from raycheck.policies.models import Strategy, optimal_interval_steps
from raycheck.policies.replan import Replanner, RobustEwma

INITIAL = MeasuredCosts(step_s=1.0, replay_step_s=0.2, snapshot_s=10.0, restart_s=60.0, load_s=5.0, mtbf_s=3600.0)


def test_robust_ewma_ignores_an_isolated_outlier_and_follows_a_sustained_change():
    est = RobustEwma(alpha=0.5, window=5)
    for x in (1.0, 1.0, 1.0, 50.0, 1.0):
        est.update(x)
    assert est.value == 1.0
    for _ in range(12):
        est.update(2.0)
    assert est.value == pytest.approx(2.0, abs=0.01)


def test_initial_plan_is_the_model_optimum_and_small_drifts_do_not_replan():
    rp = Replanner(INITIAL, threshold=0.2)
    k0 = optimal_interval_steps(Strategy.SHADOW, INITIAL)
    assert rp.interval_steps == k0 and rp.first_record.reason.startswith("initial")
    # replay 0.2 -> 0.24 s moves the optimum by about 9% (sqrt(0.2 / 0.24)): inside the dead band
    for step in range(1, 20):
        decision = rp.update(step, {"replay_step_s": 0.24, "step_s": 1.0})
        assert decision.record is None and decision.interval_steps == k0
    assert rp.estimated_costs().replay_step_s == pytest.approx(0.24, rel=0.01)


def test_a_drift_beyond_the_threshold_replans_once_with_its_inputs_and_does_not_flap():
    rp = Replanner(INITIAL, threshold=0.2)
    k0 = rp.interval_steps
    records = [d.record for step in range(1, 40) if (d := rp.update(step, {"replay_step_s": 0.8})).record]
    assert len(records) == 1
    rec = records[0]
    assert rec.previous_interval_steps == k0 and rec.interval_steps == rp.interval_steps < k0 * 0.6
    assert rec.inputs["replay_step_s"] > 0.6 and rec.inputs["mtbf_s"] == 3600.0
    assert "optimum moved" in rec.reason and rec.expected_waste_ratio > 0
    # noise around the new level stays inside the dead band
    k1 = rp.interval_steps
    for step in range(40, 80):
        assert rp.update(step, {"replay_step_s": 0.8 * (1.1 if step % 2 else 0.9)}).interval_steps == k1


def test_failure_counters_move_the_mtbf_estimate_and_the_plan():
    rp = Replanner(INITIAL, threshold=0.2, prior_failures=1.0)
    k0 = rp.interval_steps
    decision = rp.update(500, failures=9, elapsed_s=6000.0)  # 10 failures in 9600 s: MTBF 960 s
    assert rp.estimated_costs().mtbf_s == pytest.approx((3600.0 + 6000.0) / 10)
    assert decision.record is not None and decision.interval_steps < k0
    assert decision.record.inputs["mtbf_s"] == pytest.approx(960.0)


def test_cooldown_delays_a_replan():
    rp = Replanner(INITIAL, threshold=0.2, cooldown_steps=100)
    assert all(rp.update(step, {"replay_step_s": 0.8}).record is None for step in range(1, 100))
    assert rp.update(100, {"replay_step_s": 0.8}).record is not None


def test_infeasible_estimates_keep_the_plan_and_say_why():
    rp = Replanner(INITIAL)
    k0 = rp.interval_steps
    for step in range(1, 6):
        decision = rp.update(step, {"replay_step_s": 1.5})
    assert decision.interval_steps == k0 and "lag grows without bound" in decision.infeasible
    with pytest.raises(InfeasibleError):
        Replanner(INITIAL.replace(replay_step_s=2.0))


def test_bad_measurements_are_rejected():
    rp = Replanner(INITIAL)
    with pytest.raises(ValueError, match="unknown measurement 'mtbf_s'"):
        rp.update(1, {"mtbf_s": 5.0})
    with pytest.raises(ValueError, match="replay_step_s must be >= 0"):
        rp.update(1, {"replay_step_s": -1.0})


def test_replanner_state_round_trips_through_json():
    a = Replanner(INITIAL, threshold=0.1)
    for step in range(1, 30):
        a.update(step, {"replay_step_s": 0.5, "snapshot_s": 12.0}, failures=2, elapsed_s=step * 100.0)
    b = Replanner(INITIAL, threshold=0.1)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict() and b.estimated_costs() == a.estimated_costs()
    for step in range(30, 60):
        m = {"replay_step_s": 0.9}
        assert a.update(step, m) == b.update(step, m)


def test_adaptive_interval_follows_the_replanner_and_keeps_records(caplog):
    policy = AdaptiveInterval(Replanner(INITIAL, threshold=0.2))
    k0 = policy.every_steps
    with caplog.at_level(logging.INFO, logger="raycheck.policies.interval"):
        changes = [r for step in range(1, 20) if (r := policy.observe(step, replay_step_s=0.8)) is not None]
    assert len(changes) == 1 and policy.every_steps == changes[0].interval_steps < k0
    assert [r.interval_steps for r in policy.records] == [k0, policy.every_steps]
    assert "re-plan at step" in caplog.text and "replay_step_s" in caplog.text

    restored = AdaptiveInterval(Replanner(INITIAL, threshold=0.2))
    restored.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert restored.every_steps == policy.every_steps and restored.records == policy.records


def test_a_snapshot_is_due_when_the_steps_since_the_last_one_reach_the_interval():
    assert [s for s in range(1, 31) if snapshot_due(s, 0, 10)] == list(range(10, 31))
    assert not snapshot_due(12, 3, 10) and snapshot_due(13, 3, 10)
    assert not any(snapshot_due(s, 0, 0) for s in range(100))  # 0: never (log-only)
    schedule = SnapshotSchedule(every_steps=10)
    assert [s for s in range(1, 31) if schedule.take_if_due(s)] == [10, 20, 30]
    with pytest.raises(ValueError, match="every_steps must be >= 0, got -1"):
        schedule.set_interval(-1)


def test_replans_never_postpone_a_snapshot_past_the_new_interval():
    """``make run`` (issue 14): a calibration snapshot at step 1, then the interval went 16 -> 21 -> 26 -> 19
    between steps 5 and 21; with snapshots at multiples of the interval none fell before step 38."""
    replans = {5: 21, 12: 26, 21: 19, 50: 30, 75: 3}  # step -> the interval in force from that step on
    schedule = SnapshotSchedule(every_steps=16, last_step=0)
    schedule.taken(1)  # the calibration snapshot
    taken = []
    for step in range(2, 80):
        if step in replans:
            schedule.set_interval(replans[step])
        if schedule.take_if_due(step):
            taken.append(step)
    # 21: the gap (20) already reaches the new 19; 40: 19 later; 70: the longer 30 counts from 40, not
    # from a multiple; 75: the shorter 3 is due at once; then every 3 steps
    assert taken == [21, 40, 70, 75, 78]


def test_a_loop_that_starts_from_a_restore_counts_the_interval_from_it():
    schedule = SnapshotSchedule(every_steps=4)  # no last step: the first step seen starts from a restore
    assert [s for s in range(7, 20) if schedule.take_if_due(s)] == [10, 14, 18]
