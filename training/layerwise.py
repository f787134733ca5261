"""Layer-wise adaptive checkpoints of a first-order run (LayerCheck, arXiv 2026).

Every ``every`` steps (a check), for each unit (embeddings, each transformer layer, final norm, LM
head: ``storage.units.unit_of``) the checkpointer measures the relative change of the unit's weights
since the version it last persisted (``policies.layerwise.relative_change``, float64) and lets
``policies.layerwise.select_units`` decide: units never persisted and units whose persisted version
is ``staleness_bound_steps`` old or older are forced; units whose change exceeds the threshold
follow, by decreasing change, while they fit the per-check byte budget (the rest wait for a later
check: writes are spread over checks).

The training loop only stages a copy of the state (its one stall, as for an asynchronous full
checkpoint; on this CPU-only setup a memory copy costs less than measuring the change in float64 in
the loop), into one of ``max_pending + 1`` reusable buffer sets (``training.state.StagingPool``). It
never waits for the background thread: when a check comes due while every buffer set is still held
by earlier checks (the writer is behind), the check is postponed to the first step at which a set is
free (``postponed_checks``, ``postponed_steps`` in ``close``'s stats). The staleness bound still holds:
staleness is measured at the step the check runs, so the units at or over the bound are forced at
that check, whichever step it runs at. What a postponement lengthens is the gap between two checks
(``snapshot_due`` keeps a due check due at every later step, so it runs at the first step with room:
a re-plan of the interval never postpones a check past its interval, back-pressure does, by the
steps the writer is behind). A background thread measures, selects and writes the selected units'
weights, Adam moments and step counts through ``SnapshotStore.write_units``: one committed composite
snapshot per check, whose manifest references the older shards of the units not rewritten (each verified
first: a unit whose shard fails verification is rewritten from the staged copy). Restore loads the
newest committed snapshot like any other (``SnapshotStore.load_latest``); its units may come from
different steps.

A just-in-time check (``save_now``, on a failure notice: Just-In-Time Checkpointing, Gupta et al.,
EuroSys 2024) rewrites every unit not persisted at the current step, whatever the threshold and the
budget, so the composite it commits is the current state exactly; it is staged and queued as a check is
(after the checks already queued), and waited for.

Recovery is approximate by design: a unit not rewritten at the last check resumes from an older
version (within the threshold of the current one, and at most ``staleness_bound_steps`` old).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from raycheck.policies.interval import SnapshotSchedule
from raycheck.policies.layerwise import LayerwiseConfig, Reason, UnitStatus, relative_change, select_units
from raycheck.storage.background import BackgroundWriter, Postponements
from raycheck.storage.snapshots import SnapshotInfo, SnapshotStore, unit_steps
from raycheck.storage.tensor_files import as_numpy
from raycheck.storage.units import group_by_unit, parameter_of
from raycheck.training.checkpointing import just_in_time
from raycheck.training.state import StagingPool, copy_into


class LayerwiseCheckpointer:
    """Layer-wise adaptive checkpoints every ``every`` steps (a
    ``training.checkpointing.Checkpointer``).

    At a check the training loop only stages a copy of the state (as an asynchronous full checkpoint
    does); the background thread measures each unit's change, selects units and commits the composite.
    Checks are processed one at a time in step order, and a unit counts as persisted only once the
    snapshot that wrote it is committed (a failed write leaves it to be selected again).

    Args:
        store: the run's snapshots.
        every: steps between checks (>= 1).
        policy: threshold, staleness bound (steps) and byte budget per check (``max_bytes_per_check``).
        config: recorded in each manifest.
        max_pending: staged checks that may wait behind the running one (bounds staging memory: the
            checkpointer holds ``max_pending + 1`` copies of the state).
    """

    staging_wait_s = 0.0
    """How long a due check waits for a free staging set (0: it is postponed instead; ``StagingPool.take_due``)."""

    def __init__(self, store: SnapshotStore, every: int, policy: LayerwiseConfig, config: Mapping[str, Any] | None = None,
                 max_pending: int = 2) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {every}")
        self.store, self.policy = store, policy
        self.schedule = SnapshotSchedule(every_steps=every)  # counts from the step the loop starts at
        self.config = dict(config or {})
        self._persisted: dict[str, tuple[int, dict[str, np.ndarray]]] = {}  # unit -> (step, weights as committed)
        self._pool = StagingPool(max_pending + 1)  # the running check's set and those of the queued ones
        # a finished check gives its set back just before the thread takes the next one from the queue,
        # so the queue has room for every set: ``submit`` never waits
        self._writer = BackgroundWriter("layerwise-checkpoint", max_pending + 1)
        self._state: Callable[[], Mapping[str, torch.Tensor]] | None = None  # the loop's, from its last step
        self._last_step_seen = 0
        self.postponed = Postponements()
        self.checks = 0
        self.bytes = 0
        self.last_step: int | None = None
        self.write_seconds: list[float] = []
        self.copy_seconds: list[float] = []
        self.units_written: dict[str, int] = {}
        self.reasons: dict[str, int] = {}

    def resume(self, info: SnapshotInfo, state: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        """Start from a restored snapshot: each unit counts as persisted at its manifest step with the
        weights of ``state`` (the state just loaded from ``info``), so no unit is rewritten needlessly;
        a unit the snapshot lacks (e.g. the parameter groups of a state merged from checkpoints without
        them) counts as never persisted, so the next check writes it. Call before the first ``after_step``."""
        steps = unit_steps(info)
        for unit, names in group_by_unit(state).items():
            if unit not in steps:
                continue
            weights = {n: np.array(as_numpy(state[n]), copy=True) for n in names if parameter_of(n) is None}
            self._persisted[unit] = (steps[unit], weights)

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        """At a check, stage a copy of the state into a free buffer set and queue the check; with no
        free set (the writer is behind) postpone the check to the next step. Returns the seconds the
        training loop was blocked (0.0 between checks)."""
        self._state, self._last_step_seen = state, steps_done
        if not self.schedule.due(steps_done):
            return 0.0
        t0 = time.perf_counter()
        buffers = self._pool.take_due(steps_done, self.postponed, self.staging_wait_s)
        if buffers is None:
            return time.perf_counter() - t0
        self._stage(steps_done, buffers, state)
        return time.perf_counter() - t0

    def save_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]], timeout_s: float = 600.0) -> dict[str, Any]:
        """``Checkpointer.save_now`` (Just-In-Time Checkpointing, Gupta et al., EuroSys 2024): after the
        queued checks, unless every unit is persisted at ``steps_done`` already, stage ``state()`` and
        queue a just-in-time check that rewrites every unit persisted before ``steps_done`` (or never),
        ignoring the threshold and the byte budget (reason ``just_in_time``), and wait for its commit: the
        composite of ``steps_done`` is then the state of ``steps_done`` in every unit, weights and
        optimizer state. Checks go on counting from ``steps_done``. Returns ``step``, ``bytes``,
        ``seconds``, ``already`` and ``units`` (units rewritten).

        Raises:
            TimeoutError: not committed within ``timeout_s`` seconds.
            storage.backend.StorageError (or the store's other error): the check's write failed.
        """
        def save(left: Callable[[], float]) -> dict[str, Any] | None:
            if self._persisted and all(step == steps_done for step, _ in self._persisted.values()):
                return None
            buffers = self._pool.take(left())  # free: the queued checks have given theirs back
            if buffers is None:
                raise TimeoutError(f"no staging buffer set came free within {timeout_s} s")
            since, before = len(self._writer.errors), self.reasons.get(Reason.JUST_IN_TIME.value, 0)
            self._stage(steps_done, buffers, state, just_in_time=True)
            self._writer.drain_or_raise(left(), f"the just-in-time check at step {steps_done}", since)
            return {"units": self.reasons.get(Reason.JUST_IN_TIME.value, 0) - before}

        return just_in_time(steps_done, timeout_s, self.flush, lambda: self.bytes, save)

    def _stage(self, step: int, buffers: dict[str, np.ndarray], state: Callable[[], Mapping[str, torch.Tensor]],
               just_in_time: bool = False) -> None:
        """Take the check at ``step`` (a just-in-time one: every unit not persisted at ``step``): copy
        ``state()`` into ``buffers`` and queue the check, which gives the buffers back once it has finished."""
        self.schedule.taken(step)
        self.postponed.taken(step)
        t0 = time.perf_counter()
        staged = copy_into(buffers, state())
        self.copy_seconds.append(time.perf_counter() - t0)

        def check() -> None:
            try:
                self._check(step, staged, just_in_time)
            finally:
                self._pool.give_back(buffers)

        self._writer.submit(check, f"{'just-in-time ' if just_in_time else ''}layer-wise check at step {step}")

    def _status(self, step: int, unit: str, names: list[str], staged: Mapping[str, np.ndarray]) -> UnitStatus:
        size = sum(staged[n].nbytes for n in names)
        if unit not in self._persisted:
            return UnitStatus(unit=unit, relative_change=0.0, staleness_steps=None, bytes=size)
        persisted_step, weights = self._persisted[unit]
        change = relative_change({n: staged[n] for n in weights}, weights)
        return UnitStatus(unit=unit, relative_change=change, staleness_steps=step - persisted_step, bytes=size)

    def _statuses(self, step: int, layout: Mapping[str, list[str]], staged: Mapping[str, np.ndarray]) -> list[UnitStatus]:
        """Each unit's change, staleness and size at the check of ``step``."""
        return [self._status(step, u, ns, staged) for u, ns in layout.items()]

    def _write(self, step: int, units: tuple[str, ...], layout: Mapping[str, list[str]], staged: dict[str, np.ndarray]) -> tuple[list[str], int]:
        """Commit the composite of ``step`` rewriting ``units``; returns the units written (with any whose
        committed shard failed verification) and the bytes written."""
        changed = {n: staged[n] for u in units for n in layout[u]}
        info = self.store.write_units(step, changed, list(staged), config=self.config, full_state=staged)
        return [u for u, spec in info.manifest["units"].items() if spec["path"].startswith(info.folder + "/")], info.own_bytes

    def _check(self, step: int, staged: dict[str, np.ndarray], just_in_time: bool) -> None:
        """On the writer thread: select the units (``policies.layerwise.select_units``), commit them."""
        layout = group_by_unit(staged)
        decision = select_units(self.policy, self._statuses(step, layout, staged), just_in_time)
        for s in decision.selected:
            self.reasons[s.reason.value] = self.reasons.get(s.reason.value, 0) + 1
        t0 = time.perf_counter()
        written, written_bytes = self._write(step, decision.units, layout, staged)
        self.write_seconds.append(time.perf_counter() - t0)
        for unit in written:  # the selected units, and any whose committed shard failed verification
            kept = self._persisted.get(unit, (step, {}))[1]  # copied: the staged buffers are reused
            self._persisted[unit] = (step, copy_into(kept, {n: staged[n] for n in layout[unit] if parameter_of(n) is None}))
            self.units_written[unit] = self.units_written.get(unit, 0) + 1
        self.checks += 1
        self.bytes += written_bytes
        self.last_step = step

    @property
    def errors(self) -> list[str]:
        """``"<what>: <error>"`` of every failed check so far."""
        return list(self._writer.errors)

    def flush(self, timeout_s: float = 600.0) -> bool:
        """Wait until every queued check has finished (committed or failed); False on timeout."""
        return self._writer.drain(timeout_s)

    def close(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Run a check still postponed at the last step (from the final state, waiting for a free buffer
        set now that the loop is over), then wait for the queued checks (at most ``timeout_s`` each);
        returns ``checkpoints`` (committed checks), ``bytes`` (shard bytes written), ``last_step``,
        ``write_seconds`` (per check), ``copy_seconds`` (per check: the loop's staging copy),
        ``units_written`` (unit -> times written), ``reasons`` (selection reason -> times selected),
        ``postponed_checks`` (checks that ran later than due because the
        writer was behind), ``postponed_steps`` (their delays, summed), ``errors`` (failed checks) and
        ``finished`` (False when the timeout cut the wait short)."""
        finished, state = True, self._state
        if self.postponed.due_since is not None and state is not None:  # postponed by after_step, which sets state
            buffers = self._pool.take(timeout_s)
            finished = buffers is not None
            if buffers is not None:
                self._stage(self._last_step_seen, buffers, state)
        finished = self._writer.close(timeout_s) and finished
        return {"checkpoints": self.checks, "bytes": self.bytes, "last_step": self.last_step,
                "write_seconds": list(self.write_seconds), "copy_seconds": list(self.copy_seconds),
                "units_written": dict(self.units_written), "reasons": dict(self.reasons), **self.postponed.stats(), "errors": list(self._writer.errors), "finished": finished}
