"""Just-in-time checkpoints (``Checkpointer.save_now``; Just-In-Time Checkpointing, Gupta et al., EuroSys
2024) on every first-order checkpointer, without Ray: a checkpoint of the current step, off the schedule,
restores bitwise the live state of that step (weights and AdamW state), a second one writes nothing, the
schedule goes on from it, and a failed write raises and leaves the previous checkpoint the newest."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from raycheck.experiments.fo_bench import step_records
from raycheck.policies.layerwise import LayerwiseConfig, Reason, UnitStatus, select_units
from raycheck.storage.backend import Storage, StorageError
from raycheck.storage.diffs import DiffStore
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.units import group_by_unit
from raycheck.training.checkpointing import FullCheckpointer
from raycheck.training.differential import DiffCheckpointer
from raycheck.training.fo import FOTrainer
from raycheck.training.layerwise import LayerwiseCheckpointer
from raycheck.training.overlapped import OverlappedCheckpointer
from raycheck.training.sharded import ShardedCheckpointer
from raycheck.training.state import state_sha256
from test_fo import HYPER, make_trainer, train

JIT_STEP, STEPS = 6, 10
NO_THRESHOLD = LayerwiseConfig(threshold=1e9, staleness_bound_steps=1000)  # a check rewrites only units never persisted

# strategy -> its checkpointer over (snapshots, diffs, trainer); each takes something at the first scheduled
# step (4; overlapped: begins a window at 3, committed at 4), and something again at STEPS when its schedule
# counts from JIT_STEP (overlapped: a window begun at 6 is open at JIT_STEP, then one begun at 9 ends at 10)
BUILD: dict[str, Callable[[SnapshotStore, DiffStore, FOTrainer], object]] = {
    "full-sync": lambda s, d, t: FullCheckpointer(s, 4, asynchronous=False),
    "full-async": lambda s, d, t: FullCheckpointer(s, 4, asynchronous=True),
    "sharded": lambda s, d, t: ShardedCheckpointer(s, 4, asynchronous=True),  # a state without DTensors: its own rows
    "layerwise": lambda s, d, t: LayerwiseCheckpointer(s, 4, NO_THRESHOLD),
    "differential": lambda s, d, t: DiffCheckpointer(s, d, step_records(t).applied, full_every=4, batch_steps=3),
    "overlapped": lambda s, d, t: (lambda r: OverlappedCheckpointer(s, 3, 2, r.catch_up_, r.applied))(step_records(t)),
}


def stores(tmp_path) -> tuple[SnapshotStore, DiffStore]:
    storage = Storage(str(tmp_path / "store"))
    return SnapshotStore(storage, keep_last=100), DiffStore(storage)


def restored(encoder, snapshots: SnapshotStore, diffs: DiffStore, strategy: str) -> tuple[int, str]:
    """(step, state sha256) of what a recovery restores: the newest snapshot, and for differential the
    replay of the records after it into a fresh trainer."""
    if strategy != "differential":
        latest = snapshots.load_latest()
        return latest.info.step, state_sha256(latest.state)
    trainer, base = make_trainer(encoder), 0
    if snapshots.list():
        latest = snapshots.load_latest()
        trainer.load_state(latest.state)
        base = latest.info.step
    return base + diffs.replay(base, step_records(trainer, record=False).replay).end_step - base, state_sha256(trainer.state_view())


@pytest.mark.parametrize("strategy", list(BUILD))
def test_save_now_commits_the_current_step_bitwise_once_and_the_schedule_goes_on_from_it(strategy, encoder, data, tmp_path):
    snapshots, diffs = stores(tmp_path)
    trainer = make_trainer(encoder)
    ckpt = BUILD[strategy](snapshots, diffs, trainer)
    hashes = {}

    def after(done: int) -> None:
        ckpt.after_step(done, trainer.state_view)
        if done in (JIT_STEP, STEPS):
            hashes[done] = state_sha256(trainer.state_view())

    train(trainer, data[0], 0, JIT_STEP, after=after)
    result = ckpt.save_now(JIT_STEP, trainer.state_view, timeout_s=60)
    assert result["step"] == JIT_STEP and not result["already"] and result["bytes"] > 0 and result["seconds"] > 0
    assert snapshots.list()[-1].step == (4 if strategy == "differential" else JIT_STEP)
    assert restored(encoder, snapshots, diffs, strategy) == (JIT_STEP, hashes[JIT_STEP])
    if strategy == "layerwise":
        jit = snapshots.list()[-1]
        assert {u: s["step"] for u, s in jit.manifest["units"].items()} == dict.fromkeys(group_by_unit(trainer.state_view()), JIT_STEP)
        assert result["units"] == 4 and ckpt.reasons == {"forced_first": 4, "just_in_time": 4}
    if strategy == "differential":  # the pending records (steps 4 and 5) reach step 6; no full checkpoint
        assert (result["records"], result["full"], diffs.durable_end(4)) == (2, False, JIT_STEP)
    if strategy == "overlapped":  # the window begun at 6 was dropped, never committed half-staged
        assert result["dropped_window"] == JIT_STEP and [i.step for i in snapshots.list()] == [4, JIT_STEP]

    again = ckpt.save_now(JIT_STEP, trainer.state_view, timeout_s=60)
    assert (again["already"], again["bytes"], again["step"]) == (True, 0, JIT_STEP)
    count = len(snapshots.list())

    train(trainer, data[0], JIT_STEP, STEPS, after=after)
    stats = ckpt.close(60)
    assert stats["last_step"] == STEPS and stats.get("errors", []) == []
    # due again 4 (overlapped: 3) steps after the JIT step; differential's full checkpoints count from their
    # base (4), as after a restart (``resume``), and its records reach STEPS
    assert len(snapshots.list()) == count + 1 and snapshots.list()[-1].step == (8 if strategy == "differential" else STEPS)
    # layer-wise: no unit passes the threshold, so the composite of STEPS is the JIT's units of step 6
    assert restored(encoder, snapshots, diffs, strategy) == (STEPS, hashes[JIT_STEP if strategy == "layerwise" else STEPS])


def test_save_now_right_after_the_scheduled_checkpoint_only_waits_for_it(tmp_path):
    store = SnapshotStore(str(tmp_path))
    ckpt = FullCheckpointer(store, 2, asynchronous=True)
    state = {"w": torch.arange(6, dtype=torch.float32)}
    ckpt.after_step(1, lambda: state)
    ckpt.after_step(2, lambda: state)  # staged; its write may still be running
    result = ckpt.save_now(2, lambda: state, timeout_s=60)
    assert (result["already"], result["bytes"]) == (True, 0) and [i.step for i in store.list()] == [2]
    assert ckpt.close(60)["checkpoints"] == 1


def test_a_layerwise_save_now_at_a_check_s_step_rewrites_the_units_that_check_left_older(encoder, data, tmp_path):
    """The check at 4 rewrote no unit (none passes the threshold): a composite of step 4 exists but holds
    step 2's units, so the state of step 4 is not committed yet; ``save_now(4)`` commits it."""
    store = SnapshotStore(str(tmp_path), keep_last=10)
    trainer = make_trainer(encoder)
    ckpt = LayerwiseCheckpointer(store, 2, NO_THRESHOLD)
    train(trainer, data[0], 0, 4, after=lambda done: ckpt.after_step(done, trainer.state_view))
    result = ckpt.save_now(4, trainer.state_view, timeout_s=60)
    assert not result["already"] and result["units"] == 4 and [i.step for i in store.list()] == [2, 4, 4]
    assert {s["step"] for s in store.list()[-1].manifest["units"].values()} == {4}
    assert state_sha256(store.load_latest().state) == state_sha256(trainer.state_view())
    assert ckpt.close(60)["reasons"] == {"forced_first": 4, "just_in_time": 4}


