"""The experiment report: tables, ratios, explanations and files from synthetic raw results (pure logic, no Ray)."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raycheck.experiments import report as rp
from raycheck.experiments import report_tables as rt
from raycheck.policies.models import Strategy

NAN = math.nan
STEP_S, APPEND_S, STALL_S, SYNC_S, PERSIST_S, REPLAY_S = 5.6, 80e-6, 0.06, 0.93, 2.0, 1.0
GRID = [60.0, 600.0, 6000.0]


def run(strategy: str, **changes) -> dict:
    """One row of runs.parquet, SmolLM2-135M-like costs (seconds, bytes): 100 steps, a checkpoint every 20."""
    base = {
        "strategy": strategy, "model": "smollm2-135m", "steps": 100, "interval_steps": 20, "failures": 3,
        "bitwise_equal": True, "wall_s": 640.0, "mean_step_s": STEP_S, "block_s_total": 0.0, "block_s_per_step": 0.0,
        "checkpoints": 5, "snapshots": 0, "block_s_per_checkpoint": 0.0, "bytes_written": 5 * 538_000_000,
        "snapshot_s": PERSIST_S, "stall_s": 0.0, "replay_step_s": NAN, "log_append_s": 0.0,
    }
    per_strategy = {
        "shadow": {"checkpoints": 100, "snapshots": 5, "block_s_per_checkpoint": APPEND_S, "block_s_per_step": APPEND_S,
                   "block_s_total": 100 * APPEND_S, "replay_step_s": REPLAY_S, "log_append_s": APPEND_S},
        "full-sync": {"block_s_per_checkpoint": SYNC_S, "block_s_per_step": SYNC_S / 20, "block_s_total": 5 * SYNC_S,
                      "snapshot_s": SYNC_S},
        "full-async": {"block_s_per_checkpoint": STALL_S, "block_s_per_step": STALL_S / 20, "block_s_total": 5 * STALL_S,
                       "stall_s": STALL_S},
        "log-only": {"interval_steps": 0, "checkpoints": 100, "block_s_per_checkpoint": APPEND_S, "block_s_per_step": APPEND_S,
                     "block_s_total": 100 * APPEND_S, "snapshot_s": NAN, "replay_step_s": REPLAY_S, "log_append_s": APPEND_S,
                     "bytes_written": 7600},
    }
    return {**base, **per_strategy[strategy], **changes}


def recoveries(strategy: str, latencies, restart, load, replay=(0, 0, 0), recompute=(0, 0, 0)) -> list[dict]:
    """Rows of recoveries.parquet, one per latency."""
    return [{"strategy": strategy, "at_step": 30 * (i + 1), "restored_step": 20 * (i + 1), "source": "storage",
             "latency_s": lat, "restart_s": rs, "load_s": ld, "replay_s": rp_, "replayed_steps": round(rp_ / REPLAY_S),
             "recompute_s": rc, "recompute_steps": round(rc / STEP_S)}
            for i, (lat, rs, ld, rp_, rc) in enumerate(zip(latencies, restart, load, replay, recompute))]


def standard_recoveries(shadow_latency=(12.0, 13.0, 14.0), shadow_restart=(9.0, 9.5, 10.0)) -> list[dict]:
    return (recoveries("shadow", shadow_latency, shadow_restart, (1, 1, 1), replay=(1.5, 2.0, 2.5))
            + recoveries("full-sync", (25.0, 27.0, 29.0), (9.5,) * 3, (1.5,) * 3, recompute=(12, 14, 16))
            + recoveries("full-async", (20.0, 22.0, 24.0), (9.5,) * 3, (1.5,) * 3, recompute=(8, 10, 12))
            + recoveries("log-only", (70.0, 80.0, 90.0), (9.5,) * 3, (1.0,) * 3, replay=(59.5, 69.5, 79.5)))


def write(tmp_path, runs: list[dict], recs: list[dict]):
    pq.write_table(pa.Table.from_pylist(runs), tmp_path / "runs.parquet")
    columns = dict.fromkeys(k for r in recs for k in r)  # as the harness writes them: rows on different paths differ
    pq.write_table(pa.table({c: [r.get(c) for r in recs] for c in columns}), tmp_path / "recoveries.parquet")
    return tmp_path


def all_runs(**shadow_changes) -> list[dict]:
    return [run("shadow", **shadow_changes), run("full-sync"), run("full-async"), run("log-only")]


def test_overhead_ratios_at_equal_durability_and_as_run():
    rows = {r["strategy"]: r for r in rt.overhead_table(all_runs())}
    # Equal durability: the baseline's blocked seconds per checkpoint x one checkpoint per step, over ours per step.
    # By hand: full-async blocks 0.06 s per checkpoint, 6 s over 100 steps; 0.06 s / 80 us = 750x;
    # full-sync 0.93 s / 80 us = 11625x; as run, full-async blocks 0.06 s / 20 steps = 3 ms per step = 37.5x.
    assert rows["full-async"]["eq_block_s_per_step"] == 0.06
    assert rows["full-async"]["eq_block_s_total"] == pytest.approx(6.0)
    assert rows["full-async"]["ratio_equal_durability"] == pytest.approx(750.0)
    assert rows["full-sync"]["ratio_equal_durability"] == pytest.approx(11625.0)
    assert rows["full-async"]["ratio_as_run"] == pytest.approx(37.5)
    assert rows["log-only"]["ratio_equal_durability"] == pytest.approx(1.0)
    assert rows["shadow"]["ratio_equal_durability"] == 1.0
    assert rows["full-async"]["bytes_per_point"] == 538_000_000
    # One async checkpoint per step would also wait for the previous write when it outlasts a step.
    assert rows["full-async"]["eq_write_wait_s_per_step"] == 0.0  # 2.0 s persist < 5.6 s step
    slow = {r["strategy"]: r for r in rt.overhead_table([run("shadow"), run("full-async", snapshot_s=8.0)])}
    assert slow["full-async"]["eq_write_wait_s_per_step"] == pytest.approx(2.4)  # an 8 s write over a 5.6 s step


def test_overhead_means_over_several_runs_and_missed_target_sentence():
    rows = {r["strategy"]: r for r in rt.overhead_table(
        [run("shadow"), run("shadow", block_s_per_checkpoint=3 * APPEND_S, block_s_per_step=3 * APPEND_S),
         run("full-async", block_s_per_checkpoint=0.012, bytes_written=5 * 12_000_000)])}
    assert rows["shadow"]["runs"] == 2 and rows["shadow"]["block_s_per_point"] == pytest.approx(160e-6)  # (80 + 240) / 2 us
    assert rows["full-async"]["ratio_equal_durability"] == pytest.approx(75.0)  # 12 ms / 160 us < 100x
    why = rt.why_overhead(rows["shadow"], rows["full-async"], 100.0)
    assert "75x < 100x" in why and "12 MB per checkpoint" in why and "1.33x larger" in why
    assert rt.why_overhead(rows["shadow"], {**rows["full-async"], "ratio_equal_durability": 150.0}, 100.0) is None


def test_recovery_means_breakdown_interval_and_ratio():
    rows = {r["strategy"]: r for r in rt.recovery_table(standard_recoveries())}
    ours = rows["shadow"]
    assert ours["n"] == 3 and ours["latency_s"] == pytest.approx(13.0)
    assert (ours["restart_s"], ours["load_s"], ours["replay_s"], ours["recompute_s"]) == pytest.approx((9.5, 1.0, 2.0, 0.0))
    assert ours["other_s"] == pytest.approx(0.5) and ours["fixed_s"] == pytest.approx(10.0)
    # Sample std of 12, 13, 14 is 1; t(0.975, 2 dof) = 4.303; half-width 4.303 / sqrt(3) = 2.4843 s.
    assert (ours["latency_lo_s"], ours["latency_hi_s"]) == pytest.approx((10.5157, 15.4843), abs=1e-4)
    assert ours["latency_lo_s"] < ours["latency_s"] < ours["latency_hi_s"]
    assert rows["full-async"]["ratio"] == pytest.approx(1.6923, abs=1e-4)  # 22 s / 13 s
    assert rows["full-async"]["recompute_s"] == pytest.approx(10.0) and rows["full-async"]["replay_s"] == 0
    assert rows["log-only"]["ratio"] == pytest.approx(6.1538, abs=1e-4)  # 80 s / 13 s
    assert ours["sources"] == "storage: 3"
    single = rt.recovery_table(recoveries("shadow", (5.0,), (4.0,), (1.0,)))[0]
    assert single["n"] == 1 and single["latency_lo_s"] is None


def test_missed_recovery_target_says_restart_bounds_the_ratio():
    recs = (recoveries("shadow", (11.0, 12.0, 13.0), (9.0, 9.3, 9.6), (1, 1, 1), replay=(1.0, 1.5, 2.0))
            + recoveries("full-async", (12.0, 13.0, 14.0), (9.3,) * 3, (1.5,) * 3, recompute=(1.0, 2.0, 3.0)))
    rows = {r["strategy"]: r for r in rt.recovery_table(recs)}
    why = rt.why_recovery(rows["shadow"], rows["full-async"], 1.5)
    assert why.startswith("restart is 9.3 s of our 12 s latency (77%)")
    assert "bounds the ratio at 13 / 9.3 = 1.4x" in why and "< 1.5x" in why
    assert rt.why_recovery(rows["shadow"], {**rows["full-async"], "ratio": 1.6}, 1.5) is None


def test_the_interval_of_a_non_negative_quantity_is_clamped_at_0_and_only_there():
    """A mean of 0, 0, 3 has the 95% t interval 1 -/+ 4.303: a signed quantity keeps -3.303, a non-negative one
    (a |deviation|, a latency, a waste ratio) prints 0; the upper bound and the mean are the same."""
    assert rt.mean_ci([0.0, 0.0, 3.0]) == pytest.approx((1.0, 1.0 - 4.303, 1.0 + 4.303))
    assert rt.mean_ci([0.0, 0.0, 3.0], nonnegative=True) == pytest.approx((1.0, 0.0, 1.0 + 4.303))
    assert rt.mean_ci([12.0, 13.0, 14.0], nonnegative=True) == pytest.approx(rt.mean_ci([12.0, 13.0, 14.0]))  # above 0: as is
    spread = rt.recovery_table(recoveries("shadow", (0.5, 0.5, 9.0), (0.25,) * 3, (0.1,) * 3))[0]
    assert spread["latency_lo_s"] == 0.0 and spread["latency_hi_s"] > spread["latency_s"]


def test_t_quantiles():
    assert rt.t975(1) == 12.706 and rt.t975(30) == 2.042
    assert rt.t975(31) == pytest.approx(2.0395, abs=2e-4) and rt.t975(120) == pytest.approx(1.9799, abs=2e-4)
    with pytest.raises(ValueError):
        rt.t975(0)


def test_measured_costs_from_a_run_and_its_recoveries():
    summary = {r["strategy"]: r for r in rt.recovery_table(standard_recoveries())}
    c = rt.measured_costs(run("shadow"), summary["shadow"], mtbf_s=600.0)
    assert (c.step_s, c.replay_step_s, c.snapshot_s, c.log_append_s, c.stall_s) == (STEP_S, REPLAY_S, PERSIST_S, APPEND_S, 0.0)
    assert (c.restart_s, c.load_s, c.mtbf_s, c.background_weight) == pytest.approx((10.0, 1.0, 600.0, 0.0))
    a = rt.measured_costs(run("full-async"), summary["full-async"], mtbf_s=600.0)
    # full-async recomputes instead of replaying (one step costs a step); fixed restart 22 - 1.5 load - 10 recompute.
    assert a.stall_s == STALL_S and a.replay_step_s == STEP_S and a.restart_s == pytest.approx(10.5)
    assert rt.measured_costs(run("log-only"), summary["log-only"], mtbf_s=60.0).snapshot_s == 0.0
    with pytest.raises(ValueError, match="no recoveries of full-sync"):
        rt.measured_costs(run("full-sync"), None, mtbf_s=60.0)


def test_recoveries_from_the_live_shadow_set_the_share_of_failures_that_lose_it():
    """Two of three recoveries took the live shadow's image (object_store, 1 and 3 steps replayed), one a
    snapshot: the model's shadow-loss share is 1/3 and its live replay 2 steps, and the replay term says so."""
    recs = recoveries("shadow", (12.0, 13.0, 14.0), (9.0, 9.5, 10.0), (1, 1, 1), replay=(1.0, 4.0, 3.0))
    for r, source in zip(recs, ("object_store", "storage", "object_store")):
        r["source"] = source
    row = rt.recovery_table(recs)[0]
    assert row["shadow_loss_share"] == pytest.approx(1 / 3) and row["live_replayed_steps"] == pytest.approx(2.0)
    c = rt.measured_costs(run("shadow"), row, mtbf_s=600.0)
    assert (c.shadow_loss_fraction, c.live_replay_steps) == pytest.approx((1 / 3, 2.0))
    value, how = rt.waste_terms(Strategy.SHADOW, c, 20, 100)["replay"]
    assert value == pytest.approx((20 / 2 / 3 + 2 * 2 / 3) * REPLAY_S / 600.0)
    assert how == "0.333 x 20/2 + 0.667 x 2 steps (a share 0.333 of the failures loses the shadow; the others replay its lag) x 1 s per failure"
    full = rt.measured_costs(run("full-async"), rt.recovery_table(recoveries("full-async", (20.0,), (9.5,), (1.5,)))[0], mtbf_s=600.0)
    assert (full.shadow_loss_fraction, full.live_replay_steps) == (1.0, 0.0)  # the field is the shadow's alone
    nothing_live = rt.recovery_table(recoveries("shadow", (12.0,), (9.0,), (1,)))[0]
    assert nothing_live["shadow_loss_share"] == 1 and math.isnan(nothing_live["live_replayed_steps"])
    assert rt.measured_costs(run("shadow"), nothing_live, mtbf_s=600.0).live_replay_steps == 0.0


