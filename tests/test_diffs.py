"""Differential checkpoints (LowDiff-style): per-step gradient records, batches, full checkpoints every F
steps, garbage collection, commit rules, and recovery by replay through AdamW (tiny model, real data)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raycheck.experiments.fo_bench import step_records
from raycheck.storage.backend import Storage
from raycheck.storage.diffs import DiffCorruptError, DiffGapError, DiffStore, topk_decode, topk_encode
from raycheck.storage.snapshots import SnapshotStore
from test_fo import make_trainer, train
from raycheck.training.differential import DiffCheckpointer
from raycheck.training.state import state_sha256

STEPS = 12


@pytest.fixture(scope="module")
def reference(encoder, data):
    """The failure-free run: the state sha256 after every step."""
    trainer, hashes = make_trainer(encoder), {}
    train(trainer, data[0], 0, STEPS, after=lambda done: hashes.setdefault(done, state_sha256(trainer.state_view())))
    return hashes


def stores(tmp_path) -> tuple[SnapshotStore, DiffStore]:
    storage = Storage(str(tmp_path / "store"))
    return SnapshotStore(storage), DiffStore(storage)


def run_with_diffs(encoder, data, tmp_path, steps: int, close: bool = True, **kw) -> tuple[SnapshotStore, DiffStore, dict]:
    snapshots, diffs = stores(tmp_path)
    trainer = make_trainer(encoder)
    ckpt = DiffCheckpointer(snapshots, diffs, step_records(trainer).applied, **{"full_every": 5, "batch_steps": 2, **kw})
    train(trainer, data[0], 0, steps, after=lambda done: ckpt.after_step(done, trainer.state_view))
    stats = ckpt.close(60) if close else ckpt.flush(60)
    return snapshots, diffs, stats


def recover(encoder, snapshots: SnapshotStore, diffs: DiffStore, until: int | None = None):
    """Newest full checkpoint + replay of the records after it, into a fresh trainer."""
    trainer = make_trainer(encoder)
    infos = snapshots.list()
    base = 0
    if infos:
        loaded = snapshots.load_latest()
        trainer.load_state(loaded.state)
        base = loaded.info.step
    return trainer, base, diffs.replay(base, step_records(trainer, record=False).replay, until=until)


def test_exact_records_replay_bitwise_and_old_diffs_are_collected(encoder, data, tmp_path, reference):
    snapshots, diffs, stats = run_with_diffs(encoder, data, tmp_path, STEPS)
    assert [i.step for i in snapshots.list()] == [5, 10]
    assert [(b.first_step, b.last_step) for b in diffs.list()] == [(10, 11)]  # 0..9 collected after the full at 10
    assert stats["checkpoints"] == 2 and stats["batches"] == 5 and stats["errors"] == [] and stats["finished"]
    assert stats["deleted_objects"] == 2 * 2 + 2 * 2  # (0-1, 2-3) at step 5, (5-6, 7-8) at step 10: record + commit
    assert stats["diff_bytes"] == sum(b.bytes for b in diffs.list()) * 5  # every batch of 2 records has the same size
    trainer, base, result = recover(encoder, snapshots, diffs)
    assert (base, result.replayed_steps, result.end_step, result.exact, result.stopped) == (10, 2, 12, True, "")
    assert state_sha256(trainer.state_view()) == reference[12]


def test_a_failure_loses_only_the_uncommitted_records_and_recomputing_rejoins_bitwise(encoder, data, tmp_path, reference):
    """The run dies after 9 steps without closing: records of steps 5-6 and 7-8 are committed, nothing
    after. Recovery = full at 5 + replay of 5..8; recomputing 9..11 gives the failure-free state."""
    snapshots, diffs, _ = run_with_diffs(encoder, data, tmp_path, 9, close=False)
    assert diffs.durable_end(5) == 9
    trainer, base, result = recover(encoder, snapshots, diffs)
    assert (base, result.end_step) == (5, 9)
    assert state_sha256(trainer.state_view()) == reference[9]
    train(trainer, data[0], 9, STEPS)
    assert state_sha256(trainer.state_view()) == reference[12]


def test_without_a_full_checkpoint_replay_starts_from_the_initial_state(encoder, data, tmp_path, reference):
    snapshots, diffs, _ = run_with_diffs(encoder, data, tmp_path, 4, full_every=100, batch_steps=3)
    assert snapshots.list() == [] and [(b.first_step, b.last_step) for b in diffs.list()] == [(0, 2), (3, 3)]
    trainer, base, result = recover(encoder, snapshots, diffs, until=4)
    assert (base, result.replayed_steps) == (0, 4) and state_sha256(trainer.state_view()) == reference[4]


def test_records_held_by_reference_are_written_bitwise_as_applied_while_the_loop_goes_on(encoder, data, tmp_path):
    """The loop keeps references, not copies: with batches of 4, step 0's record waits while steps 1-3
    run (each allocating new gradients) and is written afterwards by the background thread; every
    written record's sha256 equals that of the gradients its step applied, hashed at that step."""
    snapshots, diffs = stores(tmp_path)
    trainer = make_trainer(encoder)
    steps = step_records(trainer)
    ckpt = DiffCheckpointer(snapshots, diffs, steps.applied, full_every=100, batch_steps=4)
    applied: dict[int, str] = {}

    def after(done: int) -> None:
        applied[done - 1] = state_sha256(steps.applied())
        ckpt.after_step(done, trainer.state_view)

    train(trainer, data[0], 0, 10, after=after)
    assert ckpt.close(60)["errors"] == []
    written = {step: state_sha256(grads) for batch in diffs.list() for step, grads in diffs.read(batch)}
    assert [(b.first_step, b.last_step) for b in diffs.list()] == [(0, 3), (4, 7), (8, 9)]
    assert written == applied and len(set(applied.values())) == 10


