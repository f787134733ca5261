"""The API example script end to end on a local Ray cluster: a GPT-2 folder (random weights, made
here) and a small JSONL classification file, in float16, one worker failure, ``--verify``: bitwise equal."""

from __future__ import annotations

import json
import pathlib
import os
import subprocess
import sys

import pytest

from test_own_model_data import gpt2_folder, reviews, write_rows
from raycheck.training.model import read_model_files

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]


def test_example_script_finetunes_a_gpt2_folder_on_jsonl_in_float16_with_a_worker_failure_bitwise_equal(tmp_path):
    folder = gpt2_folder(tmp_path / "my-gpt2")
    data = write_rows(tmp_path / "reviews.jsonl", reviews(30))
    out = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", "/tmp/raycheck-ray")}
    done = subprocess.run([sys.executable, "examples/finetune_my_model.py", "--model", str(folder), "--data", str(data),
                           "--out", str(out), "--steps", "5", "--fail-step", "3", "--verify", "--dtype", "float16"],
                          capture_output=True, text=True, env=env, timeout=900, cwd=pathlib.Path(__file__).parents[1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = json.loads(done.stdout[done.stdout.index("{\n"):])
    summary = json.loads((out / "summary.json").read_text())
    assert printed["state_sha256"] == summary["state_sha256"] == summary["reference_state_sha256"]
    assert summary["bitwise_equal"] is True and summary["shadow_equal"] is True and summary["lost_steps"] == 0
    assert [f["step"] for f in summary["failures"]] == [3] and len(summary["recoveries"]) == 1
    assert summary["final_step"] == 5 and summary["eval_metric"] == "accuracy" and printed["dtype"] == summary["dtype"] == "float16"
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    config = json.loads((out / "config.json").read_text())
    assert config["model"] == str(folder) and config["model_sha256"] == read_model_files(str(folder)).sha256
    assert config["data"]["path"] == str(data) and len(config["data"]["sha256"]) == 64