def test_wasted_grid_has_enough_failures_per_seed_and_intervals_contain_the_mean():
    rows = rt.wasted_table(all_runs(), standard_recoveries(), GRID, seeds=3, min_failures=10)
    assert len(rows) == len(GRID) * 4
    for r in rows:
        assert r["status"] == "ok", r
        assert r["samples"] == 3 and r["min_failures_per_seed"] >= 10
        assert r["waste_lo"] <= r["waste_ratio"] <= r["waste_hi"]
        assert 0 < r["effective_ratio"] < 1
        assert r["highest_rate"] == (r["mtbf_s"] == 60.0)
    # MTBF in steps of 5.6 s: 60 / 5.6, 600 / 5.6, 6000 / 5.6.
    assert [r["mtbf_steps"] for r in rows if r["strategy"] == "shadow"] == pytest.approx([10.7143, 107.143, 1071.43], rel=1e-5)
    for mtbf_s in GRID:  # ours wastes least in every cell, so its share of productive time is the largest
        cell = {r["strategy"]: r for r in rows if r["mtbf_s"] == mtbf_s}
        assert cell["shadow"]["ratio"] == 1.0 and max(cell.values(), key=lambda r: r["effective_ratio"]) is cell["shadow"]
        assert all(r["ratio"] > 1 for s, r in cell.items() if s != "shadow")
    # Ours at MTBF 6000 s, to first order by hand: a failure costs half a 5.6 s step, restart + load 11 s,
    # the replay of (20 - 1) / 2 steps x 1 s, and 20 steps more in the 3 s (replay + write) before a snapshot
    # is durable, i.e. 20 x 3 / 112 s: (2.8 + 11 + 9.5 + 0.5357) / 6000.
    slowest = next(r for r in rows if r["strategy"] == "shadow" and r["mtbf_s"] == 6000.0)
    assert slowest["analytic_waste_ratio"] == pytest.approx(23.8357 / 6000, rel=0.01)
    # More failures, more waste; the simulation agrees with the closed form (policies.models) within a loose margin.
    ours = [r for r in rows if r["strategy"] == "shadow"]
    assert ours[0]["waste_ratio"] > ours[1]["waste_ratio"] > ours[2]["waste_ratio"]
    for r in rows:
        assert r["waste_ratio"] == pytest.approx(r["analytic_waste_ratio"], rel=0.5, abs=2e-3)


