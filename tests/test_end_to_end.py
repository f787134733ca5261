"""The main job end to end on a local Ray cluster: tiny model, real snippets, injected failures.

Every claim of exactness is a sha256 over every tensor, compared with a failure-free reference run.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import pyarrow.parquet as pq
import pytest
import ray
from moto.server import ThreadedMotoServer
from typer.testing import CliRunner

from conftest import free_port, make_bucket
from experiments.s3_server import LocalS3Server
from orchestrator.cli import app
from orchestrator.config import FailureSpec, JobConfig
from orchestrator.run_dir import RunDir
from storage.steplog import read_records
from orchestrator.schedule import failure_schedule
from orchestrator.controller import Controller
from training.model import default_cache_dir

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]
SEED = 0  # poisson:2 over 12 steps with this seed fails at 6 distinct steps


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="raycheck", _metrics_export_port=port)
    yield port
    ray.shutdown()


SETTINGS = dict(model="tiny", steps=12, batch_size=8, seq_len=32, lr=1e-4, eval_samples=16, hash_every=2, snapshot_every=3)


def job(tmp_path_factory, name: str, failures: str = "", outage=None, **kw) -> dict:
    settings = dict(SETTINGS, run_id=name, failures=tuple(FailureSpec.parse(f) for f in failures.split()))
    cfg = JobConfig(out_dir=str(tmp_path_factory.mktemp(name)), cache_dir=str(default_cache_dir()), **{**settings, **kw})
    summary = Controller(cfg, echo=lambda _: None, storage_outage=outage).run()
    assert summary["ok"], summary["error"]
    return summary


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    return job(tmp_path_factory, "ref")


def assert_exact(summary: dict, reference: dict) -> None:
    assert summary["final_step"] == reference["final_step"] == 12
    assert summary["state_sha256"] == reference["state_sha256"]
    assert summary["worker_hashes"] == reference["worker_hashes"]  # every 2 steps, not only at the end
    if summary["strategy"] == "shadow":
        assert summary["shadow_equal"] and summary["shadow_state_sha256"] == reference["state_sha256"]
    assert summary["lost_steps"] == 0


def test_reference_shadow_matches_worker_every_k_steps(reference):
    assert len(reference["worker_hashes"]) == 6
    assert reference["shadow_hashes"] == reference["worker_hashes"]
    assert reference["recoveries"] == [] and reference["failures"] == []
    assert reference["snapshots"]["written"] >= 1 and reference["snapshots"]["failed"] == 0


def test_metrics_reach_the_prometheus_endpoint(cluster, reference):
    """The controller's series are scraped from the node's metrics export port (what dashboards read)."""
    wanted = {"ray_raycheck_steps_total": 12.0, "ray_raycheck_snapshot_interval_steps": 3.0}
    deadline, found = time.monotonic() + 90, {}
    while time.monotonic() < deadline and found != wanted:  # exports lag the run by up to ~10 s
        body = urllib.request.urlopen(f"http://127.0.0.1:{cluster}/metrics", timeout=10).read().decode()
        for line in body.splitlines():
            name = line.split("{")[0]
            if name in wanted and 'run="ref"' in line and 'strategy="shadow"' in line:
                found[name] = float(line.rsplit(" ", 1)[1])
        time.sleep(2)
    assert found == wanted
    for name in ("ray_raycheck_shadow_lag_steps", "ray_raycheck_snapshot_age_steps", "ray_raycheck_checkpoint_stall_seconds_total"):
        assert name in body


def test_worker_failures_first_mid_back_to_back_and_last_step_are_exact(reference, tmp_path_factory):
    s = job(tmp_path_factory, "workers", "0:worker:exit 5:worker:sigkill 5:worker:raise 11:worker:exit")
    assert_exact(s, reference)
    assert [r["at_step"] for r in s["recoveries"]] == [0, 5, 5, 11]
    assert {r["source"] for r in s["recoveries"]} == {"object_store"}
    assert all(r["seconds"] > 0 for r in s["recoveries"])
    assert s["shadow_hashes"] == s["worker_hashes"]


def test_poisson_schedule_of_failures_is_exact(reference, tmp_path_factory):
    schedule = " ".join(f"{f.step}:{f.target}" for f in failure_schedule("poisson", 2.0, 12, seed=SEED))
    s = job(tmp_path_factory, "poisson", schedule)
    assert len(s["recoveries"]) >= 5
    assert_exact(s, reference)


def test_shadow_kill_storage_fallback_and_torn_tail_are_exact(reference, tmp_path_factory):
    s = job(tmp_path_factory, "shadow", "4:shadow 8:both 10:worker:torn")
    assert_exact(s, reference)
    assert s["shadow_restarts"] and s["shadow_restarts"][0]["source"] == "snapshot"
    by_step = {r["at_step"]: r for r in s["recoveries"]}
    assert by_step[8]["source"] == "storage" and by_step[8]["replayed_steps"] == 8 - by_step[8]["base_step"] > 0
    assert by_step[10]["source"] == "object_store"
    assert [t["bytes"] for t in s["torn_tails_cut"]] == [38]


def test_two_workers_recover_exactly(cluster, tmp_path_factory):
    ref = job(tmp_path_factory, "ref2", workers=2, hash_every=0)
    s = job(tmp_path_factory, "two", "6:worker:exit", workers=2, hash_every=0, snapshot_policy="adaptive", mtbf_s=60.0)
    assert s["state_sha256"] == ref["state_sha256"] and s["shadow_equal"]
    assert [r["source"] for r in s["recoveries"]] == ["object_store"]
    intervals = pq.read_table(pathlib.Path(s["config"]["out_dir"]) / "metrics.parquet").column("snapshot_interval_steps")
    assert s["snapshot_policy"] == "adaptive" and all(k >= 1 for k in intervals.to_pylist())
    first = s["replans"][0]["previous_interval_steps"] if s["replans"] else intervals[0].as_py()
    assert intervals[0].as_py() == first


def test_s3_storage_skips_a_corrupt_snapshot_and_is_exact(reference, tmp_path_factory, s3_endpoint):
    bucket = f"rc-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    uri = f"s3://{bucket}/run"
    s = job(tmp_path_factory, "s3", "7:corrupt 7:both", storage=uri, storage_options={"endpoint_url": s3_endpoint},
            keep_snapshots=10)  # keep the corrupt snapshot for `raycheck verify` to find
    assert_exact(s, reference)
    assert {"step": 7, "target": "corrupt", "how": "flip-byte"} in s["failures"]
    recovery = next(r for r in s["recoveries"] if r["at_step"] == 7)
    assert recovery["source"] == "storage" and recovery["base_step"] == 3 and recovery["replayed_steps"] == 4
    assert len(recovery["skipped"]) == 1 and "step-0000000006" in recovery["skipped"][0]
    assert s["snapshots"]["last_durable_step"] == 12 and s["snapshots"]["log_mirrored_steps"] == 12

    result = CliRunner().invoke(app, ["verify", uri, "--s3-endpoint", s3_endpoint])
    assert result.exit_code == 1, result.output
    assert result.output.count("BAD") == 1 and "BAD  step        6" in result.output and "sha256 differs" in result.output
    assert result.output.count("ok   step        6") == 1  # the restarted shadow wrote step 6 again, intact
    assert f"ok   step log segments in {uri}/log: steps 0..11" in result.output


def test_unusable_storage_is_refused_before_training(tmp_path, s3_endpoint):
    result = CliRunner().invoke(app, [
        "run", "--model", "tiny", "--steps", "4", "--out", str(tmp_path / "run"),
        "--storage", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run", "--s3-endpoint", s3_endpoint,
    ])
    assert result.exit_code == 2, result.output
    assert "is not usable" in result.output and "bucket" in result.output.lower()
    assert not (tmp_path / "run" / "steplog.bin").exists()


def test_storage_outage_fails_the_final_persist_and_exits_4(cluster, tmp_path):
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    bucket = f"outage-{uuid.uuid4().hex[:8]}"  # moto keeps buckets across server instances in one process
    make_bucket(endpoint, bucket)
    out = tmp_path / "run"

    def stop_after_two_steps() -> None:  # the storage goes away while training goes on
        while len(RunDir.read(out / "metrics.jsonl")) < 2:
            time.sleep(0.1)
        server.stop()

    threading.Thread(target=stop_after_two_steps, daemon=True).start()
    result = CliRunner().invoke(app, [
        "run", "--model", "tiny", "--steps", "8", "--snapshot-every", "4", "--eval-samples", "0", "--out", str(out),
        "--storage", f"s3://{bucket}/run", "--s3-endpoint", endpoint,
    ])
    assert result.exit_code == 4, result.output
    assert "Last durable snapshot: none" in result.output and "holds all 8 steps" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["shadow_equal"] and summary["snapshots"]["failed"] >= 1


@pytest.mark.parametrize("strategy", ["full-sync", "full-async", "log-only"])
def test_every_baseline_survives_worker_failures_and_resumes_exactly(reference, tmp_path_factory, strategy):
    """The baselines restart through the same path: the newest committed checkpoint (full-*) or the
    initial weights plus the whole log (log-only); full-* recompute the steps after their checkpoint."""
    s = job(tmp_path_factory, strategy, "4:worker:exit 10:worker:sigkill", strategy=strategy)
    assert_exact(s, reference)
    recs = s["recoveries"]
    assert [r["failure_step"] for r in recs] == [4, 10]
    phases = [e["phase"] for e in RunDir.read(pathlib.Path(s["config"]["out_dir"]) / "events.jsonl") if e["kind"] == "phase"]
    assert phases[0] == "running" and phases.count("recovering") == 2 and phases[-1] == s["phase"] == "finished"
    if strategy == "log-only":
        assert [(r["source"], r["base_step"], r["replayed_steps"], r["recompute_steps"]) for r in recs] == [
            ("initial", 0, 4, 0), ("initial", 0, 10, 0)]
    else:  # a checkpoint every 3 steps: restored at 3 and 9, one step recomputed each time
        assert [(r["source"], r["restored_step"], r["replayed_steps"], r["recompute_steps"]) for r in recs] == [
            ("storage", 3, 0, 1), ("storage", 9, 0, 1)]
        assert s["checkpoint_block_seconds_total"] > 0 and s["worker_checkpoints"]["last_step"] == 12


def test_persister_kill_and_storage_outage_on_s3_are_exact(reference, tmp_path_factory):
    """The persister dies (the controller restarts it) and the S3 server is down for 4 s mid-run."""
    with LocalS3Server() as server:
        s = job(tmp_path_factory, "outage", "3:persister 6:storage:4 9:worker", outage=server.outage,
                storage=server.uri("run"), storage_options={"endpoint_url": server.endpoint})
        assert_exact(s, reference)
        assert [f["target"] for f in s["failures"]] == ["persister", "storage", "worker"]
        assert s["persister_restarts"] == 1 and len(server.outages) == 1 and server.outages[0][1] == 4.0
        assert s["snapshots"]["last_durable_step"] == 12 and s["snapshots"]["log_mirrored_steps"] == 12
        assert cfg_store(s).load_latest().info.step == 12  # the bucket is complete after the outage


def cfg_store(summary: dict):
    return JobConfig.from_dict(summary["config"]).snapshot_store()


def test_driver_killed_mid_run_resumes_with_the_same_run_id(reference, tmp_path):
    """The driver (with its embedded Ray cluster) is SIGKILLed mid-run; `raycheck run --resume`
    continues the same run from storage and the step log, and ends bitwise equal."""
    out = tmp_path / "run"
    args = ["--model", "tiny", "--steps", "12", "--lr", "1e-4", "--eval-samples", "16", "--hash-every", "2",
            "--snapshot-every", "3", "--out", str(out)]
    driver = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", *args], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RAY_ADDRESS": ""})
    try:
        deadline = time.monotonic() + 240
        while len(RunDir.read(out / "metrics.jsonl")) < 7 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and the Ray cluster it started
        driver.wait()
    durable = len(read_records(out / "steplog.bin"))
    assert 7 <= durable < 12
    result = CliRunner().invoke(app, ["run", "--resume", "--out", str(out)])
    assert result.exit_code == 0, result.output
    s = json.loads((out / "summary.json").read_text())
    assert s["config"]["run_id"] == json.loads((out / "config.json").read_text())["run_id"]
    assert_exact(s, reference)
    events = RunDir.read(out / "events.jsonl")
    resume = next(e for e in events if e["kind"] == "resume")
    # a stray worker of the dead driver may go on appending (here sometimes to the end) before it
    # notices; the step log's writer lock keeps it the only appender, and the resumed run continues
    # from wherever the log ends
    assert durable <= resume["durable_steps"] <= s["recoveries"][0]["at_step"] <= 12
    assert s["resumes"] == [resume]
