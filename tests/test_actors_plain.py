"""The plain classes inside the Ray actors, exercised without Ray."""

import threading

import numpy as np
import pytest

from raycheck.actors.persister import SnapshotPersister
from raycheck.actors.shadow import ShadowReplayer
from raycheck.storage.backend import RetryPolicy, Storage
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.steplog import StepLogGapError, StepLogWriter, StepRecord
from raycheck.training.model import layout_sha256, parameter_layout, trainable_parameters
from raycheck.training.state import copy_state, load_into, state_sha256
from raycheck.training.zo import GENERATOR, ZOHyper, perturb_all_, reset_and_update_all_


def header(params):
    layout = parameter_layout(params)
    return {"layout_sha256": layout_sha256(layout), "generator": GENERATOR, "model": "tiny"}


def record(step: int) -> StepRecord:
    return StepRecord(step=step, seed=900 + step, projected_grad=(-1) ** step * 0.37, loss_plus=0.7, loss_minus=0.69,
                      lr=1e-3, eps=1e-3, weight_decay=0.01, batch_id=step)


def worker_step_(params, r: StepRecord) -> None:
    """Step ``r`` as the worker executes it (workers/worker.py): +eps and -2 eps over all parameters
    phase by phase, then the reset and the update in one pass, z regenerated for each pass."""
    for scale in (r.eps, -2 * r.eps):
        perturb_all_(params, r.seed, scale)
    reset_and_update_all_(params, r.seed, r.projected_grad, ZOHyper(lr=r.lr, eps=r.eps, weight_decay=r.weight_decay))


def test_shadow_follows_the_log_bitwise_and_restores_its_state_dict(tmp_path, tiny_model):
    params = trainable_parameters(tiny_model)
    initial = copy_state(params)
    writer = StepLogWriter.create(tmp_path / "log", header(params))
    shadow = ShadowReplayer(params, tmp_path / "log", hash_every=2)
    for step in range(3):
        writer.append(record(step))
    assert shadow.catch_up() == 3 and shadow.step == 3

    ref = trainable_parameters(tiny_model.__class__(tiny_model.config))
    load_into(ref, initial)
    hashes = {}
    for step in range(3):  # the reference comes from the worker's step code, not from the replay under test
        worker_step_(ref, record(step))
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


def test_shadow_refuses_a_record_of_another_run(tmp_path, tiny_model):
    """A record with a valid checksum and the next step number but another seed's (spliced in from a run
    of seed 1, e.g. in the log segments a resume from the bucket adopts) is not replayed: before the fix
    the shadow replayed it and served the wrong image to a recovering worker."""
    from raycheck.storage.steplog import StepLogCorruptError
    from raycheck.training.zo import step_seed

    params = trainable_parameters(tiny_model)
    writer = StepLogWriter.create(tmp_path / "log", {**header(params), "run_seed": 0})
    for step, seed in enumerate([0, 1]):
        writer.append(StepRecord(step=step, seed=step_seed(seed, step), projected_grad=0.37, loss_plus=0.7, loss_minus=0.69,
                                 lr=1e-3, eps=1e-3, weight_decay=0.0, batch_id=step))
    shadow = ShadowReplayer(params, tmp_path / "log")
    with pytest.raises(StepLogCorruptError, match="the record of step 1 is not this run's"):
        shadow.catch_up()
    assert shadow.step == 1


def test_shadow_stops_at_a_gap(tmp_path, tiny_model):
    import os

    params = trainable_parameters(tiny_model)
    writer = StepLogWriter.create(tmp_path / "log", header(params))
    writer.append(record(0))
    os.write(writer._fd, record(2).bound(writer.tag, writer.path).encode())
    shadow = ShadowReplayer(params, tmp_path / "log")
    with pytest.raises(StepLogGapError, match="steps 1..1 are missing"):
        shadow.catch_up()


class GatedStorage(Storage):
    """A real local ``Storage`` whose writes (``put_stream``, which every put goes through) announce
    themselves (``entered``), block until ``release`` is set, and fail while ``broken`` is set: the
    persister runs the real ``SnapshotStore.write`` against it, so the fake cannot drift."""

    def __init__(self, root) -> None:
        super().__init__(str(root))
        self.entered, self.release, self.broken = threading.Event(), threading.Event(), threading.Event()

    def put_stream(self, rel, pieces):
        if self.broken.is_set():
            raise OSError("disk full")
        self.entered.set()
        if not self.release.wait(60):
            raise TimeoutError("the test never released the storage gate")
        return super().put_stream(rel, pieces)


