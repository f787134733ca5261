"""Warm standby per rank: a worker process that dies is replaced by one already started and loaded.

Where a run can keep one (``JobConfig.standby_refusal`` is None: ZO with one worker or with replica groups,
first-order with one worker; ``faults.warm_standby`` not False), each Ray Train worker's train function
(``train_loop_per_worker`` here) is a thin supervisor. The training runs in a step executor
(``StepExecutor``, a Ray actor on the supervisor's node), a second one started beside it where one is likely
kept (``likely_kept``: both load together, so a standby is ready when training starts). An executor's
constructor loads what a worker holds
(``workers.worker_env.worker_env``: imports, model with its initial weights, tokenizer, data), runs one
forward pass of the rank's first batch (the kernels, allocator and caches warmed, no state changed) and
its ``run`` is the worker's loop (``workers.worker.zo_loop``, ``workers.fo_worker.fo_loop``) at the
supervisor's rank and world size. Once the first executor is loaded, the supervisor measures its cold
start, its CPU time and resident memory, its own idle CPU and the node's available memory, and asks the
policy (``policies.standby.standby_decision``; ``faults.warm_standby`` True forces it on) whether the second
executor is kept loaded and waiting (started now if it was not yet), or stopped: a ``standby_decision``
event, the reason in one line.

When the active executor's process dies (its ``run`` call raises Ray's ``ActorDiedError``: ``os._exit``,
SIGKILL, the OOM killer), the supervisor promotes the standby: its ``run`` restores the freshest complete
state through the one restore entry point (``workers.recovery.restore``: the live shadow's image through
the object store, else the newest snapshot plus the log tail; first-order: the newest checkpoint), rank 0
reopens its node-local step log (the same node, so the same file, made equal to the log keeper's) and it
goes on; with replica groups the other ranks wait at the step exchange meanwhile, as they do for a
replaced worker. A new standby starts loading in the background. Ray Train never sees the failure. The
``recovery`` event has ``path`` ``standby`` and the stamps of ``orchestrator.summary.STANDBY_BREAKDOWN``.
Without a standby (the policy said no) a dead executor goes to Ray Train, which restarts the worker.

On CUDA the standby holds the model on the CPU (built, loaded and warmed there, with the CUDA context
created on the supervisor's GPU): it adds no second copy of the weights to the GPU's memory; the promoted
executor moves them to the GPU after the restore (``zo_loop``), a host-to-device copy of the weights.

What is not covered: an executor that raises (its process alive, past ``faults.max_in_process_restarts``)
and a failure of the supervisor's process or node go to Ray Train as before (the executors are owned by
the supervisor and die with it). Each promotion claims the run-wide journal marker ``standby.N`` and is
allowed only within ``faults.max_worker_failures`` (``policies.budgets.within_budget``); past it the
supervisor raises, so Ray Train replaces the group under the same budget and the run ends.

Source: the warm standby (hot spare) of high-availability systems: a replica started and loaded before it
is needed, promoted when the primary fails, so a failover pays no cold start.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import psutil
import ray
import ray.train
import torch
from ray.exceptions import ActorDiedError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycheck.actors.journal import RunChannel
from raycheck.job.config import WORKER_TARGETS, JobConfig
from raycheck.policies.budgets import within_budget
from raycheck.policies.standby import StandbyCosts, StandbyDecision, failure_interval, standby_decision
from raycheck.training.assets import ASSETS_KEY
from raycheck.training.data import batch_indices
from raycheck.training.groups import example_groups, groups_of_rank
from raycheck.training.model import trainable_parameters
from raycheck.training.zo import ZOHyper, perturb_all_, reset_and_update_all_, step_seed
from raycheck.workers.train_reports import last_report, train_reports
from raycheck.workers.worker_env import TaskEnv, worker_env

E = TypeVar("E")


class StandbyBudgetSpentError(RuntimeError):
    """The step executor died once more than ``faults.max_worker_failures`` allows."""


class NoStandbyError(RuntimeError):
    """The step executor died and no standby was kept (``standby_decision`` said no): Ray Train restarts the worker."""


def warm_up(env: TaskEnv) -> float:
    """Two forward passes of one of this rank's example groups of the first batch, gradients off, and for ZO
    a step's three noise passes on a stand-in of 256 zeros per parameter (same names and dtypes): torch's
    kernels, the noise kernels, allocator and caches are set up before the executor is needed, and no state
    changes (first-order: forward only, no backward, so no ``.grad`` is created). Returns the seconds of a
    forward pass over the rank's share of a batch, estimated from the second pass (a warm one: the first pays
    the one-time costs) times the rank's groups."""
    cfg = env.cfg
    idx = batch_indices(cfg.seed, 0, cfg.batch_size, len(env.train))
    groups = example_groups(idx, cfg.example_group_size)
    mine = groups_of_rank(len(groups), env.rank, env.world)
    group = groups[mine[0]]
    with torch.no_grad():
        env.encoder.loss_terms(env.model, env.train, group)
        t0 = time.perf_counter()
        env.encoder.loss_terms(env.model, env.train, group)
        forward_s = time.perf_counter() - t0
    if cfg.algo == "zo":
        stand_in = OrderedDict((name, torch.zeros(256, dtype=p.dtype)) for name, p in trainable_parameters(env.model).items())
        seed, hyper = step_seed(cfg.seed, 0), ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay)
        perturb_all_(stand_in, seed, cfg.zo.eps)
        perturb_all_(stand_in, seed, -2 * cfg.zo.eps)
        reset_and_update_all_(stand_in, seed, 0.0, hyper)
    return forward_s * len(mine)


