"""When Ray Train's controller noticed a failure and rebuilt the worker group: the controller's side
of the recovery breakdown (``orchestrator.summary.BREAKDOWN``).

Ray Train V2 runs its controller as an actor and calls the callbacks of ``RunConfig(callbacks=...)``
there (a ``ControllerCallback`` and a ``WorkerGroupCallback``; ours run after Ray Train's own, so
``after_worker_group_start`` comes after the torch process group is set up). ``GroupTimeline`` stamps
each hook with ``time.time()`` (unix seconds, the controller's node clock) and, once a group's train
function is launched, sends all stamps since the previous launch to the run's journal as one
``worker_group`` event (with ``starts``, the group starts so far), without waiting for the journal (the controller's loop is never held up);
at the first launch it also hands the journal Ray Train's controller actor (``Journal.publish_trainer``), so
a run that fails on its own (e.g. a ``code_error``) aborts the fit instead of leaving it restarting workers:

- ``detected_unix_s``: the controller is about to act on a failure (its poll saw a worker die; the poll
  runs every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 0.5 s here); absent on the first start;
- ``group_start_unix_s``: the old group is shut down and the new one's start begins (placement group);
- ``workers_created_unix_s``: every worker actor of the new group is up (its process started, Ray's
  worker imports done, its metadata returned);
- ``group_ready_unix_s``: the train contexts and Ray Train's backend (the torch process group) are set up.

Source: ``ray/train/v2/_internal/execution/callback.py`` and ``ray/train/v2/_internal/execution/worker_group/worker_group.py`` (Ray 2.60).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayError
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

from raycheck.actors.journal import RunChannel
from raycheck.job.config import JobConfig

if TYPE_CHECKING:
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2._internal.execution.worker_group import Worker, WorkerGroup, WorkerGroupContext

log = logging.getLogger(__name__)


class GroupTimeline(ControllerCallback, WorkerGroupCallback):
    """Stamps of the worker group's life cycle for the run of ``cfg`` (module docstring)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.run = RunChannel(cfg)
        self.stamps: dict[str, float] = {}
        self.starts = 0

    def _stamp(self, name: str) -> None:
        self.stamps[name] = time.time()

    def before_controller_execute_failure_decision(self, failure_decision: FailureDecision) -> None:
        self._stamp("detected_unix_s")

    def before_worker_group_start(self, worker_group_context: WorkerGroupContext) -> None:
        self._stamp("group_start_unix_s")

    def before_init_train_context(self, workers: list[Worker]) -> dict[str, list[Any]]:
        self._stamp("workers_created_unix_s")
        return {}

    def after_worker_group_start(self, worker_group: WorkerGroup) -> None:
        self._stamp("group_ready_unix_s")

    def after_worker_group_training_start(self, worker_group: WorkerGroup) -> None:
        """Send the stamps since the last launch as a ``worker_group`` event (a lost journal is logged, not raised)."""
        stamps, self.stamps = self.stamps, {}
        self.starts += 1
        try:
            if self.starts == 1:  # this controller's handle: the driver aborts the fit with it when the run fails first
                self.run.handle.publish_trainer.remote(ray.get_runtime_context().current_actor)
            self.run.handle.event.remote({"kind": "worker_group", "starts": self.starts, **stamps, "unix_s": time.time()})
        except (ValueError, RayError) as exc:
            log.warning("the run's journal did not take the worker group's stamps: %s", exc)
