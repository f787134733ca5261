"""raycheck on a three-node Ray cluster on this machine whose non-head nodes have private directories
(``experiments/local_cluster.py``): the cluster itself, placement, storage credentials, and a run with failures."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import ray
from ray.job_submission import JobStatus, JobSubmissionClient
from typer.testing import CliRunner

from raycheck.experiments.local_cluster import SPARE_GPU_NODE, NodeSpec, mount_namespace
from conftest import make_bucket
from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.job.stores import snapshot_store
from raycheck.cli.main import app
from raycheck.orchestrator.cluster import alive_nodes, plan_placement
from raycheck.orchestrator.components import start_persister
from raycheck.orchestrator.summary import recoveries as summary_recoveries
from raycheck.storage.backend import STORAGE_ENV, Storage
from raycheck.storage.log_segments import read_segments
from raycheck.storage.steplog import read_records
from raycheck.training.model import default_cache_dir
from raycheck.training.node import this_node

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent


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


def test_storage_settings_reach_a_node_without_them_and_a_component_that_cannot_start_fails_the_run_in_one_line(
        three_nodes, s3_endpoint, tmp_path, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    cfg = JobConfig(out_dir=str(tmp_path / "probe"), cache_dir=str(default_cache_dir()), model="tiny", strategy="log-only",
                    run_id="probe", storage={"uri": bucket_uri(s3_endpoint), "options": {"endpoint_url": s3_endpoint}})
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
    assert "StorageCredentialsError: check bucket s3://" in errors[0] and "failed after 1 try: no S3 credentials" in errors[0]
    assert "from the driver's environment (AWS_ACCESS_KEY_ID" in errors[0]
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
def test_a_submitted_job_survives_a_worker_a_shadow_and_rank_0s_node_and_resumes_from_the_bucket_alone(
        three_nodes, s3_endpoint, tmp_path, monkeypatch):
    """One run on the cluster, every fault domain in turn. ``ray job submit`` (as docs/how-to/cluster.md shows) starts
    a 10-step run at ``--durability node``: a train worker dies at step 2, the shadow at step 4, and at
    step 5 rank 0's whole node is taken down (a spare train node joined first); rank 0 is then held
    during step 7 (the test gate) until the bucket's log segments hold the 7 durable steps, and the job is
    stopped: its driver, sent SIGTERM, writes its summary and ends. Its run directory is deleted (rank 0's scratch lies on the train nodes,
    private to them). ``raycheck run --resume --storage s3://... --out NEW --verify`` on the nodes left
    ends bitwise equal to the failure-free run, every logged step kept. Prints the node failure's
    recovery figures."""
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)  # the resuming driver's (the job's driver has the head's)
    three_nodes.add_node(SPARE_GPU_NODE)
    names = {three_nodes.node_id(name): name for name in ("gpu", "gpu2", "cpu")}
    uri, out, new = bucket_uri(s3_endpoint), tmp_path / "run", tmp_path / "new"
    placement = ["--worker-resource", "train", "--shadow-resource", "replica", "--start-timeout", "120"]
    job_id = f"rc-{uuid.uuid4().hex[:8]}"
    submit = ray_job_submit(three_nodes, "--no-wait", "--submission-id", job_id, "--working-dir", str(REPO),
                            "--runtime-env-json", json.dumps({"env_vars": {"RAYCHECK_TEST_HOLD_AT_STEP": "7"}}), "--",
                            "python", "-m", "raycheck.cli", "run", "--model", "tiny", "--steps", "10", "--eval-samples", "0",
                            "--fail", "2:worker", "--fail", "4:shadow", "--fail", "5:node", "--settle-failures",
                            "--durability", "node", "--snapshot-every", "3", "--storage", uri, "--s3-endpoint", s3_endpoint,
                            *placement, "--out", str(out))
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    jobs, bucket = JobSubmissionClient(three_nodes.dashboard_url), Storage(uri, endpoint_url=s3_endpoint)
    try:
        deadline = time.monotonic() + 600
        while not (any(e["kind"] == "held" for e in RunDir.read(out / "events.jsonl")) and len(read_segments(bucket)[1]) == 7):
            status = jobs.get_job_status(job_id)
            assert time.monotonic() < deadline and status in (JobStatus.PENDING, JobStatus.RUNNING), (
                status, jobs.get_job_logs(job_id)[-4000:])
            time.sleep(0.5)  # waiting for the gate's event and the mirror; rank 0 cannot move past the gate
    finally:
        jobs.stop_job(job_id)
    while (status := jobs.get_job_status(job_id)) not in (JobStatus.STOPPED, JobStatus.FAILED):  # SIGTERM, then SIGKILL
        assert time.monotonic() < deadline + 60, status
        time.sleep(0.5)
    stopped = json.loads((out / "summary.json").read_text())  # ray job stop's SIGTERM ends the driver as Ctrl-C does
    assert (stopped["ok"], stopped["error"], stopped["phase"]) == (False, "Terminated: stopped by SIGTERM", "failed")
    assert "stopped by SIGTERM: the run stopped; resume it with:" in jobs.get_job_logs(job_id)
    events = RunDir.read(out / "events.jsonl")
    assert_the_job_survived_each_failure(three_nodes, names, events)
    held = next(e for e in events if e["kind"] == "held")
    assert held["step"] == held["durable_steps"] == len(read_records(out / "steplog.bin")) == 7
    assert read_segments(bucket)[1] == read_records(out / "steplog.bin")
    wait_until_gone(json.loads((out / "config.json").read_text())["run_id"])
    shutil.rmtree(out)

    ray_train = uri.removesuffix("/run") + "/ray_train"  # Ray Train's storage, in the bucket: every node reaches it
    result = CliRunner().invoke(app, ["run", "--resume", "--verify", "--storage", uri, "--s3-endpoint", s3_endpoint,
                                      "--ray-train-storage", ray_train, *placement, "--out", str(new)])
    summary = json.loads((new / "summary.json").read_text())
    assert result.exit_code == 0, (summary.get("error"), result.output[-3000:])
    assert summary == {**summary, "ok": True, "final_step": 10, "bitwise_equal": True, "shadow_equal": True, "lost_steps": 0}
    assert [e["steps"] for e in RunDir.read(new / "events.jsonl") if e["kind"] == "log_adopted"] == [7]
    assert [m["step"] for m in RunDir.read(new / "metrics.jsonl")] == [7, 8, 9]  # it started after the last durable step
    survivor = [n for n in ("gpu", "gpu2") if three_nodes.processes(n)]
    assert [names[w["node_id"]] for w in summary["placement"]["workers"]] == survivor
    assert [[names[p["node_id"]] for p in shard] for shard in summary["placement"]["shadow_shards"]] == [["cpu"]]
    assert [names[p["node_id"]] for p in summary["placement"]["persister"]] == ["cpu"]
    assert summary["durability"] == {**summary["durability"], "level": "node", "node_held": True}
    assert [p.name for p in new.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()] == []
    reported = summary["ray_train_checkpoint"]  # Result.checkpoint: a pointer in the bucket to the final snapshot
    assert reported == {"path": reported["path"], "snapshot": summary["final_snapshot"], "step": 10}
    assert reported["path"].startswith(ray_train + "/raycheck-")


def ray_job_submit(cluster, *args: str) -> subprocess.CompletedProcess:
    """``ray job submit --address <the cluster's dashboard> ARGS``; "No available agent" (the job agent
    comes up a few seconds after the head) is retried."""
    for _ in range(12):
        proc = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", cluster.dashboard_url, *args], env=cluster.env,
                              capture_output=True, text=True, timeout=300)
        if "No available agent" not in proc.stdout + proc.stderr:
            break
        time.sleep(5)
    return proc


def assert_the_job_survived_each_failure(cluster, names: dict[str, str], events: list[dict]) -> None:
    """The job's three failures fired and each was answered with no logged step lost: the worker's and
    the node's by a restored replacement, the shadow's by its restart. The node failure took down rank
    0's node, whose replacement started on the other train node and rebuilt the steps its local log
    lacked from the log keeper. Prints the node failure's recovery figures."""
    failures = [e for e in events if e["kind"] == "failure"]
    assert [(f["step"], f["target"]) for f in failures] == [(2, "worker"), (4, "shadow"), (5, "worker")], failures
    assert failures[2]["how"] == "node" and failures[0]["how"] != "node"
    assert len([e for e in events if e["kind"] == "shadow_restart"]) == 1
    recoveries = summary_recoveries(events)
    assert [(r["failure_step"], r["lost_steps"]) for r in recoveries] == [(2, 0), (5, 0)], recoveries
    rank0 = [e for e in events if e["kind"] == "step_log"]  # rank 0's three incarnations
    lost, replacement = names[rank0[1]["node_id"]], names[rank0[2]["node_id"]]
    assert {lost, replacement} == {"gpu", "gpu2"}, (lost, replacement)
    # its local log is the one rank 0's first incarnation left there (2 steps) if that ran on the same node, else none
    local = failures[0]["durable_steps"] if rank0[2]["node_id"] == rank0[0]["node_id"] else 0
    assert (rank0[2]["local_steps"], rank0[2]["rebuilt_steps"]) == (local, failures[2]["durable_steps"] - local), rank0
    assert cluster.processes(lost) == [], f"processes of the {lost} node survived its failure"
    assert not next(n for n in ray.nodes() if n["NodeID"] == rank0[1]["node_id"])["Alive"]
    node = recoveries[1]
    print(f"node failure at step 5 ({lost} node): {node['restored_step']} steps restored from {node['source']} "
          f"{node['seconds']:.1f} s after it (restart {node['restart_seconds']:.1f} s, restore {node['restore_seconds']:.2f} s)")


