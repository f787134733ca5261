"""The driver's side of preemption notices: which of the run's components sit on a node that Ray is
draining (``workers.preempt.draining_nodes``), each such node reported once as a ``DrainNotice``.

What follows a notice is decided in ``orchestrator.control.preemption_actions`` and carried out by the
controller: the notice is recorded, a shadow shard on the node hands its current image to the persister
and is started again elsewhere from it, the persister finishes its pending write and is started again
elsewhere. The train workers save on their own (``workers.preempt``), told by Ray Train.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class DrainNotice:
    """A node being drained (a preemption notice) that holds components of the run.

    Attributes:
        node_id: the node (hex id).
        deadline_unix_s: when it will be taken down (unix seconds; None: Ray was given no deadline).
        seen_unix_s: when the driver first saw the drain.
        components: what of the run it holds: ``workers``, ``shadow <k>`` (shard k), ``persister``.
    """

    node_id: str
    deadline_unix_s: float | None
    seen_unix_s: float
    components: tuple[str, ...]

    @property
    def grace_s(self) -> float | None:
        """Seconds from the driver seeing the notice to the deadline (None without one)."""
        return None if self.deadline_unix_s is None else max(0.0, self.deadline_unix_s - self.seen_unix_s)

    @property
    def shards(self) -> tuple[int, ...]:
        """The shadow shards on the node."""
        return tuple(int(c.split()[1]) for c in self.components if c.startswith("shadow "))


def held_by_node(workers: Mapping[int, str], shards: list[str | None], persister: str | None) -> dict[str, tuple[str, ...]]:
    """Node id -> the run's components on it (pure): ``workers`` (rank -> node id of each rank's newest
    start), ``shards`` (each shadow shard's node id, None: not known yet), ``persister`` (its node id)."""
    held: dict[str, list[str]] = {}
    for node in sorted(set(workers.values())):
        held.setdefault(node, []).append("workers")
    for k, shard_node in enumerate(shards):
        if shard_node is not None:
            held.setdefault(shard_node, []).append(f"shadow {k}")
    if persister is not None:
        held.setdefault(persister, []).append("persister")
    return {node: tuple(parts) for node, parts in held.items()}


class DrainWatch:
    """Reports each drained node that holds a component once (``poll``); ``drains`` is Ray's view of the
    draining nodes (default ``workers.preempt.draining_nodes``; a fake in the control tests)."""

    def __init__(self, drains: Callable[[], dict[str, float | None]] | None = None) -> None:
        if drains is None:
            from raycheck.workers.preempt import draining_nodes

            drains = draining_nodes
        self.drains = drains
        self.notices: list[DrainNotice] = []
        """Every notice reported so far, in order."""

    def poll(self, held: Mapping[str, tuple[str, ...]]) -> tuple[DrainNotice, ...]:
        """The notices of the nodes that are draining, hold a component (``held``, from ``held_by_node``) and
        were not reported before."""
        reported = {n.node_id for n in self.notices}
        now = time.time()
        new = tuple(DrainNotice(node, deadline, now, held[node]) for node, deadline in self.drains().items()
                    if node in held and node not in reported)
        self.notices += new
        return new


def drained_unix_s(injected: dict | None, seen: dict) -> float:
    """When a node seen draining (the driver's ``preemption_notice`` event ``seen``) got its notice: for an
    injected one (its ``failure`` event), Ray's deadline less the grace asked for (the drain command runs a
    moment after the failure is recorded); else when the driver saw it."""
    if injected is None or seen.get("deadline_unix_s") is None or injected.get("grace_s") is None:
        return injected["unix_s"] if injected is not None else seen["unix_s"]
    return min(seen["unix_s"], seen["deadline_unix_s"] - injected["grace_s"])


def notices_of(events: list[dict]) -> list[dict]:
    """The preemption notices in an event stream (pure), oldest first: the driver's ``preemption_notice``
    events, and an injected ``preempt`` failure's drain that the driver did not see holding a component (a
    notice with no grace: Ray Train restarted the workers elsewhere before the driver's next look), with
    ``workers`` among its components when a rank's newest start before it was on that node. Each:
    ``node_id``, ``components``, ``notice_unix_s`` (the drain, ``drained_unix_s``; for a drain the driver did
    not see, the injected failure's time), ``deadline_unix_s``."""
    injected = {e["node_id"]: e for e in events if e["kind"] == "failure" and e.get("target") in ("preempt", "preempt-shadow") and e.get("node_id")}
    seen = {e["node_id"]: e for e in events if e["kind"] == "preemption_notice"}
    notices = [{"node_id": node, "components": e["components"], "deadline_unix_s": e.get("deadline_unix_s"),
                "notice_unix_s": drained_unix_s(injected.get(node), e)} for node, e in seen.items()]
    for node, e in injected.items():
        if node not in seen:
            placed = {p["rank"]: p["node_id"] for p in events if p["kind"] == "placement" and p["component"] == "worker" and p["unix_s"] <= e["unix_s"]}
            notices.append({"node_id": node, "components": ["workers"] if node in placed.values() else [],
                            "deadline_unix_s": e.get("deadline_unix_s"), "notice_unix_s": e["unix_s"]})
    return sorted(notices, key=lambda n: n["notice_unix_s"])


def preemption_records(events: list[dict], executions: list[dict]) -> list[dict]:
    """Each preemption of the run (``notices_of``), from its events (pure; ``summary.json``'s ``preemptions``),
    in order: ``node_id``, ``components``, ``notice_unix_s``, ``deadline_unix_s``, ``grace_s`` (notice to
    deadline, seconds), ``saved`` (per component: ``component``, ``step``, ``notice_to_safe_seconds``),
    ``unsaved`` (per component: ``component`` and ``error`` when given) and, when it held train workers and they
    restarted, ``restored_step`` and ``recomputed_steps`` (steps done before the restart that the
    restarted workers do again: 0 when the just-in-time state was saved)."""
    records = []
    for notice in notices_of(events):
        node, notice_s, deadline = notice["node_id"], notice["notice_unix_s"], notice["deadline_unix_s"]
        mine = [e for e in events if e["kind"] in ("preemption_saved", "preemption_unsaved")
                and (e.get("node_id") == node or node in e.get("nodes", ()))]
        record: dict = {**notice, "grace_s": None if deadline is None else round(deadline - notice_s, 3),
                        "saved": [{"component": e["component"], "step": e.get("step"), "notice_to_safe_seconds": e["unix_s"] - notice_s}
                                  for e in mine if e["kind"] == "preemption_saved"],
                        "unsaved": [{"component": e["component"], **({"error": e["error"]} if "error" in e else {})}
                                    for e in mine if e["kind"] == "preemption_unsaved"]}
        if "workers" in notice["components"]:
            after = next((e for e in events if e["kind"] == "recovery" and e["unix_s"] > notice_s), None)
            if after is not None:
                done = {r["step"] for r in executions if r["unix_s"] < after["unix_s"]}
                record.update(restored_step=after["restored_step"],
                              recomputed_steps=sum(1 for step in done if step >= after["restored_step"]))
        records.append(record)
    return records
