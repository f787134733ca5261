"""The controller: starts the log keeper, shadow and persister, runs Ray Train, watches, repairs, summarises.

The driver runs ``TorchTrainer.fit`` (``orchestrator.trainer``) on a thread and, on its own thread,
loops every 0.5 s: it polls the shadow keeper, the persister and the log keeper (``orchestrator.components``),
drains the run's event and metric streams (from the run's journal actor into the run directory, which
only the driver writes: ``orchestrator.journal``), feeds the new steps to the snapshot planner
(``orchestrator.planning``) and shows them (``orchestrator.follow``), bundles what it saw into an
``orchestrator.control.Observation`` of frozen snapshots, and carries out what ``orchestrator.control.step``
decides: phase events, the restart of a dead shadow shard (from the newest snapshot plus the log tail,
once no worker recovery needs it) or of a dead persister, each within its budget, the snapshot
policy's re-plans and calibration snapshot, or the end of the run (``FAILURES``: the error of a
component beyond repair). The shell decides nothing itself. The states (``orchestrator.control``): Initialising -> Running <-> Recovering ->
Finished | Failed. At the end it compares the shadow's state hash with the worker's and writes
``summary.json`` (``orchestrator.summary.run_summary``).

Durability never depends on Ray Train's checkpoint registration (a hard crash can drop the newest
reported checkpoint): workers restore from the shadow or from storage + the step log themselves.
The step log's replica is the log keeper (``actors.log_keeper``), pinned to the driver's node over
the run directory's ``steplog.bin``; it mirrors the log to remote storage and, on a resume whose run
directory lost its log, starts from the segments there. The configuration is put in the run's
storage too (``orchestrator.stored_config``), and the failures due before the durable step count
as fired (``workers.faults.fired_before``), so a driver with an empty run directory resumes from
the storage alone (``raycheck run --resume --storage URI``). A keeper that dies fails the run
(``LogKeeperFailedError``, with its summary): its file and rank 0's local log keep every step.

Storage at start: the driver claims its writer epoch in the snapshot index before anything runs
(``SnapshotStore.claim_epoch``, which fences writers of older incarnations), so a run whose storage
is unreachable at start does not start (``raycheck run`` refuses it with exit 2 after its probe; if
storage goes in between, the claim fails the run). Once claimed, an outage is ridden out: the
persister, even one (re)started during it, reports it and retries; a dead persister is restarted at
most ``JobConfig.faults.max_persister_restarts`` times (``orchestrator.control.persister_action``). The train
workers' restart budget, ``JobConfig.faults.max_worker_failures``, is Ray Train's (``FailureConfig``).
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from raycheck.actors.journal import RunChannel
from raycheck.actors.shadow import ShadowSpec
from raycheck.job.config import JobConfig
from raycheck.job.names import log_keeper_name, persister_name
from raycheck.job.run_dir import RunDir
from raycheck.job.stores import checkpoint_store, snapshot_store
from raycheck.orchestrator.cluster import Placement, alive_nodes, connect, plan_placement
from raycheck.orchestrator.components import (ComponentStartError, LogKeeperFailedError, LogKeeperHandle, PersisterFailedError,
                                              PersisterHandle)
from raycheck.orchestrator.console import InjectedFailureMessages, RunConsole, injected_pids, one_line
from raycheck.orchestrator.control import (Action, EmitPhase, Failed, FailRun, HandOffShadow, Initialising, Limits, MovePersister,
                                           Observation, Phase, PlanStatus, RecordNotice, RecordReplan, ReportInfeasible, RestartPersister,
                                           RestartShadow, SetInterval, State, Stop, TakeSnapshot, component_actions, plan_actions, step,
                                           worker_group_status)
from raycheck.orchestrator.follow import RunFollower
from raycheck.orchestrator.journal import RunRecord, claims_in, start_journal, wait_for_previous_driver
from raycheck.orchestrator.metrics import RunMetrics
from raycheck.orchestrator.planning import SnapshotPlanner
from raycheck.orchestrator.preemption import DrainWatch, held_by_node
from raycheck.orchestrator.prepare import ClusterTooSmallError, check_node_failures, prepare
from raycheck.orchestrator.shadow_keeper import ShadowFailedError, ShadowKeeper
from raycheck.orchestrator.stored_config import store_config
from raycheck.orchestrator.summary import (Collected, failed_summary, mean_step_seconds, placement_record, run_summary, summary_base,
                                           write_metrics)
from raycheck.orchestrator.trainer import Fit, ray_train_uri, trainer
from raycheck.storage.backend import node_local
from raycheck.storage.steplog import read_header
from raycheck.training.assets import Assets, read_assets, ship
from raycheck.training.model import default_cache_dir, is_builtin
from raycheck.training.node import this_node
from raycheck.workers.faults import fired_before
from raycheck.workers.train_reports import checkpoint_record

log = logging.getLogger(__name__)

STORAGE_OUTAGE_NEEDS_SERVER = (
    "storage failures stop the S3 server, so they need a server that raycheck owns: the tests, and programs that "
    "pass Controller(storage_outage=LocalS3Server(...).outage) (experiments/s3_server.py); use another failure target")


class WorkerCodeError(RuntimeError):
    """A worker's code broke a rule that every restart would meet again (``workers.zo_session.CodeError``)."""


