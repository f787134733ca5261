"""What each Ray Train worker runs for ``algo == "fo"``: AdamW steps, checkpoints by strategy, restore.

Per step t (rank r of W workers, DDP over gloo when W > 1; every worker holds the same state):
  batch t's shard r  ->  forward + backward (gradients averaged by DDP)  ->  [injected failure]  ->
  clip + AdamW  ->  average the loss over the workers (metrics)  ->  rank 0's checkpointer.

Strategies (rank 0 persists; ``snapshot_store(cfg)`` holds every checkpoint):
  ``full-sync`` / ``full-async``: ``training.checkpointing.FullCheckpointer`` every ``snapshot_every``.
  ``layerwise``: ``training.layerwise.LayerwiseCheckpointer`` every ``snapshot_every`` (LayerCheck).
  ``differential``: ``training.differential.DiffCheckpointer`` (LowDiff): gradient records every
  step, a full checkpoint every ``differential.full_every_steps``.
  ``overlapped``: ``training.overlapped.OverlappedCheckpointer`` (GoCkpt) every ``snapshot_every``:
  staged in ``overlapped.chunks`` chunks over as many steps, caught up to one consistent step.

``fo.parallelism`` fsdp2 (``training.sharded``): the state is sharded over the workers (FSDP2); every
rank runs the checkpointer (full-sync / full-async, each writing its rows through torch DCP), the
restore (resharded to this world size), the state hashes (re-gathered) and the evaluation.

A preemption notice (Ray Train's ``get_preemption_info``, asked after every step by every rank): the
checkpointer saves the state of the steps done now (``Checkpointer.save_now``, a just-in-time checkpoint),
and the workers wait for the deadline, at which Ray Train restarts them on the nodes left; they restore
that checkpoint and redo no step (``workers.preempt.save_before_deadline``).

Restore at start (after a failure, or when the storage already holds a checkpoint, e.g. a merged
one): the newest committed checkpoint (``workers.recovery.from_storage``; for ``differential``
followed by the replay of the committed records after it). Steps after the durable point are
recomputed with the same batches, so exact strategies rejoin the failure-free trajectory bit for bit.
"""

from __future__ import annotations

import time

from raycheck.job.config import JobConfig
from raycheck.job.stores import diff_store, snapshot_store
from raycheck.policies.strategies import FULL_STATE, RunStrategy
from raycheck.storage.snapshots import SnapshotStore
from raycheck.training import sharded as sharded_fo
from raycheck.training.checkpointing import Checkpointer, FullCheckpointer
from raycheck.training.data import PromptEncoder, batch_indices
from raycheck.training.differential import DiffCheckpointer
from raycheck.workers.faults import FaultInjector
from raycheck.workers.preempt import PreemptionNotices, save_before_deadline
from raycheck.training.fo import FOHyper, FOTrainer
from raycheck.training.layerwise import LayerwiseCheckpointer
from raycheck.training.overlapped import OverlappedCheckpointer
from raycheck.workers.recovery import from_storage
from raycheck.training.state import state_sha256
from raycheck.workers.worker_env import TaskEnv, mean_over_workers, record_start, worker_env


def checkpointer(cfg: JobConfig, store: SnapshotStore, trainer: FOTrainer) -> Checkpointer:
    """Rank 0's checkpointer for ``cfg.strategy`` (unsharded state)."""
    config = {"trajectory_sha256": cfg.trajectory_sha256(), "strategy": cfg.strategy}
    if cfg.strategy in FULL_STATE:
        return FullCheckpointer(store, cfg.snapshot.every_steps, cfg.strategy == RunStrategy.FULL_ASYNC, config)
    if cfg.strategy == RunStrategy.OVERLAPPED:
        return OverlappedCheckpointer(store, cfg.snapshot.every_steps, cfg.overlapped.chunks, trainer.hyper, trainer.applied_gradients, config)
    if cfg.strategy == RunStrategy.LAYERWISE:
        return LayerwiseCheckpointer(store, cfg.snapshot.every_steps, cfg.layerwise, config)
    return DiffCheckpointer(store, diff_store(cfg), trainer.applied_gradients, cfg.differential.full_every_steps,
                            cfg.differential.batch_steps, cfg.differential.topk, config)


