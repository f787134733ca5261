"""A ZO worker's steps from its start to the run's last step, for raycheck's own task and for your own
loop: ``ZerothOrder`` (the session) and ``mezo_step_`` (one step over any model and batch).

Per step t (rank r of W workers; every worker holds identical weights):
  z for every parameter from s_t  ->  +eps z, loss+ of the rank's example groups of batch t  ->  -2 eps z,
  loss-  ->  +eps z  ->  the groups' terms of every worker (one float64 all-reduce, or the step exchange
  of replica groups), reduced in group order (``training.groups``)
  ->  g_t  ->  rank 0 appends the step record durably to its node-local log and sends it to the log
  keeper (``JobConfig.durability`` ``node``, ``cluster``: acknowledged before going on; ``workers.rank0_log``)
  ->  every worker applies the update. Every worker reads the log's length from the keeper, never a
  file of another node.

What a step scores is a ``StepBatch``: raycheck's own task deals a batch of examples into groups
(``workers.worker``); your own loop's batch is one group per rank, its loss your ``loss_fn``'s
(``workers.own_loop_zo``). Both run through ``ZerothOrder``: one code path.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
import torch
import torch.distributed as dist

from raycheck.actors.log_keeper import RemoteKeeper
from raycheck.actors.step_exchange import RemoteExchange
from raycheck.job.names import exchange_name, log_keeper_name
from raycheck.job.stores import snapshot_store
from raycheck.policies.strategies import RunStrategy
from raycheck.storage.steplog import StepLogWriter, StepRecord, read_record
from raycheck.training.checkpointing import FullCheckpointer
from raycheck.training.groups import Exchange, Terms, group_vector, reduce_groups
from raycheck.training.in_process import StepFailure, decide
from raycheck.training.model import trainable_parameters
from raycheck.training.state import state_sha256
from raycheck.training.zo import ZOHyper, perturb_all_, reset_and_update_all_, step_seed
from raycheck.workers.faults import FaultInjector
from raycheck.workers.preempt import NodeDrainWatch
from raycheck.workers.rank0_log import KeeperSender, KeeperUnreachableError, local_log_path, open_local_log, replicated_append
from raycheck.workers.recovery import restore
from raycheck.workers.train_reports import last_report, train_reports
from raycheck.workers.worker_env import WorkerEnv, record_start, sum_over_workers

if TYPE_CHECKING:
    from raycheck.actors.journal import RunChannel
    from raycheck.job.config import JobConfig


@dataclass(frozen=True)
class StepBatch:
    """What one rank scores in one step.

    Attributes:
        groups: G, the example groups of the step's whole batch (over every rank).
        mine: the groups this rank scores (``training.groups.groups_of_rank``).
        score: ``score(g) -> (numerator, weight)``: group g's loss terms under the current weights (one
            forward pass; ``training.groups.Terms``).
        identity: the batch's 63-bit identity, recorded in the step log (``StepRecord.batch_id``).
    """

    groups: int
    mine: Sequence[int]
    score: Callable[[int], Terms]
    identity: int


class CodeError(ValueError):
    """Your loop's code broke a rule of the session (the message names which): re-executing the step, in this
    process or a new one, would meet it again, so the run fails at once (a ``code_error`` event: the
    controller ends the run, ``orchestrator.control.step``). Nothing of the step was logged or applied: the
    last logged state stays the run's."""


class BatchMismatchError(CodeError):
    """``batch_of(step)`` gave another batch after a restart than the one the step log recorded for that step."""


def barrier_of(exchange: RemoteExchange | None, world: int) -> Callable[[str], None]:
    """``barrier(name)``, meeting every rank: the step exchange's with replica groups, else
    ``torch.distributed.barrier`` (nothing with one worker)."""
    if exchange is not None:
        return exchange.barrier
    return lambda _name: dist.barrier() if world > 1 else None


