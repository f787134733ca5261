"""Fakes of what the controller polls, for driving ``orchestrator.control.step`` without Ray: each keeps
the state of one component and returns the frozen snapshot that ``orchestrator.control`` defines for it
(the worker group's through ``orchestrator.control.worker_group_status``, as the controller builds it).

They live next to the interfaces they fake, so a change of a snapshot type meets its fake in the same
package (and under the type checker); ``tests/test_control.py`` drives the state machine with them."""

from __future__ import annotations

from raycheck.orchestrator.control import (Action, LogKeeperStatus, Observation, PersisterStatus, RestartPersister, RestartShadow, ShadowStatus,
                                           ShardStatus, WorkerGroupStatus, worker_group_status)


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


class FakeRun:
    """One fake of each component; ``observe`` bundles their snapshots, ``execute`` carries out the
    repairs among ``step``'s actions on them (as ``Controller._act`` does on the real ones)."""

    def __init__(self, shards: int = 1, persister_restarts: int = 0) -> None:
        self.workers = FakeWorkerGroup()
        self.shadow = FakeShadow(shards)
        self.persister = FakePersister(persister_restarts)
        self.log_keeper = FakeLogKeeper()

    def observe(self) -> Observation:
        return Observation(workers=self.workers.status(), persister=self.persister.status(), shadow=self.shadow.status(),
                           log_keeper=self.log_keeper.status())

    def execute(self, actions: tuple[Action, ...]) -> None:
        for action in actions:
            if isinstance(action, RestartShadow):
                self.shadow.restart(action.shard)
            elif isinstance(action, RestartPersister):
                self.persister.restart()
