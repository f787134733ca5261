"""The driver's side of the run's journal (``actors.journal``): it starts the journal actor on its
own node (``start_journal``), drains it into the run directory (``RunRecord``) and, before a start,
waits until no actor of an earlier driver of the run is alive (``wait_for_previous_driver``).

A resumed driver starts a new journal (the old one died with the old driver) and seeds it with the
failure markers its ``events.jsonl`` names (``claims_in``), then (once the log keeper tells the
durable step) with those of every failure due before it (``workers.faults.fired_before``: what a
run directory lost, e.g. a resume from the storage alone), so a failure that already fired does not
fire again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycheck.actors.journal import CALL_TIMEOUT_S, JournalActor, RunChannel
from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.job.names import journal_name, log_keeper_name, persister_name, shadow_name


class RunActiveError(RuntimeError):
    """Actors of the run are still alive when its driver starts: another driver runs it."""


def run_actors(cfg: JobConfig) -> list[str]:
    """The names of run ``cfg.run_id``'s actors alive in ``cfg.namespace``: its journal, log keeper,
    persister, and every shadow incarnation (``<shadow_name>-...``)."""
    ours = (journal_name(cfg), log_keeper_name(cfg), persister_name(cfg))
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == cfg.namespace
                  and (a["name"] in ours or a["name"].startswith(f"{shadow_name(cfg)}-")))


def wait_for_previous_driver(cfg: JobConfig, timeout_s: float = 60.0, echo: Callable[[str], object] = print) -> None:
    """Return once no actor of run ``cfg.run_id`` is alive: when a driver dies, Ray removes its actors
    within seconds, and a ``--resume`` started meanwhile would find their names taken. Polls Ray's
    named actors every 0.5 s (Ray has no notification of an actor's removal to wait on).

    Raises:
        RunActiveError: some are still alive after ``timeout_s`` seconds (another driver runs the run).
    """
    deadline = time.monotonic() + timeout_s
    alive = run_actors(cfg)
    if alive:
        echo(f"[raycheck] waiting up to {timeout_s:g} s for the previous driver's actors of run {cfg.run_id} to go: {', '.join(alive)}")
    while alive:
        if time.monotonic() >= deadline:
            raise RunActiveError(f"run {cfg.run_id}'s actors are still alive after {timeout_s:g} s ({', '.join(alive)}): another "
                                 "driver runs this run; stop it (e.g. ray job stop) before resuming")
        time.sleep(0.5)
        alive = run_actors(cfg)


def start_journal(cfg: JobConfig, claims: list[str]):
    """Start this run's journal actor (``journal_name(cfg)`` in ``cfg.namespace``) on the node of the
    calling process (the driver), seeded with ``claims``; returns its handle once it answers.

    It asks for no CPU (side actors must not take the trainer's CPUs) and runs one call at a time.

    Raises:
        ValueError: an actor of that name is alive (another driver of the same run id).
        ray.exceptions.GetTimeoutError: it did not start within ``CALL_TIMEOUT_S``.
    """
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    handle: Any = ray.remote(JournalActor).options(  # Any: ray types a handle's methods as Never
        name=journal_name(cfg), namespace=cfg.namespace, num_cpus=0, max_concurrency=1, scheduling_strategy=here).remote()
    ray.get(handle.seed.remote(list(claims)), timeout=CALL_TIMEOUT_S)
    return handle


def claims_in(events: list[dict]) -> list[str]:
    """The failure markers a run's events show as claimed (pure): the ``marker`` of each failure event
    (``workers.faults`` names in it the marker it claimed, or for a ``both`` failure's worker part the
    one the dying rank will claim: the driver may have died before it did)."""
    return [e["marker"] for e in events if e["kind"] == "failure" and "marker" in e]


class RunRecord:
    """What the driver has received: every event and metric row of the run, in memory (``events``,
    ``metrics``) and appended to ``events.jsonl`` / ``metrics.jsonl``. The driver is the only writer
    of those files; the rows of an earlier driver of the same run (a resume) are read once, here."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.events = RunDir.read(run.events)
        self.metrics = RunDir.read(run.metrics)
        self._cursors = (0, 0)  # rows taken from the current journal

    def drain(self, channel: RunChannel) -> None:
        """Take the journal's new rows, append them to the run directory and to memory."""
        events, metrics = channel.since(*self._cursors)
        self._cursors = (self._cursors[0] + len(events), self._cursors[1] + len(metrics))
        self._keep(events, metrics)

    def write_event(self, kind: str, **fields: Any) -> None:
        """Record an event of the driver directly (when no journal answers, e.g. a run that failed
        before or while starting it)."""
        self._keep([{"kind": kind, **fields, "unix_s": time.time()}], [])

    def _keep(self, events: list[dict], metrics: list[dict]) -> None:
        self.run.append(self.run.events, events)
        self.run.append(self.run.metrics, metrics)
        self.events.extend(events)
        self.metrics.extend(metrics)

