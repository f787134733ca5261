"""The run's journal: every message a worker or actor sends the driver, through Ray (no shared file).

Workers, the shadow keeper and the failure injector run on any node of a cluster, and the nodes need
not share a disk. So nothing but the driver writes the run directory: the others send their events
and metric rows, claim failure markers and publish the shadow's actor names through ``RunChannel``,
a client of one ``JournalActor`` that the controller starts on its own node
(``orchestrator.journal.start_journal``). The driver drains it incrementally
(``orchestrator.journal.RunRecord.drain``: two cursors, never the whole history) into the run
directory, and keeps the rows it has seen in memory; this module touches no file.

Ordering: the actor runs one call at a time (``max_concurrency=1``), and Ray runs the calls of one
caller in the order it submits them, so each process's events and metric rows keep their order;
``RunChannel.event`` waits for the journal's acknowledgement (a failure event is recorded before the
process that emits it dies), and a metric row sent before an acknowledged event is recorded before it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray

from raycheck.job.names import journal_name

if TYPE_CHECKING:  # the journal actor's process imports no torch (``job.config`` does)
    from raycheck.job.config import JobConfig

CALL_TIMEOUT_S = 120.0
"""How long a caller waits for the journal's answer (it lives on the driver's node; an answer that
takes longer means the driver's node is gone, and the caller fails)."""


class Journal:
    """The run's message board (plain logic; ``JournalActor`` serves it through Ray).

    ``events`` and ``metrics`` are append-only lists of dict rows, each with ``unix_s`` (seconds since
    the epoch, set here when the sender did not). Failure markers are strings (``"<failure index>.<part>"``,
    ``workers.faults``) claimed at most once. The shadow pointer is the dict of ``ShadowKeeper._publish``.
    """

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.metrics: list[dict] = []
        self._claims: dict[str, None] = {}  # insertion-ordered set
        self._shadow: dict | None = None
        self._trainer: Any = None

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

    def publish_trainer(self, handle: Any) -> None:
        """Keep Ray Train's controller actor (its handle, sent by ``orchestrator.group_timeline``), so the
        driver can abort a fit its run no longer wants (``trainer``)."""
        self._trainer = handle

    def trainer(self) -> Any:
        """The handle of Ray Train's controller actor, or None before its first worker group started."""
        return self._trainer

    def seed(self, claims: list[str], shadow_pointer: dict | None = None) -> None:
        """Start from a previous driver's state: its claimed markers (and shadow pointer, when given)."""
        for marker in claims:
            self.claim(marker)
        if shadow_pointer is not None:
            self.publish_shadow(shadow_pointer)


class JournalActor(Journal):
    """The Ray actor shell of ``Journal`` (started by ``orchestrator.journal.start_journal``)."""


class RunChannel:
    """A client of the run's journal, for any process of the run on any node (looked up by name on
    first use, so building one needs no Ray). Calls wait at most ``CALL_TIMEOUT_S`` for an answer.

    Raises (every call): ValueError when the journal is not running; ray.exceptions.RayActorError /
    GetTimeoutError when it died or does not answer.
    """

    def __init__(self, cfg: JobConfig) -> None:
        self.name, self.namespace = journal_name(cfg), cfg.namespace
        self._handle = None

    @classmethod
    def of_run(cls, run_id: str, namespace: str) -> "RunChannel":
        """The channel of run ``run_id`` in Ray namespace ``namespace``, without its configuration (a worker
        that lost it, ``workers.own_loop_zo``)."""
        channel = cls.__new__(cls)
        channel.name, channel.namespace, channel._handle = journal_name(run_id), namespace, None
        return channel

    @property
    def handle(self):
        if self._handle is None:
            self._handle = ray.get_actor(self.name, namespace=self.namespace)
        return self._handle

    def _call(self, method: str, *args):
        return ray.get(getattr(self.handle, method).remote(*args), timeout=CALL_TIMEOUT_S)

    def event(self, kind: str, **fields: Any) -> None:
        """Record an event (``unix_s`` now unless given); returns once the journal has it."""
        self._call("event", {"kind": kind, **fields, "unix_s": fields.get("unix_s", time.time())})

    def metric(self, **row: Any) -> None:
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
