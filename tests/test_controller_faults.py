"""The controller on a local Ray cluster when its shadow keeps failing: bounded restarts, then a failed run
that still writes ``summary.json`` and kills its actors. No Ray Train: the trainer is replaced by one
that leaves a gap in a step log file (what a broken writer would leave; the log keeper refuses gaps, so
the shadow follows that file instead of the keeper) and then blocks, so the run can only end through
the shadow's failures."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import uuid

import pytest
import ray
from ray.exceptions import RayActorError

from conftest import free_port
from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
import raycheck.orchestrator.controller
from raycheck.job.names import log_keeper_name, persister_name, shadow_name
from raycheck.orchestrator.controller import Controller
from raycheck.storage.steplog import StepLogWriter, StepRecord, read_header
from raycheck.training.model import default_cache_dir

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="raycheck", _metrics_export_port=free_port())
    yield
    ray.shutdown()


def record(step: int) -> StepRecord:
    return StepRecord(step=step, seed=900 + step, projected_grad=0.37, loss_plus=0.7, loss_minus=0.69,
                      lr=1e-3, eps=1e-3, weight_decay=0.0, batch_id=step)


class GapTrainer:
    """Appends step 0, then step 2, to the step log file ``path``; then blocks until ``release`` is set."""

    def __init__(self, path, release: threading.Event) -> None:
        self.path, self.release = path, release

    def fit(self) -> None:
        writer = StepLogWriter.open(self.path)
        writer.append(record(0))
        os.write(writer._fd, record(2).bound(writer.tag, writer.path).encode())
        writer.close()
        self.release.wait(600)


def dead(name: str) -> bool:
    try:
        handle = ray.get_actor(name, namespace="raycheck")
    except ValueError:
        return True
    try:
        ray.get(handle.status.remote(), timeout=60)
    except RayActorError:
        return True
    return False


def test_a_shadow_that_keeps_failing_is_restarted_within_its_budget_then_the_run_fails_with_a_summary(
        cluster, tmp_path, monkeypatch):
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(default_cache_dir()), model="tiny", steps=4, eval_samples=0,
                    run_id=f"gap-{uuid.uuid4().hex[:6]}", faults={"max_shadow_restarts": 1})
    release = threading.Event()
    gapped = tmp_path / "gapped.bin"
    spec = Controller._shadow_spec

    def file_spec(self: Controller):  # the run's header (prepare wrote it by now), in a file the shadow follows
        StepLogWriter.create(gapped, read_header(self.run_dir.step_log)).close()
        return dataclasses.replace(spec(self), log_keeper_name="", log_path=str(gapped))

    monkeypatch.setattr(Controller, "_shadow_spec", file_spec)
    monkeypatch.setattr(raycheck.orchestrator.controller, "trainer", lambda cfg, shipped, placement, loop: GapTrainer(gapped, release))
    try:
        returned = Controller(cfg, echo=lambda _: None).run()
    finally:
        release.set()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["error"] == returned["error"] and summary["ok"] is False and summary["phase"] == "failed"
    assert summary["error"].startswith("ShadowFailedError: the shadow failed after 1 restarts (max_shadow_restarts 1): "
                                       "replay thread died: StepLogGapError")
    [restart] = summary["shadow_restarts"]
    assert restart["incarnation"] == 1 and restart["reason"].startswith("replay thread died: StepLogGapError")
    assert restart["source"] == "initial" and restart["step"] == 0
    events = RunDir(tmp_path / "run").read(RunDir(tmp_path / "run").events)
    assert [e["kind"] for e in events if e["kind"] in ("shadow_restart", "phase")][-2:] == ["shadow_restart", "phase"]
    assert all(dead(name) for name in (f"{shadow_name(cfg)}-0", f"{shadow_name(cfg)}-1", persister_name(cfg), log_keeper_name(cfg)))
