"""Whether a warm standby pays, from what it measurably costs and what it saves at each failure (pure).

A standby (``workers.standby``) is a second step executor of a rank, built, loaded and warmed before it is
needed: when the active executor's process dies it takes over, so the recovery skips the cold start (a
process, the imports, the model, the data, and Ray Train's restart of the worker around them).

The comparison is made per failure of the rank, in core-seconds (CPU seconds of the node's cores):

- **saved**: during a cold start every training worker of the job waits (with replica groups the others
  wait at the step exchange), so a failure without a standby idles ``training_cores`` cores for the
  measured cold start: an executor's load (``load_s``: process created to model and data loaded, warmed)
  plus Ray Train's part of a restart (``restart_s``: measured as the supervisor's own start, its process
  created to its train function called; a lower bound: detection and the failed group's teardown come
  on top).
- **cost**: the CPU the standby takes from the node: one load (``load_cpu_s``, the new standby loaded after
  a promotion) plus its waiting until the failure (``idle_cpu_share`` x ``failure_interval_s``).
- **memory**: a waiting standby holds ``standby_bytes`` (a loaded executor's resident memory); it is kept
  only where the node's available memory is at least twice that, so it never pushes the training into
  swap or the OOM killer.

It pays when saved > cost and the memory fits. ``failure_interval`` gives the interval from the configured
MTBF and the run's injected failures. Source: the expected-cost comparison of a hot spare against a cold
restart in high-availability design (Gray & Siewiorek, "High-availability computer systems", IEEE Computer
24(9), 1991); one failure per MTBF as in Young's interval (Comm. ACM 17(9), 1974).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

GIB = 1024**3
MEMORY_HEADROOM = 2.0
"""A standby is kept only where the node's available memory is at least this many times what it holds."""


@dataclass(frozen=True, kw_only=True)
class StandbyCosts:
    """What a standby costs and saves, measured on the rank's node (a loaded executor and the idle
    supervisor beside it).

    Raises:
        ValueError: a field negative or not finite, ``failure_interval_s`` or ``training_cores`` not > 0
            (the message names the field).
    """

    load_s: float
    """An executor's cold start, process created to model and data loaded and warmed, seconds (wall clock)."""
    load_cpu_s: float
    """The CPU time that start took, seconds (all its threads)."""
    restart_s: float
    """Ray Train's start of a worker process, created to its train function called, seconds (the supervisor's own)."""
    standby_bytes: int
    """A loaded executor's resident memory, bytes."""
    available_bytes: int
    """The node's available memory now (``psutil.virtual_memory().available``), bytes."""
    idle_cpu_share: float
    """CPU a waiting process takes, CPU seconds per second (a process blocked in ``ray.get``, measured)."""
    failure_interval_s: float
    """Expected seconds from now to the rank's next failure (``failure_interval``)."""
    training_cores: float
    """The cores that wait during a cold start: every worker's torch threads (``workers`` x ``torch_threads``)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"StandbyCosts.{f.name} must be finite and >= 0, got {value!r}")
        for name in ("failure_interval_s", "training_cores"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StandbyCosts.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class StandbyDecision:
    """Keep a standby loaded (``keep``) or not, and why in one line (``reason``), with the figures compared per
    failure: ``saved_core_s`` and ``cost_core_s`` (core-seconds)."""

    keep: bool
    reason: str
    saved_core_s: float
    cost_core_s: float


def failure_interval(mtbf_s: float, steps: int, injected_failures: int, step_s: float) -> float:
    """Expected seconds to a worker's next failure: the configured MTBF (``mtbf_s``, seconds), or, where the
    run injects ``injected_failures`` worker failures over its ``steps`` steps, the run's length over their
    count (``steps`` x ``step_s`` / count; ``step_s``: one step, seconds, estimated) when that is shorter."""
    if injected_failures <= 0:
        return mtbf_s
    return min(mtbf_s, max(steps * step_s / injected_failures, 1e-3))


def standby_decision(c: StandbyCosts) -> StandbyDecision:
    """Whether a warm standby pays for ``c`` (the module docstring's comparison), the reason in one line."""
    saved = (c.load_s + c.restart_s) * c.training_cores
    cost = c.load_cpu_s + c.idle_cpu_share * c.failure_interval_s
    held = f"{c.standby_bytes / GIB:.2f} GiB"
    if c.available_bytes < MEMORY_HEADROOM * c.standby_bytes:
        return StandbyDecision(False, f"warm standby off: it would hold {held} and the node has {c.available_bytes / GIB:.2f} GiB "
                                      f"available (needs {MEMORY_HEADROOM:g}x)", saved, cost)
    compared = (f"a failure every {c.failure_interval_s:.4g} s would idle {c.training_cores:g} training core{'s' if c.training_cores != 1 else ''} for a "
                f"{c.load_s + c.restart_s:.1f} s cold start ({saved:.1f} core-s); a standby costs {cost:.1f} core-s "
                f"(load {c.load_cpu_s:.1f}, waiting {c.idle_cpu_share:.3f} CPU/s) and holds {held}")
    return StandbyDecision(saved > cost, f"warm standby {'on' if saved > cost else 'off'}: {compared}", saved, cost)
