"""The controller's decision core (``orchestrator.control``), no Ray: ``step`` driven one iteration at a
time over fake components (``orchestrator.control_fakes``), each iteration's exact next state and actions."""

from __future__ import annotations

from raycheck.orchestrator.control_fakes import FakePlanner, FakeRun
from raycheck.orchestrator.control import (EmitPhase, Failed, FailRun, Finished, Initialising, InfeasiblePlan, Limits, Phase, Recovering,
                                           ReportInfeasible, RestartPersister, RestartShadow, Running, SetInterval, State, Stop, TakeSnapshot,
                                           step)

LIMITS = Limits(max_shadow_restarts=2, max_persister_restarts=2, max_worker_failures=10)


def iterate(run: FakeRun, state: State, limits: Limits = LIMITS) -> tuple:
    """One iteration of the driver's loop over ``run``: observe, step, execute the repairs."""
    after, actions = step(state, run.observe(), limits)
    run.execute(actions)
    return after, actions


def test_a_worker_failure_then_its_recovery_goes_running_recovering_running():
    run = FakeRun()
    state, actions = iterate(run, Initialising())
    assert (state, actions) == (Running(), (EmitPhase(Phase.RUNNING),))
    assert iterate(run, state) == (Running(), ())  # nothing changed: no event
    run.workers.fail()
    state, actions = iterate(run, state)
    assert (state, actions) == (Recovering(failures_pending=1), (EmitPhase(Phase.RECOVERING),))
    run.workers.fail()  # a second failure before the first recovery: still recovering, no new phase event
    state, actions = iterate(run, state)
    assert (state, actions) == (Recovering(failures_pending=2), ())
    run.workers.recover()
    state, actions = iterate(run, state)
    assert (state, actions) == (Recovering(failures_pending=1), ())
    run.workers.recover()
    assert iterate(run, state) == (Running(), (EmitPhase(Phase.RUNNING),))


def test_a_dead_persister_is_restarted_within_its_budget_then_the_run_fails():
    run = FakeRun()
    state, _ = iterate(run, Initialising())
    for used in range(2):
        run.persister.kill()
        assert iterate(run, state) == (Running(), (RestartPersister("ActorDiedError", snapshot=True),))
        assert run.persister.restarts == used + 1
    run.persister.kill()
    reason = ("the snapshot persister died after 2 restarts (max_persister_restarts 2): ActorDiedError; the step log holds "
              "every step: resume with --resume, with a larger --max-persister-restarts if the persister keeps dying")
    assert iterate(run, state) == (Failed(reason), (FailRun("persister", reason),))


def test_a_shadow_that_dies_while_a_worker_recovers_is_restarted_after_the_recovery():
    run = FakeRun()
    state, _ = iterate(run, Initialising())
    run.workers.fail()  # the injector announces the worker failure, then kills the shadow
    run.shadow.kill()
    state, actions = iterate(run, state)
    assert (state, actions) == (Recovering(failures_pending=1), (EmitPhase(Phase.RECOVERING),))  # deferred
    state, actions = iterate(run, state)
    assert (state, actions) == (Recovering(failures_pending=1), ())  # still deferred while the recovery is pending
    run.workers.recover()
    state, actions = iterate(run, state)
    assert (state, actions) == (Running(), (EmitPhase(Phase.RUNNING), RestartShadow(0)))
    assert run.shadow.restarts == [1]


RESUME_HINT = ("; the step log holds every step: resume with --resume, with a larger --max-shadow-restarts "
               "if the shadow keeps failing")


def test_a_shadow_that_dies_while_running_is_restarted_at_once_then_fails_the_run_past_its_budget():
    run = FakeRun()
    state, _ = iterate(run, Initialising())
    for used in range(2):
        run.shadow.kill(reason="replay thread died: StepLogGapError")
        assert iterate(run, state) == (Running(), (RestartShadow(0),))
        assert run.shadow.restarts == [used + 1]
    run.shadow.kill(reason="replay thread died: StepLogGapError")
    run.workers.fail()  # a spent budget fails the run whatever else this iteration saw
    reason = "the shadow failed after 2 restarts (max_shadow_restarts 2): replay thread died: StepLogGapError" + RESUME_HINT
    assert iterate(run, state) == (Failed(reason), (FailRun("shadow", reason),))


def test_a_failed_shard_is_restarted_alone_and_named_in_the_failure():
    run = FakeRun(shards=3)
    state, _ = iterate(run, Initialising())
    run.shadow.kill(1)
    assert iterate(run, state) == (Running(), (RestartShadow(1),))
    assert run.shadow.restarts == [0, 1, 0]
    run.shadow.kill(1)
    run.shadow.kill(2)
    state, actions = iterate(run, state, Limits(max_shadow_restarts=1, max_persister_restarts=2, max_worker_failures=10))
    reason = "shadow shard 1 failed after 1 restarts (max_shadow_restarts 1): actor died" + RESUME_HINT
    assert (state, actions) == (Failed(reason), (FailRun("shadow", reason),))


def test_minus_one_is_an_unlimited_budget():
    unlimited = Limits(max_shadow_restarts=-1, max_persister_restarts=-1, max_worker_failures=-1)
    run = FakeRun(persister_restarts=10**6)
    run.shadow.restarts = [10**6]
    run.shadow.kill()
    run.persister.kill()
    assert iterate(run, Running(), unlimited) == (Running(), (RestartShadow(0), RestartPersister("ActorDiedError", snapshot=True)))
    assert (run.shadow.restarts, run.persister.restarts) == ([10**6 + 1], 10**6 + 1)


