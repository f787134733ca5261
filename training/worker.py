"""What each Ray Train worker runs: MeZO steps with a durable step log, restoring after failures.

Per step t (rank r of W workers; every worker holds identical weights):
  z for every parameter from s_t  ->  +eps z, loss+ on the rank's shard of batch t  ->  -2 eps z,
  loss-  ->  +eps z  ->  average loss+ and loss- over the workers (one all-reduce of two float64s)
  ->  g_t  ->  rank 0 appends the step record durably  ->  every worker applies the update.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from storage.steplog import StepLogWriter, StepRecord, read_records
from training.checkpointing import FullCheckpointer
from training.data import accuracy, batch_id, batch_indices, classification_loss
from training.faults import FaultInjector
from training.model import trainable_parameters
from training.recovery import restore
from training.state import state_sha256
from training.worker_env import mean_over_workers, record_start, worker_env
from training.zo import ZOHyper, noise, perturb_all_, step_seed, update_all_


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point; ``config`` is ``JobConfig.to_dict()``."""
    env = worker_env(config)
    cfg, rank, world, run = env.cfg, env.rank, env.world, env.run
    model, encoder, train, held_out = env.model, env.encoder, env.train, env.held_out
    params = trainable_parameters(model)
    hyper = ZOHyper(lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.uses_step_log:
        faults = FaultInjector(cfg, run, rank, world)
        writer = StepLogWriter.open(run.step_log) if rank == 0 else None  # cuts a torn tail
        if writer is not None and writer.cut_bytes:
            run.event("torn_tail_cut", bytes=writer.cut_bytes, step=writer.next_step)
        _barrier(world)
        log_end = len(read_records(run.step_log))
        checkpointer = None
        resuming = faults.fired() or log_end > 0
    else:  # full-state baselines: progress is durable at the newest committed checkpoint only
        writer, log_end = None, None
        checkpointer = FullCheckpointer(cfg.snapshot_store(), cfg.snapshot_every, cfg.strategy == "full-async",
                                        {"trajectory_sha256": cfg.trajectory_sha256()}) if rank == 0 else None
        faults = FaultInjector(cfg, run, rank, world, durable_steps=lambda: max((i.step for i in cfg.snapshot_store().list()), default=0),
                               flush=checkpointer.flush if checkpointer is not None else None)
        resuming = faults.fired() or faults.durable_steps() > 0

    start = record_start(env, restore(params, cfg, run.step_log, log_end) if resuming else None)

    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        seed = step_seed(cfg.seed, step)
        idx = batch_indices(cfg.seed, step, cfg.batch_size, len(train))
        shard = idx[rank::world]
        zs = [noise(seed, i, p) for i, p in enumerate(params.values())]
        perturb_all_(params, zs, cfg.eps)
        loss_plus = classification_loss(model, encoder, train, shard)
        faults.maybe_fail(step, writer)
        perturb_all_(params, zs, -2 * cfg.eps)
        loss_minus = classification_loss(model, encoder, train, shard)
        perturb_all_(params, zs, cfg.eps)
        loss_plus, loss_minus = mean_over_workers([loss_plus, loss_minus], world)
        grad = (loss_plus - loss_minus) / (2 * cfg.eps)
        record = StepRecord(
            step=step, seed=seed, projected_grad=grad, loss_plus=loss_plus, loss_minus=loss_minus,
            lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay, batch_id=batch_id(idx),
        )
        append_s = 0.0
        if writer is not None:
            t_append = time.perf_counter()
            writer.append(record)  # durable before the update and before the next step
            append_s = time.perf_counter() - t_append
        update_all_(params, zs, grad, hyper)
        del zs
        step_s = time.perf_counter() - t0 - append_s
        block_s = checkpointer.after_step(step + 1, lambda: params) if checkpointer is not None else append_s
        if rank == 0:
            row = dict(step=step, loss=(loss_plus + loss_minus) / 2, loss_plus=loss_plus, loss_minus=loss_minus,
                       projected_grad=grad, step_seconds=step_s, log_append_seconds=append_s,
                       checkpoint_block_seconds=block_s, checkpoint_due=checkpointer is not None and checkpointer.schedule.last_step == step + 1)
            if cfg.hash_every and (step + 1) % cfg.hash_every == 0:
                row["state_sha256"] = state_sha256(params)  # the state after step + 1 steps
            run.append(run.metrics, **row)

    if rank == 0:
        final = {"step": cfg.steps, "state_sha256": state_sha256(params)}
        if cfg.eval_samples:
            final["accuracy_after"] = accuracy(model, encoder, held_out, cfg.eval_samples)
        if checkpointer is not None:
            final["checkpoints"] = checkpointer.close()
        run.event("final", **final)
        if writer is not None:
            writer.close()
