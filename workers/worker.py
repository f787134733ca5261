"""What each Ray Train worker runs: MeZO steps with a durable step log, restoring after failures.

Per step t (rank r of W workers; every worker holds identical weights):
  z for every parameter from s_t  ->  +eps z, loss+ of the rank's example groups of batch t  ->  -2 eps z,
  loss-  ->  +eps z  ->  the groups' terms of every worker (one float64 all-reduce), reduced in group
  order (``training.groups``: the losses do not depend on the worker count)
  ->  g_t  ->  rank 0 appends the step record durably to its node-local log and sends it to the log
  keeper (``JobConfig.durability`` ``node``, ``cluster``: acknowledged before going on; ``workers.rank0_log``)
  ->  every worker applies the update. Every worker reads the log's length from the keeper, never a
  file of another node.

With ``device="cuda"`` the model, z (``training.noise.gaussian_torch``) and the perturbation and update
arithmetic run on the worker's GPU; the step log, restores, hashes and checkpoints stay on the CPU, so
the CPU shadow replays the same floats (``training.zo`` lists the ops; both devices round each one the
same way).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import ray
import torch
import torch.distributed as dist

from raycheck.job.names import exchange_name, log_keeper_name
from raycheck.job.stores import snapshot_store
from raycheck.actors.log_keeper import RemoteKeeper
from raycheck.actors.step_exchange import RemoteExchange
from raycheck.policies.strategies import RunStrategy
from raycheck.storage.steplog import StepLogWriter, StepRecord
from raycheck.training.checkpointing import FullCheckpointer
from raycheck.training.data import batch_id, batch_indices
from raycheck.workers.faults import FaultInjector
from raycheck.training.groups import Exchange, example_groups, group_vector, groups_of_rank, reduce_groups
from raycheck.training.model import trainable_parameters
from raycheck.training.in_process import StepFailure, decide
from raycheck.workers.rank0_log import KeeperSender, KeeperUnreachableError, local_log_path, open_local_log, replicated_append
from raycheck.workers.preempt import NodeDrainWatch
from raycheck.workers.recovery import restore
from raycheck.training.state import state_sha256
from raycheck.workers.worker_env import WorkerEnv, record_start, sum_over_workers, worker_env
from raycheck.training.zo import ZOHyper, perturb_all_, reset_and_update_all_, step_seed

if TYPE_CHECKING:
    from raycheck.actors.journal import RunChannel
    from raycheck.job.config import JobConfig
    from raycheck.training.data import CausalLMEncoder, PromptEncoder, Split


def barrier_of(exchange: RemoteExchange | None, world: int) -> Callable[[str], None]:
    """``barrier(name)``, meeting every rank: the step exchange's with replica groups, else
    ``torch.distributed.barrier`` (nothing with one worker)."""
    if exchange is not None:
        return exchange.barrier
    return lambda _name: dist.barrier() if world > 1 else None


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point; ``config`` is ``JobConfig.to_dict()`` (a run that can keep a warm standby has
    ``workers.standby``'s entry point, which runs ``zo_loop`` in a step executor)."""
    zo_loop(worker_env(config))


