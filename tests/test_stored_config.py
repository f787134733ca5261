"""The run's configuration in its storage (``orchestrator.stored_config``) and ``raycheck run --resume
--storage URI`` into a new run directory, up to the start of training (no Ray): the round trip
through a real moto bucket, the failures that count as fired, and every refusal."""

from __future__ import annotations

import json
import pathlib
import uuid

import pytest
from typer.testing import CliRunner

from conftest import free_port, make_bucket
from raycheck.job.config import FailureSpec, JobConfig, default_scratch_dir
from raycheck.job.run_dir import RunDir
from raycheck.cli.main import app
from raycheck.orchestrator.prepare import prepare
from raycheck.orchestrator.stored_config import CONFIG_OBJECT, StoredConfigError, load_config, save_config
from raycheck.storage.backend import Storage
from raycheck.storage.log_segments import SegmentMirror
from raycheck.storage.steplog import StepLogWriter, StepRecord
from raycheck.workers.faults import fired_before
from raycheck.training.model import default_cache_dir

SECRET = "s3cret-" + uuid.uuid4().hex


@pytest.fixture()
def bucket(s3_endpoint) -> str:
    """A new, empty bucket's run prefix (``s3://BUCKET/run``)."""
    name = f"stored-{uuid.uuid4().hex[:8]}"
    make_bucket(s3_endpoint, name)
    return f"s3://{name}/run"


def run_config(tmp_path: pathlib.Path, uri: str, endpoint: str, **kw) -> JobConfig:
    """The stored run's configuration, ``kw`` replaced (``JobConfig.replace``: a component's dict merges)."""
    return JobConfig(out_dir=str(tmp_path / "old"), cache_dir=str(default_cache_dir()), model="tiny", steps=6, run_id="stored",
                     storage={"uri": uri, "options": {"endpoint_url": endpoint}},
                     faults={"failures": (FailureSpec.parse("2:both"),)}).replace(**kw)


def mirror_a_log(cfg: JobConfig, tmp_path: pathlib.Path, steps: int = 1) -> None:
    """Prepare ``cfg``'s run directory, log ``steps`` records and mirror them to its storage as segments."""
    out = pathlib.Path(cfg.out_dir)
    out.mkdir(parents=True)
    prepare(cfg, RunDir(out))
    writer = StepLogWriter.open(out / "steplog.bin")
    for step in range(steps):
        writer.append(StepRecord(step=step, seed=7 + step, projected_grad=0.25, loss_plus=0.7, loss_minus=0.69,
                                 lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=0.0, batch_id=step))
    writer.close()
    SegmentMirror(Storage(cfg.storage.uri, **cfg.storage.options), out / "steplog.bin").sync(final=True)


def resume_from(uri: str, endpoint: str, out: pathlib.Path, *extra: str):
    return CliRunner().invoke(app, ["run", "--resume", "--storage", uri, "--s3-endpoint", endpoint, "--out", str(out), *extra])


def test_the_configuration_round_trips_through_the_bucket_without_credentials(tmp_path, bucket, s3_endpoint):
    cfg = run_config(tmp_path, bucket, s3_endpoint).replace(storage={"options": {"endpoint_url": s3_endpoint, "key": "any", "secret": SECRET}})
    assert save_config(cfg)
    raw = Storage(bucket, endpoint_url=s3_endpoint).get(CONFIG_OBJECT)
    assert SECRET.encode() not in raw and s3_endpoint.encode() not in raw and json.loads(raw)["storage"]["options"] == {}
    new = tmp_path / "new"
    loaded = load_config(bucket, {"endpoint_url": s3_endpoint}, new, tmp_path / "cache")
    assert loaded == cfg.replace(out_dir=str(new), cache_dir=str(tmp_path / "cache"), scratch_dir=default_scratch_dir(str(new), "stored"),
                                 storage={"options": {"endpoint_url": s3_endpoint}})
    assert loaded.trajectory_sha256() == cfg.trajectory_sha256()


def test_another_runs_configuration_in_the_bucket_is_never_replaced(tmp_path, bucket, s3_endpoint):
    first = run_config(tmp_path, bucket, s3_endpoint)
    assert save_config(first)
    before = Storage(bucket, endpoint_url=s3_endpoint).get(CONFIG_OBJECT)
    assert not save_config(first.replace(run_id="second"))
    assert Storage(bucket, endpoint_url=s3_endpoint).get(CONFIG_OBJECT) == before
    assert save_config(first.replace(steps=9))  # the same run's, replaced


def test_failures_due_before_the_durable_step_count_as_fired():
    failures = tuple(FailureSpec.parse(f) for f in ("1:worker", "3:both", "3:persister", "4:shadow:1", "5:corrupt"))
    assert fired_before(failures, 0) == []
    assert fired_before(failures, 3) == ["0.worker"]
    assert fired_before(failures, 4) == ["0.worker", "1.shadow", "1.shadow-killed", "1.worker", "2.persister"]
    assert fired_before(failures, 6)[-3:] == ["3.shadow", "3.shadow-killed", "4.corrupt"]
    assert fired_before((FailureSpec.parse("2:node"),), 3) == ["0.worker"]  # announced and claimed as a worker failure


