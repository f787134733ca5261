"""The shadow's replay loop (``actors.shadow.ShadowLoop``) without Ray: the snapshot schedule, the
hand-off of images to the sink, ``snapshot_at`` / ``snapshot_now`` / ``set_interval``, its status,
hashes and ``image``'s wait. The loop is driven one round at a time (``run_once``) or on its thread
against a log the test feeds; images are checked bitwise against an independent replay."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

import pytest

from raycheck.actors.shadow import ShadowLoop, ShadowReplayer
from raycheck.storage.steplog import StepRecord
from raycheck.training.model import layout_sha256, load_model, parameter_layout, trainable_parameters
from raycheck.training.state import state_sha256
from raycheck.training.zo import GENERATOR

STEPS = 8


def record(step: int) -> StepRecord:
    return StepRecord(step=step, seed=500 + step, projected_grad=0.21 - step / 20, loss_plus=0.7, loss_minus=0.69,
                      lr=1e-3, eps=1e-3, weight_decay=0.01, batch_id=step)


class FedLog:
    """A ``LogSource`` the test feeds (from step 0 on): ``poll`` returns the records fed since the last
    call, or raises ``fail`` when set."""

    def __init__(self, params) -> None:
        self.header = {"layout_sha256": layout_sha256(parameter_layout(params)), "generator": GENERATOR, "model": "tiny"}
        self.records: list[StepRecord] = []
        self.next_step = 0
        self.fail: Exception | None = None

    def feed(self, steps) -> None:
        self.records.extend(record(s) for s in steps)

    def seek(self, step: int) -> None:
        self.next_step = step

    def poll(self) -> list[StepRecord]:
        if self.fail is not None:
            raise self.fail
        new = self.records[self.next_step:]
        self.next_step += len(new)
        return new


class Sink:
    """Records what the loop hands over; ``missing``: raise ``LookupError`` as ``NamedPersister`` does
    while no persister is registered. States are hashed at the end, so an image that still shares
    memory with the replayed parameters shows up as a later state."""

    def __init__(self, missing: bool = False) -> None:
        self.calls: list[tuple] = []
        self.missing = missing

    def submit(self, step, state) -> None:
        if self.missing:
            raise LookupError("no snapshot persister registered as 'p'")
        self.calls.append((step, state))

    def submit_part(self, step, shard, shards, part) -> None:
        self.calls.append((step, shard, shards, part))

    def steps(self) -> list[int]:
        return [call[0] for call in self.calls]

    def hashes(self) -> list[str]:
        return [state_sha256(call[-1]) for call in self.calls]


@pytest.fixture(scope="module")
def params():
    """The tiny model's initial parameters; never written (every loop replays a copy)."""
    return trainable_parameters(load_model("tiny"))


def clone(params):
    return OrderedDict((n, p.clone()) for n, p in params.items())


@pytest.fixture(scope="module")
def reference(params) -> dict[int, str]:
    """step -> state_sha256 after that many steps from ``params``, by a replayer outside any loop."""
    source = FedLog(params)
    source.feed(range(STEPS))
    replayer = ShadowReplayer(clone(params), source, hash_every=1)
    replayer.catch_up()
    return {0: state_sha256(params), **replayer.hashes}


def loop_over(params, start_step: int = 0, hash_every: int = 0, **kwargs) -> tuple[ShadowLoop, FedLog]:
    """A loop (no sink, no interval unless ``kwargs`` say) over a copy of ``params``, taken as the
    state after ``start_step`` steps, following an empty log the test feeds from step 0 on."""
    source = FedLog(params)
    replayer = ShadowReplayer(clone(params), source, start_step, hash_every)
    return ShadowLoop(replayer, **{"sink": None, "every_steps": 0, **kwargs}), source


def run_all(loop: ShadowLoop) -> int:
    """Drive the loop until nothing is left to replay; returns the rounds that replayed a step."""
    rounds = 0
    while loop.run_once():
        rounds += 1
    return rounds


