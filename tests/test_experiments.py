import math
import types

import pytest


def test_log_cost_benchmark_runs_and_reports_ratios(capsys):
    from raycheck.experiments.log_cost import main

    r = main(["--model", "tiny", "--appends", "20", "--steps", "1", "--saves", "1"])
    assert r["append_over_step"] == r["append_median_s"] / r["step_median_s"] > 0
    assert r["state_bytes"] == 4 * 3_219_776
    assert "append / full torch.save" in capsys.readouterr().out


def _summary(strategy: str, **kw) -> dict:
    return {"strategy": strategy, "config": {"run_id": "r1", "model": "tiny", "steps": 6, "snapshot": {"every_steps": 3}},
            "failures": [{"step": 4, "target": "worker", "how": "exit"}], "bitwise_equal": True, "wall_seconds": 30.0,
            "mean_step_seconds": 0.5, "recoveries": [], "replans": [], **kw}


def _row(step: int, t: float, block: float, due: bool = False, append: float = 0.0) -> dict:
    return {"step": step, "unix_s": t, "step_seconds": 0.5, "checkpoint_block_seconds": block,
            "log_append_seconds": append, "checkpoint_due": due}


def test_full_sync_row_counts_every_execution_and_recovery_splits_latency():
    """Steps 0-4 run, the worker dies in step 4, restarts from the checkpoint at 3 and re-runs step 3."""
    from raycheck.experiments.results import recovery_rows, run_row

    executions = [_row(0, 1.0, 0), _row(1, 2.0, 0), _row(2, 3.0, 0.2, due=True), _row(3, 4.0, 0),
                  _row(3, 20.0, 0), _row(4, 21.0, 0), _row(5, 22.0, 0.3, due=True)]
    summary = _summary("full-sync", worker_checkpoints={"checkpoints": 1, "bytes": 1000, "write_seconds": [0.3]})
    row = run_row(summary, executions)
    assert (row["checkpoints"], row["bytes_written"], row["block_s_total"]) == (2, 2000, 0.5)
    assert row["block_s_per_checkpoint"] == 0.25 and row["snapshot_s"] == 0.25 and row["log_append_s"] == 0.0
    events = [{"kind": "failure", "target": "worker", "step": 4, "unix_s": 4.2},
              {"kind": "recovery", "unix_s": 19.0, "seconds": 1.0, "restored_step": 3, "source": "storage",
               "load_seconds": 0.9, "replay_seconds": 0.0, "replayed_steps": 0}]
    [rec] = recovery_rows(summary, events, executions)
    assert rec["latency_s"] == 21.0 - 0.5 - 4.2  # to the start of step 4's second execution
    assert rec["restart_s"] == 18.0 - 4.2 and rec["load_s"] == 0.9
    assert rec["recompute_steps"] == 1 and rec["recompute_s"] == 21.0 - 0.5 - 19.0


def test_shadow_row_counts_log_appends_as_durable_points_and_the_log_bytes():
    from raycheck.experiments.results import run_row
    from raycheck.storage.steplog import RECORD_BYTES

    appends = [0.001, 0.001, 0.004, 0.001, 0.002, 0.009]
    executions = [_row(s, float(s), a, append=a) for s, a in enumerate(appends)]
    summary = _summary("shadow", snapshots={"written": 2, "write_seconds": 3.0, "bytes_written": 5000},
                       shadow_replay_seconds_per_step=0.2, replans=[{"interval_steps": 40}])
    row = run_row(summary, executions)
    assert (row["checkpoints"], row["snapshots"], row["interval_steps"]) == (6, 2, 40)
    assert row["bytes_written"] == 5000 + 6 * RECORD_BYTES and row["snapshot_s"] == 1.5
    assert row["block_s_per_checkpoint"] == row["log_append_s"] == pytest.approx(0.003) and row["replay_step_s"] == 0.2
    assert row["log_append_median_s"] == 0.0015  # the mean of the middle two of six
    assert row["durability"] == "" and run_row({**summary, "config": {**summary["config"], "durability": "process"}},
                                                   executions)["durability"] == "process"


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """The kernel may offer the same free port to two binds in a row (the first caller has not bound it
    yet); ``free_port`` must then look again, or one ``ray start`` gets one port for two servers."""
    import raycheck.experiments.s3_server as s3_server

    offered = iter([41001, 41001, 41002])

    class OneShotSocket:  # the kernel's answers, in order
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(s3_server.socket, "socket", OneShotSocket)
    monkeypatch.setattr(s3_server, "_HANDED_OUT", set())
    assert [s3_server.free_port(), s3_server.free_port()] == [41001, 41002]


