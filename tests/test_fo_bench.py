"""The first-order benchmark's measurement pieces (no Ray): the deviation statistic, the held-out batch,
the restart points, the calibration of the differential full interval, and a short layer-wise run on
the tiny model whose exact composites must show a deviation of exactly zero."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch

from raycheck.training.optim_state import group_values
from raycheck.experiments import fo_bench
from raycheck.training.fo import FOHyper, FOTrainer
from raycheck.training.model import load_model
from raycheck.training.state import state_sha256


def test_deviation_stats_are_relative_per_seed_with_a_student_t_interval():
    d = fo_bench.deviation_stats([2.0, 1.0, 4.0], [2.02, 0.99, 4.0])
    assert d["per_seed_pct"] == pytest.approx([1.0, -1.0, 0.0])
    assert d["mean_abs_pct"] == pytest.approx(2 / 3) and d["mean_signed_pct"] == pytest.approx(0.0) and d["seeds"] == 3
    half = 4.303 * np.std([1.0, 1.0, 0.0], ddof=1) / math.sqrt(3)  # t_{0.975, 2}
    assert 2 / 3 - half < 0 and d["ci95_pct"] == pytest.approx([0.0, 2 / 3 + half])  # a mean of |deviations|: clamped at 0
    assert fo_bench.deviation_stats([1.0], [1.5])["ci95_pct"] is None
    # |deviations| 0, 0, 3 (%): mean 1, half-width 4.303 * sqrt(3) / sqrt(3) = 4.303: the t interval's -3.3 is clamped
    spread = fo_bench.deviation_stats([1.0, 1.0, 1.0], [1.0, 1.0, 0.97])
    assert spread["mean_abs_pct"] == pytest.approx(1.0) and spread["ci95_pct"] == pytest.approx([0.0, 1.0 + 4.303])
    assert spread["ci95_pct"][0] == 0.0
    with pytest.raises(ValueError, match="one restarted loss per reference"):
        fo_bench.deviation_stats([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="> 0"):
        fo_bench.deviation_stats([0.0], [1.0])


def test_restart_points_and_the_held_out_batch():
    assert fo_bench.restart_points(40, 3, 30) == [40, 70, 100]
    assert fo_bench.restart_points(40, 1, 0) == [40]
    with pytest.raises(ValueError, match="seeds"):
        fo_bench.restart_points(40, 0, 30)
    with pytest.raises(ValueError, match="gap"):
        fo_bench.restart_points(40, 2, 0)
    idx = fo_bench.eval_indices(64, 1000)
    assert len(set(idx.tolist())) == 64 and list(idx) == sorted(idx) and idx.max() < 1000
    assert np.array_equal(idx, fo_bench.eval_indices(64, 1000))  # fixed: every evaluation sees the same examples
    with pytest.raises(ValueError, match="eval size"):
        fo_bench.eval_indices(1001, 1000)


def test_calibration_chooses_the_cost_models_interval_and_leaves_the_state_bitwise(encoder, data, tmp_path):
    torch.set_num_threads(1)
    trainer = FOTrainer(load_model("tiny"), FOHyper(lr=1e-4, max_grad_norm=1.0), encoder)
    before = state_sha256(trainer.state_view())
    args = argparse.Namespace(out=tmp_path, batch_size=4, batch_steps=2, mtbf=3600.0, record_budget_gb=0.05)
    c = fo_bench.calibrate_full_every(trainer, fo_bench.step_records(trainer), data[0], args)
    assert state_sha256(trainer.state_view()) == before
    assert all(c[k] > 0 for k in ("step_s", "replay_step_s", "snapshot_s", "stall_s"))
    hyper_parameters = sum(v.numel() * 8 for v in group_values(trainer.optimizer).values())  # float64, in each record
    assert c["record_bytes"] == sum(p.numel() * 4 for p in trainer.model.parameters()) + hyper_parameters
    assert c["budget_full_every"] == int(0.05e9 // c["record_bytes"]) // 2 * 2
    assert c["full_every"] == min(c["model_full_every"], c["budget_full_every"]) and c["full_every"] % 2 == 0
    assert not (tmp_path / "stores" / "calibration").exists()


def test_exact_composites_restart_with_zero_deviation_and_the_noise_floor_does_not(tmp_path):
    """Threshold 0 rewrites every changed unit at every check, so each composite is the failure-free
    state at its restart point: the restarted runs' eval losses equal the failure-free ones exactly.
    A restart from any other step (e.g. the newest composite instead of the one at the point) would not."""
    result = fo_bench.main(["--model", "tiny", "--strategies", "layerwise", "--restart-at", "10", "--seeds", "2",
                            "--seed-gap", "10", "--post-restart", "5", "--eval-size", "16", "--noise-floor",
                            "--threshold", "0", "--lr", "1e-4", "--batch-size", "4", "--out", str(tmp_path)])
    deviation = result["strategies"]["layerwise"]["deviation"]
    assert [s["composite_step"] for s in deviation["seeds"]] == [10, 20]
    assert [s["oldest_unit_step"] for s in deviation["seeds"]] == [10, 20]
    assert deviation["eval"]["per_seed_pct"] == [0.0, 0.0]
    assert all(s["train_loss_deviation_pct"] == 0.0 for s in deviation["seeds"])
    assert all(abs(v) > 0 for v in deviation["noise_floor"]["per_seed_pct"])
    assert result["steps"] == 25 and result["strategies"]["layerwise"]["bytes_ratio_full_over_layerwise"] == pytest.approx(1.0, rel=0.01)