def test_images_go_to_the_sink_on_the_interval_bitwise(params, reference):
    sink = Sink()
    loop, source = loop_over(params, sink=sink, every_steps=2)
    source.feed(range(5))
    assert run_all(loop) == 5
    assert sink.steps() == [2, 4] and sink.hashes() == [reference[2], reference[4]]
    status = loop.status()
    assert (status["snapshots_sent"], status["snapshots_skipped"], status["last_snapshot_step"]) == (2, 0, 4)


def test_a_restored_whole_shadow_counts_from_its_base_and_shards_snap_on_the_shared_grid(params, reference):
    whole_sink, shard_sink = Sink(), Sink()
    whole, whole_log = loop_over(params, start_step=3, sink=whole_sink, every_steps=2)
    shard, shard_log = loop_over(params, start_step=3, sink=shard_sink, every_steps=2, shard=1, shards=2)
    for source in (whole_log, shard_log):
        source.feed(range(8))
    assert run_all(whole) == run_all(shard) == 5
    assert whole_sink.steps() == [5, 7]  # every 2 steps from the restored step 3
    assert [call[:3] for call in shard_sink.calls] == [(4, 1, 2), (6, 1, 2), (8, 1, 2)]  # the multiples of 2, as parts
    assert shard.status()["shard"] == 1


def test_an_image_the_sink_cannot_take_is_skipped_and_counted(params):
    loop, source = loop_over(params, sink=Sink(missing=True), every_steps=1)
    quiet, quiet_log = loop_over(params, sink=None, every_steps=1)
    for s in (source, quiet_log):
        s.feed(range(2))
    run_all(loop), run_all(quiet)
    status, quiet_status = loop.status(), quiet.status()
    assert (status["snapshots_sent"], status["snapshots_skipped"], status["last_snapshot_step"]) == (0, 2, 2)
    assert (quiet_status["snapshots_sent"], quiet_status["snapshots_skipped"], quiet_status["last_snapshot_step"]) == (0, 0, 2)


def test_snapshot_at_takes_the_exact_step_now_or_later_and_never_a_past_one(params, reference):
    sink = Sink()
    loop, source = loop_over(params, sink=sink)
    source.feed(range(2))
    run_all(loop)
    assert loop.snapshot_at(1) is False and sink.calls == []  # already past step 1
    assert loop.snapshot_at(2) is True and sink.steps() == [2]  # exactly there: at once
    assert loop.snapshot_at(6) is True and loop.snapshot_at(4) is True  # ahead: the newest request wins
    assert sink.steps() == [2]
    source.feed(range(2, 7))
    run_all(loop)
    assert sink.steps() == [2, 4] and sink.hashes() == [reference[2], reference[4]]
    assert loop.status()["last_snapshot_step"] == 4


def test_snapshot_now_hands_the_current_state_and_restarts_the_interval(params, reference):
    sink = Sink()
    loop, source = loop_over(params, sink=sink, every_steps=3)
    source.feed(range(2))
    run_all(loop)
    assert loop.snapshot_now() == 2
    source.feed(range(2, 6))
    run_all(loop)
    assert sink.steps() == [2, 5] and sink.hashes() == [reference[2], reference[5]]  # not 3: the gap counts from 2


def test_set_interval_takes_effect_at_the_next_step(params):
    sink = Sink()
    loop, source = loop_over(params, sink=sink, every_steps=0)
    source.feed(range(3))
    run_all(loop)
    assert sink.calls == [] and loop.status()["snapshot_every_steps"] == 0
    loop.set_interval(2)  # the 3 steps since the start already reach it
    source.feed(range(3, 6))
    run_all(loop)
    assert sink.steps() == [4, 6] and loop.status()["snapshot_every_steps"] == 2
    with pytest.raises(ValueError, match="every_steps must be >= 0, got -1"):
        loop.set_interval(-1)