FAILURES: dict[str, type[RuntimeError]] = {"shadow": ShadowFailedError, "persister": PersisterFailedError,
                                           "log_keeper": LogKeeperFailedError, "worker_code": WorkerCodeError}
"""The error of a run that ``orchestrator.control.FailRun`` ends, by component."""

EXPECTED_FAILURES = (ShadowFailedError, PersisterFailedError, LogKeeperFailedError, WorkerCodeError, ComponentStartError, ClusterTooSmallError)
"""Failures a run is built to report (a restart budget spent): their message says it all."""


def log_failure(exc: BaseException) -> None:
    """Log why a run failed: one error line for an ``EXPECTED_FAILURES`` one (its traceback at debug
    level, shown with ``--verbose``); the error with its traceback for anything else. An interrupt
    (Ctrl-C) is one warning line: the caller says how to resume."""
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (orchestrator.signals.Terminated: "stopped by SIGTERM")
        log.warning("the run was %s", str(exc) or "interrupted (Ctrl-C)")
        log.debug("the run was interrupted: traceback", exc_info=exc)
    elif isinstance(exc, EXPECTED_FAILURES):
        log.error("the run failed: %s", exc)
        log.debug("the run failed: traceback", exc_info=exc)
    else:
        log.error("the run failed", exc_info=exc)



