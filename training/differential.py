"""Differential checkpoints of a first-order run (LowDiff, SC'25): the training-loop side.

After every step the loop keeps a reference to the gradients AdamW consumed, no copy: each step's
``training.optim_steps.OptimizerSteps.applied`` records are new tensors that no later step writes
(``zero_grad(set_to_none=True)``; a gradients callable that hands back a tensor written in place is
refused with an error, ``training.state.require_new_tensors``), as ``training.overlapped`` does. Every
``full_every`` steps the loop stalls for a copy of the whole state instead. A background thread
(``storage.background``) encodes and writes a batch of records every ``batch_steps`` steps
(``storage.diffs.DiffStore``; on the CPU ``as_numpy`` is a view of the held tensor, so the only copy is
the encoding's; a CUDA trainer would need a device-to-host copy there, on the writer thread) and, every
``full_every`` steps, commits a full checkpoint to the run's ``SnapshotStore`` and then deletes the
records it supersedes. Records still pending at a full checkpoint are dropped: the full state
supersedes them. Recovery: the newest full checkpoint, then ``DiffStore.replay`` of the records after
it through ``training.optim_steps.OptimizerSteps.replay`` (bitwise exact with exact records). On a failure
notice ``save_now`` writes the pending records at once (Just-In-Time Checkpointing, Gupta et al.,
EuroSys 2024), so that recovery replays up to the current step.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import numpy as np
import torch

from raycheck.policies.interval import SnapshotSchedule
from raycheck.storage.background import BackgroundWriter
from raycheck.storage.diffs import DiffStore
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.tensor_files import as_numpy
from raycheck.training.checkpointing import just_in_time
from raycheck.training.state import check_record, copy_state, require_new_tensors


class _Stats(TypedDict):
    checkpoints: int
    bytes: int
    full_bytes: int
    diff_bytes: int
    batches: int
    last_step: int | None
    last_full_step: int | None
    write_seconds: list[float]
    deleted_objects: int


class DiffCheckpointer:
    """Differential checkpoints (the module docstring; a
    ``training.checkpointing.Checkpointer``).

    Args:
        snapshots: the run's snapshot store (full checkpoints).
        diffs: where the records go.
        gradients: returns the gradients the last step applied (``OptimizerSteps.applied``).
        full_every: steps between full checkpoints (>= 1).
        batch_steps: records per batch object (>= 1).
        topk_ratio: 0 for exact records, else the fraction of elements kept per tensor.
        config: recorded in the full checkpoints' manifests.
        max_pending: writes that may wait behind the running one (bounds memory: the held gradients of at
            most ``(max_pending + 2) * batch_steps + 1`` steps are alive at once: the running batch, the
            queued ones, the one being submitted and the previous step's, each step's as large as the
            gradients, 538 MB for SmolLM2-135M; one full-state copy per full checkpoint on top).
    """

    def __init__(self, snapshots: SnapshotStore, diffs: DiffStore, gradients: Callable[[], Mapping[str, torch.Tensor]],
                 full_every: int, batch_steps: int, topk_ratio: float = 0.0, config: Mapping[str, Any] | None = None,
                 max_pending: int = 2) -> None:
        for name, value in (("full_every", full_every), ("batch_steps", batch_steps)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= topk_ratio <= 1:
            raise ValueError(f"topk_ratio must be in [0, 1] (0: exact), got {topk_ratio}")
        self.snapshots, self.diffs, self.gradients = snapshots, diffs, gradients
        self.full_every, self.batch_steps, self.topk_ratio = full_every, batch_steps, topk_ratio
        self.full_schedule = SnapshotSchedule(every_steps=full_every)  # from the loop's first step, or ``resume``'s base
        self.config = dict(config or {})
        self._pending: list[tuple[int, Mapping[str, torch.Tensor]]] = []
        self._previous: Mapping[str, torch.Tensor] = {}  # the last step's gradients (held; checked against the next)
        self._names: list[str] | None = None  # the tensors every record holds (the first record's)
        self._writer = BackgroundWriter("differential-checkpoint", max_pending)
        self.stats: _Stats = {"checkpoints": 0, "bytes": 0, "full_bytes": 0, "diff_bytes": 0, "batches": 0, "last_step": None,
                              "last_full_step": None, "write_seconds": [], "deleted_objects": 0}

    def resume(self, base_step: int) -> None:
        """Count the full-checkpoint interval from ``base_step`` (steps): the full checkpoint, or the
        initial state (0), that the restored state's record chain starts at, not the restored step. So
        a recovery never replays more than ``full_every`` records plus the writes in flight, however
        often failures come; counted from the restored step, a run that fails more often than every
        ``full_every`` steps takes no full checkpoint at all and replays an ever longer chain (seen in
        ``raycheck experiment --algo fo``: failures at steps 12 and 24 with ``full_every`` 20 replayed 20
        records from the initial state)."""
        self.full_schedule.taken(base_step)

    @property
    def schedule(self) -> SnapshotSchedule:
        """The full checkpoints' schedule (``full_every``)."""
        return self.full_schedule

    def full_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        """Queue a full checkpoint of ``state()`` (the state after ``steps_done`` steps, e.g. the initial
        one) now, whatever the schedule says; the full interval counts from ``steps_done``."""
        self.full_schedule.taken(steps_done)
        self._submit_full(steps_done, state)

    @property
    def bytes(self) -> int:
        """Bytes committed so far (full checkpoints and record batches)."""
        return self.stats["bytes"]

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        """Record the gradients of step ``steps_done - 1``; write a batch or a full checkpoint when
        due. Returns the seconds the training loop was blocked."""
        t0 = time.perf_counter()
        if self.full_schedule.take_if_due(steps_done):
            self._submit_full(steps_done, state)
            return time.perf_counter() - t0
        grads = self.gradients()
        require_new_tensors(self._previous, grads, f"the gradients of step {steps_done - 2}")
        names = list(grads)
        if self._names is not None and names != self._names:
            odd = sorted(set(names) ^ set(self._names))
            raise ValueError(f"the record of step {steps_done - 1} holds other tensors than the earlier steps' ({odd[:3]}: a "
                             "parameter without a gradient at some steps?): differential records the gradients of the same "
                             "parameters at every step; freeze a parameter for the whole run (requires_grad=False) or use "
                             "another strategy")
        self._names = names
        self._pending.append((steps_done - 1, grads))
        self._previous = grads
        if len(self._pending) >= self.batch_steps:
            self._submit_pending()
        return time.perf_counter() - t0

    def save_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]], timeout_s: float = 600.0) -> dict[str, Any]:
        """``Checkpointer.save_now`` (Just-In-Time Checkpointing, Gupta et al., EuroSys 2024): after the
        queued writes, write the pending records (those of the batch not yet due) and wait for them, so
        that the committed records reach ``steps_done`` from the newest full checkpoint
        (``DiffStore.durable_end``). When they still do not (an earlier batch failed, leaving a gap, or
        ``after_step(steps_done)`` was not called), a full checkpoint of ``state()`` is written instead and
        the full interval counts from ``steps_done``; otherwise it keeps counting from its base, as
        ``resume`` does after a restart. Returns ``step``, ``bytes``, ``seconds``, ``already``, ``records``
        (records written) and ``full`` (whether a full checkpoint was written).

        Raises:
            TimeoutError: not committed within ``timeout_s`` seconds.
            storage.backend.StorageError (or the store's other error): a write failed.
        """
        def save(left: Callable[[], float]) -> dict[str, Any] | None:
            since, what = len(self._writer.errors), f"the just-in-time checkpoint of step {steps_done}"
            records = self._submit_pending()
            self._writer.drain_or_raise(left(), what, since)
            if self._records_reach(steps_done):
                return {"records": records, "full": False} if records else None
            self.full_schedule.taken(steps_done)
            self._submit_full(steps_done, state)
            self._writer.drain_or_raise(left(), what, since)
            return {"records": records, "full": True}

        return just_in_time(steps_done, timeout_s, self.flush, lambda: self.bytes, save)

    def _records_reach(self, steps_done: int) -> bool:
        """Whether the committed records reach ``steps_done`` from the newest full checkpoint (where a
        recovery's replay starts; ``DiffStore.durable_end``)."""
        base = max((i.step for i in self.snapshots.list()), default=0)
        return self.diffs.durable_end(base) >= steps_done

    def _submit_full(self, step: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        """Queue a full checkpoint of ``state()`` at ``step``; the pending records are dropped (it supersedes them)."""
        self._pending.clear()
        self._previous = {}
        staged = copy_state(state())
        self._writer.submit(lambda: self._write_full(step, staged), f"full checkpoint at step {step}")

    def _submit_pending(self) -> int:
        """Queue the pending records as one batch; returns how many there were."""
        records, self._pending = self._pending, []
        if records:
            self._writer.submit(lambda: self._write_batch(records), f"diff batch of steps {records[0][0]}-{records[-1][0]}")
        return len(records)

    def _write_full(self, step: int, staged: Mapping[str, np.ndarray]) -> None:
        t0 = time.perf_counter()
        written = self._commit_full(step, staged)
        self.stats["write_seconds"].append(time.perf_counter() - t0)
        self.stats["checkpoints"] += 1
        self.stats["bytes"] += written
        self.stats["full_bytes"] += written
        self.stats["last_step"] = self.stats["last_full_step"] = step
        self.stats["deleted_objects"] += self.diffs.collect_garbage(step)

    def _commit_full(self, step: int, staged: Mapping[str, np.ndarray]) -> int:
        """Commit the staged full state of ``step``; returns the bytes written."""
        return self.snapshots.write(step, staged, config=self.config).bytes

    def _write_batch(self, records: list[tuple[int, Mapping[str, torch.Tensor]]]) -> None:
        t0 = time.perf_counter()
        for step, grads in records:  # a gradient written in place since its step: nothing of the batch is written
            check_record(grads, f"the record of step {step}")
        batch = self.diffs.write_batch([(step, {n: as_numpy(g.cpu()) for n, g in grads.items()}) for step, grads in records],
                                       self.topk_ratio)
        self.stats["write_seconds"].append(time.perf_counter() - t0)
        self.stats["batches"] += 1
        self.stats["bytes"] += batch.bytes
        self.stats["diff_bytes"] += batch.bytes
        self.stats["last_step"] = max(self.stats["last_step"] or 0, batch.last_step + 1)

    def flush(self, timeout_s: float = 600.0) -> bool:
        """Wait until every queued write has finished (committed or failed); False on timeout."""
        return self._writer.drain(timeout_s)

    def close(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Write the pending records as a last batch, wait for every write (at most ``timeout_s``);
        returns the stats: ``checkpoints`` (full), ``batches``, ``bytes`` (``full_bytes`` +
        ``diff_bytes``), ``last_step`` (state step the committed data reach), ``last_full_step``,
        ``write_seconds``, ``deleted_objects``, ``errors`` and ``finished``."""
        self._submit_pending()
        finished = self._writer.close(timeout_s)
        return {**self.stats, "write_seconds": list(self.stats["write_seconds"]), "errors": list(self._writer.errors),
                "finished": finished}
