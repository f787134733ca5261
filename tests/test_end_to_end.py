"""The main job end to end on a local Ray cluster: tiny model, real snippets, injected failures.

Every claim of exactness is a sha256 over every tensor, compared with a failure-free reference run.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import time
import urllib.request
import uuid

import pyarrow.parquet as pq
import pytest
import ray
from typer.testing import CliRunner

from conftest import free_port, make_bucket
from raycheck.experiments.s3_server import LocalS3Server
from raycheck.job.config import FailureSpec, JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.job.stores import snapshot_store
from raycheck.cli.main import app
from raycheck.orchestrator.controller import Controller
from raycheck.orchestrator.schedule import failure_schedule, parse_schedule
from raycheck.orchestrator.summary import BREAKDOWN, IN_PROCESS_BREAKDOWN, STANDBY_BREAKDOWN
from raycheck.storage.log_segments import read_segments
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.steplog import RECORD_BYTES, read_records
from raycheck.training.model import default_cache_dir
from raycheck.training.state import state_sha256
from raycheck.storage.pointers import committed_snapshot

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]
OUTAGE_S = 20.0  # long enough for the breaker to open (three failed operations of about 4 s each)
SEED, POISSON_MTBF_STEPS = 53, 4.0  # poisson:4 over 12 steps with this seed fails at steps 0 and 11

# Failures hit a settled run (workers/faults.py): a worker failure waits for a live shadow, a shadow
# kill or a corrupted snapshot for the shadow to have replayed every durable step and for its
# snapshots to be committed. So each recovery's source and base below follow from the failure steps.


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="raycheck", _metrics_export_port=port)
    yield port
    ray.shutdown()


SETTINGS = dict(model="tiny", steps=12, batch_size=8, seq_len=32, eval_samples=16, hash_every_steps=2, zo={"micro_batch_size": 4, "lr": 1e-4},
                snapshot={"every_steps": 3}, faults={"settle_failures": True})  # each recovery source follows from the failure steps alone
"""Two example groups of 4 per step (``zo.micro_batch_size``): the same trajectory at one worker or two (docs/elastic.md)."""


def job(tmp_path_factory, name: str, failures: str = "", outage=None, **kw) -> dict:
    """Run ``SETTINGS`` with ``failures`` and ``kw`` (``JobConfig.replace``: a component's dict merges)."""
    cfg = JobConfig(out_dir=str(tmp_path_factory.mktemp(name)), cache_dir=str(default_cache_dir()), run_id=name, **SETTINGS).replace(
        **{"faults.failures": tuple(FailureSpec.parse(f) for f in failures.split())}, **kw)
    with driver_appends() as appended:
        summary = Controller(cfg, echo=lambda _: None, storage_outage=outage).run()
    assert summary["ok"], summary["error"]
    assert_only_the_driver_wrote_the_streams(RunDir(pathlib.Path(cfg.out_dir)), appended)
    return summary


@contextlib.contextmanager
def driver_appends():
    """Every row this process (the driver) appends to a run directory's streams, by stream path.
    Ray's workers and actors run in other processes, where ``RunDir.append`` is not wrapped."""
    appended: dict[pathlib.Path, list[dict]] = {}
    real = RunDir.append

    def recording(self, stream, rows):
        appended.setdefault(stream, []).extend(json.loads(json.dumps(r)) for r in rows)
        real(self, stream, rows)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunDir, "append", recording)
        yield appended


def assert_only_the_driver_wrote_the_streams(run: RunDir, appended: dict) -> None:
    """Every line of ``events.jsonl`` and ``metrics.jsonl`` is one the driver appended (a line that a
    worker or actor wrote would be in the file only), and no file of the old file-based protocol
    (failure markers, the shadow pointer) exists: every message reached the driver through Ray."""
    for stream in (run.events, run.metrics):
        assert RunDir.read(stream) == appended[stream] and appended[stream]
    assert not (run.root / "failures").exists() and not (run.root / "shadow.json").exists()


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    return job(tmp_path_factory, "ref")


def assert_exact(summary: dict, reference: dict, lost_steps: int = 0) -> None:
    assert summary["final_step"] == reference["final_step"] == 12
    assert summary["state_sha256"] == reference["state_sha256"]
    assert summary["worker_hashes"] == reference["worker_hashes"]  # every 2 steps, not only at the end
    if summary["strategy"] == "shadow":
        assert summary["shadow_equal"] and summary["shadow_state_sha256"] == reference["state_sha256"]
    assert summary["lost_steps"] == lost_steps


