"""Whether a warm standby pays, from what it measurably costs and what it saves at each failure (pure).

A standby (``workers.standby``) is a second step executor of a rank, built and loaded before it is needed:
when the active executor's process dies it takes over, so the recovery skips the cold start (a process,
the imports, the model, the data, and Ray Train's restart of the worker group around them).

The comparison is made per failure, at one failure every MTBF:

- **saved** per failure: the measured cold start of an executor (``load_s``: process created to model
  and data loaded, warmed) plus Ray Train's part of a restart (``restart_s``: measured as the supervisor's
  own start, its process created to its train function called; a lower bound: the teardown of the
  failed group and the detection come on top).
- **cost** per failure: the CPU a standby takes from the node, in seconds of its cores: one load
  (``load_cpu_s``, the new standby loaded after the promotion) plus its waiting over one MTBF
  (``idle_cpu_share`` x ``mtbf_s``), divided by ``cores``.
- **memory**: a waiting standby holds ``standby_bytes`` (a loaded executor's resident memory); it is kept
  only where the node's available memory is at least twice that, so that it never pushes the training
  into swap or the OOM killer.

It pays when saved > cost and the memory fits. Source: the expected-cost comparison of a hot spare against
a cold restart (e.g. Gray & Siewiorek, "High-availability computer systems", IEEE Computer 1991, on
standby spares); the per-MTBF accounting is Young's (Comm. ACM 17(9), 1974): one failure per MTBF.
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
        ValueError: a field negative or not finite, ``mtbf_s`` or ``cores`` not > 0 (names the field).
    """

    load_s: float
    """An executor's cold start, process created to model and data loaded, seconds (wall clock)."""
    load_cpu_s: float
    """The CPU time that start took, seconds (all its threads)."""
    standby_bytes: int
    """A loaded executor's resident memory, bytes."""
    available_bytes: int
    """The node's available memory now (``psutil.virtual_memory().available``), bytes."""
    restart_s: float
    """Ray Train's start of a worker process, created to its train function called, seconds (the supervisor's own)."""
    idle_cpu_share: float
    """CPU a waiting process takes (CPU seconds per second: a process blocked in ``ray.get``, measured)."""
    mtbf_s: float
    """Mean time between failures of a worker, seconds (``snapshot.mtbf_s``: ``--mtbf``)."""
    cores: float
    """The node's cores: the standby's CPU seconds are spread over them (``psutil.cpu_count()``)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"StandbyCosts.{f.name} must be finite and >= 0, got {value!r}")
        for name in ("mtbf_s", "cores"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StandbyCosts.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class StandbyDecision:
    """Keep a standby loaded (``keep``) or not, and why in one line (``reason``), with the figures compared:
    ``saved_s`` and ``cost_s`` per failure (seconds)."""

    keep: bool
    reason: str
    saved_s: float
    cost_s: float


def standby_decision(c: StandbyCosts) -> StandbyDecision:
    """Whether a warm standby pays for ``c`` (the module docstring's comparison), the reason in one line."""
    saved = c.load_s + c.restart_s
    cost = (c.load_cpu_s + c.idle_cpu_share * c.mtbf_s) / c.cores
    held = f"{c.standby_bytes / GIB:.2f} GiB"
    if c.available_bytes < MEMORY_HEADROOM * c.standby_bytes:
        return StandbyDecision(False, f"warm standby off: it would hold {held} and the node has {c.available_bytes / GIB:.2f} GiB "
                                      f"available (needs {MEMORY_HEADROOM:g}x)", saved, cost)
    compared = (f"per failure (one per MTBF {c.mtbf_s:g} s) it saves {saved:.1f} s of cold start and costs {cost:.2f} s of "
                f"the node's {c.cores:g} cores (load {c.load_cpu_s:.1f} CPU-s, waiting {c.idle_cpu_share:.3f} CPU/s), and holds {held}")
    return StandbyDecision(saved > cost, f"warm standby {'on' if saved > cost else 'off'}: {compared}", saved, cost)
