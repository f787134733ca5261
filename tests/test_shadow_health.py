"""A shadow whose replay thread died counts as failed (plain, no Ray), and the driver writes a summary
whatever fails inside the run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from raycheck.actors.shadow import ShadowSpec
from raycheck.actors.shadow_actor import ShadowActor
from raycheck.orchestrator.control import SHADOW_RESUME_HINT, FailRun, RestartShadow, ShardStatus, shard_action
from raycheck.orchestrator.shadow_keeper import failure_reason
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.steplog import StepLogWriter, StepRecord
from raycheck.training.model import default_cache_dir, layout_sha256, parameter_layout, trainable_parameters
from raycheck.training.zo import GENERATOR


def record(step: int) -> StepRecord:
    return StepRecord(step=step, seed=900 + step, projected_grad=0.37, loss_plus=0.7, loss_minus=0.69,
                      lr=1e-3, eps=1e-3, weight_decay=0.0, batch_id=step)


@pytest.fixture()
def gapped_log(tmp_path, tiny_model):
    """A step log of the tiny model holding step 0, then step 2: replay must stop at the gap."""
    layout = parameter_layout(trainable_parameters(tiny_model))
    writer = StepLogWriter.create(tmp_path / "steplog.bin", {"layout_sha256": layout_sha256(layout), "generator": GENERATOR,
                                                               "model": "tiny"})
    writer.append(record(0))
    os.write(writer._fd, record(2).bound(writer.tag, writer.path).encode())  # what a broken writer would leave
    writer.close()
    return tmp_path / "steplog.bin"


def test_a_shadow_whose_replay_thread_died_reports_it_and_the_keeper_restarts_it(tmp_path, gapped_log):
    threads = torch.get_num_threads()
    spec = ShadowSpec(model="tiny", cache_dir=str(default_cache_dir()), log_path=str(gapped_log),
                      store=SnapshotStore(str(tmp_path / "snapshots")), persister_name=None, snapshot_every_steps=0)
    shadow = ShadowActor(spec)
    try:
        with pytest.raises(RuntimeError, match=r"shadow replay failed: StepLogGapError: .*steps 1..1 are missing"):
            shadow.image(2, timeout_s=60)  # wakes on the replay thread's error: no timing involved
        status = shadow.status()
    finally:
        shadow.stop()
        torch.set_num_threads(threads)
    assert status["step"] == 0 and status["error"].startswith("StepLogGapError")  # the gap is seen before step 0 is replayed
    assert failure_reason(status) == f"replay thread died: {status['error']}"
    failed = ShardStatus(shard=0, restarts=0, failure=failure_reason(status))
    assert shard_action(failed, sharded=False, max_restarts=10, recovery_pending=False) == RestartShadow(0)


def test_the_keeper_decision_bounds_restarts_and_waits_for_a_pending_recovery():
    healthy = {"step": 5, "error": None}
    assert failure_reason(healthy) is None and failure_reason(None) == "actor died"
    assert shard_action(ShardStatus(0, 0, failure_reason(healthy)), False, 10, recovery_pending=False) is None
    dead = ShardStatus(0, 3, failure_reason(None))
    assert shard_action(dead, False, 10, recovery_pending=False) == RestartShadow(0)
    assert shard_action(dead, False, 10, recovery_pending=True) is None  # a worker recovery needs the shadow as it was
    assert shard_action(ShardStatus(1, 10, failure_reason({"error": "x"})), True, 10, recovery_pending=True) == FailRun(
        "shadow", "shadow shard 1 failed after 10 restarts (max_shadow_restarts 10): replay thread died: x" + SHADOW_RESUME_HINT)
    assert shard_action(ShardStatus(0, 0, "actor died"), False, 0, recovery_pending=False) == FailRun(
        "shadow", "the shadow failed after 0 restarts (max_shadow_restarts 0): actor died" + SHADOW_RESUME_HINT)
    assert shard_action(ShardStatus(0, 10**6, "actor died"), False, -1, recovery_pending=False) == RestartShadow(0)  # -1: unlimited


def test_the_driver_writes_a_failed_summary_and_exits_non_zero_when_the_run_raises(tmp_path, monkeypatch):
    import ray
    from typer.testing import CliRunner

    import raycheck.orchestrator.controller
    from raycheck.cli.main import app

    def cluster_fails(*args, **kwargs):
        raise RuntimeError("injected: the cluster did not start")

    monkeypatch.setattr(raycheck.orchestrator.controller, "connect", cluster_fails)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "4", "--eval-samples", "0", "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert "error: training failed: RuntimeError: injected: the cluster did not start" in result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False and summary["phase"] == "failed"
    assert summary["error"] == "RuntimeError: injected: the cluster did not start"
    assert summary["final_step"] is None and summary["config"]["steps"] == 4
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert events[-1]["kind"] == "phase" and events[-1]["phase"] == "failed"
    assert not ray.is_initialized()
