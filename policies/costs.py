"""Measured costs that the snapshot-interval models take in, and the error they raise.

Every duration is in seconds of wall-clock time. The step log and durable storage survive every
failure. By default a failure takes down the job's processes (workers, shadow, persister);
``shadow_loss_fraction`` < 1 says that some failures (a worker's process or node alone) leave the
CPU shadow and its image alive.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


class InfeasibleError(ValueError):
    """The inputs admit no valid plan; the message says which input to change and how."""


MAX_MTBF_STEPS = 1e12
"""The largest MTBF ``MeasuredCosts`` takes, in steps: beyond it step counts stop being numbers a run reaches."""


@dataclass(frozen=True, kw_only=True)
class MeasuredCosts:
    """Costs of one job, measured or assumed. All ``_s`` fields are seconds.

    Raises:
        ValueError: a field is negative, not finite, or zero where it must be positive; the
            message names the field.
    """

    step_s: float
    """One training step on the critical path (forward passes and update), without the log append."""
    replay_step_s: float
    """The CPU shadow's replay of one logged step (and the replay of one step during recovery)."""
    snapshot_s: float
    """Writing one full-state snapshot to durable storage: blocks training in a synchronous
    checkpoint, runs in the background for asynchronous and shadow snapshots."""
    restart_s: float
    """Detecting a failure and restarting the job's processes."""
    load_s: float
    """Loading a snapshot (or the initial weights) into the restarted job."""
    mtbf_s: float
    """Mean time between failures of the whole job (see ``for_accelerators``)."""
    stall_s: float = 0.0
    """Training stall of an asynchronous full-state snapshot (the device-to-host staging copy)."""
    log_append_s: float = 0.0
    """Durable append of one step record, paid by every step of the log-based strategies."""
    background_weight: float = 1.0
    """Share of a background snapshot's seconds charged as waste: 1 counts its CPU and I/O in full
    (the shadow model of ``docs/algorithms.md``), 0 counts only what stalls training."""
    accelerators: int = 1
    """Accelerators in the job (recorded with the plan; ``mtbf_s`` is already the job's)."""
    shadow_loss_fraction: float = 1.0
    """Share of failures, in [0, 1], that also lose the live shadow's image (its process or node, or a
    whole-job restart): those recover from the newest durable snapshot plus the log tail. The others
    take the live image through the object store and replay ``live_replay_steps``; the shadow's
    snapshots in flight survive them. 1 is the model where every failure takes the job down."""
    live_replay_steps: float = 0.0
    """Steps a recovery from the live shadow's image replays on average (the shadow's lag behind the
    durable log when the worker failed; measured from the recoveries, ``experiments.report_tables``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")
        for name in ("step_s", "replay_step_s", "mtbf_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        for name in ("background_weight", "shadow_loss_fraction"):
            if getattr(self, name) > 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.mtbf_s / self.step_s > MAX_MTBF_STEPS:  # the models' sums and searches run over k <= 50 MTBFs of steps
            raise ValueError(f"mtbf_s={self.mtbf_s:g} s is {self.mtbf_s / self.step_s:.3g} steps of step_s={self.step_s:g} s; "
                             f"the cost model takes at most {MAX_MTBF_STEPS:.0e} (no run is that long)")
        if self.accelerators < 1 or int(self.accelerators) != self.accelerators:
            raise ValueError(f"accelerators must be an integer >= 1, got {self.accelerators!r}")

    @classmethod
    def for_accelerators(cls, *, accelerator_mtbf_s: float, accelerators: int, **costs: float) -> "MeasuredCosts":
        """Costs of a job whose ``accelerators`` fail independently, each every ``accelerator_mtbf_s``
        seconds on average: the job's MTBF is ``accelerator_mtbf_s / accelerators``."""
        if accelerator_mtbf_s <= 0 or accelerators < 1:
            raise ValueError(f"accelerator_mtbf_s must be > 0 and accelerators >= 1, got {accelerator_mtbf_s!r}, {accelerators!r}")
        return cls(mtbf_s=accelerator_mtbf_s / accelerators, accelerators=accelerators, **costs)

    @property
    def failure_rate_per_s(self) -> float:
        """Failures per second of wall-clock time (1 / ``mtbf_s``)."""
        return 1.0 / self.mtbf_s

    @property
    def downtime_s(self) -> float:
        """Restart plus load: the fixed part of every recovery."""
        return self.restart_s + self.load_s

    def replace(self, **changes: Any) -> "MeasuredCosts":
        """A copy with the fields ``changes`` names (field -> value of the field's type) replaced."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)