def test_status_reports_progress_lag_and_replay_cost(params):
    loop, source = loop_over(params, shard=0, clock=lambda: 0.0)  # a clock standing still: one poll while busy
    before = loop.status()
    assert (before["step"], before["log_end"], before["replayed"], before["replay_seconds_per_step"]) == (0, 0, 0, None)
    source.feed(range(5))
    loop.run_once(), loop.run_once()
    status = loop.status()
    assert status["replay_seconds_per_step"] > 0
    del status["replay_seconds_per_step"]
    assert status == {"shard": 0, "step": 2, "log_end": 5, "lag_steps": 3, "replayed": 2, "snapshots_sent": 0,
                      "snapshots_skipped": 0, "snapshot_every_steps": 0, "last_snapshot_step": 0, "error": None}


def test_hashes_are_recorded_every_hash_every_steps(params, reference):
    loop, source = loop_over(params, hash_every=2)
    source.feed(range(5))
    run_all(loop)
    hashes = loop.hashes()
    assert hashes == {2: reference[2], 4: reference[4]}
    hashes.clear()
    assert loop.hashes() == {2: reference[2], 4: reference[4]}  # a copy


class AnnouncingClock:
    """A clock standing still that sets ``read`` on every reading. ``image`` reads it with the loop's
    lock held and keeps the lock until it waits, so once ``read`` is set a replay round can only take
    the lock while the reader waits."""

    def __init__(self) -> None:
        self.read = threading.Event()

    def __call__(self) -> float:
        self.read.set()
        return 0.0


def test_image_waits_until_the_step_is_replayed(params, reference):
    clock = AnnouncingClock()
    loop, source = loop_over(params, clock=clock)
    source.feed(range(3))
    got = []
    waiter = threading.Thread(target=lambda: got.append(loop.image(3, timeout_s=60)))
    waiter.start()
    assert clock.read.wait(60)  # the waiter holds the lock: it is waiting before step 1 is replayed
    assert run_all(loop) == 3
    waiter.join(60)
    assert not waiter.is_alive() and got[0]["step"] == 3 and state_sha256(got[0]["state"]) == reference[3]
    assert loop.state_sha256(3, timeout_s=0) == reference[3]


def test_image_times_out_and_an_exact_hash_refuses_a_past_step(params):
    ticks = itertools.count(0, 10)  # 10 s pass at each reading: no real waiting
    loop, source = loop_over(params, clock=lambda: next(ticks))
    with pytest.raises(TimeoutError, match="shadow at step 0, 1 requested"):
        loop.image(1, timeout_s=5)
    source.feed(range(2))
    run_all(loop)
    assert loop.image(1, timeout_s=5)["step"] == 2
    with pytest.raises(RuntimeError, match="shadow is at step 2, past 1"):
        loop.state_sha256(1, timeout_s=5)


def test_the_thread_replays_the_log_and_stops(params, reference):
    sink = Sink()
    loop, source = loop_over(params, sink=sink, every_steps=3)
    source.feed(range(4))
    loop.start()
    try:
        image = loop.image(4, timeout_s=60)  # woken by the thread's rounds
    finally:
        loop.stop()
    assert not loop._thread.is_alive()
    assert image["step"] == 4 and state_sha256(image["state"]) == reference[4]
    assert sink.steps() == [3] and sink.hashes() == [reference[3]]


def test_an_error_in_the_loop_stops_it_and_is_surfaced(params):
    loop, _ = loop_over(params)
    loop.replayer.reader.fail = OSError("log keeper unreachable")
    with pytest.raises(OSError, match="log keeper unreachable"):
        loop.run_once()
    loop.start()
    try:
        with pytest.raises(RuntimeError, match="^shadow replay failed: OSError: log keeper unreachable$"):
            loop.image(1, timeout_s=60)  # woken by the error: no timing involved
    finally:
        loop.stop()
    assert not loop._thread.is_alive() and loop.status()["error"] == "OSError: log keeper unreachable"