def test_resume_from_the_bucket_alone_starts_the_saved_run_in_the_new_directory(tmp_path, bucket, s3_endpoint, monkeypatch):
    import raycheck.orchestrator.runs

    cfg = run_config(tmp_path, bucket, s3_endpoint, faults={"max_persister_restarts": 1})
    mirror_a_log(cfg, tmp_path, steps=2)
    save_config(cfg)
    seen = []

    def finished(cfg, verify, echo, assets=None) -> dict:
        seen.append(cfg)
        return {"ok": False, "error": "stop here"}

    monkeypatch.setattr(raycheck.orchestrator.runs, "run_job", finished)
    new = tmp_path / "new"
    result = resume_from(bucket, s3_endpoint, new, "--max-persister-restarts", "5")
    assert result.exit_code == 1, result.output
    assert "ignored" not in result.output and "--resume: max_persister_restarts 1 -> 5" in result.output
    assert seen == [cfg.replace(out_dir=str(new.resolve()), scratch_dir=default_scratch_dir(str(new.resolve()), "stored"),
                                faults={"max_persister_restarts": 5})]


def test_a_configuration_in_the_flat_form_of_an_older_raycheck_is_refused_in_one_line(tmp_path, bucket, s3_endpoint):
    flat = {"run_id": "stored", "storage": bucket, "storage_options": {}, "snapshot_every": 10}  # as config.json held them
    Storage(bucket, endpoint_url=s3_endpoint).put(CONFIG_OBJECT, json.dumps(flat).encode())
    with pytest.raises(StoredConfigError) as err:
        load_config(bucket, {"endpoint_url": s3_endpoint}, tmp_path / "new", tmp_path / "cache")
    assert str(err.value).startswith(f"{bucket}/{CONFIG_OBJECT}: configuration written by an older raycheck (flat fields")
    assert "\n" not in str(err.value)


def test_a_bucket_without_a_run_is_refused(tmp_path, bucket, s3_endpoint):
    result = resume_from(bucket, s3_endpoint, tmp_path / "new")
    assert result.exit_code == 2, result.output
    assert f"error: {bucket} holds no run to resume (no config.json): give the --storage URI the run was started with" in result.output
    assert not (tmp_path / "new").exists()


def test_a_resume_from_an_endpoint_that_is_down_is_one_error_line_without_retries(tmp_path, bucket):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = resume_from(bucket, down, tmp_path / "new")
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        f"error: snapshot storage {bucket} is not usable: storage endpoint {down} unreachable (connection refused); check "
        "that the server runs and the endpoint URL (--s3-endpoint or $AWS_ENDPOINT_URL)"]
    assert not (tmp_path / "new").exists()


def test_a_bucket_holding_another_runs_log_is_refused(tmp_path, bucket, s3_endpoint):
    mirror_a_log(run_config(tmp_path, bucket, s3_endpoint).replace(run_id="other"), tmp_path)
    save_config(run_config(tmp_path, bucket, s3_endpoint))  # a config of run "stored" beside run "other"'s log
    result = resume_from(bucket, s3_endpoint, tmp_path / "new")
    assert result.exit_code == 2, result.output
    assert f"error: {bucket} holds another run's data: its config.json is run stored" in result.output
    assert "its step log run other" in result.output and not (tmp_path / "new").exists()


def test_a_damaged_configuration_in_the_bucket_is_one_error_line(tmp_path, bucket, s3_endpoint):
    Storage(bucket, endpoint_url=s3_endpoint).put(CONFIG_OBJECT, b'{"run_id": "x", "steps": ')
    result = resume_from(bucket, s3_endpoint, tmp_path / "new")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "/run/config.json is damaged (JSONDecodeError" in lines[0]


def test_a_resume_from_the_bucket_into_a_used_directory_or_from_local_storage_is_refused(tmp_path, bucket, s3_endpoint):
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    result = resume_from(bucket, s3_endpoint, used)
    assert result.exit_code == 2 and f"error: {used} is not empty and holds no run (no config.json)" in result.output
    assert [p.name for p in used.iterdir()] == ["notes.txt"]
    local = CliRunner().invoke(app, ["run", "--resume", "--storage", str(tmp_path / "store"), "--out", str(tmp_path / "new")])
    assert local.exit_code == 2 and "is local: only remote storage (s3://) holds the run's step log" in local.output
    bare = CliRunner().invoke(app, ["run", "--resume", "--out", str(tmp_path / "new")])
    assert bare.exit_code == 2 and "to resume from the run's storage alone, add --storage URI" in bare.output
