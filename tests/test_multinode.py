"""raycheck on a three-node Ray cluster on this machine whose non-head nodes have private directories
(``tests/cluster.py``): the cluster itself, placement, storage credentials, and a run with failures."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import pytest
import ray
from typer.testing import CliRunner

from cluster import SPARE_GPU_NODE, mount_namespace
from conftest import make_bucket
from orchestrator.cli import app
from orchestrator.cluster import alive_nodes, plan_placement, this_node
from orchestrator.config import JobConfig
from orchestrator.controller import start_persister
from storage.backend import STORAGE_ENV
from training.model import default_cache_dir

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
    print(f"the cluster started in {three_nodes.start_s:.1f} s")  # a measurement (docs/cluster.md), not a guarantee


def bucket_uri(endpoint: str) -> str:
    bucket = f"rc-{uuid.uuid4().hex[:12]}"
    make_bucket(endpoint, bucket)
    return f"s3://{bucket}/run"


def run_cli(*args: str):
    """``raycheck run`` in this process (connected to the cluster), tiny model, a few steps."""
    return CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "4", "--eval-samples", "0", *args])


@pytest.fixture(scope="module")
def zo_reference(tmp_path_factory):
    """A folder holding the failure-free reference's ``summary.json`` of the module's 8-step ZO runs once
    one has run it (``with_reference``): the runs share the trajectory settings, so one reference serves all."""
    return tmp_path_factory.mktemp("zo-reference")


def with_reference(shared, out, *args: str):
    """``run_cli(*args, "--out", out)`` reusing the reference in ``shared`` (``controller.reference``
    reuses ``<out>/reference/summary.json`` of the same trajectory); keeps the one it ran there."""
    copy_summary(shared, out / "reference")
    result = run_cli(*args, "--out", str(out))
    copy_summary(out / "reference", shared)
    return result


def copy_summary(src, dst) -> None:
    """Copy ``src/summary.json`` into ``dst`` unless ``src`` has none or ``dst`` has one."""
    if (src / "summary.json").exists() and not (dst / "summary.json").exists():
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / "summary.json", dst / "summary.json")


def test_storage_settings_reach_a_node_without_them_and_a_component_that_cannot_start_fails_the_run_in_one_line(
        three_nodes, s3_endpoint, tmp_path, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    cfg = JobConfig(out_dir=str(tmp_path / "probe"), cache_dir=str(default_cache_dir()), model="tiny", strategy="log-only",
                    storage=bucket_uri(s3_endpoint), storage_options={"endpoint_url": s3_endpoint}, run_id="probe")
    placement = plan_placement(alive_nodes(), driver_node_id=this_node()["node_id"], workers=1, use_gpu=False,
                               replica_resource="replica")
    persister = start_persister(cfg, placement)
    try:  # the "cpu" node has no AWS_* of its own: the driver's reached the persister there
        node = ray.get(persister.check_storage.remote(), timeout=120)
    finally:
        ray.kill(persister)
    assert node["node_id"] not in (this_node()["node_id"], None)

    # credentials in a file on the driver's machine (hidden from the other nodes) do not travel
    for name in STORAGE_ENV:
        monkeypatch.delenv(name, raising=False)
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[default]\naws_access_key_id = testing\naws_secret_access_key = {secret}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    out = tmp_path / "run"
    result = run_cli("--storage", bucket_uri(s3_endpoint), "--s3-endpoint", s3_endpoint, "--shadow-resource", "replica",
                     "--out", str(out))
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert errors[0].startswith(f"error: training failed: ComponentStartError: the snapshot persister on node {node['node_ip']} "
                                f"({node['node_id'][:12]}) cannot use storage s3://"), errors[0]
    assert "NoCredentialsError" in errors[0] and "from the driver's environment (AWS_ACCESS_KEY_ID" in errors[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary == {**summary, "ok": False, "phase": "failed", "error": errors[0].removeprefix("error: training failed: ")}
    assert summary["placement"]["persister"] == [{"node_id": node["node_id"], "node_ip": node["node_ip"]}]
    assert [p.name for p in out.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()] == []

    # a component that no node can place: the run fails once --start-timeout has passed
    result = run_cli("--shadow-resource", "nosuch", "--start-timeout", "2", "--out", str(tmp_path / "unplaced"))
    assert result.exit_code == 1, result.output
    assert [line for line in result.output.splitlines() if line.startswith("error:")] == [
        "error: training failed: ComponentStartError: the snapshot persister did not start within 2 s: no alive node could "
        "place it (it asks for {'resources': {'nosuch': 1}}); check the cluster's nodes, --shadow-resource and --start-timeout"]


@pytest.mark.raytrain
def test_a_zo_run_with_a_worker_and_a_shadow_failure_ends_bitwise_equal_on_three_nodes(three_nodes, s3_endpoint, tmp_path,
                                                                                        monkeypatch, zo_reference):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    out = tmp_path / "run"
    result = with_reference(zo_reference, out, *zo_run(s3_endpoint, "--fail", "3:worker", "--fail", "5:shadow"))
    summary = json.loads((out / "summary.json").read_text())
    assert result.exit_code == 0, (summary.get("error"), result.output[-3000:])
    assert summary == {**summary, "ok": True, "final_step": 8, "bitwise_equal": True, "shadow_equal": True, "lost_steps": 0}
    assert [f["target"] for f in summary["failures"]] == ["worker", "shadow"]
    assert summary["durability"] == {**summary["durability"], "level": "node", "node_held": True}
    placement = {name: three_nodes_ids()[name] for name in ("gpu", "cpu")}
    assert {w["node_id"] for w in summary["placement"]["workers"]} == {placement["gpu"]}
    assert {p["node_id"] for shard in summary["placement"]["shadow_shards"] for p in shard} == {placement["cpu"]}
    assert [p["node_id"] for p in summary["placement"]["persister"]] == [placement["cpu"]]
    assert [p.name for p in out.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()] == []


def zo_run(s3_endpoint: str, *failures: str) -> list[str]:
    """The options of the module's 8-step ZO runs on the cluster (one trajectory), with ``failures``;
    rank 0's scratch is the default one, which the fixture makes private to each node."""
    return ["--steps", "8", *failures, "--settle-failures", "--verify", "--durability", "node", "--snapshot-every", "3",
            "--storage", bucket_uri(s3_endpoint), "--s3-endpoint", s3_endpoint, "--worker-resource", "train",
            "--shadow-resource", "replica", "--start-timeout", "120"]


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.raytrain
def test_a_zo_run_survives_the_loss_of_rank_0s_node_and_ends_bitwise_equal(three_nodes, s3_endpoint, tmp_path, zo_reference):
    """``--fail 3:node`` takes down the "gpu" node (the second-to-last test here: that node stays down);
    a spare node that can host train workers joins first. Prints the recovery figures."""
    three_nodes.add_node(SPARE_GPU_NODE)
    names = {three_nodes.node_id(name): name for name in ("gpu", "gpu2", "cpu")}
    out = tmp_path / "run"
    result = with_reference(zo_reference, out, *zo_run(s3_endpoint, "--fail", "3:node"))
    summary = json.loads((out / "summary.json").read_text())
    assert result.exit_code == 0, (summary.get("error"), result.output[-3000:])
    assert summary == {**summary, "ok": True, "final_step": 8, "bitwise_equal": True, "shadow_equal": True, "lost_steps": 0}
    assert summary["failures"] == [{"step": 3, "target": "worker", "how": "node"}]

    workers = [names[w["node_id"]] for w in summary["placement"]["workers"]]
    lost = workers[0]
    assert len(workers) == 2 and set(workers) == {"gpu", "gpu2"}, workers  # rank 0 restarted on the other train node
    assert three_nodes.processes(lost) == [], f"processes of the {lost} node survived its failure"
    assert not next(n for n in ray.nodes() if n["NodeID"] == summary["placement"]["workers"][0]["node_id"])["Alive"]
    # the shadow and the persister, on the "cpu" node, ran through it untouched (one incarnation each)
    assert [[names[p["node_id"]] for p in shard] for shard in summary["placement"]["shadow_shards"]] == [["cpu"]]
    assert [names[p["node_id"]] for p in summary["placement"]["persister"]] == ["cpu"]
    assert summary["durability"] == {**summary["durability"], "level": "node", "node_held": True}
    assert [names[n] for n in summary["durability"]["rank0_node_ids"]] == workers

    events = jsonl(out / "events.jsonl")
    failure = next(e for e in events if e["kind"] == "failure")
    rebuilt = [e for e in events if e["kind"] == "step_log"][1]  # the replacement rank 0 had no local log
    assert (rebuilt["local_steps"], rebuilt["rebuilt_steps"]) == (0, failure["durable_steps"]), rebuilt
    [recovery] = summary["recoveries"]
    assert recovery == {**recovery, "failure_step": 3, "lost_steps": 0, "restored_step": failure["durable_steps"]}
    first_step_after_s = min(m["unix_s"] for m in jsonl(out / "metrics.jsonl") if m["unix_s"] > failure["unix_s"]) - failure["unix_s"]
    print(f"node failure at step 3 ({lost} node): first step after it {first_step_after_s:.1f} s; restored "
          f"{recovery['restored_step']} steps from {recovery['source']} in {recovery['seconds']:.1f} s after the failure "
          f"(restart {recovery['restart_seconds']:.1f} s, restore {recovery['restore_seconds']:.2f} s)")


def three_nodes_ids() -> dict[str, str]:
    """The node id of the "gpu" and "cpu" nodes (by the resource each offers)."""
    by_resource = {r: n.node_id for n in alive_nodes() for r in n.resources}
    return {"gpu": by_resource["train"], "cpu": by_resource["replica"]}


def test_a_node_taken_down_is_dead_to_ray_within_seconds(three_nodes):
    """Runs last in this module: the "cpu" node stays down. Ray has no notification of a node's death
    to wait on, so this polls its view of the nodes, bounded by the lowered health-check timeouts (about 4 s;
    30 s allows for a loaded machine and still fails under Ray's defaults, about a minute)."""
    @ray.remote(num_cpus=0, resources={"replica": 1})
    def node_id() -> str:
        return ray.get_runtime_context().get_node_id()

    cpu_node = ray.get(node_id.remote(), timeout=60)
    t0 = time.monotonic()
    three_nodes.kill_node("cpu")
    assert three_nodes.processes("cpu") == []
    while next(n for n in ray.nodes() if n["NodeID"] == cpu_node)["Alive"]:
        assert time.monotonic() - t0 < 30, "Ray still counts the node alive (Ray's default health checks take about a minute)"
        time.sleep(0.2)
