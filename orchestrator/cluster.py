"""Connecting to Ray: an embedded local cluster by default, or the cluster of ``ray job submit``."""

from __future__ import annotations

import os

import ray

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def connect(namespace: str, num_cpus: int, dashboard: bool = False, worker_logs: bool = False) -> bool:
    """Connect this driver to Ray; returns True when it started a local cluster itself.

    Inside ``ray job submit`` (``RAY_ADDRESS`` set) it joins that cluster; otherwise it starts one
    with ``num_cpus`` CPUs. ``RAY_TMPDIR`` defaults to ``/tmp/raycheck-ray``. ``worker_logs`` forwards
    the output of every Ray process to this terminal (noisy; errors reach the summary either way).
    """
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("RAY_TMPDIR", "/tmp/raycheck-ray")
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto", namespace=namespace)
        return False
    ray.init(num_cpus=num_cpus, namespace=namespace, include_dashboard=dashboard, log_to_driver=worker_logs)
    return True