class StepExecutor:
    """One worker (rank ``place[0]`` of ``place[1]``) whose start is paid before it is needed: built, it
    holds the ``TaskEnv`` (``config``: ``JobConfig.to_dict()`` plus the shipped assets), warmed
    (``warm_up``); ``run`` trains. ``visible_devices``: the supervisor's ``CUDA_VISIBLE_DEVICES`` (its GPU),
    set before CUDA starts (Ray sets an actor's accelerator variables at its start only). A plain class;
    ``start_executor`` runs it in a Ray actor."""

    def __init__(self, config: dict, place: tuple[int, int], visible_devices: str | None = None) -> None:
        if visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        self.env = worker_env(config, place=place)
        forward_s = warm_up(self.env)
        if self.env.cfg.device == "cuda":
            torch.cuda.init()  # the CUDA context, without a byte of the model on the GPU
        me = psutil.Process()
        cpu = me.cpu_times()
        self.costs = {"load_s": time.time() - self.env.stamps["process_created_unix_s"], "load_cpu_s": cpu.user + cpu.system,
                      "standby_bytes": me.memory_info().rss, "forward_s": forward_s}
        self.loaded_unix_s = time.time()

    def measured(self) -> dict[str, float]:
        """This executor's cold start: ``load_s`` (process created to loaded and warmed, seconds),
        ``load_cpu_s`` (its CPU seconds), ``standby_bytes`` (its resident memory when loaded, bytes) and
        ``forward_s`` (a warm forward pass over the rank's share of a batch, seconds, ``warm_up``)."""
        return self.costs

    def first_step(self) -> None:
        """Return once ``run`` has done a step (``WorkerEnv.stepped``)."""
        self.env.stepped.wait()

    def run(self, detected_unix_s: float | None) -> None:
        """Train to the run's last step (``zo_loop`` or ``fo_loop``): the rank's first executor
        (``detected_unix_s`` None) or a promoted standby, the active one's death detected at ``detected_unix_s``
        (unix seconds); its ``recovery`` event carries that, ``promoted_unix_s`` (now: this call began) and
        ``standby_loaded_unix_s`` (when this executor was loaded and warmed: after the death, if it was still loading)."""
        promoted = None if detected_unix_s is None else {"detected_unix_s": detected_unix_s, "promoted_unix_s": time.time(),
                                                         "standby_loaded_unix_s": self.loaded_unix_s}
        if self.env.cfg.algo == "fo":
            from raycheck.workers.fo_worker import fo_loop

            fo_loop(self.env, promoted)
        else:
            from raycheck.workers.worker import zo_loop

            zo_loop(self.env, promoted)


