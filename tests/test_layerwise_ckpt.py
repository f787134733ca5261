"""Layer-wise adaptive checkpoints (LayerCheck-style) of a first-order run: which units are written, the
composite manifest, restore, spreading, crash safety and retention (tiny model, real data, no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from raycheck.policies.layerwise import LayerwiseConfig
from raycheck.storage.backend import Storage
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.units import group_by_unit
from test_fo import make_trainer, train, unit_sha
from raycheck.training.layerwise import LayerwiseCheckpointer
from raycheck.training.state import copy_state

UNITS = ["embed", "layer.000", "layer.001", "norm"]


def run(encoder, data, store: SnapshotStore, steps: int, policy: LayerwiseConfig, every: int = 2, trainer=None, first: int = 0):
    """Train with a layer-wise checkpointer; returns (trainer, checkpointer stats, state copies at each check).
    Each check is waited for, so none is postponed (the writer is idle at every check) and the checks
    fall on multiples of ``every``; ``test_a_check_due_while_the_writer_is_busy_is_postponed`` covers
    the busy writer."""
    trainer = trainer or make_trainer(encoder)
    ckpt = LayerwiseCheckpointer(store, every, policy)
    states = {}

    def after(done: int) -> None:
        ckpt.after_step(done, trainer.state_view)
        if done % every == 0:
            assert ckpt.flush(60)
            states[done] = copy_state(trainer.state_view())

    train(trainer, data[0], first, steps, after=after)
    return trainer, ckpt.close(60), states


def unit_steps(info) -> dict[str, int]:
    return {u: s["step"] for u, s in info.manifest["units"].items()}


def test_first_check_writes_every_unit_then_only_changed_ones(encoder, data, tmp_path):
    store = SnapshotStore(str(tmp_path), keep_last=10)
    policy = LayerwiseConfig(threshold=1e9, staleness_bound_steps=1000)  # nothing passes the threshold
    _, stats, states = run(encoder, data, store, 6, policy)
    infos = store.list()
    assert [i.step for i in infos] == [2, 4, 6] and stats["checkpoints"] == 3 and stats["errors"] == []
    assert all(unit_steps(i) == dict.fromkeys(UNITS, 2) for i in infos)  # later manifests reference step 2's shards
    assert [i.own_bytes for i in infos[1:]] == [0, 0] and stats["bytes"] == infos[0].own_bytes == infos[0].bytes
    assert stats["reasons"] == {"forced_first": 4}
    latest = store.load_latest()
    assert latest.info.step == 6
    for unit in UNITS:
        assert unit_sha(latest.state, unit) == unit_sha(states[2], unit)


def test_units_over_the_threshold_or_the_staleness_bound_are_rewritten(encoder, data, tmp_path):
    store = SnapshotStore(str(tmp_path), keep_last=10)
    policy = LayerwiseConfig(threshold=0.01, staleness_bound_steps=4)
    _, stats, states = run(encoder, data, store, 8, policy)
    by_step = {i.step: i for i in store.list()}
    assert unit_steps(by_step[2]) == dict.fromkeys(UNITS, 2)
    # measured on the tiny model at lr 1e-3, relative change from step 2 to 4: layers 0.016 and 0.017,
    # embedding 0.0044, norm 0.0010: the layers pass the threshold, the others wait for the bound
    assert unit_steps(by_step[4]) == {"embed": 2, "layer.000": 4, "layer.001": 4, "norm": 2}
    assert unit_steps(by_step[6]) == dict.fromkeys(UNITS, 6)
    assert unit_steps(by_step[8]) == {"embed": 6, "layer.000": 8, "layer.001": 6, "norm": 6}  # updates slow down
    assert stats["reasons"] == {"forced_first": 4, "threshold": 5, "staleness_bound": 2}
    latest = store.load_latest()
    for unit, step in unit_steps(latest.info).items():  # each unit bitwise as it was at its own step
        assert unit_sha(latest.state, unit) == unit_sha(states[step], unit), unit
    assert 0 < by_step[4].own_bytes < by_step[4].bytes


def test_the_byte_budget_spreads_writes_over_checks(encoder, data, tmp_path):
    store = SnapshotStore(str(tmp_path), keep_last=10)
    layer_bytes = sum(a.nbytes for n, a in copy_state(make_trainer(encoder).state_view()).items()
                      if n in group_by_unit(make_trainer(encoder).state_view())["layer.000"])
    policy = LayerwiseConfig(threshold=0.0, staleness_bound_steps=1000, max_bytes_per_check=layer_bytes + 1000)
    _, stats, _ = run(encoder, data, store, 8, policy)
    written = [sorted(u for u, s in i.manifest["units"].items() if s["step"] == i.step) for i in store.list()[1:]]
    assert all(len(w) == 1 for w in written[:2]) and written[0] != written[1]  # one unit per check, round robin-ish
    assert stats["reasons"]["forced_first"] == 4 and stats["reasons"]["threshold"] == 3


def test_resume_counts_restored_units_as_persisted(encoder, data, tmp_path):
    store = SnapshotStore(str(tmp_path), keep_last=10)
    policy = LayerwiseConfig(threshold=1e9, staleness_bound_steps=6)
    trainer, _, _ = run(encoder, data, store, 4, policy)
    latest = store.load_latest()
    resumed = make_trainer(encoder)
    resumed.load_state(latest.state)
    ckpt = LayerwiseCheckpointer(store, 2, policy)
    ckpt.resume(latest.info, resumed.state_view())
    train(resumed, data[0], 4, 8, after=lambda done: ckpt.after_step(done, resumed.state_view))
    stats = ckpt.close(60)
    assert stats["reasons"] == {"staleness_bound": 4}  # at step 8 the step-2 versions are 6 steps old; nothing earlier
    assert unit_steps(store.list()[-2]) == dict.fromkeys(UNITS, 2) and unit_steps(store.list()[-1]) == dict.fromkeys(UNITS, 8)


def test_a_crash_mid_write_keeps_the_previous_composite_and_forces_the_units_again(encoder, data, tmp_path):
    storage = Storage(str(tmp_path))
    store = SnapshotStore(storage, keep_last=10)
    trainer = make_trainer(encoder)
    policy = LayerwiseConfig(threshold=0.0, staleness_bound_steps=1000)
    ckpt = LayerwiseCheckpointer(store, 1, policy)
    train(trainer, data[0], 0, 1, after=lambda done: ckpt.after_step(done, trainer.state_view))
    assert ckpt.flush(60)
    put = storage.put

    def failing_put(rel: str, blob: bytes) -> None:
        if rel.endswith("manifest.json"):
            raise OSError("disk full (injected)")
        put(rel, blob)

    storage.put = failing_put
    train(trainer, data[0], 1, 2, after=lambda done: ckpt.after_step(done, trainer.state_view))
    assert ckpt.flush(60)
    assert [i.step for i in store.list()] == [1] and store.verify(store.list()[-1]) == []
    assert "layer-wise check at step 2: OSError: disk full (injected)" in ckpt.errors[0]
    storage.put = put
    train(trainer, data[0], 2, 3, after=lambda done: ckpt.after_step(done, trainer.state_view))
    stats = ckpt.close(60)
    assert [i.step for i in store.list()] == [1, 3] and unit_steps(store.list()[-1]) == dict.fromkeys(UNITS, 3)
    assert stats["reasons"] == {"forced_first": 4, "threshold": 8}  # step 3 selects again what step 2 failed to commit


def test_retention_never_deletes_a_shard_that_a_kept_composite_references(encoder, data, tmp_path):
    store = SnapshotStore(str(tmp_path), keep_last=2)
    run(encoder, data, store, 12, LayerwiseConfig(threshold=0.01, staleness_bound_steps=8))
    infos = store.list()
    assert [i.step for i in infos] == [10, 12]
    assert min(s["step"] for s in infos[0].manifest["units"].values()) < 10  # really composite
    for info in infos:
        assert store.verify(info) == []
    referenced = {u["path"] for i in infos for u in i.manifest["units"].values()} | {f"{i.folder}/manifest.json" for i in infos}
    assert {p for p in store.storage.list() if p.startswith("step-")} == referenced  # a dropped folder's other shards go
    assert store.unindexed() == []  # and its manifest: what is left of it is no snapshot, only shards a composite reads


def test_write_units_refuses_an_incomplete_composite(tmp_path):
    store = SnapshotStore(str(tmp_path))
    names = ["model.layers.0.w", "optim.exp_avg.model.layers.0.w", "model.norm.weight"]
    state = {n: np.ones(3, np.float32) for n in names}
    with pytest.raises(ValueError, match="unit norm is not in the new tensors and has no committed version to reference"):
        store.write_units(1, {n: state[n] for n in names[:2]}, names)
    with pytest.raises(ValueError, match=r"unit layer.000: got tensors \['model.layers.0.w'\]"):
        store.write_units(1, {names[0]: state[names[0]], names[2]: state[names[2]]}, names)
    store.write_units(2, state, names)
    with pytest.raises(ValueError, match=r"step 1 is older than the newest committed snapshot \(step 2\)"):
        store.write_units(1, {}, names)
    info = store.write_units(3, {"model.norm.weight": np.zeros(3, np.float32)}, names)
    assert unit_steps(info) == {"layer.000": 2, "norm": 3} and store.load(info)["model.norm.weight"].tolist() == [0, 0, 0]


def test_a_unit_whose_committed_shard_fails_verification_is_rewritten_not_referenced(encoder, data, tmp_path):
    store = SnapshotStore(str(tmp_path), keep_last=1)
    trainer = make_trainer(encoder)
    ckpt = LayerwiseCheckpointer(store, 2, LayerwiseConfig(threshold=1e9, staleness_bound_steps=1000))  # nothing passes
    states = {}

    def after(done: int) -> None:
        ckpt.after_step(done, trainer.state_view)
        states[done] = copy_state(trainer.state_view())
        if done == 2:  # step 2's composite is committed; then its embedding shard rots
            assert ckpt.flush(60)
            shard = store.list()[-1].manifest["units"]["embed"]["path"]
            blob = bytearray(store.storage.get(shard))
            blob[len(blob) // 2] ^= 1
            store.storage.put(shard, bytes(blob))

    train(trainer, data[0], 0, 4, after=after)
    stats = ckpt.close(60)
    [info] = store.list()  # keep_last 1: step 2 is retired, and nothing references its rotten shard
    assert info.step == 4 and unit_steps(info) == {"embed": 4, "layer.000": 2, "layer.001": 2, "norm": 2}
    assert stats["errors"] == [] and stats["units_written"] == {"embed": 2, "layer.000": 1, "layer.001": 1, "norm": 1}
    restored = store.load_latest().state
    assert unit_sha(restored, "embed") == unit_sha(states[4], "embed")
    for unit in ("layer.000", "layer.001", "norm"):
        assert unit_sha(restored, unit) == unit_sha(states[2], unit)
