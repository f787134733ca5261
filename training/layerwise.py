"""Layer-wise adaptive checkpoints of a first-order run (LayerCheck, arXiv 2026).

Every ``every`` steps (a check), for each unit (embeddings, each transformer layer, final norm, LM
head: ``storage.units.unit_of``) the checkpointer measures the relative change of the unit's
weights since the version it last persisted (``policies.layerwise.relative_change``) and lets
``policies.layerwise.select_units`` decide: units never persisted and units whose persisted version
is ``staleness_bound_steps`` old or older are forced; units whose change exceeds the threshold follow,
by decreasing change, while they fit the per-check byte budget (the rest wait for a later check:
writes are spread over checks). The selected units' weights, Adam moments and step counts are copied
(the only stall of the training loop besides the measurement) and written by a background thread
through ``storage.composite.write_units``: one committed composite snapshot per check, whose
manifest references the older shards of the units not rewritten. Restore loads the newest committed
snapshot like any other (``SnapshotStore.load_latest``); its units may come from different steps.

Recovery is approximate by design: a unit not rewritten at the last check resumes from an older
version (within the threshold of the current one, and at most ``staleness_bound_steps`` old).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from policies.layerwise import LayerwiseConfig, UnitStatus, relative_change, select_units
from storage.background import BackgroundWriter
from storage.composite import write_units, written_bytes
from storage.snapshots import SnapshotInfo, SnapshotStore
from storage.units import group_by_unit, parameter_of
from training.state import as_numpy


class LayerwiseCheckpointer:
    """Layer-wise adaptive checkpoints every ``every`` steps (same interface as
    ``training.checkpointing.FullCheckpointer``).

    Args:
        store: the run's snapshots.
        every: steps between checks (>= 1).
        policy: threshold, staleness bound (steps) and byte budget per check (``max_bytes_per_step``).
        config: recorded in each manifest.
        max_pending: checks whose writes may wait behind the running one (bounded staging memory).
    """

    def __init__(self, store: SnapshotStore, every: int, policy: LayerwiseConfig, config: Mapping | None = None,
                 max_pending: int = 2) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {every}")
        self.store, self.every, self.policy = store, every, policy
        self.config = dict(config or {})
        self._persisted: dict[str, tuple[int, dict[str, np.ndarray]]] = {}  # unit -> (step, weights as persisted)
        self._failed: set[str] = set()  # units whose write failed: forced at the next check
        self._lock = threading.Lock()
        self._writer = BackgroundWriter("layerwise-checkpoint", max_pending)
        self.checks = 0
        self.bytes = 0
        self.last_step: int | None = None
        self.write_seconds: list[float] = []
        self.units_written: dict[str, int] = {}
        self.reasons: dict[str, int] = {}

    def resume(self, info: SnapshotInfo, state: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        """Start from a restored snapshot: each unit counts as persisted at its manifest step with the
        weights of ``state`` (the state just loaded from ``info``), so no unit is rewritten needlessly."""
        for unit, names in group_by_unit(state).items():
            weights = {n: np.array(as_numpy(state[n]), copy=True) for n in names if parameter_of(n) is None}
            self._persisted[unit] = (int(info.manifest["units"][unit]["step"]), weights)

    def _status(self, steps_done: int, unit: str, names: list[str], live: Mapping[str, torch.Tensor]) -> UnitStatus:
        size = sum(as_numpy(live[n]).nbytes for n in names)
        with self._lock:
            failed = unit in self._failed
        if unit not in self._persisted or failed:
            return UnitStatus(unit=unit, relative_change=0.0, staleness_steps=None, bytes=size)
        step, weights = self._persisted[unit]
        change = relative_change({n: as_numpy(live[n]) for n in weights}, weights)
        return UnitStatus(unit=unit, relative_change=change, staleness_steps=steps_done - step, bytes=size)

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        """At a check, select units, stage their copies and queue the composite write; returns the
        seconds the training loop was blocked (0.0 between checks)."""
        if steps_done % self.every:
            return 0.0
        t0 = time.perf_counter()
        live = state()
        layout = group_by_unit(live)
        decision = select_units(self.policy, [self._status(steps_done, u, ns, live) for u, ns in layout.items()])
        staged = {n: np.array(as_numpy(live[n]), copy=True) for u in decision.units for n in layout[u]}
        with self._lock:
            self._failed -= set(decision.units)
        for unit in decision.units:
            self._persisted[unit] = (steps_done, {n: staged[n] for n in layout[unit] if parameter_of(n) is None})
        for s in decision.selected:
            self.reasons[s.reason.value] = self.reasons.get(s.reason.value, 0) + 1
        names = list(live)
        self._writer.submit(lambda: self._write(steps_done, staged, names, decision.units), f"layer-wise check at step {steps_done}")
        return time.perf_counter() - t0

    def _write(self, step: int, staged: dict[str, np.ndarray], names: list[str], units: tuple[str, ...]) -> None:
        t0 = time.perf_counter()
        try:
            info = write_units(self.store, step, staged, names, config=self.config)
        except BaseException:
            with self._lock:
                self._failed |= set(units)
            raise
        self.write_seconds.append(time.perf_counter() - t0)
        self.checks += 1
        self.bytes += written_bytes(info)
        self.last_step = step
        for unit in units:
            self.units_written[unit] = self.units_written.get(unit, 0) + 1

    def close(self, timeout_s: float = 600.0) -> dict:
        """Wait for the queued writes (at most ``timeout_s``); returns ``checkpoints`` (committed
        checks), ``bytes`` (shard bytes written), ``last_step``, ``write_seconds`` (per check),
        ``units_written`` (unit -> times written), ``reasons`` (selection reason -> count),
        ``errors`` (failed writes) and ``finished`` (False when the timeout cut the wait short)."""
        finished = self._writer.close(timeout_s)
        return {"checkpoints": self.checks, "bytes": self.bytes, "last_step": self.last_step,
                "write_seconds": list(self.write_seconds), "units_written": dict(self.units_written),
                "reasons": dict(self.reasons), "errors": list(self._writer.errors), "finished": finished}