def test_recovery_rows_carry_the_summary_breakdown_as_columns():
    from raycheck.experiments.results import recovery_rows

    executions = [_row(3, 4.0, 0), _row(4, 30.0, 0)]
    summary = _summary("shadow", recoveries=[{"breakdown": {"detection_s": 0.5, "log_setup+state_transfer_s": 1.25},
                                              "first_step_seconds": 25.75}])
    events = [{"kind": "failure", "target": "worker", "step": 4, "unix_s": 4.25},
              {"kind": "recovery", "unix_s": 29.0, "seconds": 1.0, "restored_step": 4, "source": "object_store",
               "load_seconds": 0.9, "replay_seconds": 0.0, "replayed_steps": 0}]
    [rec] = recovery_rows(summary, events, executions)
    assert {k: rec[k] for k in ("bd_detection_s", "bd_log_setup+state_transfer_s", "first_step_s")} == {
        "bd_detection_s": 0.5, "bd_log_setup+state_transfer_s": 1.25, "first_step_s": 25.75}
    assert rec["path"] == "new_process"  # an event without a path: a run older than the warm path
    [rec] = recovery_rows(summary, [events[0], {**events[1], "path": "in_process"}], executions)
    assert rec["path"] == "in_process"


def test_failure_kind_reaches_every_strategy_but_not_the_reference(tmp_path):
    """``--failure-kind raise``: the preset's failure steps, each a ``worker:raise``, for every strategy."""
    import pytest

    from raycheck.experiments.harness import PRESETS, PRESETS_BY_ALGO, job_config
    from raycheck.job.config import STRATEGIES

    preset = PRESETS["full"]
    for strategy in STRATEGIES["zo"]:
        cfg = job_config(preset, strategy, tmp_path / strategy, "/cache", failure_kind="raise")
        assert [(f.step, f.target, f.how) for f in cfg.faults.failures] == [(12, "worker", "raise"), (24, "worker", "raise")]
    assert [f.how for f in job_config(preset, "shadow", tmp_path, "/cache").faults.failures] == ["exit", "exit"]
    assert job_config(preset, "shadow", tmp_path, "/cache", failures=False, failure_kind="raise").faults.failures == ()
    with pytest.raises(ValueError, match="failure kind 'sigkill': choose one of exit, cold, raise, standby"):
        job_config(preset, "shadow", tmp_path, "/cache", failure_kind="sigkill")
    for strategy in STRATEGIES["zo"]:  # standby: the process exits and every strategy's worker has a warm standby
        cfg = job_config(preset, strategy, tmp_path / strategy, "/cache", failure_kind="standby")
        assert [f.how for f in cfg.faults.failures] == ["exit", "exit"] and cfg.faults.warm_standby and cfg.supervised
    for strategy in STRATEGIES["fo"]:  # one first-order worker can keep one too
        assert job_config(PRESETS_BY_ALGO["fo"]["full"], strategy, tmp_path / strategy, "/cache", failure_kind="standby").supervised
    cold = job_config(preset, "shadow", tmp_path, "/cache", failure_kind="cold")
    assert [f.how for f in cold.faults.failures] == ["exit", "exit"] and cold.faults.warm_standby is False and not cold.supervised
    assert job_config(preset, "shadow", tmp_path, "/cache", failures=False, failure_kind="standby").faults.warm_standby is None
    assert job_config(preset, "shadow", tmp_path, "/cache").faults.warm_standby is None  # exit: the run's default
    assert job_config(preset, "shadow", tmp_path, "/cache").durability == "node"  # the run's default
    assert {job_config(preset, s, tmp_path, "/cache", durability="process").durability for s in STRATEGIES["zo"]} == {"process"}