def test_a_just_in_time_selection_takes_every_unit_not_persisted_at_this_step_whatever_the_policy():
    units = [UnitStatus(unit="a", relative_change=0.0, staleness_steps=None, bytes=5),
             UnitStatus(unit="b", relative_change=0.0, staleness_steps=0, bytes=7),
             UnitStatus(unit="c", relative_change=0.0, staleness_steps=3, bytes=11)]
    decision = select_units(LayerwiseConfig(threshold=1.0, max_bytes_per_check=1), units, just_in_time=True)
    assert decision.reasons() == {"a": Reason.JUST_IN_TIME, "c": Reason.JUST_IN_TIME} and decision.bytes == 16


@pytest.mark.parametrize("strategy", [s for s in BUILD if s != "sharded"])  # sharded: full-async's path
def test_a_failed_write_raises_from_save_now_and_the_previous_checkpoint_stays_the_newest(strategy, encoder, data, tmp_path,
                                                                                        monkeypatch):
    snapshots, diffs = stores(tmp_path)
    trainer = make_trainer(encoder)
    ckpt = BUILD[strategy](snapshots, diffs, trainer)
    train(trainer, data[0], 0, 4, after=lambda done: ckpt.after_step(done, trainer.state_view))
    assert ckpt.flush(60)
    before = restored(encoder, snapshots, diffs, strategy)

    def failing(rel, pieces):
        raise StorageError(f"put {rel}: injected failure")

    train(trainer, data[0], 4, 5, after=lambda done: ckpt.after_step(done, trainer.state_view))
    monkeypatch.setattr(snapshots.storage, "put_stream", failing)
    with pytest.raises(StorageError, match="injected failure"):
        ckpt.save_now(5, trainer.state_view, timeout_s=60)
    monkeypatch.undo()
    assert restored(encoder, snapshots, diffs, strategy) == before
    assert ckpt.save_now(5, trainer.state_view, timeout_s=60)["step"] == 5  # storage is back: it commits
    assert restored(encoder, snapshots, diffs, strategy) == (5, state_sha256(trainer.state_view()))
    ckpt.close(60)


