"""``orchestrator.summary.recoveries``: each recovery's timings and the work it lost or must redo."""

import dataclasses

from raycheck.orchestrator.summary import (BREAKDOWN, IN_PROCESS_BREAKDOWN, STANDBY_BREAKDOWN, Collected, breakdown, mean_step_seconds, recoveries,
                                           failed_summary, metric_coverage, missing_steps_line, run_checkpoints, recovery_of_event, run_summary)


def test_recoveries_count_lost_and_recomputed_steps_against_the_failure_they_answer():
    events = [
        {"kind": "failure", "target": "shadow", "step": 2, "unix_s": 95.0},  # not a worker failure: ignored
        {"kind": "failure", "target": "worker", "step": 17, "durable_steps": 16, "unix_s": 100.0},
        {"kind": "recovery", "at_step": 10, "restored_step": 10, "source": "storage", "base_step": 10, "replayed_steps": 0,
         "seconds": 4.0, "load_seconds": 3.0, "replay_seconds": 0.0, "skipped": ["step-15: sha256 differs"], "unix_s": 112.0},
        {"kind": "failure", "target": "worker", "step": 25, "durable_steps": 25, "unix_s": 200.0},
        {"kind": "recovery", "at_step": 25, "restored_step": 25, "source": "object_store", "base_step": 25, "replayed_steps": 0,
         "seconds": 1.5, "load_seconds": 1.0, "replay_seconds": 0.5, "unix_s": 209.0},
    ]
    first, second = recoveries(events)
    # 16 steps were durable at the failure in step 17 but only 10 came back (a corrupt snapshot was skipped and the
    # log did not reach past it): 6 durable steps lost; steps 10..16 ran before the failure and run again: 7
    assert first == {"at_step": 10, "restored_step": 10, "source": "storage", "base_step": 10, "replayed_steps": 0,
                     "skipped": ["step-15: sha256 differs"], "restore_seconds": 4.0, "load_seconds": 3.0, "replay_seconds": 0.0,
                     "failure_step": 17, "seconds": 12.0, "restart_seconds": 8.0, "lost_steps": 6, "recompute_steps": 7}
    assert (second["lost_steps"], second["recompute_steps"], second["seconds"], second["restart_seconds"]) == (0, 0, 9.0, 7.5)


def test_a_recovery_without_a_worker_failure_has_no_failure_fields():
    [row] = recoveries([{"kind": "recovery", "at_step": 0, "restored_step": 0, "source": "initial", "base_step": 0,
                         "replayed_steps": 0, "seconds": 0.1, "load_seconds": 0.1, "replay_seconds": 0.0, "unix_s": 5.0}])
    assert "lost_steps" not in row and "failure_step" not in row and row["restore_seconds"] == 0.1


def test_the_ranks_of_a_group_restoring_the_same_step_are_one_recovery():
    """With replica groups every rank that restores records a ``recovery`` event; a whole-group restart
    after one failure is one recovery (the first event), a later failure's is another."""
    restored = {"source": "object_store", "base_step": 6, "replayed_steps": 0, "seconds": 0.5, "load_seconds": 0.5,
                "replay_seconds": 0.0}
    events = [
        {"kind": "failure", "target": "worker", "step": 6, "durable_steps": 6, "unix_s": 100.0},
        {"kind": "recovery", "rank": 1, "at_step": 6, "restored_step": 6, "unix_s": 104.0, **restored},
        {"kind": "recovery", "rank": 0, "at_step": 6, "restored_step": 6, "unix_s": 105.0, **restored},
        {"kind": "failure", "target": "worker", "step": 6, "durable_steps": 6, "unix_s": 110.0},
        {"kind": "recovery", "rank": 0, "at_step": 6, "restored_step": 6, "unix_s": 113.0, **restored},
    ]
    assert [(r["failure_step"], r["seconds"]) for r in recoveries(events)] == [(6, 4.0), (6, 3.0)]


T0 = 1_700_000_000.0  # a unix time: stamps are multiples of 2**-22 s here, so the components add up exactly