def test_reference_shadow_matches_worker_every_k_steps(reference):
    assert len(reference["worker_hashes"]) == 6
    assert reference["shadow_hashes"] == reference["worker_hashes"]
    assert reference["recoveries"] == [] and reference["failures"] == []
    assert reference["snapshots"]["written"] >= 1 and reference["snapshots"]["failed"] == 0
    assert_result_checkpoint_is_the_final_snapshot(reference, os.path.join(reference["config"]["out_dir"], "ray_train", ""))


def assert_result_checkpoint_is_the_final_snapshot(summary: dict, ray_train_storage: str) -> None:
    """Ray Train's ``Result.checkpoint`` is a pointer in its storage (``ray_train_storage``) to the committed
    snapshot of the final step (the last report waited for the shadow's)."""
    reported = summary["ray_train_checkpoint"]
    assert reported["path"].startswith(ray_train_storage) and reported["path"].rsplit("/", 1)[1].startswith("step-0000000012-")
    assert reported["snapshot"] == summary["final_snapshot"] and reported["step"] == 12


def poisson_schedule() -> tuple:
    """The seeded Poisson schedule the ``workers`` run draws its first- and last-step failures from."""
    return failure_schedule("poisson", POISSON_MTBF_STEPS, 12, seed=SEED)


@pytest.fixture(scope="module")
def workers(reference, tmp_path_factory):
    """Worker failures at the first step, back to back in step 5 (SIGKILL, then an exception in the
    restarted worker, whose process survives it: an in-process restart) and at the last step; those at 0
    and 11 come from the seeded Poisson schedule."""
    drawn = [f"{f.step}:{f.target}:{f.how}" for f in poisson_schedule()]
    return job(tmp_path_factory, "workers", " ".join([drawn[0], "5:worker:sigkill 5:worker:raise", *drawn[1:]]),
               faults={"warm_standby": False})  # Ray Train's own restarts: the standby's are the other tests'


def test_worker_failures_first_mid_back_to_back_and_last_step_are_exact(workers, reference):
    s = workers
    assert_exact(s, reference)
    assert [(f["step"], f["how"]) for f in s["failures"]] == [(0, "exit"), (5, "sigkill"), (5, "raise"), (11, "exit")]
    assert [(r["at_step"], r["source"]) for r in s["recoveries"]] == [(step, "object_store") for step in (0, 5, 5, 11)]
    assert all(r["seconds"] > 0 for r in s["recoveries"])
    assert s["shadow_hashes"] == s["worker_hashes"]
    # the exception in step 5 is rolled back in the process that raised it (one worker): no new worker process
    assert [r["path"] for r in s["recoveries"]] == ["new_process", "new_process", "in_process", "new_process"]
    events = RunDir.read(RunDir(pathlib.Path(s["config"]["out_dir"])).events)
    started = [e["pid"] for e in events if e["kind"] == "placement" and e["component"] == "worker"]
    restored = [e["pid"] for e in events if e["kind"] == "recovery"]
    assert len(set(started)) == len(started) == 4 and restored == started[1:3] + started[2:]  # the same pid twice in step 5
    assert [(e["step"], e["reason"]) for e in events if e["kind"].startswith("in_process")] == [(5, "in-process restart 1 of 3")]
    # each recovery's breakdown: every component measured apart, none negative, adding up exactly (float64) to the
    # failure-to-first-step time; the first worker of step 5 failed again before its first step: it ends at the restore;
    # the in-process one has no Ray Train or process-start component
    chains = {"new_process": [part for _, part in BREAKDOWN], "in_process": [part for _, part in IN_PROCESS_BREAKDOWN]}
    assert [r["first_step_seconds"] is None for r in s["recoveries"]] == [False, True, False, False]
    for r in s["recoveries"]:
        components = chains[r["path"]]
        total = r["seconds"] if r["first_step_seconds"] is None else r["first_step_seconds"]
        assert list(r["breakdown"]) == (components[:-1] if r["first_step_seconds"] is None else components)
        assert min(r["breakdown"].values()) >= 0 and sum(r["breakdown"].values()) == total


