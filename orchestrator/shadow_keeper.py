"""Keeps one live shadow replayer: starts it, watches it without blocking, restarts it when it fails.

A shadow has failed when its actor is dead or when its replay thread has stopped on an error (the
actor still answers, with ``error`` in its status, but replays and snapshots nothing more): either
way the keeper kills it and starts a new incarnation, at most ``JobConfig.max_shadow_restarts`` times
(``decide``); past that budget ``poll`` raises ``ShadowFailedError``.

Each incarnation gets its own actor name (``<shadow_name>-<n>``), published in the run directory's
``shadow.json`` pointer (written atomically) where workers look it up; reusing one name would make a
restart wait until Ray releases the dead incarnation's name. A dead shadow is restarted only while no
worker recovery is pending (the controller says so): a recovering worker must see the shadow as it
was at the failure, and a new incarnation starts from the newest snapshot plus the log tail anyway.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from actors.shadow import ShadowActor, ShadowSpec
from orchestrator.config import JobConfig
from orchestrator.run_dir import RunDir


class ShadowAction(enum.Enum):
    """What the keeper does with the shadow after a status poll."""

    KEEP = "keep"
    """It answered and its replay thread runs."""
    WAIT = "wait"
    """It failed, but a restart must wait (a worker recovery needs the shadow as it was)."""
    RESTART = "restart"
    """It failed: kill it and start the next incarnation."""
    GIVE_UP = "give_up"
    """It failed and the restart budget is spent."""


class ShadowFailedError(RuntimeError):
    """The shadow failed more often than ``JobConfig.max_shadow_restarts`` allows."""


def failure_reason(status: dict | None) -> str | None:
    """Why a shadow counts as failed: its actor is dead (``status`` None), or its replay thread
    stopped (the ``error`` of its status); None when it is healthy."""
    if status is None:
        return "actor died"
    if status.get("error") is not None:
        return f"replay thread died: {status['error']}"
    return None


def decide(status: dict | None, restarts_used: int, max_restarts: int, may_restart: Callable[[], bool]) -> ShadowAction:
    """The keeper's decision after a poll (pure).

    Args:
        status: the shadow's ``ShadowActor.status()``, or None when its actor is dead.
        restarts_used: restarts so far in this run.
        max_restarts: the budget (-1: unlimited).
        may_restart: asked only when the shadow has failed and the budget allows a restart.
    """
    if failure_reason(status) is None:
        return ShadowAction.KEEP
    if 0 <= max_restarts <= restarts_used:
        return ShadowAction.GIVE_UP
    return ShadowAction.RESTART if may_restart() else ShadowAction.WAIT


class ShadowKeeper:
    """Owns the shadow actor of a run. ``poll`` never blocks; ``status`` is the last status seen."""

    def __init__(self, cfg: JobConfig, run: RunDir, spec: ShadowSpec) -> None:
        self.cfg, self.run, self.spec = cfg, run, spec
        self.incarnation = -1
        self.actor = None
        self.status: dict = {}
        self.restarts: list[dict] = []
        self._status_ref = None
        self._failed: tuple[float, str] | None = None  # (unix seconds, reason) of a failure not yet restarted
        self._restarted: tuple[float, str] | None = None  # the same, restarted, until the new incarnation answers
        self.alive = False

    def start(self) -> None:
        """Start the next incarnation and publish its name (returns before it is ready)."""
        self.incarnation += 1
        name = f"{self.cfg.shadow_name}-{self.incarnation}"
        self.actor = ray.remote(ShadowActor).options(
            name=name, namespace=self.cfg.namespace, num_cpus=0, max_concurrency=4, **self.cfg.shadow_actor_options
        ).remote(self.spec)
        self.run.write_json(self.run.shadow_pointer, {"name": name, "incarnation": self.incarnation})
        self._status_ref = None

    def wait_ready(self, timeout_s: float) -> dict:
        """Block until the current incarnation answers (first start only)."""
        self.status = ray.get(self.actor.status.remote(), timeout=timeout_s)
        return self.status

    def poll(self, may_restart: Callable[[], bool]) -> None:
        """Refresh ``status`` if an answer is in; restart a failed shadow (``decide``).

        ``may_restart`` is asked only after the failure is seen: a failure injector announces a worker
        failure before it kills the shadow, so asking later cannot miss that announcement.

        Raises:
            ShadowFailedError: the shadow failed and ``cfg.max_shadow_restarts`` restarts are spent.
        """
        if self._status_ref is None:
            self._status_ref = self.actor.status.remote()
        ready, _ = ray.wait([self._status_ref], timeout=0)
        if not ready:
            return
        ref, self._status_ref = self._status_ref, None
        try:
            status = ray.get(ref)
        except RayActorError:
            status = None
        if status is not None:
            self.status = status
            if self._restarted is not None:  # a restarted incarnation has answered
                self._record_restart(*self._restarted)
        action = decide(status, self.incarnation, self.cfg.max_shadow_restarts, may_restart)
        self.alive = action is ShadowAction.KEEP
        if action is ShadowAction.KEEP:
            return
        self._failed = self._failed or (time.time(), failure_reason(status))
        if action is ShadowAction.WAIT:
            return
        ray.kill(self.actor, no_restart=True)  # an actor whose replay thread died still holds memory and CPU
        if action is ShadowAction.GIVE_UP:
            raise ShadowFailedError(f"the shadow failed after {self.incarnation} restarts (max_shadow_restarts "
                                    f"{self.cfg.max_shadow_restarts}): {self._failed[1]}")
        self._restarted, self._failed = self._failed, None
        self.start()

    def _record_restart(self, failed_unix_s: float, reason: str) -> None:
        restart = {"incarnation": self.incarnation, "seconds": time.time() - failed_unix_s, "reason": reason,
                   **self.status["base"]}
        self.restarts.append(restart)
        self.run.event("shadow_restart", **restart)
        self._restarted = None

    def ensure_alive(self, timeout_s: float) -> None:
        """Block until a shadow answers, restarting a dead one (e.g. killed in the last step).

        Raises:
            TimeoutError: no incarnation answered within ``timeout_s``.
            ShadowFailedError: the restart budget is spent.
        """
        deadline = time.monotonic() + timeout_s
        self.alive = False
        while not self.alive:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no shadow answered within {timeout_s:g} s")
            self.poll(may_restart=lambda: True)
            time.sleep(0.1)

    def set_interval(self, every_steps: int) -> None:
        """Apply a new snapshot interval now and to every later incarnation."""
        self.spec = dataclasses.replace(self.spec, snapshot_every_steps=every_steps)
        self.actor.set_interval.remote(every_steps)

    def call(self, method: str, *args, timeout_s: float):
        """Call ``method`` on the current incarnation and wait for the result."""
        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout_s)


def find_shadow(run: RunDir, namespace: str, timeout_s: float, alive: Callable[[object], bool] | None = None):
    """The current incarnation's handle, or None if none answers within ``timeout_s``.

    ``alive(handle)`` decides whether a found handle counts (default: it is registered).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        pointer = run.read_json(run.shadow_pointer)
        try:
            handle = ray.get_actor(pointer["name"], namespace=namespace) if pointer else None
        except ValueError:
            handle = None
        if handle is not None and (alive is None or alive(handle)):
            return handle
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)
