"""``raycheck policy`` and the scale study."""

from __future__ import annotations

import csv
import json

import pytest
from typer.testing import CliRunner

from raycheck.orchestrator.console import format_duration
from raycheck.cli.policy import app, parse_duration
from raycheck.policies.costs import MeasuredCosts
from raycheck.policies.models import Strategy, optimal_interval_steps, waste_shadow

ARGS = ["--step-time", "5.6s", "--replay-time", "1s", "--snapshot-time", "930ms", "--stall-time", "60ms",
        "--restart-time", "1min", "--load-time", "1s", "--log-time", "76us"]


@pytest.mark.parametrize("text, seconds", [("1.2s", 1.2), ("250ms", 0.25), ("5min", 300.0), ("3h", 10800.0),
                                           ("2d", 172800.0), ("80us", 8e-5), ("1e3ms", 1.0), (" 2 H ", 7200.0),
                                           ("0", 0.0), ("0.0", 0.0)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1.2", "3 hours", "-1s", "", "h"])
def test_parse_duration_rejects_text_without_a_known_unit(text):
    with pytest.raises(ValueError, match="is not a duration: write a number and a unit"):
        parse_duration(text)


def test_format_duration():
    assert [format_duration(s) for s in (0.25, 42.0, 336.0, 10800.0, 1.5 * 86400)] == ["250 ms", "42 s", "5.6 min", "3 h", "1.5 d"]


def test_policy_table_recommends_the_shadow_at_its_optimum():
    result = CliRunner().invoke(app, [*ARGS, "--mtbf", "3h"])
    assert result.exit_code == 0, result.output
    costs = MeasuredCosts(step_s=5.6, replay_step_s=1.0, snapshot_s=0.93, stall_s=0.06, restart_s=60.0, load_s=1.0,
                          log_append_s=76e-6, mtbf_s=10800.0)
    k = optimal_interval_steps(Strategy.SHADOW, costs)
    shadow_row = next(line for line in result.output.splitlines() if "shadow" in line and "optimal" in line)
    assert f" {k} " in shadow_row and "recommended" in shadow_row
    assert f"recommended: shadow (optimal interval, every {k} steps" in result.output
    assert "full-sync at " in result.output and "daly" in result.output and "checkfreq" in result.output


def test_policy_json_for_scripts_with_accelerator_mtbf():
    result = CliRunner().invoke(app, [*ARGS, "--gpus", "16384", "--gpu-mtbf", "2048d", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["costs"]["mtbf_s"] == pytest.approx(3 * 3600) and out["costs"]["accelerators"] == 16384
    assert [(o["strategy"], o["rule"]) for o in out["options"]] == [
        ("full-sync", "young"), ("full-sync", "daly"), ("full-async", "checkfreq"), ("full-async", "optimal"),
        ("log-only", "none"), ("shadow", "young"), ("shadow", "optimal")]
    best = out["recommended"]
    assert (best["strategy"], best["rule"]) == ("shadow", "optimal")
    assert best["overhead_pct"] == min(o["overhead_pct"] for o in out["options"] if o["overhead_pct"] is not None)
    assert best["wasted_h_per_day"] == pytest.approx(24 * best["waste_ratio"] / (1 + best["waste_ratio"]))


def test_policy_with_failures_that_leave_the_shadow_alive_charges_them_its_lag_only():
    """``--shadow-loss 0.1 --live-replay-steps 2``: the shadow's waste is the closed form at those values, below
    the one where every failure loses the shadow, and its optimal interval is longer (k* ~ 1 / sqrt(p))."""
    every, some = (json.loads(CliRunner().invoke(app, [*ARGS, "--mtbf", "3h", "--json", *extra]).output)
                   for extra in ([], ["--shadow-loss", "0.1", "--live-replay-steps", "2"]))
    assert (some["costs"]["shadow_loss_fraction"], some["costs"]["live_replay_steps"]) == (0.1, 2.0)
    assert every["costs"]["shadow_loss_fraction"] == 1.0
    optimal = {name: next(o for o in out["options"] if (o["strategy"], o["rule"]) == ("shadow", "optimal"))
               for name, out in (("every", every), ("some", some))}
    costs = MeasuredCosts(**some["costs"])
    assert optimal["some"]["waste_ratio"] == pytest.approx(waste_shadow(costs, optimal["some"]["interval_steps"]))
    assert optimal["some"]["waste_ratio"] < optimal["every"]["waste_ratio"]
    assert optimal["some"]["interval_steps"] > 2 * optimal["every"]["interval_steps"]


def test_policy_reports_an_infeasible_shadow_and_recommends_something_else():
    args = [a if a != "1s" else "6s" for a in ARGS]  # replay slower than a step
    result = CliRunner().invoke(app, [*args, "--mtbf", "3h", "--json"])
    out = json.loads(result.output)
    shadow = [o for o in out["options"] if o["strategy"] == "shadow"]
    assert all(o["waste_ratio"] is None and "lag grows without bound" in o["error"] for o in shadow)
    assert out["recommended"]["strategy"] in ("full-sync", "full-async")


def test_policy_does_not_recommend_a_shadow_that_catches_up_for_hours_between_failures():
    """Replay 1.19 s against a 1.2 s step: a restarted shadow gains 1/120 step per replayed step; with an MTBF
    of 1 h it is still catching up when the next failure comes, at every interval a 30 s snapshot allows."""
    args = ["--step-time", "1.2s", "--replay-time", "1.19s", "--snapshot-time", "30s", "--restart-time", "5min",
            "--load-time", "30s", "--mtbf", "1h"]
    out = json.loads(CliRunner().invoke(app, [*args, "--json"]).output)
    shadow = [o for o in out["options"] if o["strategy"] == "shadow"]
    assert len(shadow) == 2 and all(o["waste_ratio"] is None and "outlasts the MTBF of 3600 s" in o["error"] for o in shadow)
    assert out["recommended"]["strategy"] == "full-async"
    table = " ".join(CliRunner().invoke(app, args).output.split())
    assert "shadow/optimal infeasible: a shadow restarted from its snapshot (every 25 steps) catches up at 0.00833 steps" in table


@pytest.mark.parametrize("extra, message", [
    (["--mtbf", "3"], "is not a duration"),
    (["--mtbf", "3h", "--gpu-mtbf", "100d"], "exclude each other: give one of them"),
    (["--mtbf", "0"], "the MTBF must be > 0, got '0'"),
    (["--mtbf", "0s"], "the MTBF must be > 0, got '0s'"),
    (["--gpus", "8", "--gpu-mtbf", "0d"], "--gpu-mtbf: the MTBF must be > 0, got '0d'"),
    (["--mtbf", "3h", "--shadow-loss", "1.5"], "Invalid value for '--shadow-loss'"),
    ([], "give the job's --mtbf, or --gpus"),
    (["--mtbf", "1e300d"], "(no run is that long)"),
])
def test_policy_rejects_bad_flags_with_a_clear_error(extra, message):
    result = CliRunner().invoke(app, [*ARGS, *extra])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_scale_study_writes_the_table_and_the_plot(tmp_path, capsys):
    from raycheck.experiments.scale_study import STUDIED, main

    rows = main(["--out", str(tmp_path), "--accelerators", "1024", "16384", "--models", "7", "--sim-mtbfs", "1500"])
    with (tmp_path / "scale_study.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == len(rows) == 2 * len(STUDIED)
    assert (tmp_path / "scale_study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    waste = {(int(r["accelerators"]), r["strategy"], r["rule"]): float(r["simulated_pct"]) for r in table}
    for n in (1024, 16384):
        assert waste[n, "shadow", "optimal"] < waste[n, "shadow", "young"] < waste[n, "full-sync", "daly"]
        assert waste[n, "log-only", "none"] > waste[n, "full-sync", "daly"]
    assert all(waste[16384, s, r] > 3 * waste[1024, s, r] for s, r in STUDIED)
    for r in table:
        assert float(r["simulated_pct"]) == pytest.approx(float(r["analytic_pct"]), rel=0.1)
    assert "shadow" in capsys.readouterr().out


@pytest.mark.parametrize("mtbf, daly_steps, young_steps, daly_min", [
    ("24h", 7001, 7200, 117), ("6h", 3403, 3600, 57), ("15min", 548, 735, 9.1)])
def test_the_daly_row_uses_dalys_formula(mtbf, daly_steps, young_steps, daly_min):
    """Daly 2006 (FGCS 22), C = 5 min: T = sqrt(2CM) [1 + sqrt(C/2M)/3 + C/(18M)] - C, his worked examples
    117, 57 and 9.1 min; Young's sqrt(2CM) is 120, 60 and 12.2 min. One-second steps give the seconds."""
    args = ["--step-time", "1s", "--replay-time", "100ms", "--snapshot-time", "5min", "--restart-time", "1min"]
    result = CliRunner().invoke(app, [*args, "--mtbf", mtbf, "--json"])
    assert result.exit_code == 0, result.output
    rows = {(o["strategy"], o["rule"]): o for o in json.loads(result.output)["options"]}
    assert rows["full-sync", "daly"]["interval_steps"] == daly_steps
    assert rows["full-sync", "young"]["interval_steps"] == young_steps
    assert rows["full-sync", "daly"]["interval_s"] / 60 == pytest.approx(daly_min, abs=0.35)


def test_policy_says_that_no_strategy_makes_progress_when_failures_outpace_recovery():
    args = ["--step-time", "1s", "--replay-time", "100ms", "--snapshot-time", "10s", "--restart-time", "5min", "--mtbf", "1s"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.output.splitlines()
    # (the shadow, 1.48e+131 before its catch-up was modelled, cannot catch up between failures 1 s apart: infeasible)
    assert lines[-1].startswith("error: no strategy makes progress with these costs: the least wasteful, full-sync/daly, "
                                "expects 1.16e+135 wasted seconds per productive second (at most 100 counts as progress)")
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 7 and all(row.rstrip(" │").endswith(("no progress", "infeasible (below)")) for row in rows)
    assert "recommended" not in result.output and max(len(line) for line in lines[:-1]) <= 120  # no 130-digit percentages
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 2
    out = json.loads(result.output[:result.output.rindex("}") + 1])
    assert out["recommended"] is None and out["explanation"].startswith("no strategy makes progress")


def test_policy_with_a_snapshot_too_slow_to_compute_still_answers():
    args = ["--step-time", "1s", "--replay-time", "100ms", "--snapshot-time", "1e300d", "--restart-time", "5min", "--mtbf", "3h"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output  # was an OverflowError
    out = json.loads(result.output)
    rows = {(o["strategy"], o["rule"]): o for o in out["options"]}
    assert "the interval overflows" in rows["full-sync", "young"]["error"]
    assert all(o["waste_ratio"] is None for key, o in rows.items() if key != ("log-only", "none"))  # infinite or infeasible
    assert (out["recommended"]["strategy"], out["recommended"]["rule"]) == ("log-only", "none")  # needs no snapshot


@pytest.mark.parametrize("mtbf, replay", [("1us", "300ms"), ("1e-9s", "300ms"), ("5s", "1h")])
def test_policy_whose_replay_dwarfs_the_mtbf_says_no_progress_instead_of_overflowing(mtbf, replay):
    result = CliRunner().invoke(app, ["--step-time", "1.2s", "--replay-time", replay, "--snapshot-time", "30s",
                                      "--restart-time", "5min", "--mtbf", mtbf])
    assert result.exit_code == 2, result.output  # was an OverflowError from math.expm1 (exit 1)
    assert result.output.splitlines()[-1].startswith("error: no strategy makes progress with these costs")