def scrape(port: int, run: str) -> dict[tuple, float]:
    """The ``ray_raycheck_*`` series of ``run`` on the node's metrics export port, keyed by name
    plus the target, source or component label."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = {}
    for line in body.splitlines():
        if not line.startswith("ray_raycheck_") or f'run="{run}"' not in line:
            continue
        name, rest = line.split("{", 1)
        labels = dict(kv.split("=", 1) for kv in rest.rsplit("}", 1)[0].split(","))
        found[(name, *(labels[k].strip('"') for k in ("target", "source", "component") if k in labels))] = float(line.rsplit(" ", 1)[1])
    return found


def test_metrics_reach_the_prometheus_endpoint(cluster, workers):
    """Every series the controller emits reaches the node's metrics export port (what dashboards
    read), after a run with four worker failures, with the value the run fixes."""
    s = workers
    wanted = {
        ("ray_raycheck_steps_total",): 12.0,
        ("ray_raycheck_failures_injected_total", "worker"): 4.0,
        ("ray_raycheck_recoveries_total", "object_store"): 4.0,
        ("ray_raycheck_recovery_seconds",): s["recoveries"][-1]["seconds"],
        ("ray_raycheck_checkpoint_stall_seconds_total",): s["checkpoint_block_seconds_total"],
        ("ray_raycheck_snapshot_interval_steps",): 3.0,
        ("ray_raycheck_snapshot_bytes_persisted",): float(s["snapshots"]["bytes_written"]),
        ("ray_raycheck_snapshot_age_steps",): 12.0 - s["snapshots"]["last_durable_step"],
        ("ray_raycheck_log_lag_steps",): 0.0,  # the log is not mirrored: storage is local
        ("ray_raycheck_recovery_first_step_seconds",): s["recoveries"][-1]["first_step_seconds"],
        **{("ray_raycheck_recovery_component_seconds", c.removesuffix("_s")): v for c, v in s["recoveries"][-1]["breakdown"].items()},
    }
    deadline, found = time.monotonic() + 90, {}
    while time.monotonic() < deadline:  # Ray exports on its own period (up to ~10 s behind the run)
        found = scrape(cluster, "workers")
        if {k: found.get(k) for k in wanted} == pytest.approx(wanted, rel=1e-9):
            break
        time.sleep(2)
    lag = found.pop(("ray_raycheck_shadow_lag_steps",))  # when the controller last looked: not fixed by the run
    assert 0 <= lag <= 12
    assert found == pytest.approx(wanted, rel=1e-9)  # no other series, and each with its value


def test_poisson_schedule_of_failures_is_exact(workers, reference):
    """The seeded Poisson schedule is an exact list, and the run it drives (the ``workers`` run, which
    adds the back-to-back pair in step 5) recovers from each of its failures exactly."""
    schedule = poisson_schedule()
    assert [(f.step, f.target, f.how) for f in schedule] == [(0, "worker", "exit"), (11, "worker", "exit")]
    injected = [(f["step"], f["target"], f["how"]) for f in workers["failures"]]
    assert [f for f in injected if f[2] == "exit"] == [(f.step, f.target, f.how) for f in schedule]
    assert [(r["failure_step"], r["at_step"], r["source"]) for r in workers["recoveries"] if r["failure_step"] in (0, 11)] == [
        (0, 0, "object_store"), (11, 11, "object_store")]
    assert_exact(workers, reference)


def test_shadow_kill_storage_fallback_and_torn_tail_are_exact(reference, tmp_path_factory):
    """With a warm standby (``workers.standby``): step 2: the worker's executor process exits, the
    standby takes over from the shadow's image. Step 4: the shadow dies once its snapshot of step 3 is
    committed; its restart starts there. Step 8: the shadow dies once the snapshot of step 6 is
    committed, then rank 0 dies half-way through the log append of step 8: the torn tail is cut, and
    the second standby restores the snapshot of step 6 from storage plus the 2 logged steps after it; the
    shadow, restarted from that snapshot too, ends equal to the reference. Ray Train never restarts its
    worker (the supervisor). (A restarted shadow serving a later recovery from the object
    store: ``test_two_shards_serve_an_assembled_image_restart_alone_and_are_exact``.)"""
    s = job(tmp_path_factory, "shadow", "2:worker 4:shadow 8:both:torn", faults={"warm_standby": True})
    assert_exact(s, reference)
    assert [(r["incarnation"], r["source"], r["step"]) for r in s["shadow_restarts"]] == [(1, "snapshot", 3), (2, "snapshot", 6)]
    assert [(r["failure_step"], r["path"], r["source"], r["base_step"], r["replayed_steps"], r["restored_step"]) for r in s["recoveries"]] == [
        (2, "standby", "object_store", 2, 0, 2), (8, "standby", "storage", 6, 2, 8)]
    assert [(t["bytes"], t["step"]) for t in s["torn_tails_cut"]] == [(RECORD_BYTES // 2, 8)]  # half a record
    events = RunDir.read(RunDir(pathlib.Path(s["config"]["out_dir"])).events)
    supervisors = [e["pid"] for e in events if e["kind"] == "standby_supervisor"]
    assert len(supervisors) == 1 and len([e for e in events if e["kind"] == "worker_group"]) == 1
    assert [(e["promoted"], e["supervisor_pid"]) for e in events if e["kind"] == "standby_promoted"] == [(True, supervisors[0])] * 2
    executors = [e["pid"] for e in events if e["kind"] == "placement" and e["component"] == "worker"]
    assert len(set(executors)) == 3 and supervisors[0] not in executors
    assert [e["pid"] for e in events if e["kind"] == "recovery"] == executors[1:]
    for r in s["recoveries"]:  # every component measured apart, adding up exactly to the failure-to-first-step time
        assert list(r["breakdown"]) == [part for _, part in STANDBY_BREAKDOWN]
        assert min(r["breakdown"].values()) >= 0 and sum(r["breakdown"].values()) == r["first_step_seconds"]


def test_two_workers_equal_one_the_failed_one_is_replaced_alone_and_the_adaptive_policy_replans(reference, tmp_path_factory):
    """Two data-parallel workers against the failure-free run of ONE worker (``reference``) with the same example groups
    (``training.groups``: the losses do not depend on the worker count, ``docs/elastic.md``), with the default
    warm standby: at an MTBF of 2 s each rank's policy keeps a standby (``policies.standby``). Rank 1's
    executor dies at step 6: its standby takes over (path ``standby``), rank 0's process going on through the
    failure, waiting at the step exchange until the standby has restored step 6 from the shadow. At step 9
    rank 1 raises: with two workers that is not restarted in process (rank 0 waits in the step's exchange),
    so its supervisor re-raises and Ray Train replaces rank 1 alone (each worker its own Ray Train replica
    group, ``orchestrator.replica_groups``; path ``new_process``). The adaptive policy assumes an MTBF of 2 s: it starts at 1 step between snapshots and must re-plan, since every second the job
    runs without a failure contradicts that MTBF (policies.replan: (M0 + elapsed) / (1 + failures))."""
    ref = reference
    s = job(tmp_path_factory, "two", "6:worker:exit 9:worker:raise", workers=2, eval_samples=0,
            snapshot={"policy": "adaptive", "mtbf_s": 2.0})
    assert s["state_sha256"] == ref["state_sha256"] and s["worker_hashes"] == ref["worker_hashes"] and s["shadow_equal"]
    assert len(set(ref["worker_hashes"].values())) == 6  # after steps 2, 4, ..., 12: the state moved
    assert s["trajectory_sha256"] == ref["trajectory_sha256"]  # one trajectory, whatever the worker count
    assert [(r["failure_step"], r["source"], r["restored_step"], r["path"]) for r in s["recoveries"]] == [
        (6, "object_store", 6, "standby"), (9, "object_store", 9, "new_process")]
    assert [d["keep"] for d in s["standby"][:2]] == [True, True] and s["standby"][0]["saved_core_s"] > s["standby"][0]["cost_core_s"]
    assert s["recoveries"][0]["why"] == "the executor's process died and the rank's loaded standby took over"
    events = RunDir.read(RunDir(pathlib.Path(s["config"]["out_dir"])).events)
    assert [(e["kind"], e["rank"], e["step"], e["reason"].split(":")[0]) for e in events if e["kind"].startswith("in_process")] == [
        ("in_process_refused", 1, 9, "2 workers")]  # the other rank waits in the step's collective
    started = [e for e in events if e["kind"] == "placement" and e["component"] == "worker"]
    pids = {rank: [e["pid"] for e in started if e["rank"] == rank] for rank in (0, 1)}
    assert len(pids[0]) == 1  # rank 0 started once: its process survived both failures
    assert len(set(pids[1])) == len(pids[1]) == 3 and pids[0][0] not in pids[1]
    # The re-plan needs a shadow that keeps up: where the machine is so loaded that the tiny model's replay is
    # measured slower than its step, the policy keeps its 1-step plan and says why, with the figures it measured.
    assert s["snapshot_policy"] == "adaptive"
    for e in (e for e in events if e["kind"] == "plan_infeasible"):
        replay_s, step_s = map(float, re.search(r"replays a step in (\S+) s but training takes (\S+) s a step", e["reason"]).groups())
        assert replay_s >= step_s, e
    intervals = pq.read_table(pathlib.Path(s["config"]["out_dir"]) / "metrics.parquet").column("snapshot_interval_steps")
    if not s["replans"]:
        assert any(e["kind"] == "plan_infeasible" for e in events), "no re-plan and no reason given"
        assert intervals.to_pylist() == [1] * 12
        return
    assert s["replans"][0]["previous_interval_steps"] == 1
    interval, expected = 1, []  # the interval in force at each step, from the re-plan events
    replans = {r["step"]: r for r in s["replans"]}
    for step in range(12):
        if step in replans:
            assert replans[step]["previous_interval_steps"] == interval
            interval = replans[step]["interval_steps"]
        expected.append(interval)
    assert intervals.to_pylist() == expected and len(set(expected)) > 1


def test_s3_storage_skips_a_corrupt_snapshot_and_is_exact(reference, tmp_path_factory, s3_endpoint):
    """Also durability cluster: every step record is in the bucket before its update (group commits)."""
    bucket = f"rc-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    uri = f"s3://{bucket}/run"
    s = job(tmp_path_factory, "s3", "7:corrupt 7:both", storage={"uri": uri, "options": {"endpoint_url": s3_endpoint}},
            snapshot={"keep": 10}, durability="cluster")  # keep the corrupt snapshot for `raycheck verify` to find
    assert_exact(s, reference)
    committed = s["durability"]
    assert committed["level"] == "cluster" and committed["uploaded_steps"] == 12 and 1 <= committed["uploads"] <= 12
    assert committed["records_per_upload"] == 12 / committed["uploads"]
    assert {"step": 7, "target": "corrupt", "how": "flip-byte"} in s["failures"]
    recovery = next(r for r in s["recoveries"] if r["at_step"] == 7)
    assert recovery["source"] == "storage" and recovery["base_step"] == 3 and recovery["replayed_steps"] == 4
    assert len(recovery["skipped"]) == 1 and "step-0000000006" in recovery["skipped"][0]
    assert s["snapshots"]["last_durable_step"] == 12 and s["snapshots"]["log_mirrored_steps"] == 12
    assert_result_checkpoint_is_the_final_snapshot(s, os.path.join(s["config"]["out_dir"], "ray_train", ""))  # the pointer: on this disk
    store, info = committed_snapshot(s["ray_train_checkpoint"]["path"], endpoint_url=s3_endpoint)
    assert info.step == 12 and store.storage.url(info.folder) == s["final_snapshot"]

    result = CliRunner().invoke(app, ["verify", uri, "--s3-endpoint", s3_endpoint])
    assert result.exit_code == 1, result.output
    assert result.output.count("BAD") == 1 and "BAD  step        6" in result.output and "sha256 differs" in result.output
    assert result.output.count("ok   step        6") == 1  # the restarted shadow wrote step 6 again, intact
    assert f"ok   step log segments in {uri}/log: steps 0..11" in result.output


def test_storage_gone_after_the_check_fails_the_final_persist_and_exits_4(cluster, tmp_path, monkeypatch):
    """The S3 server stops right after the driver checked it and claimed its writer epoch in the
    index: training goes on (the step log is local), no snapshot becomes durable (the persister
    starts all the same and reports the outage), and the run says so, naming it, with exit code 4."""
    claim = SnapshotStore.claim_epoch
    with LocalS3Server() as server:
        def claim_then_stop(store: SnapshotStore) -> int:  # in this process only: the driver's claim
            epoch = claim(store)
            server.stop()
            return epoch

        monkeypatch.setattr(SnapshotStore, "claim_epoch", claim_then_stop)
        out = tmp_path / "run"
        result = CliRunner().invoke(app, [
            "run", "--model", "tiny", "--steps", "8", "--snapshot-every", "4", "--eval-samples", "0", "--out", str(out),
            "--storage", server.uri("run"), "--s3-endpoint", server.endpoint,
        ])
    assert result.exit_code == 4, result.output
    assert "Last durable snapshot: none" in result.output and "holds all 8 steps" in result.output
    assert f"storage endpoint {server.endpoint} unreachable (connection refused)" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["shadow_equal"] and summary["snapshots"].get("last_durable_step") is None
    assert summary["config_stored"] is False  # the bucket was gone before the configuration could be put there


def test_verify_reuses_the_reference_and_exits_3_when_not_bitwise_equal(reference, tmp_path):
    """``--verify`` through the CLI, with a seeded Weibull failure schedule, against a failure-free
    reference in ``<out>/reference`` whose state hash was changed: the reference is reused (not run
    again), the recovered state is the true failure-free one, and the comparison with the changed hash
    fails: exit 3. The shadow runs on other CPU kernels
    than the worker (``--shadow-env``), the recovery takes its image, and ``raycheck replay`` of a
    logged step gives the worker's hash of it."""
    out = tmp_path / "run"
    (out / "reference").mkdir(parents=True)
    RunDir.write_json(out / "reference" / "summary.json", {**reference, "state_sha256": "0" * 64})
    schedule = parse_schedule("weibull:12:0.7", 12, seed=7)
    assert [(f.step, f.target) for f in schedule] == [(5, "worker")]

    result = CliRunner().invoke(app, [
        "run", "--model", "tiny", "--steps", "12", "--micro-batch-size", "4", "--lr", "1e-4", "--eval-samples", "16", "--hash-every", "2",
        "--snapshot-every", "3", "--settle-failures", "--verify", "--out", str(out),
        "--shadow-env", "ATEN_CPU_CAPABILITY=default", "--shadow-env", "NUMBA_CPU_NAME=generic",
        "--fail-schedule", "weibull:12:0.7", "--fail-seed", "7"])
    assert result.exit_code == 3, result.output
    assert f"reusing the failure-free reference in {out / 'reference'}" in result.output
    assert "error: recovery was not exact (see summary.json)" in result.output
    s = json.loads((out / "summary.json").read_text())
    assert [(f["step"], f["target"]) for f in s["failures"]] == [(5, "worker")]
    assert [(r["failure_step"], r["source"]) for r in s["recoveries"]] == [(5, "object_store")]
    assert s["lost_steps"] == 0 and s["shadow_equal"] is True  # so exit 3 comes from the comparison alone
    assert s["bitwise_equal"] is False and s["reference_state_sha256"] == "0" * 64
    assert s["state_sha256"] == reference["state_sha256"]
    assert s["shadow_cpu_capability"] == "DEFAULT" != s["worker_cpu_capability"]
    replayed = CliRunner().invoke(app, ["replay", str(out), "--step", "6"])  # any logged step, from the run's own files
    assert replayed.output.strip().endswith(f"state_sha256 {s['worker_hashes']['6']}"), replayed.output


@pytest.mark.parametrize("strategy", ["full-async", "log-only"])
def test_every_baseline_survives_worker_failures_and_resumes_exactly(reference, tmp_path_factory, strategy):
    """The baselines restart through the same path: the newest committed checkpoint (full-*) or the
    initial weights plus the whole log (log-only); full-* recompute the steps after their checkpoint.
    (full-sync differs from full-async only in ``FullCheckpointer(asynchronous=False)``, tested without
    Ray in ``tests/test_staging.py``; its restore is full-async's.)
    The exception at step 7 is restored in process, through the same restore from the perturbed weights
    (log-only: the initial weights read again); the SIGKILL at step 10 is taken over by the warm standby
    (the default keeps one: two failures in 12 steps). full-*: the
    newest checkpoint (step 9) is corrupted before the failure at step 10, so the restore skips it: the
    3 steps it made durable are lost and 4 steps are recomputed."""
    full = strategy != "log-only"
    s = job(tmp_path_factory, strategy, "7:worker:raise " + ("10:corrupt 10:worker:sigkill" if full else "10:worker:sigkill"),
            strategy=strategy)
    assert_exact(s, reference, lost_steps=3 if full else 0)
    recs = s["recoveries"]
    assert [(r["failure_step"], r["path"]) for r in recs] == [(7, "in_process"), (10, "standby")]
    phases = [e["phase"] for e in RunDir.read(pathlib.Path(s["config"]["out_dir"]) / "events.jsonl") if e["kind"] == "phase"]
    # the in-process restart and the standby's promotion may each be over before the controller looks: "recovering" or not
    assert phases[0] == "running" and phases.count("recovering") in (0, 1, 2) and phases[-1] == s["phase"] == "finished"
    if not full:
        assert [(r["source"], r["base_step"], r["replayed_steps"], r["recompute_steps"]) for r in recs] == [
            ("initial", 0, 7, 0), ("initial", 0, 10, 0)]
        return
    # a checkpoint every 3 steps: restored at 6 (the raise; one step recomputed), then at 6 again (9 is corrupt)
    assert [(r["source"], r["restored_step"], r["replayed_steps"], r["recompute_steps"], r["lost_steps"]) for r in recs] == [
        ("storage", 6, 0, 1, 0), ("storage", 6, 0, 4, 3)]
    assert "skipped" not in recs[0] and len(recs[1]["skipped"]) == 1 and "step-0000000009" in recs[1]["skipped"][0]
    assert s["checkpoint_block_seconds_total"] > 0 and s["worker_checkpoints"]["last_step"] == 12


def test_persister_kill_and_a_20s_s3_outage_are_exact_and_storage_resumes(reference, tmp_path_factory):
    """The persister dies during step 3 (the controller restarts it); the S3 server stops during step 4
    for 20 s; a worker dies during step 9. The outage callable returns when the server is back, so the
    run's end (its last snapshot and log upload) comes after the outage whatever the speed of training:
    the scenario forces storage calls after the outage: snapshots and the log mirror resume, so the
    storage ends complete and the run bitwise exact. Whether the breaker opens during the outage is not
    forced (one S3 call that began just before it can retry through all of it, seen under load), so it
    is not asserted here: tests/test_storage_failures.py and tests/test_breaker.py drive it with gates."""
    with LocalS3Server() as server:

        outages_s = []

        def outage_until_back(seconds: float) -> None:
            outages_s.append(seconds)
            server.stop()
            time.sleep(seconds)  # the outage itself
            server.start()

        s = job(tmp_path_factory, "outage", f"3:persister 4:storage:{OUTAGE_S:g} 9:worker", outage=outage_until_back,
                storage={"uri": server.uri("run"), "options": {"endpoint_url": server.endpoint}})
        assert_exact(s, reference)
        assert [f["target"] for f in s["failures"]] == ["persister", "storage", "worker"]
        assert s["persister_restarts"] == 1 and outages_s == [OUTAGE_S]
        snaps = s["snapshots"]
        assert snaps["storage"]["state"] == "closed"  # usable again at the end, whatever happened in between
        assert snaps["last_durable_step"] == 12 and snaps["log_mirrored_steps"] == 12  # past the outage (step 4)
        latest = cfg_store(s).load_latest()  # the bucket is complete after the outage
        assert latest.info.step == 12 and state_sha256(latest.state) == s["state_sha256"]
        local = read_records(pathlib.Path(s["config"]["out_dir"]) / "steplog.bin")
        assert read_segments(cfg_store(s).storage)[1] == local and len(local) == 12


def cfg_store(summary: dict):
    return snapshot_store(JobConfig.from_dict(summary["config"]))


def test_two_shards_serve_an_assembled_image_restart_alone_and_are_exact(reference, tmp_path_factory):
    """``--shadow-shards 2``. Step 7: shard 1 alone is killed once the snapshot of step 6 (both parts,
    one manifest) is committed; it restarts from its units of that snapshot while shard 0 keeps its
    actor. Step 10: a worker dies and restores, through the object store, the image assembled from
    the restarted shard 1 and the original shard 0."""
    s = job(tmp_path_factory, "shards", "7:shadow:1 10:worker", placement={"shadow_shards": 2})
    assert_exact(s, reference)
    assert [(r["failure_step"], r["source"], r["restored_step"]) for r in s["recoveries"]] == [(10, "object_store", 10)]
    assert [(r["shard"], r["incarnation"], r["source"], r["step"]) for r in s["shadow_restarts"]] == [(1, 1, "snapshot", 6)]
    first, second = s["shadow_shards"]
    assert (first["units"], second["units"]) == ("embed", "layer.000..norm")
    assert len(first["actor_ids"]) == 1 and first["restarts"] == 0  # shard 0 kept its actor through shard 1's restart
    assert len(set(second["actor_ids"])) == 2 and second["actor_ids"][1] == s["shadow_restarts"][0]["actor_id"]
    assert all(f["replay_over_step"] > 0 for f in s["shadow_shards"])
    assert s["snapshots"]["last_durable_step"] == 12 and s["snapshots"]["parts_pending_steps"] == []