class ZerothOrder:
    """MeZO training of one worker (rank ``env.rank``), from its start to the run's last step: the step log
    (rank 0 appends, at the run's durability), the restore after a failure (the shadow's image, or a
    snapshot plus the log tail), failure injection, in-process restarts, metric rows and the ``final``
    event. The run's shadow, log keeper, persister and controller run around it (``orchestrator``).

        zo = ZerothOrder(env, batch_of)      # restores when the run is resuming
        for step in zo.steps():              # from the restored step to cfg.steps
            zo.step()                        # step ``step``; rolled back in process after an exception
        zo.close()

    Args:
        env: the worker's configuration, place, run channel and model (``workers.worker_env.WorkerEnv``).
        batch_of: ``batch_of(step) -> StepBatch`` for this rank; deterministic in ``step`` (a restart
            re-executes steps after the restored one).
        promoted: a warm standby's promotion stamps (``workers.standby``), recorded in its ``recovery`` event.

    Raises:
        BatchMismatchError: (rank 0, at a restore) ``batch_of`` gives another batch for the newest logged
            step than the one logged: re-executed steps would not be the logged trajectory's.
        Whatever the restore raises (``workers.recovery.restore``).
    """

    def __init__(self, env: WorkerEnv, batch_of: Callable[[int], StepBatch], promoted: dict[str, float] | None = None) -> None:
        cfg, rank, world = env.cfg, env.rank, env.world
        self.env, self.cfg, self.batch_of = env, cfg, batch_of
        self.hyper = ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay)
        self.exchange = RemoteExchange(exchange_name(cfg), cfg.namespace, rank, cfg.faults.recovery_timeout_s) if cfg.replica_groups else None
        barrier = barrier_of(self.exchange, world)
        self.writer: StepLogWriter | None = None
        self.sender: KeeperSender | None = None
        self.checkpointer: FullCheckpointer | None = None
        self.log_end: int | None = None
        if cfg.uses_step_log:
            self.keeper = RemoteKeeper(log_keeper_name(cfg), cfg.namespace)
            self.faults = FaultInjector(cfg, env.run, rank, world, durable_steps=self.keeper.end, barrier=barrier)
            self.writer = open_rank0_log(cfg, self.keeper, env.run) if rank == 0 else None
            barrier("log-opened")  # rank 0's log equals the keeper's before anyone reads its length
            self.log_end = self.keeper.end()
            self.sender = KeeperSender(self.keeper, self.log_end, wait=cfg.durability != "process") if self.writer is not None else None
            resuming = promoted is not None or self.faults.fired() or self.log_end > 0
        else:  # full-state baselines: progress is durable at the newest committed checkpoint only
            self.checkpointer = FullCheckpointer(snapshot_store(cfg), cfg.snapshot.every_steps, cfg.strategy == RunStrategy.FULL_ASYNC,
                                                 {"trajectory_sha256": cfg.trajectory_sha256()}) if rank == 0 else None
            self.faults = FaultInjector(cfg, env.run, rank, world, durable_steps=lambda: max((i.step for i in snapshot_store(cfg).list()), default=0),
                                        flush=self.checkpointer.flush if self.checkpointer is not None else None)
            resuming = promoted is not None or self.faults.fired() or self.faults.durable_steps() > 0
        params = trainable_parameters(env.model)  # on the CPU until the restore is done
        restored = restore(params, cfg, self._local_log(), self.log_end) if resuming else None
        self.params = trainable_parameters(env.model.to(worker_device(cfg.device)))
        self.next_step = record_start(env, restored, promoted=promoted)
        if restored is not None:
            try:
                self._check_batch_of()
            except CodeError as exc:
                self._code_error(exc, self.next_step)
                raise
        self.commit = self._commit()
        self.drain = NodeDrainWatch(ray.get_runtime_context().get_node_id()) if self.writer is not None else None
        self.restarts = 0  # in-process restarts of this process
        self.reports = train_reports(cfg, rank)

    def _local_log(self) -> str | None:
        return str(local_log_path(self.cfg)) if self.writer is not None else None

    def _commit(self) -> Callable[[StepRecord], float]:
        return replicated_append(self.writer, self.sender) if self.writer is not None and self.sender is not None else timed_append(None)

    def _check_batch_of(self) -> None:
        """Rank 0: ``batch_of`` of the newest logged step must give the batch that step logged."""
        if self.writer is None or not self.next_step:
            return
        logged = read_record(local_log_path(self.cfg), self.next_step - 1)
        again = self.batch_of(logged.step).identity
        if again != logged.batch_id:
            raise BatchMismatchError(f"batch_of({logged.step}) is not deterministic: it gave batch {again:016x} after the restart, "
                                     f"the step log recorded {logged.batch_id:016x}; a re-executed step would train on other data")

    def steps(self) -> Iterator[int]:
        """The steps still to execute, each yielded before ``step`` executes it (a step rolled back in
        process is yielded again)."""
        while self.next_step < self.cfg.steps:
            yield self.next_step

    def step(self) -> StepRecord | None:
        """Execute step ``next_step`` (``mezo_step_``), log it and record its metric row (rank 0). After an
        exception with the process alive (``training.in_process.decide``), roll back to the freshest
        complete state and return None (``next_step`` is then the restored step); else re-raise."""
        cfg, env, step = self.cfg, self.env, self.next_step
        try:
            t0 = time.perf_counter()
            record, append_s = mezo_step_(self.params, self.batch_of(step), step, cfg, self.hyper,
                                          fail=lambda: self.faults.maybe_fail(step, self.writer), commit=self.commit,
                                          exchange=self.exchange, world=env.world)
            step_s = time.perf_counter() - t0 - append_s
            block_s = self.checkpointer.after_step(step + 1, lambda: on_cpu(self.params)) if self.checkpointer is not None else append_s
            if self.drain is not None and self.sender is not None and (deadline := self.drain.check()) is not None:
                acknowledged(self.sender, deadline, env.run)
            if env.rank == 0:
                row: dict[str, object] = dict(step=step, loss=(record.loss_plus + record.loss_minus) / 2, loss_plus=record.loss_plus,
                                              loss_minus=record.loss_minus, projected_grad=record.projected_grad, step_seconds=step_s,
                                              log_append_seconds=append_s, checkpoint_block_seconds=block_s,
                                              checkpoint_due=self.checkpointer is not None and self.checkpointer.schedule.last_step == step + 1)
                if cfg.hash_every_steps and (step + 1) % cfg.hash_every_steps == 0:
                    row["state_sha256"] = state_sha256(on_cpu(self.params))  # the state after step + 1 steps
                env.run.metric(**row)
            self.next_step = step + 1
            if self.reports is not None and self.reports.periodic and cfg.snapshot.every_steps and self.next_step % cfg.snapshot.every_steps == 0:
                self.reports.report(self.next_step, {"loss": (record.loss_plus + record.loss_minus) / 2})
            env.stepped.set()
            return record
        except Exception as exc:
            self._roll_back(exc, step)
            return None

    def _roll_back(self, exc: Exception, step: int) -> None:
        """An in-process restart after ``exc`` at ``step`` (``training.in_process``), or ``exc`` re-raised."""
        cfg, env = self.cfg, self.env
        detected_unix_s = time.time()
        if isinstance(exc, CodeError):
            self._code_error(exc, step)
            raise exc
        decision = decide(StepFailure(world=env.world, error=type(exc), restarts_done=self.restarts,
                                      max_restarts=cfg.faults.max_in_process_restarts))
        env.run.event("in_process_restart" if decision.restart else "in_process_refused", rank=env.rank, step=step,
                      error=f"{type(exc).__name__}: {exc}"[:300], reason=decision.reason)
        if not decision.restart:
            raise exc
        self.restarts += 1
        if self.writer is not None and self.sender is not None:  # made equal to the keeper's, as a replacement's is
            self.writer, self.sender = reopen_rank0_log(cfg, self.keeper, env.run, self.writer, self.sender)
            self.log_end = self.keeper.end()
        elif self.checkpointer is not None:
            self.checkpointer.flush()  # a background write commits before the restore looks for the newest checkpoint
        restored = restore(trainable_parameters(env.model.to("cpu")), cfg, self._local_log(), self.log_end, initial=env.initial_weights)
        self.params = trainable_parameters(env.model.to(worker_device(cfg.device)))
        self.next_step = restored["base_step"] + restored["replayed_steps"]
        if self.checkpointer is not None:
            self.checkpointer.schedule.taken(self.next_step)  # the interval counts from the restore, as in a replacement worker
        self.commit = self._commit()
        env.run.event("recovery", rank=env.rank, at_step=self.next_step, restored_step=self.next_step, path="in_process",
                      pid=os.getpid(), detected_unix_s=detected_unix_s, **restored)

    def _code_error(self, exc: CodeError, step: int) -> None:
        """Record ``exc`` as a ``code_error`` event (the controller fails the run on it)."""
        self.env.run.event("code_error", rank=self.env.rank, step=step, error=f"{type(exc).__name__}: {exc}")

    def close(self, **final: Any) -> None:
        """After the last step: rank 0 records the ``final`` event (the run's last step, the state's sha256,
        ``final``'s fields, the full-state checkpointer's statistics) once the log keeper holds every step;
        then every rank reports to Ray Train once more (``train_reports``)."""
        if self.env.rank != 0:
            if self.reports is not None:
                last_report(self.cfg, self.reports, self.env.run)
            return
        event = {"step": self.cfg.steps, "state_sha256": state_sha256(on_cpu(self.params)),
                 "cpu_capability": torch.backends.cpu.get_cpu_capability(), **final}
        if self.checkpointer is not None:
            event["checkpoints"] = self.checkpointer.close()
        if self.writer is not None and self.sender is not None:
            self.sender.close()  # the keeper holds every step before the run counts as done
            self.writer.close()
        if self.reports is not None:
            last_report(self.cfg, self.reports, self.env.run)
        self.env.run.event("final", **event)


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
    """A ``commit`` for ``mezo_step_``: appends the record durably to ``writer`` (rank 0; None on the
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



def mezo_step_(params: Mapping[str, torch.Tensor], batch: StepBatch, step: int, cfg: JobConfig, hyper: ZOHyper,
               fail: Callable[[], None], commit: Callable[[StepRecord], float], exchange: Exchange | None = None,
               world: int = 1) -> tuple[StepRecord, float]:
    """Execute MeZO step ``step`` on ``params`` (in place; the tensors the batch's ``score`` runs through, on
    their device). Source: Malladi et al. 2023, Algorithm 1 (``training.zo``).

    Perturbs every parameter by +eps z, scores this rank's groups of ``batch`` (``StepBatch.score``),
    calls ``fail()`` (failure injection), perturbs by -2 eps z, scores them again, sums the groups' terms
    over the ``world`` workers (``exchange(step, vector)``; default: one torch.distributed all-reduce) and
    reduces them in group order (``training.groups``), then calls ``commit(record)`` (the durability point:
    the step log append), then resets (+eps z) and updates in one pass. Each of the three passes
    regenerates z from the step seed (``zo.perturb_all_``, ``zo.reset_and_update_all_``), as MeZO does: no
    z is held for the model. ``cfg``: the ``JobConfig`` (seed, eps). Returns the step's record and what
    ``commit`` returned (the seconds it blocked).
    """
    seed = step_seed(cfg.seed, step)
    perturb_all_(params, seed, cfg.zo.eps)
    plus = [batch.score(g) for g in batch.mine]
    fail()
    perturb_all_(params, seed, -2 * cfg.zo.eps)
    minus = [batch.score(g) for g in batch.mine]
    summed = (exchange or (lambda _, vec: sum_over_workers(vec, world)))(step, group_vector(batch.groups, batch.mine, plus, minus))
    loss_plus, loss_minus = reduce_groups(summed)
    grad = (loss_plus - loss_minus) / (2 * cfg.zo.eps)
    record = StepRecord(
        step=step, seed=seed, projected_grad=grad, loss_plus=loss_plus, loss_minus=loss_minus,
        lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay, batch_id=batch.identity,
    )
    committed_s = commit(record)
    reset_and_update_all_(params, seed, grad, hyper)
    return record, committed_s
