"""Elastic and exact on a cluster of nodes (``experiments/local_cluster.py``): a 2-worker run loses a node, goes on
with 1 worker, grows back to 2 when a node joins, and ends with the bits of the 2-worker failure-free run."""

from __future__ import annotations

import pathlib
import threading
import time

import pytest
import ray

from raycheck.experiments.local_cluster import LocalCluster, NodeSpec
from conftest import make_bucket
from raycheck.job.config import FailureSpec, JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.orchestrator.controller import Controller
from raycheck.orchestrator.runs import reference_config
from raycheck.training.model import default_cache_dir

pytestmark = [pytest.mark.ray, pytest.mark.raytrain, pytest.mark.multinode]

TRAIN_NODES = (NodeSpec("a", num_cpus=2, resources={"train": 1}), NodeSpec("b", num_cpus=2, resources={"train": 1}))
"""One train worker slot each (one unit of ``train``): a lost node leaves one slot."""
REPLICAS = NodeSpec("cpu", num_cpus=1, resources={"replica": 8})
JOINING = NodeSpec("c", num_cpus=2, resources={"train": 1})
HOLD_STEP = 6


@pytest.fixture(scope="module")
def elastic_cluster(tmp_path_factory):
    cluster = LocalCluster((*TRAIN_NODES, REPLICAS), [tmp_path_factory.getbasetemp()]).start()
    yield cluster
    cluster.stop()


def test_a_run_shrinks_to_one_worker_grows_back_to_two_and_stays_exact(elastic_cluster, s3_endpoint, tmp_path, monkeypatch):
    """``--workers 2 --min-workers 1``: rank 0 takes down its node during step 3 (durability node: nothing
    logged is lost); one train node is left, so Ray Train restarts the group with 1 worker. Rank 0 of
    that group is held during step 6 (the test gate, once per run) until node c has joined; Ray Train
    then resizes to 2 workers, which restore step 6 and finish. Equal to the failure-free 2-worker run.

    After the node is lost, Ray Train first tries the old worker count on the dead node's reserved
    resources and shrinks only when that start times out: 20 s here instead of Ray's 60 s default
    (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, which Ray Train hands from the driver to its controller)."""
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20")
    bucket = "rc-elastic"
    make_bucket(s3_endpoint, bucket)
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(default_cache_dir()), model="tiny", steps=10, batch_size=8,
                    workers=2, hash_every_steps=2,
                    eval_samples=0, durability="node",
                    placement={"worker_resource": "train", "shadow_resource": "replica"},
                    run_id="elastic",
                    zo={"micro_batch_size": 4, "lr": 1e-4},
                    elastic={"min_workers": 1, "resize_interval_s": 2.0},
                    snapshot={"every_steps": 3},
                    faults={"settle_failures": True, "failures": (FailureSpec.parse("3:node"),)},
                    storage={"uri": f"s3://{bucket}/run", "options": {"endpoint_url": s3_endpoint}})
    ray.init(address=elastic_cluster.address, namespace="raycheck", log_to_driver=False)
    try:
        ref = Controller(reference_config(cfg).replace(elastic={"min_workers": 0}), echo=lambda _: None).run()
    finally:
        ray.shutdown()
    assert ref["ok"], ref["error"]

    ray.init(address=elastic_cluster.address, namespace="raycheck", log_to_driver=False,
             runtime_env={"env_vars": {"RAYCHECK_TEST_HOLD_AT_STEP": str(HOLD_STEP)}})
    try:
        done: dict = {}
        run = threading.Thread(target=lambda: done.update(Controller(cfg, echo=lambda _: None).run()))
        run.start()
        events = pathlib.Path(cfg.out_dir) / "events.jsonl"
        deadline = time.monotonic() + 900
        while not (events.exists() and any(e["kind"] == "held" for e in RunDir.read(events))):
            assert run.is_alive() and time.monotonic() < deadline, done.get("error")
            time.sleep(0.5)  # waiting for the gate's event: rank 0 cannot move past it
        elastic_cluster.add_node(JOINING)
        run.join(timeout=900)
    finally:
        ray.shutdown()
    assert done["ok"], done["error"]
    assert done["state_sha256"] == ref["state_sha256"] and done["worker_hashes"] == ref["worker_hashes"]
    assert done["shadow_equal"] and done["lost_steps"] == 0
    started = [(e["world"], e["rank"]) for e in RunDir.read(events) if e["kind"] == "placement" and e["component"] == "worker"]
    worlds = [w for w, rank in started if rank == 0]
    assert worlds == [2, 1, 2] and sorted(started) == [(1, 0), (2, 0), (2, 0), (2, 1), (2, 1)]
    held = next(e for e in RunDir.read(events) if e["kind"] == "held")
    assert held["step"] == held["durable_steps"] == HOLD_STEP
    assert [(r["at_step"], r["restored_step"]) for r in done["recoveries"]] == [(3, 3), (HOLD_STEP, HOLD_STEP)]
