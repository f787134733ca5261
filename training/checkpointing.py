"""Worker-side full-state checkpoints: the baselines raycheck is measured against.

``full-sync``: every ``every`` steps the training loop stops, writes the whole state and returns
once the snapshot is committed (a blocking ``torch.save`` / ``safetensors`` save).
``full-async``: every ``every`` steps the loop stops only for a staging copy of the state (the
device-to-host copy; on CPU a memory copy) and a background thread writes the copy (torch DCP
``async_save``; CheckFreq, Mohan et al., FAST'21, section 4). A new checkpoint that comes due while
the previous write is still running waits for it first: that wait blocks the loop too and is
counted. Either way the checkpoint goes through the run's ``SnapshotStore`` (the same storage layer
and commit rules as the shadow's snapshots) and recovery restores it through the same path.

A failure loses the steps after the last committed checkpoint: they are recomputed after restart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from policies.interval import SnapshotSchedule
from storage.snapshots import SnapshotStore
from training.state import copy_state


class FullCheckpointer:
    """Full-state checkpoints every ``every`` steps, blocking (``asynchronous=False``) or staged.

    Args:
        store: where checkpoints are committed.
        every: interval in steps (>= 1).
        asynchronous: stage a copy and write it on a background thread.
        config: recorded in each manifest (e.g. the run's trajectory hash).

    Raises:
        ValueError: ``every`` < 1.
        storage.backend.StorageError: from ``after_step`` (synchronous) or ``close`` (a failed
            background write), so a checkpoint that did not commit is never silent.
    """

    def __init__(self, store: SnapshotStore, every: int, asynchronous: bool, config: Mapping | None = None) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {every}")
        self.store, self.asynchronous = store, asynchronous
        self.schedule = SnapshotSchedule(every_steps=every)  # counts from the step the loop starts at
        self.config = dict(config or {})
        self.checkpoints = 0
        self.bytes = 0
        self.last_step: int | None = None
        self.write_seconds: list[float] = []
        self.stage_seconds: list[float] = []
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

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
        """Checkpoint the state after ``steps_done`` steps when it is due; returns the seconds the
        training loop was blocked (0.0 when no checkpoint is due)."""
        if not self.schedule.take_if_due(steps_done):
            return 0.0
        t0 = time.perf_counter()
        self._wait()
        staged = copy_state(state())
        if not self.asynchronous:
            self._write(steps_done, staged)
            self._wait()
            return time.perf_counter() - t0
        self.stage_seconds.append(time.perf_counter() - t0)
        self._writer = threading.Thread(target=self._write, args=(steps_done, staged), name="async-checkpoint", daemon=True)
        self._writer.start()
        return time.perf_counter() - t0

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the background write (if any) has committed; raises its error if it failed, and
        ``TimeoutError`` after ``timeout_s`` seconds (None: no limit)."""
        self._wait(timeout_s)

    def close(self) -> dict:
        """Wait for a background write; returns ``checkpoints``, ``bytes``, ``last_step``,
        ``write_seconds`` (per checkpoint) and ``stage_seconds`` (per staged copy)."""
        self._wait()
        return {"checkpoints": self.checkpoints, "bytes": self.bytes, "last_step": self.last_step,
                "write_seconds": list(self.write_seconds), "stage_seconds": list(self.stage_seconds)}
