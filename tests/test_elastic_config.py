"""What Ray Train is given for replica groups and elastic runs (``orchestrator.trainer.trainer``, built without Ray),
and the refusals of ``min_workers``."""

from __future__ import annotations

import pytest

from raycheck.job.config import JobConfig
from raycheck.orchestrator.cluster import Placement
from raycheck.orchestrator.trainer import trainer
from raycheck.orchestrator.replica_groups import ReplicaGroupsBackend, ReplicaGroupsConfig


def trainer_for(cfg: JobConfig):
    return trainer(cfg, {}, Placement({}, None, None, "one node: everything on it"))


def test_two_workers_are_two_replica_groups_and_an_elastic_run_gets_a_worker_range(tmp_path):
    base = dict(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", batch_size=8, run_id="r", writer_epoch=3)
    fixed = trainer_for(JobConfig(**base, workers=2))
    assert isinstance(fixed.backend_config, ReplicaGroupsConfig) and fixed.backend_config.backend_cls is ReplicaGroupsBackend
    assert ReplicaGroupsBackend.has_replica_groups
    assert (fixed.backend_config.exchange_name, fixed.backend_config.world) == ("raycheck-exchange-r-3", 2)
    assert fixed.scaling_config.num_workers == 2
    one = trainer_for(JobConfig(**base))
    assert type(one.backend_config) is not ReplicaGroupsConfig and one.scaling_config.num_workers == 1
    fo = trainer_for(JobConfig(**base, workers=2, algo="fo"))
    assert type(fo.backend_config) is not ReplicaGroupsConfig  # its gradients all-reduce over torch.distributed
    elastic = trainer_for(JobConfig(**base, workers=2, elastic={"min_workers": 1, "resize_interval_s": 5.0}))
    assert elastic.scaling_config.num_workers == (1, 2) and elastic.scaling_config.elastic_resize_monitor_interval_s == 5.0
    assert type(elastic.backend_config) is not ReplicaGroupsConfig  # Ray 2.60: replica groups are not elastic


def test_min_workers_is_refused_where_the_losses_would_depend_on_the_worker_count(tmp_path):
    base = dict(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", batch_size=8, workers=2)
    with pytest.raises(ValueError, match=r"min_workers must be in \[1, workers \(2\)\], or 0 for a fixed worker count, got 3"):
        JobConfig(**base, elastic={"min_workers": 3})
    with pytest.raises(ValueError, match="min_workers 1 \\(elastic\\) needs algo zo with a step log .* \\(this run: fo layerwise\\)"):
        JobConfig(**base, algo="fo", elastic={"min_workers": 1})
    with pytest.raises(ValueError, match="elastic.resize_interval_s must be a finite number > 0"):
        JobConfig(**base, elastic={"min_workers": 1, "resize_interval_s": 0})
    assert not JobConfig(**base, elastic={"min_workers": 2}).is_elastic and JobConfig(**base, elastic={"min_workers": 1}).is_elastic
