"""Shared fixtures: the real tokenizer and data, the tiny model, and a local Ray cluster when needed."""

from __future__ import annotations

import os
import pathlib

import pytest

from raycheck.experiments.s3_server import free_port  # noqa: F401  (re-exported for the tests)
from raycheck.job.config import default_scratch_dir

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")  # for the moto S3 server; set before Ray starts
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")  # so that actors and workers inherit them


def zo_step_(params, model, encoder, train, cfg, step, rank, world, hyper, fail, commit, exchange=None):
    """The worker's MeZO step on raycheck's task without Ray: ``workers.zo_session.mezo_step_`` over
    ``workers.worker.task_batch`` (what ``ZerothOrder.step`` runs). Returns (record, commit's seconds)."""
    from raycheck.workers.worker import task_batch
    from raycheck.workers.zo_session import mezo_step_

    return mezo_step_(params, task_batch(model, encoder, train, cfg, step, rank, world), step, cfg, hyper, fail, commit,
                      exchange, world)


@pytest.fixture(scope="session")
def data():
    from raycheck.training.data import load_rotten_tomatoes

    return load_rotten_tomatoes()


@pytest.fixture(scope="session")
def encoder():
    from raycheck.training.data import PromptEncoder
    from raycheck.training.model import load_tokenizer

    return PromptEncoder(load_tokenizer(), seq_len=32)


@pytest.fixture()
def tiny_model():
    from raycheck.training.model import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto) on 127.0.0.1 for the whole session."""
    from raycheck.experiments.s3_server import LocalS3Server

    server = LocalS3Server().start()
    yield server.endpoint
    server.stop()


S3RVER_VERSION = "3.7.1"
S3RVER_DIR = pathlib.Path(__file__).resolve().parent.parent / ".cache" / "s3rver"
"""Where ``scripts/setup.sh`` installs s3rver (npm), the second S3 implementation the tests start."""


@pytest.fixture(scope="session")
def s3rver(tmp_path_factory):
    """(endpoint URL, bucket) of s3rver (a Node S3 server that ignores If-Match and If-None-Match on PUT)
    on 127.0.0.1 for the session; its credentials are S3RVER / S3RVER. Installed into ``S3RVER_DIR``
    when missing (``scripts/setup.sh`` does it in CI); skipped only where node or npm are absent."""
    import shutil
    import subprocess
    import uuid

    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("s3rver (the second S3 implementation) needs node and npm, which are not installed")
    modules = S3RVER_DIR / "node_modules"
    if not (modules / "s3rver" / "package.json").is_file():
        subprocess.run(["npm", "install", "--prefix", str(S3RVER_DIR), "--no-audit", "--no-fund", "--silent",
                        f"s3rver@{S3RVER_VERSION}"], check=True, timeout=600)
    port, bucket = free_port(), f"rc-{uuid.uuid4().hex[:10]}"
    proc = subprocess.Popen(["node", str(pathlib.Path(__file__).with_name("s3rver_main.js")), str(modules), str(port),
                             str(tmp_path_factory.mktemp("s3rver")), bucket], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "s3rver did not start"
        yield f"http://127.0.0.1:{port}", bucket
    finally:
        proc.terminate()
        proc.wait(10)


def make_bucket(endpoint: str, name: str) -> None:
    import s3fs

    s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(name)


@pytest.fixture(params=["file", "s3", "memory"])
def storage(request, tmp_path):
    """A fresh, empty ``Storage`` of each backend."""
    import uuid

    from raycheck.storage.backend import Storage

    if request.param == "file":
        return Storage(str(tmp_path / "store"))
    if request.param == "memory":
        return Storage(f"memory://raycheck-{uuid.uuid4().hex}")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"rc-{uuid.uuid4().hex[:12]}"
    make_bucket(endpoint, bucket)
    return Storage(f"s3://{bucket}/run", endpoint_url=endpoint)


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    """A three-node Ray cluster (``experiments/local_cluster.py``: head for the driver, a "gpu" node with
    ``{"train": 2}``, a "cpu" node with ``{"replica": 8}``) whose two non-head nodes cannot see this
    session's temporary directories nor rank 0's default scratch root, with the head's dashboard (``ray job
    submit``); this process is connected to it (namespace ``raycheck``)."""
    import ray

    from raycheck.experiments.local_cluster import THREE_NODES, LocalCluster

    scratch_root = pathlib.Path(default_scratch_dir("out", "run")).parent  # rank 0's default scratch: node-local on a cluster
    scratch_root.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(THREE_NODES, [tmp_path_factory.getbasetemp(), scratch_root], dashboard=True).start()
    try:
        ray.init(address=cluster.address, namespace="raycheck", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()