def wait_until_gone(run_id: str) -> None:
    """Wait (bounded) until Ray has removed the stopped job's named actors of run ``run_id``: the resume
    starts actors of the same names."""
    deadline = time.monotonic() + 120
    while any(run_id in a["name"] for a in ray.util.list_named_actors(all_namespaces=True)):
        assert time.monotonic() < deadline, ray.util.list_named_actors(all_namespaces=True)
        time.sleep(0.5)


PLACED = ["--worker-resource", "train", "--shadow-resource", "replica", "--start-timeout", "120"]


def preempted_run(three_nodes, s3_endpoint, tmp_path, spare, *args: str) -> tuple[dict, list[dict], dict[str, str]]:
    """Add the ``spare`` node, then a tiny ``raycheck run --verify`` with ``args`` (its preemptions) on the
    cluster with its snapshots and Ray Train's storage in a bucket; returns its summary, events and node names
    by id, once its Result.checkpoint is checked: a pointer in the bucket to the final snapshot."""
    three_nodes.add_node(spare)
    names = {three_nodes.node_id(n.name): n.name for n in three_nodes.nodes if three_nodes.processes(n.name)}
    out, uri = tmp_path / "run", bucket_uri(s3_endpoint)
    ray_train = uri.removesuffix("/run") + "/ray_train"
    result = run_cli("--steps", "12", "--verify", "--storage", uri, "--s3-endpoint", s3_endpoint, "--ray-train-storage", ray_train,
                     *PLACED, "--out", str(out), *args)
    summary = json.loads((out / "summary.json").read_text())
    assert result.exit_code == 0, (summary.get("error"), result.output[-3000:])
    assert summary == {**summary, "ok": True, "final_step": 12, "bitwise_equal": True, "lost_steps": 0}
    reported = summary["ray_train_checkpoint"]  # Result.checkpoint: a pointer in the bucket to the final snapshot
    assert reported == {"path": reported["path"], "snapshot": summary["final_snapshot"], "step": 12}
    assert reported["path"].startswith(ray_train + "/raycheck-")
    return summary, RunDir.read(out / "events.jsonl"), names