def zo_loop(env: WorkerEnv, promoted: dict[str, float] | None = None) -> None:
    """A ZO worker from its start (``env``: its configuration, place, model and data) to the run's last
    step: restore when the run is resuming, then steps until ``cfg.steps`` (rolled back in process after
    an exception, ``training.in_process``), then the ``final`` event (rank 0). ``promoted``: a warm
    standby's promotion stamps (``workers.standby``), recorded in its ``recovery`` event."""
    cfg, rank, world, run = env.cfg, env.rank, env.world, env.run
    model, encoder, train, held_out = env.model, env.encoder, env.train, env.held_out
    params = trainable_parameters(model)  # on the CPU until the restore is done
    hyper = ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay)
    exchange = RemoteExchange(exchange_name(cfg), cfg.namespace, rank, cfg.faults.recovery_timeout_s) if cfg.replica_groups else None
    barrier = barrier_of(exchange, world)
    if cfg.uses_step_log:
        keeper = RemoteKeeper(log_keeper_name(cfg), cfg.namespace)
        faults = FaultInjector(cfg, run, rank, world, durable_steps=keeper.end, barrier=barrier)
        writer = open_rank0_log(cfg, keeper, run) if rank == 0 else None
        barrier("log-opened")  # rank 0's log equals the keeper's before anyone reads its length
        log_end = keeper.end()
        sender = KeeperSender(keeper, log_end, wait=cfg.durability != "process") if writer is not None else None
        checkpointer = None
        resuming = promoted is not None or faults.fired() or log_end > 0
    else:  # full-state baselines: progress is durable at the newest committed checkpoint only
        writer, sender, log_end = None, None, None
        checkpointer = FullCheckpointer(snapshot_store(cfg), cfg.snapshot.every_steps, cfg.strategy == RunStrategy.FULL_ASYNC,
                                        {"trajectory_sha256": cfg.trajectory_sha256()}) if rank == 0 else None
        faults = FaultInjector(cfg, run, rank, world, durable_steps=lambda: max((i.step for i in snapshot_store(cfg).list()), default=0),
                               flush=checkpointer.flush if checkpointer is not None else None)
        resuming = promoted is not None or faults.fired() or faults.durable_steps() > 0

    restored = restore(params, cfg, local_log_path(cfg) if writer is not None else None, log_end) if resuming else None
    params = trainable_parameters(model.to(worker_device(cfg.device)))
    step = record_start(env, restored, promoted=promoted)

    commit = replicated_append(writer, sender) if writer is not None and sender is not None else timed_append(None)
    drain = NodeDrainWatch(ray.get_runtime_context().get_node_id()) if writer is not None else None
    restarts = 0  # in-process restarts of this process
    while step < cfg.steps:
        try:
            t0 = time.perf_counter()
            record, append_s = zo_step_(params, model, encoder, train, cfg, step, rank, world, hyper,
                                        fail=lambda: faults.maybe_fail(step, writer), commit=commit, exchange=exchange)
            step_s = time.perf_counter() - t0 - append_s
            block_s = checkpointer.after_step(step + 1, lambda: on_cpu(params)) if checkpointer is not None else append_s
            if drain is not None and sender is not None and (deadline := drain.check()) is not None:
                acknowledged(sender, deadline, run)
            if rank == 0:
                loss_plus, loss_minus = record.loss_plus, record.loss_minus
                row: dict[str, object] = dict(step=step, loss=(loss_plus + loss_minus) / 2, loss_plus=loss_plus, loss_minus=loss_minus,
                                              projected_grad=record.projected_grad, step_seconds=step_s, log_append_seconds=append_s,
                                              checkpoint_block_seconds=block_s, checkpoint_due=checkpointer is not None and checkpointer.schedule.last_step == step + 1)
                if cfg.hash_every_steps and (step + 1) % cfg.hash_every_steps == 0:
                    row["state_sha256"] = state_sha256(on_cpu(params))  # the state after step + 1 steps
                run.metric(**row)
            step += 1
            env.stepped.set()
        except Exception as exc:
            detected_unix_s = time.time()
            decision = decide(StepFailure(world=world, error=type(exc), restarts_done=restarts, max_restarts=cfg.faults.max_in_process_restarts))
            run.event("in_process_restart" if decision.restart else "in_process_refused", rank=rank, step=step,
                      error=f"{type(exc).__name__}: {exc}"[:300], reason=decision.reason)
            if not decision.restart:
                raise
            restarts += 1
            if writer is not None and sender is not None:  # made equal to the keeper's, as a replacement's is
                writer, sender = reopen_rank0_log(cfg, keeper, run, writer, sender)
                log_end = keeper.end()
            elif checkpointer is not None:
                checkpointer.flush()  # a background write commits before the restore looks for the newest checkpoint
            restored = restore(trainable_parameters(model.to("cpu")), cfg, local_log_path(cfg) if writer is not None else None,
                               log_end, initial=env.initial_weights)
            params = trainable_parameters(model.to(worker_device(cfg.device)))
            step = restored["base_step"] + restored["replayed_steps"]
            if checkpointer is not None:
                checkpointer.schedule.taken(step)  # the interval counts from the restore, as in a replacement worker
            commit = replicated_append(writer, sender) if writer is not None and sender is not None else timed_append(None)
            run.event("recovery", rank=rank, at_step=step, restored_step=step, path="in_process", pid=os.getpid(),
                      detected_unix_s=detected_unix_s, **restored)

    if rank == 0:
        final = {"step": cfg.steps, "state_sha256": state_sha256(on_cpu(params)),
                 "cpu_capability": torch.backends.cpu.get_cpu_capability()}
        if cfg.eval_samples:
            final["accuracy_after"] = encoder.evaluate(model, held_out, cfg.eval_samples)
        if checkpointer is not None:
            final["checkpoints"] = checkpointer.close()
        if writer is not None and sender is not None:
            sender.close()  # the keeper holds every step before the run counts as done
            writer.close()
        run.event("final", **final)


