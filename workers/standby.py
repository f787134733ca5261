"""Warm standby of a single ZO worker: a worker process that dies is replaced by one already started and loaded.

With ``faults.warm_standby`` (``JobConfig``: ZO, one worker, CPU) the Ray Train worker's train function
(``train_loop_per_worker`` here) is a thin supervisor. The training runs in a step executor
(``StepExecutor``, in a Ray actor on the supervisor's node): its constructor loads what a worker holds
(``workers.worker_env.worker_env``: imports, model with its initial weights, tokenizer, data) and its
``run`` is the worker's loop (``workers.worker.zo_loop``). A second executor is started beside it, loads
the same and waits. When the active executor's process dies (its ``run`` call raises Ray's
``ActorDiedError``: ``os._exit``, SIGKILL, the OOM killer), the supervisor promotes the standby: its
``run`` restores the freshest complete state through the one restore entry point
(``workers.recovery.restore``: the live shadow's image through the object store, else the newest
snapshot plus the log tail), opens rank 0's node-local step log (the same node, so the same file, made
equal to the log keeper's: ``workers.worker.open_rank0_log``) and goes on; a new standby starts loading
in the background. Ray Train never sees the failure. Its ``recovery`` event has ``path`` ``standby``
and the stamps of ``orchestrator.summary.STANDBY_BREAKDOWN``.

What is not covered: an executor that raises (its process alive, past ``faults.max_in_process_restarts``)
and a failure of the supervisor's process or node go to Ray Train as before (the executors are owned by
the supervisor and die with it). Each promotion claims the run-wide journal marker ``standby.N`` and is
allowed only within ``faults.max_worker_failures`` (``policies.budgets.within_budget``); past it the
supervisor raises, so Ray Train replaces the group under the same budget and the run ends.

Source: the warm standby (hot spare) of high-availability systems: a replica started and loaded before it
is needed, promoted when the primary fails, so a failover pays no cold start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import ray
from ray.exceptions import ActorDiedError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycheck.actors.journal import RunChannel
from raycheck.job.config import JobConfig
from raycheck.policies.budgets import within_budget
from raycheck.training.assets import ASSETS_KEY
from raycheck.workers.worker import zo_loop
from raycheck.workers.worker_env import worker_env

E = TypeVar("E")


class StandbyBudgetSpentError(RuntimeError):
    """The step executor died once more than ``faults.max_worker_failures`` allows."""


class StepExecutor:
    """One ZO worker (rank 0 of 1) whose start is paid before it is needed: built, it holds the
    ``WorkerEnv`` (``config``: ``JobConfig.to_dict()`` plus the shipped assets); ``run`` trains. A plain
    class; ``start_executor`` runs it in a Ray actor."""

    def __init__(self, config: dict) -> None:
        self.env = worker_env(config, place=(0, 1))

    def run(self, detected_unix_s: float | None) -> None:
        """Train to the run's last step (``zo_loop``): the run's first executor (``detected_unix_s`` None)
        or a promoted standby, the active one's death detected at ``detected_unix_s`` (unix seconds); its
        ``recovery`` event carries that and ``promoted_unix_s`` (now: this call began)."""
        promoted = None if detected_unix_s is None else {"detected_unix_s": detected_unix_s, "promoted_unix_s": time.time()}
        zo_loop(self.env, promoted)


def supervise(start: Callable[[], E], run_on: Callable[[E, float | None], None], promotion_allowed: Callable[[], bool],
              record: Callable[..., None]) -> int:
    """Run the training in an executor (``start()`` returns one, loading in the background;
    ``run_on(executor, detected_unix_s)`` waits for its ``StepExecutor.run``) with a standby started beside
    it; whenever the active one's process dies (``ActorDiedError``), record a ``standby_promoted`` event
    (``record(kind, **fields)``) and, if ``promotion_allowed()``, run the standby instead and start a new
    one. Returns the promotions done.

    Raises:
        StandbyBudgetSpentError: a death past the budget (``promotion_allowed()`` False).
        Any other error of ``run_on`` (an executor that raised: Ray Train restarts the worker group).
    """
    active, standby = start(), start()
    detected_unix_s: float | None = None
    promotions = 0
    while True:
        try:
            run_on(active, detected_unix_s)
            return promotions
        except ActorDiedError as exc:
            detected_unix_s = time.time()
            allowed = promotion_allowed()
            record("standby_promoted", promoted=allowed, promotions=promotions + int(allowed), supervisor_pid=os.getpid(),
                   error=f"{type(exc).__name__}: {exc}"[:300], detected_unix_s=detected_unix_s)
            if not allowed:
                raise StandbyBudgetSpentError("the step executor died again past faults.max_worker_failures: "
                                              "Ray Train restarts the worker group") from exc
            active, standby = standby, start()
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
supervisor only waits) and no Ray restart (the supervisor promotes its standby instead)."""


def start_executor(config: dict):
    """An ``ExecutorActor`` on this process's node (so the same node-local step log), loading in the background."""
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return ExecutorActor.options(scheduling_strategy=here).remote(config)


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point with ``faults.warm_standby`` (``config``: ``JobConfig.to_dict()`` plus the
    shipped assets): supervise the step executors (``supervise``), then stop the standby left over."""
    cfg = JobConfig.from_dict({k: v for k, v in config.items() if k != ASSETS_KEY})
    run = RunChannel(cfg)
    started: list = []

    def start():
        started.append(start_executor(config))
        return started[-1]

    run.event("standby_supervisor", pid=os.getpid())
    try:
        supervise(start, lambda executor, detected: ray.get(executor.run.remote(detected)),
                  lambda: claim_promotion(run, cfg.faults.max_worker_failures), run.event)
    finally:
        for executor in started:
            ray.kill(executor, no_restart=True)