STAMPS = {  # seconds after the failure at T0, one per BREAKDOWN stamp
    "detected_unix_s": 0.5, "group_start_unix_s": 0.75, "process_created_unix_s": 1.25, "workers_created_unix_s": 3.0,
    "group_ready_unix_s": 5.5, "worker_start_unix_s": 5.625, "imports_unix_s": 7.625, "model_loaded_unix_s": 9.125,
    "data_loaded_unix_s": 10.0, "restore_began_unix_s": 10.0625, "state_loaded_unix_s": 10.5625, "unix_s": 10.75,
    "first_step_unix_s": 11.5,
}


def test_breakdown_is_the_chain_of_stamps_and_adds_up_to_the_total_exactly():
    parts, clamped = breakdown(T0, {k: T0 + v for k, v in STAMPS.items()})
    # by hand: each component is its stamp minus the one before (the first minus the failure)
    assert parts == {"detection_s": 0.5, "teardown_s": 0.25, "scheduling_s": 0.5, "process_start_s": 1.75,
                     "group_setup_s": 2.5, "launch_s": 0.125, "imports_s": 2.0, "model_load_s": 1.5, "data_load_s": 0.875,
                     "log_setup_s": 0.0625, "state_transfer_s": 0.5, "replay_s": 0.1875, "first_step_s": 0.75}
    assert clamped == [] and list(parts) == [part for _, part in BREAKDOWN]
    # stamps that are not binary fractions: the sum is still exactly the last stamp minus the failure
    odd = {k: T0 + v * 1.0123456789 for k, v in STAMPS.items()}
    parts, _ = breakdown(T0 + 0.1, odd)
    assert sum(parts.values()) == odd["first_step_unix_s"] - (T0 + 0.1)


def test_a_missing_stamp_merges_its_two_components_and_an_early_one_is_clamped_to_zero():
    stamps = {k: T0 + v for k, v in STAMPS.items() if k not in ("detected_unix_s", "restore_began_unix_s", "first_step_unix_s")}
    stamps["process_created_unix_s"] = T0 - 2.0  # a process Ray had started before the failure
    parts, clamped = breakdown(T0, stamps)
    assert parts == {"detection+teardown_s": 0.75, "scheduling_s": 0.0, "process_start_s": 2.25, "group_setup_s": 2.5,
                     "launch_s": 0.125, "imports_s": 2.0, "model_load_s": 1.5, "data_load_s": 0.875,
                     "log_setup+state_transfer_s": 0.5625, "replay_s": 0.1875}  # no first step yet: it ends at the restore
    assert clamped == ["scheduling_s"]


def test_recoveries_take_the_breakdown_from_the_group_the_worker_joined_and_its_first_step():
    group = {k: T0 + STAMPS[k] for k in ("detected_unix_s", "group_start_unix_s", "workers_created_unix_s", "group_ready_unix_s")}
    worker = {k: T0 + v for k, v in STAMPS.items() if k not in group and k not in ("unix_s", "first_step_unix_s")}
    events = [
        {"kind": "worker_group", "starts": 1, "group_start_unix_s": T0 - 30.0, "unix_s": T0 - 20.0},  # the first start
        {"kind": "failure", "target": "worker", "step": 3, "durable_steps": 3, "unix_s": T0},
        {"kind": "recovery", "at_step": 3, "restored_step": 3, "source": "object_store", "base_step": 3, "replayed_steps": 0,
         "seconds": 0.6875, "load_seconds": 0.5, "replay_seconds": 0.0, **worker, "unix_s": T0 + 10.75},
        # the controller's stamps reach the journal after the worker's event: matched by time, not by order
        {"kind": "worker_group", "starts": 2, **group, "unix_s": T0 + 5.75},
    ]
    executions = [{"step": 3, "unix_s": T0 - 1.0}, {"step": 2, "unix_s": T0 + 11.0}, {"step": 3, "unix_s": T0 + 11.5}]
    [row] = recoveries(events, executions)
    assert row["breakdown"] == breakdown(T0, {**{k: T0 + v for k, v in STAMPS.items()}})[0]
    assert (row["seconds"], row["first_step_seconds"]) == (10.75, 11.5)
    assert sum(row["breakdown"].values()) == row["first_step_seconds"]
    assert "breakdown_clamped" not in row
    # before the first step after the restore is done, the breakdown ends at the restore
    [early] = recoveries(events, executions[:2])
    assert early["first_step_seconds"] is None and "first_step_s" not in early["breakdown"]
    assert sum(early["breakdown"].values()) == early["seconds"]