def test_measured_waste_of_the_real_runs_beside_the_monte_carlo():
    rows = {r["strategy"]: r for r in rt.measured_waste_table(all_runs(), standard_recoveries())}
    ours = rows["shadow"]
    assert (ours["productive_s"], ours["wasted_s"]) == pytest.approx((560.0, 80.0))
    assert ours["waste_ratio"] == pytest.approx(0.142857, rel=1e-5)  # 80 s wasted / 560 s productive
    assert ours["observed_mtbf_s"] == pytest.approx(213.333, rel=1e-5)  # 640 s wall / 3 failures
    assert 0 < ours["simulated_waste_ratio"] < rows["full-async"]["simulated_waste_ratio"]
    assert math.isnan(rt.measured_waste_table([run("shadow", failures=0)], standard_recoveries())[0]["simulated_waste_ratio"])


def test_infeasible_and_unmeasured_cells_are_reported_not_raised():
    runs = [run("shadow", replay_step_s=2 * STEP_S), run("full-async", snapshot_s=200.0), run("full-sync")]
    recs = [r for r in standard_recoveries() if r["strategy"] != "full-sync"]
    rows = {r["strategy"]: r for r in rt.wasted_table(runs, recs, [600.0], seeds=3, min_failures=10)}
    assert rows["shadow"]["status"] == "infeasible" and "lag grows without bound" in rows["shadow"]["reason"]
    assert rows["full-async"]["status"] == "infeasible" and "would not finish before the next" in rows["full-async"]["reason"]
    assert rows["full-sync"]["status"] == "unmeasured" and "no recoveries of full-sync" in rows["full-sync"]["reason"]
    assert all(math.isnan(r["waste_ratio"]) and math.isnan(r["ratio"]) for r in rows.values())


