"""The controller's decisions, pure (no Ray): states, frozen status snapshots in, transitions and actions out.

One iteration of the driver's loop (``orchestrator.controller.Controller``) polls its components,
bundles what they said into an ``Observation`` of frozen snapshots (``WorkerGroupStatus``,
``ShadowStatus``, ``PersisterStatus``, ``LogKeeperStatus``) and calls ``step``, which returns the next
state and the actions the controller executes, in order. The states:
Initialising -> Running <-> Recovering(failures_pending) -> Finished | Failed(reason).

- ``Running`` becomes ``Recovering`` while the event stream holds more worker failures than
  recoveries, and goes back once each has its recovery; ``Finished`` or ``Failed`` once ``fit`` has
  returned (ok or not). A change of phase is an ``EmitPhase``; a terminal state adds ``Stop``.
- A failed shadow shard is restarted (``RestartShadow``) only while no worker recovery is pending, a
  dead persister is restarted (``RestartPersister``, and the shadow snapshots at once), each within its
  budget (``Limits``, -1: unlimited; ``within_budget``); past it, and whenever the log keeper died, the
  run fails (``FailRun``, the state ``Failed``), before any other action of that iteration.
- A preemption notice (``orchestrator.preemption.DrainNotice``: a draining node that holds a component)
  is recorded (``RecordNotice``); shadow shards on it hand off their image and move (``HandOffShadow``),
  a persister on it finishes its write and moves (``MovePersister``); neither counts against a budget.
- The adaptive snapshot policy (``PlanStatus``, from the steps the observation fed it): each re-plan
  is recorded (``RecordReplan``) and the shadow snapshots at the planned interval (``SetInterval``);
  the first step of each spell without a feasible plan is reported (``ReportInfeasible``); and until
  a snapshot has been written, one is taken at once (``TakeSnapshot``, the calibration snapshot: the
  policy needs a measured snapshot cost, not the assumed one).

The worker group's budget (``Limits.max_worker_failures``) is Ray Train's own restart budget
(``FailureConfig.max_failures``, the mechanism that restarts the group): once spent, ``fit`` fails and
``step`` sees it as ``WorkerGroupStatus.ok`` False.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Union

from raycheck.orchestrator.preemption import DrainNotice
from raycheck.policies.budgets import within_budget
from raycheck.policies.replan import ReplanRecord


class Phase(enum.Enum):
    """The phase of a run as ``phase`` events and ``summary.json`` name it."""

    INITIALISING = "initialising"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"


# -- frozen status snapshots: what one poll of each component said --------------------------------

@dataclass(frozen=True)
class WorkerGroupStatus:
    """The train workers: whether Ray Train's ``fit`` still runs, how it ended, and the worker failures
    and recoveries (counts of ``failure`` events with target ``worker`` and of ``recovery`` events)."""

    running: bool
    ok: bool = False
    """Whether ``fit`` returned without an error (False while it runs)."""
    error: str | None = None
    """``<ErrorType>: message`` of a ``fit`` that raised."""
    failures: int = 0
    recoveries: int = 0
    code_error: str | None = None
    """The first ``code_error`` event's error: your loop's code broke a rule (``workers.zo_session.CodeError``),
    which every restart would meet again."""

    @property
    def recovery_pending(self) -> bool:
        """Whether a worker failure has no recovery yet."""
        return self.failures > self.recoveries


def worker_failures_and_recoveries(events: list[dict]) -> tuple[int, int]:
    """Counts of worker failures and of worker recoveries in an event stream."""
    failures = sum(1 for e in events if e["kind"] == "failure" and e["target"] == "worker")
    return failures, sum(1 for e in events if e["kind"] == "recovery")


def worker_group_status(running: bool, outcome: dict, events: list[dict]) -> WorkerGroupStatus:
    """The snapshot of the worker group from its ``fit`` thread (``running``; ``outcome``: ``ok`` and,
    when it raised, ``error``, once it returned) and the run's event stream."""
    failures, recoveries = worker_failures_and_recoveries(events)
    code_error = next((e["error"] for e in events if e["kind"] == "code_error"), None)
    return WorkerGroupStatus(running=running, ok=outcome.get("ok", False), error=outcome.get("error"),
                             failures=failures, recoveries=recoveries, code_error=code_error)


@dataclass(frozen=True)
class ShardStatus:
    """One shadow shard (the whole shadow when unsharded) as its last poll saw it."""

    shard: int
    restarts: int
    """Restarts of this shard so far (its current incarnation number)."""
    failure: str | None = None
    """Why it failed (the first reason seen since its last restart), when this poll's answer says it has
    (dead actor, or a replay thread stopped); None when it runs or has not answered yet."""