def test_a_worker_that_fails_again_before_its_first_step_has_no_first_step():
    """Back to back in step 5: the restarted worker fails in step 5 too; the step 5 done later belongs
    to the second recovery only."""
    worker = {k: T0 + v for k, v in STAMPS.items() if k in ("process_created_unix_s", "worker_start_unix_s")}
    recovery = {"kind": "recovery", "at_step": 5, "restored_step": 5, "source": "object_store", "base_step": 5,
                "replayed_steps": 0, "seconds": 0.5, "load_seconds": 0.5, "replay_seconds": 0.0}
    events = [{"kind": "failure", "target": "worker", "step": 5, "durable_steps": 5, "unix_s": T0},
              {**recovery, **worker, "unix_s": T0 + 10.0},
              {"kind": "failure", "target": "worker", "step": 5, "durable_steps": 5, "unix_s": T0 + 10.5},
              {**recovery, **{k: v + 20.0 for k, v in worker.items()}, "unix_s": T0 + 30.0}]
    first, second = recoveries(events, [{"step": 5, "unix_s": T0 + 31.0}])
    assert first["first_step_seconds"] is None and sum(first["breakdown"].values()) == first["seconds"] == 10.0
    assert second["first_step_seconds"] == 20.5 and second["breakdown"]["first_step_s"] == 1.0


def test_an_in_process_restart_is_one_recovery_broken_down_without_ray_train():
    """The worker's process survived (``path`` ``in_process``): its breakdown is its own stamps, from the
    exception caught to the first step done; no worker group started, no Ray Train component."""
    events = [
        {"kind": "worker_group", "starts": 1, "group_start_unix_s": T0 - 30.0, "unix_s": T0 - 20.0},
        {"kind": "failure", "target": "worker", "step": 3, "durable_steps": 3, "unix_s": T0},
        {"kind": "in_process_restart", "rank": 0, "step": 3, "unix_s": T0 + 0.0625},
        {"kind": "recovery", "rank": 0, "at_step": 3, "restored_step": 3, "path": "in_process", "pid": 42, "source": "object_store",
         "base_step": 3, "replayed_steps": 0, "seconds": 0.25, "load_seconds": 0.125, "replay_seconds": 0.0,
         "detected_unix_s": T0 + 0.015625, "restore_began_unix_s": T0 + 0.125, "state_loaded_unix_s": T0 + 0.3125,
         "unix_s": T0 + 0.375},
    ]
    [row] = recoveries(events, [{"step": 3, "unix_s": T0 + 0.875}])
    assert row["path"] == "in_process" and (row["failure_step"], row["lost_steps"], row["seconds"]) == (3, 0, 0.375)
    assert row["breakdown"] == {"detection_s": 0.015625, "log_setup_s": 0.109375, "state_transfer_s": 0.1875, "replay_s": 0.0625,
                                "first_step_s": 0.5}
    assert list(row["breakdown"]) == [part for _, part in IN_PROCESS_BREAKDOWN]
    assert sum(row["breakdown"].values()) == row["first_step_seconds"] == 0.875 and "breakdown_clamped" not in row


