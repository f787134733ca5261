"""What a run shows (``orchestrator.console``): event sentences, the step lines' cadence, Ray's raylet
messages about injected failures held back, and the closing summary table. Pure logic: no Ray."""

from __future__ import annotations

import io

from raycheck.orchestrator.console import (InjectedFailureMessages, RunConsole, describe, event_line, injected_pids,
                                           summary_table)

FAILURE = {"kind": "failure", "unix_s": 10.0, "step": 20, "target": "worker", "how": "exit", "rank": 0, "durable_steps": 20,
           "marker": "m", "pid": 4242}
RECOVERY = {"kind": "recovery", "unix_s": 15.0, "rank": 0, "at_step": 20, "restored_step": 20, "path": "new_process", "pid": 5151,
            "source": "storage", "base_step": 16, "replayed_steps": 4, "seconds": 0.41234, "load_seconds": 0.2}


def row(step: int, seconds: float = 2.0) -> dict:
    return {"step": step, "loss": 0.5, "step_seconds": seconds, "checkpoint_block_seconds": 0.004}


def test_verbose_event_lines_print_floats_to_3_significant_digits_and_leave_the_event_whole():
    event = {"kind": "recovery", "unix_s": 1.5, "step": 7, "load_seconds": 0.03001784600019164, "seconds": 0.41234,
             "source": "snapshot", "bytes": 123456, "wall_s": 12345.678, "exact": True, "inputs": {"a": 0.123456}}
    assert event_line(event, 2.000123) == ("[raycheck] recovery: step=7, load_seconds=0.03, source=snapshot, bytes=123456, "
                                           "wall_s=12346, exact=True, restore_seconds=0.412, seconds=2")
    assert event["load_seconds"] == 0.03001784600019164 and event["seconds"] == 0.41234  # events.jsonl keeps every digit
    assert event_line({"kind": "failure", "unix_s": 2.0, "step": 3, "target": "worker", "lr": 1e-06}) == (
        "[raycheck] failure: step=3, target=worker, lr=1e-06")


def test_events_read_as_sentences_and_bookkeeping_events_show_only_with_verbose():
    assert describe(FAILURE) == "[raycheck] worker 0 failed after step 20 (injected: exit); 20 steps durable"
    assert describe(RECOVERY, 5.234) == ("[raycheck] worker 0 restored at step 20 from the snapshot of step 16 + 4 logged steps "
                                         "replayed in a new process, 5.2 s after the failure")
    assert describe({**RECOVERY, "source": "object_store", "replayed_steps": 0, "path": "standby"}, None) == (
        "[raycheck] worker 0 restored at step 20 from the shadow's image in the warm standby, restore took 0.41 s")
    damaged = {**RECOVERY, "skipped": ["snapshot step-0000000018-ab: unit embed, sha256 differs (corrupt)", "x"]}
    assert describe(damaged, 5.234) == ("[raycheck] worker 0 restored at step 20 from the snapshot of step 16 + 4 logged steps "
                                        "replayed in a new process, 5.2 s after the failure; passed over: snapshot "
                                        "step-0000000018-ab: unit embed, sha256 differs (corrupt) (and 1 more)")
    loading = {**RECOVERY, "source": "object_store", "replayed_steps": 0, "path": "standby", "detected_unix_s": 10.0,
               "standby_loaded_unix_s": 13.5}
    assert describe(loading, 4.0) == ("[raycheck] worker 0 restored at step 20 from the shadow's image in the warm standby "
                                      "(still loading: 3.5 s more), 4.0 s after the failure")
    decision = {"kind": "standby_decision", "keep": False, "reason": "warm standby off: it would hold 2 GiB"}
    assert describe({**decision, "rank": 0}) == describe(decision) == "[raycheck] warm standby off: it would hold 2 GiB"
    assert describe({**decision, "rank": 1}) == "[raycheck] worker 1: warm standby off: it would hold 2 GiB"
    assert describe({"kind": "shadow_restart", "step": 30, "source": "snapshot", "seconds": 3.05, "reason": "ActorDiedError"}) == (
        "[raycheck] shadow restarted at step 30 from the snapshot of step 30 in 3.0 s (ActorDiedError)")
    assert describe({"kind": "failure", "step": 5, "target": "storage", "seconds": 90.0}) == (
        "[raycheck] storage down for 1.5 min after step 5 (injected outage)")
    for quiet in ({"kind": "phase", "phase": "running"}, {"kind": "placement", "component": "worker", "rank": 0, "pid": 1},
                  {"kind": "step_log", "local_steps": 4, "rebuilt_steps": 0, "sent_steps": 0, "discarded": None}):
        assert describe(quiet) is None, quiet
    assert describe({"kind": "step_log", "local_steps": 4, "rebuilt_steps": 2, "sent_steps": 0, "discarded": None}) == (
        "[raycheck] rank 0's local step log (4 steps): 2 steps copied from the log keeper")
    raised = {"rank": 0, "step": 3, "error": "TypeError: unsupported operand"}  # what raised is named, not only the recovery
    assert describe({"kind": "in_process_restart", **raised, "reason": "in-process restart 1 of 3"}) == (
        "[raycheck] worker 0's step 3 raised TypeError: unsupported operand: rolled back in the same process (in-process restart 1 of 3)")
    assert describe({"kind": "in_process_refused", **raised, "reason": "2 workers: ..."}) == (
        "[raycheck] worker 0's step 3 raised TypeError: unsupported operand: no restart in the same process (2 workers: ...)")


