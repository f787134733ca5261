"""Issue 32, item 2: the store is proven before it is trusted. Fencing (a stale writer's index update
refused) rests on conditional PUTs; moto honours them, s3rver (npm, a second S3 implementation on
127.0.0.1) ignores them. ``Storage.check_conditional_writes`` tells them apart, and ``run``,
``inspect`` and ``verify`` refuse s3rver in one line unless ``--storage-consistency unfenced``."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import make_bucket
from raycheck.job.config import JobConfig, StorageConfig
from raycheck.orchestrator.api import check_job
from raycheck.cli.main import app
from raycheck.storage.backend import PreconditionFailedError, Storage, StorageConsistencyError
from raycheck.storage.snapshots import SnapshotStore
from raycheck.training.model import default_cache_dir

REFUSAL = ("the S3 server does not honour conditional writes (it accepted a PUT with If-None-Match: * over an existing key "
           "and accepted a PUT with If-Match of a wrong ETag), so a stale writer could overwrite a newer one's index "
           "unnoticed; use a server that honours them, or pass --storage-consistency unfenced to accept that weaker guarantee")


@pytest.fixture()
def s3rver_store(s3rver, monkeypatch) -> Storage:
    endpoint, bucket = s3rver
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "S3RVER")  # s3rver's own credentials (moto takes any)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3RVER")
    return Storage(f"s3://{bucket}/{uuid.uuid4().hex[:8]}", endpoint_url=endpoint)


def stale_writer_lands(storage: Storage) -> bool:
    """Two writers read the same index; the newer one claims it first; whether the stale one's
    compare-and-swap on what it read still lands (fencing lost)."""
    storage.put("index.json", b"epoch 1")
    read_by_both = storage.get("index.json")
    storage.put_if_match("index.json", b"epoch 2 claim", read_by_both)
    try:
        storage.put_if_match("index.json", b"stale epoch 1 update", read_by_both)
    except PreconditionFailedError:
        return False
    return storage.get("index.json") == b"stale epoch 1 update"


def test_moto_honours_conditional_writes_and_fences_a_stale_writer(s3_endpoint):
    bucket = f"rc-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    storage = Storage(f"s3://{bucket}/run", endpoint_url=s3_endpoint)
    assert storage.conditional_write_faults() == []
    storage.check_conditional_writes()
    assert not stale_writer_lands(storage)
    assert storage.list() == ["index.json"]  # the probe's scratch object is gone


def test_s3rver_ignores_them_the_probe_names_both_and_the_stale_writer_lands(s3rver_store):
    assert s3rver_store.conditional_write_faults() == ["accepted a PUT with If-None-Match: * over an existing key",
                                                       "accepted a PUT with If-Match of a wrong ETag"]
    with pytest.raises(StorageConsistencyError) as exc:
        s3rver_store.check_conditional_writes()
    assert str(exc.value) == f"{s3rver_store.url()}: {REFUSAL}"
    assert s3rver_store.list() == []  # the probe's scratch object is gone
    assert stale_writer_lands(s3rver_store)  # what the refusal protects against


def test_run_inspect_and_verify_refuse_s3rver_in_one_line_unless_unfenced(s3rver_store, tmp_path):
    uri, endpoint = s3rver_store.uri, s3rver_store.options["endpoint_url"]
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "2", "--out", str(tmp_path / "run"),
                                      "--storage", uri, "--s3-endpoint", endpoint])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [f"error: snapshot storage {uri} is not usable: {s3rver_store.url()}: {REFUSAL}"]
    assert not (tmp_path / "run" / "steplog.bin").exists()
    cfg = JobConfig(out_dir=str(tmp_path / "unfenced"), cache_dir=str(default_cache_dir()), model="tiny", steps=2,
                    storage={"uri": uri, "options": {"endpoint_url": endpoint}, "consistency": "unfenced"})
    assert check_job(cfg)[0].storage.consistency == "unfenced"  # accepted: the weaker guarantee was asked for
    SnapshotStore(s3rver_store).write(2, {"model.layers.0.w": np.full(8, 2.0, dtype=np.float32)})
    for command in ("inspect", "verify"):
        refused = CliRunner().invoke(app, [command, uri, "--s3-endpoint", endpoint])
        assert refused.exit_code == 2, refused.output
        assert refused.output.splitlines() == [f"error: cannot read snapshot store {uri}: {s3rver_store.url()}: {REFUSAL}"]
        unfenced = CliRunner().invoke(app, [command, uri, "--s3-endpoint", endpoint, "--storage-consistency", "unfenced"])
        assert unfenced.exit_code == 0 and "step        2" in unfenced.output, unfenced.output


def test_an_unknown_consistency_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"^storage consistency 'strong': choose one of fenced, unfenced$"):
        StorageConfig(consistency="strong")
