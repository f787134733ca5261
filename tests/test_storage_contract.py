"""One contract suite, run against every storage backend: local disk, a real S3 server (moto on
127.0.0.1), and fsspec's in-memory filesystem."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from raycheck.storage.backend import Storage
from raycheck.storage.log_segments import SegmentMirror, read_segments, segment_name
from raycheck.storage.snapshots import INDEX, MANIFEST, NoSnapshotError, SnapshotCorruptError, SnapshotStore
from raycheck.storage.steplog import StepLogGapError, StepLogWriter, StepRecord
from raycheck.training.state import state_sha256


def state(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "model.embed_tokens.weight": rng.standard_normal((6, 4)).astype(np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(4).astype(np.float32),
        "model.layers.1.mlp.up_proj.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(4).astype(np.float32),
    }


def test_objects_roundtrip(storage):
    storage.put("a/b/c.bin", b"hello")
    storage.put("a/d.bin", b"x" * 1000)
    assert storage.get("a/b/c.bin") == b"hello"
    assert storage.list("a") == ["a/b/c.bin", "a/d.bin"]
    assert storage.exists("a/d.bin") and not storage.exists("a/zzz")
    storage.put("a/d.bin", b"replaced")
    assert storage.get("a/d.bin") == b"replaced"
    storage.delete("a/d.bin")
    storage.delete("a/d.bin")  # already gone: no error
    assert storage.list("a") == ["a/b/c.bin"] and storage.list("nothing") == []
    with pytest.raises(FileNotFoundError):
        storage.get("a/missing")


def test_snapshot_roundtrip_shards_by_unit(storage):
    store = SnapshotStore(storage)
    info = store.write(7, state(7), config={"run": "t"})
    assert (info.step, info.folder, info.manifest) == (7, store.list()[-1].folder, store.list()[-1].manifest)
    assert sorted(info.manifest["units"]) == ["embed", "layer.000", "layer.001", "norm"]
    assert {u["step"] for u in info.manifest["units"].values()} == {7}
    loaded = store.load(store.list()[-1])
    assert list(loaded) == list(state(7)) and state_sha256(loaded) == state_sha256(state(7))
    assert store.verify(info) == []


def test_composite_unit_steps_are_recorded(storage):
    info = SnapshotStore(storage).write(9, state(9), unit_steps={"layer.001": 4, "embed": 2})
    steps = {u: spec["step"] for u, spec in info.manifest["units"].items()}
    assert steps == {"embed": 2, "layer.000": 9, "layer.001": 4, "norm": 9}


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_shard_is_named_and_the_previous_snapshot_loads(storage, damage):
    store = SnapshotStore(storage)
    store.write(5, state(5))
    info = store.write(10, state(10))
    shard = info.manifest["units"]["layer.001"]["path"]
    blob = storage.get(shard)
    if damage == "flip":
        storage.put(shard, blob[:-3] + bytes([blob[-3] ^ 1]) + blob[-2:])
    elif damage == "truncate":
        storage.put(shard, blob[:-7])
    else:
        storage.delete(shard)
    assert len(store.verify(info)) == 1 and shard in store.verify(info)[0]
    with pytest.raises(SnapshotCorruptError, match=shard.replace(".", r"\.")):
        store.load(info)
    got, loaded, skipped = store.load_latest()
    assert got.step == 5 and state_sha256(loaded) == state_sha256(state(5))
    assert len(skipped) == 1 and shard in skipped[0]


def test_uncommitted_snapshots_are_never_listed(storage):
    store = SnapshotStore(storage)
    store.write(5, state(5))
    storage.put("step-0000000009-aaaaaaaa/layer.000.safetensors", b"half")  # died before its manifest
    storage.put("step-0000000008-bbbbbbbb/" + MANIFEST, b"{}")  # manifest but never indexed
    assert [i.step for i in store.list()] == [5]
    index = json.loads(storage.get(INDEX))
    gone = {"folder": "step-0000000012-cccccccc", "manifest_sha256": "0" * 64}
    storage.put(INDEX, json.dumps({**index, "snapshots": index["snapshots"] + [gone]}).encode())
    assert [i.step for i in store.list()] == [5]  # indexed but its manifest is gone: skipped
    assert store.skipped == [f"step-0000000012-cccccccc/{MANIFEST}: missing"]


def test_retention_keeps_the_newest_and_cleans_failed_attempts(storage):
    store = SnapshotStore(storage, keep_last=2)
    storage.put("step-0000000002-deadbeef/embed.safetensors", b"partial")  # a failed attempt's leftovers
    for step in (1, 2, 3, 4):
        store.write(step, state(step))
    assert [i.step for i in store.list()] == [3, 4]
    folders = {p.split("/")[0] for p in storage.list() if p.startswith("step-")}
    assert folders == {i.folder for i in store.list()}
    assert [e["folder"] for e in json.loads(storage.get(INDEX))["snapshots"]] == [i.folder for i in store.list()]
    if storage.protocol == "file":  # retired snapshots leave no empty step-* folders behind
        assert sorted(p.name for p in pathlib.Path(storage.root).iterdir()) == sorted([INDEX, *folders])


def test_composite_snapshot_keeps_referenced_shards_of_older_snapshots(storage):
    store = SnapshotStore(storage, keep_last=1)
    old = store.write(1, state(1))
    s2 = state(2)
    changed = {n: a for n, a in s2.items() if not n.startswith("model.embed_tokens.")}
    info = store.write_units(2, changed, list(s2))  # embed references step 1's shard
    assert info.manifest["units"]["embed"] == old.manifest["units"]["embed"]
    assert [i.step for i in store.list()] == [2]  # step 1 retired, its referenced shard kept
    assert store.verify(info) == [] and state_sha256(store.load(info)) == state_sha256({**s2, **{
        n: a for n, a in state(1).items() if n.startswith("model.embed_tokens.")}})


def test_unreadable_index_falls_back_to_scanning(storage):
    store = SnapshotStore(storage)
    store.write(1, state(1))
    storage.put(INDEX, b"{not json")
    assert [i.step for i in store.list()] == [1]


def test_nothing_loadable_names_what_was_tried(storage):
    store = SnapshotStore(storage)
    with pytest.raises(NoSnapshotError, match="none found"):
        store.load_latest()
    info = store.write(3, state(3))
    storage.delete(info.manifest["units"]["norm"]["path"])
    with pytest.raises(NoSnapshotError, match="norm.safetensors: missing"):
        store.load_latest()


def rec(step: int) -> StepRecord:
    return StepRecord(step=step, seed=step, projected_grad=step / 3, loss_plus=0.5, loss_minus=0.4, lr=1e-6,
                      eps=1e-3, weight_decay=0.0, batch_id=step)


def test_step_log_segments_mirror_and_read_back(storage, tmp_path):
    writer = StepLogWriter.create(tmp_path / "log", {"model": "x"})
    mirror = SegmentMirror(storage, tmp_path / "log", records_per_segment=4, max_age_s=3600)
    for step in range(6):
        writer.append(rec(step))
    assert mirror.sync() == 4  # one full segment; the 2-record tail is not old enough
    assert mirror.sync(final=True) == 6
    writer.append(rec(6))
    writer.write_torn(7)  # a torn local tail is never mirrored
    assert mirror.sync(final=True) == 7
    header, records = read_segments(storage)
    assert header["model"] == "x" and records == [rec(i) for i in range(7)]
    assert [p for p in storage.list("log")] == [segment_name(0, 3), segment_name(4, 6)]  # tail superseded
    assert SegmentMirror(storage, tmp_path / "log", records_per_segment=4).mirrored == 7  # resumes


def test_step_log_segment_gap_is_refused(storage, tmp_path):
    writer = StepLogWriter.create(tmp_path / "log", {"model": "x"})
    mirror = SegmentMirror(storage, tmp_path / "log", records_per_segment=2)
    for step in range(6):
        writer.append(rec(step))
    mirror.sync(final=True)
    storage.delete(segment_name(2, 3))
    with pytest.raises(StepLogGapError, match="steps 2..3 are missing"):
        read_segments(storage)
    assert read_segments(Storage("memory://empty-log")) == (None, [])
