"""Issue 32, item 3: readers of a live store never cry wolf. A writer with retention (keep 1) commits a
snapshot, retiring the one before, at every point of a reader's ``inspect`` / ``verify`` pass (each of
its storage reads in turn), deterministically: the plain store classes on real files, no timing."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from raycheck.cli.storage import listing, rehash
from raycheck.storage.backend import Storage
from raycheck.storage.snapshots import MANIFEST, SnapshotStore


class InterleavedStorage(Storage):
    """A real local store that calls ``before_read`` once, just before its read number ``at`` (``get`` and
    ``list`` calls, counted from 0); ``reads`` counts them."""

    def __init__(self, uri: str, at: int, before_read: Callable[[], None]) -> None:
        super().__init__(uri, create=False)
        self.at, self.before_read, self.reads = at, before_read, 0

    def _count(self) -> None:
        if self.reads == self.at:
            self.before_read()
        self.reads += 1

    def get(self, rel: str) -> bytes:
        self._count()
        return super().get(rel)

    def list(self, prefix: str = "") -> list[str]:
        self._count()
        return super().list(prefix)


def state(step: int) -> dict[str, np.ndarray]:
    return {"model.layers.0.w": np.full(64, step, dtype=np.float32), "model.norm.w": np.full(8, -step, dtype=np.float32)}


def read_pass(store: SnapshotStore) -> tuple[list[str], int]:
    """(false alarms, snapshots retired during the read) of one inspect + verify pass over ``store``."""
    seen = listing(store)
    alarms = seen.skipped + seen.unindexed
    retired = len(seen.retired)
    for info in seen.infos:
        problems = rehash(store, info)
        retired += problems is None
        alarms += problems or []
    return alarms, retired


def naive_pass(store: SnapshotStore) -> tuple[list[str], int]:
    """The same pass as the tools read before issue 32: every problem of the first read is damage."""
    infos, unindexed = store.list(), store.unindexed()
    return store.skipped + unindexed + [p for info in infos for p in store.verify(info)], 0


def raced(tmp_path, read: Callable[[SnapshotStore], tuple[list[str], int]]) -> tuple[int, list[str], int]:
    """(reads raced, false alarms, snapshots retired during the read) of ``read`` over fresh stores of
    snapshots 1 and 2 (keep 1), with snapshot 3 committed just before each of its reads in turn."""
    alarms: list[str] = []
    retired = 0
    for at in itertools.count():
        folder = tmp_path / f"{read.__name__}-{at}"
        writer = SnapshotStore(str(folder), keep_last=1)
        for step in (1, 2):
            writer.write(step, state(step))
        storage = InterleavedStorage(str(folder), at, lambda: writer.write(3, state(3)))
        found, gone = read(SnapshotStore(storage))
        if storage.reads <= at:  # the pass ended before read `at`: every point has been raced
            return at, alarms, retired
        alarms += found
        retired += gone
    raise AssertionError("unreachable")


def test_a_reader_racing_retention_at_every_read_raises_no_false_alarm_but_real_damage_stays(tmp_path):
    reads, alarms, retired = raced(tmp_path, read_pass)
    assert reads >= 6 and alarms == [] and retired > 0, (reads, alarms, retired)
    assert raced(tmp_path, naive_pass)[1]  # the race is real: the first read alone cries wolf

    damaged = SnapshotStore(str(tmp_path / "read_pass-0"), keep_last=1)
    info = damaged.list()[-1]
    damaged.storage.delete(f"{info.folder}/{MANIFEST}")  # damage that stays: still indexed on the re-check
    seen = listing(damaged)
    assert seen.skipped == [f"{info.folder}/{MANIFEST}: missing"] and seen.retired == []