def test_experiment_cli_refuses_an_unknown_failure_kind(tmp_path):
    from typer.testing import CliRunner

    from raycheck.cli.main import app

    result = CliRunner().invoke(app, ["experiment", "--failure-kind", "sigkill", "--out", str(tmp_path)])
    assert result.exit_code == 2 and result.output.startswith("error: --failure-kind 'sigkill': choose from exit, cold, raise, standby")
    assert list(tmp_path.iterdir()) == []
    help_text = CliRunner().invoke(app, ["experiment", "--help"]).output
    assert "--failure-kind" in help_text and "the process survives" in help_text and "--no-warm-standby" in help_text
    assert list(tmp_path.iterdir()) == []
    result = CliRunner().invoke(app, ["experiment", "--durability", "cluster", "--out", str(tmp_path)])
    assert result.exit_code == 2 and result.output == ("error: --durability 'cluster': choose process or node (cluster "
                                                       "needs remote storage, which the experiment does not use)\n")
    result = CliRunner().invoke(app, ["experiment", "--durability", "disk", "--out", str(tmp_path)])
    assert result.exit_code == 2 and result.output == "error: --durability 'disk': choose process or node\n"
    assert list(tmp_path.iterdir()) == []


def test_experiment_cli_never_empties_a_folder_it_did_not_write_and_replaces_results_only_with_overwrite(tmp_path, monkeypatch):
    """The experiment deletes ``--out``'s ``runs/`` before it starts; before the fix ``--out .`` in a project
    folder deleted the user's ``runs/myrun``, and an earlier experiment's 7.6 GB of runs went without a word."""
    from typer.testing import CliRunner

    import raycheck.experiments.harness as harness
    import raycheck.orchestrator.cluster as cluster
    from raycheck.cli.main import app

    started = []
    monkeypatch.setattr(harness, "run_experiment", lambda preset, out, *args, **kwargs: started.append(out))
    monkeypatch.setattr(cluster, "connect", lambda *args, **kwargs: True)
    monkeypatch.setattr("raycheck.experiments.report.write_report", lambda out: types.SimpleNamespace(summary=lambda: "report"))

    def experiment(out, *more):
        return CliRunner().invoke(app, ["experiment", "--quick", "--out", str(out), *more])

    project = tmp_path / "project"
    (project / "runs" / "myrun").mkdir(parents=True)
    (project / "runs" / "myrun" / "keep.txt").write_text("precious")
    (project / "notes.txt").write_text("mine")
    earlier, interrupted = tmp_path / "earlier", tmp_path / "interrupted"
    (earlier / "runs" / "shadow").mkdir(parents=True)
    (earlier / "preset.json").write_text("{}")
    (interrupted / "runs" / "reference").mkdir(parents=True)  # stopped before its tables and preset.json
    (tmp_path / "afile").write_text("x")
    for out, more, line in [
        (project / "notes.txt", [], f"error: --out {project / 'notes.txt'} is a file, not a folder"),
        (project, ["--overwrite"], f"error: {project} is not empty and holds no raycheck experiment (no preset.json or "
                                   "runs/reference): choose a new or empty --out"),
        (earlier, [], f"error: {earlier} already holds an experiment's results; pass --overwrite to replace them (its runs/ "
                      "is deleted) or choose another --out"),
        (interrupted, [], f"error: {interrupted} already holds an experiment's results; pass --overwrite to replace them "
                          "(its runs/ is deleted) or choose another --out"),
    ]:
        result = experiment(out, *more)
        assert result.exit_code == 2 and result.output == line + "\n", result.output
    assert (project / "runs" / "myrun" / "keep.txt").read_text() == "precious" and (earlier / "runs" / "shadow").is_dir()
    assert started == []
    (tmp_path / "empty").mkdir()
    for out, more in [(tmp_path / "new", []), (tmp_path / "empty", []), (earlier, ["--overwrite"]), (interrupted, ["--overwrite"])]:
        started.clear()
        result = experiment(out, *more)
        assert started == [out.resolve()], result.output


