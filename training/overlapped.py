"""Overlapped multi-step snapshots of a first-order run (GoCkpt: Zhang, Chen, Hu, Lin, Xu and Chen,
"Gradient-Assisted Multi-Step overlapped Checkpointing for Efficient LLM Training", arXiv:2511.07035, 2025).

A snapshot is split into m chunks of whole parameters (each with its Adam moments and step count),
balanced by bytes (``balanced_chunks``). When one comes due after step t (``policies.interval.snapshot_due``
through ``SnapshotSchedule``), the loop stages chunk 1 after step t, chunk 2 after step t+1, ..., chunk m
after step t+m-1: each step copies one chunk, about 1/m of a full staging copy. Each step of the window
also keeps a reference to the gradients its AdamW step applied to the chunks already staged (no copy:
``training.optim_steps.OptimizerSteps.applied``: each step's gradients are new tensors). Once the last chunk is staged, a
background thread brings every earlier chunk forward to step t+m-1 by replaying those gradients through
the same optimizer arithmetic (GoCkpt's gradient catch-up: a new optimizer of the run's optimizer class
over the chunk, ``training.optim_steps.OptimizerSteps.catch_up_``), so the assembled
snapshot is one consistent version, the state after step t+m-1, bitwise; then it commits it through the
run's ``SnapshotStore`` (shards, manifest last, the index as commit point). Rolling chunks back to step t
instead would not be exact (an AdamW step is not invertible in floating point), hence the forward
direction, as in the paper.

A snapshot that comes due while a window is open starts when it closes. The chunks are staged into one
of ``max_pending + 2`` reusable buffer sets (``training.state.StagingPool``: the open window's, the one
being written, and ``max_pending`` queued); a snapshot that comes due while none is free (the writer
is behind) is postponed to the first step at which one is, never waited for (``postponed_checks``,
``postponed_steps`` in ``close``), as in ``training.layerwise``. A failure during a window loses
that window (recovery takes the newest committed snapshot); ``close`` completes an open window from the
final state. m = 1 is a one-shot staged copy, as ``full-async``. On a failure notice ``save_now`` drops an
open window (its chunks are of several steps and need later steps' gradients) and commits the whole state
of the current step at once (Just-In-Time Checkpointing, Gupta et al., EuroSys 2024).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np
import torch

from raycheck.policies.interval import SnapshotSchedule
from raycheck.storage.background import BackgroundWriter, Postponements
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.tensor_files import as_numpy
from raycheck.storage.units import parameter_of
from raycheck.training.checkpointing import just_in_time
from raycheck.training.state import StagingPool, check_record, copy_into, record_part, require_new_tensors


CatchUp = Callable[[dict[str, np.ndarray], Sequence[Mapping[str, torch.Tensor]]], None]
"""Brings part of a staged state forward in place by the given steps' records, in order
(``training.optim_steps.OptimizerSteps.catch_up_``)."""


def balanced_chunks(sizes: Mapping[str, int], m: int) -> list[list[str]]:
    """Split items into at most ``m`` chunks of nearly equal total size.

    Greedy longest-first (LPT): items by decreasing size (ties: input order) each go to the chunk with
    the fewest bytes so far (ties: the lower index), so no chunk exceeds the mean by more than its
    largest item. Pure and deterministic.

    Args:
        sizes: item -> size in bytes (>= 0), e.g. a parameter's bytes with its optimizer state.
        m: chunks wanted (>= 1); fewer come back when there are fewer items (no chunk is empty).

    Returns:
        The chunks in index order, each listing its items in input order.

    Raises:
        ValueError: ``m`` < 1, or a negative size.
    """
    if m < 1:
        raise ValueError(f"the number of chunks must be >= 1, got {m}")
    negative = {k: v for k, v in sizes.items() if v < 0}
    if negative:
        raise ValueError(f"sizes must be >= 0 bytes, got {negative}")
    order = {item: i for i, item in enumerate(sizes)}
    loads = [0] * min(m, len(sizes))
    chunks: list[list[str]] = [[] for _ in loads]
    for item in sorted(sizes, key=lambda k: (-sizes[k], order[k])):
        lightest = min(range(len(loads)), key=lambda i: (loads[i], i))
        loads[lightest] += sizes[item]
        chunks[lightest].append(item)
    return [sorted(c, key=order.__getitem__) for c in chunks]


def parameter_tensors(names: list[str]) -> dict[str, list[str]]:
    """Parameter name -> its training-state tensor names (the weights, then ``optim.*``), in state order."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(parameter_of(n) or n, []).append(n)
    return groups