@dataclass(frozen=True)
class ShadowStatus:
    """Every shard of the shadow, in shard order."""

    shards: tuple[ShardStatus, ...]


@dataclass(frozen=True)
class PersisterStatus:
    """The snapshot persister's last poll."""

    restarts: int
    """Restarts so far in this run (each started incarnation counts, whether or not it came up)."""
    died: str | None = None
    """The error type of a poll that found it dead; None when it answered (or only timed out)."""


@dataclass(frozen=True)
class LogKeeperStatus:
    """The step log keeper's last poll."""

    log_path: str
    """The run directory's step log, which keeps every step when the keeper is gone."""
    died: str | None = None
    """The last line of the error that ended it, when this poll found it dead."""


@dataclass(frozen=True)
class InfeasiblePlan:
    """The first step of a spell in which the measured costs admit no snapshot plan (the interval in
    force is kept): ``reason`` is ``policies.costs.InfeasibleError``'s message."""

    step: int
    interval_steps: int
    reason: str


@dataclass(frozen=True)
class PlanStatus:
    """The adaptive snapshot policy after the steps one observation fed it
    (``orchestrator.planning.SnapshotPlanner.observe_rows``)."""

    step: int
    """The newest step fed so far (-1: none yet)."""
    interval_steps: int
    """The interval the policy plans, in steps."""
    in_force_steps: int
    """The interval the shadow snapshots at now, in steps."""
    replans: tuple[ReplanRecord, ...] = ()
    """The re-plans of the steps this observation fed, oldest first."""
    infeasible: tuple[InfeasiblePlan, ...] = ()
    """The spells without a feasible plan that began at the steps this observation fed."""
    calibration_requested: bool = False
    """Whether the calibration snapshot was taken already (by this driver or an earlier one of the run)."""
    snapshots_written: int = 0
    """Snapshots the persister has written (its last status)."""


@dataclass(frozen=True)
class Observation:
    """What one iteration of the driver's loop saw: the worker group and each component the run has
    (None: the run has none, e.g. no shadow in a first-order run, no log keeper without a step log, no
    plan without the adaptive snapshot policy)."""

    workers: WorkerGroupStatus
    persister: PersisterStatus
    shadow: ShadowStatus | None = None
    log_keeper: LogKeeperStatus | None = None
    plan: PlanStatus | None = None
    notices: tuple[DrainNotice, ...] = ()
    """Preemption notices first seen in this iteration (``orchestrator.preemption.DrainWatch``)."""


@dataclass(frozen=True)
class Limits:
    """The run's restart budgets (``JobConfig``'s fields of the same names; -1: unlimited)."""

    max_shadow_restarts: int
    """Per shard."""
    max_persister_restarts: int
    max_worker_failures: int
    """Ray Train's (``FailureConfig.max_failures``): the controller hands it on, ``fit`` enforces it."""


# -- states -----------------------------------------------------------------------------------------