def test_inproc_bench_table_lists_each_path_s_components_in_breakdown_order():
    """An in-process recovery has no Ray Train component: its cells are '-', and a mean over none is '-'; a standby's
    promotion comes right after the detection."""
    from raycheck.experiments.inproc_bench import table

    def rec(breakdown: dict, seconds: float, first: float) -> dict:
        return {"breakdown": breakdown, "seconds": seconds, "first_step_seconds": first}

    rows = {"raise": [rec({"detection_s": 0.0, "log_setup_s": 0.25}, 0.5, 1.0), rec({"detection_s": 0.5, "log_setup_s": 0.75}, 1.5, 2.0)],
            "exit": [rec({"detection_s": 0.5, "group_setup_s": 5.0, "log_setup_s": 0.5}, 12.0, 12.5)]}
    lines = table(rows).splitlines()
    assert lines[0] == "| component | raise 1 | raise 2 | exit 1 | mean raise | mean exit |"
    assert lines[2:] == ["| detection | 0.00 | 0.50 | 0.50 | 0.25 | 0.50 |", "| group_setup | - | - | 5.00 | - | 5.00 |",
                         "| log_setup | 0.25 | 0.75 | 0.50 | 0.50 | 0.50 |",
                         "| **failure -> restored** | 0.50 | 1.50 | 12.00 | 1.00 | 12.00 |",
                         "| **failure -> first step done** | 1.00 | 2.00 | 12.50 | 1.50 | 12.50 |"]
    standby = table({"standby": [rec({"detection_s": 0.25, "promotion_s": 0.5, "log_setup_s": 0.25}, 1.0, 1.5)]}).splitlines()
    assert [line.split(" | ")[0] for line in standby[2:5]] == ["| detection", "| promotion", "| log_setup"]


def test_fo_presets_run_every_first_order_strategy_on_the_same_failures(tmp_path):
    """``raycheck experiment --algo fo``: each strategy of ``STRATEGIES["fo"]`` is an AdamW run with the preset's
    interval and failures; differential takes a full checkpoint every two intervals; the reference has no failure."""
    from raycheck.experiments.harness import PRESETS_BY_ALGO, REFERENCE_STRATEGY, job_config
    from raycheck.job.config import STRATEGIES

    for preset in PRESETS_BY_ALGO["fo"].values():
        for strategy in STRATEGIES["fo"]:
            cfg = job_config(preset, strategy, tmp_path / strategy, "/cache")
            assert (cfg.algo, cfg.strategy, cfg.snapshot.every_steps, cfg.snapshot.policy) == ("fo", strategy, preset.interval_steps, "fixed")
            assert [(f.step, f.target) for f in cfg.faults.failures] == [(s, "worker") for s in preset.failure_steps]
            assert cfg.differential.full_every_steps == 2 * preset.interval_steps >= cfg.overlapped.chunks
        reference = job_config(preset, REFERENCE_STRATEGY["fo"], tmp_path / "reference", "/cache", failures=False)
        assert reference.algo == "fo" and reference.faults.failures == ()
    assert PRESETS_BY_ALGO["fo"]["quick"].model == "tiny" and PRESETS_BY_ALGO["fo"]["full"].model == "smollm2-135m"


def _fo_row(step: int, t: float, loss: float, block: float = 0.0, committed: int = 0) -> dict:
    return {"step": step, "unix_s": t, "loss": loss, "step_seconds": 0.5, "checkpoint_block_seconds": block,
            "log_append_seconds": 0.0, "checkpoint_bytes": committed}


def test_fo_row_sums_bytes_over_incarnations_and_measures_the_loss_deviation_after_the_restart():
    """A layer-wise run of 6 steps: checks after steps 2 and 4 (bytes committed 100, then 130), the worker dies
    in step 5, the new one restores the composite of step 4 and runs steps 4 and 5 (committing 40, then 60 by
    ``close``); the reference's losses are 1.0 at every step."""
    from raycheck.experiments.results import fo_run_row
    from raycheck.orchestrator.summary import checkpoint_bytes

    executions = [_fo_row(0, 1.0, 1.0), _fo_row(1, 2.0, 1.0, 0.25, 100), _fo_row(2, 3.0, 1.0), _fo_row(3, 4.0, 1.0, 0.25, 130),
                  _fo_row(4, 5.0, 1.5), _fo_row(4, 20.0, 1.1, 0.5, 40), _fo_row(5, 21.0, 0.8)]
    events = [{"kind": "failure", "target": "worker", "step": 5, "unix_s": 5.2},
              {"kind": "recovery", "unix_s": 19.0, "seconds": 1.0, "restored_step": 4, "source": "storage",
               "load_seconds": 0.9, "replay_seconds": 0.0, "replayed_steps": 0}]
    reference = [_fo_row(s, float(s), 1.0) for s in range(6)]
    summary = _summary("layerwise", worker_checkpoints={"checkpoints": 2, "bytes": 60}, bitwise_equal=False,
                       config={"run_id": "r1", "model": "tiny", "steps": 6, "snapshot": {"every_steps": 2}})
    row = fo_run_row(summary, executions, events, reference)
    assert row["bytes_written"] == 130 + 60 and checkpoint_bytes(executions, [], 0) == 130  # one incarnation: the most committed
    assert (row["block_s_total"], row["compute_s_total"], row["block_share"], row["block_s_max"]) == (1.0, 3.5, 1.0 / 3.5, 0.5)
    assert (row["exact_by_design"], row["bitwise_equal"], row["recoveries"], row["failures"]) == (False, False, 1, 1)
    # steps 4 and 5 from their last executions: |1.1 - 1| and |0.8 - 1|; the discarded 1.5 of step 4 does not count
    assert (row["dev_from_step"], row["dev_steps"], row["first_deviating_step"]) == (4, 2, 4)
    assert row["loss_dev_mean_abs"] == pytest.approx(0.15) and row["loss_dev_max_abs"] == pytest.approx(0.2)
    assert (row["final_loss"], row["reference_final_loss"]) == (0.8, 1.0) and row["final_loss_dev"] == pytest.approx(-0.2)
    exact = fo_run_row(_summary("differential", config={"run_id": "r2", "model": "tiny", "steps": 6, "snapshot": {"every_steps": 2},
                                                       "differential": {"topk": 0.0}}), reference, [], reference)
    assert exact["exact_by_design"] and exact["dev_from_step"] == -1 and exact["dev_steps"] == 0 and math.isnan(exact["loss_dev_mean_abs"])
    assert exact["first_deviating_step"] == -1
    assert exact["final_loss_dev"] == 0.0


