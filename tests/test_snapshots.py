import json
import os

import numpy as np
import pytest

from storage.snapshots import MANIFEST, SHARD, NoSnapshotError, SnapshotCorruptError, SnapshotStore
from training.state import state_sha256


def state(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"b.weight": rng.standard_normal((4, 3)).astype(np.float32), "a.bias": rng.standard_normal(5).astype(np.float32)}


def test_roundtrip_is_bitwise_and_keeps_order(tmp_path):
    store = SnapshotStore(tmp_path)
    info = store.write(10, state(10))
    loaded = store.load(info)
    assert list(loaded) == ["b.weight", "a.bias"]
    assert state_sha256(loaded) == state_sha256(state(10)) == info.manifest["state_sha256"]
    assert [i.step for i in store.list()] == [10]


def test_folder_without_manifest_is_never_listed(tmp_path):
    store = SnapshotStore(tmp_path)
    store.write(5, state(5))
    info = store.write(10, state(10))
    (info.path / MANIFEST).unlink()  # as if the writer died before committing
    assert [i.step for i in store.list()] == [5]
    assert store.load_latest()[0].step == 5


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_shard_is_refused_and_the_previous_snapshot_loads(tmp_path, damage, caplog):
    store = SnapshotStore(tmp_path)
    store.write(5, state(5))
    info = store.write(10, state(10))
    shard = info.path / SHARD
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[-3] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(shard, shard.stat().st_size - 7)
    else:
        shard.unlink()
    with pytest.raises(SnapshotCorruptError, match=SHARD):
        store.load(info)
    got, loaded = store.load_latest()
    assert got.step == 5 and state_sha256(loaded) == state_sha256(state(5))
    assert "skipping snapshot" in caplog.text


def test_nothing_loadable_names_what_was_tried(tmp_path):
    store = SnapshotStore(tmp_path)
    with pytest.raises(NoSnapshotError, match="none found"):
        store.load_latest()
    info = store.write(3, state(3))
    (info.path / SHARD).write_bytes(b"junk")
    with pytest.raises(NoSnapshotError, match="step-0000000003"):
        store.load_latest()


def test_retention_keeps_the_newest_and_cleans_failed_attempts(tmp_path):
    store = SnapshotStore(tmp_path, keep_last=2)
    (tmp_path / "step-0000000002-deadbeef").mkdir()  # leftovers of an attempt that never committed
    (tmp_path / "step-0000000002-deadbeef" / SHARD).write_bytes(b"partial")
    for step in (1, 2, 3, 4):
        store.write(step, state(step))
    assert [i.step for i in store.list()] == [3, 4]
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir()) == ["0000000003", "0000000004"]
    assert store.load_latest(max_step=3)[0].step == 3


def test_unreadable_manifest_is_skipped(tmp_path):
    store = SnapshotStore(tmp_path)
    store.write(1, state(1))
    info = store.write(2, state(2))
    (info.path / MANIFEST).write_text("{not json")
    assert [i.step for i in store.list()] == [1]
    assert json.loads((store.list()[0].path / MANIFEST).read_text())["step"] == 1