def acknowledged(sender: KeeperSender, deadline_unix_s: float, run: RunChannel) -> None:
    """Rank 0's node is being drained (a preemption notice, ``workers.preempt.NodeDrainWatch``): wait until the
    log keeper holds every record of its node-local log (at durability ``process`` they may still be queued;
    at ``node`` and ``cluster`` each already was before its step went on) and record a ``preemption_saved``
    event. Training goes on: every later step is acknowledged as it is logged (or, at ``process``, until the
    node goes; a restarted rank 0 sends what its node-local log kept)."""
    t0 = time.time()
    held = sender.flush()
    run.event("preemption_saved", component="step_log", step=held, notice_seen_unix_s=t0,
              deadline_unix_s=None if deadline_unix_s == float("inf") else deadline_unix_s, seconds=time.time() - t0,
              node_id=ray.get_runtime_context().get_node_id())


def open_rank0_log(cfg: JobConfig, keeper: RemoteKeeper, run: RunChannel) -> StepLogWriter:
    """Rank 0's node-local step log (``local_log_path``), made equal to the keeper's
    (``workers.rank0_log.open_local_log``); records how in a ``step_log`` event (this node, the
    keeper's, the steps rebuilt from or sent to the keeper) and a cut torn tail in ``torn_tail_cut``."""
    opened = open_local_log(local_log_path(cfg), keeper)
    if opened.writer.cut_bytes:
        run.event("torn_tail_cut", bytes=opened.writer.cut_bytes, step=opened.local_steps)
    run.event("step_log", durability=cfg.durability, node_id=ray.get_runtime_context().get_node_id(),
              local_steps=opened.local_steps, rebuilt_steps=opened.rebuilt_steps, sent_steps=opened.sent_steps,
              discarded=opened.discarded)
    return opened.writer


def reopen_rank0_log(cfg: JobConfig, keeper: RemoteKeeper, run: RunChannel, writer: StepLogWriter,
                     sender: KeeperSender) -> tuple[StepLogWriter, KeeperSender]:
    """An in-process restart's rank 0 log (``training.in_process``): stop ``sender`` (a send that failed for
    good leaves its records in the local log, which the reopening sends again), close ``writer`` and open
    the local log anew (``open_rank0_log``: a torn tail cut, the keeper made equal to it), with a new
    sender from the keeper's end. Returns (writer, sender)."""
    with contextlib.suppress(KeeperUnreachableError):
        sender.close()
    writer.close()
    writer = open_rank0_log(cfg, keeper, run)
    return writer, KeeperSender(keeper, keeper.end(), wait=cfg.durability != "process")