def _nbytes(state: Mapping[str, torch.Tensor | np.ndarray], names: list[str]) -> int:
    return sum(as_numpy(state[n]).nbytes for n in names)


def _tensors(chunk: Mapping[str, list[str]]) -> list[str]:
    """The tensor names of a chunk (parameter -> its tensor names)."""
    return [n for names in chunk.values() for n in names]


@dataclass
class _Window:
    """An overlapped snapshot being staged: started after ``start_step`` steps."""

    start_step: int
    names: list[str]
    """Every tensor name of the state, canonical order."""
    buffers: dict[str, np.ndarray]
    """The staging buffer set the chunks are copied into (given back once the snapshot is written)."""
    plan: list[dict[str, list[str]]]
    """The chunks (``OverlappedCheckpointer.plan``), staged in this order."""
    staged: dict[str, np.ndarray] = field(default_factory=dict)
    gradients: list[Mapping[str, torch.Tensor]] = field(default_factory=list)
    """``gradients[i]``: what step ``start_step + i`` applied to the parameters of chunks 0..i."""

    @property
    def chunks_staged(self) -> int:
        """Chunks staged: the first at the start, one more with each later step (which adds its gradients)."""
        return len(self.gradients) + 1


class _Stats(TypedDict):
    checkpoints: int
    bytes: int
    last_step: int | None
    write_seconds: list[float]
    catch_up_seconds: list[float]
    stage_seconds: list[float]