def test_gradients_written_in_place_are_refused(tmp_path):
    """A gradients callable that hands back the same tensors every step (a later step writes the
    record the loop still holds) is refused at the step that did it; the records before it are kept."""
    snapshots, diffs = stores(tmp_path)
    grads = {"w": torch.zeros(3)}
    ckpt = DiffCheckpointer(snapshots, diffs, lambda: grads, full_every=100, batch_steps=4)
    ckpt.after_step(1, dict)
    with pytest.raises(RuntimeError, match=r"the gradients of step 0 were overwritten by the next step \(\['w'\]\)"):
        ckpt.after_step(2, dict)
    assert ckpt.close(60)["batches"] == 1 and diffs.list()[0].steps == range(0, 1)  # only step 0's record


def test_topk_records_are_smaller_and_approximate(encoder, data, tmp_path, reference):
    _, exact_diffs, exact = run_with_diffs(encoder, data, tmp_path / "exact", 4, full_every=100)
    snapshots, diffs, topk = run_with_diffs(encoder, data, tmp_path / "topk", 4, full_every=100, topk_ratio=0.01)
    assert exact["diff_bytes"] / topk["diff_bytes"] > 40  # 8 bytes per kept element: about 1 / (2 * 0.01) = 50x
    trainer, _, result = recover(encoder, snapshots, diffs)
    assert result.end_step == 4 and result.exact is False
    assert state_sha256(trainer.state_view()) != reference[4]


def test_topk_encoding_keeps_the_largest_magnitudes():
    g = np.array([[0.5, -3.0, 0.1], [2.0, -0.2, 0.0]], dtype=np.float32)
    values, indices = topk_encode(g, 0.3)  # ceil(0.3 * 6) = 2
    assert indices.tolist() == [1, 3] and values.tolist() == [-3.0, 2.0] and indices.dtype == np.int32
    assert topk_decode(values, indices, g.shape).tolist() == [[0.0, -3.0, 0.0], [2.0, 0.0, 0.0]]
    assert topk_encode(g, 1e-9)[1].tolist() == [1]  # at least one element
    assert np.array_equal(topk_decode(*topk_encode(g, 1.0), g.shape), g)


def records(first: int, last: int) -> list[tuple[int, dict[str, np.ndarray]]]:
    return [(s, {"w": np.full((2, 3), s, np.float32), "b": np.full(3, -s, np.float32)}) for s in range(first, last + 1)]


def collect(diffs: DiffStore, from_step: int, until: int | None = None):
    seen: list[float] = []
    result = diffs.replay(from_step, lambda g: seen.append(float(g["w"][0, 0])), until=until)
    return seen, result


def test_batches_replay_in_order_across_overlaps(tmp_path):
    diffs = DiffStore(str(tmp_path))
    diffs.write_batch(records(0, 3))
    diffs.write_batch(records(2, 5))  # a restarted attempt re-recorded 2..3
    diffs.write_batch(records(6, 6))
    seen, result = collect(diffs, 1)
    assert seen == [1, 2, 3, 4, 5, 6] and (result.end_step, result.exact, result.stopped) == (7, True, "")
    assert collect(diffs, 2, until=4)[0] == [2, 3]