def supervise(start: Callable[[], E], stop: Callable[[E], None], run_on: Callable[[E, float | None, Callable[[], None]], None],
              keep_standby: Callable[[E], bool], promotion_allowed: Callable[[], bool], record: Callable[..., None],
              early: bool = True) -> int:
    """Run the training in an executor (``start()`` returns one, loading in the background;
    ``run_on(executor, detected_unix_s, stepped)`` waits for its ``StepExecutor.run``, calling ``stepped()``
    once a promoted executor has done its first step) with a standby where ``keep_standby(active)`` says so
    (asked once, before training): started beside the active one at once when ``early`` (both load together;
    stopped, ``stop(standby)``, if not kept), else only once kept. Whenever the active one's process
    dies (``ActorDiedError``), record a ``standby_promoted`` event (``record(kind, **fields)``) and, if there is
    a standby and ``promotion_allowed()``, run the standby instead, and start a new one after its first step
    (a standby loading beside the restore and first step would slow both). Returns the promotions done.

    Raises:
        StandbyBudgetSpentError: a death past the budget (``promotion_allowed()`` False).
        NoStandbyError: a death with no standby kept.
        Any other error of ``run_on`` (an executor that raised: Ray Train restarts the worker group).
    """
    active = start()
    spare = start() if early else None
    standby: E | None = None
    if keep_standby(active):
        standby = spare if spare is not None else start()
    elif spare is not None:
        stop(spare)
    detected_unix_s: float | None = None
    promotions = 0

    def replace() -> None:
        nonlocal standby
        standby = start()

    while True:
        try:
            run_on(active, detected_unix_s, replace)
            return promotions
        except ActorDiedError as exc:
            detected_unix_s = time.time()
            allowed = standby is not None and promotion_allowed()
            record("standby_promoted", promoted=allowed, promotions=promotions + int(allowed), supervisor_pid=os.getpid(),
                   error=f"{type(exc).__name__}: {exc}"[:300], detected_unix_s=detected_unix_s, kept=standby is not None)
            if standby is None:
                raise NoStandbyError("the step executor died and no standby was kept: Ray Train restarts the worker") from exc
            if not allowed:
                raise StandbyBudgetSpentError("the step executor died again past faults.max_worker_failures: "
                                              "Ray Train restarts the worker group") from exc
            active, standby = standby, None  # the next one starts after its first step (``replace``)
            promotions += 1


def claim_promotion(run: RunChannel, max_failures: int) -> bool:
    """Claim the next run-wide promotion marker ``standby.N`` in the run's journal (the first N not yet
    claimed, by any supervisor of the run) and return whether it is ``within_budget(N, max_failures)``."""
    n = 0
    while not run.claim(f"standby.{n}"):
        n += 1
    return within_budget(n, max_failures)


ExecutorActor = ray.remote(num_cpus=0, max_restarts=0)(StepExecutor)
"""``StepExecutor`` as a Ray actor: no CPU of its own (it computes in the CPU the supervisor holds; the
supervisor only waits) and no Ray restart (the supervisor promotes its standby instead); ``start_executor``
gives it two threads (``run``, and ``first_step`` waiting beside it)."""


def run_on(executor, detected_unix_s: float | None, stepped: Callable[[], None]) -> None:
    """``supervise``'s ``run_on`` for an ``ExecutorActor``: its ``run``, and for a promoted one (``detected_unix_s``
    given) ``stepped()`` once its first step is done (or it died: the error is ``run``'s to raise)."""
    done = executor.run.remote(detected_unix_s)
    if detected_unix_s is not None:
        ray.wait([done, executor.first_step.remote()], num_returns=1)
        stepped()
    ray.get(done)


