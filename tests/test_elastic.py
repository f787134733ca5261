"""The worker count does not change a MeZO trajectory (example groups, ``training.groups``), on a local Ray
cluster: a 1-worker and a 2-worker run of one configuration end with the same bits (sha256 of every
tensor). ``tests/test_groups.py::test_the_groups_decide_the_trajectory_so_the_worker_count_check_can_fail``
shows that the comparison can fail (one group against two: other bits from the first step)."""

from __future__ import annotations

import pathlib

import pytest
import ray

from conftest import free_port
from orchestrator.run_dir import RunDir
from test_end_to_end import job

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]
GROUPED = dict(steps=6, micro_batch_size=4, hash_every=2, eval_samples=0)  # batch 8: two example groups


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="raycheck", _metrics_export_port=free_port())
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def one_worker(cluster, tmp_path_factory) -> dict:
    """The failure-free 1-worker run of the grouped configuration."""
    return job(tmp_path_factory, "one", workers=1, **GROUPED)


def test_one_and_two_workers_end_with_the_same_bits(one_worker, tmp_path_factory):
    two = job(tmp_path_factory, "two", workers=2, **GROUPED)
    assert two["state_sha256"] == one_worker["state_sha256"] and two["worker_hashes"] == one_worker["worker_hashes"]
    assert len(set(one_worker["worker_hashes"].values())) == 3  # after steps 2, 4, 6: the state moved
    assert two["shadow_equal"] and one_worker["shadow_equal"]
    assert two["trajectory_sha256"] == one_worker["trajectory_sha256"]
    assert sorted(p["rank"] for p in two["placement"]["workers"]) == [0, 1]


def test_a_failed_worker_is_replaced_alone_and_the_run_stays_exact(one_worker, tmp_path_factory):
    """Each worker its own replica group (``orchestrator.replica_groups``): rank 1 dies during step 3,
    Ray Train replaces it alone; rank 0's process (its pid) goes on through the failure, waiting at the
    step exchange until the replacement has restored step 3 from the shadow and scored its groups."""
    s = job(tmp_path_factory, "replaced", "3:worker:exit", workers=2, **GROUPED)
    assert s["state_sha256"] == one_worker["state_sha256"] and s["worker_hashes"] == one_worker["worker_hashes"]
    assert s["shadow_equal"]
    assert [(f["step"], f["target"]) for f in s["failures"]] == [(3, "worker")]
    assert [(r["failure_step"], r["source"], r["restored_step"]) for r in s["recoveries"]] == [(3, "object_store", 3)]
    started = [e for e in RunDir.read(RunDir(pathlib.Path(s["config"]["out_dir"])).events) if e["kind"] == "placement"
               and e["component"] == "worker"]
    pids = {rank: [e["pid"] for e in started if e["rank"] == rank] for rank in (0, 1)}
    assert len(pids[0]) == 1  # rank 0 started once: its process survived the failure
    assert len(pids[1]) == 2 and pids[1][0] != pids[1][1] and pids[0][0] not in pids[1]
