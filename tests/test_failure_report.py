"""How a run that fails is reported, without Ray: one log line for an expected failure (a restart
budget spent), a traceback for anything else, and a failure summary that keeps the restart figures."""

from __future__ import annotations

import logging

from raycheck.actors.journal import RunChannel
from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.orchestrator.console import RunConsole
from raycheck.orchestrator.controller import Controller, log_failure
from raycheck.orchestrator.components import PersisterFailedError
from raycheck.orchestrator.shadow_keeper import ShadowFailedError, ShadowKeeper
from raycheck.storage.steplog import StepLogWriter


def test_an_expected_failure_is_one_line_and_an_unexpected_one_keeps_its_traceback(caplog):
    caplog.set_level(logging.DEBUG, logger="raycheck.orchestrator.controller")
    for exc in (ShadowFailedError("shard 1 failed after 2 restarts"), PersisterFailedError("the persister died")):
        caplog.clear()
        log_failure(exc)
        shown = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [(r.levelname, r.getMessage(), r.exc_info) for r in shown] == [("ERROR", f"the run failed: {exc}", None)]
        assert [r.exc_info[1] for r in caplog.records if r.levelno == logging.DEBUG] == [exc]
    caplog.clear()
    bug = KeyError("step")
    log_failure(bug)
    assert [(r.levelname, r.getMessage(), r.exc_info[1]) for r in caplog.records] == [("ERROR", "the run failed", bug)]


def test_the_failure_summary_keeps_the_shadow_and_persister_figures(tmp_path):
    cfg = JobConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path), model="tiny", steps=6, placement={"shadow_shards": 2})
    controller = Controller(cfg, echo=lambda line: None)
    controller.t_start = 0.0
    StepLogWriter.create(controller.run_dir.step_log, {"layout": [["w", [2], "float32"]]}).close()  # the shadow spec reads it
    controller.shadow = ShadowKeeper(cfg, RunChannel(cfg), controller._shadow_spec())
    controller.shadow.restarts.append({"shard": 1, "seconds": 2.5})
    controller.shadow.shards[1].incarnation = 3
    controller._restarts_before = 1  # an earlier driver of the run restarted its persister once
    summary = controller._failure_summary(ShadowFailedError("shadow shard 1 failed after 3 restarts"))
    assert (summary["ok"], summary["phase"], summary["error"]) == (
        False, "failed", "ShadowFailedError: shadow shard 1 failed after 3 restarts")
    assert summary["shadow_restarts"] == [{"shard": 1, "seconds": 2.5}]
    assert summary["persister_restarts"] == 1
    assert [(s["shard"], s["restarts"]) for s in summary["shadow_shards"]] == [(0, -1), (1, 3)]
    assert RunDir.read(RunDir(tmp_path).events) == []  # made without a Ray call: an interrupt cannot stop it
    controller._announce_failure(summary)
    [phase] = RunDir.read(RunDir(tmp_path).events)  # no journal was started: the driver wrote it itself
    assert (phase["kind"], phase["phase"], phase["error"]) == ("phase", "failed", summary["error"])


def test_the_recovery_progress_line_names_its_times_as_the_summary_does(tmp_path):
    """The worker's ``recovery`` event measures the restore alone (``seconds``); the console's sentence gives, as
    ``summary.json`` does, the seconds from the failure to the restored state, and the ``--verbose`` detail line
    calls the event's own ``restore_seconds``."""
    cfg = JobConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path), model="tiny", steps=6)
    events = [{"kind": "failure", "step": 3, "target": "worker", "durable_steps": 3, "unix_s": 100.0},
              {"kind": "recovery", "at_step": 3, "restored_step": 3, "source": "object_store", "base_step": 3, "replayed_steps": 0,
               "seconds": 0.25, "load_seconds": 0.2, "replay_seconds": 0.0, "unix_s": 117.5}]
    for verbose in (False, True):
        lines: list[str] = []
        controller = Controller(cfg, echo=RunConsole(lines.append, verbose=verbose, bar=False))
        controller.record.drain = lambda channel: None  # the events below are what the journal delivered
        controller.record.events = events
        controller._follow()
        if verbose:
            [recovery] = [line for line in lines if line.startswith("[raycheck] recovery:")]
            assert "restore_seconds=0.25" in recovery and "seconds=17.5" in recovery.replace("restore_seconds=0.25", ""), recovery
        else:
            assert lines == ["[raycheck] worker 0 failed after step 3 (injected); 3 steps durable",
                             "[raycheck] worker 0 restored at step 3 from the shadow's image in a new process, 17.5 s after the failure"]