def start_executor(config: dict, place: tuple[int, int], visible_devices: str | None):
    """An ``ExecutorActor`` on this process's node (so the same node-local step log), loading in the background."""
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return ExecutorActor.options(scheduling_strategy=here, max_concurrency=2).remote(config, place, visible_devices)


def measured_decision(cfg: JobConfig, executor, restart_s: float) -> StandbyDecision:
    """``standby_decision`` for this rank from measurements: ``executor``'s cold start and warm-up forward pass
    (``StepExecutor.measured``, waited for), this supervisor's own start (``restart_s``: Ray Train's part of a
    restart, seconds) and its CPU share while it waited (a process blocked in ``ray.get``, as a waiting standby
    is), the node's available memory; the failure interval from ``--mtbf`` and the run's injected worker
    failures (a ZO step is about two forward passes over the rank's share of the batch, a first-order one three)."""
    wall, cpu = time.monotonic(), time.process_time()
    load = ray.get(executor.measured.remote())
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    step_s = load["forward_s"] * (3 if cfg.algo == "fo" else 2)
    return standby_decision(StandbyCosts(
        load_s=load["load_s"], load_cpu_s=load["load_cpu_s"], restart_s=restart_s, standby_bytes=int(load["standby_bytes"]),
        available_bytes=psutil.virtual_memory().available, idle_cpu_share=cpu / max(wall, 1e-3),
        failure_interval_s=failure_interval(cfg.snapshot.mtbf_s, cfg.steps, injected_worker_failures(cfg), step_s), training_cores=cfg.workers * cfg.torch_threads))


def injected_worker_failures(cfg: JobConfig) -> int:
    """The run's injected failures that kill a worker's process (``WORKER_TARGETS``)."""
    return sum(f.target in WORKER_TARGETS for f in cfg.faults.failures)


def likely_kept(cfg: JobConfig) -> bool:
    """Whether a standby is started beside the first executor at once, before the measured decision: where it is
    forced, or the run injects worker failures (its failures come sooner than ``--mtbf``, so the standby is
    likely kept and should be ready early); a run without them pays no standby's load unless the decision keeps one."""
    return bool(cfg.faults.warm_standby) or injected_worker_failures(cfg) > 0


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point of a supervised worker (``config``: ``JobConfig.to_dict()`` plus the shipped
    assets): supervise the step executors (``supervise``), then stop the standby left over."""
    restart_s = time.time() - psutil.Process().create_time()  # Ray Train's start of this process, to this call
    cfg = JobConfig.from_dict({k: v for k, v in config.items() if k != ASSETS_KEY})
    ctx = ray.train.get_context()
    place = ctx.get_world_rank(), ctx.get_world_size()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if cfg.device == "cuda" else None
    run = RunChannel(cfg)
    started: list = []

    def start():
        started.append(start_executor(config, place, visible))
        return started[-1]

    def keep(active) -> bool:
        if cfg.faults.warm_standby:
            run.event("standby_decision", rank=place[0], keep=True, reason="warm standby on: --warm-standby")
            return True
        decision = measured_decision(cfg, active, restart_s)
        run.event("standby_decision", rank=place[0], keep=decision.keep, reason=decision.reason,
                  saved_core_s=decision.saved_core_s, cost_core_s=decision.cost_core_s)
        return decision.keep

    run.event("standby_supervisor", rank=place[0], pid=os.getpid())
    reports = train_reports(cfg, place[0])  # the executors are not Ray Train workers: the supervisor reports
    try:
        with reports.following() if reports is not None and reports.periodic else contextlib.nullcontext():  # one rank only
            supervise(start, lambda executor: ray.kill(executor, no_restart=True), run_on, keep,
                      lambda: claim_promotion(run, cfg.faults.max_worker_failures), run.event, early=likely_kept(cfg))
        if reports is not None:
            last_report(cfg, reports, run)
    finally:
        for executor in started:
            ray.kill(executor, no_restart=True)
