"""Keeps the live shadow replayer (K shard actors with ``JobConfig.placement.shadow_shards``): starts them,
watches them without blocking, restarts one when it fails.

A shard (the whole shadow when K = 1) has failed when its actor is dead or when its replay thread has
stopped on an error (the actor still answers, with ``error`` in its status, but replays and snapshots
nothing more): either way the keeper kills it and starts a new incarnation of that shard ALONE (the
other shards keep their actors and state), from its own units of the newest snapshot plus the log
tail. Each shard has its own incarnation counter and its own restart budget of
``JobConfig.faults.max_shadow_restarts``. The keeper observes and restarts; whether to restart is decided by
``orchestrator.control.shard_action`` (in the driver's loop by ``orchestrator.control.step``); past the
budget the run fails with ``ShadowFailedError``.

Each incarnation gets its own actor name (``<shadow_name>-<n>``; sharded ``<shadow_name>-s<shard>-<n>``),
published as the shadow pointer in the run's journal (``actors.journal``: ``shards``, one
``{shard, name, incarnation}`` per shard, and for K = 1 also ``name`` and ``incarnation``) where workers
look them up (``actors.shadow_actor.find_shards``); reusing one name would make a restart wait until
Ray releases the dead incarnation's name. A dead shard is restarted only while no worker recovery is pending (the
controller says so): a recovering worker must see the shadow as it was at the failure, and a new
incarnation starts from the newest snapshot plus the log tail anyway.

Placement: shard actors ask for no CPU (``num_cpus=0``, like the single shadow) and are created with
Ray's ``SPREAD`` scheduling strategy, so on a cluster with several nodes they land on different nodes,
among those the run's ``placement`` allows (``orchestrator.cluster.plan_placement``: never a node that
could host a train worker, on a cluster of two or more nodes).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from raycheck.actors.journal import RunChannel
from raycheck.actors.shadow import ShadowSpec
from raycheck.actors.shadow_actor import ShadowActor
from raycheck.actors.shards import assemble
from raycheck.job.config import JobConfig
from raycheck.job.names import shadow_name
from raycheck.orchestrator.cluster import shadow_actor_options
from raycheck.orchestrator.components import start_failure
from raycheck.orchestrator.control import FailRun, ShadowStatus, ShardStatus, shard_action
from raycheck.training.state import state_sha256


class ShadowFailedError(RuntimeError):
    """The shadow failed more often than ``JobConfig.faults.max_shadow_restarts`` allows."""


def failure_reason(status: dict | None) -> str | None:
    """Why a shadow counts as failed: its actor is dead (``status`` None), or its replay thread
    stopped (the ``error`` of its status); None when it is healthy."""
    if status is None:
        return "actor died"
    if status.get("error") is not None:
        return f"replay thread died: {status['error']}"
    return None


class ShardKeeper:
    """Owns one shard's actor (the whole shadow when K = 1). ``poll`` never blocks; ``status`` is the
    last status seen; ``actor_ids`` lists the Ray actor id of every incarnation that answered; each
    restart is appended to ``restarts`` (shared by the shards: the run's restarts in time order)."""

    def __init__(self, cfg: JobConfig, run: RunChannel, spec: ShadowSpec, publish: Callable[[], None], restarts: list[dict],
                 placement: dict | None = None) -> None:
        self.cfg, self.run, self.spec, self._publish = cfg, run, spec, publish
        self.incarnation = -1
        self.moves = 0
        """Incarnations started to move the shard off a draining node (not counted against its restart budget)."""
        self.actor: Any = None  # the actor handle, None until started (ray types a handle's methods as Never)
        self.status: dict = {}
        self.restarts = restarts
        self.actor_ids: list[str] = []
        self.placements: list[dict] = []
        """``actor_id``, ``node_id``, ``node_ip`` of every incarnation that answered."""
        self._status_ref: ray.ObjectRef | None = None
        self._failed: tuple[float, str] | None = None  # (unix seconds, reason) of a failure not yet restarted
        self._restarted: tuple[float, str] | None = None  # the same, restarted, until the new incarnation answers
        self.alive = False
        self.placement = {**({"scheduling_strategy": "SPREAD"} if spec.shards > 1 else {}), **(placement or {})}

    @property
    def name(self) -> str:
        """The current incarnation's actor name."""
        prefix = shadow_name(self.cfg) if self.spec.shards == 1 else f"{shadow_name(self.cfg)}-s{self.spec.shard}"
        return f"{prefix}-{self.incarnation}"

    def start(self) -> None:
        """Start the next incarnation and publish its name (returns before it is ready)."""
        self.incarnation += 1
        self.actor = ray.remote(ShadowActor).options(
            name=self.name, namespace=self.cfg.namespace, num_cpus=0, max_concurrency=4, **self.placement, **shadow_actor_options(self.cfg)
        ).remote(self.spec)
        self._publish()
        self._status_ref = None

    def _seen(self, status: dict) -> None:
        self.status = status
        if status["actor_id"] not in self.actor_ids:
            self.actor_ids.append(status["actor_id"])
            self.placements.append({k: status[k] for k in ("actor_id", "node_id", "node_ip")})

    def wait_ready(self, timeout_s: float) -> dict:
        """Block until the current incarnation answers (first start only)."""
        self._seen(ray.get(self.actor.status.remote(), timeout=timeout_s))
        return self.status

    def observe(self) -> ShardStatus:
        """Refresh ``status`` if an answer is in (never blocks); the shard's snapshot: its restarts so
        far and, when this answer says it failed (``failure_reason``), the first reason seen since its
        last restart."""
        if self._status_ref is None:
            self._status_ref = self.actor.status.remote()
        ready, _ = ray.wait([self._status_ref], timeout=0)
        if not ready:
            return ShardStatus(self.spec.shard, self.restarts_counted)
        ref, self._status_ref = self._status_ref, None
        try:
            status = ray.get(ref)
        except RayActorError:
            status = None
        if status is not None:
            self._seen(status)
            if self._restarted is not None:  # a restarted incarnation has answered
                self._record_restart(*self._restarted)
        reason = failure_reason(status)
        self.alive = reason is None
        if reason is None:
            return ShardStatus(self.spec.shard, self.restarts_counted)
        self._failed = self._failed or (time.time(), reason)
        return ShardStatus(self.spec.shard, self.restarts_counted, failure=self._failed[1])

    @property
    def restarts_counted(self) -> int:
        """Restarts that count against ``faults.max_shadow_restarts`` (moves off a draining node do not)."""
        return self.incarnation - self.moves

    def restart(self) -> None:
        """Kill the current incarnation (an actor whose replay thread died still holds memory and CPU)
        and start the next; its ``shadow_restart`` event is recorded once it answers."""
        ray.kill(self.actor, no_restart=True)
        self._restarted, self._failed = self._failed, None
        self.start()

    def move(self, reason: str) -> None:
        """Start the next incarnation in place of a live one (e.g. off a draining node: Ray places nothing new
        there), not counted against the restart budget; its ``shadow_restart`` event (``reason``) is recorded
        once it answers."""
        self.moves += 1
        ray.kill(self.actor, no_restart=True)
        self._restarted, self._failed = (time.time(), reason), None
        self.start()

    def _record_restart(self, failed_unix_s: float, reason: str) -> None:
        restart = {"shard": self.spec.shard, "incarnation": self.incarnation, "seconds": time.time() - failed_unix_s,
                   "reason": reason, "actor_id": self.status["actor_id"], **self.status["base"]}
        self.restarts.append(restart)
        self.run.event("shadow_restart", **restart)
        self._restarted = None


def combined_status(statuses: list[dict]) -> dict:
    """The shadow's status from its shards' (pure): one shard's as it is; for several, the figures of
    the shard that bounds the whole: the lowest ``step``, ``replayed`` and ``last_snapshot_step``, the
    highest ``log_end`` and ``replay_seconds_per_step`` (the slowest shard), the lowest base, the first
    ``error``, the shards' CPU kernel levels (``cpu_capability``, comma-joined when they differ);
    ``shards`` lists every shard's own status."""
    if len(statuses) == 1:
        return statuses[0]
    per_step = [s["replay_seconds_per_step"] for s in statuses if s.get("replay_seconds_per_step") is not None]
    step, log_end = min(s["step"] for s in statuses), max(s["log_end"] for s in statuses)
    return {
        "step": step,
        "log_end": log_end,
        "lag_steps": log_end - step,
        "replayed": min(s["replayed"] for s in statuses),
        "replay_seconds_per_step": max(per_step) if len(per_step) == len(statuses) else None,
        "base": min((s["base"] for s in statuses), key=lambda b: b["step"]),
        "snapshots_sent": min(s["snapshots_sent"] for s in statuses),
        "snapshots_skipped": max(s["snapshots_skipped"] for s in statuses),
        "snapshot_every_steps": statuses[0]["snapshot_every_steps"],
        "last_snapshot_step": min(s["last_snapshot_step"] for s in statuses),
        "error": next((s["error"] for s in statuses if s.get("error") is not None), None),
        "cpu_capability": ",".join(sorted({str(s.get("cpu_capability")) for s in statuses})),
        "shards": statuses,
    }


class ShadowKeeper:
    """Owns the shadow of a run: ``cfg.placement.shadow_shards`` shard actors (one ``ShardKeeper`` each).
    ``poll`` never blocks; ``status`` combines the last statuses seen (``combined_status``)."""

    def __init__(self, cfg: JobConfig, run: RunChannel, spec: ShadowSpec, placement: dict | None = None) -> None:
        self.cfg, self.run, self.placement = cfg, run, placement
        self.restarts: list[dict] = []
        """Every shard restart in the order recorded (``seconds``: failure until the new incarnation answered)."""
        k = cfg.placement.shadow_shards
        self.shards = [ShardKeeper(cfg, run, dataclasses.replace(spec, shard=i, shards=k, hash_every=spec.hash_every if k == 1 else 0),
                                   self._publish, self.restarts, placement) for i in range(k)]

    def _publish(self) -> None:
        """Publish the shadow pointer: every shard's current actor name and incarnation (only once every
        shard has been started, so a reader never finds part of the shadow)."""
        if any(s.actor is None for s in self.shards):
            return
        shards = [{"shard": s.spec.shard, "name": s.name, "incarnation": s.incarnation} for s in self.shards]
        single = {"name": shards[0]["name"], "incarnation": shards[0]["incarnation"]} if len(self.shards) == 1 else {}
        self.run.publish_shadow({**single, "shards": shards})

    @property
    def status(self) -> dict:
        return combined_status([s.status for s in self.shards]) if all(s.status for s in self.shards) else {}

    @property
    def alive(self) -> bool:
        return all(s.alive for s in self.shards)

    def start(self) -> None:
        """Start every shard's first incarnation (returns before they are ready)."""
        for shard in self.shards:
            shard.start()

    def wait_ready(self, timeout_s: float) -> dict:
        """Block until every shard answers (first start only); returns ``status``.

        Raises:
            orchestrator.components.ComponentStartError: a shard was not placed within ``timeout_s`` seconds
                or its constructor raised.
        """
        try:
            for shard in self.shards:
                shard.wait_ready(timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            raise start_failure("the shadow", exc, timeout_s, self.placement or {}) from exc
        return self.status

    def observe(self) -> ShadowStatus:
        """``ShardKeeper.observe`` of every shard (never blocks)."""
        return ShadowStatus(tuple(shard.observe() for shard in self.shards))

    def restart(self, shard: int) -> None:
        """Restart shard ``shard`` alone (``ShardKeeper.restart``)."""
        self.shards[shard].restart()

    def ensure_alive(self, timeout_s: float) -> None:
        """Block until every shard answers, restarting a failed one (e.g. killed in the last step) within
        its budget (``orchestrator.control.shard_action``, no worker recovery pending).

        Raises:
            TimeoutError: not every shard answered within ``timeout_s``.
            ShadowFailedError: a shard's restart budget is spent.
        """
        deadline = time.monotonic() + timeout_s
        for shard in self.shards:
            shard.alive = False
        while not self.alive:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no shadow answered within {timeout_s:g} s")
            for status in self.observe().shards:
                action = shard_action(status, len(self.shards) > 1, self.cfg.faults.max_shadow_restarts, recovery_pending=False)
                if isinstance(action, FailRun):
                    raise ShadowFailedError(action.reason)
                if action is not None:
                    self.restart(action.shard)
            time.sleep(0.1)

    @property
    def interval_steps(self) -> int:
        """The snapshot interval the shards snapshot at, in steps (``set_interval``)."""
        return self.shards[0].spec.snapshot_every_steps

    def set_interval(self, every_steps: int) -> None:
        """Apply a new snapshot interval now and to every later incarnation of every shard."""
        for shard in self.shards:
            shard.spec = dataclasses.replace(shard.spec, snapshot_every_steps=every_steps)
            shard.actor.set_interval.remote(every_steps)

    def refresh_status(self, timeout_s: float) -> dict:
        """Ask every shard for its status now (blocking); returns ``status``."""
        for shard, status in zip(self.shards, ray.get([s.actor.status.remote() for s in self.shards], timeout=timeout_s)):
            shard._seen(status)
        return self.status

    def snapshot_now(self, timeout_s: float | None) -> int | None:
        """Hand the current state to the persister (e.g. the final state, or a calibration snapshot).
        One shard: ``ShadowActor.snapshot_now``. Several: every shard snapshots one agreed step
        (``ShadowActor.snapshot_at``), so the parts complete one snapshot: the furthest shard's step
        (statuses refreshed first), or with ``timeout_s`` None (do not wait) the step after the
        furthest last seen, which every shard still has to reach while training runs. A shard that
        passed the agreed step declines, and the persister drops the incomplete step. Returns the
        snapshot's step (None with ``timeout_s`` None); it reaches the persister a moment later.

        Raises:
            ray.exceptions.RayActorError, GetTimeoutError: a shard did not answer within ``timeout_s``.
        """
        if len(self.shards) == 1:
            refs = [self.shards[0].actor.snapshot_now.remote()]
            step = None
        else:
            if timeout_s is not None:
                self.refresh_status(timeout_s)
            step = max(s.status["step"] for s in self.shards) + (1 if timeout_s is None else 0)
            refs = [s.actor.snapshot_at.remote(step) for s in self.shards]
        if timeout_s is None:
            return None
        answers = ray.get(refs, timeout=timeout_s)
        return answers[0] if step is None else step

    def hand_off(self, shards: tuple[int, ...], committed: Callable[[int], int | None], timeout_s: float) -> int | None:
        """Shards ``shards`` are on a draining node: the shadow hands its current image to the persister
        (``snapshot_now``), ``committed(step)`` waits until the persister has written that step and returns its
        newest durable snapshot step, then those shards move (``ShardKeeper.move``: the next incarnation starts from that
        snapshot, elsewhere). Returns that step.

        Raises:
            ray.exceptions.RayActorError, GetTimeoutError: a shard did not answer within ``timeout_s``.
        """
        step = committed(self.snapshot_now(timeout_s) or 0)
        for shard in shards:
            self.shards[shard].move("preemption")
        return step

    def state_sha256(self, step: int, timeout_s: float) -> str:
        """``training.state.state_sha256`` of the shadow's state after exactly ``step`` steps (the
        shards' images assembled when sharded; waits until replayed).

        Raises:
            RuntimeError: a shard is past ``step`` or its replay failed.
        """
        if len(self.shards) == 1:
            return ray.get(self.shards[0].actor.state_sha256.remote(step, timeout_s), timeout=timeout_s + 30)
        images = ray.get([s.actor.image.remote(step, timeout_s) for s in self.shards], timeout=timeout_s + 30)
        state, problem = assemble(images, step)
        if state is None:
            raise RuntimeError(problem)
        return state_sha256(state)

    def hashes(self, timeout_s: float) -> dict[int, str]:
        """The state hashes recorded every ``hash_every`` steps (none when sharded: a shard sees only
        its part of the state)."""
        return ray.get(self.shards[0].actor.hashes.remote(), timeout=timeout_s) if len(self.shards) == 1 else {}

    def shard_figures(self, mean_step_s: float | None) -> list[dict]:
        """Per shard: ``shard``, ``units``, ``elements``, ``replay_seconds_per_step``,
        ``replay_over_step`` (over ``mean_step_s``), ``restarts``, ``actor_ids`` (every incarnation's)."""
        out = []
        for shard in self.shards:
            replay_s = shard.status.get("replay_seconds_per_step")
            out.append({"shard": shard.spec.shard, "units": shard.status.get("units"), "elements": shard.status.get("elements"),
                        "replay_seconds_per_step": replay_s,
                        "replay_over_step": replay_s / mean_step_s if replay_s is not None and mean_step_s else None,
                        "restarts": shard.incarnation, "actor_ids": list(shard.actor_ids)})
        return out

    def finish(self, ok: bool, flush: Callable[[], dict], mean_step_s: float | None, max_lag_steps: int | None) -> dict:
        """The shadow's fields of a finished run's summary. With ``ok`` (``fit`` succeeded): every shard alive
        (a failed one restarted within its budget), its state hash after ``cfg.steps`` steps, and, when the
        persister's last durable step (``flush``: its flush, returning its status) is behind the shadow, a
        last snapshot of the final state, so storage ends complete. Then: the final state hash (None
        without ``ok``), its replay time per step (seconds, and over ``mean_step_s``), ``max_lag_steps``,
        its recorded hashes, its CPU capability and ``shard_figures``."""
        cfg, sha = self.cfg, None
        if ok:
            self.ensure_alive(timeout_s=600)
            sha = self.state_sha256(cfg.steps, cfg.faults.recovery_timeout_s)
            self.refresh_status(timeout_s=60)
            durable = flush().get("last_durable_step")
            if cfg.snapshot.every_steps and self.status["step"] > (durable or 0):  # e.g. its write failed in an outage
                self.snapshot_now(timeout_s=600)
        replay_s = self.status.get("replay_seconds_per_step")
        return {
            "shadow_state_sha256": sha,
            "shadow_replay_seconds_per_step": replay_s,
            "shadow_replay_over_step": (replay_s or 0) / mean_step_s if mean_step_s else None,
            "shadow_max_lag_steps": max_lag_steps,
            "shadow_hashes": {str(k): v for k, v in sorted(self.hashes(timeout_s=60).items())},
            "shadow_cpu_capability": self.status.get("cpu_capability"),
            "shadow_shards": self.shard_figures(mean_step_s),
        }

    def kill(self) -> None:
        """Kill every shard's current incarnation."""
        for shard in self.shards:
            if shard.actor is not None:
                ray.kill(shard.actor, no_restart=True)

