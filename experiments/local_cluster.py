"""A Ray cluster of several nodes on this machine, each non-head node with its own private directories.

``LocalCluster`` starts a head with ``ray start --head`` (no CPUs: the driver's node) and one node per
``NodeSpec``, each in its own mount namespace (``unshare --mount --propagation private``, root only)
with an empty tmpfs over every directory in ``private_dirs``: a file the driver writes there is
invisible on that node, as on a cluster whose nodes have their own disks. Every worker and actor that
Ray starts on a node inherits its namespace. The non-head nodes start without the driver's storage
credentials (no ``AWS_*`` variables), so whatever reaches them came through Ray's runtime environment.

Health checks are lowered (``HEALTH_CHECK_ENV``) so that a node taken down (``kill_node``: its raylet
and every process in its namespace) is marked dead within a few seconds. ``stop`` kills only the
processes this cluster started (never ``ray stop``, which stops every Ray cluster of the user).
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from raycheck.experiments.s3_server import free_port

BIN = pathlib.Path(sys.executable).parent
HEALTH_CHECK_ENV = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
"""Ray settings (environment overrides of its config) under which a dead node is seen within ~4 s."""
OBJECT_STORE_BYTES = 300 * 2**20
"""Object store of each node (the tiny model's images are kilobytes; Ray's default takes 30% of memory)."""


@dataclass(frozen=True)
class NodeSpec:
    """One non-head node: its ``name`` (its role: ``gpu``, ``cpu``), CPUs, and custom resources."""

    name: str
    num_cpus: int
    resources: dict[str, float]


def kill_tree(procs: Sequence[psutil.Process]) -> None:
    """SIGKILL ``procs`` and all their descendants, and wait until they are gone."""
    found = {}
    for root in procs:
        try:
            found.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        except psutil.NoSuchProcess:
            continue
    for p in found.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(found.values()), timeout=30)


def stop_cluster(marks: tuple[str, ...]) -> None:
    """Kill the processes whose command line holds one of ``marks`` (a cluster's temp dir or GCS
    address), with all their descendants, and no other: ``ray stop`` would stop every Ray cluster on
    the machine, e.g. a concurrent test session's."""
    kill_tree([p for p in psutil.process_iter(["cmdline"])
               if p.pid != os.getpid() and any(m in " ".join(p.info["cmdline"] or ()) + " " for m in marks)])


def agent_ports() -> list[str]:
    """``ray start`` options giving a node's agents free ports: Ray's fixed defaults (e.g. the dashboard
    agent's 52365) collide between the nodes of this machine and with other clusters on it (then
    ``ray job submit`` finds "No available agent")."""
    return [f"--{option}={free_port()}" for option in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                        "metrics-export-port", "runtime-env-agent-port")]


def mount_namespace(pid: int | str) -> str:
    """The mount namespace of process ``pid`` (``self`` for this one), e.g. ``mnt:[4026532177]``."""
    return os.readlink(f"/proc/{pid}/ns/mnt")


