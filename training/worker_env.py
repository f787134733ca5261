"""What every Ray Train worker sets up first, whatever the algorithm, and the averages across workers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import ray.train
import torch
import torch.distributed as dist

from orchestrator.cluster import this_node
from orchestrator.config import JobConfig
from orchestrator.journal import RunChannel
from training.assets import ASSETS_KEY, fetch, shipped_model, splits
from training.data import CausalLMEncoder, PromptEncoder, make_encoder
from training.model import load_model, load_tokenizer


@dataclass(frozen=True)
class WorkerEnv:
    """One worker's configuration, place in the job, channel to the run's journal, model and data.

    ``started_unix_s`` is when the worker process began its setup (recovery timings start there).
    """

    cfg: JobConfig
    rank: int
    world: int
    run: RunChannel
    started_unix_s: float
    model: torch.nn.Module
    encoder: PromptEncoder | CausalLMEncoder
    train: object
    held_out: object


def record_start(env: WorkerEnv, restored: dict | None, accuracy: Callable[[], float] | None = None) -> int:
    """Record how this worker starts and return its first step: after a restore (``restored``, the
    restore's result), a ``recovery`` event at the restored step; on a fresh start, the held-out
    accuracy before training (when ``eval_samples``; ``accuracy``, when given, computes it on every
    rank, e.g. a sharded model's collective evaluation). Only rank 0 writes these events; every rank
    records where it runs (a ``placement`` event, for the summary)."""
    env.run.event("placement", component="worker", rank=env.rank, **this_node())
    if restored is None:
        if env.cfg.eval_samples and (env.rank == 0 or accuracy is not None):
            value = accuracy() if accuracy is not None else env.encoder.evaluate(env.model, env.held_out, env.cfg.eval_samples)
            if env.rank == 0:
                env.run.event("accuracy", when="before", value=value)
        return 0
    start = restored["base_step"] + restored["replayed_steps"]
    if env.rank == 0:
        env.run.event("recovery", at_step=start, restored_step=start, worker_start_unix_s=env.started_unix_s, **restored)
    return start


def worker_env(config: dict) -> WorkerEnv:
    """Parse ``config`` (``JobConfig.to_dict()`` plus the driver's shipped references under
    ``training.assets.ASSETS_KEY``), fix the torch thread count (reproducible forward passes across
    restarts), and load the model (initial weights), tokenizer and data: a model folder's files and a
    data file's splits from Ray's object store, never from the driver's paths."""
    started = time.time()
    config = dict(config)
    shipped = config.pop(ASSETS_KEY, None)
    cfg = JobConfig.from_dict(config)
    torch.set_num_threads(cfg.torch_threads)
    ctx = ray.train.get_context()
    files = shipped_model(shipped, cfg.model)
    train, held_out = splits(fetch(shipped, "data"))
    return WorkerEnv(
        cfg=cfg, rank=ctx.get_world_rank(), world=ctx.get_world_size(), run=RunChannel(cfg),
        started_unix_s=started, model=load_model(cfg.model, cfg.cache_dir, files, cfg.dtype),
        encoder=make_encoder(cfg, load_tokenizer(cfg.cache_dir, files)), train=train, held_out=held_out,
    )


def mean_over_workers(values: list[float], world: int) -> list[float]:
    """The mean of each value over the ``world`` workers (one float64 all-reduce; identity for one)."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / world).tolist()
