"""How many cores the CPU shadow needs to keep up, from the measured replay rate, and what a recovery
costs when the shadow lags.

A replayed MeZO step touches every trainable element once (``training.zo.replay_step_``: one fused
pass per tensor, compute-bound: ``experiments.hotpath_bench``), so its time is the model's element
count over the replay rate. The rate is measured per core (the benchmark's one-thread replay rate, or
a shadow's own ``replay_seconds_per_step``); a sharded shadow splits the tensors over its shards and each
shard splits its large tensors over its threads (``training.noise``), so c cores replay a step in
elements / (c x rate). That scaling is taken as linear: the benchmark measures 1.8x on 2 cores of this
machine; a user with another machine gives its own rate.

A shadow keeps up when it replays a step in less than a training step (``policies.models.check_shadow``);
it is sized here to replay within ``utilization`` of a step, so that after a restart its lag shrinks by
at least 1 - utilization steps per replayed step (``policies.models.catch_up_s_per_step``) and its
snapshots have CPU left. A recovery from a live shadow that lags by L steps replays those L steps on the
worker's device before training goes on (``MeasuredCosts.live_replay_steps``): L x elements / that
device's replay rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_UTILIZATION = 0.5
"""The share of a training step a sized shadow spends replaying it."""


@dataclass(frozen=True, kw_only=True)
class ReplayThroughput:
    """Measured replay throughput of one model.

    Raises:
        ValueError: ``elements`` < 1, or a rate that is not a finite number > 0 (the message names it).
    """

    elements: int
    """Trainable elements of the model (every one is perturbed and updated by each step)."""
    elements_per_s_per_core: float
    """Replay rate of one CPU core, elements per second (``hotpath_bench``'s one-thread replay rate)."""
    device_elements_per_s: float | None = None
    """Replay rate on the training workers' device (a GPU's fused kernels), elements per second; None:
    the workers replay on their CPU, at ``elements_per_s_per_core`` per core of ``device_cores``."""
    device_cores: int = 1
    """CPU cores a worker replays with when ``device_elements_per_s`` is None."""

    def __post_init__(self) -> None:
        if self.elements < 1:
            raise ValueError(f"elements must be >= 1, got {self.elements!r}")
        for name in ("elements_per_s_per_core", "device_elements_per_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0 elements/s, got {value!r}")
        if self.device_cores < 1:
            raise ValueError(f"device_cores must be >= 1, got {self.device_cores!r}")


def shadow_replay_step_s(rate: ReplayThroughput, cores: int) -> float:
    """Seconds a shadow on ``cores`` cores takes to replay one step: elements / (cores x rate)."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores!r}")
    return rate.elements / (cores * rate.elements_per_s_per_core)


def cores_to_keep_up(rate: ReplayThroughput, step_s: float, utilization: float = DEFAULT_UTILIZATION) -> int:
    """The fewest cores (shards x threads) with which the shadow replays a step in less than
    ``utilization`` x ``step_s`` seconds; ``utilization`` 1: the fewest that keep up at all
    (``policies.models.check_shadow``'s rule, replay strictly faster than training).

    Raises:
        ValueError: ``step_s`` not > 0, or ``utilization`` outside (0, 1].
    """
    if not step_s > 0:
        raise ValueError(f"step_s must be > 0 seconds, got {step_s!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return math.floor(rate.elements / (rate.elements_per_s_per_core * utilization * step_s)) + 1


def lag_replay_s(rate: ReplayThroughput, lag_steps: float) -> float:
    """Seconds a recovery from a live shadow ``lag_steps`` steps behind the log spends replaying them
    on the worker's device (``device_elements_per_s``, or ``device_cores`` CPU cores)."""
    if lag_steps < 0:
        raise ValueError(f"lag_steps must be >= 0, got {lag_steps!r}")
    device = rate.device_elements_per_s or rate.device_cores * rate.elements_per_s_per_core
    return lag_steps * rate.elements / device