class OverlappedCheckpointer:
    """GoCkpt-style overlapped snapshots every ``every`` steps (the module docstring; a
    ``training.checkpointing.Checkpointer``).

    Args:
        store: the run's snapshots.
        every: steps between the starts of two snapshots (>= 1).
        chunks: m, the steps a snapshot is staged over (>= 1; at most one chunk per parameter).
        catch_up: brings a staged chunk forward by the later steps' records
            (``training.optim_steps.OptimizerSteps.catch_up_``: through the optimizer's class).
        gradients: the record of the last step (``OptimizerSteps.applied``): tensors that no later
            step writes.
        config: recorded in each manifest.
        max_pending: assembled snapshots that may wait behind the one being written (bounds memory: the
            checkpointer holds ``max_pending + 2`` copies of the state).

    Raises:
        ValueError: ``every`` or ``chunks`` < 1.
    """

    staging_wait_s = 0.0
    """How long a due snapshot waits for a free staging set (0: it is postponed instead; ``StagingPool.take_due``)."""

    def __init__(self, store: SnapshotStore, every: int, chunks: int, catch_up: CatchUp,
                 gradients: Callable[[], Mapping[str, torch.Tensor]], config: Mapping[str, Any] | None = None,
                 max_pending: int = 1) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {every}")
        if chunks < 1:
            raise ValueError(f"an overlapped snapshot needs >= 1 chunk, got {chunks}")
        self.store, self.chunks, self.gradients = store, chunks, gradients
        self.catch_up = catch_up
        self.schedule = SnapshotSchedule(every_steps=every)  # counts from the step the loop starts at
        self.config = dict(config or {})
        self._pool = StagingPool(max_pending + 2)  # the open window, the snapshot being written, the queued ones
        # a written snapshot gives its set back just before the thread takes the next from the queue
        self._writer = BackgroundWriter("overlapped-checkpoint", max_pending + 1)
        self.postponed = Postponements()
        self._last_step_seen = 0
        self._window: _Window | None = None
        self._plan: list[dict[str, list[str]]] | None = None  # per chunk: parameter -> its state tensors
        self._state: Callable[[], Mapping[str, torch.Tensor]] | None = None
        self.chunk_bytes: list[int] = []
        """Bytes of each chunk (known from the first snapshot on)."""
        self.last_submitted_step: int | None = None
        """The step of the newest snapshot whose chunks are all staged (handed to the writer thread)."""
        self.stats: _Stats = {"checkpoints": 0, "bytes": 0, "last_step": None, "write_seconds": [], "catch_up_seconds": [],
                              "stage_seconds": []}

    @property
    def window_open(self) -> bool:
        """A snapshot is being staged (its remaining chunks come with the next steps, or at ``close``)."""
        return self._window is not None

    @property
    def bytes(self) -> int:
        """Shard bytes committed so far."""
        return self.stats["bytes"]

    def plan(self, state: Mapping[str, torch.Tensor | np.ndarray]) -> list[dict[str, list[str]]]:
        """The chunks of ``state`` (``balanced_chunks`` by the bytes of each parameter with its optimizer
        state), each as parameter -> its tensor names. Entries without optimizer state (a frozen
        parameter, a parameter group's hyper-parameters: nothing catches them up) go into the last chunk,
        staged at the snapshot's step."""
        members = parameter_tensors(list(state))
        loose = [p for p, names in members.items() if len(names) == 1]
        sizes = {p: _nbytes(state, names) for p, names in members.items() if p not in loose}
        plan = [{p: members[p] for p in chunk} for chunk in balanced_chunks(sizes, self.chunks)] or [{}]
        plan[-1].update((p, members[p]) for p in loose)
        return plan

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        """Start a snapshot when one is due, or go on with the open one: keep the last step's gradients of
        the chunks staged so far and stage the next chunk; submit the snapshot once every chunk is staged.
        Returns the seconds the training loop was blocked (0.0 outside a window)."""
        t0 = time.perf_counter()
        window, self._state, self._last_step_seen = self._window, state, steps_done
        if window is None:
            if not self.schedule.due(steps_done):
                return 0.0
            buffers = self._pool.take_due(steps_done, self.postponed, self.staging_wait_s)
            if buffers is None:  # every buffer set is held by snapshots not yet written: postponed
                return 0.0
            live = state()
            window = self._open(steps_done, live, buffers)
        else:
            live = state()
            window.gradients.append(self._held_gradients(window))
        self._stage(window, window.chunks_staged - 1, live)
        if window.chunks_staged == len(window.plan):
            self._submit(window, steps_done)
        blocked = time.perf_counter() - t0
        self.stats["stage_seconds"].append(blocked)
        return blocked

    def save_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]], timeout_s: float = 600.0) -> dict[str, Any]:
        """``Checkpointer.save_now`` (Just-In-Time Checkpointing, Gupta et al., EuroSys 2024): after the
        submitted snapshots, drop an open window (never committed half-staged: its buffer set goes back to
        the pool) and, unless the newest committed snapshot is of ``steps_done``, stage every chunk of
        ``state()`` now (a window of one step: no catch-up) and wait for its commit. Snapshots go on
        counting from ``steps_done``. Returns ``step``, ``bytes``, ``seconds``, ``already`` and
        ``dropped_window`` (the step the dropped window began at; None: none was open).

        Raises:
            TimeoutError: not committed within ``timeout_s`` seconds.
            storage.backend.StorageError (or the store's other error): the write failed.
        """
        def save(left: Callable[[], float]) -> dict[str, Any] | None:
            dropped, self._window = self._window, None
            if dropped is not None:
                self._pool.give_back(dropped.buffers)
            if self.stats["last_step"] == steps_done:
                self.schedule.taken(steps_done)
                self.postponed.taken(steps_done)
                return None
            buffers = self._pool.take(left())  # free: the submitted snapshots have given theirs back
            if buffers is None:
                raise TimeoutError(f"no staging buffer set came free within {timeout_s} s")
            live = state()
            window = self._open(steps_done, live, buffers)
            for index in range(len(window.plan)):
                self._stage(window, index, live)
            since = len(self._writer.errors)
            self._submit(window, steps_done)
            self._writer.drain_or_raise(left(), f"the just-in-time snapshot of step {steps_done}", since)
            return {"dropped_window": None if dropped is None else dropped.start_step}

        return just_in_time(steps_done, timeout_s, self.flush, lambda: self.bytes, save)

    def _open(self, step: int, live: Mapping[str, torch.Tensor], buffers: dict[str, np.ndarray]) -> _Window:
        """Start the snapshot due after ``step`` steps in ``buffers`` (plans the chunks on first use)."""
        self.schedule.taken(step)
        self.postponed.taken(step)
        if self._plan is None:
            self._plan = self.plan(live)
            self.chunk_bytes = [_nbytes(live, _tensors(chunk)) for chunk in self._plan]
        self._window = _Window(start_step=step, names=list(live), buffers=buffers, plan=self._plan)
        return self._window

    def _held_gradients(self, window: _Window) -> Mapping[str, torch.Tensor]:
        """References to the last step's record but the gradients of the chunks not staged yet (no copy;
        a record's other entries, e.g. a user's optimizer's hyper-parameters, are kept for every chunk)."""
        grads = self.gradients()
        unstaged = {p for chunk in window.plan[window.chunks_staged:] for p, names in chunk.items() if len(names) > 1}
        held = record_part(grads, [n for n in grads if n not in unstaged])
        previous = window.gradients[-1] if window.gradients else {}
        require_new_tensors(previous, held, f"the gradients of step {window.start_step + len(window.gradients) - 1}")
        return held

    def _stage(self, window: _Window, index: int, live: Mapping[str, torch.Tensor]) -> None:
        window.staged.update(copy_into(window.buffers, {n: live[n] for n in _tensors(window.plan[index])}))

    def _submit(self, window: _Window, step: int) -> None:
        """Queue the catch-up and the commit of ``window`` as the snapshot of ``step``; close the window."""
        self._window, self.last_submitted_step = None, step

        def write() -> None:
            try:
                self._write(window, step)
            finally:
                self._pool.give_back(window.buffers)

        self._writer.submit(write, f"overlapped snapshot of step {step}")

    def _write(self, window: _Window, step: int) -> None:
        """On the writer thread: bring each chunk to ``step`` (replay the steps after it was staged), commit."""
        t0 = time.perf_counter()
        for i, record in enumerate(window.gradients):  # a gradient written in place since its step: nothing is written
            check_record(record, f"the record of step {window.start_step + i} (overlapped snapshot of step {step})")
        for index, chunk in enumerate(window.plan):
            later = window.gradients[index:]  # the steps after chunk ``index`` was staged
            if later:
                self.catch_up({n: window.staged[n] for n in _tensors(chunk)}, later)
        t1 = time.perf_counter()
        written = self._commit(step, {n: window.staged[n] for n in window.names})
        self.stats["catch_up_seconds"].append(t1 - t0)
        self.stats["write_seconds"].append(time.perf_counter() - t1)
        self.stats["checkpoints"] += 1
        self.stats["bytes"] += written
        self.stats["last_step"] = step

    def _commit(self, step: int, state: dict[str, np.ndarray]) -> int:
        """Commit the assembled ``state`` as the snapshot of ``step``; returns the bytes written."""
        return self.store.write(step, state, config=self.config).bytes

    def flush(self, timeout_s: float = 600.0) -> bool:
        """Wait until every submitted snapshot has been committed or has failed (an open window is not
        submitted yet: it needs its later steps); False on timeout."""
        return self._writer.drain(timeout_s)

    def close(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Complete an open window from the current (final) state: its remaining chunks are staged now,
        outside the loop, so the snapshot is of the last step (a snapshot still postponed at the last
        step is staged whole now, once a buffer set is free). Then wait for every write (at most
        ``timeout_s``); returns ``checkpoints``, ``bytes``, ``last_step``, ``write_seconds`` and
        ``catch_up_seconds`` (per snapshot), ``stage_seconds`` (per staging step), ``chunks`` (m used),
        ``chunk_bytes`` (per chunk), ``postponed_checks``, ``postponed_steps``, ``errors`` and
        ``finished``."""
        state = self._state
        if state is not None:  # after_step has run: a window may be open, a snapshot postponed
            buffers = self._pool.take(timeout_s) if self._window is None and self.postponed.due_since is not None else None
            if buffers is not None:
                self._stage(self._open(self._last_step_seen, state(), buffers), 0, state())
            window = self._window
            if window is not None:
                live = state()
                for index in range(window.chunks_staged, len(window.plan)):
                    self._stage(window, index, live)
                self._submit(window, window.start_step + len(window.gradients))
        finished = self._writer.close(timeout_s)
        return {**self.stats, "write_seconds": list(self.stats["write_seconds"]),
                "catch_up_seconds": list(self.stats["catch_up_seconds"]), "stage_seconds": list(self.stats["stage_seconds"]),
                "chunks": len(self._plan or []), "chunk_bytes": list(self.chunk_bytes), **self.postponed.stats(), "errors": list(self._writer.errors), "finished": finished}