@pytest.mark.parametrize("layerwise", [False, True], ids=["full-async", "layerwise"])
def test_a_sharded_save_now_under_fsdp2_restores_the_rows_of_its_step_bitwise(layerwise, encoder, data, tmp_path):
    """One rank of FSDP2 (a gloo group in this process): ``save_now`` stages this rank's rows and commits
    them through the sharded store (layer-wise: a just-in-time check rewriting every unit not persisted at
    step 3, whatever its threshold); a fresh sharded trainer restores them bitwise."""
    import torch.distributed as dist

    from raycheck.storage.dcp_store import ShardedStore
    from raycheck.training.model import load_model
    from raycheck.training.sharded import ShardedLayerwiseCheckpointer, ShardedWriter, checkpoint_group, full_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = checkpoint_group()
        trainer = FOTrainer(load_model("tiny"), HYPER, encoder, sharded=True)
        store = ShardedStore(str(tmp_path))
        ckpt = (ShardedLayerwiseCheckpointer(store, trainer.state_view(), group, 2, LayerwiseConfig(threshold=1.0)) if layerwise
                else ShardedCheckpointer(ShardedWriter(store, trainer.state_view(), group), 2, asynchronous=True))
        train(trainer, data[0], 0, 3, after=lambda done: ckpt.after_step(done, trainer.state_view))
        result = ckpt.save_now(3, trainer.state_view, timeout_s=60)
        assert not result["already"] and result["bytes"] > 0 and [i.step for i in store.list()] == [2, 3]
        assert ckpt.save_now(3, trainer.state_view, timeout_s=60)["already"]
        restarted = FOTrainer(load_model("tiny"), HYPER, encoder, sharded=True)
        info, _ = store.restore(restarted.state_view(), group)
        assert info.step == 3
        assert state_sha256(full_state(restarted.state_view())) == state_sha256(full_state(trainer.state_view()))
        assert ckpt.close(60)["last_step"] == 3
    finally:
        dist.destroy_process_group()
