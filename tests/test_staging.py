"""Staging without waiting: reusable staging buffers (``training.state.StagingPool``) and checks that come
due while the background writer is still busy are postponed, never waited for (tiny model, real
snippets, a real snapshot store on disk held by a gate, no Ray)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from raycheck.experiments.fo_bench import step_records
from raycheck.policies.layerwise import LayerwiseConfig
from raycheck.storage.snapshots import SnapshotStore
from test_fo import make_trainer, train
from raycheck.training.checkpointing import FullCheckpointer
from raycheck.training.layerwise import LayerwiseCheckpointer
from raycheck.training.overlapped import OverlappedCheckpointer
from raycheck.training.state import StagingPool, copy_into, state_sha256

GATE_TIMEOUT_S = 60.0


class GatedStore(SnapshotStore):
    """A real snapshot store whose writes wait for ``gate`` (a write that is still waiting after
    ``GATE_TIMEOUT_S`` fails). Each write records its step, the arrays it was handed, and the sha256
    of those arrays when it began and again when the gate let it go: equal hashes prove the loop did
    not overwrite a staged buffer while its check was still being written."""

    def __init__(self, root: str) -> None:
        super().__init__(root, keep_last=100)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.calls: list[dict] = []

    def _gated(self, step: int, state) -> None:
        before = state_sha256(state)
        self.entered.set()
        if not self.gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the test never opened the gate")
        self.calls.append({"step": step, "arrays": list(state.values()), "before": before, "after": state_sha256(state)})

    def write(self, step, state, config=None):
        self._gated(step, state)
        return super().write(step, state, config=config)

    def write_units(self, step, changed, names, config=None, full_state=None):
        self._gated(step, full_state)
        return super().write_units(step, changed, names, config=config, full_state=full_state)


def attach(ckpt, trainer, store: GatedStore, states: dict, held_at: int, flush_at: int | None = None):
    """The ``after`` callback of ``train``: the checkpointer's ``after_step``, then the state's sha256 into
    ``states``; after step ``held_at`` it waits until a write has entered the gate (and is held there);
    after step ``flush_at`` it waits until every write has finished."""

    def after(done: int) -> None:
        ckpt.after_step(done, trainer.state_view)
        states[done] = state_sha256(trainer.state_view())
        if done == held_at:
            assert store.entered.wait(GATE_TIMEOUT_S)
        if done == flush_at:
            ckpt.flush(GATE_TIMEOUT_S)

    return after


def test_staging_pool_hands_out_each_set_once_and_copy_into_reuses_arrays():
    pool = StagingPool(2)
    a, b = pool.take(), pool.take()
    assert a is not b and pool.take() is None  # both in use: no wait, None
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "s": np.ones(1, np.float32)}
    staged = copy_into(a, state)
    first = a["w"]
    assert list(staged) == ["w", "s"] and staged["w"].tobytes() == state["w"].tobytes() and staged["w"] is not state["w"]
    state["w"] += 1
    assert copy_into(a, state)["w"] is first and first.tobytes() == state["w"].tobytes()  # same array, new bits
    assert copy_into(a, {"w": np.zeros(4, np.float64)})["w"] is not first  # another shape: a new array
    pool.give_back(a)
    assert pool.take() is a
    pool.give_back(b)
    pool.give_back(a)
    assert pool.take() is a and pool.take() is b  # the set given back last first
    pool.give_back(a)
    with pytest.raises(ValueError, match="not a buffer set of this pool that is in use"):
        pool.give_back({})
    pool.give_back(b)
    with pytest.raises(ValueError, match="not a buffer set of this pool that is in use"):
        pool.give_back(b)
    with pytest.raises(ValueError, match="a staging pool needs >= 1 buffer set, got 0"):
        StagingPool(0)


def test_a_layerwise_check_due_while_the_writer_is_busy_is_postponed_not_waited_for(encoder, data, tmp_path):
    """A check every step, one check queued behind the running one (2 buffer sets). The write of step 1
    is held by the gate; step 2 is staged and queued; steps 3 and 4 find no free set: their check is
    postponed and ``after_step`` returns (were it to wait, the gate, opened by this thread only
    afterwards, would fail the held write). Once the gate is open and the writer done, the postponed
    check runs at step 5 in the buffers given back last (step 2's), and step 6 in those of step 1."""
    store = GatedStore(str(tmp_path))
    trainer = make_trainer(encoder)
    ckpt = LayerwiseCheckpointer(store, 1, LayerwiseConfig(threshold=0.0, staleness_bound_steps=1000), max_pending=1)
    states = {}
    after = attach(ckpt, trainer, store, states, held_at=1)  # the check of step 1 is held in its write

    train(trainer, data[0], 0, 4, after=after)
    assert ckpt.schedule.last_step == 2 and store.calls == [] and ckpt.postponed.checks == 0
    store.gate.set()
    assert ckpt.flush(GATE_TIMEOUT_S)
    train(trainer, data[0], 4, 6, after=after)
    stats = ckpt.close(GATE_TIMEOUT_S)

    assert stats["errors"] == [] and stats["finished"]
    assert (stats["postponed_checks"], stats["postponed_steps"]) == (1, 2)  # due at 3, ran at 5
    calls = {c["step"]: c for c in store.calls}
    assert list(calls) == [1, 2, 5, 6] and [i.step for i in store.list()] == [1, 2, 5, 6]
    assert len(set(states.values())) == 6  # every step changed the state
    for step, call in calls.items():  # the staged copy is the state of its step, untouched while written
        assert call["before"] == call["after"] == states[step], step
        assert state_sha256(store.load(store.list()[[1, 2, 5, 6].index(step)])) == states[step], step  # threshold 0: all units
    same = lambda x, y: all(p is q for p, q in zip(calls[x]["arrays"], calls[y]["arrays"], strict=True))
    assert same(5, 2) and same(6, 1) and not any(p is q for p, q in zip(calls[1]["arrays"], calls[2]["arrays"]))


def test_full_sync_blocks_until_each_checkpoint_is_committed_and_resumes_bitwise(encoder, data, tmp_path):
    """``FullCheckpointer(asynchronous=False)``, what strategy full-sync runs (``workers.worker``,
    ``workers.fo_worker``; the full-async case runs end to end through Ray in ``tests/test_fo_ray.py``): a
    checkpoint every 2 steps is committed, listed in the store, before ``after_step`` returns; the loop's
    stall is at least the write; a resume from each checkpoint reaches the uninterrupted state bitwise."""
    store = SnapshotStore(str(tmp_path), keep_last=100)
    trainer = make_trainer(encoder)
    ckpt = FullCheckpointer(store, 2, asynchronous=False)
    states, listed, blocked = {}, {}, {}

    def after(done: int) -> None:
        blocked[done] = ckpt.after_step(done, trainer.state_view)
        listed[done] = [i.step for i in store.list()]
        states[done] = state_sha256(trainer.state_view())

    train(trainer, data[0], 0, 6, after=after)
    stats = ckpt.close()
    assert listed == {1: [], 2: [2], 3: [2], 4: [2, 4], 5: [2, 4], 6: [2, 4, 6]}
    assert [s for s, b in blocked.items() if b > 0] == [2, 4, 6]
    assert all(blocked[s] >= w for s, w in zip((2, 4, 6), stats["write_seconds"], strict=True))
    assert (stats["checkpoints"], stats["last_step"], stats["stage_seconds"]) == (3, 6, [])
    for info in store.list():
        resumed = make_trainer(encoder)
        resumed.load_state(store.load(info))
        assert state_sha256(resumed.state_view()) == states[info.step]
        train(resumed, data[0], info.step, 6)
        assert state_sha256(resumed.state_view()) == states[6], info.step


def test_full_async_postponed_while_its_write_runs_reuses_one_buffer_set(encoder, data, tmp_path):
    """``postpone_when_busy``: a checkpoint every 2 steps; the write of step 2 is held by the gate, so the
    one due at 4 is postponed (``after_step`` returns 0.0 at once; were it to wait, the held write
    would fail). After the gate opens and the write ends, it is taken at 5, and the next one is due 2
    steps later, at 7, staged in the arrays of step 2. Without the option the checkpoint at 4 would wait: the
    CheckFreq baseline (``tests/test_fo.py``)."""
    store = GatedStore(str(tmp_path))
    trainer = make_trainer(encoder)
    ckpt = FullCheckpointer(store, 2, asynchronous=True, postpone_when_busy=True)
    states = {}
    after = attach(ckpt, trainer, store, states, held_at=2, flush_at=5)  # 5 is written before 7 comes due

    train(trainer, data[0], 0, 3, after=after)
    train(trainer, data[0], 3, 4)  # step 4's ``after_step`` is called here, to read what it returns
    assert ckpt.after_step(4, trainer.state_view) == 0.0
    states[4] = state_sha256(trainer.state_view())
    assert ckpt.postponed.due_since == 4 and store.calls == []
    store.gate.set()
    ckpt.flush(GATE_TIMEOUT_S)
    train(trainer, data[0], 4, 8, after=after)
    stats = ckpt.close()

    calls = {c["step"]: c for c in store.calls}
    assert list(calls) == [2, 5, 7] and [i.step for i in store.list()] == [2, 5, 7]
    assert (stats["postponed_checks"], stats["postponed_steps"], stats["checkpoints"]) == (1, 1, 3)
    for step, call in calls.items():
        assert call["before"] == call["after"] == states[step], step
    assert all(p is q for p, q in zip(calls[2]["arrays"], calls[7]["arrays"], strict=True))
    assert state_sha256(store.load_latest().state) == states[7]


def test_an_overlapped_snapshot_due_while_every_buffer_set_is_held_is_postponed(encoder, data, tmp_path):
    """m = 2, a snapshot begun every 2 steps, one queued behind the one being written (3 buffer sets:
    the open window's, the written one's, the queued one's). The write of the snapshot of step 3 is held
    by the gate; those of 5 and 7 are queued; at 8 and 9 no set is free: the start is postponed. After
    the gate opens, the window starts at 10 in the buffers given back last (7's) and its snapshot is of 11;
    every snapshot (its earlier chunk caught up) is the state at its step, bitwise."""
    store = GatedStore(str(tmp_path))
    trainer = make_trainer(encoder)
    steps = step_records(trainer)
    ckpt = OverlappedCheckpointer(store, 2, 2, steps.catch_up_, steps.applied, max_pending=1)
    states = {}
    after = attach(ckpt, trainer, store, states, held_at=3)  # the snapshot of step 3 is held in its write

    train(trainer, data[0], 0, 9, after=after)
    assert ckpt.postponed.due_since == 8 and ckpt.last_submitted_step == 7 and store.calls == []
    store.gate.set()
    assert ckpt.flush(GATE_TIMEOUT_S)
    train(trainer, data[0], 9, 11, after=after)
    stats = ckpt.close(GATE_TIMEOUT_S)

    assert stats["errors"] == [] and (stats["postponed_checks"], stats["postponed_steps"]) == (1, 2)
    calls = {c["step"]: c for c in store.calls}
    assert list(calls) == [3, 5, 7, 11] and [i.step for i in store.list()] == [3, 5, 7, 11]
    for info in store.list():
        call = calls[info.step]
        assert call["before"] == call["after"] == states[info.step] == state_sha256(store.load(info)), info.step
    assert all(p is q for p, q in zip(calls[7]["arrays"], calls[11]["arrays"], strict=True))