def test_persister_is_bounded_and_keeps_the_newest(tmp_path):
    storage = GatedStorage(tmp_path)
    p = SnapshotPersister(SnapshotStore(storage))
    arrays = {f"model.layers.{i}.w": np.arange(6, dtype=np.float32) + i for i in range(2)}
    p.submit(1, arrays)
    assert storage.entered.wait(60)  # step 1 is being written, blocked in storage
    for step in (2, 3, 4):
        p.submit(step, {k: v + step for k, v in arrays.items()})  # returns while storage is blocked
    status = p.status()
    assert (status["busy"], status["written"], status["superseded"], status["last_submitted_step"]) == (True, 0, 2, 4)
    storage.release.set()
    status = p.flush(60)
    assert (status["busy"], status["written"], status["superseded"], status["last_durable_step"]) == (False, 2, 2, 4)
    store = SnapshotStore(str(tmp_path))
    assert [i.step for i in store.list()] == [1, 4]
    assert state_sha256(store.load_latest().state) == state_sha256({k: v + 4 for k, v in arrays.items()})


def test_a_late_older_image_neither_replaces_a_newer_one_nor_becomes_the_last_durable_step(tmp_path):
    """Images out of step order (Ray orders no calls to a threaded actor): 10 arriving after 12 waits,
    or after 12 is being written, or after 12 is written, is dropped; 12 stays the last durable step."""
    storage = GatedStorage(tmp_path)
    p = SnapshotPersister(SnapshotStore(storage))
    arrays = {"model.layers.0.w": np.arange(6, dtype=np.float32)}
    p.submit(5, arrays)
    assert storage.entered.wait(60)  # step 5 is being written, blocked in storage
    p.submit(12, {k: v + 12 for k, v in arrays.items()})
    p.submit(10, {k: v + 10 for k, v in arrays.items()})  # late: 12 waits
    storage.release.set()
    status = p.flush(60)
    assert (status["written"], status["superseded"], status["last_durable_step"], status["last_submitted_step"]) == (2, 1, 12, 12)
    p.submit(10, {k: v + 10 for k, v in arrays.items()})  # late: 12 is written
    status = p.flush(60)
    assert (status["written"], status["superseded"], status["last_durable_step"]) == (2, 2, 12)
    p.submit(12, {k: v + 12 for k, v in arrays.items()})  # the same step again is taken (e.g. after a persister restart)
    assert p.flush(60)["written"] == 3
    store = SnapshotStore(str(tmp_path))
    assert [i.step for i in store.list()] == [5, 12, 12]
    assert state_sha256(store.load_latest().state) == state_sha256({k: v + 12 for k, v in arrays.items()})


def test_after_a_failed_write_an_older_image_is_taken_again(tmp_path):
    """A write of step 12 that failed leaves step 5 the newest durable: a restarted shadow's image of step
    10 is then written, not dropped as late."""
    storage = GatedStorage(tmp_path)
    storage.release.set()
    p = SnapshotPersister(SnapshotStore(storage))
    p.submit(5, {"w": np.zeros(3, dtype=np.float32)})
    assert p.flush(10)["last_durable_step"] == 5
    storage.broken.set()
    p.submit(12, {"w": np.ones(3, dtype=np.float32)})
    status = p.flush(10)
    storage.broken.clear()
    assert (status["failed"], status["last_durable_step"]) == (1, 5)
    p.submit(10, {"w": np.ones(3, dtype=np.float32)})
    status = p.flush(10)
    assert (status["written"], status["superseded"], status["last_durable_step"]) == (2, 0, 10)


def test_persister_counts_and_surfaces_a_failed_write(tmp_path):
    store = SnapshotStore(str(tmp_path / "snaps"))
    (tmp_path / "snaps").rmdir()
    (tmp_path / "snaps").write_text("a file where the snapshot folder should be")  # every write now fails
    p = SnapshotPersister(store)
    p.submit(7, {"w": np.zeros(3, dtype=np.float32)})
    status = p.flush(10)
    assert (status["failed"], status["written"], status["last_durable_step"]) == (1, 0, None)
    assert status["last_error"].startswith("step 7: ") and "NotADirectoryError" in status["last_error"]


def test_persister_waits_for_the_breakers_probe_instead_of_losing_the_image(tmp_path):
    """Storage that failed three times in a row (breaker open): a new image is written by the probe
    once the back-off has passed, not refused."""
    storage = Storage(str(tmp_path), retry=RetryPolicy(max_consecutive_failures=3, breaker_backoff_s=0.2))
    for _ in range(3):
        storage.breaker.record(ok=False, probe=False)
    assert storage.breaker.state()["state"] == "open"
    p = SnapshotPersister(SnapshotStore(storage))
    p.submit(5, {"w": np.arange(3, dtype=np.float32)})
    status = p.flush(30)
    assert (status["written"], status["failed"], status["last_durable_step"]) == (1, 0, 5)
    assert {k: status["storage"][k] for k in ("state", "opened", "probes")} == {"state": "closed", "opened": 1, "probes": 1}