class LocalCluster:
    """A head and ``nodes`` on 127.0.0.1; ``start()`` returns once every node has joined.

    Args:
        nodes: the non-head nodes.
        private_dirs: existing directories hidden from every non-head node (a tmpfs over each).
        dashboard: start the head's dashboard (for ``ray job submit``; costs ~1 GB of memory).

    Attributes:
        address: the GCS address (``ray.init(address=...)``), ``dashboard_url`` (with ``dashboard``),
        env: the environment of the cluster's processes (give it to ``ray`` commands run against it),
        start_s, stop_s: seconds the last ``start`` / ``stop`` took.
    """

    def __init__(self, nodes: Sequence[NodeSpec], private_dirs: Sequence[pathlib.Path], dashboard: bool = False) -> None:
        self.nodes, self.private_dirs, self.dashboard = list(nodes), [pathlib.Path(d) for d in private_dirs], dashboard
        self.tmp = tempfile.mkdtemp(prefix="rcmn-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.port, self.dashboard_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(HEALTH_CHECK_ENV, RAY_TMPDIR=self.tmp, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
                        PATH=f"{BIN}:{os.environ['PATH']}")
        self.namespaces: dict[str, str] = {}
        """Node name -> its mount namespace."""
        self.start_s: float | None = None
        self.stop_s: float | None = None

    def _ray_start(self, *args: str) -> list[str]:
        return [str(BIN / "ray"), "start", "--node-ip-address=127.0.0.1", f"--object-store-memory={OBJECT_STORE_BYTES}",
                "--disable-usage-stats", *agent_ports(), *args]

    def start(self) -> "LocalCluster":
        """Start the head, then every node (``ray start`` returns once its raylet has registered);
        on a failure, stop whatever started.

        Raises:
            RuntimeError: a ``ray start`` failed (its output is in the message).
        """
        t0 = time.monotonic()
        try:
            self._run_start("head", subprocess.Popen(
                self._ray_start("--head", f"--port={self.port}", "--num-cpus=0", "--resources={\"driver\": 1}",
                                f"--include-dashboard={str(self.dashboard).lower()}", "--dashboard-host=127.0.0.1",
                                f"--dashboard-port={self.dashboard_port}"),
                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            for node in self.nodes:  # one after the other: two nodes starting at once timed out here (2 cores)
                self._join(node)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def _join(self, node: NodeSpec) -> None:
        """Start ``node`` and record its mount namespace (``ray start`` returns once it has registered)."""
        self.namespaces[node.name] = self._run_start(node.name, self._start_node(node)).splitlines()[0]

    def add_node(self, node: NodeSpec) -> None:
        """Start one more node on the running cluster (``stop`` stops it too).

        Raises:
            RuntimeError: its ``ray start`` failed.
        """
        self.nodes.append(node)
        self._join(node)

    def node_id(self, node: str) -> str:
        """The Ray node id of the alive node named ``node`` (its raylet's ``--node_id``)."""
        raylet = next(p for p in self.processes(node) if p.name() == "raylet")
        return next(a.split("=", 1)[1] for a in raylet.cmdline() if a.startswith("--node_id="))

    @staticmethod
    def _run_start(name: str, proc: subprocess.Popen) -> str:
        """Wait for a ``ray start``; returns its output."""
        out, err = proc.communicate(timeout=120)
        if proc.returncode:
            raise RuntimeError(f"{name} node did not start (exit {proc.returncode}): {out[-2000:]} {err[-2000:]}")
        return out

    def _start_node(self, node: NodeSpec) -> subprocess.Popen:
        """Start ``ray start`` for ``node`` in a new mount namespace; its first output line names the namespace."""
        node_env = {k: v for k, v in self.env.items() if not k.startswith("AWS_")}
        # the node's own runtime resources (the working directories its workers unpack), as on a real cluster:
        # shared, a node's cleanup of a job's working directory would remove the driver's current directory
        resources = pathlib.Path(self.tmp, "ray", "session_latest").resolve() / "runtime_resources"
        resources.mkdir(parents=True, exist_ok=True)
        mounts = "".join(f"mount -t tmpfs none {shlex.quote(str(d))} && " for d in [*self.private_dirs, resources])
        start = shlex.join(self._ray_start(f"--address={self.address}", f"--num-cpus={node.num_cpus}",
                                           f"--resources={json.dumps(node.resources)}"))
        return subprocess.Popen(["unshare", "--mount", "--propagation", "private", "bash", "-c",
                                 f"{mounts}readlink /proc/self/ns/mnt && {start}"],
                                env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def processes(self, node: str) -> list[psutil.Process]:
        """Every process in ``node``'s mount namespace (its raylet, workers, actors)."""
        found = []
        for p in psutil.process_iter():
            try:
                if mount_namespace(p.pid) == self.namespaces[node]:
                    found.append(p)
            except (OSError, psutil.NoSuchProcess):
                continue
        return found

    def kill_node(self, node: str) -> None:
        """Take ``node`` down: SIGKILL every process in its namespace (Ray then marks it dead)."""
        kill_tree(self.processes(node))

    def stop(self) -> None:
        """Kill every process this cluster started (each node's namespace, then the head's)."""
        t0 = time.monotonic()
        for node in self.namespaces:
            self.kill_node(node)
        stop_cluster((self.tmp, self.address, f":{self.port} "))
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.stop_s = time.monotonic() - t0


THREE_NODES = (NodeSpec("gpu", num_cpus=2, resources={"train": 2}), NodeSpec("cpu", num_cpus=1, resources={"replica": 8}))
"""Besides the head (the driver, no CPUs): a "gpu" node for the train workers (CPU only here) and a
"cpu" node for the shadow's shards and the snapshot persister (one ``replica`` unit each)."""
SPARE_GPU_NODE = NodeSpec("gpu2", num_cpus=2, resources={"train": 2})
"""A second node for the train workers (``LocalCluster.add_node``): where they restart once the first is lost."""
