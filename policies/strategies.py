"""The names of the checkpointing strategies a run can use (``JobConfig.strategy``, ``raycheck run --strategy``).

One place for their spellings: the configuration (``job.config.STRATEGIES``: which strategies
each algorithm takes), the workers that pick a checkpointer by it and the cost model
(``policies.models.Strategy``, the strategies it has a closed form for) all name them from here. The
values are the strings that ``config.json`` files, summaries and metrics hold.
"""

from __future__ import annotations

from enum import StrEnum


class RunStrategy(StrEnum):
    """How a run makes its progress durable."""

    SHADOW = "shadow"
    """ZO: step log + a CPU shadow that replays it + snapshots of the shadow (ours)."""
    FULL_SYNC = "full-sync"
    """The worker blocks on a full-state save every ``snapshot_every`` steps."""
    FULL_ASYNC = "full-async"
    """The worker blocks on a staging copy; a background thread writes it (torch DCP ``async_save``, CheckFreq)."""
    LOG_ONLY = "log-only"
    """ZO: step log only; recovery replays it from the initial weights."""
    LAYERWISE = "layerwise"
    """First-order: only the units whose weights changed enough, or are too stale, are rewritten (LayerCheck)."""
    DIFFERENTIAL = "differential"
    """First-order: full checkpoints plus per-step gradient records between them (LowDiff)."""
    OVERLAPPED = "overlapped"
    """First-order: a snapshot is staged in chunks over consecutive steps (GoCkpt)."""


FULL_STATE = (RunStrategy.FULL_SYNC, RunStrategy.FULL_ASYNC)
"""The strategies that write the whole state at each checkpoint (the only ones for sharded state,
``JobConfig.fo.parallelism`` fsdp2)."""
STEP_LOG = (RunStrategy.SHADOW, RunStrategy.LOG_ONLY)
"""The strategies that append every step to a durable step log (ZO)."""
