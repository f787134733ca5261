"""The run's journal: every message a worker or actor sends the driver, through Ray (no shared file).

Workers, the shadow keeper and the failure injector run on any node of a cluster, and the nodes need
not share a disk. So nothing but the driver writes the run directory: the others send their events
and metric rows, claim failure markers and publish the shadow's actor names through ``RunChannel``,
a client of one ``JournalActor`` that the controller starts on its own node (``start_journal``).
The driver drains it incrementally (``RunRecord.drain``: two cursors, never the whole history) into
``events.jsonl`` and ``metrics.jsonl`` and keeps the rows it has seen in memory.

Ordering: the actor runs one call at a time (``max_concurrency=1``), and Ray runs the calls of one
caller in the order it submits them, so each process's events and metric rows keep their order;
``RunChannel.event`` waits for the journal's acknowledgement (a failure event is recorded before the
process that emits it dies), and a metric row sent before an acknowledged event is recorded before it.

A resumed driver starts a new journal (the old one died with the old driver) and seeds it with the
failure markers its ``events.jsonl`` names (``claims_in``), then (once the log keeper tells the
durable step) with those of every failure due before it (``training.faults.fired_before``: what a
run directory lost, e.g. a resume from the storage alone), so a failure that already fired does not
fire again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.run_dir import RunDir

if TYPE_CHECKING:  # the journal actor's process imports no torch (``orchestrator.config`` does)
    from orchestrator.config import JobConfig

CALL_TIMEOUT_S = 120.0
"""How long a caller waits for the journal's answer (it lives on the driver's node; an answer that
takes longer means the driver's node is gone, and the caller fails)."""


class Journal:
    """The run's message board (plain logic; ``JournalActor`` serves it through Ray).

    ``events`` and ``metrics`` are append-only lists of dict rows, each with ``unix_s`` (seconds since
    the epoch, set here when the sender did not). Failure markers are strings (``"<failure index>.<part>"``,
    ``training.faults``) claimed at most once. The shadow pointer is the dict of ``ShadowKeeper._publish``.
    """

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.metrics: list[dict] = []
        self._claims: dict[str, None] = {}  # insertion-ordered set
        self._shadow: dict | None = None

    @staticmethod
    def _stamped(row: dict) -> dict:
        return row if "unix_s" in row else {**row, "unix_s": time.time()}

    def event(self, row: dict) -> None:
        """Append an event row (``kind`` plus its fields)."""
        self.events.append(self._stamped(row))

    def metric(self, row: dict) -> None:
        """Append a metric row (one per executed step)."""
        self.metrics.append(self._stamped(row))

    def since(self, events_cursor: int, metrics_cursor: int) -> tuple[list[dict], list[dict]]:
        """The events and metric rows after the first ``events_cursor`` and ``metrics_cursor`` (the
        counts a reader has already taken), in the order they were appended.

        Raises:
            ValueError: a cursor is negative or past the end (it must be a count of rows taken from this journal).
        """
        for name, cursor, rows in (("events", events_cursor, self.events), ("metrics", metrics_cursor, self.metrics)):
            if not 0 <= cursor <= len(rows):
                raise ValueError(f"{name} cursor {cursor} is outside 0..{len(rows)}: pass the number of rows already taken")
        return self.events[events_cursor:], self.metrics[metrics_cursor:]

    def claim(self, marker: str) -> bool:
        """Claim ``marker``; True for the first caller only (test-and-set)."""
        if marker in self._claims:
            return False
        self._claims[marker] = None
        return True

    def claimed(self, marker: str) -> bool:
        return marker in self._claims

    def claims(self) -> list[str]:
        """Every claimed marker, in claim order."""
        return list(self._claims)

    def publish_shadow(self, pointer: dict) -> None:
        """Replace the shadow pointer (``{"shards": [{shard, name, incarnation}, ...]}``, plus ``name``
        and ``incarnation`` for one shard)."""
        self._shadow = dict(pointer)

    def shadow_pointer(self) -> dict | None:
        """The last published shadow pointer, or None before the first."""
        return self._shadow

    def seed(self, claims: list[str], shadow_pointer: dict | None = None) -> None:
        """Start from a previous driver's state: its claimed markers (and shadow pointer, when given)."""
        for marker in claims:
            self.claim(marker)
        if shadow_pointer is not None:
            self.publish_shadow(shadow_pointer)


