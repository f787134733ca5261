"""examples/own_loop_zo.py end to end under Ray Train: a user's own MLP, data and loss in their own loop,
with raycheck's step log, CPU shadow, persister and failure injector around it (``run_own_loop``). Each
run is a subprocess: its own local Ray cluster, as a user's script has."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from raycheck.job.stores import snapshot_store
from raycheck.job.config import JobConfig
from raycheck.storage.steplog import read_records

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]
ROOT = pathlib.Path(__file__).parents[1]
ENV = {**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", "/tmp/raycheck-ray")}


def run_example(*args: str, code: str | None = None) -> tuple[int, dict, str]:
    """Run the example (or ``code``, a script that runs it) and return (exit code, its printed summary, output)."""
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "examples/own_loop_zo.py", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=900, cwd=ROOT)
    output = done.stdout[-4000:] + done.stderr[-4000:]
    out = "\n" + done.stdout
    assert "\n{\n" in out, output
    return done.returncode, json.loads(out[out.rindex("\n{\n"):]), output  # the summary: the last top-level object


def test_two_workers_of_your_own_loop_recover_a_worker_failure_bitwise(tmp_path):
    code, summary, output = run_example("--out", str(tmp_path / "run"), "--workers", "2", "--steps", "12", "--fail-step", "6", "--verify")
    assert code == 0, output
    assert summary["ok"] and summary["final_step"] == 12 and summary["lost_steps"] == 0
    assert summary["bitwise_equal"] is True and summary["state_sha256"] == summary["reference_state_sha256"]
    assert summary["final_snapshot"].startswith(str(tmp_path / "run" / "snapshots" / "step-0000000012-"))
    assert summary["final_snapshot_loads_final_state"] is True
    reported = summary["ray_train_checkpoint"]  # Result.checkpoint: a pointer in Ray Train's storage to the final snapshot
    assert reported["path"].startswith(str(tmp_path / "run" / "ray_train")) and reported["snapshot"] == summary["final_snapshot"]
    assert reported["step"] == 12 and summary["ray_train_checkpoint_loads_final_state"] is True
    [recovery] = summary["recoveries"]
    assert recovery["failure_step"] == 6 and recovery["restored_step"] == 6 and recovery["path"] == "new_process"
    assert "your own train loop runs in Ray Train's worker process" in recovery["why"]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"] == "module:Regressor" and config["workers"] == 2
    assert [r.step for r in read_records(tmp_path / "run" / "steplog.bin")] == list(range(12))


NONDETERMINISTIC = """
import os, sys
sys.path.insert(0, "examples")
from ray import cloudpickle
import own_loop_zo as example
cloudpickle.register_pickle_by_value(example)  # the workers get this module's globals, the batch_of below
steady = example.batch_of
# targets shifted by the process id (1e-6 apart per id: distinct in float32 for |y| < 8): another batch in each process
example.batch_of = lambda step, seed, rank, world: (steady(step, seed, rank, world)[0], steady(step, seed, rank, world)[1] + os.getpid() * 1e-6)
sys.exit(example.main(sys.argv[1:]))
"""


def test_a_batch_of_that_is_not_deterministic_fails_the_run_at_the_restart_and_the_logged_state_stays(tmp_path):
    code, summary, output = run_example("--out", str(tmp_path / "run"), "--steps", "8", "--fail-step", "4", "--every", "2",
                                        code=NONDETERMINISTIC)
    assert code == 1, output
    assert not summary["ok"] and (summary["final_step"] or 0) < 8
    assert summary["error"].startswith("WorkerCodeError: BatchMismatchError: batch_of(3) is not deterministic: it gave batch "), summary["error"]
    assert "\n" not in summary["error"] and "Traceback" not in output, output
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert {e["step"] for e in events if e["kind"] == "code_error"} == {4}  # each start that met it (Ray Train may restart once more)
    # the steps logged before the failure stay, and the newest snapshot of them loads
    assert [r.step for r in read_records(tmp_path / "run" / "steplog.bin")] == [0, 1, 2, 3]
    cfg = JobConfig.from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
    info, state, _ = snapshot_store(cfg).load_latest()
    assert info.step in (2, 4) and set(state) == {"hidden.weight", "hidden.bias", "out.weight", "out.bias"}