@pytest.mark.raytrain
def test_a_first_order_run_saves_the_current_step_on_a_preemption_notice_and_redoes_no_step(three_nodes, s3_endpoint, tmp_path):
    """Rank 0's node gets a 10 s preemption notice (``ray drain-node``) at step 4 of a layer-wise run that
    checkpoints every 5 steps: the workers commit a just-in-time checkpoint of the steps done at once (a
    composite: every unit not persisted at this step), wait, and restart on the spare node at the deadline
    (the node is taken down then) from it: 0 steps redone, the final state bitwise equal to the failure-free
    run's (layer-wise with threshold 0 is exact). The notice's path is the same for every strategy; each
    strategy's just-in-time save is tested in tests/test_jit_save.py."""
    strategy = "layerwise"
    spare = NodeSpec(f"gpu-{strategy}", num_cpus=2, resources={"train": 2})
    summary, events, names = preempted_run(three_nodes, s3_endpoint, tmp_path, spare, "--algo", "fo", "--strategy", strategy,
                                           "--snapshot-every", "5", "--layer-threshold", "0", "--fail", "4:preempt:10")
    [preemption] = summary["preemptions"]
    assert preemption == {**preemption, "components": ["workers"], "grace_s": pytest.approx(10, abs=1.5), "unsaved": [],
                          "recomputed_steps": 0}, preemption
    [saved] = preemption["saved"]  # of the step the workers had done when Ray Train's watcher told them (it polls every 1 s)
    assert saved["component"] == "workers" and saved["step"] == preemption["restored_step"] > 4, (saved, preemption)
    assert saved["notice_to_safe_seconds"] < 10, saved
    print(f"{strategy}: notice to safe {saved['notice_to_safe_seconds']:.2f} s (grace 10 s)")
    wait_until_taken_down(three_nodes, names[preemption["node_id"]], preemption["deadline_unix_s"])
    assert [w["node_id"] for w in summary["placement"]["workers"]][-1] != preemption["node_id"]


