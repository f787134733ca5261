"""Seeded random failure schedules: Poisson (exponential inter-arrival) or Weibull arrivals, in steps.

A schedule is a tuple of ``FailureSpec`` drawn once before the run from ``numpy``'s PCG64 generator
seeded with ``seed``, so the same arguments give the same failures on every machine. Weibull arrivals
with shape k < 1 model infant mortality (failures cluster early), k > 1 wear-out; k = 1 is Poisson.
The Weibull scale is set so that the mean inter-arrival equals ``mtbf_steps``
(mean = scale * Gamma(1 + 1/k)).
"""

from __future__ import annotations

import math

import numpy as np

from raycheck.job.config import FailureSpec

KINDS = ("poisson", "weibull")


def failure_schedule(kind: str, mtbf_steps: float, steps: int, seed: int, target: str = "worker",
                     how: str = "exit", shape: float = 1.0) -> tuple[FailureSpec, ...]:
    """Failures at the steps where arrivals fall in [0, ``steps``), one per step at most.

    Args:
        kind: ``poisson`` or ``weibull``.
        mtbf_steps: mean steps between failures (> 0).
        steps: run length in steps.
        seed: generator seed.
        target, how: as in ``FailureSpec``.
        shape: Weibull shape k (> 0); ignored for Poisson.

    Raises:
        ValueError: an unknown kind, or a non-positive ``mtbf_steps`` or ``shape``.
    """
    if kind not in KINDS:
        raise ValueError(f"failure schedule {kind!r}: choose one of {', '.join(KINDS)}")
    if not mtbf_steps > 0 or not shape > 0:
        raise ValueError(f"need mtbf_steps > 0 and shape > 0, got {mtbf_steps!r} and {shape!r}")
    rng = np.random.default_rng(seed)
    at = 0.0
    out: list[FailureSpec] = []
    while True:
        if kind == "poisson":
            at += rng.exponential(mtbf_steps)
        else:
            at += mtbf_steps / math.gamma(1 + 1 / shape) * rng.weibull(shape)
        if at >= steps:
            return tuple(out)
        step = int(at)
        if not out or out[-1].step != step:
            out.append(FailureSpec(step=step, target=target, how=how))


def parse_schedule(text: str, steps: int, seed: int) -> tuple[FailureSpec, ...]:
    """Parse ``poisson:MTBF_STEPS[:TARGET]`` or ``weibull:MTBF_STEPS:SHAPE[:TARGET]``.

    Raises:
        ValueError: a malformed spec; the message shows the expected form.
    """
    parts = text.split(":")
    try:
        if parts[0] == "poisson" and len(parts) in (2, 3):
            return failure_schedule("poisson", float(parts[1]), steps, seed, target=parts[2] if len(parts) == 3 else "worker")
        if parts[0] == "weibull" and len(parts) in (3, 4):
            return failure_schedule("weibull", float(parts[1]), steps, seed, target=parts[3] if len(parts) == 4 else "worker",
                                    shape=float(parts[2]))
    except ValueError as exc:
        raise ValueError(f"bad failure schedule {text!r}: {exc}") from exc
    raise ValueError(f"bad failure schedule {text!r}: expected poisson:MTBF_STEPS[:TARGET] or "
                     f"weibull:MTBF_STEPS:SHAPE[:TARGET], e.g. poisson:8 or weibull:8:0.7:both")
