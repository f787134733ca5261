"""Worker-side full-state checkpoints: the baselines raycheck is measured against.

``full-sync``: every ``every`` steps the training loop stops, writes the whole state and returns
once the snapshot is committed (a blocking ``torch.save`` / ``safetensors`` save).
``full-async``: every ``every`` steps the loop stops only for a staging copy of the state (the
device-to-host copy; on CPU a memory copy) and a background thread writes the copy (torch DCP
``async_save``; CheckFreq, Mohan et al., FAST'21, section 4). The staging copy goes into one reused
buffer set (``training.state.copy_into``: no fresh allocation, no page faults after the first). A new
checkpoint that comes due while the previous write is still running waits for it first (CheckFreq's
rule): that wait blocks the loop too and is counted. With ``postpone_when_busy`` the loop never waits:
the checkpoint is postponed to the first step at which the previous write has finished (the rule of
``training.layerwise``; ``postponed_checks`` / ``postponed_steps`` in ``close``), so the gap between two
checkpoints can exceed the interval by the steps a slow write takes. Either way the checkpoint goes through the run's ``SnapshotStore`` (the same storage layer
and commit rules as the shadow's snapshots) and recovery restores it through the same path.

A failure loses the steps after the last committed checkpoint: they are recomputed after restart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
import torch

from policies.interval import SnapshotSchedule
from storage.background import Postponements
from training.state import copy_into


class _Committed(Protocol):
    @property
    def bytes(self) -> int: ...


class CheckpointWriter(Protocol):
    """Where ``FullCheckpointer`` commits: a ``storage.snapshots.SnapshotStore``, or a
    ``training.sharded.ShardedWriter`` under FSDP2; ``write`` returns once committed, with the bytes written."""

    def write(self, step: int, state: Mapping[str, np.ndarray], /, config: Mapping | None = None) -> _Committed: ...


class FullCheckpointer:
    """Full-state checkpoints every ``every`` steps, blocking (``asynchronous=False``) or staged.

    Args:
        store: where checkpoints are committed.
        every: interval in steps (>= 1).
        asynchronous: stage a copy and write it on a background thread.
        config: recorded in each manifest (e.g. the run's trajectory hash).
        postpone_when_busy: (asynchronous only) postpone a due checkpoint while the previous write is
            still running instead of waiting for it. Off by default: the baseline is CheckFreq's, and
            its checkpoints fall on multiples of ``every``.

    Raises:
        ValueError: ``every`` < 1.
        storage.backend.StorageError: from ``after_step`` (synchronous) or ``close`` (a failed
            background write), so a checkpoint that did not commit is never silent.
    """

    def __init__(self, store: CheckpointWriter, every: int, asynchronous: bool, config: Mapping | None = None,
                 postpone_when_busy: bool = False) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {every}")
        self.store, self.asynchronous, self.postpone_when_busy = store, asynchronous, asynchronous and postpone_when_busy
        self.schedule = SnapshotSchedule(every_steps=every)  # counts from the step the loop starts at
        self.config = dict(config or {})
        self.checkpoints = 0
        self.bytes = 0
        self.last_step: int | None = None
        self.write_seconds: list[float] = []
        self.stage_seconds: list[float] = []
        self.copy_seconds: list[float] = []
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[str, np.ndarray] = {}  # the staging copy, reused (held by the write until it ends)
        self.postponed = Postponements()
        self._last: tuple[int, Callable[[], Mapping[str, torch.Tensor]]] | None = None  # the loop's last step and state

    def _write(self, step: int, state: Mapping[str, np.ndarray]) -> None:
        t0 = time.perf_counter()
        try:
            info = self.store.write(step, state, config=self.config)
        except BaseException as exc:  # re-raised by the loop's next checkpoint or by close()
            self._error = exc
            return
        self.write_seconds.append(time.perf_counter() - t0)
        self.checkpoints += 1
        self.bytes += info.bytes
        self.last_step = step

    def _wait(self, timeout_s: float | None = None) -> None:
        if self._writer is not None:
            self._writer.join(timeout_s)
            if self._writer.is_alive():
                raise TimeoutError(f"the background checkpoint write did not finish within {timeout_s} s")
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        """Checkpoint the state after ``steps_done`` steps when it is due (with ``postpone_when_busy``,
        when it is due and the previous write has finished); returns the seconds the training loop was
        blocked (0.0 when no checkpoint is taken)."""
        self._last = (steps_done, state)
        if not self.schedule.due(steps_done):
            return 0.0
        if self.postpone_when_busy and self._writer is not None and self._writer.is_alive():
            self.postponed.postpone(steps_done)
            return 0.0
        return self._take(steps_done, state)

    def _take(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        t0 = time.perf_counter()
        self.schedule.taken(steps_done)
        self.postponed.taken(steps_done)
        self._wait()
        t1 = time.perf_counter()
        staged = copy_into(self._buffers, state())
        if not self.asynchronous:
            self._write(steps_done, staged)
            self._wait()
            return time.perf_counter() - t0
        self.copy_seconds.append(time.perf_counter() - t1)
        self.stage_seconds.append(time.perf_counter() - t0)
        self._writer = threading.Thread(target=self._write, args=(steps_done, staged), name="async-checkpoint", daemon=True)
        self._writer.start()
        return time.perf_counter() - t0

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the background write (if any) has committed; raises its error if it failed, and
        ``TimeoutError`` after ``timeout_s`` seconds (None: no limit)."""
        self._wait(timeout_s)

    def close(self) -> dict:
        """Take a checkpoint still postponed at the last step (from the final state), wait for the
        background write; returns ``checkpoints``, ``bytes``, ``last_step``, ``write_seconds`` (per
        checkpoint), ``stage_seconds`` (per staged copy: the loop's whole stall, the wait for the previous
        write included), ``copy_seconds`` (per staged copy: the copy alone), ``postponed_checks`` and
        ``postponed_steps``."""
        if self.postponed.due_since is not None and self._last is not None:  # postponed by after_step, which sets _last
            self._take(*self._last)
        self._wait()
        return {"checkpoints": self.checkpoints, "bytes": self.bytes, "last_step": self.last_step,
                "write_seconds": list(self.write_seconds), "stage_seconds": list(self.stage_seconds),
                "copy_seconds": list(self.copy_seconds), **self.postponed.stats()}
