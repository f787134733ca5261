"""The worker count does not change a MeZO trajectory (example groups, ``training.groups``), on a local Ray
cluster: a 1-worker and a 2-worker run of one configuration end with the same bits (sha256 of every
tensor). ``tests/test_groups.py::test_the_groups_decide_the_trajectory_so_the_worker_count_check_can_fail``
shows that the comparison can fail (one group against two: other bits from the first step)."""

from __future__ import annotations

import pytest
import ray

from conftest import free_port
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