@pytest.mark.raytrain
def test_a_notice_without_grace_falls_back_to_the_newest_committed_checkpoint_and_commits_nothing_partial(
        three_nodes, s3_endpoint, tmp_path):
    """A 0 s notice at step 4 of a full-sync run that checkpoints every 3 steps: Ray ends a node whose drain
    deadline has passed at once, so there is no time to save; the preemption is still recorded (from the
    injected drain). The restart loads a committed checkpoint (the periodic one of step 3, or a
    just-in-time one had it committed in time), redoes the steps after it, and ends bitwise equal; every
    snapshot in the bucket verifies (none half-written)."""
    summary, events, names = preempted_run(three_nodes, s3_endpoint, tmp_path, NodeSpec("gpu-grace0", num_cpus=2, resources={"train": 2}),
                                           "--algo", "fo", "--strategy", "full-sync", "--snapshot-every", "3", "--fail", "4:preempt:0")
    [preemption] = summary["preemptions"]
    assert preemption["grace_s"] == pytest.approx(0, abs=1.5) and preemption["components"] == ["workers"], preemption
    assert preemption["restored_step"] in {3, *(s["step"] for s in preemption["saved"])}, preemption
    cfg = JobConfig.from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
    store = snapshot_store(cfg)
    assert [(info.step, store.verify(info)) for info in store.list()] == [(info.step, []) for info in store.list()]
    wait_until_taken_down(three_nodes, names[preemption["node_id"]], preemption["deadline_unix_s"])
    print(f"grace 0: restored step {preemption['restored_step']}, {preemption['recomputed_steps']} steps redone, "
          f"saved {preemption['saved']}, unsaved {preemption['unsaved']}")


@pytest.mark.raytrain
def test_a_zo_shadow_on_a_preempted_node_hands_its_image_on_and_moves_without_replaying(three_nodes, s3_endpoint, tmp_path):
    """The shadow's node gets a 10 s preemption notice at step 3: the shadow hands its current image to the
    persister (on the same node), which commits it; the shadow starts again on the spare node from that
    snapshot (nothing it had replayed is replayed again) and the persister moves there too; the run ends
    bitwise equal with the shadow equal, no restart counted against the budgets."""
    summary, events, names = preempted_run(three_nodes, s3_endpoint, tmp_path, NodeSpec("cpu2", num_cpus=1, resources={"replica": 8}),
                                           "--durability", "node", "--snapshot-every", "100", "--fail", "3:preempt-shadow:10")
    assert summary["shadow_equal"] is True
    [preemption] = summary["preemptions"]
    assert sorted(preemption["components"]) == ["persister", "shadow 0"] and preemption["unsaved"] == [], preemption
    saved = {s["component"]: s for s in preemption["saved"]}
    assert set(saved) == {"shadow", "persister"} and all(s["notice_to_safe_seconds"] < 10 for s in saved.values()), saved
    handed = next(e for e in events if e["kind"] == "preemption_saved" and e["component"] == "shadow")
    [moved] = [e for e in events if e["kind"] == "shadow_restart"]
    assert (moved["reason"], moved["step"]) == ("preemption", handed["step"]), (moved, handed)
    print(f"shadow hand-off: notice to safe {saved['shadow']['notice_to_safe_seconds']:.2f} s, step {handed['step']}")
    assert [names.get(p["node_id"]) for p in summary["placement"]["persister"]][-1] != names[preemption["node_id"]]
    assert summary["persister_restarts"] == 0
    wait_until_taken_down(three_nodes, names[preemption["node_id"]], preemption["deadline_unix_s"])


def wait_until_taken_down(cluster, node: str, deadline_unix_s: float) -> None:
    """Wait (bounded) until ``node``'s processes are gone: it is taken down at its preemption deadline, which
    a short run ends before."""
    while cluster.processes(node):
        assert time.time() < deadline_unix_s + 30, (f"the {node} node was not taken down at its preemption deadline",
                                                    [(p.pid, p.name(), p.cmdline()[:3]) for p in cluster.processes(node)])
        time.sleep(0.5)