class _State:
    """A state of the run; each subclass names its ``phase``."""

    phase: ClassVar[Phase]

    def __init_subclass__(cls, phase: Phase, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.phase = phase


@dataclass(frozen=True)
class Initialising(_State, phase=Phase.INITIALISING):
    """Components started, ``fit`` not yet observed."""


@dataclass(frozen=True)
class Running(_State, phase=Phase.RUNNING):
    """Training, no worker failure without its recovery."""


@dataclass(frozen=True)
class Recovering(_State, phase=Phase.RECOVERING):
    """``failures_pending`` worker failures (>= 1) have no recovery yet."""

    failures_pending: int


@dataclass(frozen=True)
class Finished(_State, phase=Phase.FINISHED):
    """``fit`` returned without an error."""


@dataclass(frozen=True)
class Failed(_State, phase=Phase.FAILED):
    """The run failed: ``fit`` raised, or a component is beyond repair (``reason`` says which and why)."""

    reason: str | None


State = Union[Initialising, Running, Recovering, Finished, Failed]


# -- actions ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EmitPhase:
    """Record a ``phase`` event (and its progress line)."""

    phase: Phase


@dataclass(frozen=True)
class RestartShadow:
    """Kill shadow shard ``shard`` and start its next incarnation."""

    shard: int


@dataclass(frozen=True)
class RestartPersister:
    """Start a new snapshot persister after one died (``reason``: the error type); once it answers, with
    ``snapshot``, the shadow snapshots at once, so durability in storage resumes without waiting for the
    next interval."""

    reason: str
    snapshot: bool = False


@dataclass(frozen=True)
class RecordReplan:
    """Record a re-plan of the snapshot interval (a ``replan`` event)."""

    record: ReplanRecord


@dataclass(frozen=True)
class SetInterval:
    """Make the shadow (every shard, and each later incarnation) snapshot every ``every_steps`` steps."""

    every_steps: int


@dataclass(frozen=True)
class ReportInfeasible:
    """Record that the policy has no feasible plan from ``plan.step`` on (a ``plan_infeasible`` event)."""

    plan: InfeasiblePlan


@dataclass(frozen=True)
class TakeSnapshot:
    """Have the shadow hand its state to the persister now, without waiting (the calibration snapshot,
    of step ``step``: a ``calibration_snapshot`` event)."""

    step: int


@dataclass(frozen=True)
class RecordNotice:
    """Record a preemption notice (a ``preemption_notice`` event: the node, its deadline, what it holds)."""

    notice: DrainNotice


@dataclass(frozen=True)
class HandOffShadow:
    """Shadow shards ``shards`` sit on a draining node: have the shadow hand its current image to the persister,
    wait until it is committed, then start those shards again elsewhere (from that snapshot), not counted
    against ``max_shadow_restarts``."""

    notice: DrainNotice
    shards: tuple[int, ...]


@dataclass(frozen=True)
class MovePersister:
    """The persister sits on a draining node: let it finish its pending write, then start it again elsewhere,
    not counted against ``max_persister_restarts``."""

    notice: DrainNotice


@dataclass(frozen=True)
class FailRun:
    """End the run as failed: ``component`` (``shadow``, ``persister`` or ``log_keeper``) is beyond
    repair, or (``worker_code``) a worker's code broke a rule that a restart would meet again; ``reason`` is
    the whole message of the run's error."""

    component: str
    reason: str


@dataclass(frozen=True)
class Stop:
    """Leave the loop: the run has ended (``Finished`` or ``Failed`` through ``fit``)."""


Action = Union[EmitPhase, RestartShadow, RestartPersister, RecordReplan, SetInterval, ReportInfeasible, TakeSnapshot, RecordNotice,
               HandOffShadow, MovePersister, FailRun, Stop]


# -- decisions --------------------------------------------------------------------------------------

SHADOW_RESUME_HINT = ("; the step log holds every step: resume with --resume, with a larger --max-shadow-restarts if "
                      "the shadow keeps failing")
"""How a run failed by its shadow ends its reason: nothing logged is lost, and how to go on."""


def shard_action(shard: ShardStatus, sharded: bool, max_restarts: int, recovery_pending: bool) -> RestartShadow | FailRun | None:
    """What to do with one shadow shard: nothing while it runs (or has not answered) and while a worker
    recovery is pending (the recovering worker must see the shadow as it was at the failure); else
    restart it within ``max_restarts``, past it fail the run."""
    if shard.failure is None:
        return None
    if not within_budget(shard.restarts, max_restarts):
        what = f"shadow shard {shard.shard}" if sharded else "the shadow"
        return FailRun("shadow", f"{what} failed after {shard.restarts} restarts (max_shadow_restarts {max_restarts}): "
                                 f"{shard.failure}{SHADOW_RESUME_HINT}")
    return None if recovery_pending else RestartShadow(shard.shard)


def persister_action(persister: PersisterStatus, max_restarts: int, snapshot: bool = False) -> RestartPersister | FailRun | None:
    """Restart a dead snapshot persister within ``max_restarts`` (``snapshot``: the shadow snapshots into
    the new one); past it fail the run."""
    if persister.died is None:
        return None
    if within_budget(persister.restarts, max_restarts):
        return RestartPersister(persister.died, snapshot)
    return FailRun("persister", f"the snapshot persister died after {persister.restarts} restarts (max_persister_restarts "
                                f"{max_restarts}): {persister.died}; the step log holds every step: resume with --resume, "
                                "with a larger --max-persister-restarts if the persister keeps dying")


def log_keeper_action(keeper: LogKeeperStatus) -> FailRun | None:
    """A dead log keeper fails the run (its log file and rank 0's local log keep the steps)."""
    if keeper.died is None:
        return None
    return FailRun("log_keeper", f"the step log keeper died: {keeper.died}; {keeper.log_path} and rank 0's local log keep "
                                 "the steps: resume with --resume")


def component_actions(limits: Limits, shadow: ShadowStatus | None = None, persister: PersisterStatus | None = None,
                      log_keeper: LogKeeperStatus | None = None, recovery_pending: bool = False,
                      has_shadow: bool | None = None) -> tuple[Action, ...]:
    """The repairs the component snapshots call for, shadow shards first, then the persister, then the
    log keeper; when one is beyond repair, only its ``FailRun`` (the first such). A restarted persister
    gets a snapshot at once when the run has a shadow (``has_shadow``; None: whether ``shadow`` is given)."""
    decided: list[Action | None] = [shard_action(s, len(shadow.shards) > 1, limits.max_shadow_restarts, recovery_pending) for s in shadow.shards] if shadow else []
    snapshot = shadow is not None if has_shadow is None else has_shadow
    decided.append(persister_action(persister, limits.max_persister_restarts, snapshot=snapshot) if persister else None)
    decided.append(log_keeper_action(log_keeper) if log_keeper else None)
    actions = tuple(a for a in decided if a is not None)
    failed = [a for a in actions if isinstance(a, FailRun)]
    return (failed[0],) if failed else actions


def plan_actions(plan: PlanStatus) -> tuple[Action, ...]:
    """What the adaptive snapshot policy's ``plan`` calls for, in order: a ``RecordReplan`` per re-plan,
    ``SetInterval`` when the planned interval is not the one in force, a ``ReportInfeasible`` per spell
    begun, and the calibration ``TakeSnapshot`` (of the step after the newest) while no snapshot has been
    written and none was requested."""
    actions: list[Action] = [RecordReplan(r) for r in plan.replans]
    if plan.interval_steps != plan.in_force_steps:
        actions.append(SetInterval(plan.interval_steps))
    actions += [ReportInfeasible(spell) for spell in plan.infeasible]
    if plan.step >= 0 and not plan.calibration_requested and not plan.snapshots_written:
        actions.append(TakeSnapshot(plan.step + 1))
    return tuple(actions)


def preemption_actions(notices: tuple[DrainNotice, ...], has_shadow: bool) -> tuple[Action, ...]:
    """What each new preemption notice calls for, in order: record it, then (when the node holds them) the
    shadow's hand-off (before the persister moves: the hand-off is written by the persister of the node)
    and the persister's move. The train workers on the node need nothing from the driver: Ray Train tells
    them (``workers.preempt``) and restarts them at the deadline."""
    actions: list[Action] = []
    for notice in notices:
        actions.append(RecordNotice(notice))
        if notice.shards and has_shadow:
            actions.append(HandOffShadow(notice, notice.shards))
        if "persister" in notice.components:
            actions.append(MovePersister(notice))
    return tuple(actions)


def workers_state(workers: WorkerGroupStatus) -> State:
    """The state the worker group alone puts the run in."""
    if not workers.running:
        return Finished() if workers.ok else Failed(workers.error)
    if workers.recovery_pending:
        return Recovering(workers.failures - workers.recoveries)
    return Running()


def step(state: State, observation: Observation, limits: Limits) -> tuple[State, tuple[Action, ...]]:
    """One iteration of the controller (pure): the next state and the actions to execute, in order.

    A terminal state stays as it is (``Stop``). A worker's code error (``WorkerGroupStatus.code_error``) or a
    component beyond repair: ``Failed(reason)`` and its ``FailRun`` alone. Otherwise the state of the worker group (``workers_state``), an ``EmitPhase``
    when its phase differs from ``state``'s, the component repairs (``component_actions``), what new
    preemption notices call for (``preemption_actions``, while the run goes on), the snapshot policy's
    actions (``plan_actions``), and ``Stop`` when the new state is terminal.
    """
    if isinstance(state, (Finished, Failed)):
        return state, (Stop(),)
    if observation.workers.code_error is not None:
        return Failed(observation.workers.code_error), (FailRun("worker_code", observation.workers.code_error),)
    repairs = component_actions(limits, observation.shadow, observation.persister, observation.log_keeper,
                                observation.workers.recovery_pending)
    if repairs and isinstance(repairs[0], FailRun):
        return Failed(repairs[0].reason), repairs
    after = workers_state(observation.workers)
    emit: tuple[Action, ...] = (EmitPhase(after.phase),) if after.phase is not state.phase else ()
    plan = plan_actions(observation.plan) if observation.plan is not None else ()
    preempted = preemption_actions(observation.notices, observation.shadow is not None) if not isinstance(after, (Finished, Failed)) else ()
    stop: tuple[Action, ...] = (Stop(),) if isinstance(after, (Finished, Failed)) else ()
    return after, emit + repairs + preempted + plan + stop
