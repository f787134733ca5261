"""What each Ray Train worker of ``raycheck run`` runs for ZO: raycheck's own task (prompt classification or
causal LM over a text column, ``training.data``) through the same session your own loop uses
(``workers.zo_session.ZerothOrder``): a step's batch is dealt into example groups, group g scored by rank
g % world (``training.groups``), so the trajectory does not depend on the worker count."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from raycheck.training.data import batch_id, batch_indices
from raycheck.training.groups import example_groups, groups_of_rank
from raycheck.workers.worker_env import TaskEnv, worker_env
from raycheck.workers.zo_session import StepBatch, ZerothOrder

if TYPE_CHECKING:
    from raycheck.job.config import JobConfig
    from raycheck.training.data import CausalLMEncoder, PromptEncoder, Split


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point; ``config`` is ``JobConfig.to_dict()`` (a run that can keep a warm standby has
    ``workers.standby``'s entry point, which runs ``zo_loop`` in a step executor)."""
    zo_loop(worker_env(config))


def zo_loop(env: TaskEnv, promoted: dict[str, float] | None = None) -> None:
    """A ZO worker from its start (``env``: its configuration, place, model and data) to the run's last
    step (``ZerothOrder``), then the ``final`` event (rank 0) with the held-out accuracy after training
    (when ``eval_samples``). ``promoted``: a warm standby's promotion stamps (``workers.standby``)."""
    cfg = env.cfg
    zo = ZerothOrder(env, lambda step: task_batch(env.model, env.encoder, env.train, cfg, step, env.rank, env.world), promoted)
    for _ in zo.steps():
        zo.step()
    final = {"accuracy_after": env.encoder.evaluate(env.model, env.held_out, cfg.eval_samples)} if cfg.eval_samples and env.rank == 0 else {}
    zo.close(**final)


def task_batch(model: torch.nn.Module, encoder: PromptEncoder | CausalLMEncoder, train: Split, cfg: JobConfig, step: int,
               rank: int, world: int) -> StepBatch:
    """Step ``step``'s batch of raycheck's task for rank ``rank`` of ``world``: ``batch_size`` indices of
    ``train`` drawn from the run seed and step (``training.data.batch_indices``), dealt into groups of
    ``example_group_size`` (``training.groups.example_groups``), each scored by ``encoder.loss_terms``."""
    idx = batch_indices(cfg.seed, step, cfg.batch_size, len(train))
    groups = example_groups(idx, cfg.example_group_size)
    return StepBatch(groups=len(groups), mine=groups_of_rank(len(groups), rank, world),
                     score=lambda g: encoder.loss_terms(model, train, groups[g]), identity=batch_id(idx))