def durable_steps(cfg: JobConfig) -> int:
    """Steps durable in storage now: the newest committed checkpoint's, extended by the committed
    gradient records after it for ``differential``."""
    store = snapshot_store(cfg)
    base = max((i.step for i in store.list()), default=0)
    return diff_store(cfg).durable_end(base) if cfg.strategy == RunStrategy.DIFFERENTIAL else base


def restore_first_order(trainer: FOTrainer, cfg: JobConfig, store: SnapshotStore) -> dict:
    """Load the newest durable state into ``trainer`` (see the module docstring); returns the
    ``recovery`` event's fields: ``source``, ``base_step``, ``replayed_steps``, ``load_seconds``,
    ``replay_seconds``, ``seconds``, ``skipped`` (and ``exact`` for ``differential``)."""
    t0 = time.perf_counter()
    result = from_storage(trainer.state_view(), cfg, None, None)
    if cfg.strategy == RunStrategy.DIFFERENTIAL:
        t1 = time.perf_counter()
        replay = diff_store(cfg).replay(result["base_step"], trainer.replay_gradients)
        result.update(replayed_steps=replay.replayed_steps, replay_seconds=time.perf_counter() - t1, exact=replay.exact)
        if replay.stopped:
            result["skipped"] = [*result["skipped"], replay.stopped]
    result["seconds"] = time.perf_counter() - t0
    return result


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
    group = sharded_fo.checkpoint_group() if sharded else None
    trainer = FOTrainer(model, hyper, encoder, distributed=world > 1, sharded=sharded)
    store = snapshot_store(cfg)
    ckpt: Checkpointer | None = (sharded_fo.sharded_checkpointer(cfg, trainer, group) if group is not None
                                 else checkpointer(cfg, store, trainer) if rank == 0 else None)
    durable = (lambda: sharded_fo.durable_steps(cfg)) if sharded else (lambda: durable_steps(cfg))
    faults = FaultInjector(cfg, run, rank, world, durable_steps=durable, flush=ckpt.flush if ckpt else None)

    result = None
    if promoted is not None or faults.fired() or durable() > 0:
        result = sharded_fo.restore_sharded(trainer, cfg, group) if group is not None else restore_first_order(trainer, cfg, store)
        if isinstance(ckpt, LayerwiseCheckpointer) and result["source"] == "storage":
            ckpt.resume(next(i for i in reversed(store.list()) if i.step == result["base_step"]), trainer.state_view())
        if isinstance(ckpt, DiffCheckpointer):
            ckpt.resume(result["base_step"])  # the next full checkpoint bounds the chain this restore replayed
    accuracy = (lambda: sharded_fo.evaluate(trainer, encoder, held_out, cfg.eval_samples)) if sharded else None
    start = record_start(env, result, accuracy, promoted=promoted)
    notices = PreemptionNotices(env.rank)

    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        idx = batch_indices(cfg.seed, step, cfg.batch_size, len(train))
        loss = trainer.compute_gradients(train, idx[rank::world])
        faults.maybe_fail(step)
        trainer.apply_gradients()
        [loss] = mean_over_workers([loss], world)
        step_s = time.perf_counter() - t0
        block_s = ckpt.after_step(step + 1, trainer.state_view) if ckpt else 0.0
        if (notice := notices.poll()) is not None:  # every rank asks (a collective), every rank gets the same answer
            save_before_deadline(notice, ckpt, step + 1, trainer.state_view, run, rank)
        hashed = cfg.hash_every_steps and (step + 1) % cfg.hash_every_steps == 0 and (rank == 0 or sharded)
        digest = state_sha256(sharded_fo.full_state(trainer.state_view())) if hashed else None  # weights + optimizer
        if rank == 0:
            row = dict(step=step, loss=loss, step_seconds=step_s, checkpoint_block_seconds=block_s, log_append_seconds=0.0,
                       checkpoint_bytes=ckpt.bytes if ckpt is not None else 0)  # committed so far (fsdp2: rank 0's files)
            run.metric(**row, **({"state_sha256": digest} if digest else {}))
        env.stepped.set()

    if rank == 0 or sharded:
        final = {"step": cfg.steps, "state_sha256": state_sha256(sharded_fo.full_state(trainer.state_view()))}
        if cfg.eval_samples:
            final["accuracy_after"] = accuracy() if accuracy is not None else encoder.evaluate(model, held_out, cfg.eval_samples)
        if ckpt is not None:  # rank 0's, or every rank's under fsdp2
            final["checkpoints"] = ckpt.close()
        if rank == 0:
            run.event("final", **final)