def worker_device(device: str) -> torch.device:
    """The torch device of this worker for ``JobConfig.device`` (``cpu`` or ``cuda``: the GPU Ray Train
    assigned; in a step executor, the one GPU its supervisor shows it). On CUDA, deterministic algorithms are required (cuBLAS with a fixed workspace), so a
    step re-executed after a failure computes the same losses as the first time."""
    if device == "cpu":
        return torch.device("cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, below
    torch.use_deterministic_algorithms(True)
    import ray.train.torch

    try:
        return ray.train.torch.get_device()
    except RuntimeError:  # not a Ray Train worker: a step executor (workers.standby), shown its supervisor's GPU only
        return torch.device("cuda", 0)


def timed_append(writer: StepLogWriter | None) -> Callable[[StepRecord], float]:
    """A ``commit`` for ``zo_step_``: appends the record durably to ``writer`` (rank 0; None on the
    other ranks: nothing) and returns the seconds the append blocked."""
    def commit(record: StepRecord) -> float:
        if writer is None:
            return 0.0
        t0 = time.perf_counter()
        writer.append(record)
        return time.perf_counter() - t0

    return commit


def on_cpu(params: Mapping[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
    """``params`` with every tensor on the CPU (CPU tensors as they are, no copy): for hashing and checkpoints."""
    return OrderedDict((n, t.cpu()) for n, t in params.items())


def zo_step_(
    params: Mapping[str, torch.Tensor], model: torch.nn.Module, encoder: PromptEncoder | CausalLMEncoder, train: Split, cfg: JobConfig, step: int, rank: int, world: int,
    hyper: ZOHyper, fail: Callable[[], None], commit: Callable[[StepRecord], float], exchange: Exchange | None = None,
) -> tuple[StepRecord, float]:
    """Execute MeZO step ``step`` on ``params`` (in place; the tensors of ``model``, on its device).

    Perturbs every parameter by +eps z, scores this rank's example groups of the step's batch
    (``training.groups``; ``train``, a ``training.data.Split``; ``encoder`` a ``PromptEncoder`` or
    ``CausalLMEncoder``), calls ``fail()`` (failure injection), perturbs by -2 eps z, scores them again,
    sums the groups' terms over the ``world`` workers (``exchange(step, vector)``; default: one
    torch.distributed all-reduce) and reduces them in group order, then calls ``commit(record)`` (the
    durability point: the step log append), then resets (+eps z) and updates in one pass. Each of the
    three passes regenerates z from the step seed (``zo.perturb_all_``, ``zo.reset_and_update_all_``), as
    MeZO does: no z is held for the model. ``cfg`` is the ``JobConfig``. Returns the step's record and
    what ``commit`` returned (the seconds it blocked).
    """
    seed = step_seed(cfg.seed, step)
    idx = batch_indices(cfg.seed, step, cfg.batch_size, len(train))
    groups = example_groups(idx, cfg.example_group_size)
    mine = groups_of_rank(len(groups), rank, world)
    perturb_all_(params, seed, cfg.zo.eps)
    plus = [encoder.loss_terms(model, train, groups[g]) for g in mine]
    fail()
    perturb_all_(params, seed, -2 * cfg.zo.eps)
    minus = [encoder.loss_terms(model, train, groups[g]) for g in mine]
    summed = (exchange or (lambda _, vec: sum_over_workers(vec, world)))(step, group_vector(len(groups), mine, plus, minus))
    loss_plus, loss_minus = reduce_groups(summed)
    grad = (loss_plus - loss_minus) / (2 * cfg.zo.eps)
    record = StepRecord(
        step=step, seed=seed, projected_grad=grad, loss_plus=loss_plus, loss_minus=loss_minus,
        lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay, batch_id=batch_id(idx),
    )
    committed_s = commit(record)
    reset_and_update_all_(params, seed, grad, hyper)
    return record, committed_s
