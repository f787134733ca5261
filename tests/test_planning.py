"""The controller's feed of measured costs into the cost-model policy."""

from raycheck.orchestrator.planning import INITIAL_COSTS, SnapshotPlanner
from raycheck.policies.costs import MeasuredCosts
from raycheck.policies.models import Strategy, optimal_interval_steps


def row(step_s: float) -> dict:
    return {"step_seconds": step_s, "log_append_seconds": 0.001}


def test_planner_starts_at_the_model_optimum_and_replans_from_measurements():
    planner = SnapshotPlanner(mtbf_s=600.0)
    first = planner.every_steps
    assert first == optimal_interval_steps(Strategy.SHADOW, MeasuredCosts(mtbf_s=600.0, **INITIAL_COSTS))
    shadow = {"replay_seconds_per_step": 0.1}
    persister = {"written": 2, "failed": 0, "write_seconds": 1.0}
    records = []
    for step in range(20):  # the job measures other costs than assumed: the plan must follow them
        rec = planner.observe(step, row(0.5), shadow, persister, [], failures=0, elapsed_s=0.5 * (step + 1))
        records.append(rec)
    changes = [r for r in records if r is not None]
    assert changes and changes[0].previous_interval_steps == first
    assert changes[0].inputs["step_s"] == 0.5 and changes[0].inputs["snapshot_s"] == 0.5
    last = changes[-1]
    assert planner.every_steps == last.interval_steps != first
    assert last.interval_steps == optimal_interval_steps(Strategy.SHADOW, MeasuredCosts(**last.inputs))


def test_each_recovery_is_one_sample_and_failures_shrink_the_interval():
    planner = SnapshotPlanner(mtbf_s=3600.0, cooldown_steps=0)
    shadow, persister = {"replay_seconds_per_step": 1.0}, {"written": 1, "failed": 0, "write_seconds": 5.0}
    for step in range(5):
        planner.observe(step, row(5.0), shadow, persister, [], failures=0, elapsed_s=5.0 * (step + 1))
    calm = planner.every_steps
    recs = [{"load_seconds": 2.0, "restart_seconds": 20.0}]
    for step in range(5, 10):  # three failures within a minute: the MTBF estimate collapses
        planner.observe(step, row(5.0), shadow, persister, recs, failures=3, elapsed_s=60.0)
    assert planner.every_steps < calm
    assert planner.policy.replanner.estimates["restart_s"].count == 1


def test_a_shadow_slower_than_a_step_keeps_the_plan_and_the_planner_says_why():
    planner = SnapshotPlanner(mtbf_s=600.0)
    first, persister = planner.every_steps, {"written": 1, "failed": 0, "write_seconds": 0.5}
    for step in range(10):
        assert planner.observe(step, row(0.5), {"replay_seconds_per_step": 0.8}, persister, [], failures=0,
                               elapsed_s=0.5 * (step + 1)) is None
    assert planner.every_steps == first
    assert planner.infeasible.startswith("the shadow replays a step in 0.8 s but training takes 0.5 s a step")


def test_a_planner_saved_and_loaded_goes_on_with_its_measured_costs_interval_and_elapsed_time():
    """``--resume`` keeps what was measured: a planner loaded from another's ``state_dict`` (through JSON, as
    ``controller.json`` holds it) has its interval, re-plans, estimates and recoveries counted, and, fed the
    same next steps with the seconds since ITS start, decides exactly as the one that never stopped."""
    import json

    shadow, persister = {"replay_seconds_per_step": 0.1}, {"written": 2, "failed": 0, "write_seconds": 1.0}
    recs = [{"load_seconds": 2.0, "restart_seconds": 20.0}]
    planner = SnapshotPlanner(mtbf_s=600.0, cooldown_steps=0)
    for step in range(12):
        planner.observe(step, row(0.5), shadow, persister, recs, failures=1, elapsed_s=0.5 * (step + 1))
    assert planner.every_steps != SnapshotPlanner(mtbf_s=600.0).every_steps  # it measured something new
    resumed = SnapshotPlanner(mtbf_s=600.0, cooldown_steps=0)
    resumed.load_state_dict(json.loads(json.dumps(planner.state_dict())))
    assert resumed.every_steps == planner.every_steps and resumed.policy.records == planner.policy.records
    assert resumed.state_dict() == planner.state_dict()
    for step in range(12, 40):  # the run goes on: 2000 s more without failure, the MTBF estimate grows
        elapsed = 0.5 * 12 + 100.0 * (step - 11)
        expected = planner.observe(step, row(0.5), shadow, persister, recs, failures=1, elapsed_s=elapsed)
        assert resumed.observe(step, row(0.5), shadow, persister, recs, failures=1, elapsed_s=elapsed - 0.5 * 12) == expected
    assert resumed.state_dict() == planner.state_dict() and len(planner.policy.records) > 2


def test_observe_rows_feeds_each_step_once_and_reports_its_replans_spells_and_intervals():
    """``observe_rows`` (what the controller calls each iteration): only the rows past the newest step fed,
    each once even when the same rows come again (a resumed driver's earlier rows); the status carries the
    re-plans and the first step of an infeasible spell of these rows alone, and ``interval_at`` gives each
    step the interval planned once it was fed."""
    planner = SnapshotPlanner(mtbf_s=600.0, cooldown_steps=0)
    first = planner.every_steps
    persister = {"written": 2, "failed": 0, "write_seconds": 1.0}
    rows = [{"step": s, "unix_s": 100.0 + 0.5 * s, **row(0.5)} for s in range(6)]
    plan = planner.observe_rows(rows, [], {"replay_seconds_per_step": 0.1}, persister, t_start=100.0, in_force_steps=first)
    assert (plan.step, plan.interval_steps, plan.in_force_steps, plan.snapshots_written) == (5, planner.every_steps, first, 2)
    assert plan.replans and plan.replans[0].previous_interval_steps == first and not plan.infeasible
    assert planner.policy.replanner.estimates["step_s"].count == 6
    again = planner.observe_rows(rows, [], {"replay_seconds_per_step": 0.1}, persister, t_start=100.0,
                                 in_force_steps=plan.interval_steps)
    assert (again.step, again.replans, planner.policy.replanner.estimates["step_s"].count) == (5, (), 6)  # nothing fed twice
    changed = plan.replans[0].step
    assert [planner.interval_at(s) for s in range(changed)] == [first] * changed
    assert planner.interval_at(5) == planner.interval_at(10**6) == planner.every_steps
    slow = [{"step": s, "unix_s": 104.0 + 0.5 * s, **row(0.5)} for s in range(6, 20)]
    plan = planner.observe_rows(rows + slow, [], {"replay_seconds_per_step": 5.0}, persister, t_start=100.0,
                                in_force_steps=plan.interval_steps)
    assert len(plan.infeasible) == 1 and plan.step == 19 and plan.interval_steps == planner.every_steps
    assert plan.infeasible[0].interval_steps == planner.every_steps and 6 <= plan.infeasible[0].step < 19
    assert plan.infeasible[0].reason.startswith("the shadow replays a step in")