class JournalActor(Journal):
    """The Ray actor shell of ``Journal`` (started by ``start_journal``)."""


class RunActiveError(RuntimeError):
    """Actors of the run are still alive when its driver starts: another driver runs it."""


def run_actors(cfg: JobConfig) -> list[str]:
    """The names of run ``cfg.run_id``'s actors alive in ``cfg.namespace``: its journal, log keeper,
    persister, and every shadow incarnation (``<shadow_name>-...``)."""
    ours = (cfg.journal_name, cfg.log_keeper_name, cfg.persister_name)
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == cfg.namespace
                  and (a["name"] in ours or a["name"].startswith(f"{cfg.shadow_name}-")))


def wait_for_previous_driver(cfg: JobConfig, timeout_s: float = 60.0, echo=print) -> None:
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
    """Start this run's journal actor (``cfg.journal_name`` in ``cfg.namespace``) on the node of the
    calling process (the driver), seeded with ``claims``; returns its handle once it answers.

    It asks for no CPU (side actors must not take the trainer's CPUs) and runs one call at a time.

    Raises:
        ValueError: an actor of that name is alive (another driver of the same run id).
        ray.exceptions.GetTimeoutError: it did not start within ``CALL_TIMEOUT_S``.
    """
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    handle: Any = ray.remote(JournalActor).options(  # Any: ray types a handle's methods as Never
        name=cfg.journal_name, namespace=cfg.namespace, num_cpus=0, max_concurrency=1, scheduling_strategy=here).remote()
    ray.get(handle.seed.remote(list(claims)), timeout=CALL_TIMEOUT_S)
    return handle


class RunChannel:
    """A client of the run's journal, for any process of the run on any node (looked up by name on
    first use, so building one needs no Ray). Calls wait at most ``CALL_TIMEOUT_S`` for an answer.

    Raises (every call): ValueError when the journal is not running; ray.exceptions.RayActorError /
    GetTimeoutError when it died or does not answer.
    """

    def __init__(self, cfg: JobConfig) -> None:
        self.name, self.namespace = cfg.journal_name, cfg.namespace
        self._handle = None

    @property
    def handle(self):
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        return self._handle

    def _call(self, method: str, *args):
        return ray.get(getattr(self.handle, method).remote(*args), timeout=CALL_TIMEOUT_S)

    def event(self, kind: str, **fields) -> None:
        """Record an event (``unix_s`` now unless given); returns once the journal has it."""
        self._call("event", {"kind": kind, **fields, "unix_s": fields.get("unix_s", time.time())})

    def metric(self, **row) -> None:
        """Send a metric row (``unix_s`` now unless given) without waiting; recorded in order with this
        process's other calls."""
        self.handle.metric.remote({**row, "unix_s": row.get("unix_s", time.time())})

    def claim(self, marker: str) -> bool:
        """Claim a failure marker; True for the first caller in the run only."""
        return self._call("claim", marker)

    def claimed(self, marker: str) -> bool:
        return self._call("claimed", marker)

    def any_claimed(self) -> bool:
        """True once any failure has fired in this run (a worker start is then a restart)."""
        return bool(self._call("claims"))

    def shadow_pointer(self) -> dict | None:
        return self._call("shadow_pointer")

    def since(self, events_cursor: int, metrics_cursor: int) -> tuple[list[dict], list[dict]]:
        """``Journal.since`` (the driver's drain)."""
        return self._call("since", events_cursor, metrics_cursor)

    def publish_shadow(self, pointer: dict) -> None:
        self._call("publish_shadow", pointer)


def claims_in(events: list[dict]) -> list[str]:
    """The failure markers a run's events show as claimed (pure): the ``marker`` of each failure event
    (``training.faults`` names in it the marker it claimed, or for a ``both`` failure's worker part the
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

    def write_event(self, kind: str, **fields) -> None:
        """Record an event of the driver directly (when no journal answers, e.g. a run that failed
        before or while starting it)."""
        self._keep([{"kind": kind, **fields, "unix_s": time.time()}], [])

    def _keep(self, events: list[dict], metrics: list[dict]) -> None:
        self.run.append(self.run.events, events)
        self.run.append(self.run.metrics, metrics)
        self.events.extend(events)
        self.metrics.extend(metrics)

