"""Fakes of what the controller polls, for driving ``orchestrator.control.step`` without Ray: each keeps
the state of one component and returns the frozen snapshot that ``orchestrator.control`` defines for it
(the worker group's through ``orchestrator.control.worker_group_status``, as the controller builds it).

They live next to the interfaces they fake, so a change of a snapshot type meets its fake in the same
package (and under the type checker); ``tests/test_control.py`` drives the state machine with them."""

from __future__ import annotations

from raycheck.orchestrator.control import (Action, InfeasiblePlan, LogKeeperStatus, Observation, PersisterStatus, PlanStatus, RestartPersister,
                                           RestartShadow, SetInterval, ShadowStatus, ShardStatus, TakeSnapshot, WorkerGroupStatus,
                                           worker_group_status)
from raycheck.policies.replan import ReplanRecord


class FakeWorkerGroup:
    """Ray Train's ``fit`` and the workers' events: ``fail``, ``recover``, ``finish``."""

    def __init__(self) -> None:
        self.running = True
        self.outcome: dict = {}
        self.events: list[dict] = []

    def fail(self) -> None:
        """A worker failed (its ``failure`` event with target ``worker``)."""
        self.events.append({"kind": "failure", "target": "worker"})

    def recover(self) -> None:
        """A worker restored its state (its ``recovery`` event)."""
        self.events.append({"kind": "recovery"})

    def finish(self, error: str | None = None) -> None:
        """``fit`` returned, or raised ``error`` (``<ErrorType>: message``)."""
        self.running = False
        self.outcome = {"ok": True} if error is None else {"ok": False, "error": error}

    def status(self) -> WorkerGroupStatus:
        return worker_group_status(self.running, self.outcome, self.events)


class FakeShadow:
    """The shadow's shards: ``kill`` one; ``restart`` it as ``ShadowKeeper.restart`` does."""

    def __init__(self, shards: int = 1) -> None:
        self.restarts = [0] * shards
        self.failures: list[str | None] = [None] * shards

    def kill(self, shard: int = 0, reason: str = "actor died") -> None:
        self.failures[shard] = reason

    def restart(self, shard: int) -> None:
        self.restarts[shard] += 1
        self.failures[shard] = None

    def status(self) -> ShadowStatus:
        return ShadowStatus(tuple(ShardStatus(i, n, f) for i, (n, f) in enumerate(zip(self.restarts, self.failures))))


class FakePersister:
    """The snapshot persister: ``kill`` it; ``restart`` it as ``Controller._restart_persister`` does."""

    def __init__(self, restarts: int = 0) -> None:
        self.restarts = restarts
        self.died: str | None = None

    def kill(self) -> None:
        self.died = "ActorDiedError"

    def restart(self) -> None:
        self.restarts += 1
        self.died = None

    def status(self) -> PersisterStatus:
        return PersisterStatus(self.restarts, self.died)


class FakeLogKeeper:
    """The step log keeper: ``kill`` it."""

    def __init__(self) -> None:
        self.died: str | None = None

    def kill(self, reason: str) -> None:
        self.died = reason

    def status(self) -> LogKeeperStatus:
        return LogKeeperStatus("run/steplog.bin", self.died)


class FakePlanner:
    """The adaptive snapshot policy fed step by step: ``feed`` one step (a re-plan to ``interval``, or the
    start of a spell without a feasible plan, ``infeasible``), ``status`` the plan of the steps fed since
    the last one (as ``orchestrator.planning.SnapshotPlanner.observe_rows`` returns it)."""

    def __init__(self, interval: int = 10) -> None:
        self.step, self.interval, self.in_force = -1, interval, interval
        self.replans: list[ReplanRecord] = []
        self.infeasible: list[InfeasiblePlan] = []
        self.calibration_requested, self.written = False, 0

    def feed(self, interval: int | None = None, infeasible: str | None = None) -> None:
        self.step += 1
        if interval is not None:
            self.replans.append(ReplanRecord(step=self.step, previous_interval_steps=self.interval, interval_steps=interval,
                                             expected_waste_ratio=0.1, reason="measured costs changed", inputs={}))
            self.interval = interval
        if infeasible is not None:
            self.infeasible.append(InfeasiblePlan(self.step, self.interval, infeasible))

    def status(self) -> PlanStatus:
        plan = PlanStatus(step=self.step, interval_steps=self.interval, in_force_steps=self.in_force, replans=tuple(self.replans),
                          infeasible=tuple(self.infeasible), calibration_requested=self.calibration_requested,
                          snapshots_written=self.written)
        self.replans, self.infeasible = [], []
        return plan


class FakeRun:
    """One fake of each component (a planner with ``planner``); ``observe`` bundles their snapshots,
    ``execute`` carries out the repairs and plan changes among ``step``'s actions on them (as
    ``Controller._act`` does on the real ones)."""

    def __init__(self, shards: int = 1, persister_restarts: int = 0, planner: FakePlanner | None = None) -> None:
        self.workers = FakeWorkerGroup()
        self.shadow = FakeShadow(shards)
        self.persister = FakePersister(persister_restarts)
        self.log_keeper = FakeLogKeeper()
        self.planner = planner

    def observe(self) -> Observation:
        return Observation(workers=self.workers.status(), persister=self.persister.status(), shadow=self.shadow.status(),
                           log_keeper=self.log_keeper.status(), plan=self.planner.status() if self.planner else None)

    def execute(self, actions: tuple[Action, ...]) -> None:
        for action in actions:
            if isinstance(action, RestartShadow):
                self.shadow.restart(action.shard)
            elif isinstance(action, RestartPersister):
                self.persister.restart()
            elif isinstance(action, SetInterval) and self.planner:
                self.planner.in_force = action.every_steps
            elif isinstance(action, TakeSnapshot) and self.planner:
                self.planner.calibration_requested = True
