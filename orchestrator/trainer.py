"""The Ray Train trainer of a run: the workers' loop for its algorithm, its worker count and placement,
and Ray Train's own restart budgets (``FailureConfig.max_failures``, and ``max_preemption_failures`` for the
restarts at a preemption's deadline); and its ``fit`` run on a thread
(``Fit``) while the driver watches."""

from __future__ import annotations

import os
import pathlib
import threading
from collections.abc import Callable
from typing import Any

from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig  # what ray.train exports (Ray Train v2)
from ray.train.v2.torch.torch_trainer import TorchTrainer  # what ray.train.torch exports (Ray Train v2)

PREEMPTION_POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"
"""Ray Train's setting of how often its preemption watcher polls the node drains, in seconds."""

from raycheck.job.config import JobConfig
from raycheck.job.names import TRAINER_PREFIX, exchange_name
from raycheck.orchestrator.cluster import Placement, runtime_env
from raycheck.orchestrator.group_timeline import GroupTimeline
from raycheck.orchestrator.replica_groups import ReplicaGroupsConfig
from raycheck.storage.backend import local_path, pyarrow_filesystem
from raycheck.training.assets import ASSETS_KEY


def trainer(cfg: JobConfig, shipped: dict, placement: Placement, loop: Callable[[dict], None] | None = None) -> TorchTrainer:
    """The ``TorchTrainer`` of ``cfg``'s run: your own ``loop`` when given (``orchestrator.api.run_own_loop``), else supervised workers that can keep a warm standby
    (``workers.standby``, ``JobConfig.supervised``), else first-order workers (``workers.fo_worker``) or ZO
    workers (``workers.worker``); ``shipped``: the assets in Ray's
    object store (``training.assets.ship``); ``placement``: the workers' resources and label selector."""
    # Ray Train's preemption watcher polls the drains every 5 s by default: 1 s leaves more of a 30 s notice to save in
    os.environ.setdefault(PREEMPTION_POLL_ENV, "1")  # read by Ray Train's controller, which gets the driver's value
    if loop is not None:
        train_loop_per_worker = loop
    elif cfg.supervised:
        from raycheck.workers.standby import train_loop_per_worker
    elif cfg.algo == "fo":
        from raycheck.workers.fo_worker import train_loop_per_worker
    else:
        from raycheck.workers.worker import train_loop_per_worker
    return TorchTrainer(
        train_loop_per_worker=train_loop_per_worker,
        train_loop_config={**cfg.to_dict(), ASSETS_KEY: shipped},
        torch_config=ReplicaGroupsConfig(exchange_name(cfg), cfg.namespace, cfg.workers) if cfg.replica_groups else None,
        scaling_config=ScalingConfig(num_workers=(cfg.elastic.min_workers, cfg.workers) if cfg.is_elastic else cfg.workers,
                                     elastic_resize_monitor_interval_s=cfg.elastic.resize_interval_s,
                                     use_gpu=cfg.device == "cuda",
                                     resources_per_worker=placement.worker_resources,
                                     label_selector=placement.worker_label_selector),
        run_config=RunConfig(
            name=f"{TRAINER_PREFIX}{cfg.run_id}",
            **ray_train_storage(cfg),
            failure_config=FailureConfig(max_failures=cfg.faults.max_worker_failures, max_preemption_failures=cfg.faults.max_preemptions),
            worker_runtime_env=runtime_env(),
            # the controller's side of the recovery breakdown; Ray annotates UserCallback, and takes any RayTrainCallback
            callbacks=[GroupTimeline(cfg)],  # type: ignore[list-item]
        ),
    )


def ray_train_uri(cfg: JobConfig) -> str:
    """Ray Train's storage of ``cfg``'s run: ``--ray-train-storage``, else ``<out>/ray_train``."""
    return cfg.storage.ray_train or str(pathlib.Path(cfg.out_dir).resolve() / "ray_train")


def ray_train_storage(cfg: JobConfig) -> dict[str, Any]:
    """``RunConfig``'s storage arguments for ``cfg``'s run: a local ``storage_path``, or a remote one with
    its ``storage_filesystem`` (the fsspec filesystem raycheck's storage uses, with ``cfg.storage.options``:
    the same endpoint and credentials as ``--storage``)."""
    uri = ray_train_uri(cfg)
    folder = local_path(uri)
    if folder is not None:
        return {"storage_path": str(folder)}
    fs, path = pyarrow_filesystem(uri, cfg.storage.options)
    return {"storage_path": path, "storage_filesystem": fs}


class Fit:
    """``trainer.fit()`` on a daemon thread, started at once: ``running`` while it runs, then ``outcome``
    (``ok``; ``checkpoint`` and ``metrics``: the ``Result``'s of a run that returned; ``error``:
    ``<ErrorType>: message`` of what it raised, reported in the summary and by the exit code)."""

    def __init__(self, trainer: TorchTrainer) -> None:
        self.outcome: dict[str, object] = {}
        self._thread = threading.Thread(target=self._fit, args=(trainer,), name="ray-train-fit", daemon=True)
        self._thread.start()

    def _fit(self, trainer: TorchTrainer) -> None:
        try:
            result = trainer.fit()
            self.outcome.update(ok=True, checkpoint=result.checkpoint, metrics=result.metrics)
        except Exception as exc:
            self.outcome.update(ok=False, error=f"{type(exc).__name__}: {exc}")

    @property
    def running(self) -> bool:
        return self._thread.is_alive()