def test_plain_step_lines_come_every_5_percent_and_at_the_first_step_after_a_restore():
    lines: list[str] = []
    console = RunConsole(lines.append, bar=False, plain_lines=4)  # every 10 of 40 steps
    console.begin(40)
    for step in range(40):
        console.step(row(step), shadow_lag=1)
        if step == 21:
            console.event(FAILURE)
            console.event({"kind": "phase", "phase": "recovering"})
            console.event(RECOVERY, 5.2)
    steps = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step ")]
    assert steps == [1, 10, 20, 23, 30, 40]
    assert lines[0] == "step    1/40    2%  loss 0.5000  2.00 s/step  checkpoint stall 4 ms  shadow 1 behind"  # no ETA from a first step
    assert lines[1].endswith("shadow 1 behind  ETA 1 min")  # 30 steps left at the 2 s of steps 2..10
    assert lines[-1].endswith("shadow 1 behind")  # the last step has no ETA
    assert sum(line.startswith("[raycheck]") for line in lines) == 2  # the failure and the recovery; not the phase


def test_verbose_shows_every_step_and_every_event_in_detail():
    lines: list[str] = []
    console = RunConsole(lines.append, verbose=True, bar=False)
    console.begin(3)
    for step in range(3):
        console.step(row(step))
    console.event({"kind": "phase", "phase": "running", "unix_s": 1.0})
    assert [line.split()[1] for line in lines[:3]] == ["1/3", "2/3", "3/3"]
    assert lines[3] == "[raycheck] phase: phase=running"


def test_the_bar_draws_on_its_stream_and_lines_go_above_it():
    stream = io.StringIO()
    console = RunConsole(bar=True, file=stream)
    console.begin(4, done=1)
    console.step(row(1))
    console("[raycheck] a line")
    console.end()
    text = stream.getvalue()
    assert "[raycheck] a line" in text and "2/4" in text and "ETA" in text
    assert console.progress is None


def test_raylet_messages_about_injected_processes_are_held_back_and_others_are_printed():
    printed: list[tuple[str, bool]] = []
    messages = InjectedFailureMessages(hold_s=3600.0)
    messages.original = lambda data, ignore_prefix: printed.append((data["lines"][0], ignore_prefix))  # Ray's printer, recorded
    died = {"pid": "raylet", "lines": ["A worker died or was killed ... Worker PID: 4242"]}
    other = {"pid": "raylet", "lines": ["A worker died or was killed ... Worker PID: 7"]}
    messages.take({"pid": 99, "lines": ["a worker's own line"]}, False)
    messages.take(died, False)
    messages.take(other, True)
    assert printed == [("a worker's own line", False)]  # raylet text is held until its process is known
    messages.release({4242})
    assert printed == [("a worker's own line", False)] and len(messages.held) == 1  # the injected one is dropped
    messages.uninstall({4242})
    assert printed == [("a worker's own line", False), (other["lines"][0], True)] and messages.held == []


def test_injected_pids_are_the_failure_pid_and_the_rank_s_latest_placement_before_it():
    events = [{"kind": "placement", "component": "worker", "rank": 1, "pid": 10},
              {"kind": "placement", "component": "worker", "rank": 1, "pid": 11},
              {"kind": "failure", "target": "worker", "rank": 1, "step": 4},
              {"kind": "placement", "component": "worker", "rank": 1, "pid": 12},
              {"kind": "failure", "target": "shadow", "step": 6},
              FAILURE]
    assert injected_pids(events) == {11, 4242}


