"""The checkpointer interface (``training.checkpointing.Checkpointer``): every first-order checkpointer
implements it with the same signatures, and a full-async checkpoint's failed background write is
raised, never silent (no Ray)."""

from __future__ import annotations

import inspect

import pytest
import torch

from raycheck.policies.layerwise import LayerwiseConfig
from raycheck.storage.backend import StorageError
from raycheck.storage.diffs import DiffStore
from raycheck.storage.snapshots import SnapshotStore
from raycheck.training.checkpointing import Checkpointer, FullCheckpointer
from raycheck.training.differential import DiffCheckpointer
from raycheck.training.layerwise import LayerwiseCheckpointer
from raycheck.training.overlapped import OverlappedCheckpointer
from raycheck.training.sharded import ShardedCheckpointer

METHODS = ("after_step", "save_now", "flush", "close")


def checkpointers(store: SnapshotStore) -> list:
    """One of each checkpointer over ``store`` (a checkpoint every step; nothing taken yet)."""
    no_gradients, no_catch_up = dict, print  # never called: no step is taken
    return [FullCheckpointer(store, 1, asynchronous=False), FullCheckpointer(store, 1, asynchronous=True),
            ShardedCheckpointer(store, 1, asynchronous=True),
            LayerwiseCheckpointer(store, 1, LayerwiseConfig(threshold=0.0, staleness_bound_steps=10)),
            DiffCheckpointer(store, DiffStore(store.storage), no_gradients, full_every=2, batch_steps=1),
            OverlappedCheckpointer(store, 1, 2, no_catch_up, no_gradients)]


def signatures(cls) -> dict[str, inspect.Signature]:
    return {m: inspect.signature(getattr(cls, m), eval_str=True) for m in METHODS}


def test_every_checkpointer_implements_the_protocol_with_its_signatures(tmp_path):
    expected = signatures(Checkpointer)
    assert str(expected["flush"]) == "(self, timeout_s: float = 600.0) -> bool"
    for ckpt in checkpointers(SnapshotStore(str(tmp_path))):
        name = type(ckpt).__name__
        assert isinstance(ckpt, Checkpointer), name
        assert signatures(type(ckpt)) == expected, name
        assert ckpt.bytes == 0 and type(ckpt.bytes) is int, name
        stats = ckpt.close(60.0)
        assert (stats["checkpoints"], stats["bytes"], stats["last_step"]) == (0, 0, None), name


def test_the_signature_check_tells_a_drifted_method(tmp_path):
    """``isinstance`` sees only that the methods exist; the signatures tell a drifted one (a ``flush``
    that returned None and took None for no limit, as ``FullCheckpointer``'s once did)."""

    class Drifted(FullCheckpointer):
        def flush(self, timeout_s: float | None = None) -> None:  # type: ignore[override]  # the drift under test
            super().flush(600.0 if timeout_s is None else timeout_s)

    drifted = Drifted(SnapshotStore(str(tmp_path)), 1, asynchronous=False)
    assert isinstance(drifted, Checkpointer)
    assert signatures(Drifted)["flush"] != signatures(Checkpointer)["flush"]
    assert not isinstance(object(), Checkpointer)


class FailingStore:
    """A store whose every write fails as storage that is down does."""

    def write(self, step, state, config=None):
        raise StorageError(f"put of checkpoint {step} failed after 3 tries")


def test_a_failed_full_async_write_is_raised_by_flush_and_the_next_checkpoint():
    ckpt = FullCheckpointer(FailingStore(), 2, asynchronous=True)

    def state() -> dict[str, torch.Tensor]:
        return {"w": torch.arange(4, dtype=torch.float32)}

    assert ckpt.after_step(1, state) == 0.0
    assert ckpt.after_step(2, state) > 0.0  # staged and handed to the writer thread
    with pytest.raises(StorageError, match="put of checkpoint 2 failed"):
        ckpt.flush(60.0)
    assert ckpt.flush(60.0)  # raised once; nothing is running
    ckpt.after_step(4, state)
    with pytest.raises(StorageError, match="put of checkpoint 4 failed"):
        ckpt.after_step(6, state)  # CheckFreq's wait for the previous write raises its error
    ckpt.after_step(8, state)  # due again an interval after the step that raised
    with pytest.raises(StorageError, match="put of checkpoint 8 failed"):
        ckpt.close(60.0)
    assert (ckpt.checkpoints, ckpt.bytes, ckpt.last_step) == (0, 0, None)