def test_experiment_cli_refuses_a_zo_strategy_with_algo_fo_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from raycheck.cli.main import app

    result = CliRunner().invoke(app, ["experiment", "--algo", "fo", "--strategy", "layerwise", "--strategy", "shadow",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output == ("error: --strategy shadow is not a strategy of --algo fo: choose from full-sync, full-async, "
                             "layerwise, differential, overlapped\n")
    assert list(tmp_path.iterdir()) == []
    assert CliRunner().invoke(app, ["experiment", "--algo", "so", "--out", str(tmp_path)]).output == "error: --algo 'so': choose zo or fo\n"


def test_collect_results_rebuilds_the_fo_tables_from_the_run_directories(tmp_path):
    """``harness.collect_results``: runs.parquet and recoveries.parquet come from ``runs/<strategy>/`` and the
    reference's metrics alone (a change of the row functions needs no new run)."""
    import json

    import pyarrow.parquet as pq

    from raycheck.experiments.harness import collect_results

    def lines(path, rows):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    lines(tmp_path / "runs" / "reference" / "metrics.jsonl", [_fo_row(s, float(s), 1.0) for s in range(4)])
    executions = [_fo_row(0, 1.0, 1.0), _fo_row(1, 2.0, 1.0, 0.5, 100), _fo_row(2, 3.0, 1.0), _fo_row(2, 9.0, 1.25), _fo_row(3, 10.0, 1.5)]
    events = [{"kind": "failure", "target": "worker", "step": 3, "unix_s": 3.5},
              {"kind": "recovery", "unix_s": 8.0, "seconds": 1.0, "restored_step": 2, "source": "storage",
               "load_seconds": 0.5, "replay_seconds": 0.0, "replayed_steps": 0}]
    lines(tmp_path / "runs" / "layerwise" / "metrics.jsonl", executions)
    lines(tmp_path / "runs" / "layerwise" / "events.jsonl", events)
    summary = _summary("layerwise", worker_checkpoints={"bytes": 20}, failures=[{"step": 3, "target": "worker", "how": "exit"}])
    (tmp_path / "runs" / "layerwise" / "summary.json").write_text(json.dumps(summary))
    collect_results(tmp_path, "fo", ("layerwise",))
    [row] = pq.read_table(tmp_path / "runs.parquet").to_pylist()
    assert (row["strategy"], row["bytes_written"], row["first_deviating_step"], row["dev_from_step"]) == ("layerwise", 120, 2, 2)
    assert row["loss_dev_mean_abs"] == pytest.approx(0.375) and row["bitwise_equal"] is True  # as summary.json says
    [rec] = pq.read_table(tmp_path / "recoveries.parquet").to_pylist()
    assert (rec["strategy"], rec["at_step"], rec["restored_step"]) == ("layerwise", 3, 2)
    with pytest.raises(FileNotFoundError, match="full-sync/summary.json not found"):
        collect_results(tmp_path, "fo", ("full-sync",))