def test_a_job_that_cannot_progress_is_reported_as_such():
    row = rt.simulate_cell(Strategy.LOG_ONLY, [run("log-only", steps=5000)],
                           rt.recovery_table(standard_recoveries())[-1], 60.0, seeds=3, min_failures=10)
    assert row["status"] == "no-progress" and row["analytic_waste_ratio"] > rt.MAX_WASTE_RATIO


def test_missed_wasted_target_names_our_largest_term():
    rows = rt.wasted_table(all_runs(), standard_recoveries(), GRID, seeds=3, min_failures=10)
    cell = {r["strategy"]: r for r in rows if r["highest_rate"]}
    summary = {r["strategy"]: r for r in rt.recovery_table(standard_recoveries())}
    costs = rt.measured_costs(run("shadow"), summary["shadow"], mtbf_s=60.0)
    why = rt.why_wasted(cell["shadow"], cell["full-async"], costs, run("shadow"), 1e6)
    terms = rt.waste_terms(Strategy.SHADOW, costs, 20, 100)
    assert terms["restart + load"][0] == pytest.approx(11.0 / 60.0)  # fixed 10 s + load 1 s per failure, every 60 s
    assert terms["replay"][0] == pytest.approx(10 * REPLAY_S / 60.0)
    assert ("Our terms, to first order: restart + load ~0.183 (11 s per failure), "
            "replay ~0.167 (20/2 steps x 1 s per failure)") in why
    assert f"restart + load alone bounds the ratio at {cell['full-async']['waste_ratio']:.3g} / 0.183" in why
    assert rt.why_wasted(cell["shadow"], {**cell["full-async"], "ratio": 2e6}, costs, run("shadow"), 1e6) is None
    assert rt.why_wasted(cell["shadow"], cell["full-async"], None, run("shadow"), 1e6) == (  # used to raise AttributeError
        f"shadow at MTBF {cell['full-async']['mtbf_s']:.3g} s: its costs were not measured (a run and a recovery of it are needed)")