class Controller:
    """One run of ``cfg``. ``run()`` returns the summary dict (also written to ``summary.json``).

    Args:
        cfg: the job configuration.
        echo: where progress lines go (default ``print``), or the ``orchestrator.console.RunConsole``
            that shows them (its progress bar, its ``verbose`` detail).
        storage_outage: takes the snapshot storage down for the given seconds and returns at once
            (e.g. ``experiments.s3_server.LocalS3Server.outage``); required by ``storage`` failures.
        assets: what ``training.assets.read_assets`` returned for ``cfg`` (read here when None).

    Raises:
        ValueError: ``cfg`` has a storage failure and no ``storage_outage`` is given.
    """

    def __init__(self, cfg: JobConfig, echo: Callable[[str], None] | RunConsole = print,
                 storage_outage: Callable[[float], None] | None = None, assets: Assets | None = None) -> None:
        if storage_outage is None and any(f.target == "storage" for f in cfg.faults.failures):
            raise ValueError(STORAGE_OUTAGE_NEEDS_SERVER)
        if assets is None:  # read and checked here, on the driver, before anything starts
            cfg, assets = read_assets(cfg)
        self.cfg, self.assets = cfg, assets
        self.shipped: dict = {}
        """The assets in Ray's object store (``training.assets.ship``), once connected."""
        self.run_dir = RunDir(pathlib.Path(cfg.out_dir))
        self.channel = RunChannel(cfg)
        self.journal: Any = None  # the journal actor's handle once started
        self.fit: Fit | None = None  # Ray Train's fit, once started
        self.record = RunRecord(self.run_dir)
        self.echo = self.console = echo if isinstance(echo, RunConsole) else RunConsole(echo)
        self.ray_messages = InjectedFailureMessages()
        self.metrics = RunMetrics(cfg.run_id, cfg.strategy)
        self.follower = RunFollower(self.record, self.console, self.metrics, storage_outage)
        self.state: State = Initialising()
        """Where the run stands (``orchestrator.control``); ``phase`` is its phase."""
        self.planner = SnapshotPlanner(cfg.snapshot.mtbf_s) if cfg.snapshot.policy == "adaptive" else None  # a shadow's (JobConfig)
        self.placement: Placement | None = None
        self.driver_node: dict | None = None
        self.shadow: ShadowKeeper | None = None
        self.persister: PersisterHandle | None = None
        self.log_keeper: LogKeeperHandle | None = None
        self.drains = DrainWatch()
        self.config_stored = False
        """Whether this start put the configuration in the run's remote storage (``store_config``)."""
        self._restarts_before = 0
        saved = RunDir.read_json(self.run_dir.controller_state)
        if saved is not None and saved.get("run_id") == cfg.run_id:  # a resume: go on with what was measured and counted
            self.load_state_dict(saved)

    def state_dict(self) -> dict:
        """What the driver measured and counted that a resumed driver goes on with (saved as
        ``controller.json`` in the run directory as steps come in): the snapshot planner's
        ``state_dict`` (its measured costs, the interval in force, its re-plans, the newest step fed), the
        snapshot persister's restarts (its budget, ``faults.max_persister_restarts``, is the run's, not each
        driver's). The workers' failures are counted from the events."""
        return {"run_id": self.cfg.run_id, "planner": self.planner.state_dict() if self.planner else None,
                "persister_restarts": self.persister_restarts}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state_dict``'s ``state`` of an earlier driver of this run."""
        if self.planner is not None and state.get("planner") is not None:
            self.planner.load_state_dict(state["planner"])
        self._restarts_before = state["persister_restarts"]

    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def persister_restarts(self) -> int:
        """Restarts of the snapshot persister in this run, over all its drivers."""
        return self.persister.restarts if self.persister is not None else self._restarts_before

    @property
    def limits(self) -> Limits:
        """The run's restart budgets."""
        cfg = self.cfg
        return Limits(cfg.faults.max_shadow_restarts, cfg.faults.max_persister_restarts, cfg.faults.max_worker_failures)

    def _interval_at(self, step: int) -> int:
        """The snapshot interval planned at ``step``, in steps."""
        return self.planner.interval_at(step) if self.planner is not None else self.cfg.snapshot.every_steps

    def _shadow_spec(self) -> ShadowSpec:
        cfg = self.cfg
        return ShadowSpec(
            model=cfg.model, cache_dir=cfg.cache_dir, dtype=cfg.dtype, log_keeper_name=log_keeper_name(cfg), store=snapshot_store(cfg),
            persister_name=persister_name(cfg), snapshot_every_steps=self.planner.every_steps if self.planner else cfg.snapshot.every_steps,
            hash_every=cfg.hash_every_steps, layout=read_header(self.run_dir.step_log)["layout"], shipped=self.shipped,
            threads=cfg.placement.shadow_threads,
        )

    def run(self) -> dict:
        """Run the job; returns the summary, also written to ``summary.json``.

        Once ``prepare`` has claimed the run directory, whatever fails inside the run (an exception,
        a shadow past its restart budget, an interrupt) ends with a summary (``ok`` false, ``error``,
        phase ``failed``) and with this run's shadow and persister killed; an interrupt is re-raised.
        The summary is made before any Ray call of the failure path and written even when one of those
        calls is interrupted again (a second Ctrl-C, or ``timeout -s INT``, which signals the driver twice).

        Raises:
            ResumeMismatchError: the run directory holds another trajectory's step log (nothing written).
        """
        self.t_start = time.time()
        self.run_dir.root.mkdir(parents=True, exist_ok=True)
        first_use = is_builtin(self.cfg.model) and not (pathlib.Path(self.cfg.cache_dir or default_cache_dir()) / self.cfg.model).is_dir()
        self.echo(f"[raycheck] preparing {self.cfg.model}{' (converted once, on this first use)' if first_use else ''} in {self.run_dir.root}")
        prepare(self.cfg, self.run_dir, self.assets.own.model if self.assets.own is not None else None)
        summary = None
        try:
            summary = self._run()
        except BaseException as exc:  # the run directory always gets a summary
            log_failure(exc)
            summary = self._failure_summary(exc)
            self.run_dir.write_json(self.run_dir.root / "summary.json", summary)  # before any Ray call: SIGKILL follows SIGTERM
            self._announce_failure(summary)
            if not isinstance(exc, Exception):
                raise
        finally:
            self.console.end()
            try:
                self._kill_actors()
            finally:
                self.ray_messages.uninstall(injected_pids(self.record.events))
                if summary is not None:
                    self.run_dir.write_json(self.run_dir.root / "summary.json", summary)
        return summary

    def _run(self) -> dict:
        cfg = self.cfg
        self.cfg = cfg = cfg.replace(writer_epoch=snapshot_store(cfg).claim_epoch())  # fences older incarnations
        if cfg.storage.remote:  # beside the log segments: --resume --storage URI needs nothing else
            self.config_stored = store_config(cfg)
        connect(cfg.namespace, num_cpus=max(2, cfg.workers))
        self.ray_messages.install()
        self.shipped = ship(self.assets)
        self.driver_node, driver_id = this_node(), ray.get_runtime_context().get_node_id()
        nodes = alive_nodes()
        self.placement = placement = plan_placement(nodes, driver_node_id=driver_id, workers=cfg.workers,
                                                    use_gpu=cfg.device == "cuda", worker_resource=cfg.placement.worker_resource,
                                                    replica_resource=cfg.placement.shadow_resource)
        if len(nodes) > 1 and node_local(ray_train_uri(cfg)):
            self.echo(f"[raycheck] Ray Train's storage {ray_train_uri(cfg)} is this machine's disk: workers on the cluster's "
                      "other nodes report no checkpoint to it (Result.checkpoint stays empty; the snapshots are in the run's "
                      "storage). Give --ray-train-storage s3://BUCKET/PREFIX for Ray Train to list them")
        wait_for_previous_driver(cfg, echo=self.echo)  # a resume right after its driver died: Ray is removing its actors
        self.journal = start_journal(cfg, claims_in(self.record.events))  # a failure that fired before stays fired
        # start-ups overlap: the persister starts while the log keeper is awaited, the shadow (after the
        # node-failure check, which needs the durable steps) while the persister is; one that cannot
        # start ends the run (_kill_actors stops the others)
        if cfg.uses_step_log:
            self.log_keeper = LogKeeperHandle(cfg, self.run_dir, self.channel)
        self.persister = PersisterHandle(cfg, placement, self.channel, self._persister_answered, restarts=self._restarts_before)
        durable = self.log_keeper.await_ready() if self.log_keeper is not None else 0
        fired = fired_before(cfg.faults.failures, durable)  # even when the run directory was lost
        ray.get(self.journal.seed.remote(fired))
        check_node_failures(cfg, nodes, driver_id, fired=[*claims_in(self.record.events), *fired])
        if cfg.uses_shadow:
            self.shadow = ShadowKeeper(cfg, self.channel, self._shadow_spec(), placement=placement.replica)
            self.shadow.start()
        if durable or self.record.events:  # a driver re-run of the same run id: the workers restore
            rows = self.record.metrics
            self.channel.event("resume", durable_steps=durable, last_step_unix_s=rows[-1]["unix_s"] if rows else None)
        self.persister.await_ready()
        if self.shadow is not None:
            self.echo(f"[raycheck] shadow ready at step {self.shadow.wait_ready(timeout_s=cfg.faults.start_timeout_s)['step']}")
        self.echo(f"[raycheck] {f'resuming after step {durable} of' if durable else 'training'} {cfg.steps} steps "
                  f"({cfg.algo}, strategy {cfg.strategy})")
        self.console.begin(cfg.steps, done=len(self.record.metrics))

        if not cfg.supervised:  # a supervised worker records its rank's own decision, by measurement
            self.channel.event("standby_decision", keep=False, reason=f"warm standby off: {cfg.standby_refusal or '--no-warm-standby'}")
        self.fit = fit = Fit(trainer(cfg, self.shipped, placement, self.assets.own.train_loop_per_worker if self.assets.own is not None else None))
        while True:
            self.state, actions = step(self.state, self._observe(fit.running, fit.outcome), self.limits)
            if self._act(actions):
                break
            time.sleep(0.5)
        plan = self._follow()  # what came in after the last observation
        self._act(plan_actions(plan) if plan is not None else ())
        return self._finish(fit.outcome)

    def _persister_answered(self, status: dict) -> None:
        """Publish a persister status (and the step log mirror's) as metrics."""
        self.metrics.storage({**status, **(self.log_keeper.mirror_status() if self.log_keeper else {})}, self.follower.rows_seen)

    def _observe(self, running: bool, outcome: dict) -> Observation:
        """Poll every component (never blocking long) and drain the journal: one ``Observation``.
        ``running`` is sampled before the drain, so that a finished ``fit`` is seen with its events; the
        shadow is polled before the drain, so that a worker failure announced before the shadow was
        killed is seen with it (its restart then waits for the recovery)."""
        assert self.persister is not None  # started before the loop
        shadow = self.shadow.observe() if self.shadow else None
        persister = self.persister.poll()
        keeper = self.log_keeper.poll() if self.log_keeper is not None else None
        plan = self._follow()
        return Observation(workers=worker_group_status(running, outcome, self.record.events), persister=persister,
                           shadow=shadow, log_keeper=keeper, plan=plan, notices=self.drains.poll(self._held_by_node()))

    def _held_by_node(self) -> dict[str, tuple[str, ...]]:
        """Node id -> the run's components on it now (``orchestrator.preemption.held_by_node``)."""
        workers = {e["rank"]: e["node_id"] for e in self.record.events if e["kind"] == "placement" and e["component"] == "worker"}
        shards = [s.status.get("node_id") for s in self.shadow.shards] if self.shadow else []
        persister = self.persister.placed[-1]["node_id"] if self.persister and self.persister.placed else None
        return held_by_node(workers, shards, persister)

    def _follow(self) -> PlanStatus | None:
        """Drain the journal, feed the new steps to the snapshot planner, show new events and steps, and
        save the driver's state when steps came in; returns the plan (None without the adaptive policy)."""
        self.record.drain(self.channel)
        rows, events = self.record.metrics, self.record.events
        plan = None
        if self.planner is not None and self.shadow is not None:  # the adaptive policy plans a shadow's snapshots
            plan = self.planner.observe_rows(rows, events, self.shadow.status, self.persister.status if self.persister else {},
                                             t_start=self.t_start, in_force_steps=self.shadow.interval_steps)
        came_in = len(rows) > self.follower.rows_seen
        self.follower.follow(self.shadow.status.get("step", 0) if self.shadow else None, self._interval_at)
        if came_in or not self.run_dir.controller_state.exists():
            self.run_dir.write_json(self.run_dir.controller_state, self.state_dict())
        self.ray_messages.release(injected_pids(events))
        return plan

    def _act(self, actions: tuple[Action, ...]) -> bool:
        """Execute ``actions`` (``orchestrator.control.step``'s) in order; returns whether one was ``Stop``.

        Raises:
            ShadowFailedError, PersisterFailedError, LogKeeperFailedError: a ``FailRun`` of that component.
        """
        for action in actions:
            if isinstance(action, EmitPhase):  # every transition is an event (and a progress line)
                self.channel.event("phase", phase=action.phase.value)
            elif isinstance(action, RestartShadow) and self.shadow is not None:  # decided from the shadow's status
                self.shadow.restart(action.shard)
            elif isinstance(action, RestartPersister) and self.persister is not None:
                if self.persister.restart(action.reason) and action.snapshot and self.shadow is not None:
                    try:
                        self.shadow.snapshot_now(timeout_s=600)
                    except (RayActorError, GetTimeoutError) as err:  # a dead shadow is restarted by its keeper
                        log.warning("the shadow could not snapshot after the persister restart (%s); the next planned "
                                    "snapshot will be taken", one_line(err))
            elif isinstance(action, RecordReplan):
                self.channel.event("replan", **action.record.to_dict())
            elif isinstance(action, SetInterval) and self.shadow is not None:
                self.shadow.set_interval(action.every_steps)
            elif isinstance(action, ReportInfeasible):
                self.channel.event("plan_infeasible", step=action.plan.step, interval_steps=action.plan.interval_steps,
                                   reason=action.plan.reason)
            elif isinstance(action, TakeSnapshot) and self.shadow is not None and self.planner is not None:
                self.planner.calibration_requested = True
                self.shadow.snapshot_now(timeout_s=None)
                self.channel.event("calibration_snapshot", step=action.step)
            elif isinstance(action, RecordNotice):
                n = action.notice
                self.channel.event("preemption_notice", node_id=n.node_id, deadline_unix_s=n.deadline_unix_s, grace_s=n.grace_s,
                                   components=list(n.components))
            elif isinstance(action, HandOffShadow) and self.shadow is not None:
                self._hand_off_shadow(action)
            elif isinstance(action, MovePersister) and self.persister is not None:
                self._move_persister(action)
            elif isinstance(action, FailRun):
                raise FAILURES[action.component](action.reason)
        return any(isinstance(action, Stop) for action in actions)

    @staticmethod
    def _time_left(deadline_unix_s: float | None) -> float:
        """Seconds until a notice's deadline (at least 1; 600 without a deadline)."""
        return max(1.0, deadline_unix_s - time.time()) if deadline_unix_s is not None else 600.0

    def _move_persister(self, action: MovePersister) -> None:
        """Carry out ``MovePersister``: its pending write finished (a ``preemption_saved`` event with the newest
        durable step, or ``preemption_unsaved`` when it did not answer in time), then a new persister elsewhere
        (its ``persister_restart`` event, reason ``preemption``)."""
        assert self.persister is not None
        t0, timeout_s = time.time(), self._time_left(action.notice.deadline_unix_s)
        flushed = self.persister.poll("flush", timeout_s, timeout_s=timeout_s + 30)
        done = flushed.died is None and "unavailable" not in self.persister.status and not self.persister.status.get("busy")
        self.channel.event("preemption_saved" if done else "preemption_unsaved", component="persister", node_id=action.notice.node_id,
                           seconds=time.time() - t0, step=self.persister.status.get("last_durable_step"),
                           **({} if done else {"error": "its pending write did not finish before the deadline"}))
        self.persister.move("preemption")

    def _hand_off_shadow(self, action: HandOffShadow) -> None:
        """Carry out ``HandOffShadow``: the shadow's image of now committed by the persister, then the shards on
        the draining node moved (``ShadowKeeper.hand_off``); a ``preemption_saved`` event with the snapshot's
        step, or ``preemption_unsaved`` with why (the shards then restart from the newest snapshot and the
        log tail when the node goes, as after any shadow failure)."""
        assert self.shadow is not None and self.persister is not None
        t0, timeout_s = time.time(), self._time_left(action.notice.deadline_unix_s)
        persister = self.persister
        replayed = self.shadow.status.get("step")

        def committed(step: int) -> int | None:
            deadline = time.monotonic() + timeout_s
            while True:  # the image reaches the persister a moment after the shadow handed it
                persister.poll("flush", timeout_s, timeout_s=timeout_s + 30)
                durable = persister.status.get("last_durable_step")
                if (durable is not None and durable >= step) or time.monotonic() > deadline:
                    return durable
                time.sleep(0.05)

        try:
            step = self.shadow.hand_off(action.shards, committed, timeout_s)
        except (RayActorError, GetTimeoutError) as err:
            self.channel.event("preemption_unsaved", component="shadow", node_id=action.notice.node_id, shards=list(action.shards),
                               error=one_line(err)[:300], seconds=time.time() - t0)
            return
        self.channel.event("preemption_saved", component="shadow", node_id=action.notice.node_id, shards=list(action.shards),
                           step=step, replayed_step=replayed, seconds=time.time() - t0,
                           before_deadline=action.notice.deadline_unix_s is None or time.time() <= action.notice.deadline_unix_s)

    def _flush(self, keeper: bool = True) -> dict:
        """A final flush of the persister (its pending write) and, with ``keeper``, of the log keeper (a
        last mirror round), repairing or failing as ``orchestrator.control.component_actions`` decides;
        returns the persister's status."""
        assert self.persister is not None
        persister = self.persister.poll("flush", 600, timeout_s=660)
        keeper_status = self.log_keeper.poll("flush", timeout_s=660) if keeper and self.log_keeper is not None else None
        self._act(component_actions(self.limits, persister=persister, log_keeper=keeper_status, has_shadow=self.shadow is not None))
        return self.persister.status

    def _kill_actors(self) -> None:
        """Abort Ray Train's fit if it still runs (the run failed first: otherwise it would go on restarting
        workers in this process), then kill this run's shadow (every shard's current incarnation),
        persister, log keeper and journal (after a last drain), whichever were started."""
        if self.fit is not None and self.fit.running and self.journal is not None:
            try:
                handle = ray.get(self.journal.trainer.remote(), timeout=30)
                if handle is not None:
                    ray.get(handle.abort.remote(), timeout=60)
            except RayError:  # abort ends Ray Train's controller process: its call fails as it exits
                pass
        for component in (self.shadow, self.persister, self.log_keeper):
            if component is not None:
                component.kill()
        if self.journal is not None:
            try:  # what came in since the last drain (e.g. a restart during the final checks)
                self.record.drain(self.channel)
            except RayError as exc:
                log.warning("the journal did not answer its last drain (%s)", one_line(exc))
            ray.kill(self.journal, no_restart=True)

    # -- the summary ----------------------------------------------------------------------------
    def _summary_base(self) -> dict:
        """The summary fields known whatever happened (``orchestrator.summary.summary_base``)."""
        shadow = self.shadow
        placement = placement_record(self.placement.policy if self.placement else None, self.driver_node,
                                     self.persister.placed if self.persister else [],
                                     [list(s.placements) for s in shadow.shards] if shadow else None, self.record.events)
        return summary_base(self.cfg, phase=self.phase.value, shadow_restarts=shadow.restarts if shadow else None,
                            persister_restarts=self.persister_restarts, config_stored=self.config_stored,
                            wall_seconds=time.time() - self.t_start, placement=placement)

    def _failure_summary(self, exc: BaseException) -> dict:
        """The summary of a run that raised ``exc``, from what the driver holds (no Ray call): phase
        ``failed``, ``ok`` false, the error (``<ErrorType>: message``, or the type alone for one
        without a message, as an interrupt), and what is known of the shadow (``orchestrator.summary.failed_summary``)."""
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.state = Failed(error)
        return failed_summary(error, self.shadow.shard_figures(None) if self.shadow else None, self._summary_base())

    def _announce_failure(self, summary: dict) -> None:
        """Record the ``phase`` event of a failed run (``_failure_summary``'s ``summary``): through the
        journal while it answers (in time order with the others, written at the last drain), else
        directly (none started, or it died). A Ray call, so it comes after the summary is made."""
        fields = {"phase": summary["phase"], "error": summary["error"][:500]}
        try:
            if self.journal is not None:
                self.channel.event("phase", **fields)
                return
        except RayError as exc:
            log.warning("the journal did not take the phase event (%s)", one_line(exc))
        self.record.write_event("phase", **fields)

    def _finish(self, outcome: dict) -> dict:
        """The end of a run whose ``fit`` returned (``outcome``: ``ok``, ``error``): ``metrics.parquet``,
        the shadow's final figures, the last flushes, and the summary (``orchestrator.summary.run_summary``)."""
        cfg = self.cfg
        intervals = {r["step"]: self._interval_at(r["step"]) for r in self.record.metrics}
        rows = write_metrics(self.record.metrics, {"shadow_lag_steps": self.follower.shadow_lag, "snapshot_interval_steps": intervals},
                             self.run_dir.root / "metrics.parquet")
        lag = max(self.follower.shadow_lag.values(), default=None)
        shadow = self.shadow.finish(outcome.get("ok", False), lambda: self._flush(keeper=False), mean_step_seconds(rows), lag) if self.shadow else {}
        persisted = self._flush()
        return run_summary(Collected(
            ok=outcome.get("ok", False), error=outcome.get("error"), events=self.record.events, executions=self.record.metrics, rows=rows,
            shadow=shadow, persisted=persisted, mirror=self.log_keeper.mirror_status() if self.log_keeper else {},
            keeper=self.log_keeper.status if self.log_keeper else None, durability_level=cfg.durability, task=cfg.data.task,
            base=self._summary_base(), newest_snapshot=self._newest_snapshot(), ray_train_checkpoint=checkpoint_record(outcome.get("checkpoint"), outcome.get("metrics"))))

    def _newest_snapshot(self) -> tuple[int, str] | None:
        """(step, URI) of the newest committed snapshot in the run's storage; None when there is none or the
        storage cannot be read from the driver (it is told in a warning)."""
        try:
            store = checkpoint_store(self.cfg)
            infos = store.list()
        except OSError as exc:
            log.warning("the run's snapshots could not be listed for the summary: %s", one_line(exc))
            return None
        return (infos[-1].step, f"{store.storage.uri.rstrip('/')}/{infos[-1].folder}") if infos else None
