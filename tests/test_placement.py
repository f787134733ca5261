"""Placement of a run's processes on a cluster (``orchestrator.cluster.plan_placement``, pure) and the
storage settings every process gets (``runtime_env``)."""

from __future__ import annotations

from raycheck.orchestrator.cluster import NODE_ID_LABEL, Node, Placement, plan_placement, runtime_env
from raycheck.storage.backend import STORAGE_ENV

HEAD = Node("head", "10.0.0.1", {"driver": 1.0})
GPU = Node("gpu", "10.0.0.2", {"CPU": 8.0, "GPU": 2.0, "train": 2.0})
CPU_A = Node("cpu-a", "10.0.0.3", {"CPU": 4.0, "replica": 8.0})
CPU_B = Node("cpu-b", "10.0.0.4", {"CPU": 2.0})


def plan(nodes, workers=1, use_gpu=False, **options) -> Placement:
    return plan_placement(nodes, driver_node_id="head", workers=workers, use_gpu=use_gpu, **options)


def test_the_replicas_never_go_where_a_train_worker_can_unless_every_node_is_needed():
    assert plan([CPU_A]) == Placement({}, None, None, "one node: everything on it")
    # GPU workers: the replicas go to every node without a GPU (the head and the CPU nodes)
    assert plan([HEAD, GPU, CPU_A], use_gpu=True).replica == {"label_selector": {NODE_ID_LABEL: "!in(gpu)"}}
    # CPU workers: the head (no CPU) cannot host one
    assert plan([HEAD, GPU, CPU_A]).replica == {"label_selector": {NODE_ID_LABEL: "!in(gpu,cpu-a)"}}
    # a worker resource: only the nodes that offer it host workers, and each worker asks one unit of it
    placed = plan([GPU, CPU_A, CPU_B], worker_resource="train")
    assert placed == Placement({"label_selector": {NODE_ID_LABEL: "!in(gpu)"}}, {"CPU": 1.0, "train": 1.0}, None,
                               "replicas on the nodes that cannot host a train worker")
    # every node can host a worker: the one holding the fewest is kept for the replicas, the workers kept off it
    placed = plan([GPU, CPU_A, CPU_B], workers=3)
    assert (placed.replica, placed.worker_label_selector) == ({"label_selector": {NODE_ID_LABEL: "cpu-b"}},
                                                              {NODE_ID_LABEL: "!in(cpu-b)"})
    # ... unless the workers need it too
    assert plan([CPU_A, CPU_B], workers=5).replica == {}
    assert "may share rank 0's node" in plan([CPU_A, CPU_B], workers=5).policy
    # the operator's resources win
    assert plan([HEAD, GPU, CPU_A], replica_resource="replica", worker_resource="train", use_gpu=True) == Placement(
        {"resources": {"replica": 1}}, {"GPU": 1.0, "train": 1.0}, None, "replicas on nodes with resource 'replica'")


def test_every_process_gets_the_drivers_storage_settings_and_nothing_else(monkeypatch):
    for name in STORAGE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "t0ken")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/root/.aws/credentials")  # a file: it stays on this machine
    assert runtime_env({"X": "1"}) == {"env_vars": {"AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_SESSION_TOKEN": "t0ken", "X": "1"}}


def test_the_worker_group_gets_the_placement_and_the_runs_failure_budget_not_the_injected_count(tmp_path):
    """Ray Train's worker group (``orchestrator.trainer.trainer``, built without Ray) restarts at most
    ``faults.max_worker_failures`` times, whatever the injected failures: a real run's budget must not depend on them."""
    from raycheck.job.config import FailureSpec, JobConfig
    from raycheck.orchestrator.trainer import trainer

    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", faults={"failures": (FailureSpec.parse("2:worker"),)})
    for budget in (10, -1, 3):
        group = trainer(cfg.replace(faults={"max_worker_failures": budget}), {}, plan([HEAD, GPU, CPU_A], worker_resource="train"))
        assert group.run_config.failure_config.max_failures == budget
        assert group.scaling_config.resources_per_worker == {"CPU": 1.0, "train": 1.0}
    assert JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny").faults.max_worker_failures == 10
