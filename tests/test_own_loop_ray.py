"""examples/own_loop_fo.py end to end under Ray Train: a user's own MLP, data, loss and AdamW with
``FirstOrderCheckpoints`` (layer-wise, threshold 0), 2 DDP workers, the rank-0 process exits once at
step 6, Ray Train restarts the group, every rank restores: bitwise equal to the failure-free run, and
``Result.checkpoint`` points at the newest committed snapshot and loads in one call (about 100 s here)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from raycheck.storage.snapshots import SnapshotStore
from raycheck.training.optim_state import ModelOptimizerState
from raycheck.training.state import state_sha256
from raycheck.workers.own_loop import load_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]
ROOT = pathlib.Path(__file__).parents[1]


def test_own_loop_example_recovers_a_ddp_worker_failure_bitwise_and_reports_the_newest_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", "/tmp/raycheck-ray")}
    done = subprocess.run([sys.executable, "examples/own_loop_fo.py", "--out", str(out), "--fail-step", "6", "--verify",
                           "--workers", "2", "--steps", "12", "--every", "4"],
                          capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{\n"):])
    assert summary["strategy"] == "layerwise" and summary["layer_threshold"] == 0.0 and summary["workers"] == 2
    assert summary["recovery"] == "exact" and summary["bitwise_equal"] is True
    assert summary["state_sha256"] == summary["reference_sha256"]
    assert summary["worker_starts"] == 2 and summary["restored_from_steps"] == [4]  # settled before the exit
    # Result.checkpoint: a pointer to the newest committed snapshot (its bytes not copied), loading the final state
    store = SnapshotStore(summary["checkpoints"])
    assert pathlib.Path(summary["result_checkpoint"]).name == store.list()[-1].folder
    assert summary["result_checkpoint_is_newest"] and summary["result_checkpoint_loads_final_state"]
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from own_loop_fo import TinyMLP
    finally:
        sys.path.remove(str(ROOT / "examples"))
    model = TinyMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    assert load_checkpoint(summary["result_checkpoint"], model, opt) == 12
    assert opt.param_groups[0]["lr"] == 1e-2
    assert state_sha256(ModelOptimizerState(model, opt).view()) == summary["state_sha256"]
