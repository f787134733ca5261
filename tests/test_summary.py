"""``orchestrator.summary.recoveries``: each recovery's timings and the work it lost or must redo."""

from orchestrator.summary import recoveries


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
