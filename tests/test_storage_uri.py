"""The one reading of a storage URI (``storage.backend.split_uri``) and what is built on it: the local
folder (``local_path``), whether only one node holds the storage (``node_local``) and ``Storage``'s
scheme; Ray Train's storage of a run (no Ray; an S3 server on 127.0.0.1)."""

from __future__ import annotations

import os
import pathlib
import uuid

import pytest

from conftest import make_bucket
from raycheck.orchestrator.api import job_config
from raycheck.orchestrator.trainer import ray_train_storage
from raycheck.storage.backend import Storage, local_path, node_local, split_uri


@pytest.mark.parametrize("uri, parts, local, one_node", [
    ("s3://bucket/run/a", ("s3", "bucket/run/a"), None, False),
    ("memory://scratch", ("memory", "scratch"), None, True),
    ("file:///data/run", ("file", "/data/run"), "/data/run", True),
    ("/data/run", ("file", "/data/run"), "/data/run", True),
    ("gs://bucket/run", ("gs", "bucket/run"), None, False),
])
def test_a_uri_is_taken_apart_once(uri, parts, local, one_node):
    assert split_uri(uri) == parts
    assert local_path(uri) == (None if local is None else pathlib.Path(local).resolve())
    assert node_local(uri) is one_node


def test_a_relative_path_is_a_local_folder_resolved_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert split_uri("runs/a") == ("file", "runs/a")
    assert local_path("runs/a") == local_path("file://runs/a") == tmp_path.resolve() / "runs" / "a"
    assert Storage("runs/a").root == Storage("file://runs/a").root == os.path.join(str(tmp_path.resolve()), "runs", "a")


def test_storage_refuses_a_scheme_it_has_no_backend_for():
    with pytest.raises(ValueError, match=r"^'gs://bucket/run': unsupported storage scheme 'gs'; use one of file, s3, memory$"):
        Storage("gs://bucket/run")


def test_ray_train_storage_is_the_driver_disk_by_default_or_a_bucket_through_raycheck_s_filesystem(tmp_path, s3_endpoint):
    """``--ray-train-storage``: ``RunConfig``'s storage arguments; a bucket is reached with the run's
    endpoint (its storage options), through the same filesystem raycheck's ``Storage`` uses."""
    assert ray_train_storage(job_config(tmp_path / "run")) == {"storage_path": str(tmp_path.resolve() / "run" / "ray_train")}
    assert ray_train_storage(job_config(tmp_path / "run", storage={"ray_train": str(tmp_path / "rt")})) == {
        "storage_path": str(tmp_path.resolve() / "rt")}
    bucket = f"rc-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    kwargs = ray_train_storage(job_config(tmp_path / "run", storage={"ray_train": f"s3://{bucket}/rt", "options": {"endpoint_url": s3_endpoint}}))
    assert kwargs["storage_path"] == f"{bucket}/rt"
    with kwargs["storage_filesystem"].open_output_stream(f"{bucket}/rt/marker") as f:  # what Ray Train writes first
        f.write(b"ray train")
    assert Storage(f"s3://{bucket}/rt", endpoint_url=s3_endpoint).get("marker") == b"ray train"
    with pytest.raises(ValueError, match=r"Ray Train's storage 'memory://rt': give a path or s3://BUCKET/PREFIX"):
        job_config(tmp_path / "run", storage={"ray_train": "memory://rt"})
