"""``--dtype bfloat16`` end to end on a local Ray cluster, on a causal-LM data file: one worker failure,
``--verify``, bitwise equal."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from raycheck.cli.main import app
from test_end_to_end import cluster  # noqa: F401  (the module's local Ray cluster)
from test_own_model_data import write_rows

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]


def test_bfloat16_run_with_a_worker_failure_is_bitwise_equal_to_its_reference(cluster, tmp_path):  # noqa: F811
    """The worker trains in bfloat16 on the best CPU kernels, on the completion loss of a prompt/completion
    JSONL file (``--task causal-lm``), the shadow replays on the default kernels (``--shadow-env``); the
    failed worker restores the shadow's bfloat16 image; the failure-free reference ends with the same
    bits, the snapshots hold BF16 tensors, and ``raycheck replay`` of a logged step, from its BF16
    snapshot and from the initial weights plus the log, gives the worker's hash."""
    out = tmp_path / "run"
    data = write_rows(tmp_path / "qa.jsonl", [{"prompt": f"Question {i}: is {i} even?", "completion": f" {'yes' if i % 2 == 0 else 'no'}"}
                                              for i in range(40)])
    result = CliRunner().invoke(app, [
        "run", "--model", "tiny", "--dtype", "bfloat16", "--data", str(data), "--task", "causal-lm", "--batch-size", "4",
        "--seq-len", "16", "--steps", "6", "--lr", "1e-3", "--eval-samples", "4", "--hash-every", "2", "--snapshot-every", "2",
        "--settle-failures", "--fail", "3:worker", "--verify", "--shadow-env", "ATEN_CPU_CAPABILITY=default", "--out", str(out)])
    assert result.exit_code == 0, result.output
    s = json.loads((out / "summary.json").read_text())
    assert s["dtype"] == "bfloat16" and s["final_step"] == 6 and s["lost_steps"] == 0
    assert s["eval_metric"] == "loss" and s["accuracy_before"] > 0 and s["accuracy_after"] > 0  # held-out completion losses
    assert [(r["failure_step"], r["source"]) for r in s["recoveries"]] == [(3, "object_store")]
    assert s["bitwise_equal"] is True and s["state_sha256"] == s["reference_state_sha256"]
    assert s["shadow_equal"] is True and s["shadow_cpu_capability"] == "DEFAULT"
    shards = sorted((out / "snapshots").rglob("*.safetensors"))
    assert shards
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}, shard
    for extra, how in (([], "base snapshot of step 4"), (["--from-initial"], "base the initial weights; replayed steps 0..3 (4)")):
        replayed = CliRunner().invoke(app, ["replay", str(out), "--step", "4", *extra])
        assert how in replayed.output, replayed.output
        assert replayed.output.strip().endswith(f"state_sha256 {s['worker_hashes']['4']}"), replayed.output