def test_a_standby_promotion_is_broken_down_over_its_own_stamps():
    """A warm standby took over (``path`` ``standby``): its chain has the promotion after the detection and
    no Ray Train, process start or load component (the standby loaded before the failure)."""
    events = [
        {"kind": "failure", "target": "worker", "step": 3, "durable_steps": 3, "unix_s": T0},
        {"kind": "recovery", "rank": 0, "at_step": 3, "restored_step": 3, "path": "standby", "pid": 43, "source": "object_store",
         "base_step": 3, "replayed_steps": 0, "seconds": 0.25, "load_seconds": 0.125, "replay_seconds": 0.0,
         "detected_unix_s": T0 + 0.125, "promoted_unix_s": T0 + 0.25, "restore_began_unix_s": T0 + 0.5,
         "state_loaded_unix_s": T0 + 0.625, "unix_s": T0 + 0.75},
    ]
    [row] = recoveries(events, [{"step": 3, "unix_s": T0 + 1.0}])
    assert row["path"] == "standby" and list(row["breakdown"]) == [part for _, part in STANDBY_BREAKDOWN]
    assert row["breakdown"] == {"detection_s": 0.125, "promotion_s": 0.125, "log_setup_s": 0.25, "state_transfer_s": 0.125,
                                "replay_s": 0.125, "first_step_s": 0.25}
    assert sum(row["breakdown"].values()) == row["first_step_seconds"] == 1.0 and row["seconds"] == 0.75


def test_each_recovery_says_why_it_took_its_path_from_the_standby_decision_in_force_when_its_worker_failed():
    """Rank 1 kept no standby (too little memory): its failure goes to Ray Train, and the row says why with that
    decision's reason, not the one its new incarnation records before restoring; rank 0 kept one: promoted."""
    def recovery(rank, step, path, t):
        return {"kind": "recovery", "rank": rank, "at_step": step, "restored_step": step, "path": path, "source": "object_store",
                "base_step": step, "replayed_steps": 0, "seconds": 0.25, "load_seconds": 0.1, "replay_seconds": 0.0, "unix_s": t}

    events = [
        {"kind": "standby_decision", "rank": 0, "keep": True, "reason": "warm standby on: ...", "unix_s": T0},
        {"kind": "standby_decision", "rank": 1, "keep": False, "reason": "warm standby off: it would hold 2 GiB", "unix_s": T0},
        {"kind": "failure", "target": "worker", "step": 3, "durable_steps": 3, "unix_s": T0 + 1},
        {"kind": "standby_decision", "rank": 1, "keep": True, "reason": "warm standby on: the new incarnation's", "unix_s": T0 + 9},
        recovery(1, 3, "new_process", T0 + 10),
        {"kind": "failure", "target": "worker", "step": 5, "durable_steps": 5, "unix_s": T0 + 12},
        {**recovery(0, 5, "standby", T0 + 12.5), "detected_unix_s": T0 + 12.1, "standby_loaded_unix_s": T0 + 4},
        {"kind": "failure", "target": "worker", "step": 6, "durable_steps": 6, "unix_s": T0 + 13},
        {**recovery(0, 6, "standby", T0 + 17), "detected_unix_s": T0 + 13.25, "standby_loaded_unix_s": T0 + 15.75},
    ]
    assert [(r["path"], r["why"]) for r in recoveries(events)] == [
        ("new_process", "Ray Train restarted the worker: warm standby off: it would hold 2 GiB"),
        ("standby", "the executor's process died and the rank's loaded standby took over"),
        ("standby", "the executor's process died and the rank's standby, still loading (2.5 s more), took over")]


def test_a_resume_starts_afresh_its_restore_answers_no_earlier_failure_and_every_event_has_its_row():
    """A resume that restores the step the last recovery restored (its newest checkpoint was damaged) is
    a recovery of its own, not a second event of the earlier one; it has no failure fields (the driver
    was dead in between: no failure-to-restore time)."""
    restored = {"source": "storage", "base_step": 3, "replayed_steps": 0, "seconds": 0.5, "load_seconds": 0.5,
                "replay_seconds": 0.0}
    events = [
        {"kind": "failure", "target": "worker", "step": 5, "durable_steps": 5, "unix_s": 100.0},
        {"kind": "recovery", "at_step": 3, "restored_step": 3, "unix_s": 110.0, **restored},
        {"kind": "resume", "durable_steps": 0, "unix_s": 300.0},
        {"kind": "recovery", "at_step": 3, "restored_step": 3, "unix_s": 320.0, **restored},
        {"kind": "resume", "durable_steps": 0, "unix_s": 400.0},
        {"kind": "recovery", "at_step": 3, "restored_step": 3, "unix_s": 420.0, **restored},
    ]
    rows = recoveries(events)
    assert [(r.get("failure_step"), r.get("seconds")) for r in rows] == [(5, 10.0), (None, None), (None, None)]
    by_event = recovery_of_event(events)
    assert sorted(by_event) == [1, 3, 5] and [by_event[i] for i in (1, 3, 5)] == rows


