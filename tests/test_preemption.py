"""The driver's side of preemption notices, pure: which drained nodes hold what, each reported once, what each
notice calls for (``orchestrator.control``), and the summary's record of each preemption."""

from __future__ import annotations

import pytest

from raycheck.orchestrator.control import (HandOffShadow, Limits, MovePersister, Observation, PersisterStatus, RecordNotice, Running,
                                           ShadowStatus, ShardStatus, Stop, WorkerGroupStatus, step)
from raycheck.orchestrator.preemption import DrainNotice, DrainWatch, held_by_node, preemption_records

LIMITS = Limits(max_shadow_restarts=2, max_persister_restarts=2, max_worker_failures=10)


def test_each_drained_node_that_holds_a_component_is_reported_once_with_what_it_holds():
    held = held_by_node({0: "gpu", 1: "gpu"}, ["cpu", None], "cpu")
    assert held == {"gpu": ("workers",), "cpu": ("shadow 0", "persister")}
    drains: dict[str, float | None] = {"elsewhere": 50.0}
    watch = DrainWatch(lambda: drains)
    assert watch.poll(held) == ()  # a drained node that holds nothing of the run is not this run's notice
    drains["cpu"] = 100.0
    [notice] = watch.poll(held)
    assert (notice.node_id, notice.deadline_unix_s, notice.components, notice.shards) == ("cpu", 100.0, ("shadow 0", "persister"), (0,))
    assert watch.poll(held) == ()  # once
    drains["gpu"] = None
    [workers] = watch.poll(held)
    assert (workers.components, workers.grace_s) == (("workers",), None)


def test_a_notice_is_recorded_then_the_shadow_hands_off_before_the_persister_moves_and_nothing_after_the_end():
    notice = DrainNotice("cpu", deadline_unix_s=110.0, seen_unix_s=100.0, components=("shadow 1", "persister"))
    assert notice.grace_s == 10.0
    running = WorkerGroupStatus(running=True)
    shadow = ShadowStatus((ShardStatus(0, 0), ShardStatus(1, 0)))
    state, actions = step(Running(), Observation(workers=running, persister=PersisterStatus(0), shadow=shadow, notices=(notice,)), LIMITS)
    assert actions == (RecordNotice(notice), HandOffShadow(notice, (1,)), MovePersister(notice))
    workers = DrainNotice("gpu", 110.0, 100.0, ("workers",))  # the train workers save on their own
    assert step(state, Observation(workers=running, persister=PersisterStatus(0), notices=(workers,)), LIMITS)[1] == (RecordNotice(workers),)
    ended = WorkerGroupStatus(running=False, ok=True)
    assert step(state, Observation(workers=ended, persister=PersisterStatus(0), notices=(notice,)), LIMITS)[1][-1:] == (Stop(),)
    assert not any(isinstance(a, RecordNotice) for a in step(state, Observation(workers=ended, persister=PersisterStatus(0),
                                                                                 notices=(notice,)), LIMITS)[1])


def test_the_summary_gives_each_preemption_its_grace_what_was_saved_when_and_the_steps_redone():
    events = [
        {"kind": "placement", "component": "worker", "rank": 0, "node_id": "gpu", "unix_s": 1.0},
        {"kind": "failure", "target": "preempt", "node_id": "gpu", "grace_s": 9.5, "deadline_unix_s": 20.5, "unix_s": 10.0, "step": 4},
        # the drain ran half a second after the failure was recorded: Ray's deadline less the grace is when it came
        {"kind": "preemption_notice", "node_id": "gpu", "components": ["workers"], "deadline_unix_s": 20.0, "unix_s": 11.0},
        {"kind": "preemption_saved", "component": "workers", "step": 6, "nodes": ["gpu"], "unix_s": 11.5},
        {"kind": "recovery", "restored_step": 6, "unix_s": 25.0},
    ]
    rows = [{"step": s, "unix_s": 5.0 + s} for s in range(6)] + [{"step": 6, "unix_s": 26.0}]
    [record] = preemption_records(events, rows)
    assert record == {"node_id": "gpu", "components": ["workers"], "notice_unix_s": 10.5, "deadline_unix_s": 20.0, "grace_s": 9.5,
                      "saved": [{"component": "workers", "step": 6, "notice_to_safe_seconds": pytest.approx(1.0)}], "unsaved": [],
                      "restored_step": 6, "recomputed_steps": 0}
    # no grace: the driver never saw the node hold anything (Ray Train had moved the workers); a save cut off
    events = [events[0], {**events[1], "grace_s": 0.0, "deadline_unix_s": 10.0}, {"kind": "recovery", "restored_step": 3, "unix_s": 12.0}]
    [record] = preemption_records(events, rows)
    assert (record["components"], record["grace_s"], record["saved"], record["restored_step"], record["recomputed_steps"]) == (
        ["workers"], 0.0, [], 3, 3)  # steps 3 to 5 ran before the restart and run again
