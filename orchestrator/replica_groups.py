"""Each MeZO worker its own Ray Train replica group, so a failure replaces only the failed worker.

Ray Train V2 replaces only the failing replica groups of a worker group whose backend has
``has_replica_groups = True`` (``ray/train/v2/_internal/execution/controller/controller.py``,
``_execute_resize_decision`` -> ``_replace_bad_workers`` -> ``WorkerGroup.replace_replica_group``): the
other workers keep their processes and go on. Ray ships one such backend, torchft's
(``ray/train/v2/torch/torchft_config.py``); ``ReplicaGroupsConfig`` is the same without torchft: a
torch.distributed process group per replica group (of one worker), and the run's step exchange
(``actors.step_exchange``) created by the backend in Ray Train's controller process, as torchft's
lighthouse is, so it lives exactly as long as the fit. The workers sum their losses and meet at
barriers through it (``workers.worker``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import ray
from ray.train.backend import BackendConfig
from ray.train.torch.config import TorchConfig, _TorchBackend
from ray.train.v2._internal.execution.worker_group import ReplicaGroup, WorkerGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycheck.actors.step_exchange import StepExchangeActor

if TYPE_CHECKING:
    from ray.train._internal.base_worker_group import BaseWorkerGroup

EXCHANGE_KEEP_STEPS = 1024
"""Complete steps whose parts the step exchange keeps: a replacement restored at the durable step re-executes
at most the steps the log keeper lags behind rank 0 (none with durability node or cluster)."""


class ReplicaGroupsConfig(TorchConfig):
    """``TorchTrainer(torch_config=...)``: every worker its own replica group, plus the step exchange.

    Args:
        exchange_name: the step exchange actor's name (``job.names.exchange_name``), in ``namespace``.
        world: the workers (Ray Train's world size): ranks of the exchange.
        **kwargs: ``TorchConfig``'s (``backend``, ``init_method``, ``timeout_s``).
    """

    def __init__(self, exchange_name: str, namespace: str, world: int, **kwargs) -> None:
        self.exchange_name, self.namespace, self.world = exchange_name, namespace, world
        super().__init__(**kwargs)

    @property
    def backend_cls(self):
        return ReplicaGroupsBackend


class ReplicaGroupsBackend(_TorchBackend):
    """Starts a process group per replica group (a whole worker group at the start, one replaced replica
    group after a failure) and, once, the step exchange (kept referenced so it lives with the backend), on
    the node of Ray Train's controller: a lost train node never takes it (the controller's node is the
    driver's by default)."""

    has_replica_groups: bool = True

    def __init__(self) -> None:
        super().__init__()
        self.exchange: Any = None  # the actor handle (ray types a handle's methods as Never)

    def on_start(self, worker_group: BaseWorkerGroup, backend_config: BackendConfig) -> None:
        if not isinstance(backend_config, ReplicaGroupsConfig):
            raise TypeError(f"the replica groups backend needs a ReplicaGroupsConfig, got a {type(backend_config).__name__}")
        if self.exchange is None:
            here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
            self.exchange = ray.remote(StepExchangeActor).options(
                name=backend_config.exchange_name, namespace=backend_config.namespace, num_cpus=0, max_concurrency=1000,
                get_if_exists=True, scheduling_strategy=here,  # on the controller's node, as torchft's lighthouse
            ).remote(backend_config.world, EXCHANGE_KEEP_STEPS)
            ray.get(self.exchange.__ray_ready__.remote())
        start = super().on_start
        if isinstance(worker_group, ReplicaGroup):
            start(worker_group, backend_config)
            return
        assert isinstance(worker_group, WorkerGroup)
        groups = worker_group.get_replica_groups()
        if groups is None:
            raise RuntimeError("the worker group has no replica groups (has_replica_groups is set: Ray Train makes them)")
        with ThreadPoolExecutor() as pool:
            for done in [pool.submit(start, rg, backend_config) for rg in groups]:
                done.result()