def test_the_summary_table_says_exact_or_not_and_lists_failures_and_recoveries():
    summary = {"ok": True, "final_step": 50, "bitwise_equal": True, "shadow_equal": True, "lost_steps": 0, "state_sha256": "ab" * 32,
               "failures": [{"target": "worker", "step": 20, "how": "exit"}, {"target": "shadow", "step": 30}],
               "recoveries": [{"restored_step": 20, "source": "object_store", "base_step": 20, "replayed_steps": 0,
                               "path": "new_process", "seconds": 18.1, "restore_seconds": 0.12}],
               "shadow_restarts": [{}], "persister_restarts": 0, "mean_step_seconds": 2.0, "mean_checkpoint_block_seconds": 0.01,
               "accuracy_before": 0.5, "accuracy_after": 0.56, "wall_seconds": 300.0}
    lines = summary_table(summary, {}, "runs/x")
    assert lines[0] == "raycheck run finished: 50 steps, recovery exact: bitwise equal to the failure-free run"
    assert lines[1:] == [
        "  exact       0 steps lost; the shadow's state equals the worker's; the failure-free run's state equals this one's; "
        "state sha256 abababababababab",
        "  failures    worker after step 20 (exit), shadow after step 30",
        "  recoveries  step 20 from the shadow's image in a new process, 18.1 s after the failure",
        "  restarts    shadow 1, snapshot persister 0, driver resumes 0",
        "  step time   2 s mean, plus 10 ms checkpointing blocked the loop (0.5 % of its time)",
        "  accuracy    0.500 before, 0.560 after",
        "  wall time   5 min",
        "  results     runs/x/summary.json, runs/x/metrics.parquet"]
    assert "NOT exact" in summary_table({**summary, "bitwise_equal": False}, {}, "o")[0]
    reported = {"path": "runs/x/ray_train/raycheck-x/step-0000000050-ab", "snapshot": "runs/x/snapshots/step-0000000050-ab", "step": 50}
    assert summary_table({**summary, "ray_train_checkpoint": reported}, {}, "runs/x")[-2:] == [
        "  checkpoint  Ray Train's Result.checkpoint (step 50): runs/x/ray_train/raycheck-x/step-0000000050-ab",
        "  results     runs/x/summary.json, runs/x/metrics.parquet"]
    failed = summary_table({"ok": False}, {"error": "boom", "phase": "failed", "logged_steps": 3, "resume": "raycheck run --resume --out o"}, "o")
    assert failed[:4] == ["raycheck run failed", "  error     boom", "  phase     failed", "  step log  3 steps, all recoverable"]


def test_a_preemption_reads_as_a_notice_what_was_saved_and_when_not_as_a_failure():
    notice = {"kind": "failure", "target": "preempt", "how": "10", "step": 4, "node_id": "abcdef0123", "grace_s": 10.0}
    assert describe(notice) == "[raycheck] preemption notice for rank 0's node after step 4: drained, taken down in 10 s (injected)"
    assert describe({"kind": "preemption_notice", "node_id": "abcdef0123", "components": ["shadow 0", "persister"], "grace_s": 9.6}) == (
        "[raycheck] preemption notice: node abcdef01 (shadow 0, persister) goes in 10 s")
    assert describe({"kind": "preemption_saved", "component": "workers", "step": 6, "seconds": 1.24}) == (
        "[raycheck] preemption: the train workers' checkpoint of step 6 is safe (1.2 s)")
    assert describe({"kind": "persister_restart", "reason": "preemption", "seconds": 7.4}) == "[raycheck] snapshot persister moved off a draining node in 7.4 s"
    summary = {"ok": True, "final_step": 12, "lost_steps": 0, "state_sha256": "ab" * 32, "failures": [], "recoveries": [],
               "preemptions": [{"node_id": "abcdef0123", "components": ["workers"], "grace_s": 10.2, "unsaved": [],
                                "saved": [{"component": "workers", "step": 6, "notice_to_safe_seconds": 1.7}], "recomputed_steps": 0},
                               {"node_id": "0123456789", "components": ["workers"], "grace_s": 0.0, "saved": [],
                                "unsaved": [{"component": "workers"}], "recomputed_steps": 2}]}
    rows = [line for line in summary_table(summary, {}, "o") if "node " in line]
    assert rows == ["  preemption  node abcdef01 (workers), 10 s notice: workers safe in 1.7 s, 0 steps redone",
                    "              node 01234567 (workers), 0 s notice: nothing saved, workers not saved, 2 steps redone"]
