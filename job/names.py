"""The names of a run's Ray actors, derived from its run id (in ``JobConfig.namespace``): one place for
every actor name, so the actors, the workers that look them up and the cleanup that finds them agree."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no runtime import: the journal actor's process imports no torch (``job.config`` does)
    from raycheck.job.config import JobConfig


def shadow_name(cfg: JobConfig) -> str:
    """The prefix of the run's shadow actors' names (``<shadow_name>-<n>``; sharded ``<shadow_name>-s<shard>-<n>``,
    ``orchestrator.shadow_keeper``)."""
    return f"raycheck-shadow-{cfg.run_id}"


def persister_name(cfg: JobConfig) -> str:
    """The run's snapshot persister actor."""
    return f"raycheck-persister-{cfg.run_id}"


def journal_name(cfg: JobConfig | str) -> str:
    """The run's journal actor (``actors.journal``); ``cfg``: the run's configuration or its run id."""
    return f"raycheck-journal-{cfg if isinstance(cfg, str) else cfg.run_id}"


TRAINER_PREFIX = "raycheck-"
"""The run's Ray Train experiment name is this prefix and its run id (``orchestrator.trainer``)."""


def log_keeper_name(cfg: JobConfig) -> str:
    """The run's step log keeper actor (``actors.log_keeper``)."""
    return f"raycheck-log-keeper-{cfg.run_id}"


def exchange_name(cfg: JobConfig) -> str:
    """The step exchange of this driver incarnation's fit (``actors.step_exchange``; with ``JobConfig.replica_groups``)."""
    return f"raycheck-exchange-{cfg.run_id}-{cfg.writer_epoch}"
