"""Sizing the CPU shadow from the measured replay rate (issue 31, item 5): ``policies.shadow_sizing``
and ``raycheck policy --elements/--replay-rate``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from raycheck.cli.main import app
from raycheck.cli.policy import parse_count
from raycheck.policies.shadow_sizing import ReplayThroughput, cores_to_keep_up, lag_replay_s, shadow_replay_step_s

SMOLLM2 = ReplayThroughput(elements=134_515_008, elements_per_s_per_core=150e6)
ARGS = ["policy", "--step-time", "0.5s", "--snapshot-time", "2s", "--restart-time", "25s", "--mtbf", "1h"]


def test_the_replay_of_a_step_is_the_elements_over_the_cores_rate():
    assert shadow_replay_step_s(SMOLLM2, 1) == pytest.approx(134_515_008 / 150e6)
    assert shadow_replay_step_s(SMOLLM2, 4) == pytest.approx(134_515_008 / 600e6)
    with pytest.raises(ValueError, match="cores must be >= 1"):
        shadow_replay_step_s(SMOLLM2, 0)


def test_the_sized_shadow_is_the_fewest_cores_that_replay_within_the_share_of_a_step():
    # one core replays a step in 0.897 s: a 0.5 s step needs 2 cores to keep up, 4 to replay within half of it
    assert cores_to_keep_up(SMOLLM2, 0.5, utilization=1.0) == 2
    assert cores_to_keep_up(SMOLLM2, 0.5) == 4
    assert shadow_replay_step_s(SMOLLM2, 4) < 0.25 <= shadow_replay_step_s(SMOLLM2, 3)
    tie = ReplayThroughput(elements=100, elements_per_s_per_core=100.0)  # 1 s per step on one core
    assert cores_to_keep_up(tie, 1.0, utilization=1.0) == 2  # as fast as training is not keeping up
    assert cores_to_keep_up(SMOLLM2, 60.0) == 1
    with pytest.raises(ValueError, match=r"utilization must be in \(0, 1\]"):
        cores_to_keep_up(SMOLLM2, 1.0, utilization=1.5)


def test_a_lagging_shadow_costs_its_lag_replayed_on_the_workers_device():
    assert lag_replay_s(SMOLLM2, 3) == pytest.approx(3 * 134_515_008 / 150e6)  # default: one CPU core
    gpu = ReplayThroughput(elements=134_515_008, elements_per_s_per_core=150e6, device_elements_per_s=20e9)
    assert lag_replay_s(gpu, 3) == pytest.approx(3 * 134_515_008 / 20e9)
    with pytest.raises(ValueError, match="device_elements_per_s must be a finite number > 0"):
        ReplayThroughput(elements=10, elements_per_s_per_core=1.0, device_elements_per_s=0.0)


@pytest.mark.parametrize("text, value", [("134515008", 134515008), ("135M", 135e6), ("1.5G", 1.5e9), ("8B", 8e9),
                                         ("150M/s", 150e6), ("20k", 2e4)])
def test_counts_and_rates_take_si_suffixes(text, value):
    assert parse_count(text) == value


def test_policy_sizes_the_shadow_and_derives_its_replay_time():
    result = CliRunner().invoke(app, [*ARGS, "--elements", "134515008", "--replay-rate", "150M", "--device-replay-rate",
                                      "20G", "--live-replay-steps", "3", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    sizing = out["shadow_sizing"]
    assert (sizing["cores_sized"], sizing["cores_at_least"], sizing["shadow_cores"]) == (4, 2, 4)
    assert out["costs"]["replay_step_s"] == pytest.approx(134_515_008 / 600e6)  # the sized shadow's replay
    assert sizing["live_replay_s"] == pytest.approx(3 * 134_515_008 / 20e9)
    text = CliRunner().invoke(app, [*ARGS, "--elements", "135M", "--replay-rate", "150M", "--shadow-cores", "2"]).output
    text = " ".join(text.split())
    assert "within 50% of a 500 ms step on 4 cores, within the step on 2 cores; this shadow (2 cores)" in text


@pytest.mark.parametrize("extra, message", [
    ([], "give --replay-time, or --elements and --replay-rate to size the shadow"),
    (["--elements", "135M"], "--elements and --replay-rate size the shadow together"),
    (["--elements", "lots", "--replay-rate", "1M"], "'lots' is not a count"),
    (["--replay-time", "1s", "--device-replay-rate", "1G"], "--device-replay-rate needs --elements and --replay-rate"),
    (["--replay-time", "200ms", "--elements", "135M", "--replay-rate", "175M"], "give --replay-time or --elements with --replay-rate, not both"),
])
def test_policy_refuses_incomplete_sizing_options_in_one_line(extra, message):
    result = CliRunner().invoke(app, [*ARGS, *extra])
    assert result.exit_code == 2 and result.output.startswith("error: ") and message in result.output, result.output
