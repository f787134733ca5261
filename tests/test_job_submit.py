"""The same job through ``ray job submit`` against a ``ray start --head`` on 127.0.0.1."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from cluster import agent_ports, stop_cluster
from conftest import free_port

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
SECRET = f"secret-{uuid.uuid4().hex}"
"""The cluster's AWS_SECRET_ACCESS_KEY: handed to every process, written nowhere."""


@pytest.fixture()
def head_node():
    tmp = tempfile.mkdtemp(prefix="rcjob-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_TMPDIR": tmp, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "PATH": f"{BIN}:{os.environ['PATH']}", "AWS_SECRET_ACCESS_KEY": SECRET}
    env.pop("RAY_ADDRESS", None)
    gcs, dash = free_port(), free_port()
    subprocess.run(
        [BIN / "ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--disable-usage-stats",
         *agent_ports()],
        env=env, check=True, capture_output=True, timeout=120,
    )
    try:
        yield env, f"http://127.0.0.1:{dash}", pathlib.Path(tmp)
    finally:
        stop_cluster((tmp, f"127.0.0.1:{gcs}", f":{gcs} "))
        shutil.rmtree(tmp, ignore_errors=True)


def test_ray_job_submit_runs_the_job_with_a_failure(head_node):
    env, address, tmp = head_node
    out = tmp / "job-run"
    cmd = [BIN / "ray", "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
           "python", "-m", "orchestrator.cli", "run", "--model", "tiny", "--steps", "6", "--eval-samples", "0",
           "--fail", "3:worker", "--settle-failures", "--out", str(out)]
    for _ in range(12):  # right after `ray start` the job agent may not be up yet ("No available agent")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if "No available agent" not in proc.stdout + proc.stderr:
            break
        time.sleep(5)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["final_step"] == 6 and summary["shadow_equal"]
    assert [r["source"] for r in summary["recoveries"]] == ["object_store"]
    placement, head = summary["placement"], summary["placement"]["driver"]["node_id"]
    assert placement["policy"] == "one node: everything on it"
    assert [(w["rank"], w["node_id"]) for w in placement["workers"]] == [(0, head), (0, head)]  # the start and the restart
    assert placement["persister"] == [placement["driver"]]
    assert [[p["node_id"] for p in shard] for shard in placement["shadow_shards"]] == [[head]]
    assert [p.name for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()] == []