def test_a_gap_is_an_error_naming_the_steps_and_ends_an_open_replay(tmp_path):
    diffs = DiffStore(str(tmp_path))
    for first, last in ((0, 1), (2, 3), (4, 5)):
        diffs.write_batch(records(first, last))
    middle = diffs.list()[1]
    diffs.storage.delete(middle.commit)
    with pytest.raises(DiffGapError, match=r"no committed diff record for steps 2..5 \(replaying from step 0"):
        collect(diffs, 0, until=6)
    seen, result = collect(diffs, 0)
    assert seen == [0, 1] and result.end_step == 2
    assert "no committed diff record for step 2; the batches of steps ['4-5'] after the gap are not used" in result.stopped


def test_a_corrupt_batch_is_refused_naming_its_steps(tmp_path):
    diffs = DiffStore(str(tmp_path))
    diffs.write_batch(records(0, 1))
    diffs.write_batch(records(2, 3))
    batch = diffs.list()[1]
    blob = bytearray(diffs.storage.get(batch.path))
    blob[-1] ^= 0x01
    diffs.storage.put(batch.path, bytes(blob))
    with pytest.raises(DiffCorruptError, match=r"diff batch of steps 2-3 \(.*\): sha256 differs from the commit record"):
        collect(diffs, 0, until=4)
    seen, result = collect(diffs, 0)
    assert seen == [0, 1] and result.end_step == 2 and "steps 2-3" in result.stopped
    diffs.storage.put(batch.path, bytes(blob[:-5]))
    with pytest.raises(DiffCorruptError, match=r"steps 2-3 .*bytes, the commit record says"):
        collect(diffs, 0, until=4)


def test_a_batch_without_its_commit_record_does_not_count_and_is_collected(tmp_path):
    diffs = DiffStore(str(tmp_path))
    diffs.write_batch(records(0, 1))
    diffs.storage.put("diffs/0000000002-0000000003-0badf00d.safetensors", b"half-written")  # crash before the commit
    assert [(b.first_step, b.last_step) for b in diffs.list()] == [(0, 1)] and diffs.durable_end(0) == 2
    diffs.storage.put("diffs/0000000004-0000000004-00000000.commit.json", b"{not json")
    assert len(diffs.list()) == 1 and "unreadable" in diffs.skipped[0]
    assert diffs.collect_garbage(5) == 4 and diffs.storage.list("diffs") == []


def test_write_batch_validation(tmp_path):
    diffs = DiffStore(str(tmp_path))
    with pytest.raises(ValueError, match="at least one record"):
        diffs.write_batch([])
    with pytest.raises(ValueError, match=r"consecutive and >= 0, got \[0, 2\]"):
        diffs.write_batch([records(0, 0)[0], records(2, 2)[0]])
    with pytest.raises(ValueError, match="step 1: gradient names or shapes differ from step 0's"):
        diffs.write_batch([records(0, 0)[0], (1, {"w": np.zeros((2, 3), np.float32)})])
    with pytest.raises(ValueError, match=r"step 0, w: gradients must be float32 \(float64: stored exact\), got float16"):
        diffs.write_batch([(0, {"w": np.zeros(2, np.float16)})])
    with pytest.raises(ValueError, match=r"topk_ratio must be in \[0, 1\]"):
        diffs.write_batch(records(0, 0), topk_ratio=1.5)
    assert diffs.storage.list("diffs") == []
    with pytest.raises(ValueError, match="full_every must be >= 1, got 0"):
        DiffCheckpointer(None, diffs, dict, full_every=0, batch_steps=1)


def test_a_resumed_checkpointer_counts_the_full_interval_from_the_chain_s_base(encoder, data, tmp_path, reference):
    """A worker restored at step 6 from the initial state plus 6 records (no full checkpoint yet, full
    every 8) takes its full checkpoint at step 8, 8 steps after the chain's base, not at 14: counted
    from the restore, failures every 6 steps would never see one and replay ever longer chains."""
    snapshots, diffs, _ = run_with_diffs(encoder, data, tmp_path, 6, close=False, full_every=8, batch_steps=2)
    trainer, base, result = recover(encoder, snapshots, diffs)
    assert (base, result.end_step) == (0, 6) and state_sha256(trainer.state_view()) == reference[6]
    ckpt = DiffCheckpointer(snapshots, diffs, step_records(trainer).applied, full_every=8, batch_steps=2)
    ckpt.resume(base)
    train(trainer, data[0], 6, 10, after=lambda done: ckpt.after_step(done, trainer.state_view))
    ckpt.close(60)
    assert [i.step for i in snapshots.list()] == [8]
    trainer, base, result = recover(encoder, snapshots, diffs)
    assert (base, result.replayed_steps, result.end_step) == (8, 2, 10)
    assert state_sha256(trainer.state_view()) == reference[10]


