"""Worker-side checkpointers: their interface (``Checkpointer``) and full-state checkpoints, the
baselines raycheck is measured against.

``full-sync``: every ``every`` steps the training loop stops, writes the whole state and returns
once the snapshot is committed (a blocking ``torch.save`` / ``safetensors`` save).
``full-async``: every ``every`` steps the loop stops only for a staging copy of the state (the
device-to-host copy; on CPU a memory copy) and a background thread
(``storage.background.BackgroundWriter``, one job at a time) writes the copy (torch DCP
``async_save``; CheckFreq, Mohan et al., FAST'21, section 4). The staging copy goes into one reused
buffer set (``training.state.copy_into``: no fresh allocation, no page faults after the first). A new
checkpoint that comes due while the previous write is still running waits for it first (CheckFreq's
rule): that wait blocks the loop too and is counted. With ``postpone_when_busy`` the loop never waits:
the checkpoint is postponed to the first step at which the previous write has finished (the rule of
``training.layerwise``; ``postponed_checks`` / ``postponed_steps`` in ``close``), so the gap between two
checkpoints can exceed the interval by the steps a slow write takes. Either way the checkpoint goes through the run's ``SnapshotStore`` (the same storage layer
and commit rules as the shadow's snapshots) and recovery restores it through the same path.

A failure loses the steps after the last committed checkpoint: they are recomputed after restart.
On a failure notice (a node drain with a deadline) the loop calls ``save_now`` instead: it commits the
state of the current step whatever the schedule says, so the restart recomputes none (Just-In-Time
Checkpointing, Gupta et al., EuroSys 2024: a checkpoint of the current minibatch on a failure notice).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from raycheck.policies.interval import SnapshotSchedule
from raycheck.storage.background import BackgroundWriter, Postponements
from raycheck.training.state import copy_into


@runtime_checkable
class Checkpointer(Protocol):
    """What a training loop calls on its checkpointer (``workers.fo_worker``; the ZO full-state
    baselines of ``workers.worker``): ``FullCheckpointer`` (and ``training.sharded.ShardedCheckpointer``),
    ``training.layerwise.LayerwiseCheckpointer``, ``training.differential.DiffCheckpointer`` and
    ``training.overlapped.OverlappedCheckpointer`` implement it (structurally: none inherits from it).
    """

    @property
    def bytes(self) -> int:
        """Bytes committed to storage so far (a write still running is not counted)."""

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        """Called by the loop after each step, ``steps_done`` (>= 1) the steps done so far; takes what
        is due after that step (staging a copy of ``state()``, the live training state by name, called
        only when something is copied). Returns the seconds the training loop was blocked (0.0 when
        nothing was taken).
        """

    def save_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]], timeout_s: float = 600.0) -> dict[str, Any]:
        """Just-in-time checkpoint (Just-In-Time Checkpointing, Gupta et al., EuroSys 2024): commit the
        state after ``steps_done`` steps (``state()``, as for ``after_step``) now, whatever the schedule
        says, after the writes already queued, and return once it is committed, so that a restart from it
        recomputes no step. The loop calls it after that step's ``after_step``; ``after_step`` and ``close``
        go on afterwards as before (a schedule counts from ``steps_done``, as after a restart there).

        Returns ``step`` (``steps_done``), ``bytes`` (bytes this call wrote), ``seconds`` (its wall
        seconds), the checkpointer's own fields, and ``already`` (True when the state of ``steps_done`` was
        committed already, e.g. by the schedule at that step: then only that write is waited for and
        ``bytes`` is 0).

        Raises:
            TimeoutError: the commit did not finish within ``timeout_s`` seconds (nothing partial is
                committed; the write may still commit later).
            storage.backend.StorageError (or the store's other error): the write failed.
        """

    def flush(self, timeout_s: float = 600.0) -> bool:
        """Wait until every write handed to the background has finished (committed or failed); False
        when ``timeout_s`` seconds passed first. What a failed write does is the checkpointer's
        (``FullCheckpointer`` raises its error; the others report it in ``close``'s ``errors``).
        """

    def close(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Take what is still due or postponed at the last step, wait for every write (``timeout_s``
        seconds: the checkpointer says what a longer wait does) and stop the background thread. Returns
        the checkpointer's statistics, at least ``checkpoints`` (committed), ``bytes`` and ``last_step``
        (the newest committed state's step; None: none).
        """


def just_in_time(steps_done: int, timeout_s: float, queued: Callable[[float], bool], written: Callable[[], int],
                 save: Callable[[Callable[[], float]], dict[str, Any] | None]) -> dict[str, Any]:
    """The frame of every checkpointer's ``save_now``: wait up to ``timeout_s`` seconds for the writes
    already queued (``queued(seconds)``: False on timeout), then ``save(left)`` commits what the state
    after ``steps_done`` steps still lacks and waits for it (``left()``: the seconds of ``timeout_s`` left);
    it returns the checkpointer's own result fields, or None when nothing was lacking (``already``).
    ``bytes``: the growth of ``written()`` (the checkpointer's committed bytes).

    Raises:
        TimeoutError: the queued writes did not finish in time (or ``save``'s, which raises it).
    """
    t0 = time.perf_counter()
    if not queued(timeout_s):
        raise TimeoutError(f"the writes queued before the just-in-time checkpoint of step {steps_done} did not finish "
                           f"within {timeout_s} s")
    before = written()
    fields = save(lambda: max(0.0, timeout_s - (time.perf_counter() - t0)))
    return {"step": steps_done, "bytes": written() - before, "seconds": time.perf_counter() - t0,
            **(fields or {}), "already": fields is None}


class _Committed(Protocol):
    @property
    def bytes(self) -> int: ...


class CheckpointWriter(Protocol):
    """Where ``FullCheckpointer`` commits: a ``storage.snapshots.SnapshotStore``, or a
    ``training.sharded.ShardedWriter`` under FSDP2; ``write`` returns once committed, with the bytes written."""

    def write(self, step: int, state: Mapping[str, np.ndarray], /, config: Mapping[str, Any] | None = None) -> _Committed: ...


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
        storage.backend.StorageError: from ``after_step`` (synchronous, or the next checkpoint after a
            failed background write), ``flush`` or ``close`` (a failed background write), so a
            checkpoint that did not commit is never silent.
    """

    def __init__(self, store: CheckpointWriter, every: int, asynchronous: bool, config: Mapping[str, Any] | None = None,
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
        self._writer = BackgroundWriter("async-checkpoint", max_pending=1) if asynchronous else None
        self._error: BaseException | None = None  # of the last background write, raised by ``_wait``
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

    def _wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the background write (None: no limit); False on timeout, else raise its error if
        it failed."""
        if self._writer is not None and not self._writer.drain(timeout_s):
            return False
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return True

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        """Checkpoint the state after ``steps_done`` steps when it is due (with ``postpone_when_busy``,
        when it is due and the previous write has finished); returns the seconds the training loop was
        blocked (0.0 when no checkpoint is taken)."""
        self._last = (steps_done, state)
        if not self.schedule.due(steps_done):
            return 0.0
        if self.postpone_when_busy and not self._wait(0.0):  # the previous write is still running
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
        if self._writer is None:  # full-sync: written on the loop's thread
            self._write(steps_done, staged)
            self._wait()
            return time.perf_counter() - t0
        self.copy_seconds.append(time.perf_counter() - t1)
        self.stage_seconds.append(time.perf_counter() - t0)
        self._writer.submit(functools.partial(self._write, steps_done, staged), f"checkpoint at step {steps_done}")
        return time.perf_counter() - t0  # the queue is empty (the previous write has finished): no wait

    def save_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]], timeout_s: float = 600.0) -> dict[str, Any]:
        """``Checkpointer.save_now`` (Just-In-Time Checkpointing, Gupta et al., EuroSys 2024): wait for
        the running write; unless it was of ``steps_done``, take a checkpoint of ``state()`` now as the
        schedule would (written on this thread, or staged and waited for) and count the interval from
        ``steps_done``. Returns ``step``, ``bytes``, ``seconds`` and ``already``.

        Raises:
            TimeoutError: not committed within ``timeout_s`` seconds.
            storage.backend.StorageError: this write failed, or the running one did (raised first, as
                ``after_step`` does: it is raised once, and a second call then writes).
        """
        def save(left: Callable[[], float]) -> dict[str, Any] | None:
            if self.last_step == steps_done:
                return None
            self._take(steps_done, state)
            if not self._wait(left()):
                raise TimeoutError(f"the just-in-time checkpoint of step {steps_done} did not commit within {timeout_s} s")
            return {}

        return just_in_time(steps_done, timeout_s, self._wait, lambda: self.bytes, save)

    def flush(self, timeout_s: float = 600.0) -> bool:
        """Wait until the background write (if any) has committed; raises its error if it failed;
        False after ``timeout_s`` seconds."""
        return self._wait(timeout_s)

    def close(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Take a checkpoint still postponed at the last step (from the final state), wait for the
        background write and stop its thread; returns ``checkpoints``, ``bytes``, ``last_step``,
        ``write_seconds`` (per checkpoint), ``stage_seconds`` (per staged copy: the loop's whole stall,
        the wait for the previous write included), ``copy_seconds`` (per staged copy: the copy alone),
        ``postponed_checks`` and ``postponed_steps``.

        Raises:
            TimeoutError: the write did not finish within ``timeout_s`` seconds.
            storage.backend.StorageError: the write failed.
        """
        if self.postponed.due_since is not None and self._last is not None:  # postponed by after_step, which sets _last
            self._take(*self._last)
        if self._writer is not None and not self._writer.close(timeout_s):
            raise TimeoutError(f"the background checkpoint write did not finish within {timeout_s} s")
        self._wait()
        return {"checkpoints": self.checkpoints, "bytes": self.bytes, "last_step": self.last_step,
                "write_seconds": list(self.write_seconds), "stage_seconds": list(self.stage_seconds),
                "copy_seconds": list(self.copy_seconds), **self.postponed.stats()}