def test_the_run_summary_is_a_pure_function_of_what_the_controller_collected():
    events = [
        {"kind": "accuracy", "value": 0.5, "unix_s": 1.0},
        {"kind": "failure", "target": "worker", "step": 2, "how": "raise", "durable_steps": 2, "unix_s": 10.0},
        {"kind": "recovery", "at_step": 2, "restored_step": 2, "source": "object_store", "base_step": 2, "replayed_steps": 0,
         "seconds": 1.0, "load_seconds": 0.5, "replay_seconds": 0.25, "unix_s": 14.0},
        {"kind": "step_log", "node_id": "n0", "unix_s": 15.0},
        {"kind": "final", "step": 4, "state_sha256": "ab", "accuracy_after": 0.75, "checkpoints": 3, "cpu_capability": "avx2"},
    ]
    rows = [{"step": s, "step_seconds": 1.5 + s, "checkpoint_block_seconds": 0.25, "log_append_seconds": 0.125} for s in range(4)]
    rows[3]["state_sha256"] = "ab"
    collected = Collected(ok=True, error=None, events=events, executions=rows, rows=rows,
                          shadow={"shadow_state_sha256": "ab", "shadow_shards": []}, persisted={"written": 2},
                          mirror={"log_mirrored_steps": 4}, keeper={"node_id": "k", "end": 4}, durability_level="node", task="classification",
                          base={"phase": "finished", "dtype": "float32"}, newest_snapshot=(4, "/s/step-4"),
                          ray_train_checkpoint={"path": "/r/step-4", "snapshot": "/s/step-4", "step": 4})
    summary = run_summary(collected)
    assert summary == {
        "ok": True, "error": None, "final_step": 4, "state_sha256": "ab", "shadow_state_sha256": "ab", "shadow_equal": True,
        "reference_state_sha256": None, "bitwise_equal": None, "failures": [{"step": 2, "target": "worker", "how": "raise"}],
        "recoveries": recoveries(events, rows), "standby": [], "preemptions": [], "lost_steps": 0, "torn_tails_cut": [], "accuracy_before": 0.5,
        "accuracy_after": 0.75, "eval_metric": "accuracy", "mean_step_seconds": 3.0, "mean_log_append_seconds": 0.125,
        "checkpoint_block_seconds_total": 1.0, "mean_checkpoint_block_seconds": 0.25, "worker_checkpoints": 3,
        "worker_cpu_capability": "avx2", "shadow_shards": [], "worker_hashes": {"4": "ab"},
        "snapshots": {"written": 2, "log_mirrored_steps": 4}, "final_snapshot": "/s/step-4",
        "ray_train_checkpoint": {"path": "/r/step-4", "snapshot": "/s/step-4", "step": 4},
        "durability": {"level": "node", "keeper_node_id": "k", "rank0_node_ids": ["n0"], "node_held": True},
        "replans": [], "resumes": [], "metrics": {"missing_step_count": 0, "missing_steps": []},
        "phase": "finished", "dtype": "float32"}
    assert list(summary)[:4] == ["ok", "error", "final_step", "state_sha256"] and list(summary)[-2:] == ["phase", "dtype"]
    # no shadow, no log keeper: those fields are None, and nothing else changes
    bare = run_summary(dataclasses.replace(collected, shadow={}, keeper=None))
    assert (bare["shadow_equal"], bare["shadow_state_sha256"], bare["durability"], bare["metrics"]) == (None, None, None, None)
    assert mean_step_seconds([]) is None
    # the newest snapshot is the final state's only at the final step
    assert run_summary(dataclasses.replace(collected, newest_snapshot=(3, "/s/step-3")))["final_snapshot"] is None
    assert run_summary(dataclasses.replace(collected, newest_snapshot=None))["final_snapshot"] is None
    # step 2's row was lost across an interrupt (logged, so not executed again): named, no row invented
    lost = run_summary(dataclasses.replace(collected, rows=[r for r in rows if r["step"] != 2]))
    assert lost["metrics"] == {"missing_step_count": 1, "missing_steps": [[2, 2]]}


