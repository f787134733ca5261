"""Layer-wise adaptive checkpoints: which units to persist at a step (LayerCheck, arXiv 2026).

Updates are non-uniform across transformer layers, so LayerCheck persists only the units (embeddings,
one transformer layer, final norm, LM head: ``storage.units.unit_of``) whose change since their last
persisted version exceeds a threshold, spreads the writes over checks with a per-check byte budget,
and bounds every unit's staleness so that a composite recovery state is never older than the bound.

The rule (``select_units``), applied at each check (a step the checkpointer checks at) to a frozen
status of every unit:

1. Units never persisted (``staleness_steps=None``) are forced: taken first, in input order
   (reason ``FORCED_FIRST``); a composite state needs a version of every unit.
2. Units at or over the staleness bound (``staleness_steps >= staleness_bound_steps``) are forced:
   taken next, oldest first (ties: larger change first, then input order) (``STALENESS_BOUND``).
3. Units whose relative change is strictly over ``threshold`` are taken by decreasing change (ties:
   staler first, then input order) while they fit in what the forced units left of
   ``max_bytes_per_check`` (``THRESHOLD``). The first one that does not fit ends the check: it and
   the rest are ``deferred`` to a later check (where the staleness bound forces them at the latest).

Forced units are taken even when they alone exceed the budget; their bytes count against it.
A just-in-time check (``just_in_time=True``: a checkpoint on a failure notice, Just-In-Time Checkpointing,
Gupta et al., EuroSys 2024) takes every unit not persisted at this step (``JUST_IN_TIME``), with no
threshold and no budget, so the composite is the current state, exactly.
Pure: no torch, no Ray, no I/O; counters and measurements are passed in.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, kw_only=True)
class LayerwiseConfig:
    """Settings of the selection rule: strategy ``layerwise``'s component of the job's configuration
    (``job.config.JobConfig``, field ``layerwise``), whose checks come every ``snapshot.every_steps`` steps.
    A refusal names the field by its path there (``layerwise.threshold``)."""

    threshold: float = field(default=1e-3, metadata={"raycheck.option": {"name": '--layer-threshold', "section": 'First-order', "min": 0,
            "help": "fo layerwise: rewrite a unit at a check (every --snapshot-every steps) when its weights' "
            'relative change since its persisted version exceeds this.'}})
    """Relative change (||w - w_persisted|| / ||w_persisted||, dimensionless, >= 0) a unit must exceed to
    be persisted before its staleness bound. Default from a measurement: see docs/first-order.md."""
    staleness_bound_steps: int = field(default=100, metadata={"raycheck.option": {"name": '--layer-staleness-steps', "section": 'First-order', "min": 1, "unit": "steps",
            "help": 'fo layerwise: rewrite a unit whose persisted version is this many steps old.'}})
    """A unit whose last persisted version is this many steps old or older is persisted regardless of its
    change (>= 1; bounds how old a restored unit can be)."""
    max_bytes_per_check: int = field(default=0, metadata={"raycheck.option": {"name": '--layer-max-bytes-per-check', "section": 'First-order', "min": 0, "unit": "bytes",
            "help": 'fo layerwise: bytes written per check, forced units included (0: no limit).'}})
    """Bytes of unit shards written per check, forced units included (they are written even over it);
    units over the threshold that do not fit wait for a later check (0: no limit)."""

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise ValueError(f"layerwise.threshold must be a number, got {self.threshold!r}")
        if not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"layerwise.threshold must be a finite relative change >= 0, got {self.threshold}")
        for name, low in (("staleness_bound_steps", 1), ("max_bytes_per_check", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"layerwise.{name} must be an integer, got {value!r}")
            if value < low:
                raise ValueError(f"layerwise.{name} must be >= {low}, got {value}")


@dataclass(frozen=True, kw_only=True)
class UnitStatus:
    """What the rule knows about one unit at the current step.

    Attributes:
        unit: the unit's name (``embed``, ``layer.007``, ``norm``, ``lm_head``).
        relative_change: ||w - w_persisted|| / ||w_persisted|| since its last persisted version
            (``relative_change``; >= 0, ``inf`` allowed). Ignored for a unit never persisted.
        staleness_steps: current step - step of its last persisted version (>= 0), or ``None``
            when no version of the unit has been persisted yet.
        bytes: size of the unit's shard in bytes (>= 0).
    """

    unit: str
    relative_change: float
    staleness_steps: int | None
    bytes: int

    def __post_init__(self) -> None:
        if not self.unit:
            raise ValueError("unit must be a non-empty name")
        if math.isnan(self.relative_change) or self.relative_change < 0:
            raise ValueError(f"{self.unit}: relative_change must be >= 0 (not NaN), got {self.relative_change}")
        if self.staleness_steps is not None and self.staleness_steps < 0:
            raise ValueError(f"{self.unit}: staleness_steps must be >= 0 or None, got {self.staleness_steps}")
        if self.bytes < 0:
            raise ValueError(f"{self.unit}: bytes must be >= 0, got {self.bytes}")


class Reason(str, enum.Enum):
    """Why a unit is persisted at this step."""

    FORCED_FIRST = "forced_first"
    """No version of the unit has been persisted yet."""
    STALENESS_BOUND = "staleness_bound"
    """Its last persisted version is ``staleness_bound_steps`` old or older."""
    THRESHOLD = "threshold"
    """Its relative change exceeds ``threshold`` and it fits the byte budget."""
    JUST_IN_TIME = "just_in_time"
    """A just-in-time check: it was not persisted at this step (never, or at an earlier one)."""


@dataclass(frozen=True)
class Selected:
    """A unit to persist now, why, and its size in bytes."""

    unit: str
    reason: Reason
    bytes: int


@dataclass(frozen=True)
class LayerwiseDecision:
    """The units to persist at this step, in the order chosen.

    Attributes:
        selected: units to persist, forced ones first.
        deferred: units over threshold that did not fit the budget, in priority order.
        bytes: total bytes of ``selected``.
    """

    selected: tuple[Selected, ...]
    deferred: tuple[str, ...]
    bytes: int

    @property
    def units(self) -> tuple[str, ...]:
        """Names of the selected units."""
        return tuple(s.unit for s in self.selected)

    def reasons(self) -> dict[str, Reason]:
        """Selected unit -> reason."""
        return {s.unit: s.reason for s in self.selected}


def select_units(config: LayerwiseConfig, units: Sequence[UnitStatus], just_in_time: bool = False) -> LayerwiseDecision:
    """The units to persist at this step (the rule is in the module docstring); ``just_in_time``: every
    unit whose staleness is not 0 steps, in input order, ignoring ``config``.

    Raises:
        ValueError: a unit appears twice in ``units``.
    """
    seen: set[str] = set()
    for u in units:
        if u.unit in seen:
            raise ValueError(f"unit {u.unit!r} appears twice in the unit status")
        seen.add(u.unit)
    if just_in_time:
        due = [Selected(u.unit, Reason.JUST_IN_TIME, u.bytes) for u in units if u.staleness_steps != 0]
        return LayerwiseDecision(tuple(due), (), sum(s.bytes for s in due))
    never = [u for u in units if u.staleness_steps is None]
    persisted = [(i, u.staleness_steps, u) for i, u in enumerate(units) if u.staleness_steps is not None]
    stale = sorted(
        ((i, s, u) for i, s, u in persisted if s >= config.staleness_bound_steps),
        key=lambda isu: (-isu[1], -isu[2].relative_change, isu[0]),
    )
    changed = sorted(
        ((i, s, u) for i, s, u in persisted
         if s < config.staleness_bound_steps and u.relative_change > config.threshold),
        key=lambda isu: (-isu[2].relative_change, -isu[1], isu[0]),
    )
    selected = [Selected(u.unit, Reason.FORCED_FIRST, u.bytes) for u in never]
    selected += [Selected(u.unit, Reason.STALENESS_BOUND, u.bytes) for _, _, u in stale]
    spent = sum(s.bytes for s in selected)
    deferred: list[str] = []
    for _, _, u in changed:
        if deferred or (config.max_bytes_per_check and spent + u.bytes > config.max_bytes_per_check):
            deferred.append(u.unit)
            continue
        selected.append(Selected(u.unit, Reason.THRESHOLD, u.bytes))
        spent += u.bytes
    return LayerwiseDecision(tuple(selected), tuple(deferred), spent)


def relative_change(current: Mapping[str, np.ndarray], persisted: Mapping[str, np.ndarray]) -> float:
    """||w - w_persisted|| / ||w_persisted|| over all tensors of one unit (dimensionless).

    ``current`` and ``persisted`` map the unit's tensor names to arrays; the norm is the Euclidean
    norm of all their elements together, accumulated in float64. A unit whose persisted norm is 0
    has change 0 when unchanged and ``inf`` otherwise.

    Raises:
        ValueError: the two mappings hold different names, or a tensor's shape differs.
    """
    return change_ratio(*change_sums(current, persisted))


def change_sums(current: Mapping[str, np.ndarray], persisted: Mapping[str, np.ndarray]) -> tuple[float, float]:
    """``(||w - w_persisted||^2, ||w_persisted||^2)`` over all tensors of one unit, accumulated in float64:
    the parts of ``relative_change`` that add up over row shards (FSDP2: each rank sums its rows,
    ``training.sharded.ShardedLayerwiseCheckpointer``).

    Raises:
        ValueError: as ``relative_change``.
    """
    if set(current) != set(persisted):
        missing = sorted(set(persisted) - set(current))[:3]
        extra = sorted(set(current) - set(persisted))[:3]
        raise ValueError(f"current and persisted tensors differ: missing {missing}, unexpected {extra}")
    diff_sq = base_sq = 0.0
    for name, now in current.items():
        now, then = np.asarray(now), np.asarray(persisted[name])
        if now.shape != then.shape:
            raise ValueError(f"{name}: shape {now.shape} now, {then.shape} when persisted")
        then64 = then.astype(np.float64, copy=False)
        delta = now.astype(np.float64) - then64
        diff_sq += float(np.vdot(delta.ravel(), delta.ravel()))
        base_sq += float(np.vdot(then64.ravel(), then64.ravel()))
    return diff_sq, base_sq


def change_ratio(diff_sq: float, base_sq: float) -> float:
    """``sqrt(diff_sq) / sqrt(base_sq)`` (``relative_change`` from ``change_sums``); 0 when both are 0,
    ``inf`` when only ``base_sq`` is."""
    if base_sq == 0.0:
        return 0.0 if diff_sq == 0.0 else math.inf
    return math.sqrt(diff_sq) / math.sqrt(base_sq)
