"""The run's journal without Ray: ordering, incremental reads with cursors, claims that fire once,
seeding a resumed driver; and the driver's record of it in the run directory."""

from __future__ import annotations

import json
import threading

import pytest

from raycheck.actors.journal import Journal
from raycheck.job.run_dir import RunDir
from raycheck.job.names import journal_name
from raycheck.orchestrator.journal import RunRecord, claims_in


def test_rows_keep_their_order_and_cursors_return_only_what_is_new():
    journal = Journal()
    journal.event({"kind": "phase", "phase": "running", "unix_s": 5.0})
    journal.metric({"step": 0, "loss": 0.7})
    journal.event({"kind": "failure", "step": 1})
    events, metrics = journal.since(0, 0)
    assert events == [{"kind": "phase", "phase": "running", "unix_s": 5.0}, {"kind": "failure", "step": 1, "unix_s": events[1]["unix_s"]}]
    assert [m["step"] for m in metrics] == [0] and isinstance(metrics[0]["unix_s"], float)  # stamped when missing
    assert journal.since(2, 1) == ([], [])
    journal.metric({"step": 1, "loss": 0.6, "unix_s": 9.0})
    assert journal.since(2, 1) == ([], [{"step": 1, "loss": 0.6, "unix_s": 9.0}])
    assert journal.since(1, 2) == ([events[1]], [])


@pytest.mark.parametrize("cursors", [(-1, 0), (0, 2), (3, 0)])
def test_a_cursor_outside_the_journal_is_refused(cursors):
    journal = Journal()
    journal.event({"kind": "phase"})
    journal.metric({"step": 0})
    with pytest.raises(ValueError, match="pass the number of rows already taken"):
        journal.since(*cursors)


def test_a_marker_is_claimed_once_and_a_seed_carries_the_claims_and_pointer():
    journal = Journal()
    assert journal.claims() == [] and journal.shadow_pointer() is None
    assert journal.claim("1.worker") is True
    assert journal.claim("1.worker") is False
    assert journal.claim("0.shadow") is True
    assert journal.claims() == ["1.worker", "0.shadow"]
    assert journal.claimed("0.shadow") and not journal.claimed("0.worker")
    journal.publish_shadow({"name": "s-1", "incarnation": 1, "shards": [{"shard": 0, "name": "s-1", "incarnation": 1}]})
    assert journal.shadow_pointer()["name"] == "s-1"

    resumed = Journal()
    resumed.seed(journal.claims(), shadow_pointer={"shards": []})
    assert resumed.claim("1.worker") is False and resumed.claim("2.worker") is True
    assert resumed.claims() == ["1.worker", "0.shadow", "2.worker"] and resumed.shadow_pointer() == {"shards": []}


def test_the_claims_of_a_previous_driver_come_from_its_failure_events():
    events = [{"kind": "phase", "phase": "running"},
              {"kind": "failure", "target": "worker", "marker": "1.worker"},
              {"kind": "failure", "target": "shadow", "marker": "2.shadow"},
              {"kind": "recovery", "at_step": 3}]
    assert claims_in(events) == ["1.worker", "2.shadow"]


class ListChannel:
    """A journal served in process (``RunRecord.drain`` needs only ``since``)."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def since(self, events_cursor: int, metrics_cursor: int):
        return self.journal.since(events_cursor, metrics_cursor)


def test_the_driver_appends_each_row_once_and_keeps_an_earlier_drivers_rows(tmp_path):
    run = RunDir(tmp_path)
    run.append(run.events, [{"kind": "failure", "marker": "0.worker", "unix_s": 1.0}])  # an earlier driver's
    record = RunRecord(run)
    journal = Journal()
    journal.event({"kind": "resume", "unix_s": 2.0})
    journal.metric({"step": 0, "unix_s": 2.5})
    record.drain(ListChannel(journal))
    journal.event({"kind": "recovery", "unix_s": 3.0})
    record.drain(ListChannel(journal))
    record.drain(ListChannel(journal))  # nothing new
    record.write_event("phase", phase="failed")
    kinds = ["failure", "resume", "recovery", "phase"]
    assert [e["kind"] for e in record.events] == kinds
    assert [json.loads(line)["kind"] for line in run.events.read_text().splitlines()] == kinds
    assert [json.loads(line) for line in run.metrics.read_text().splitlines()] == record.metrics == [{"step": 0, "unix_s": 2.5}]
    assert RunRecord(run).events == record.events  # what a resumed driver reads back


@pytest.mark.ray
def test_the_actor_keeps_each_senders_order_and_serves_claims_and_the_pointer_to_every_process(tmp_path):
    """A real journal actor and a Ray task in another process: the task's fire-and-forget metric rows
    are recorded before its acknowledged event; a claim seeded by the driver, or made by the task, is
    refused to the next caller; the pointer the task publishes is what the driver reads."""
    import ray

    from conftest import free_port
    from raycheck.actors.journal import RunChannel
    from raycheck.job.config import JobConfig
    from raycheck.orchestrator.journal import RunActiveError, run_actors, start_journal, wait_for_previous_driver

    cfg = JobConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path), model="tiny", run_id="journal-actor")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace=cfg.namespace, _metrics_export_port=free_port())
    try:
        wait_for_previous_driver(cfg, timeout_s=0.1)  # none: returns at once
        journal = start_journal(cfg, ["0.worker"])

        @ray.remote(num_cpus=0)
        def worker(config: dict) -> list:
            channel = RunChannel(JobConfig.from_dict(config))
            for step in range(50):
                channel.metric(step=step)
            channel.event("failure", target="worker", marker="1.worker")
            recorded = len(channel.since(0, 0)[1])  # once the event is acknowledged
            channel.publish_shadow({"shards": [{"shard": 0, "name": "s-3", "incarnation": 3}]})
            return [recorded, channel.claim("0.worker"), channel.claim("1.worker"), channel.any_claimed()]

        assert ray.get(worker.remote(cfg.to_dict()), timeout=120) == [50, False, True, True]
        channel, record = RunChannel(cfg), RunRecord(RunDir(tmp_path))
        record.drain(channel)
        assert [m["step"] for m in record.metrics] == list(range(50)) and [e["marker"] for e in record.events] == ["1.worker"]
        assert channel.claim("1.worker") is False and channel.claimed("1.worker")
        assert channel.shadow_pointer() == {"shards": [{"shard": 0, "name": "s-3", "incarnation": 3}]}
        assert RunDir.read(RunDir(tmp_path).metrics) == record.metrics
        # a second driver of this run, while the first one's journal lives: it waits, then refuses
        with pytest.raises(RunActiveError, match=rf"^run journal-actor's actors are still alive after 0.5 s \({journal_name(cfg)}\)"):
            wait_for_previous_driver(cfg, timeout_s=0.5, echo=lambda _: None)
        threading.Timer(0.5, ray.kill, args=(journal,), kwargs={"no_restart": True}).start()  # the first driver's actors go
        wait_for_previous_driver(cfg, timeout_s=60, echo=lambda _: None)  # returns once Ray has removed it
        assert run_actors(cfg) == []
    finally:
        ray.shutdown()