def test_the_final_checkpoint_bytes_are_the_runs_not_the_last_incarnations():
    """A layer-wise run: the first worker committed 100 then 130 bytes and died; the second restored and
    committed nothing before the end, so its ``final`` event says 0 bytes. The summary (and the printed
    ``final`` line, from the same function) says 130, the last incarnation's 0 kept beside it; the
    experiment row counts the bytes once."""
    from raycheck.experiments.results import fo_run_row

    executions = [{"step": 1, "unix_s": 2.0, "checkpoint_bytes": 100}, {"step": 3, "unix_s": 4.0, "checkpoint_bytes": 130},
                  {"step": 4, "unix_s": 20.0, "checkpoint_bytes": 0}, {"step": 5, "unix_s": 21.0, "checkpoint_bytes": 0}]
    events = [{"kind": "failure", "target": "worker", "step": 4, "how": "exit", "durable_steps": 4, "unix_s": 5.0},
              {"kind": "recovery", "unix_s": 19.0, "at_step": 4, "restored_step": 4, "source": "storage", "base_step": 4,
               "replayed_steps": 0, "seconds": 1.0, "load_seconds": 0.9, "replay_seconds": 0.0},
              {"kind": "final", "step": 6, "state_sha256": "ab", "checkpoints": {"checkpoints": 0, "bytes": 0, "last_step": None}}]
    assert run_checkpoints(events[-1]["checkpoints"], executions, events) == {
        "checkpoints": 0, "bytes": 130, "incarnation_bytes": 0, "last_step": None}
    assert run_checkpoints(None, executions, events) is None
    rows = [{**r, "step_seconds": 1.0, "checkpoint_block_seconds": 0.0, "log_append_seconds": 0.0, "loss": 1.0} for r in executions]
    collected = Collected(ok=True, error=None, events=events, executions=rows, rows=rows, shadow={}, persisted={}, mirror={},
                          keeper=None, durability_level="process", task="classification", base={})
    summary = run_summary(collected)
    assert summary["worker_checkpoints"]["bytes"] == 130 and summary["worker_checkpoints"]["incarnation_bytes"] == 0
    summary.update(strategy="layerwise", wall_seconds=30.0, config={"run_id": "r", "model": "tiny", "steps": 6,
                                                                    "snapshot": {"every_steps": 2}})
    assert fo_run_row(summary, rows, events, [])["bytes_written"] == 130  # not 260


def test_the_steps_of_the_log_without_a_metrics_row_are_counted_and_named_as_ranges():
    rows = [{"step": s} for s in (0, 1, 3, 7, 8)]
    coverage = metric_coverage(10, rows)
    assert coverage == {"missing_step_count": 5, "missing_steps": [[2, 2], [4, 6], [9, 9]]}
    assert missing_steps_line(coverage).endswith(": 2, 4..6, 9")
    assert metric_coverage(2, rows) == {"missing_step_count": 0, "missing_steps": []}
    assert missing_steps_line(metric_coverage(2, rows)) is None and metric_coverage(0, []) == metric_coverage(2, rows)


def test_the_failed_summary_is_a_pure_function_of_the_error_the_shadow_and_the_base():
    shards = [{"shard": 0, "step": 7}]
    base = {"phase": "failed", "persister_restarts": 2}
    assert failed_summary("PersisterFailedError: budget spent", shards, base) == {
        "ok": False, "error": "PersisterFailedError: budget spent", "final_step": None, "state_sha256": None,
        "shadow_equal": None, "bitwise_equal": None, "shadow_shards": [{"shard": 0, "step": 7}],
        "phase": "failed", "persister_restarts": 2}
    assert list(failed_summary("E: x", None, base))[-2:] == ["phase", "persister_restarts"]