def test_a_batch_of_another_run_copied_into_the_prefix_is_skipped_not_replayed(tmp_path):
    """A committed batch of another run of the same model (its object and commit record copied in under
    a plausible name) is not this run's: before the fix it was chained and replayed (a wrong state)."""
    from raycheck.storage.manifest import RunIdentity

    storage = Storage(str(tmp_path / "store"))
    run_a = RunIdentity("run-a", "a" * 64)
    ours, theirs = DiffStore(storage, identity=run_a), DiffStore(storage, identity=RunIdentity("run-b", "a" * 64))
    grads = [(step, {"w": np.full((2, 2), step, np.float32)}) for step in range(4)]
    ours.write_batch(grads[:2])
    theirs.write_batch(grads[2:])  # steps 2-3: exactly where run A's records end
    anonymous = DiffStore(storage).write_batch(grads[2:])  # a batch written without a run
    applied = []
    result = ours.replay(0, applied.append)
    assert (result.replayed_steps, result.end_step, len(applied)) == (2, 2, 2)
    assert len(ours.skipped) == 2 and any("a batch of run run-b, not of run run-a" in s for s in ours.skipped)
    assert any(anonymous.commit in s and "a batch of no run" in s for s in ours.skipped)
    assert ours.durable_end(0) == 2 and DiffStore(storage).durable_end(0) == 4  # a store-wide tool sees every batch


def test_garbage_collection_deletes_only_this_run_s_batches_and_orphans(storage, caplog):
    """Two runs share a prefix (one's files copied in): collecting run A's garbage before step 4 deletes
    A's committed batches and A's orphaned object (a failed attempt: no commit record), and leaves run
    B's batch, B's orphan, a batch written without a run and an orphan of no run where they are, named
    once in the log. Before the fix every batch before the step went, by file name alone."""
    import logging

    from raycheck.storage.manifest import RunIdentity

    run_a, run_b = RunIdentity("run-a", "a" * 64), RunIdentity("run-b", "a" * 64)
    ours, theirs, anonymous = (DiffStore(storage, identity=run_a), DiffStore(storage, identity=run_b),
                               DiffStore(storage))
    grads = [(step, {"w": np.full((2, 2), step, np.float32)}) for step in range(6)]
    mine = [ours.write_batch(grads[:2]), ours.write_batch(grads[2:4]), ours.write_batch(grads[4:])]
    other, nobody = theirs.write_batch(grads[:2]), anonymous.write_batch(grads[2:4])
    orphan_a, orphan_b = ours.write_batch(grads[:1]), theirs.write_batch(grads[:1])
    orphan_none = anonymous.write_batch(grads[:1])
    for b in (orphan_a, orphan_b, orphan_none):  # a crash before the commit record
        storage.delete(b.commit)
    kept = sorted([other.path, other.commit, nobody.path, nobody.commit, orphan_b.path, orphan_none.path,
                   mine[2].path, mine[2].commit])
    with caplog.at_level(logging.INFO, logger="raycheck.storage.diffs"):
        assert ours.collect_garbage(4) == 5  # A's two batches (object and commit each) and A's orphan
        assert ours.collect_garbage(4) == 0
    assert storage.list("diffs") == kept
    notes = [r.getMessage() for r in caplog.records if "of another run" in r.getMessage()]
    assert len(notes) == 1 and "6 object(s)" in notes[0] and "run run-a" in notes[0], notes
    assert [(b.first_step, b.last_step) for b in theirs.list()] == [(0, 1)]  # B's chain is intact
    assert anonymous.collect_garbage(4) == 6 and storage.list("diffs") == sorted([mine[2].path, mine[2].commit])


def test_float64_entries_stay_exact_under_topk(tmp_path):
    """A user's optimizer's hyper-parameters ride in the records as float64 (``training.optim_steps``):
    top-k encodes only the float32 gradients."""
    diffs = DiffStore(str(tmp_path))
    grad = np.arange(1, 21, dtype=np.float32)
    lr, betas = np.array([1e-2 * 0.8 ** 3]), np.array([0.9, 0.999])
    diffs.write_batch([(0, {"w": grad, "param_groups.0.lr": lr, "param_groups.0.betas": betas})], topk_ratio=0.1)
    [(step, record)] = diffs.read(diffs.list()[0])
    assert step == 0 and record["param_groups.0.lr"].tobytes() == lr.tobytes()
    assert record["param_groups.0.betas"].tobytes() == betas.tobytes()
    assert record["w"].tolist() == [0.0] * 18 + [19.0, 20.0]
