"""Snapshot interval policies: pure decisions over step counts.

For now a fixed interval; the cost-model policy (Young/Daly and the shadow-replay model) will
produce the interval that this class applies.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class FixedInterval:
    """Snapshot every ``every_steps`` steps (0 disables snapshots: log-only recovery)."""

    every_steps: int

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"every_steps must be >= 0, got {self.every_steps}")

    def due(self, step: int, last_snapshot_step: int) -> bool:
        """True when the state after ``step`` steps should be snapshotted."""
        return self.every_steps > 0 and step > last_snapshot_step and step % self.every_steps == 0