def test_a_node_taken_down_is_dead_to_ray_within_seconds(three_nodes):
    """Runs last in this module: the replica node ("cpu", or the spare that replaced it) stays down. Ray has no notification of a node's death
    to wait on, so this polls its view of the nodes, bounded by the lowered health-check timeouts (about 4 s;
    30 s allows for a loaded machine and still fails under Ray's defaults, about a minute)."""
    @ray.remote(num_cpus=0, resources={"replica": 1})
    def node_id() -> str:
        return ray.get_runtime_context().get_node_id()

    cpu_node = ray.get(node_id.remote(), timeout=60)
    name = next(n.name for n in three_nodes.nodes if three_nodes.processes(n.name) and three_nodes.node_id(n.name) == cpu_node)
    t0 = time.monotonic()
    three_nodes.kill_node(name)
    assert three_nodes.processes(name) == []
    while next(n for n in ray.nodes() if n["NodeID"] == cpu_node)["Alive"]:
        assert time.monotonic() - t0 < 30, "Ray still counts the node alive (Ray's default health checks take about a minute)"
        time.sleep(0.2)


@pytest.mark.raytrain
def test_your_own_zo_loop_submitted_to_the_cluster_recovers_a_worker_failure_bitwise(three_nodes, s3_endpoint, tmp_path):
    """``examples/own_loop_zo.py`` (your model, loss and loop; ``run_own_loop``) under ``ray job submit``: its
    train worker on the "gpu" node, the shadow and persister on the others, snapshots in a bucket; the
    worker exits in step 4 and its replacement restores: bitwise equal to the failure-free run. Ray Train's
    storage in a bucket too (``--ray-train-storage``): ``Result.checkpoint`` points to the final snapshot."""
    out, storage = tmp_path / "own-zo", bucket_uri(s3_endpoint)
    ray_train = storage.removesuffix("/run") + "/ray_train"
    submit = ray_job_submit(three_nodes, "--working-dir", str(REPO), "--", "python", "examples/own_loop_zo.py", "--out", str(out),
                            "--steps", "10", "--fail-step", "4", "--verify", "--storage", storage, "--s3-endpoint", s3_endpoint,
                            "--ray-train-storage", ray_train)
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary == {**summary, "ok": True, "final_step": 10, "bitwise_equal": True, "lost_steps": 0}
    [recovery] = summary["recoveries"]
    assert recovery["failure_step"] == 4 and recovery["restored_step"] == 4
    head = this_node()["node_id"]
    assert all(w["node_id"] != head for w in summary["placement"]["workers"]) and summary["config"]["model"] == "module:Regressor"
    # Ray Train's storage is a bucket: Result.checkpoint is a pointer there to the final snapshot, and loads it (the
    # example exits 1 otherwise)
    assert summary["final_snapshot"].startswith(storage + "/step-0000000010-")
    reported = summary["ray_train_checkpoint"]
    assert reported == {"path": reported["path"], "snapshot": summary["final_snapshot"], "step": 10}
    assert reported["path"].startswith(ray_train + "/raycheck-") and summary["config"]["storage"]["ray_train"] == ray_train


def test_your_own_fo_loop_submitted_to_the_cluster_recovers_a_ddp_worker_failure_bitwise(three_nodes, s3_endpoint, tmp_path):
    """``examples/own_loop_fo.py`` (your model, loss, AdamW and Ray Train loop; ``FirstOrderCheckpoints``)
    under ``ray job submit`` with Ray Train's storage in a bucket: 2 DDP workers on the nodes without the
    driver's disk, rank 0 exits in step 6, the group restarts and restores the layer-wise checkpoint of step
    4 from the bucket: bitwise equal to the failure-free run; ``Result.checkpoint`` is a pointer in the bucket
    (Ray Train's experiment directory) to the newest committed snapshot, and loads the final state."""
    storage = bucket_uri(s3_endpoint)
    submit = ray_job_submit(three_nodes, "--working-dir", str(REPO), "--", "python", "examples/own_loop_fo.py", "--out",
                            str(tmp_path / "own-fo"), "--steps", "10", "--every", "4", "--fail-step", "6", "--workers", "2",
                            "--verify", "--storage", storage, "--s3-endpoint", s3_endpoint)
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    start = submit.stdout.index("{\n")  # the printed summary; the workers' log lines follow it
    summary = json.loads(submit.stdout[start:submit.stdout.index("\n}\n", start) + 2])
    assert summary == {**summary, "recovery": "exact", "bitwise_equal": True, "worker_starts": 2, "restored_from_steps": [4],
                       "result_checkpoint_is_newest": True, "result_checkpoint_loads_final_state": True}
    assert summary["result_checkpoint"].startswith(storage.removeprefix("s3://") + "/failing/step-0000000010-")
    assert summary["checkpoints"] == f"{storage}/failing/raycheck"
