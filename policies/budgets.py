"""Restart budgets: how many times a failed component may be replaced (pure)."""

from __future__ import annotations


def within_budget(used: int, max_restarts: int) -> bool:
    """Whether one more restart is allowed after ``used`` of ``max_restarts`` (-1: unlimited)."""
    return max_restarts < 0 or used < max_restarts
