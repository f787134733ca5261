"""Keeps one live shadow replayer: starts it, watches it without blocking, restarts it when it dies.

Each incarnation gets its own actor name (``<shadow_name>-<n>``), published in the run directory's
``shadow.json`` pointer (written atomically) where workers look it up; reusing one name would make a
restart wait until Ray releases the dead incarnation's name. A dead shadow is restarted only while no
worker recovery is pending (the controller says so): a recovering worker must see the shadow as it
was at the failure, and a new incarnation starts from the newest snapshot plus the log tail anyway.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from actors.shadow import ShadowActor, ShadowSpec
from orchestrator.config import JobConfig
from orchestrator.run_dir import RunDir


class ShadowKeeper:
    """Owns the shadow actor of a run. ``poll`` never blocks; ``status`` is the last status seen."""

    def __init__(self, cfg: JobConfig, run: RunDir, spec: ShadowSpec) -> None:
        self.cfg, self.run, self.spec = cfg, run, spec
        self.incarnation = -1
        self.actor = None
        self.status: dict = {}
        self.restarts: list[dict] = []
        self._status_ref = None
        self._dead_since: float | None = None
        self.alive = False

    def start(self) -> None:
        """Start the next incarnation and publish its name (returns before it is ready)."""
        self.incarnation += 1
        name = f"{self.cfg.shadow_name}-{self.incarnation}"
        self.actor = ray.remote(ShadowActor).options(
            name=name, namespace=self.cfg.namespace, num_cpus=0, max_concurrency=4
        ).remote(self.spec)
        self.run.write_json(self.run.shadow_pointer, {"name": name, "incarnation": self.incarnation})
        self._status_ref = None

    def wait_ready(self, timeout_s: float) -> dict:
        """Block until the current incarnation answers (first start only)."""
        self.status = ray.get(self.actor.status.remote(), timeout=timeout_s)
        return self.status

    def poll(self, may_restart: Callable[[], bool]) -> None:
        """Refresh ``status`` if an answer is in; restart a dead shadow when ``may_restart()``.

        ``may_restart`` is asked only after the death is seen: a failure injector announces a worker
        failure before it kills the shadow, so asking later cannot miss that announcement.
        """
        if self._status_ref is None:
            self._status_ref = self.actor.status.remote()
        ready, _ = ray.wait([self._status_ref], timeout=0)
        if not ready:
            return
        ref, self._status_ref = self._status_ref, None
        try:
            self.status = ray.get(ref)
            self.alive = True
        except RayActorError:
            self.alive = False
            self._dead_since = self._dead_since or time.time()
            if may_restart():
                self.start()
            return
        if self._dead_since is not None:  # a restarted incarnation has answered
            restart = {"incarnation": self.incarnation, "seconds": time.time() - self._dead_since, **self.status["base"]}
            self.restarts.append(restart)
            self.run.event("shadow_restart", **restart)
            self._dead_since = None

    def ensure_alive(self, timeout_s: float) -> None:
        """Block until a shadow answers, restarting a dead one (e.g. killed in the last step).

        Raises:
            TimeoutError: no incarnation answered within ``timeout_s``.
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