def test_write_report_files_parse_and_headlines(tmp_path):
    write(tmp_path, all_runs(), standard_recoveries())
    report = rp.write_report(tmp_path, grid_mtbf_s=GRID, seeds=3, min_failures=10)
    for name in ("overhead", "recovery", "wasted", "measured_waste", "exactness"):
        table = pq.read_table(report.files[name])
        assert table.num_rows > 0 and "strategy" in table.column_names
    assert pq.read_table(report.files["wasted"]).num_rows == 12
    for name in ("overhead_png", "recovery_png", "wasted_png"):
        assert report.files[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = report.files["report"].read_text()
    for heading in ("## (a) Checkpoint overhead", "## (b) Recovery latency", "## (c) End-to-end wasted time", "## (d) Exactness"):
        assert heading in md
    assert "Monte Carlo over the costs measured in the real runs" in md and "219.7x" in md and "1.55x" in md and "21.3x" in md
    overhead = report.headline("overhead")
    assert overhead.ratio == pytest.approx(750.0) and overhead.met and overhead.paper == 219.7 and overhead.why is None
    recovery = report.headline("recovery")
    assert recovery.ratio == pytest.approx(1.6923, abs=1e-4) and recovery.target == 5.0 and not recovery.met
    assert recovery.paths == "shadow new_process: 3; full-async new_process: 3"  # results without a path column
    assert report.headline("recovery", "log-only").target is None
    wasted = report.headline("wasted")
    assert report.highest_rate_mtbf_s == 60.0 and wasted.target == 10.0
    assert (wasted.why is None) == wasted.met
    assert "overhead vs full-async" in report.summary()
    exact = pq.read_table(report.files["exactness"]).to_pylist()
    assert all(r["bitwise_equal"] for r in exact)


def test_report_explains_missed_targets_and_infeasible_shadow(tmp_path):
    runs = all_runs(replay_step_s=2 * STEP_S, block_s_per_checkpoint=0.001, block_s_per_step=0.001, bitwise_equal=False)
    recs = standard_recoveries(shadow_latency=(14.0, 15.0, 16.0), shadow_restart=(11.0, 11.5, 12.0))
    report = rp.write_report(write(tmp_path, runs, recs), grid_mtbf_s=[600.0, 6000.0], seeds=3, min_failures=10)
    md = report.files["report"].read_text()
    assert report.headline("overhead").ratio == pytest.approx(60.0) and "60x < 100x" in report.headline("overhead").why
    assert not report.headline("recovery").met and "restart is 11.5 s of our 15 s latency" in report.headline("recovery").why
    wasted = report.headline("wasted")
    assert wasted.ratio is None and not wasted.met and "infeasible" in wasted.why
    assert "**infeasible**" in md and "**no**" in md and "60x < 100x" in md


def test_the_step_log_under_snapshot_load_is_our_mean_append_over_the_log_only_median(tmp_path, capsys):
    runs = [run("shadow", log_append_s=3 * APPEND_S, log_append_median_s=APPEND_S, durability="process"), run("full-sync"),
            run("full-async"),
            run("log-only", log_append_median_s=APPEND_S, log_append_s=1.5 * APPEND_S)]
    inflation = rt.append_inflation(runs)
    assert inflation["ratio"] == pytest.approx(3.0) and inflation["target"] == 2.0 and not inflation["met"]
    assert rt.append_inflation([runs[0], {**runs[3], "log_append_median_s": 2 * APPEND_S}])["met"]
    assert rt.append_inflation(all_runs()) is None  # results from before the median column
    assert rt.append_inflation(runs[:3]) is None  # no quiet (log-only) run
    assert rt.append_inflation([runs[0], {**runs[3], "durability": "node"}]) is None  # levels differ: not comparable
    assert rt.append_inflation([runs[0], {**runs[3], "durability": "process"}])["ratio"] == pytest.approx(3.0)
    report = rp.main([str(write(tmp_path, runs, standard_recoveries())), "--mtbf-s", "600", "--seeds", "3"])
    line = ("The step log under snapshot load: our mean append at durability process, while the shadow's snapshots were written to "
            "the same disk, 0.24 ms; the log-only run's median (no snapshots, the same durability) 0.08 ms: 3x the "
            "quiet (log-only) median (target <= 2x: missed).")
    assert line in capsys.readouterr().out and line in report.files["report"].read_text()


def test_command_line_prints_the_summary(tmp_path, capsys):
    write(tmp_path, all_runs(), standard_recoveries())
    report = rp.main([str(tmp_path), "--mtbf-s", "600", "--seeds", "3", "--intervals", "optimal"])
    out = capsys.readouterr().out
    assert "overhead vs full-async 750x  (paper 219.7x, target >= 100x: met)" in out
    assert report.highest_rate_mtbf_s == 600.0 and "that minimises the closed-form waste" in report.files["report"].read_text()


def test_default_grid_spans_two_decades_from_the_highest_rate():
    grid = rt.default_grid_mtbf_s(all_runs(), standard_recoveries())
    # Slowest restart + load: full-sync, fixed 27 - 1.5 - 14 = 11.5 s + 1.5 s load = 13 s; 5 x 13 s > 10 steps of 5.6 s.
    assert grid[0] == pytest.approx(5 * 13.0) and 5 * 13.0 > 10 * STEP_S
    assert len(grid) == 5 and grid[-1] == pytest.approx(100 * grid[0])


def test_missing_and_empty_inputs_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="runs.parquet not found"):
        rp.write_report(tmp_path)
    write(tmp_path, all_runs(), [])
    pq.write_table(pa.table({c: pa.array([], pa.float64()) for c in rt.RECOVERY_COLUMNS}), tmp_path / "recoveries.parquet")
    with pytest.raises(ValueError, match="recoveries.parquet has no rows"):
        rt.load_results(tmp_path)
    pq.write_table(pa.Table.from_pylist([{"strategy": "shadow"}]), tmp_path / "runs.parquet")
    with pytest.raises(ValueError, match="lacks columns"):
        rt.load_results(tmp_path)
    write(tmp_path, [run("full-async")], standard_recoveries())
    with pytest.raises(ValueError, match="no shadow run"):
        rt.load_results(tmp_path)
    write(tmp_path, [{**run("shadow"), "strategy": "bogus"}], standard_recoveries())
    with pytest.raises(ValueError, match="unknown strategy 'bogus'"):
        rt.load_results(tmp_path)


