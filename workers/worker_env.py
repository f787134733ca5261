"""What every Ray Train worker sets up first, whatever the algorithm, and the averages across workers."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import ray.train
import torch
import torch.distributed as dist

from raycheck.actors.journal import RunChannel
from raycheck.job.config import JobConfig
from raycheck.training.assets import ASSETS_KEY, fetch, shipped_model, splits
from raycheck.training.data import CausalLMEncoder, PromptEncoder, Split, make_encoder
from raycheck.training.model import load_model, load_tokenizer, trainable_parameters
from raycheck.training.node import this_node


@dataclass(frozen=True)
class WorkerEnv:
    """One worker's configuration, place in the job, channel to the run's journal and model: what
    ``workers.zo_session.ZerothOrder`` needs, for raycheck's task (``TaskEnv``) and for your own model
    (``workers.own_loop_zo``).

    ``stamps``: when (unix seconds, this node's clock) this worker's start reached each phase
    (``process_created_unix_s``, ``worker_start_unix_s``, ``imports_unix_s``, ``model_loaded_unix_s``,
    ``data_loaded_unix_s``: ``worker_env``); a restore's ``recovery`` event carries them, for the
    recovery breakdown (``orchestrator.summary.BREAKDOWN``). ``initial_weights()``: the model's initial
    parameters again (``trainable_parameters`` order, on the CPU), read anew from the node's model cache,
    for an in-process restart that finds no snapshot (``workers.recovery.restore``'s ``initial``).
    """

    cfg: JobConfig
    rank: int
    world: int
    run: RunChannel
    stamps: dict[str, float]
    model: torch.nn.Module
    initial_weights: Callable[[], "OrderedDict[str, torch.Tensor]"]
    stepped: threading.Event = field(default_factory=threading.Event)
    """Set after each step this worker completes (a promoted standby's supervisor waits for the first one,
    ``workers.standby``)."""


@dataclass(frozen=True, kw_only=True)
class TaskEnv(WorkerEnv):
    """A ``WorkerEnv`` of raycheck's own task: its tokenizer's encoder and the (train, held-out) splits."""

    encoder: PromptEncoder | CausalLMEncoder
    train: Split
    held_out: Split


def record_start(env: WorkerEnv, restored: dict | None, accuracy: Callable[[], float] | None = None,
                 promoted: dict[str, float] | None = None) -> int:
    """Record how this worker starts and return its first step: after a restore (``restored``, the
    restore's result), a ``recovery`` event at the restored step; on a fresh start, the held-out
    accuracy before training (when ``eval_samples``; ``accuracy``, when given, computes it on every
    rank, e.g. a sharded model's collective evaluation). Only rank 0 writes these events (with
    ``replica_groups`` every rank that restored writes its ``recovery``: a replaced worker restores
    alone; ``path`` ``new_process`` and the process id: ``workers.worker`` records ``in_process`` ones; with
    ``promoted``, the stamps of a warm standby's promotion (``workers.standby``), ``path`` ``standby`` with
    those stamps instead of the process start's); every rank records where it runs, its process id and the
    world size (a ``placement`` event, for the summary)."""
    env.run.event("placement", component="worker", rank=env.rank, world=env.world, pid=os.getpid(), **this_node())
    if restored is None:
        if env.cfg.eval_samples and isinstance(env, TaskEnv) and (env.rank == 0 or accuracy is not None):
            value = accuracy() if accuracy is not None else env.encoder.evaluate(env.model, env.held_out, env.cfg.eval_samples)
            if env.rank == 0:
                env.run.event("accuracy", when="before", value=value)
        return 0
    start = restored["base_step"] + restored["replayed_steps"]
    if env.rank == 0 or env.cfg.replica_groups:  # with replica groups a replaced worker restores alone
        path, stamps = ("new_process", env.stamps) if promoted is None else ("standby", promoted)
        env.run.event("recovery", rank=env.rank, at_step=start, restored_step=start, path=path, pid=os.getpid(), **stamps, **restored)
    return start


def worker_env(config: dict, place: tuple[int, int] | None = None) -> TaskEnv:
    """Parse ``config`` (``JobConfig.to_dict()`` plus the driver's shipped references under
    ``training.assets.ASSETS_KEY``), fix the torch thread count (reproducible forward passes across
    restarts), and load the model (initial weights), tokenizer and data: a model folder's files and a
    data file's splits from Ray's object store, never from the driver's paths. Each phase is stamped
    (``WorkerEnv.stamps``). ``place``: (rank, world size) of a process outside Ray Train's worker group
    (a step executor, ``workers.standby``); default: Ray Train's context."""
    stamps = {"process_created_unix_s": psutil.Process().create_time(), "worker_start_unix_s": time.time()}
    config = dict(config)
    shipped = config.pop(ASSETS_KEY, None)
    cfg = JobConfig.from_dict(config)
    torch.set_num_threads(cfg.torch_threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (load_model's and load_tokenizer's imports, timed on their own)

    stamps["imports_unix_s"] = time.time()
    files = shipped_model(shipped, cfg.model)
    model = load_model(cfg.model, cfg.cache_dir, files, cfg.dtype)
    stamps["model_loaded_unix_s"] = time.time()
    train, held_out = splits(fetch(shipped, "data"))
    encoder = make_encoder(cfg, load_tokenizer(cfg.cache_dir, files))
    stamps["data_loaded_unix_s"] = time.time()
    if place is None:
        ctx = ray.train.get_context()
        place = ctx.get_world_rank(), ctx.get_world_size()
    return TaskEnv(cfg=cfg, rank=place[0], world=place[1], run=RunChannel(cfg), stamps=stamps,
                     model=model, encoder=encoder, train=train, held_out=held_out,
                     initial_weights=lambda: trainable_parameters(load_model(cfg.model, cfg.cache_dir, files, cfg.dtype)))


def sum_over_workers(t: torch.Tensor, world: int) -> torch.Tensor:
    """``t`` (a CPU tensor) summed over the ``world`` workers by one torch.distributed all-reduce, in
    place (identity for one worker)."""
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def mean_over_workers(values: list[float], world: int) -> list[float]:
    """The mean of each value over the ``world`` workers (one float64 all-reduce; identity for one)."""
    if world == 1:
        return values
    return (sum_over_workers(torch.tensor(values, dtype=torch.float64), world) / world).tolist()
