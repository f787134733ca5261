"""The driver's handles on the run's snapshot persister and step log keeper: each starts its actor, waits
until it answers, polls it into a frozen status for ``orchestrator.control.step`` (never blocking long)
and, for the persister, restarts it after it died. The errors that end a run whose component could not
start or is beyond repair are here too."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycheck.actors.journal import RunChannel
from raycheck.actors.log_keeper import LogKeeperActor
from raycheck.actors.persister import PersisterActor
from raycheck.job.config import JobConfig
from raycheck.job.names import log_keeper_name, persister_name
from raycheck.job.run_dir import RunDir
from raycheck.job.stores import snapshot_store
from raycheck.orchestrator.cluster import Placement, runtime_env
from raycheck.orchestrator.console import one_line
from raycheck.orchestrator.control import LogKeeperStatus, PersisterStatus
from raycheck.storage.backend import STORAGE_ENV, StorageUnreachableError
from raycheck.training.zo import ZOHyper

log = logging.getLogger(__name__)


class PersisterFailedError(RuntimeError):
    """The snapshot persister died more often than ``JobConfig.faults.max_persister_restarts`` allows."""


class LogKeeperFailedError(RuntimeError):
    """The step log keeper did not start, or died (its log file and rank 0's local log keep the steps)."""


def last_line(exc: BaseException) -> str:
    """The last line of ``exc``'s message (at most 600 characters): for a Ray actor error, the error
    that ended the actor, after its traceback."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1][:600] if lines else ""


class ComponentStartError(RuntimeError):
    """A component of the run (the snapshot persister, a shadow shard) could not start: it was not
    placed on a node within ``JobConfig.start_timeout_s``, its constructor raised, or it cannot use
    the run's storage from its node."""


def start_failure(what: str, exc: Exception, timeout_s: float, options: dict) -> ComponentStartError:
    """The error that ends a run whose ``what`` did not start (``exc``: what waiting for it raised;
    ``options``: the placement it asked for)."""
    if isinstance(exc, GetTimeoutError):
        return ComponentStartError(
            f"{what} did not start within {timeout_s:g} s: no alive node could place it (it asks for "
            f"{options or 'no particular node'}); check the cluster's nodes, --shadow-resource and --start-timeout")
    return ComponentStartError(f"{what} could not start: {last_line(exc) or type(exc).__name__}")


def storage_failure(what: str, node: dict, uri: str, cause: BaseException) -> ComponentStartError:
    """The error that ends a run whose ``what`` (on ``node``, ``this_node()``) cannot use storage at ``uri``."""
    return ComponentStartError(
        f"{what} on node {node['node_ip']} ({node['node_id'][:12]}) cannot use storage {uri}: {type(cause).__name__}: "
        f"{str(cause)[:300]}; storage settings reach the processes on other nodes from the driver's environment "
        f"({', '.join(STORAGE_ENV)}): set them there (a credentials file on the driver's machine does not travel)")


def start_persister(cfg: JobConfig, placement: Placement):
    """Start the run's snapshot persister (named ``persister_name(cfg)``) where ``placement`` puts the
    replicas, with the driver's storage settings (``runtime_env``), writing local snapshots with direct I/O
    unless ``snapshot.persister_direct_io`` is off; returns its handle at once."""
    return ray.remote(PersisterActor).options(
        name=persister_name(cfg), namespace=cfg.namespace, num_cpus=0, max_concurrency=4,
        runtime_env=runtime_env(), **placement.replica,
    ).remote(snapshot_store(cfg, direct=cfg.snapshot.persister_direct_io), priority=cfg.snapshot.persister_priority)


class PersisterHandle:
    """The run's snapshot persister (``actors.persister``), as the driver sees it.

    Args:
        cfg: the run's configuration; placement: where the replicas go (``Placement.replica``).
        channel: the run's journal channel (``persister_restart`` events).
        on_status: called with each status the persister answers (e.g. to publish its metrics).
        restarts: restarts counted by earlier drivers of the run (its budget is the run's).
    """

    def __init__(self, cfg: JobConfig, placement: Placement, channel: RunChannel, on_status: Callable[[dict], None],
                 restarts: int = 0) -> None:
        self.cfg, self.placement, self.channel, self.on_status = cfg, placement, channel, on_status
        self.restarts = restarts
        self.status: dict = {}
        """Its last status (``PersisterActor.status``), with ``unavailable`` while it does not answer."""
        self.placed: list[dict] = []
        """Each incarnation's node (``node_id``, ``node_ip``), from its first status."""
        self.actor: Any = start_persister(cfg, placement)

    def await_ready(self) -> None:
        """Wait until the first persister has started and can use storage from its node.

        Raises:
            ComponentStartError: it was not placed within ``cfg.faults.start_timeout_s``, its constructor
                raised, or its storage probe failed (e.g. no credentials on its node). Storage that is
                unreachable (an outage) is logged, not fatal: the persister retries through its breaker.
        """
        what, timeout_s = "the snapshot persister", self.cfg.faults.start_timeout_s
        try:
            self._placed(ray.get(self.actor.status.remote(), timeout=timeout_s))
        except (RayActorError, GetTimeoutError) as exc:
            raise start_failure(what, exc, timeout_s, self.placement.replica) from exc
        try:
            ray.get(self.actor.check_storage.remote(), timeout=timeout_s)
        except (ray.exceptions.RayTaskError, GetTimeoutError) as exc:  # the probe raised, or hung
            cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
            if isinstance(cause, StorageUnreachableError):  # an outage, not a setting: it retries through its breaker
                log.warning("the snapshot persister cannot reach storage yet (%s); training goes on, snapshots wait", cause)
                return
            raise storage_failure(what, self.placed[-1], self.cfg.storage.uri, cause) from exc
        except RayActorError as exc:  # it died
            raise start_failure(what, exc, timeout_s, self.placement.replica) from exc

    def _placed(self, status: dict) -> None:
        """Record the node of an incarnation from its first status."""
        self.placed.append({k: status[k] for k in ("node_id", "node_ip")})

    def poll(self, method: str = "status", *args: object, timeout_s: float = 30) -> PersisterStatus:
        """Refresh ``status`` (``status``, or ``flush``: its pending write finished); returns its snapshot
        (``died``: it is dead). One that does not answer is reported in ``status``, never fatal:
        snapshots are an optimisation over the step log."""
        try:
            self.status = ray.get(getattr(self.actor, method).remote(*args), timeout=timeout_s)
        except ActorDiedError as exc:
            return PersisterStatus(self.restarts, died=type(exc).__name__)
        except (RayActorError, GetTimeoutError) as exc:
            log.warning("the snapshot persister did not answer %s (%s)", method, one_line(exc))
            self.status = {**self.status, "unavailable": f"{type(exc).__name__}: {exc}"[:300]}
            return PersisterStatus(self.restarts)
        self.on_status(self.status)
        return PersisterStatus(self.restarts)

    def move(self, reason: str) -> bool:
        """Start the persister again elsewhere (e.g. off a draining node: Ray places nothing new there; flush
        it first), not counted against its restart budget; returns whether the new one answers."""
        ray.kill(self.actor, no_restart=True)
        deadline = time.monotonic() + 60
        while True:  # the killed one's name is released within a moment
            started = self.restart(reason, counted=False)
            if started or time.monotonic() > deadline:
                return started
            time.sleep(0.2)

    def restart(self, reason: str, counted: bool = True) -> bool:
        """Start a new persister (same name) after one died (``reason``: the error type); returns whether
        it answers. It starts even while storage is unreachable (it reports that in its status and
        retries). One whose name Ray has not released yet is not counted: the next poll sees the old
        one dead again and retries."""
        t0 = time.time()
        try:
            self.actor = start_persister(self.cfg, self.placement)
        except ValueError as err:  # the old name not yet released: next poll
            log.warning("the snapshot persister could not restart yet (%s); retrying", one_line(err))
            return False
        self.restarts += int(counted)
        try:
            self._placed(ray.get(self.actor.status.remote(), timeout=120))
        except (RayActorError, GetTimeoutError) as err:  # it died starting: the next poll sees it dead
            log.warning("the restarted snapshot persister did not answer (%s); retrying", one_line(err))
            return False
        self.channel.event("persister_restart", reason=reason[:100], seconds=time.time() - t0)
        return True

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


class LogKeeperHandle:
    """The run's step log keeper (``actors.log_keeper``) over the run directory's step log, pinned to
    this (the driver's) node, mirroring to and (when its log lacks steps) resuming from the run's remote
    storage. Starting returns at once (``await_ready``)."""

    def __init__(self, cfg: JobConfig, run_dir: RunDir, channel: RunChannel) -> None:
        self.cfg, self.run_dir, self.channel = cfg, run_dir, channel
        self.status: dict = {}
        """Its last status (``LogKeeperActor.status``)."""
        storage = snapshot_store(cfg).storage if cfg.storage.remote else None
        self.actor: Any = ray.remote(LogKeeperActor).options(
            name=log_keeper_name(cfg), namespace=cfg.namespace, num_cpus=0, max_concurrency=8, runtime_env=runtime_env(),
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(str(run_dir.step_log.absolute()), resume_from=storage, mirror_to=storage, commit_to_storage=cfg.durability == "cluster",
                 hyper=ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay))

    def await_ready(self) -> int:
        """Wait until it has started (and adopted the steps the storage holds past its log); returns the
        steps it holds.

        Raises:
            LogKeeperFailedError: it did not start (e.g. the bucket holds another run's log).
        """
        try:
            self.status = ray.get(self.actor.status.remote(), timeout=300)
        except (RayActorError, GetTimeoutError) as exc:
            raise LogKeeperFailedError(f"the step log keeper could not start on the driver's node: {last_line(exc)}") from exc
        if self.status["adopted_steps"]:
            self.channel.event("log_adopted", steps=self.status["adopted_steps"], storage=self.cfg.storage.uri)
        return self.status["end"]

    def poll(self, method: str = "status", timeout_s: float = 30) -> LogKeeperStatus:
        """Refresh ``status`` (``status``, or ``flush``: a final mirror round); one that does not answer
        in ``timeout_s`` seconds keeps its last status (logged). Returns its snapshot (``died``: it is dead)."""
        try:
            self.status = ray.get(getattr(self.actor, method).remote(), timeout=timeout_s)
        except RayActorError as exc:
            return LogKeeperStatus(str(self.run_dir.step_log), died=last_line(exc))
        except GetTimeoutError as exc:
            log.warning("the step log keeper did not answer %s (%s)", method, one_line(exc))
        return LogKeeperStatus(str(self.run_dir.step_log))

    def mirror_status(self) -> dict:
        """The step log mirror's fields of its status (``log_mirrored_steps``, ``log_mirror_error``)."""
        return {k: v for k, v in self.status.items() if k.startswith("log_mirror")}

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)
