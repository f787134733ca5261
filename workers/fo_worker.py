"""What each Ray Train worker runs for ``algo == "fo"``: AdamW steps, checkpoints by strategy, restore.

Per step t (rank r of W workers, DDP over gloo when W > 1; every worker holds the same state):
  batch t's shard r  ->  forward + backward (gradients averaged by DDP)  ->  [injected failure]  ->
  clip + AdamW  ->  average the loss over the workers (metrics)  ->  rank 0's checkpointer.

Strategies (rank 0 persists; ``job.stores.checkpoint_store(cfg)`` holds every checkpoint):
  ``full-sync`` / ``full-async``: ``training.checkpointing.FullCheckpointer`` every ``snapshot_every``.
  ``layerwise``: ``training.layerwise.LayerwiseCheckpointer`` every ``snapshot_every`` (LayerCheck).
  ``differential``: ``training.differential.DiffCheckpointer`` (LowDiff): gradient records every
  step, a full checkpoint every ``differential.full_every_steps``.
  ``overlapped``: ``training.overlapped.OverlappedCheckpointer`` (GoCkpt) every ``snapshot_every``:
  staged in ``overlapped.chunks`` chunks over as many steps, caught up to one consistent step.

``fo.parallelism`` fsdp2 (``training.sharded``): the state is sharded over the workers (FSDP2); every
rank runs the checkpointer (any strategy, each writing its rows through torch DCP), the
restore (resharded to this world size), the state hashes (re-gathered) and the evaluation.

Checkpoints go through ``workers.own_loop.FirstOrderCheckpoints`` (``run_checkpoints``), the API a user's
own loop calls, FSDP2 included (its sharded checkpoints in ``storage.dcp_store.ShardedStore``).

A preemption notice (Ray Train's ``get_preemption_info``, asked after every step by every rank in
``FirstOrderCheckpoints.after_step``): the checkpointer saves the state of the
steps done now (``Checkpointer.save_now``, a just-in-time checkpoint), and the workers wait for the
deadline, at which Ray Train restarts them on the nodes left; they restore that checkpoint and redo no
step (``workers.preempt.save_before_deadline``).

Restore at start (after a failure, or when the storage already holds a checkpoint, e.g. a merged
one): the newest committed checkpoint (``workers.recovery.from_storage``; for ``differential``
followed by the replay of the committed records after it). Steps after the durable point are
recomputed with the same batches, so exact strategies rejoin the failure-free trajectory bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from raycheck.job.config import JobConfig
from raycheck.job.stores import checkpoint_store, diff_store
from raycheck.storage.snapshots import NoSnapshotError
from raycheck.training.optim_state import StateMismatchError
from raycheck.policies.strategies import RunStrategy
from raycheck.training import sharded as sharded_fo
from raycheck.training.data import PromptEncoder, batch_indices
from raycheck.training.fo import FOHyper, FOTrainer
from raycheck.training.state import state_sha256
from raycheck.workers.faults import FaultInjector
from raycheck.workers.own_loop import FirstOrderCheckpoints
from raycheck.workers.worker_env import TaskEnv, mean_over_workers, record_start, worker_env

RECOVERY_FIELDS = ("source", "base_step", "replayed_steps", "load_seconds", "replay_seconds", "seconds", "skipped",
                   "restore_began_unix_s", "state_loaded_unix_s", "exact")
"""What a ``recovery`` event takes of ``FirstOrderCheckpoints.restored`` (``exact``: ``differential`` only)."""


def run_checkpoints(cfg: JobConfig, trainer: FOTrainer, events: Callable[[str, dict[str, Any]], None]) -> FirstOrderCheckpoints:
    """The run's checkpoints through the public API a user's own loop calls (``workers.own_loop``): the
    run's snapshot store (its identity, retention and writer epoch; FSDP2: its sharded store), ``cfg``'s
    strategy and settings, Ray Train reports of its committed snapshots (in a Ray Train worker:
    ``workers.train_reports``), preemption notices acted on (``events``: the run's journal), and ``reproducible_init`` (every worker
    loads the same initial weights)."""
    return FirstOrderCheckpoints(trainer.model, trainer.optimizer, checkpoint_store(cfg), strategy=cfg.strategy,
                                 every_steps=cfg.snapshot.every_steps, layerwise=cfg.layerwise, differential=cfg.differential,
                                 overlapped=cfg.overlapped, preemption=True, events=events,
                                 reproducible_init=True)


def durable_steps(cfg: JobConfig) -> int:
    """Steps durable in storage now: the newest committed checkpoint's (FSDP2: sharded), extended by the
    committed gradient records after it for ``differential`` (FSDP2: as far as every rank's reach, at the
    run's worker count)."""
    store = checkpoint_store(cfg)
    base = max((i.step for i in store.list()), default=0)
    if cfg.strategy != RunStrategy.DIFFERENTIAL:
        return base
    if cfg.fo.parallelism == "fsdp2":
        return min(diff_store(cfg, r).durable_end(base) for r in range(cfg.workers))
    return diff_store(cfg).durable_end(base)


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point for ``algo == "fo"``; ``config`` is ``JobConfig.to_dict()`` (a run that keeps a
    warm standby runs ``fo_loop`` in a step executor instead, ``workers.standby``)."""
    fo_loop(worker_env(config))


def fo_loop(env: TaskEnv, promoted: dict[str, float] | None = None) -> None:
    """A first-order worker from its start (``env``: its configuration, place, model and data) to the run's
    last step: restore when the run is resuming, then steps until ``cfg.steps``, then the ``final`` event
    (rank 0). ``promoted``: a warm standby's promotion stamps (``workers.standby``), recorded in its
    ``recovery`` event."""
    cfg, rank, world, run = env.cfg, env.rank, env.world, env.run
    model, encoder, train, held_out = env.model, env.encoder, env.train, env.held_out
    if not isinstance(encoder, PromptEncoder):  # JobConfig refuses task causal-lm with algo fo
        raise ValueError(f"algo fo trains a classification task (a PromptEncoder), got a {type(encoder).__name__}")
    hyper = FOHyper(lr=cfg.fo.lr, weight_decay=cfg.weight_decay, max_grad_norm=cfg.fo.max_grad_norm)
    sharded = cfg.fo.parallelism == "fsdp2"  # every rank checkpoints its rows, restores, hashes and evaluates
    if sharded:
        sharded_fo.ensure_process_group()
    trainer = FOTrainer(model, hyper, encoder, distributed=world > 1, sharded=sharded)
    def record(kind: str, fields: dict[str, Any]) -> None:  # rank 0's preemption events, in the run's journal
        run.event(kind, **fields)

    own = run_checkpoints(cfg, trainer, record)
    faults = FaultInjector(cfg, run, rank, world, durable_steps=lambda: durable_steps(cfg), flush=own.flush)

    result = None
    if promoted is not None or faults.fired() or durable_steps(cfg) > 0:
        try:
            own.restore()
        except (NoSnapshotError, StateMismatchError) as exc:  # every restart would meet it again: the run fails at once
            if rank == 0:
                run.event("code_error", rank=rank, step=None, error=f"{type(exc).__name__}: {exc}")
            raise
        result = {k: own.restored[k] for k in RECOVERY_FIELDS if k in own.restored}
        if sharded:  # what the ranks loaded, re-gathered (a collective)
            result.update(saved_world_size=own.restored.get("saved_world_size"),
                          restored_state_sha256=state_sha256(sharded_fo.full_state(trainer.state_view())))
    accuracy = (lambda: sharded_fo.evaluate(trainer, encoder, held_out, cfg.eval_samples)) if sharded else None
    start = record_start(env, result, accuracy, promoted=promoted)

    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        idx = batch_indices(cfg.seed, step, cfg.batch_size, len(train))
        loss = trainer.compute_gradients(train, idx[rank::world])
        faults.maybe_fail(step)
        trainer.apply_gradients()
        [loss] = mean_over_workers([loss], world)
        step_s = time.perf_counter() - t0
        block_s = own.after_step(step + 1, {"loss": loss})
        hashed = cfg.hash_every_steps and (step + 1) % cfg.hash_every_steps == 0 and (rank == 0 or sharded)
        digest = state_sha256(sharded_fo.full_state(trainer.state_view())) if hashed else None  # weights + optimizer
        if rank == 0:
            row = dict(step=step, loss=loss, step_seconds=step_s, checkpoint_block_seconds=block_s, log_append_seconds=0.0,
                       checkpoint_bytes=own.checkpointer.bytes if own.checkpointer is not None else 0)  # committed so far (fsdp2: rank 0's files)
            run.metric(**row, **({"state_sha256": digest} if digest else {}))
        env.stepped.set()

    if rank == 0 or sharded:
        final = {"step": cfg.steps, "state_sha256": state_sha256(sharded_fo.full_state(trainer.state_view()))}
        if cfg.eval_samples:
            final["accuracy_after"] = accuracy() if accuracy is not None else encoder.evaluate(model, held_out, cfg.eval_samples)
        final["checkpoints"] = own.close()  # a collective under fsdp2
        if rank == 0:
            run.event("final", **final)
    else:
        own.close()