def test_experiment_report_only_rebuilds_the_report_from_existing_results(tmp_path):
    """``raycheck experiment --report-only``: no run, no Ray; the report comes from the Parquet files in --out."""
    from typer.testing import CliRunner

    from raycheck.cli.main import app

    runner = CliRunner()
    result = runner.invoke(app, ["experiment", "--report-only", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "holds no results (runs.parquet); run without --report-only first" in result.output
    assert list(tmp_path.iterdir()) == []

    write(tmp_path, all_runs(), standard_recoveries())
    inputs = {name: (tmp_path / name).read_bytes() for name in ("runs.parquet", "recoveries.parquet")}
    result = runner.invoke(app, ["experiment", "--report-only", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert f"report: {tmp_path / 'report.md'}" in result.output
    assert "overhead vs full-async 750x  (paper 219.7x, target >= 100x: met)" in result.output  # 60 ms / 80 us
    assert ("recovery vs full-async 1.69x  (paper 1.55x, target >= 5x: MISSED)  [shadow new_process: 3; full-async "
            "new_process: 3]") in result.output  # 22 s / 13 s
    md = (tmp_path / "report.md").read_text()
    for heading in ("## (a) Checkpoint overhead", "## (b) Recovery latency", "## (c) End-to-end wasted time", "## (d) Exactness"):
        assert heading in md
    assert {p.name for p in tmp_path.glob("*.png")} == {"overhead.png", "recovery.png", "wasted.png"}
    assert {name: (tmp_path / name).read_bytes() for name in inputs} == inputs  # the results are only read


def with_breakdown(rows: list[dict], detection: float, group_setup: float, state: float) -> list[dict]:
    """``rows`` with breakdown columns (seconds): first step = their sum."""
    return [{**r, "bd_detection_s": detection, "bd_group_setup_s": group_setup, "bd_log_setup+state_transfer_s": state,
             "first_step_s": detection + group_setup + state} for r in rows]


def test_breakdown_table_means_each_component_per_strategy_and_marks_ray_trains(tmp_path):
    recs = (with_breakdown(recoveries("shadow", (12.0, 13.0), (9.0, 9.5), (1, 1)), 0.5, 5.0, 0.25)
            + with_breakdown(recoveries("full-async", (20.0,), (9.5,), (1.5,)), 1.0, 6.0, 1.5)
            + recoveries("full-sync", (25.0,), (9.5,), (1.5,)))  # an older run: no breakdown
    rows = {r["component"]: r for r in rt.breakdown_table(rt.read_rows(write(tmp_path, all_runs(), recs) / "recoveries.parquet",
                                                                          rt.RECOVERY_COLUMNS))}
    assert list(rows) == ["detection", "group_setup", "log_setup+state_transfer", "failure -> first step done"]
    assert [rows[c]["owner"] for c in rows] == ["Ray Train", "Ray Train", "raycheck", ""]
    assert (rows["detection"]["shadow"], rows["detection"]["full-async"]) == (0.5, 1.0)
    assert rows["failure -> first step done"]["shadow"] == 5.75 and rows["failure -> first step done"]["full-async"] == 8.5
    assert math.isnan(rows["detection"]["full-sync"])
    report = rp.write_report(tmp_path, grid_mtbf_s=GRID, seeds=1, min_failures=2)
    assert pq.read_table(report.files["breakdown"]).num_rows == 4
    md = report.files["report"].read_text()
    assert "| component | whose | shadow (s) | full-sync (s) | full-async (s) |" in md
    assert "| log_setup+state_transfer | raycheck | 0.25 | n/a | 1.5 |" in md


def test_a_report_without_breakdowns_says_so(tmp_path):
    report = rp.write_report(write(tmp_path, all_runs(), standard_recoveries()), grid_mtbf_s=GRID, seeds=1, min_failures=2)
    assert "breakdown" not in report.files
    assert "No recovery recorded a breakdown" in report.files["report"].read_text()


IN_PROCESS = {"detection": 0.0, "log_setup": 0.0625, "state_transfer": 0.75, "replay": 0.125, "first_step": 5.0}
"""The first step after the restore is the largest component but not in the recovery latency: never the floor."""
NEW_PROCESS = {"detection": 0.5, "teardown": 0.0, "process_start": 4.0, "group_setup": 6.0, "launch": 0.5, "imports": 3.0,
               "model_load": 2.0, "data_load": 1.0, "log_setup": 0.0625, "state_transfer": 0.25, "replay": 0.0}


def on_path(rows: list[dict], path: str, components: dict) -> list[dict]:
    """``rows`` as recoveries on ``path`` with these breakdown ``components`` (seconds), which add up to the total."""
    return [{**r, "path": path, **{f"bd_{c}_s": v for c, v in components.items()},
             "first_step_s": sum(components.values())} for r in rows]


def test_breakdown_is_one_table_per_path_and_an_in_process_detection_is_not_ray_trains(tmp_path):
    recs = (on_path(recoveries("shadow", (1.0, 1.0), (0.1, 0.1), (0.75, 0.75)), "in_process", IN_PROCESS)
            + on_path(recoveries("full-async", (3.0,), (0.1,), (1.5,), recompute=(1.4,)), "in_process", {**IN_PROCESS, "state_transfer": 1.5})
            + on_path(recoveries("full-async", (20.0,), (16.5,), (1.5,), recompute=(2.0,)), "new_process", NEW_PROCESS))
    rows = rt.breakdown_table(recs)
    inproc = {r["component"]: r for r in rows if r["path"] == "in_process"}
    newproc = {r["component"]: r for r in rows if r["path"] == "new_process"}
    assert list(inproc) == ["detection", "log_setup", "state_transfer", "replay", "first_step",
                            "failure -> first step done"]  # no process start
    assert {r["owner"] for c, r in inproc.items() if c != rt.TOTAL} == {"raycheck"}
    assert (inproc["state_transfer"]["shadow"], inproc["state_transfer"]["full-async"]) == (0.75, 1.5)
    assert newproc["detection"]["owner"] == newproc["process_start"]["owner"] == "Ray Train"
    assert newproc["process_start"]["full-async"] == 4.0 and "shadow" not in newproc["process_start"]  # no shadow recovery there
    table = {r["strategy"]: r for r in rt.recovery_table(recs)}
    assert table["shadow"]["paths"] == "in_process: 2" and table["full-async"]["paths"] == "new_process: 1, in_process: 1"
    report = rp.write_report(write(tmp_path, [run("shadow"), run("full-async")], recs), grid_mtbf_s=GRID, seeds=1, min_failures=2)
    md = report.files["report"].read_text()
    assert "Path `in_process`" in md and "Path `new_process`" in md
    assert "| detection | raycheck | 0 | 0 |" in md and "| detection | Ray Train | 0.5 |" in md
    assert "| process_start | Ray Train | 4 |" in md and "| imports | raycheck | 3 |" in md
    assert report.headline("recovery").paths == "shadow in_process: 2; full-async new_process: 1, in_process: 1"
    assert "shadow in_process: 2; full-async new_process: 1, in_process: 1 |" in md


def test_a_missed_target_names_the_floor_of_the_breakdown_with_its_seconds(tmp_path):
    """In process, the state transfer (0.75 s of a 1 s recovery) is the floor: 3 s / 0.75 s = 4x at best."""
    recs = (on_path(recoveries("shadow", (1.0, 1.0), (0.1, 0.1), (0.75, 0.75)), "in_process", IN_PROCESS)
            + on_path(recoveries("full-async", (3.0, 3.0), (0.1, 0.1), (1.5, 1.5), recompute=(1.4, 1.4)), "in_process",
                      {**IN_PROCESS, "state_transfer": 1.5}))
    floor = rt.recovery_floor(recs)
    assert (floor["component"], floor["seconds"], floor["paths"], floor["parts"]) == ("state_transfer", 0.75, "in_process: 2", {})
    rows = {r["strategy"]: r for r in rt.recovery_table(recs)}
    why = rt.why_recovery(rows["shadow"], rows["full-async"], 5.0, floor)
    assert why.startswith("the floor of our recovery (in_process: 2) is **state_transfer**, 0.75 s of our 1 s latency (75%")
    assert "full-async (in_process: 2) takes 3 s" in why and "bounds the ratio at 3 / 0.75 = 4x" in why
    assert why.endswith("measured ratio 3x < 5x.")
    report = rp.write_report(write(tmp_path, [run("shadow"), run("full-async")], recs), grid_mtbf_s=[60.0], seeds=1, min_failures=2)
    assert not report.headline("wasted").met
    wasted = report.headline("wasted").why
    assert "Per failure, the floor of our recovery (in_process: 2) is **state_transfer**, 0.75 s" in wasted
    assert "our measured recoveries replayed 0 steps on average (restored from storage: 2)" in wasted
    assert "is **state_transfer**, 0.75 s of our 1 s latency" in report.files["report"].read_text()


def test_a_new_process_floor_is_its_whole_start_and_an_in_process_detection_stays_apart():
    """One new-process and one in-process recovery: the new process start (17 s) counts half per recovery,
    its detection among its parts; the in-process detection (0.25 s) is a component of its own."""
    recs = (on_path(recoveries("shadow", (20.0,), (17.0,), (0.25,)), "new_process", NEW_PROCESS)
            + on_path(recoveries("shadow", (1.0,), (0.1,), (0.75,)), "in_process", {**IN_PROCESS, "detection": 0.25}))
    floor = rt.recovery_floor(recs)
    assert (floor["component"], floor["seconds"], floor["paths"]) == ("new process start", 8.5, "new_process: 1, in_process: 1")
    assert floor["parts"]["detection"] == 0.25 and floor["parts"]["process_start"] == 2.0 and "log_setup" not in floor["parts"]
    assert "import torch, Ray Train and transformers" in floor["why"]
    text = rt.floor_text(floor, 10.5)
    assert text.startswith("the floor of our recovery (new_process: 1, in_process: 1) is **new process start**, 8.5 s of our "
                           "10.5 s latency (81%, mean per recovery from the breakdown: detection 0.25 s, teardown 0 s, "
                           "process_start 2 s, group_setup 3 s")


def fo_run(strategy: str, bytes_written: int, block_s: float, **changes) -> dict:
    """One row of a first-order runs.parquet (``results.fo_run_row``): 32 steps, 16 s of compute, an exact restart."""
    return {"run_id": strategy, "strategy": strategy, "algo": "fo", "model": "tiny", "steps": 32, "interval_steps": 8,
            "failures": 2, "recoveries": 2, "exact_by_design": True, "bitwise_equal": True, "wall_s": 300.0, "mean_step_s": 0.5,
            "compute_s_total": 16.0, "block_s_total": block_s, "block_share": block_s / 16.0, "block_s_max": block_s / 2,
            "bytes_written": bytes_written, "dev_from_step": 8, "dev_steps": 24, "loss_dev_mean_abs": 0.0, "first_deviating_step": -1,
            "loss_dev_max_abs": 0.0, "final_loss": 0.7, "reference_final_loss": 0.7, "final_loss_dev": 0.0, **changes}


def test_a_first_order_results_set_gets_the_first_order_report(tmp_path, capsys):
    """``preset.json``'s algo fo selects ``experiments.report_fo``: stall and bytes, recovery, deviation, each labelled."""
    import json

    runs = [fo_run("full-sync", 4_000_000, 0.8), fo_run("full-async", 4_000_000, 0.4),
            fo_run("layerwise", 1_000_000, 0.2, exact_by_design=False, bitwise_equal=False, loss_dev_mean_abs=0.0125,
                   loss_dev_max_abs=0.05, final_loss=0.735, final_loss_dev=0.05, first_deviating_step=24)]
    recs = (recoveries("full-async", (20.0, 22.0), (9.5,) * 2, (1.5,) * 2, recompute=(8, 10))
            + recoveries("layerwise", (18.0, 20.0), (9.5,) * 2, (1.5,) * 2, recompute=(6, 8))
            + recoveries("full-sync", (21.0, 23.0), (9.5,) * 2, (1.5,) * 2, recompute=(8, 10)))
    write(tmp_path, runs, recs)
    (tmp_path / "preset.json").write_text(json.dumps({"name": "fo-quick", "algo": "fo", "model": "tiny", "steps": 32, "batch_size": 8,
                                                      "interval_steps": 8, "failure_steps": [13, 26], "failure_kind": "exit"}))
    report = rp.main([str(tmp_path)])
    stall = {r["strategy"]: r for r in pq.read_table(tmp_path / "stall.parquet").to_pylist()}
    assert list(stall) == ["full-sync", "full-async", "layerwise"]  # STRATEGIES["fo"] order
    assert stall["layerwise"]["bytes_ratio"] == 4.0 and stall["full-sync"]["block_share"] == 0.05
    deviation = {r["strategy"]: r for r in pq.read_table(tmp_path / "deviation.parquet").to_pylist()}
    assert deviation["layerwise"]["loss_dev_mean_abs_pct"] == 1.25 and deviation["layerwise"]["final_loss_dev_pct"] == 5.0
    recovery = {r["strategy"]: r for r in pq.read_table(tmp_path / "recovery.parquet").to_pylist()}
    assert recovery["layerwise"]["latency_s"] == 19.0 and math.isnan(recovery["layerwise"]["ratio"])  # no ours to compare with
    md = (tmp_path / "report.md").read_text()
    for text in ("# raycheck experiment --algo fo: tiny", "## (a) Loop stall and bytes written", "## (b) Recovery latency",
                 "## (c) Exactness and post-restart deviation", "| layerwise | **no** | 8 | 16 | 0.2 | 1.25% | 0.1 | 1,000,000 | 4x |",
                 "| layerwise | **no** | **no** | 24 | 8..31 (24) | 1.25 | 5 | 0.735 | 0.7 | 5 |",
                 "| full-sync | yes | yes | none | 8..31 (24) | 0 | 0 | 0.7 | 0.7 | 0 |", "Inexact by design here: layerwise.",
                 "one sample each", "docs/first-order.md"):
        assert text in md, text
    assert "/ ours" not in md and "ZOCheck" not in md
    assert {p.name for p in tmp_path.glob("*.png")} == {"stall.png", "recovery.png"}
    out = capsys.readouterr().out
    assert out.startswith(f"report: {tmp_path / 'report.md'}\n") and report.headlines == ()
    assert "   layerwise: blocked 1.25% of compute, 1.0 MB, final state differs, mean abs. loss deviation 1.25%" in out
    write(tmp_path, [*runs, {**fo_run("full-async", 1, 0.1), "strategy": "shadow"}], recs)
    with pytest.raises(ValueError, match="strategy shadow is not first-order"):
        rp.write_report(tmp_path)
