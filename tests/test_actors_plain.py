"""The plain classes inside the Ray actors, exercised without Ray."""

import threading
import time

import numpy as np
import pytest

from actors.persister import SnapshotPersister
from actors.shadow import ShadowReplayer
from storage.snapshots import SnapshotStore
from storage.steplog import StepLogGapError, StepLogWriter, StepRecord
from training.model import layout_sha256, parameter_layout, trainable_parameters
from training.state import copy_state, load_into, state_sha256
from training.zo import GENERATOR, replay_step_


def header(params):
    layout = parameter_layout(params)
    return {"layout_sha256": layout_sha256(layout), "generator": GENERATOR, "model": "tiny"}


def record(step: int) -> StepRecord:
    return StepRecord(step=step, seed=900 + step, projected_grad=(-1) ** step * 0.37, loss_plus=0.7, loss_minus=0.69,
                      lr=1e-3, eps=1e-3, weight_decay=0.01, batch_id=step)


def test_shadow_follows_the_log_bitwise_and_restores_its_state_dict(tmp_path, tiny_model):
    params = trainable_parameters(tiny_model)
    initial = copy_state(params)
    writer = StepLogWriter.create(tmp_path / "log", header(params))
    shadow = ShadowReplayer(params, tmp_path / "log", hash_every=2)
    for step in range(3):
        writer.append(record(step))
    assert shadow.catch_up() == 3 and shadow.step == 3

    expected = {k: v.copy() for k, v in initial.items()}
    ref = trainable_parameters(tiny_model.__class__(tiny_model.config))
    load_into(ref, expected)
    hashes = {}
    for step in range(3):
        r = record(step)
        replay_step_(ref, r.seed, r.projected_grad, r.lr, r.eps, r.weight_decay)
        hashes[step + 1] = state_sha256(ref)
    assert state_sha256(params) == hashes[3]
    assert shadow.hashes == {2: hashes[2]}

    saved = shadow.state_dict()
    writer.append(record(3))
    shadow.catch_up()
    shadow.load_state_dict(saved)
    assert shadow.step == 3 and state_sha256(params) == hashes[3]
    assert shadow.catch_up() == 1 and shadow.step == 4


def test_shadow_refuses_a_log_of_another_model(tmp_path, tiny_model):
    params = trainable_parameters(tiny_model)
    StepLogWriter.create(tmp_path / "log", {**header(params), "layout_sha256": "0" * 64}).close()
    with pytest.raises(ValueError, match="another model layout"):
        ShadowReplayer(params, tmp_path / "log")


def test_shadow_stops_at_a_gap(tmp_path, tiny_model):
    import os

    params = trainable_parameters(tiny_model)
    writer = StepLogWriter.create(tmp_path / "log", header(params))
    writer.append(record(0))
    os.write(writer._fd, record(2).encode())
    shadow = ShadowReplayer(params, tmp_path / "log")
    with pytest.raises(StepLogGapError, match="steps 1..1 are missing"):
        shadow.catch_up()


class SlowStore(SnapshotStore):
    def __init__(self, root, gate: threading.Event):
        super().__init__(str(root))
        self.gate = gate

    def write(self, step, state, meta=None):
        self.gate.wait(10)
        return super().write(step, state, meta)


def test_persister_is_bounded_and_keeps_the_newest(tmp_path):
    gate = threading.Event()
    p = SnapshotPersister(SlowStore(tmp_path, gate))
    arrays = {"w": np.arange(6, dtype=np.float32)}
    t0 = time.perf_counter()
    for step in (1, 2, 3, 4):
        p.submit(step, arrays)
    assert time.perf_counter() - t0 < 0.5  # submit never waits for storage
    gate.set()
    status = p.flush(10)
    assert status["busy"] is False
    assert status["last_durable_step"] == 4
    assert status["written"] + status["superseded"] == 4 and status["superseded"] >= 2
    assert [i.step for i in SnapshotStore(str(tmp_path)).list()][-1] == 4


def test_persister_counts_and_surfaces_a_failed_write(tmp_path):
    store = SnapshotStore(str(tmp_path / "snaps"))
    (tmp_path / "snaps").rmdir()
    (tmp_path / "snaps").write_text("a file where the snapshot folder should be")  # every write now fails
    p = SnapshotPersister(store)
    p.submit(7, {"w": np.zeros(3, dtype=np.float32)})
    status = p.flush(10)
    assert (status["failed"], status["written"], status["last_durable_step"]) == (1, 0, None)
    assert status["last_error"].startswith("step 7: ") and "NotADirectoryError" in status["last_error"]