def test_a_zero_budget_fails_at_the_first_death():
    run = FakeRun()
    run.persister.kill()
    none = Limits(max_shadow_restarts=0, max_persister_restarts=0, max_worker_failures=0)
    state, [action] = iterate(run, Running(), none)
    assert action.component == "persister" and action.reason.startswith("the snapshot persister died after 0 restarts")
    assert state == Failed(action.reason)


def test_fit_finishing_ok_ends_the_run_finished_and_a_finished_run_stays_finished():
    run = FakeRun()
    state, _ = iterate(run, Initialising())
    run.workers.finish()
    state, actions = iterate(run, state)
    assert (state, actions) == (Finished(), (EmitPhase(Phase.FINISHED), Stop()))
    assert iterate(run, state) == (Finished(), (Stop(),))


def test_fit_failing_ends_the_run_failed_with_its_error():
    run = FakeRun()
    state, _ = iterate(run, Initialising())
    run.workers.fail()
    state, _ = iterate(run, state)
    run.workers.finish(error="RuntimeError: max_failures reached")  # Ray Train's budget spent
    run.shadow.kill()  # its restart still waits for the recovery that never came
    state, actions = iterate(run, state)
    assert (state, actions) == (Failed("RuntimeError: max_failures reached"), (EmitPhase(Phase.FAILED), Stop()))
    assert iterate(run, state) == (state, (Stop(),))


def test_the_last_iteration_still_repairs_a_component():
    run = FakeRun()
    state, _ = iterate(run, Initialising())
    run.workers.finish()
    run.shadow.kill()  # e.g. killed in the last step: restarted so the final hash can be compared
    assert iterate(run, state) == (Finished(), (EmitPhase(Phase.FINISHED), RestartShadow(0), Stop()))


def test_a_dead_log_keeper_fails_the_run_with_its_reason():
    run = FakeRun()
    state, _ = iterate(run, Initialising())
    run.log_keeper.kill("ActorDiedError: the actor died unexpectedly")
    reason = ("the step log keeper died: ActorDiedError: the actor died unexpectedly; run/steplog.bin and rank 0's local "
              "log keep the steps: resume with --resume")
    assert iterate(run, state) == (Failed(reason), (FailRun("log_keeper", reason),))


def test_a_run_without_shadow_or_log_keeper_decides_from_the_workers_and_persister():
    run = FakeRun()
    observation = run.observe()
    bare = type(observation)(workers=observation.workers, persister=observation.persister)
    assert step(Initialising(), bare, LIMITS) == (Running(), (EmitPhase(Phase.RUNNING),))


def test_the_calibration_snapshot_is_taken_once_at_the_first_step_unless_one_was_written():
    planner = FakePlanner()
    run = FakeRun(planner=planner)
    state, actions = iterate(run, Initialising())
    assert (state, actions) == (Running(), (EmitPhase(Phase.RUNNING),))  # no step fed yet: nothing to calibrate from
    planner.feed()
    assert iterate(run, state) == (Running(), (TakeSnapshot(1),))  # the snapshot of the next step
    planner.feed()
    assert iterate(run, state) == (Running(), ())  # requested once, by this driver or an earlier one
    resumed = FakePlanner()
    resumed.written = 1  # the persister has written one already: the policy has a measured cost
    resumed.feed()
    assert iterate(FakeRun(planner=resumed), Running()) == (Running(), ())


def test_a_replan_is_recorded_and_applied_to_the_shadow_and_each_infeasible_spell_reported_once():
    planner = FakePlanner(interval=10)
    planner.calibration_requested = True
    run = FakeRun(planner=planner)
    state, _ = iterate(run, Initialising())
    planner.feed(interval=7)
    planner.feed(interval=5)  # two re-plans between two observations: both recorded, the newest applied
    state, actions = iterate(run, state)
    assert [type(a).__name__ for a in actions] == ["RecordReplan", "RecordReplan", "SetInterval"]
    assert ([a.record.interval_steps for a in actions[:2]], actions[2]) == ([7, 5], SetInterval(5))
    assert planner.in_force == 5 and iterate(run, state) == (Running(), ())
    planner.feed(infeasible="the shadow replays slower than a step")
    planner.feed()  # the spell goes on: no second report
    state, actions = iterate(run, state)
    assert actions == (ReportInfeasible(InfeasiblePlan(2, 5, "the shadow replays slower than a step")),)


def test_plan_actions_come_after_the_repairs_and_before_stop_and_not_after_a_component_fails():
    planner = FakePlanner(interval=10)
    run = FakeRun(planner=planner)
    state, _ = iterate(run, Initialising())
    planner.feed(interval=4)
    run.persister.kill()
    run.workers.finish()
    state, actions = iterate(run, state)
    assert [type(a).__name__ for a in actions] == ["EmitPhase", "RestartPersister", "RecordReplan", "SetInterval", "TakeSnapshot", "Stop"]
    dead = FakeRun(planner=FakePlanner())
    dead.planner.feed(interval=3)
    dead.log_keeper.kill("disk full")
    state, actions = iterate(dead, Running())
    assert isinstance(state, Failed) and [type(a).__name__ for a in actions] == ["FailRun"]
