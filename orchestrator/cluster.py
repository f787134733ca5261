"""Connecting to Ray (an embedded local cluster by default, or the cluster of ``ray job submit``),
where a run's processes go on a cluster (``plan_placement``), and what reaches them there (``runtime_env``)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from raycheck.orchestrator.signals import reclaim_sigterm

if TYPE_CHECKING:
    from raycheck.job.config import JobConfig

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
"""The driver's environment defaults (a variable already set wins): no usage stats, no auth token for
the local cluster, and Ray Train's controller polling its workers every 0.5 s instead of its default
2 s, so a worker failure or the end of training is seen up to 1.5 s sooner (Ray Train hands the
variable from the driver to its controller)."""


def connect(namespace: str, num_cpus: int, dashboard: bool = False, worker_logs: bool = False) -> bool:
    """Connect this driver to Ray; returns True when it started a local cluster itself.

    Inside ``ray job submit`` (``RAY_ADDRESS`` set) it joins that cluster; otherwise it starts one
    with ``num_cpus`` CPUs; either way the output of the cluster's other processes stays in Ray's logs. ``SIGTERM`` stays an interrupt where ``raycheck run`` made it one
    (``orchestrator.signals``). ``RAY_TMPDIR`` defaults to ``/tmp/raycheck-ray``. ``worker_logs`` forwards
    the output of every Ray process to this terminal (noisy; errors reach the summary either way).
    """
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("RAY_TMPDIR", "/tmp/raycheck-ray")
    if ray.is_initialized():
        return False
    joined = bool(os.environ.get("RAY_ADDRESS"))
    quiet = not logging.getLogger(__name__).isEnabledFor(logging.DEBUG)  # Ray's INFO lines ("Started a local Ray instance") with --verbose
    level = logging.WARNING if quiet else logging.INFO
    if joined:  # the workers' and actors' output stays in Ray's logs (ray job logs shows the driver's) unless worker_logs
        ray.init(address="auto", namespace=namespace, log_to_driver=worker_logs, logging_level=level)
    else:
        ray.init(num_cpus=num_cpus, namespace=namespace, include_dashboard=dashboard, log_to_driver=worker_logs, logging_level=level)
    reclaim_sigterm()  # ray.init's own SIGTERM handler exits without a summary
    return not joined


NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its own node id (label selectors match on it)."""


def runtime_env(env_vars: dict[str, str] | None = None) -> dict:
    """The ``runtime_env`` of every actor and train worker a run starts: the storage settings of this
    (the driver's) environment (``storage.backend.storage_env``) plus ``env_vars``, so that they reach
    processes on any node (a node's own environment has none of them on a real cluster). Ray keeps
    runtime environments in its own session state; raycheck never writes them to the run directory."""
    from raycheck.storage.backend import storage_env

    return {"env_vars": {**storage_env(), **(env_vars or {})}}


def shadow_actor_options(cfg: JobConfig) -> dict:
    """Extra ``.options(...)`` of a shadow actor of run ``cfg``: its ``runtime_env`` (the driver's storage
    settings and ``cfg.placement.shadow_env``, ``runtime_env``)."""
    return {"runtime_env": runtime_env(cfg.placement.shadow_env)}


@dataclass(frozen=True)
class Node:
    """An alive Ray node as placement sees it: its id, ip and total resources (``ray.nodes()``)."""

    node_id: str
    node_ip: str
    resources: dict[str, float]

    def can_host(self, need: dict[str, float]) -> bool:
        """Whether this node offers every resource in ``need`` in the amount asked (in total)."""
        return all(self.resources.get(k, 0) >= v for k, v in need.items())

    def capacity(self, need: dict[str, float]) -> int:
        """How many processes asking ``need`` this node holds (by its totals)."""
        return min((int(self.resources.get(k, 0) // v) for k, v in need.items() if v > 0), default=0)


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes (needs ``ray`` connected)."""
    return [Node(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"])) for n in ray.nodes() if n["Alive"]]


@dataclass(frozen=True)
class Placement:
    """Where a run's processes go.

    Attributes:
        replica: ``.options(...)`` of the shadow's shards and the snapshot persister (resources or a
            label selector; empty: anywhere).
        worker_resources: Ray Train's ``resources_per_worker`` (None: Ray's default, one CPU or GPU).
        worker_label_selector: Ray Train's ``label_selector`` of every worker (None: any node).
        policy: why, in words (reported in ``summary.json``).
    """

    replica: dict
    worker_resources: dict | None
    worker_label_selector: dict | None
    policy: str


def worker_need(use_gpu: bool, worker_resource: str = "") -> dict[str, float]:
    """The resources one train worker asks: a GPU or a CPU, and one unit of ``worker_resource`` if given."""
    return {"GPU" if use_gpu else "CPU": 1.0, **({worker_resource: 1.0} if worker_resource else {})}


def plan_placement(nodes: list[Node], *, driver_node_id: str, workers: int, use_gpu: bool,
                   worker_resource: str = "", replica_resource: str = "") -> Placement:
    """Place the train workers, the shadow and the persister (pure). The shadow and persister are the
    replicas of a train worker's progress, so, on a cluster of two or more nodes, they must not share
    rank 0's node: one node's loss must never take both. Rank 0's node is known only once Ray Train
    has placed its workers, after the shadow starts, so the replicas are kept off every node that
    could host a train worker:

    - ``replica_resource`` given: the replicas ask one unit of it each (the operator has set the
      node roles); ``worker_resource`` given: each worker asks one unit of it besides its CPU or GPU;
    - else, one node: anywhere;
    - else, some alive node cannot host a worker (no GPU, no CPU, no worker resource, e.g. the head):
      the replicas go to such nodes (a label selector on the node id);
    - else (every node can host a worker): the node that holds the fewest workers (the driver's on a
      tie) is kept for the replicas and the workers are kept off it, if the other nodes still hold
      ``workers``; otherwise the replicas go anywhere and the policy says so.

    Args:
        nodes: the alive nodes (``alive_nodes``); driver_node_id: the driver's node;
        workers: train workers; use_gpu: each worker needs a GPU (else a CPU).
    """
    need = worker_need(use_gpu, worker_resource)
    worker_resources = need if worker_resource else None
    if replica_resource:
        return Placement({"resources": {replica_resource: 1}}, worker_resources, None,
                         f"replicas on nodes with resource {replica_resource!r}")
    if len(nodes) < 2:
        return Placement({}, worker_resources, None, "one node: everything on it")
    hosts = [n.node_id for n in nodes if n.can_host(need)]
    if len(hosts) < len(nodes):
        return Placement({"label_selector": {NODE_ID_LABEL: f"!in({','.join(hosts)})"}}, worker_resources, None,
                         "replicas on the nodes that cannot host a train worker")
    keep = min(nodes, key=lambda n: (n.capacity(need), n.node_id != driver_node_id, n.node_id))
    if sum(n.capacity(need) for n in nodes if n is not keep) < workers:
        return Placement({}, worker_resources, None, f"every node is needed by the {workers} train workers: "
                                                     "the replicas may share rank 0's node")
    return Placement({"label_selector": {NODE_ID_LABEL: keep.node_id}}, worker_resources,
                     {NODE_ID_LABEL: f"!in({keep.node_id})"}, "replicas on a node kept free of train workers")
