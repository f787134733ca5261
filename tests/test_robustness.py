"""Findings of a fresh user trying to break raycheck: each bad input or outage gets one clear error,
nothing is hidden, and a component that storage trouble would kill keeps going instead.

All but the last test run without Ray (real files, a real moto S3 server, the real CLI); the last
one runs the controller on a local Ray cluster with its trainer replaced, so that the persister's
deaths are the only thing that happens."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import uuid

import numpy as np
import pytest
import ray
from moto.server import ThreadedMotoServer
from typer.testing import CliRunner

from raycheck.actors.log_keeper import LogKeeper
from raycheck.actors.persister import PersisterActor
from conftest import free_port, make_bucket
from raycheck.experiments.s3_server import LocalS3Server
from raycheck.job.config import JobConfig
from raycheck.job.names import log_keeper_name, persister_name
from raycheck.cli.main import app
from raycheck.orchestrator.control import within_budget
import raycheck.orchestrator.controller
from raycheck.orchestrator.components import PersisterFailedError, PersisterHandle
from raycheck.orchestrator.controller import Controller
from raycheck.storage.backend import RetryPolicy, Storage, StorageUnreachableError
from raycheck.storage.log_segments import read_segments
from raycheck.storage.manifest import RunIdentity
from raycheck.storage.snapshots import INDEX, MANIFEST, NoSnapshotError, SnapshotStore
from raycheck.storage.steplog import StepLogWriter, StepRecord, read_records
from raycheck.training.model import default_cache_dir
from raycheck.training.state import state_sha256

IDENTITY = RunIdentity("a1b2c3d4", "f" * 12 + "0" * 52)


def state(step: int) -> dict[str, np.ndarray]:
    """One unit (layer 0): a write is a single put, so which call probes the breaker is not a race."""
    return {"model.layers.0.w": np.random.default_rng(step).standard_normal(16).astype(np.float32)}


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


# -- 1. folders the index does not list are reported, never restored from ------------------------
def test_snapshot_folders_missing_from_the_index_are_reported_and_restores_still_trust_only_the_index(tmp_path):
    root = tmp_path / "snapshots"
    store = SnapshotStore(str(root), identity=IDENTITY)
    s2, s4 = (store.write(s, state(s)) for s in (2, 4))
    committed_index = (root / INDEX).read_bytes()
    s6 = store.write(6, state(6))
    (root / INDEX).write_bytes(committed_index)  # as if the driver died between step 6's manifest and its commit

    result = cli("verify", str(tmp_path))
    assert result.exit_code == 1, result.output
    assert result.output.splitlines() == [
        f"ok   step        2  {s2.folder}",
        f"ok   step        4  {s4.folder}",
        f"BAD  1 committed-looking snapshot folder is not in the index (restores never use it): {s6.folder}",
        "1 problem(s) found",
    ]
    loaded = SnapshotStore(str(root), identity=IDENTITY).load_latest()
    assert loaded.info.folder == s4.folder and state_sha256(loaded.state) == state_sha256(state(4))

    (root / INDEX).unlink()  # the index deleted: every snapshot folder is committed-looking, none is committed
    result = cli("verify", str(tmp_path))
    assert result.exit_code == 1, result.output
    assert result.output.splitlines() == [
        f"BAD  3 committed-looking snapshot folders are not in the index (restores never use them): "
        f"{s2.folder}, {s4.folder}, {s6.folder}",
        "3 problem(s) found",
    ]
    inspected = cli("inspect", str(tmp_path))
    assert inspected.exit_code == 1, inspected.output
    assert inspected.output.splitlines() == [f"{root}: 0 committed snapshot(s)"] + [
        f"  not indexed: {info.folder}" for info in (s2, s4, s6)] + ["3 problem(s) found"]
    with pytest.raises(NoSnapshotError):
        SnapshotStore(str(root), identity=IDENTITY).load_latest()
    assert sorted(p.name for p in root.iterdir()) == sorted(i.folder for i in (s2, s4, s6))  # read only

    (root / INDEX).write_bytes(b"{not json")  # a malformed index is replaced by a scan: nothing hidden either
    result = cli("verify", str(tmp_path))
    assert result.exit_code == 1 and "not in the index" not in result.output, result.output
    assert [line[:22] for line in result.output.splitlines()[:3]] == ["ok   step        2  st", "ok   step        4  st",
                                                                      "ok   step        6  st"]
    assert f"BAD  {INDEX}: malformed" in result.output


# -- 2. an endpoint where nothing listens is named as such -----------------------------------------
@pytest.mark.parametrize("credentials", [True, False])
def test_an_unreachable_endpoint_is_named_wherever_storage_is_probed(tmp_path, monkeypatch, credentials):
    if not credentials:  # botocore would otherwise fail first with NoCredentialsError
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(var, raising=False)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    unreachable = (f"storage endpoint {endpoint} unreachable (connection refused); check that the server runs and "
                   "the endpoint URL (--s3-endpoint or $AWS_ENDPOINT_URL)")
    uri = "s3://a-bucket/run"
    for command in ("inspect", "verify"):
        result = cli(command, uri, "--s3-endpoint", endpoint)
        assert result.exit_code == 2, result.output
        assert result.output.splitlines() == [f"error: cannot read snapshot store {uri}: {unreachable}"]
    result = cli("merge", "--source", f"A={uri}", "--take", "0:A", "--out", str(tmp_path / "merged"), "--s3-endpoint", endpoint)
    assert result.exit_code == 2 and result.output.splitlines() == [f"error: cannot read snapshot store {uri}: {unreachable}"]
    result = cli("run", "--model", "tiny", "--steps", "4", "--out", str(tmp_path / "run"), "--storage", uri,
                 "--s3-endpoint", endpoint)
    assert result.exit_code == 2 and result.output.splitlines() == [f"error: snapshot storage {uri} is not usable: {unreachable}"]
    assert sorted(os.listdir(tmp_path)) == []  # nothing created: no merge output, no run directory

    storage = Storage(uri, retry=RetryPolicy(attempts=2, base_delay_s=0.01), endpoint_url=endpoint)
    with pytest.raises(StorageUnreachableError) as raised:  # an operation that fails for that reason, after its retries
        storage.put("x", b"1")
    tries = "2 tries" if credentials else "1 try"  # missing credentials are not retried
    assert str(raised.value) == f"put {uri}/x failed after {tries}: {unreachable}"
    with pytest.raises(StorageUnreachableError, match=r"^storage endpoint 127\.0\.0\.1:9000 unreachable \(not an http:// or "
                                                      r"https:// URL with a host\)"):
        Storage(uri, endpoint_url="127.0.0.1:9000").check_reachable()  # no scheme: botocore would refuse it later


# -- 3. a persister started during an outage starts, says so, and resumes --------------------------
def test_a_persister_and_log_keeper_started_while_storage_is_unreachable_report_it_and_resume_when_storage_returns(tmp_path):
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    bucket = f"rc-late-{uuid.uuid4().hex[:8]}"  # moto keeps buckets across servers in one process
    log_path = tmp_path / "steplog.bin"
    writer = StepLogWriter.create(log_path, {"model": "tiny"})
    for step in range(3):
        writer.append(StepRecord(step=step, seed=step, projected_grad=0.25, loss_plus=0.5, loss_minus=0.4, lr=1e-3,
                                 eps=1e-3, weight_decay=0.0, batch_id=step))
    writer.close()
    retry = RetryPolicy(attempts=1, base_delay_s=0.01, timeout_s=5.0, max_consecutive_failures=1, breaker_backoff_s=0.05,
                        breaker_max_backoff_s=0.05)
    store = SnapshotStore(Storage(f"s3://{bucket}/run", retry=retry, endpoint_url=endpoint), keep_last=1)
    persister = PersisterActor(store)  # never touches storage before its first write
    # the log keeper mirrors the step log; its mirror loop is not running: only flush() syncs, so each outcome below is forced
    keeper = LogKeeper(log_path, mirror_to=store.storage, mirror_every_s=3600)
    unreachable = f"storage endpoint {endpoint} unreachable (connection refused)"

    status = keeper.flush()
    assert unreachable in status["log_mirror_error"] and status["log_mirrored_steps"] == 0
    status = persister.status()
    assert status["storage"]["state"] in ("open", "half_open") and status["storage"]["opened"] == 1
    persister.submit(1, state(1))
    status = persister.flush(timeout_s=60)
    assert status["failed"] == 1 and status["last_durable_step"] is None
    assert status["last_error"].startswith("step 1: StorageUnreachableError: put ") and unreachable in status["last_error"]

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        make_bucket(endpoint, bucket)
        assert keeper.flush()["log_mirrored_steps"] == 3  # its probe closes the breaker
        persister.submit(2, state(2))
        status = persister.flush(timeout_s=60)
        assert status["storage"]["state"] == "closed" and keeper.status()["log_mirror_error"] is None
        assert status["last_durable_step"] == 2 and status["written"] == 1 and keeper.status()["log_mirrored_steps"] == 3
        fresh = Storage(f"s3://{bucket}/run", endpoint_url=endpoint)
        assert state_sha256(SnapshotStore(fresh).load_latest().state) == state_sha256(state(2))
        assert read_segments(fresh)[1] == read_records(log_path)
    finally:
        keeper.close()
        server.stop()


# -- 4. the persister's restart budget ------------------------------------------------------------
def test_the_persister_restart_budget_is_a_pure_decision_validated_up_front(tmp_path):
    assert [within_budget(used, 2) for used in range(4)] == [True, True, False, False]
    assert not within_budget(0, 0)
    assert all(within_budget(used, -1) for used in (0, 1, 10_000))
    with pytest.raises(ValueError, match=r"^faults.max_persister_restarts must be >= 0, or -1 for unlimited, got -2$"):
        JobConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path), model="tiny", faults={"max_persister_restarts": -2})
    assert JobConfig.from_dict({**JobConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path), model="tiny").to_dict(),
                                "faults": {"max_persister_restarts": 0}}).faults.max_persister_restarts == 0
    result = cli("run", "--model", "tiny", "--out", str(tmp_path / "run"), "--max-persister-restarts", "-2")
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == ["error: --max-persister-restarts must be >= 0, or -1 for unlimited, got -2"]
    assert not (tmp_path / "run").exists()


# -- 5 and 6. each skipped snapshot printed once; the run of each snapshot shown -------------------
def test_inspect_and_verify_print_each_skipped_snapshot_once_and_inspect_names_each_snapshots_run(tmp_path, caplog):
    root = tmp_path / "snapshots"
    ours = SnapshotStore(str(root), identity=IDENTITY).write(2, state(2))
    merged = SnapshotStore(str(root)).write(4, state(4))  # a store-wide writer (e.g. a merge) records no run
    altered = SnapshotStore(str(root)).write(6, state(6))
    with open(root / altered.folder / MANIFEST, "a") as fh:
        fh.write(" ")
    problem = f"{altered.folder}/{MANIFEST}: sha256 differs from the index (altered after its commit)"
    outputs = {}
    for command, code in (("inspect", 1), ("verify", 1)):
        caplog.clear()
        result = cli(command, str(tmp_path))
        assert result.exit_code == code, result.output
        logged = [r.getMessage() for r in caplog.records]  # what the CLI's log handler prints on stderr
        outputs[command] = result.output.splitlines()
        assert "\n".join(outputs[command] + logged).count(problem) == 1, (outputs[command], logged)
    lines = outputs["inspect"]
    assert f"  skipped: {problem}" in lines and f"BAD  {problem}" in outputs["verify"]
    assert " run a1b2c3d4 (trajectory ffffffffffff)  " in lines[1] and lines[1].endswith(ours.folder)
    assert "  run -  " in lines[2] and lines[2].endswith(merged.folder)


# -- 7. help at 80 columns -------------------------------------------------------------------------
def test_help_is_whole_at_80_columns():
    import typer.main

    group = typer.main.get_command(app)
    for command in [None, *group.commands]:
        result = CliRunner().invoke(app, [command, "--help"] if command else ["--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        usage, *lines = result.output.splitlines()  # the usage line ends "[ARGS]..." by convention
        assert max(len(line) for line in [usage, *lines]) <= 80, result.output
        assert not [line for line in lines if "..." in line or "\u2026" in line], result.output
        if command:
            for param in group.commands[command].params:  # an argument by its metavar, an option by its names
                for name in (param.opts if param.param_type_name == "option" else [param.metavar]):
                    assert name in result.output.split(), (command, name)



def test_every_positional_argument_has_an_upper_case_metavar_in_its_usage_line():
    """Without a metavar the usage line shows the Python name ("{uri}"); typer 0.29 marks a required
    argument with braces itself (``TyperArgument._usage_display_name``), so "{URI}" is what it can say."""
    import re

    import typer.main

    group = typer.main.get_command(app)
    usages = {name: CliRunner().invoke(app, [name, "--help"]).output.splitlines()[0] for name in group.commands}
    assert usages["inspect"] == "Usage: root inspect [OPTIONS] {URI}", usages["inspect"]
    assert usages["replay"] == "Usage: root replay [OPTIONS] {RUN_OR_STORE}", usages["replay"]
    assert not {name: usage for name, usage in usages.items() if re.search(r"[{\[][^}\]]*[a-z][^}\]]*[}\]]", usage)}

# -- 8. make bench ---------------------------------------------------------------------------------
def test_make_bench_runs_every_benchmark():
    done = subprocess.run(["make", "-n", "bench"], capture_output=True, text=True, check=True, timeout=60)
    for module in ("log_cost", "persist_throughput", "hotpath_bench"):
        assert f"-m raycheck.experiments.{module}\n" in done.stdout, done.stdout


# -- 3 and 4 in a running job (Ray) ----------------------------------------------------------------
class PersisterKiller:
    """A trainer that takes storage down, kills the persister, waits until the controller has started
    a new one (``restarted``), checks it came up, has the log keeper report the outage (a step logged
    after storage went down cannot be mirrored), kills the persister again, and blocks."""

    def __init__(self, cfg: JobConfig, server: LocalS3Server, restarted: threading.Event, release: threading.Event) -> None:
        self.cfg, self.server, self.restarted, self.release = cfg, server, restarted, release
        self.status_after_restart: dict | None = None
        self.keeper_status: dict | None = None

    def _kill(self) -> None:
        ray.kill(ray.get_actor(persister_name(self.cfg), namespace=self.cfg.namespace), no_restart=True)

    def fit(self) -> None:
        self.server.stop()
        self._kill()
        if self.restarted.wait(300):
            handle = ray.get_actor(persister_name(self.cfg), namespace=self.cfg.namespace)
            self.status_after_restart = ray.get(handle.flush.remote(60), timeout=120)
            keeper = ray.get_actor(log_keeper_name(self.cfg), namespace=self.cfg.namespace)
            # a record logged during the outage: the forced mirror round must upload it, and fails
            ray.get(keeper.append.remote(StepRecord(step=0, seed=1, projected_grad=0.5, loss_plus=1.0, loss_minus=0.0,
                                                       lr=1e-6, eps=1e-3, weight_decay=0.0, batch_id=7)), timeout=60)
            self.keeper_status = ray.get(keeper.flush.remote(), timeout=120)  # one mirror round, forced
            self._kill()
        self.release.wait(600)


@pytest.fixture()
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="raycheck", _metrics_export_port=free_port())
    yield
    ray.shutdown()


@pytest.mark.ray
def test_a_persister_restarted_during_an_outage_comes_up_and_its_spent_budget_fails_the_run(cluster, tmp_path, monkeypatch):
    server = LocalS3Server().start()
    server.create_bucket()
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(default_cache_dir()), model="tiny", steps=4,
                    strategy="log-only", eval_samples=0, run_id=f"budget-{uuid.uuid4().hex[:6]}",
                    storage={"uri": server.uri("run"), "options": {"endpoint_url": server.endpoint}},
                    faults={"max_persister_restarts": 1})
    restarted, release = threading.Event(), threading.Event()
    trainer = PersisterKiller(cfg, server, restarted, release)
    restart = PersisterHandle.restart

    def restart_and_signal(self: PersisterHandle, reason: str) -> bool:
        used = self.restarts
        answered = restart(self, reason)
        if self.restarts > used:
            restarted.set()
        return answered

    monkeypatch.setattr(PersisterHandle, "restart", restart_and_signal)
    monkeypatch.setattr(raycheck.orchestrator.controller, "trainer", lambda cfg, shipped, placement, loop: trainer)
    try:
        returned = Controller(cfg, echo=lambda _: None).run()
    finally:
        release.set()
        server.stop()
    status = trainer.status_after_restart
    assert status is not None, "the persister was never restarted"
    assert status["written"] == 0 and status["last_error"] is None  # it came up, and had nothing to write
    assert f"storage endpoint {server.endpoint} unreachable (connection refused)" in trainer.keeper_status["log_mirror_error"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary == {**summary, "ok": False, "phase": "failed", "persister_restarts": 1, "error": returned["error"]}
    assert summary["error"] == (
        f"{PersisterFailedError.__name__}: the snapshot persister died after 1 restarts (max_persister_restarts 1): "
        "ActorDiedError; the step log holds every step: resume with --resume, with a larger --max-persister-restarts "
        "if the persister keeps dying")
    saved = JobConfig.from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
    assert saved.faults.max_persister_restarts == 1  # --resume continues under the same budget
