"""``workers.train_reports.TrainReports.wait_for``, rank 0's wait for the final step's snapshot before
its last report to Ray Train: it ends when the snapshot is committed, at its timeout, and at once when
the store cannot be listed. Plain: a real snapshot store (a folder; an S3 endpoint nothing listens on),
no Ray (``attach`` set as ``storage_reachable`` would set it in rank 0)."""

from __future__ import annotations

import time

import numpy as np

from conftest import free_port
from raycheck.storage.backend import RetryPolicy, Storage
from raycheck.storage.snapshots import SnapshotStore
from raycheck.workers.train_reports import TrainReports


def rank0_reports(store: SnapshotStore) -> TrainReports:
    reports = TrainReports(store, rank=1, reported="")  # rank 1 starts no listing thread and calls no Ray Train API
    reports.attach = True  # rank 0's, with Ray Train's storage reachable
    return reports


def test_wait_for_ends_when_the_step_is_committed_or_at_its_timeout(tmp_path):
    store = SnapshotStore(Storage(str(tmp_path / "snapshots")))
    store.write(4, {"model.layers.0.w": np.arange(8, dtype=np.float32)})
    reports = rank0_reports(store)
    assert reports.wait_for(4, timeout_s=0) is True and reports.newest().step == 4
    assert reports.wait_for(8, timeout_s=0.5, poll_s=0.1) is False  # step 8 never comes


def test_wait_for_gives_up_at_the_first_failed_listing_not_at_its_timeout():
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every call is refused
    store = SnapshotStore(Storage("s3://raycheck-gone/run", retry=RetryPolicy(attempts=2, base_delay_s=0.01), endpoint_url=endpoint))
    reports = rank0_reports(store)
    began = time.monotonic()
    assert reports.wait_for(8, timeout_s=120) is False
    assert time.monotonic() - began < 60  # one failed listing (2 refused tries), not the 120 s timeout
    assert reports.newest() is None
