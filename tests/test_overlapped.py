"""Overlapped multi-step snapshots (GoCkpt) of first-order training, no Ray: the balanced chunk split,
the AdamW catch-up, and snapshots whose chunks were staged over m steps that equal, bitwise, the state
at their step and resume bitwise (tiny model, real snippets, a real snapshot store on disk)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.units import parameter_of
from test_fo import BATCH, make_trainer, train
from raycheck.training.data import batch_indices
from raycheck.training.overlapped import OverlappedCheckpointer, balanced_chunks
from raycheck.experiments.fo_bench import step_records
from raycheck.training.state import copy_state, state_sha256

STEPS, EVERY = 12, 4


def test_balanced_chunks_split_by_bytes_deterministically():
    sizes = {"a": 10, "b": 70, "c": 20, "d": 40, "e": 30, "f": 30}
    assert balanced_chunks(sizes, 1) == [["a", "b", "c", "d", "e", "f"]]
    assert balanced_chunks(sizes, 2) == [["b", "f"], ["a", "c", "d", "e"]]  # 100 and 100 bytes
    assert balanced_chunks(sizes, 4) == [["b"], ["d"], ["c", "e"], ["a", "f"]]  # 70, 40, 50, 40
    assert balanced_chunks({"x": 5, "y": 5}, 4) == [["x"], ["y"]]  # never an empty chunk
    assert balanced_chunks({}, 3) == []
    sizes = {f"p{i}": (i * 7919) % 1000 for i in range(50)}
    for m in (2, 3, 4, 8):
        chunks = balanced_chunks(sizes, m)
        assert sorted(n for c in chunks for n in c) == sorted(sizes) and len(chunks) == m  # a partition
        loads = [sum(sizes[n] for n in c) for c in chunks]
        assert max(loads) <= sum(sizes.values()) / m + max(sizes.values())  # the greedy bound
        assert chunks == balanced_chunks(sizes, m)
    with pytest.raises(ValueError, match="number of chunks must be >= 1, got 0"):
        balanced_chunks(sizes, 0)
    with pytest.raises(ValueError, match=r"sizes must be >= 0 bytes, got \{'q': -1\}"):
        balanced_chunks({"q": -1}, 2)


def test_replayed_adamw_steps_bring_a_staged_part_up_to_date_bitwise(encoder, data):
    """Part of the state staged at step 2, caught up with the gradients of steps 2..4, equals the
    trainer's state at step 5 (weights, moments, counts); left alone it would not."""
    trainer = make_trainer(encoder)
    train(trainer, data[0], 0, 2)
    part = [n for n in trainer.state_view() if (parameter_of(n) or n) in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight")]
    staged = copy_state({n: trainer.state_view()[n] for n in part})
    steps, records = step_records(trainer), []
    for step in range(2, 5):
        trainer.train_step(data[0], batch_indices(0, step, BATCH, len(data[0])))
        records.append(dict(steps.applied()))  # references: every step makes new tensors
    at5 = {n: trainer.state_view()[n] for n in part}
    assert state_sha256(staged) != state_sha256(at5)
    steps.catch_up_(staged, records)  # a new AdamW over the two parameters, in their two groups
    assert state_sha256(staged) == state_sha256(at5)
    assert float(staged["optim.step.model.norm.weight"][0]) == 5.0
    with pytest.raises(ValueError, match=r"the recorded gradient of model.norm.weight is torch.float32 \(3,\)"):
        steps.catch_up_(staged, [{**records[0], "model.norm.weight": torch.zeros(3)}])


def run_with(encoder, split, store: SnapshotStore, chunks: int, versions: list[int]) -> tuple[dict, dict[int, str]]:
    """Steps 0..STEPS-1 with an overlapped checkpointer attached; returns its closing stats and the
    state's sha256 after every step."""
    trainer = make_trainer(encoder)
    steps = step_records(trainer)
    ckpt = OverlappedCheckpointer(store, EVERY, chunks, steps.catch_up_, steps.applied)
    hashes = {0: state_sha256(trainer.state_view())}

    def after(steps_done: int) -> None:
        ckpt.after_step(steps_done, trainer.state_view)
        hashes[steps_done] = state_sha256(trainer.state_view())
        if steps_done == 10:  # with m = 4 the window begun at 8 is open: nothing of it is committed yet
            assert ckpt.flush(60) and store.list()[-1].step == max(v for v in versions if v <= 10)

    train(trainer, split, 0, STEPS, after=after)
    stats = ckpt.close(60)
    assert stats["errors"] == [] and stats["finished"]
    return stats, hashes


@pytest.mark.parametrize("chunks, versions", [(1, [4, 8, 12]), (2, [5, 9, 12]), (4, [7, 11, 12])])
def test_an_overlapped_snapshot_is_the_state_at_its_step_bitwise_and_resumes_bitwise(encoder, data, tmp_path, chunks, versions):
    """Snapshots start every 4 steps (after steps 4, 8, 12) and take m steps to stage: each is the
    state after the step of its last chunk (the one begun after the last step is completed by
    ``close``), bitwise, weights and Adam moments and counts; a trainer restored from each goes on to
    the failure-free final state bitwise."""
    store = SnapshotStore(str(tmp_path / "snapshots"), keep_last=100)
    stats, hashes = run_with(encoder, data[0], store, chunks, versions)
    assert [i.step for i in store.list()] == versions and stats["last_step"] == versions[-1]
    assert stats["chunks"] == chunks and stats["checkpoints"] == len(versions)
    for info in store.list():
        assert state_sha256(store.load(info)) == hashes[info.step], info.step
        resumed = make_trainer(encoder)
        resumed.load_state(store.load(info))
        train(resumed, data[0], info.step, STEPS)
        assert state_sha256(resumed.state_view()) == hashes[STEPS], info.step


def test_each_step_of_a_window_stages_only_its_chunk(encoder, data, tmp_path):
    """m = 4: the plan covers every tensor once, chunks within the greedy bound of a quarter of the
    state's bytes; the window's four steps (after steps 4..7) each stage one more chunk, the others none."""
    trainer = make_trainer(encoder)
    steps = step_records(trainer)
    ckpt = OverlappedCheckpointer(SnapshotStore(str(tmp_path / "s")), EVERY, 4, steps.catch_up_, steps.applied)
    state = copy_state(trainer.state_view())
    plan = ckpt.plan(state)
    chunks = [[n for tensors in chunk.values() for n in tensors] for chunk in plan]
    assert sorted(n for c in chunks for n in c) == sorted(state)  # every tensor once
    loads = [sum(state[n].nbytes for n in c) for c in chunks]
    biggest = max(sum(state[n].nbytes for n in tensors) for chunk in plan for tensors in chunk.values())
    assert len(plan) == 4 and max(loads) <= sum(loads) / 4 + biggest
    staged = []

    def after(steps_done: int) -> None:
        ckpt.after_step(steps_done, trainer.state_view)
        staged.append(set(ckpt._window.staged) if ckpt._window else None)

    train(trainer, data[0], 0, 8, after=after)
    upto = [set().union(*chunks[:k]) for k in range(1, 4)]
    # submitted after step 7 (its fourth chunk), the next window begins after step 8
    assert staged == [None, None, None, *upto, None, upto[0]]
    stats = ckpt.close(60)
    assert stats["checkpoints"] == 2 and len(stats["stage_seconds"]) == 5  # close stages the rest outside the loop
    assert stats["chunk_bytes"] == loads


def test_gradients_overwritten_in_place_are_refused(encoder, data, tmp_path):
    """A gradients callable that hands back the same tensors every step (so a held step's gradients
    would be overwritten) stops the snapshot with an error that says so; nothing is committed."""
    trainer = make_trainer(encoder)
    same = {n: np.zeros(p.shape, np.float32) for n, p in trainer.named.items()}
    store = SnapshotStore(str(tmp_path / "s"))
    ckpt = OverlappedCheckpointer(store, 1, 3, step_records(trainer).catch_up_, lambda: {n: torch.from_numpy(a) for n, a in same.items()})
    ckpt.after_step(1, trainer.state_view)
    ckpt.after_step(2, trainer.state_view)  # holds the gradients of step 1
    with pytest.raises(RuntimeError, match=r"the gradients of step 1 were overwritten by the next step .* must return new tensors"):
        ckpt.after_step(3, trainer.state_view)
    assert store.list() == []
