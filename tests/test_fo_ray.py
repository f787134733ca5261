"""First-order training end to end under Ray Train (tiny model, real snippets): DDP over gloo with
differential checkpoints, with the full-state baselines and with overlapped snapshots recovers bitwise; a merged checkpoint
resumes and layer-wise recovery works.

Failures hit a settled run (workers/faults.py): every rank waits until rank 0's background
checkpoint writes are committed before the failing rank dies, so what each recovery restores
follows from the failure step."""

from __future__ import annotations

import pathlib

import pytest
import ray

from conftest import free_port
from raycheck.job.config import FailureSpec, JobConfig
from raycheck.orchestrator.controller import Controller
from raycheck.storage.merge import Source, merge_snapshots, parse_take
from raycheck.storage.snapshots import SnapshotStore
from test_fo import make_trainer, train
from raycheck.training.model import default_cache_dir
from raycheck.training.state import copy_state

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="raycheck", _metrics_export_port=free_port())
    yield
    ray.shutdown()


def fo_job(out: pathlib.Path, name: str, failures: str = "", **kw) -> dict:
    """Run a first-order job with ``failures`` and ``kw`` (``JobConfig.replace``: a component's dict merges)."""
    cfg = JobConfig(out_dir=str(out), cache_dir=str(default_cache_dir()), model="tiny", algo="fo", steps=10, batch_size=8, seq_len=32,
                    eval_samples=16, hash_every_steps=2, run_id=name, fo={"lr": 1e-3}).replace(
        **{"faults.settle_failures": True, "faults.failures": tuple(FailureSpec.parse(f) for f in failures.split())}, **kw)
    summary = Controller(cfg, echo=lambda _: None).run()
    assert summary["ok"], summary["error"]
    return summary


DDP = dict(workers=2, differential={"full_every_steps": 4, "batch_steps": 2})


@pytest.fixture(scope="module")
def ddp_reference(cluster, tmp_path_factory):
    """The failure-free two-worker run (the checkpointing strategy does not change the trajectory)."""
    reference = fo_job(tmp_path_factory.mktemp("ref"), "fo-ref", strategy="differential", **DDP)
    assert reference["recoveries"] == [] and len(reference["worker_hashes"]) == 5
    return reference


def assert_bitwise(failed: dict, reference: dict) -> None:
    assert failed["final_step"] == reference["final_step"] == 10
    assert failed["state_sha256"] == reference["state_sha256"]  # weights and AdamW state, bitwise
    assert failed["worker_hashes"] == reference["worker_hashes"]  # every 2 steps


def test_two_ddp_workers_with_differential_checkpoints_recover_bitwise(ddp_reference, tmp_path):
    """Rank 1 dies during step 7: the full checkpoint of step 4 plus the committed gradient
    records of steps 5 and 6 (one object per 2 steps) restore step 6; step 7 is recomputed."""
    failed = fo_job(tmp_path, "fo-diff", "7:worker", strategy="differential", **DDP)
    assert_bitwise(failed, ddp_reference)
    assert [(r["source"], r["failure_step"], r["base_step"], r["replayed_steps"], r["restored_step"], r["lost_steps"],
             r["recompute_steps"]) for r in failed["recoveries"]] == [("storage", 7, 4, 2, 6, 0, 1)]


@pytest.mark.parametrize("strategy, restored, last", [("full-async", 6, 10), ("overlapped", 7, 10)])
def test_two_ddp_workers_with_full_state_baselines_recover_bitwise(ddp_reference, tmp_path, strategy, restored, last):
    """Rank 1 dies during step 7; a checkpoint begins every 3 steps. Full: restored at 6, step 6
    recomputed (full-sync differs only in ``FullCheckpointer(asynchronous=False)``, tested without Ray in
    ``tests/test_staging.py``; its restore is this one). Overlapped in 2 chunks (GoCkpt): the snapshot begun after step 6 is the state after
    step 7 (its first chunk caught up with step 6's DDP-averaged gradients), nothing recomputed; the one
    begun after the last step is completed by ``close``. Full: ``close`` commits the state of the last step
    (10, off the interval), the run's trained state (``FirstOrderCheckpoints.close``)."""
    failed = fo_job(tmp_path, f"fo-{strategy}", "7:worker", strategy=strategy, snapshot={"every_steps": 3}, overlapped={"chunks": 2}, **DDP)
    assert_bitwise(failed, ddp_reference)
    assert [(r["source"], r["failure_step"], r["restored_step"], r["lost_steps"], r["recompute_steps"])
            for r in failed["recoveries"]] == [("storage", 7, restored, 0, 7 - restored)]
    assert failed["worker_checkpoints"]["last_step"] == last and failed["checkpoint_block_seconds_total"] > 0


def test_a_merged_checkpoint_resumes_and_layerwise_recovery_restores_the_composite(cluster, tmp_path, encoder, data):
    sources = []
    for name, seed, steps in (("A", 0, 4), ("B", 1, 6)):  # two first-order runs, full checkpoints at steps 4 and 6
        trainer = make_trainer(encoder)
        train(trainer, data[0], 0, steps, seed=seed)
        store = SnapshotStore(str(tmp_path / name))
        store.write(steps, copy_state(trainer.state_view()))
        sources.append(Source(name, store))
    out = tmp_path / "run"
    merge_snapshots(sources, [parse_take("0,embed:A"), parse_take("1,norm:B")], SnapshotStore(str(out / "snapshots")))
    summary = fo_job(out, "fo-merged", "9:worker", strategy="layerwise", steps=12, snapshot={"every_steps": 2},
                     layerwise={"threshold": 0.01, "staleness_bound_steps": 4})
    first, second = summary["recoveries"]
    assert (first["source"], first["base_step"], first["restored_step"]) == ("storage", 6, 6)  # started from the merge
    assert "failure_step" not in first
    assert (second["source"], second["failure_step"], second["lost_steps"]) == ("storage", 9, 0)
    assert second["restored_step"] in (6, 7, 8)  # the newest committed check (the one due at 8 is written in the
    # background, and a check that comes due while the writer is behind runs a step later: training.layerwise)
    assert summary["final_step"] == 12
    final = SnapshotStore(str(out / "snapshots")).list()[-1]
    assert final.step == 12 and max(u["step"] for u in final.manifest["units"].values()) == 12
