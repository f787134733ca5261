"""A driver stopped by SIGTERM (``ray job stop``, a pod eviction) and resumed: the stop leaves a summary and a
run that resumes exactly, and the resumed driver goes on with what the first one measured and counted.

The CLI runs in a child process (its own Ray cluster, as a user's ``raycheck run``), so the signal reaches
a real driver with Ray's own SIGTERM handlers installed.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pyarrow.parquet as pq
import pytest

from raycheck.job.run_dir import RunDir

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS, STOP_AFTER = 24, 8


@pytest.fixture()
def child_env():
    """The environment of a child ``raycheck`` with a fresh, short Ray session folder (socket paths must fit 107 bytes)."""
    tmp = tempfile.mkdtemp(prefix="rcst-", dir="/tmp")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": tmp}
    env.pop("RAY_ADDRESS", None)
    yield env
    shutil.rmtree(tmp, ignore_errors=True)


def raycheck(env: dict, *args: str) -> list[str]:
    return [sys.executable, "-m", "raycheck.cli", "run", *args]


def observed_steps(out: pathlib.Path) -> int:
    """The steps the run's snapshot planner has observed, by its saved state (0 before the first save)."""
    saved = RunDir.read_json(out / "controller.json")
    return 0 if saved is None else saved["planner"]["policy"]["replanner"]["estimates"]["step_s"]["count"]


def test_sigterm_leaves_a_summary_and_the_resumed_run_keeps_its_planner_and_is_exact(tmp_path, child_env):
    """SIGTERM once ``STOP_AFTER`` steps are in: the driver exits 143 with the resume command, ``summary.json``
    says why (written before any Ray call), and ``controller.json`` holds the adaptive planner's state. The
    resume ends bitwise equal to the failure-free run; its planner went on from the saved one: every step
    of the run was observed exactly once over both drivers (its step-time estimate counts them all), and
    each step's snapshot interval is recorded."""
    out = tmp_path / "run"
    proc = subprocess.Popen(raycheck(child_env, "--model", "tiny", "--steps", str(STEPS), "--eval-samples", "0",
                                     "--snapshot-policy", "adaptive", "--mtbf", "2s", "--out", str(out)),
                            env=child_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while observed_steps(out) < STOP_AFTER:  # the driver has planned STOP_AFTER steps and saved its state
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    stopped_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stdout[-2000:] + stderr[-3000:]
    assert time.monotonic() - stopped_at < 3.0  # before ray job stop's SIGKILL (RAY_JOB_STOP_WAIT_TIME_S, 3 s)
    assert stderr.splitlines()[-2:] == ["stopped by SIGTERM: the run stopped; resume it with:", f"  raycheck run --resume --out {out}"]
    assert "Traceback" not in stdout + stderr, stderr[-3000:]
    stopped = json.loads((out / "summary.json").read_text())
    assert (stopped["ok"], stopped["error"], stopped["phase"]) == (False, "Terminated: stopped by SIGTERM", "failed")
    saved = json.loads((out / "controller.json").read_text())
    observed = observed_steps(out)
    assert STOP_AFTER <= observed == saved["planner"]["fed_through"] + 1 < STEPS

    resumed = subprocess.run(raycheck(child_env, "--resume", "--verify", "--out", str(out)), env=child_env, cwd=REPO,
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary == {**summary, "ok": True, "final_step": STEPS, "bitwise_equal": True, "lost_steps": 0}
    final = json.loads((out / "controller.json").read_text())
    rows = RunDir.read(out / "metrics.jsonl")
    # each row once (the steps done just before the stop whose rows were still on their way to the journal have none:
    # those died with the worker; their records are in the step log, so the state has them)
    assert final["planner"]["policy"]["replanner"]["estimates"]["step_s"]["count"] == len(rows) > observed
    assert rows[-1]["step"] == STEPS - 1 and len({r["step"] for r in rows}) == len(rows)
    assert final["planner"]["elapsed_s"] > saved["planner"]["elapsed_s"]  # the MTBF estimate counts both drivers' time
    intervals = pq.read_table(out / "metrics.parquet").column("snapshot_interval_steps").to_pylist()
    planned = [r for r in saved["planner"]["policy"]["records"]]  # the interval at a step: the newest re-plan at or before it
    assert None not in intervals and intervals[:observed] == [[p for p in planned if p["step"] <= r["step"]][-1]["interval_steps"]
                                                              for r in rows[:observed]]
