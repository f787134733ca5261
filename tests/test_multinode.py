"""raycheck on a three-node Ray cluster on this machine whose non-head nodes have private directories
(``tests/cluster.py``): the cluster itself, placement, storage credentials, and a run with failures."""

from __future__ import annotations

import os
import time

import pytest
import ray

from cluster import mount_namespace

pytestmark = [pytest.mark.ray, pytest.mark.multinode]


def test_each_node_has_private_directories_and_no_credentials_of_its_own(three_nodes, tmp_path, tmp_path_factory):
    @ray.remote(num_cpus=0)
    def look(directory: str) -> dict:  # defined here: pickled by value (the workers cannot import this module)
        """What a process on its node sees: ``directory``'s entries, its mount namespace, its node id,
        and the storage credentials in its environment."""
        return {"entries": sorted(os.listdir(directory)), "namespace": os.readlink("/proc/self/ns/mnt"),
                "node_id": ray.get_runtime_context().get_node_id(), "aws": sorted(k for k in os.environ if k.startswith("AWS_"))}

    (tmp_path / "written-by-the-driver").write_text("x")
    private = tmp_path_factory.getbasetemp()  # tmp_path is a folder in it
    seen = {node: ray.get(look.options(resources={resource: 1}).remote(str(private)), timeout=60)
            for node, resource in (("gpu", "train"), ("cpu", "replica"))}
    assert sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]) == sorted(
        [ray.get_runtime_context().get_node_id(), seen["gpu"]["node_id"], seen["cpu"]["node_id"]])
    for node, view in seen.items():
        assert view == {**view, "entries": [], "namespace": three_nodes.namespaces[node], "aws": []}, node
    assert seen["gpu"]["namespace"] != seen["cpu"]["namespace"] != mount_namespace("self")
    assert tmp_path.name in os.listdir(private) and os.listdir(tmp_path) == ["written-by-the-driver"]
    assert three_nodes.start_s < 60, f"the cluster took {three_nodes.start_s:.1f} s to start"
    print(f"cluster start {three_nodes.start_s:.1f} s")


def test_a_node_taken_down_is_dead_to_ray_within_seconds(three_nodes):
    """Runs last in this module: the "cpu" node stays down. Ray has no notification of a node's death
    to wait on, so this polls its view of the nodes, bounded by the lowered health-check timeouts."""
    @ray.remote(num_cpus=0, resources={"replica": 1})
    def node_id() -> str:
        return ray.get_runtime_context().get_node_id()

    cpu_node = ray.get(node_id.remote(), timeout=60)
    t0 = time.monotonic()
    three_nodes.kill_node("cpu")
    assert three_nodes.processes("cpu") == []
    while next(n for n in ray.nodes() if n["NodeID"] == cpu_node)["Alive"]:
        assert time.monotonic() - t0 < 15, "Ray still counts the node alive"
        time.sleep(0.2)
