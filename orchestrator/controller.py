"""The controller: starts the log keeper, shadow and persister, runs Ray Train, watches, repairs, summarises.

The driver runs ``TorchTrainer.fit`` on a thread and, on its own thread, loops every 0.5 s: it polls
the shadow keeper, the persister and the log keeper, drains the run's event and metric streams (from
the run's journal actor into the run directory, which only the driver writes: ``orchestrator.journal``)
and prints progress, bundles what it saw into an ``orchestrator.control.Observation`` of frozen
snapshots, and executes what ``orchestrator.control.step`` decides: phase events, the restart of a
dead shadow shard (from the newest snapshot plus the log tail, once no worker recovery needs it) or of
a dead persister, each within its budget, or the end of the run (``FAILURES``: the error of a component
beyond repair). The states (``orchestrator.control``): Initialising -> Running <-> Recovering ->
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

import functools
import json
import logging
import pathlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Collection
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError
from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig  # what ray.train exports (Ray Train v2)
from ray.train.v2.torch.torch_trainer import TorchTrainer  # what ray.train.torch exports (Ray Train v2)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycheck.actors.journal import RunChannel
from raycheck.actors.log_keeper import LogKeeperActor
from raycheck.actors.persister import PersisterActor
from raycheck.actors.shadow import ShadowSpec
from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.job.names import exchange_name, log_keeper_name, persister_name
from raycheck.job.stores import snapshot_store
from raycheck.orchestrator.cluster import Node, Placement, alive_nodes, connect, plan_placement, runtime_env, worker_need
from raycheck.orchestrator.console import InjectedFailureMessages, RunConsole, injected_pids, one_line
from raycheck.orchestrator.control import (Action, EmitPhase, Failed, FailRun, Initialising, Limits, LogKeeperStatus, Observation, Phase,
                                           PersisterStatus, RestartPersister, RestartShadow, State, Stop, component_actions, step,
                                           worker_failures_and_recoveries, worker_group_status)
from raycheck.orchestrator.group_timeline import GroupTimeline
from raycheck.orchestrator.journal import RunRecord, claims_in, start_journal, wait_for_previous_driver
from raycheck.orchestrator.metrics import RunMetrics
from raycheck.orchestrator.planning import SnapshotPlanner
from raycheck.orchestrator.replica_groups import ReplicaGroupsConfig
from raycheck.orchestrator.shadow_keeper import ShadowFailedError, ShadowKeeper
from raycheck.orchestrator.stored_config import save_config
from raycheck.orchestrator.summary import (Collected, failed_summary, mean_step_seconds, recoveries, recovery_of_event, run_checkpoints,
                                           run_summary, write_metrics)
from raycheck.storage.backend import STORAGE_ENV, StorageError, StorageUnreachableError
from raycheck.storage.steplog import StepLogCorruptError, StepLogWriter, read_header, read_prefix, trajectory_tag
from raycheck.storage.units import describe_units
from raycheck.training.assets import ASSETS_KEY, Assets, read_assets, ship
from raycheck.training.model import default_cache_dir, is_builtin, layout_sha256, load_model, model_dir, parameter_layout, tokenizer_dir, trainable_parameters
from raycheck.training.node import this_node
from raycheck.training.zo import GENERATOR, ZOHyper, check_dtype, check_generator, check_records
from raycheck.workers.faults import PARTS, fired_before, marker

log = logging.getLogger(__name__)


class PersisterFailedError(RuntimeError):
    """The snapshot persister died more often than ``JobConfig.faults.max_persister_restarts`` allows."""


STORAGE_OUTAGE_NEEDS_SERVER = (
    "storage failures stop the S3 server, so they need a server that raycheck owns: the tests, and programs that "
    "pass Controller(storage_outage=LocalS3Server(...).outage) (experiments/s3_server.py); use another failure target")


class LogKeeperFailedError(RuntimeError):
    """The step log keeper did not start, or died (its log file and rank 0's local log keep the steps)."""


def last_line(exc: BaseException) -> str:
    """The last line of ``exc``'s message (at most 600 characters): for a Ray actor error, the error
    that ended the actor, after its traceback."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1][:600] if lines else ""


class ResumeMismatchError(ValueError):
    """The run directory holds a step log of another trajectory than the configuration's."""


class ComponentStartError(RuntimeError):
    """A component of the run (the snapshot persister, a shadow shard) could not start: it was not
    placed on a node within ``JobConfig.start_timeout_s``, its constructor raised, or it cannot use
    the run's storage from its node."""


def check_node_failures(cfg: JobConfig, nodes: list[Node], driver_node_id: str, fired: Collection[str] = ()) -> None:
    """Refuse ``node`` failures (``workers.faults.take_down_node``) still to fire on a cluster where the
    run could not survive one: rank 0's node must not be the driver's (its loss would end the run), and
    after it is gone another node must host the train workers.

    Args:
        nodes: the alive nodes (``alive_nodes``); driver_node_id: the driver's node.
        fired: the failure markers already claimed (``workers.faults.marker``): a resumed run whose node
            failure fired before is not refused for the node it took down.

    Raises:
        ValueError: ``cfg`` has a ``node`` failure and the cluster has one node, or the driver's node
            can host a train worker, or fewer than two other nodes can.
    """
    node_failures = [f"{f.step}:node" for i, f in enumerate(cfg.faults.failures)
                     if f.target == "node" and not set(marker(i, part) for part in PARTS["node"]) <= set(fired)]
    if not node_failures:
        return
    if len(nodes) < 2:
        raise ValueError(f"failure {node_failures[0]} takes down rank 0's node, which on a one-node cluster is the "
                         "driver's: the run would end with it; use a cluster of several nodes")
    need = worker_need(cfg.device == "cuda", cfg.placement.worker_resource)
    hosts = [n.node_id for n in nodes if n.can_host(need)]
    if driver_node_id in hosts:
        raise ValueError(f"failure {node_failures[0]} would take down the driver's node, which can host a train worker "
                         f"(it offers {need}): start the driver's node without them (ray start --head --num-cpus=0) "
                         "or set --worker-resource to a resource only the other nodes offer")
    if len(hosts) < 2:
        raise ValueError(f"failure {node_failures[0]} takes down rank 0's node, but {len(hosts)} node(s) of {len(nodes)} "
                         f"can host a train worker (each asks {need}): the workers need another node to restart on")


def start_failure(what: str, exc: Exception, timeout_s: float, options: dict) -> ComponentStartError:
    """The error that ends a run whose ``what`` did not start (``exc``: what waiting for it raised;
    ``options``: the placement it asked for)."""
    if isinstance(exc, GetTimeoutError):
        return ComponentStartError(
            f"{what} did not start within {timeout_s:g} s: no alive node could place it (it asks for "
            f"{options or 'no particular node'}); check the cluster's nodes, --shadow-resource and --start-timeout")
    return ComponentStartError(f"{what} could not start: {last_line(exc) or type(exc).__name__}")


def storage_failure(what: str, node: dict, uri: str, cause: BaseException) -> ComponentStartError:
    """The error that ends a run whose ``what`` (on ``node``, ``this_node()``) cannot use storage at ``uri``."""
    return ComponentStartError(
        f"{what} on node {node['node_ip']} ({node['node_id'][:12]}) cannot use storage {uri}: {type(cause).__name__}: "
        f"{str(cause)[:300]}; storage settings reach the processes on other nodes from the driver's environment "
        f"({', '.join(STORAGE_ENV)}): set them there (a credentials file on the driver's machine does not travel)")


FAILURES: dict[str, type[RuntimeError]] = {"shadow": ShadowFailedError, "persister": PersisterFailedError,
                                           "log_keeper": LogKeeperFailedError}
"""The error of a run that ``orchestrator.control.FailRun`` ends, by component."""

EXPECTED_FAILURES = (ShadowFailedError, PersisterFailedError, LogKeeperFailedError, ComponentStartError)
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


def check_resumed_log(cfg: JobConfig, run: RunDir) -> None:
    """Check, reading only the file, that ``run``'s existing step log can be continued by ``cfg``'s run:
    its header's trajectory, run id, seed, generator and dtype, every record's seed and hyper-parameters
    (``training.zo.check_records``) and its records' order (no gap, no step out of order, no corrupt
    record; a torn tail is no damage: it is cut when the log is opened). ``prepare`` runs it, and
    ``raycheck run --resume`` before anything else (the model, the data, Ray), so the error comes at once.

    Raises:
        ResumeMismatchError: the log is another run's or trajectory's.
        training.zo.GeneratorMismatchError, training.zo.DtypeMismatchError: another noise generator or dtype.
        storage.steplog.StepLogGapError, storage.steplog.StepLogCorruptError: the log is damaged (a gap, a
            step out of order, a corrupt record): it cannot be continued.
    """
    header = read_header(run.step_log)
    found = header.get("trajectory_sha256")
    check_dtype(header, cfg.dtype, str(run.step_log))
    if found != cfg.trajectory_sha256():
        raise ResumeMismatchError(f"{run.step_log} belongs to another trajectory ({found}); use a new --out")
    check_generator(header, str(run.step_log))
    if (header.get("run_id"), header.get("run_seed")) != (cfg.run_id, cfg.seed):
        raise ResumeMismatchError(f"{run.step_log} belongs to run {header.get('run_id')} (seed {header.get('run_seed')}), "
                                  f"not to run {cfg.run_id} (seed {cfg.seed}) of {run.root / 'config.json'}; use a new --out")
    prefix = read_prefix(run.step_log)
    try:
        check_records(prefix.records, cfg.seed, str(run.step_log),
                      ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay),
                      trajectory_tag(cfg.run_id, cfg.trajectory_sha256()))
    except StepLogCorruptError as exc:
        raise ResumeMismatchError(str(exc)) from exc
    if prefix.damage is not None:
        raise prefix.damage


def prepare(cfg: JobConfig, run: RunDir) -> None:
    """Convert the model once, save the configuration (``config.json``, for ``--resume``; a resumed run
    saves it again, with the options ``--resume`` took from the command line, e.g. a larger restart
    budget) and create the step log with everything replay needs in its header. An existing step log is
    kept when ``check_resumed_log`` passes (a resumed run: its trajectory, run id, seed and every record's
    seed and hyper-parameters match, and its records are in order), else it raises what that raises
    (``ResumeMismatchError``, ``GeneratorMismatchError``, ``DtypeMismatchError``, or a ``StepLogError``
    for a damaged log); none of them touches ``config.json``."""
    cache_dir = pathlib.Path(cfg.cache_dir) if cfg.cache_dir else None
    tokenizer_dir(cache_dir)
    if is_builtin(cfg.model):
        model_dir(cfg.model, cache_dir)
    if run.step_log.exists():
        check_resumed_log(cfg, run)
        run.write_json(run.root / "config.json", cfg.to_dict())
        return
    run.write_json(run.root / "config.json", cfg.to_dict())
    model = load_model(cfg.model, cache_dir, dtype=cfg.dtype)  # the driver's own copy: a folder is read here only
    units = describe_units(model)
    if not units.recognised:
        log.warning("the unit layout of %s (%s) is not recognised: each module is its own checkpoint unit (%d units)",
                    cfg.model, type(model).__name__, len(units.units))
    layout = parameter_layout(trainable_parameters(model))
    header = {
        "run_id": cfg.run_id,
        "model": cfg.model,
        "model_sha256": cfg.model_sha256,
        "data_sha256": cfg.data.sha256,
        "units_recognised": units.recognised,
        "tied": units.tied,
        "dtype": cfg.dtype,
        "layout": layout,
        "layout_sha256": layout_sha256(layout),
        "generator": GENERATOR,
        "run_seed": cfg.seed,
        "trajectory_sha256": cfg.trajectory_sha256(),
        "log_id": uuid.uuid4().hex,  # this log's incarnation: a node-local copy of an earlier one is not taken for it
    }
    StepLogWriter.create(run.step_log, header).close()


def start_persister(cfg: JobConfig, placement: Placement):
    """Start the run's snapshot persister (named ``persister_name(cfg)``) where ``placement`` puts the
    replicas, with the driver's storage settings (``runtime_env``), writing local snapshots with direct I/O
    unless ``snapshot.persister_direct_io`` is off; returns its handle at once."""
    return ray.remote(PersisterActor).options(
        name=persister_name(cfg), namespace=cfg.namespace, num_cpus=0, max_concurrency=4,
        runtime_env=runtime_env(), **placement.replica,
    ).remote(snapshot_store(cfg, direct=cfg.snapshot.persister_direct_io), priority=cfg.snapshot.persister_priority)


class Controller:
    """One run of ``cfg``. ``run()`` returns the summary dict (also written to ``summary.json``).

    Args:
        cfg: the job configuration.
        echo: where progress lines go (default ``print``), or the ``orchestrator.console.RunConsole``
            that shows them (its progress bar, its ``verbose`` detail).
        storage_outage: takes the snapshot storage down for the given seconds and returns at once
            (e.g. ``experiments.s3_server.LocalS3Server.outage``); required by ``storage`` failures.

    Raises:
        ValueError: ``cfg`` has a storage failure and no ``storage_outage`` is given.
    """

    def __init__(self, cfg: JobConfig, echo: Callable[[str], None] | RunConsole = print,
                 storage_outage: Callable[[float], None] | None = None, assets: Assets | None = None) -> None:
        if storage_outage is None and any(f.target == "storage" for f in cfg.faults.failures):
            raise ValueError(STORAGE_OUTAGE_NEEDS_SERVER)
        self.storage_outage = storage_outage
        if assets is None:  # read and checked here, on the driver, before anything starts
            cfg, assets = read_assets(cfg)
        self.assets = assets
        self.shipped: dict = {}
        """The assets in Ray's object store (``training.assets.ship``), once connected."""
        self.cfg = cfg
        self.run_dir = RunDir(pathlib.Path(cfg.out_dir))
        self.channel = RunChannel(cfg)
        self.journal: Any = None  # the journal actor's handle once started
        self.record = RunRecord(self.run_dir)
        self.echo = self.console = echo if isinstance(echo, RunConsole) else RunConsole(echo)
        self.ray_messages = InjectedFailureMessages()
        self.state: State = Initialising()
        """Where the run stands (``orchestrator.control``); ``phase`` is its phase."""
        self.shadow_lag: dict[int, int] = {}
        self.shadow: ShadowKeeper | None = None
        self.planner = SnapshotPlanner(cfg.snapshot.mtbf_s) if cfg.snapshot.policy == "adaptive" and cfg.uses_shadow else None
        self.snapshot_interval: dict[int, int] = {}
        self.metrics = RunMetrics(cfg.run_id, cfg.strategy)
        self.persister: Any = None  # the persister actor's handle once started
        self.persister_status: dict = {}
        self.persister_restarts = 0
        self.config_stored = False
        """Whether this start put the configuration in the run's remote storage (``_store_config``)."""
        self.placement: Placement | None = None
        self.placed: dict = {"driver": None, "persister": []}
        """Where the driver and each persister incarnation ran (``this_node()``); ``_placement`` adds the rest."""
        self.log_keeper: Any = None  # the log keeper actor's handle once started
        self.log_keeper_status: dict = {}
        self._calibration_requested = False
        self._printed_steps = 0
        self._seen_events = 0
        self._earlier = (len(self.record.events), len(self.record.metrics))
        """The events and metric rows of earlier drivers of this run (a resume): followed, not shown again."""
        saved = RunDir.read_json(self.run_dir.controller_state)
        if saved is not None and saved.get("run_id") == cfg.run_id:  # a resume: go on with what was measured and counted
            self.load_state_dict(saved)

    def state_dict(self) -> dict:
        """What the driver measured and counted that a resumed driver goes on with (saved as
        ``controller.json`` in the run directory as steps come in): the snapshot planner's
        ``state_dict`` (its measured costs, the interval in force, its re-plans), the interval in force at
        each step it observed (so a resumed driver does not observe those steps again), the snapshot persister's
        restarts (its budget, ``faults.max_persister_restarts``, is the run's, not each driver's) and
        whether the calibration snapshot was taken. The workers' failures are counted from the events."""
        return {"run_id": self.cfg.run_id, "planner": self.planner.state_dict() if self.planner else None,
                "snapshot_interval": self.snapshot_interval, "persister_restarts": self.persister_restarts,
                "calibration_requested": self._calibration_requested}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state_dict``'s ``state`` of an earlier driver of this run."""
        if self.planner is not None and state.get("planner") is not None:
            self.planner.load_state_dict(state["planner"])
        self.snapshot_interval = {int(step): k for step, k in state["snapshot_interval"].items()}  # JSON keys are strings
        self.persister_restarts = state["persister_restarts"]
        self._calibration_requested = state["calibration_requested"]

    @property
    def phase(self) -> Phase:
        return self.state.phase

    def _planned(self) -> Placement:
        """The placement plan (``_run`` makes it before anything is placed).

        Raises:
            RuntimeError: none is planned yet.
        """
        if self.placement is None:
            raise RuntimeError("no placement is planned yet")
        return self.placement

    @property
    def limits(self) -> Limits:
        """The run's restart budgets."""
        cfg = self.cfg
        return Limits(cfg.faults.max_shadow_restarts, cfg.faults.max_persister_restarts, cfg.faults.max_worker_failures)

    def _start_persister(self):
        return start_persister(self.cfg, self.placement)

    def _await_persister(self) -> None:
        """Wait until the first persister has started and can use storage from its node.

        Raises:
            ComponentStartError: it was not placed within ``cfg.faults.start_timeout_s``, its constructor
                raised, or its storage probe failed (e.g. no credentials on its node). Storage that is
                unreachable (an outage) is logged, not fatal: the persister retries through its breaker.
        """
        what, timeout_s = "the snapshot persister", self.cfg.faults.start_timeout_s
        try:
            self._placed_persister(ray.get(self.persister.status.remote(), timeout=timeout_s))
        except (RayActorError, GetTimeoutError) as exc:
            raise start_failure(what, exc, timeout_s, self._planned().replica) from exc
        try:
            ray.get(self.persister.check_storage.remote(), timeout=timeout_s)
        except (ray.exceptions.RayTaskError, GetTimeoutError) as exc:  # the probe raised, or hung
            cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
            if isinstance(cause, StorageUnreachableError):  # an outage, not a setting: it retries through its breaker
                log.warning("the snapshot persister cannot reach storage yet (%s); training goes on, snapshots wait", cause)
                return
            raise storage_failure(what, self.placed["persister"][-1], self.cfg.storage.uri, cause) from exc
        except RayActorError as exc:  # it died
            raise start_failure(what, exc, timeout_s, self._planned().replica) from exc

    def _placed_persister(self, status: dict) -> None:
        """Record the node of a persister incarnation from its first status."""
        self.placed["persister"].append({k: status[k] for k in ("node_id", "node_ip")})

    def _start_log_keeper(self) -> None:
        """Start the log keeper over the run directory's step log, pinned to this (the driver's) node,
        mirroring to and (when its log lacks steps) resuming from the run's remote storage; returns
        before it is ready (``_await_log_keeper``)."""
        storage = snapshot_store(self.cfg).storage if self.cfg.storage.remote else None
        self.log_keeper = ray.remote(LogKeeperActor).options(
            name=log_keeper_name(self.cfg), namespace=self.cfg.namespace, num_cpus=0, max_concurrency=8, runtime_env=runtime_env(),
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(str(self.run_dir.step_log.absolute()), resume_from=storage, mirror_to=storage,
                 commit_to_storage=self.cfg.durability == "cluster",
                 hyper=ZOHyper(lr=self.cfg.zo.lr, eps=self.cfg.zo.eps, weight_decay=self.cfg.weight_decay))

    def _await_log_keeper(self) -> int:
        """Wait until the log keeper has started (and adopted the steps the storage holds past its log);
        returns the steps it holds.

        Raises:
            LogKeeperFailedError: it did not start (e.g. the bucket holds another run's log).
        """
        try:
            self.log_keeper_status = ray.get(self.log_keeper.status.remote(), timeout=300)
        except (RayActorError, GetTimeoutError) as exc:
            raise LogKeeperFailedError(f"the step log keeper could not start on the driver's node: {last_line(exc)}") from exc
        if self.log_keeper_status["adopted_steps"]:
            self.channel.event("log_adopted", steps=self.log_keeper_status["adopted_steps"], storage=self.cfg.storage.uri)
        return self.log_keeper_status["end"]

    def _poll_log_keeper(self, method: str = "status", timeout_s: float = 30) -> LogKeeperStatus:
        """Refresh ``log_keeper_status`` (``status``, or ``flush``: a final mirror round); a keeper
        that does not answer in ``timeout_s`` seconds keeps its last status (logged). Returns the
        keeper's snapshot (``died``: it is dead)."""
        try:
            self.log_keeper_status = ray.get(getattr(self.log_keeper, method).remote(), timeout=timeout_s)
        except RayActorError as exc:
            return LogKeeperStatus(str(self.run_dir.step_log), died=last_line(exc))
        except GetTimeoutError as exc:
            log.warning("the step log keeper did not answer %s (%s)", method, one_line(exc))
        return LogKeeperStatus(str(self.run_dir.step_log))

    def _mirror_status(self) -> dict:
        """The step log mirror's fields of the keeper's status (``log_mirrored_steps``, ``log_mirror_error``)."""
        return {k: v for k, v in self.log_keeper_status.items() if k.startswith("log_mirror")}

    def _shadow_spec(self) -> ShadowSpec:
        return ShadowSpec(
            model=self.cfg.model, cache_dir=self.cfg.cache_dir, dtype=self.cfg.dtype, log_keeper_name=log_keeper_name(self.cfg),
            store=snapshot_store(self.cfg), persister_name=persister_name(self.cfg),
            snapshot_every_steps=self.planner.every_steps if self.planner else self.cfg.snapshot.every_steps, hash_every=self.cfg.hash_every_steps,
            layout=read_header(self.run_dir.step_log)["layout"],
            shipped=self.shipped, threads=self.cfg.placement.shadow_threads,
        )

    # -- monitoring ---------------------------------------------------------------------------
    def _follow(self) -> None:
        """Drain the journal, print new events and steps."""
        self.record.drain(self.channel)
        events = self.record.events
        self.metrics.recoveries(recoveries(events, self.record.metrics))
        by_event = recovery_of_event(events, self.record.metrics)
        shown: list[tuple[float, Callable[[], None]]] = []  # shown in time order across both streams
        for i, e in enumerate(events[self._seen_events:], start=self._seen_events):
            seconds = by_event[i].get("seconds") if i in by_event else None
            if i >= self._earlier[0]:
                e_shown = ({**e, "checkpoints": run_checkpoints(e["checkpoints"], self.record.metrics, events)}
                           if e["kind"] == "final" and "checkpoints" in e else e)  # the run's bytes, not the last incarnation's
                shown.append((e["unix_s"], functools.partial(self.console.event, e_shown, seconds)))
                if e["kind"] == "failure" and e["target"] == "storage" and self.storage_outage is not None:  # set when one is due
                    self.storage_outage(e["seconds"])
            self.metrics.event(e, seconds)
        self._seen_events = len(events)
        rows = self.record.metrics
        shadow_step = self.shadow.status.get("step", 0) if self.shadow else None
        for i, r in enumerate(rows[self._printed_steps:], start=self._printed_steps):
            lag = None if shadow_step is None else max(0, r["step"] + 1 - shadow_step)
            if lag is not None:
                self.shadow_lag.setdefault(r["step"], lag)
            if r["step"] not in self.snapshot_interval:  # an earlier driver's row was planned by it (load_state_dict)
                self._plan(r, events)
            self.metrics.step(r, lag or 0, self.snapshot_interval[r["step"]])
            if i >= self._earlier[1]:
                shown.append((r["unix_s"], functools.partial(self.console.step, r, lag)))
        for _, show in sorted(shown, key=lambda x: x[0]):
            show()
        if len(rows) > self._printed_steps or not self.run_dir.controller_state.exists():
            self.run_dir.write_json(self.run_dir.controller_state, self.state_dict())
        self._printed_steps = len(rows)
        self.ray_messages.release(injected_pids(events))

    def _plan(self, row: dict, events: list[dict]) -> None:
        """Feed the cost-model policy with this step's measurements; apply and record a re-plan."""
        if self.planner is None or self.shadow is None:  # the adaptive policy plans a shadow's snapshots
            self.snapshot_interval[row["step"]] = self.cfg.snapshot.every_steps
            return
        failures, _ = worker_failures_and_recoveries(events)
        feasible = self.planner.infeasible is None
        record = self.planner.observe(row["step"], row, self.shadow.status, self.persister_status, recoveries(events), failures,
                                      elapsed_s=row["unix_s"] - self.t_start)
        if record is not None:
            self.shadow.set_interval(record.interval_steps)
            self.channel.event("replan", **record.to_dict())
        if feasible and self.planner.infeasible:  # the first step of a spell, as the policy's warning
            self.channel.event("plan_infeasible", step=row["step"], interval_steps=self.planner.every_steps,
                               reason=self.planner.infeasible)
        if not self._calibration_requested and not self.persister_status.get("written"):
            # the policy needs a measured snapshot cost, not the assumed one: snapshot once early
            self._calibration_requested = True
            self.shadow.snapshot_now(timeout_s=None)
            self.channel.event("calibration_snapshot", step=row["step"] + 1)
        self.snapshot_interval[row["step"]] = self.planner.every_steps

    def _poll_persister(self, method: str = "status", *args, timeout_s: float = 30) -> PersisterStatus:
        """Refresh ``persister_status`` (``status`` or ``flush``); returns the persister's snapshot
        (``died``: it is dead). A persister that does not answer is reported in ``persister_status``,
        never fatal: snapshots are an optimisation over the step log."""
        try:
            self.persister_status = ray.get(getattr(self.persister, method).remote(*args), timeout=timeout_s)
        except ActorDiedError as exc:
            return PersisterStatus(self.persister_restarts, died=type(exc).__name__)
        except (RayActorError, GetTimeoutError) as exc:
            log.warning("the snapshot persister did not answer %s (%s)", method, one_line(exc))
            self.persister_status = {**self.persister_status, "unavailable": f"{type(exc).__name__}: {exc}"[:300]}
            return PersisterStatus(self.persister_restarts)
        self.metrics.storage({**self.persister_status, **self._mirror_status()}, self._printed_steps)
        return PersisterStatus(self.persister_restarts)

    def _flush(self, keeper: bool = True) -> dict:
        """A final flush of the persister (its pending write) and, with ``keeper``, of the log keeper (a
        last mirror round), repairing or failing as ``orchestrator.control.component_actions`` decides;
        returns ``persister_status``."""
        persister = self._poll_persister("flush", 600, timeout_s=660)
        keeper_status = self._poll_log_keeper("flush", timeout_s=660) if keeper and self.log_keeper is not None else None
        self._act(component_actions(self.limits, persister=persister, log_keeper=keeper_status))
        return self.persister_status

    def _restart_persister(self, reason: str) -> None:
        """Start a new persister (same name) after one died (``reason``: the error type); the shadow then
        snapshots at once, so durability in storage resumes without waiting for the next interval. A
        new persister starts even while storage is unreachable (it reports that in its status and
        retries). One whose name Ray has not released yet is not counted: the next poll sees the old
        one dead again and retries."""
        t0 = time.time()
        try:
            self.persister = self._start_persister()
        except ValueError as err:  # the old name not yet released: next poll
            log.warning("the snapshot persister could not restart yet (%s); retrying", one_line(err))
            return
        self.persister_restarts += 1
        try:
            self._placed_persister(ray.get(self.persister.status.remote(), timeout=120))
        except (RayActorError, GetTimeoutError) as err:  # it died starting: the next poll sees it dead
            log.warning("the restarted snapshot persister did not answer (%s); retrying", one_line(err))
            return
        self.channel.event("persister_restart", reason=reason[:100], seconds=time.time() - t0)
        if self.shadow is not None:
            try:
                self.shadow.snapshot_now(timeout_s=600)
            except (RayActorError, GetTimeoutError) as err:  # a dead shadow is restarted by its keeper
                log.warning("the shadow could not snapshot after the persister restart (%s); the next planned snapshot "
                            "will be taken", one_line(err))

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
            elif isinstance(action, RestartPersister):
                self._restart_persister(action.reason)
            elif isinstance(action, FailRun):
                raise FAILURES[action.component](action.reason)
        return any(isinstance(action, Stop) for action in actions)

    def _trainer(self) -> TorchTrainer:
        if self.cfg.algo == "fo":
            from raycheck.workers.fo_worker import train_loop_per_worker
        elif self.cfg.faults.warm_standby:
            from raycheck.workers.standby import train_loop_per_worker
        else:
            from raycheck.workers.worker import train_loop_per_worker
        cfg = self.cfg
        return TorchTrainer(
            train_loop_per_worker=train_loop_per_worker,
            train_loop_config={**cfg.to_dict(), ASSETS_KEY: self.shipped},
            torch_config=ReplicaGroupsConfig(exchange_name(cfg), cfg.namespace, cfg.workers) if cfg.replica_groups else None,
            scaling_config=ScalingConfig(num_workers=(cfg.elastic.min_workers, cfg.workers) if cfg.is_elastic else cfg.workers,
                                         elastic_resize_monitor_interval_s=cfg.elastic.resize_interval_s,
                                         use_gpu=cfg.device == "cuda",
                                         resources_per_worker=self._planned().worker_resources,
                                         label_selector=self._planned().worker_label_selector),
            run_config=RunConfig(
                name=f"raycheck-{self.cfg.run_id}",
                storage_path=str(pathlib.Path(self.cfg.out_dir).resolve() / "ray_train"),
                failure_config=FailureConfig(max_failures=self.cfg.faults.max_worker_failures),
                worker_runtime_env=runtime_env(),
                # the controller's side of the recovery breakdown; Ray annotates UserCallback, and takes any RayTrainCallback
                callbacks=[GroupTimeline(self.cfg)],  # type: ignore[list-item]
            ),
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
        prepare(self.cfg, self.run_dir)
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

    def _kill_actors(self) -> None:
        """Kill this run's shadow (every shard's current incarnation), persister, log keeper and journal
        (after a last drain), whichever were started."""
        if self.shadow is not None:
            self.shadow.kill()
        for actor in (self.persister, self.log_keeper):
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self.journal is not None:
            try:  # what came in since the last drain (e.g. a restart during the final checks)
                self.record.drain(self.channel)
            except RayError as exc:
                log.warning("the journal did not answer its last drain (%s)", one_line(exc))
            ray.kill(self.journal, no_restart=True)

    def _summary_base(self) -> dict:
        """The summary fields known whatever happened (``_finish`` and ``_failure_summary`` add the rest)."""
        cfg = self.cfg
        return {
            "phase": self.phase.value,
            "algo": cfg.algo,
            "strategy": cfg.strategy,
            "dtype": cfg.dtype,
            "shadow_restarts": self.shadow.restarts if self.shadow else None,
            "persister_restarts": self.persister_restarts,
            "config_stored": self.config_stored,
            "snapshot_policy": cfg.snapshot.policy,
            "storage_consistency": cfg.storage.consistency,
            "wall_seconds": time.time() - self.t_start,
            "trajectory_sha256": cfg.trajectory_sha256(),
            "placement": self._placement(),
            "config": cfg.to_dict(),
        }

    def _last_event(self, kind: str, **fields) -> None:
        """Record a driver event of a failing run: through the journal while it answers (in time order
        with the others, written at the last drain), else directly (none started, or it died)."""
        try:
            if self.journal is not None:
                self.channel.event(kind, **fields)
                return
        except RayError as exc:
            log.warning("the journal did not take the %s event (%s)", kind, one_line(exc))
        self.record.write_event(kind, **fields)

    def _placement(self) -> dict:
        """Where each component ran: ``policy`` (``Placement.policy``), ``driver``, ``persister`` (one
        entry per incarnation), ``shadow_shards`` (per shard, one per incarnation that answered) and
        ``workers`` (one per worker start: ``rank``, ``unix_s``); each entry has ``node_id`` and ``node_ip``."""
        events = self.record.events
        return {"policy": self.placement.policy if self.placement else None, **self.placed,
                "shadow_shards": [list(s.placements) for s in self.shadow.shards] if self.shadow else None,
                "workers": [{k: e[k] for k in ("rank", "node_id", "node_ip", "unix_s")}
                            for e in events if e["kind"] == "placement" and e["component"] == "worker"]}

    def _store_config(self) -> None:
        """Put the configuration in the run's storage (``save_config``); storage that fails here does not
        stop the run (the step log is local, snapshots wait for storage): the run is then resumable from
        its run directory only, which the warning and ``summary.json``'s ``config_stored`` say."""
        try:
            self.config_stored = save_config(self.cfg)
        except StorageError as exc:
            log.warning("the configuration could not be put in %s (%s): until a later start stores it, this run "
                        "resumes from its run directory only, not from the bucket alone", self.cfg.storage.uri, exc)

    def _failure_summary(self, exc: BaseException) -> dict:
        """The summary of a run that raised ``exc``, from what the driver holds (no Ray call): phase
        ``failed``, ``ok`` false, the error (``<ErrorType>: message``, or the type alone for one
        without a message, as an interrupt), and what is known of the shadow (``orchestrator.summary.failed_summary``)."""
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        self.state = Failed(error)
        return failed_summary(error, self.shadow.shard_figures(None) if self.shadow else None, self._summary_base())

    def _announce_failure(self, summary: dict) -> None:
        """Record the ``phase`` event of a failed run (``_failure_summary``'s ``summary``): a Ray call while the
        journal answers, so it comes after the summary is made."""
        self._last_event("phase", phase=summary["phase"], error=summary["error"][:500])

    def _run(self) -> dict:
        cfg = self.cfg
        self.cfg = cfg = cfg.replace(writer_epoch=snapshot_store(cfg).claim_epoch())  # fences older incarnations
        if cfg.storage.remote:  # beside the log segments: --resume --storage URI needs nothing else
            self._store_config()
        connect(cfg.namespace, num_cpus=max(2, cfg.workers))
        self.ray_messages.install()
        self.shipped = ship(self.assets)
        self.placed["driver"] = this_node()
        nodes = alive_nodes()
        self.placement = plan_placement(nodes, driver_node_id=self.placed["driver"]["node_id"], workers=cfg.workers,
                                        use_gpu=cfg.device == "cuda", worker_resource=cfg.placement.worker_resource,
                                        replica_resource=cfg.placement.shadow_resource)
        wait_for_previous_driver(cfg, echo=self.echo)  # a resume right after its driver died: Ray is removing its actors
        self.journal = start_journal(cfg, claims_in(self.record.events))  # a failure that fired before stays fired
        # start-ups overlap: the persister starts while the log keeper is awaited, the shadow (after the
        # node-failure check, which needs the durable steps) while the persister is; one that cannot
        # start ends the run (_kill_actors stops the others)
        if cfg.uses_step_log:
            self._start_log_keeper()
        self.persister = self._start_persister()
        durable = self._await_log_keeper() if cfg.uses_step_log else 0
        fired = fired_before(cfg.faults.failures, durable)  # even when the run directory was lost
        ray.get(self.journal.seed.remote(fired))
        check_node_failures(cfg, nodes, self.placed["driver"]["node_id"], fired=[*claims_in(self.record.events), *fired])
        shadow = None
        if cfg.uses_shadow:
            self.shadow = shadow = ShadowKeeper(cfg, self.channel, self._shadow_spec(), placement=self._planned().replica)
            shadow.start()
        if durable or self.record.events:  # a driver re-run of the same run id: the workers restore
            rows = self.record.metrics
            self.channel.event("resume", durable_steps=durable, last_step_unix_s=rows[-1]["unix_s"] if rows else None)
        self._await_persister()
        if shadow is not None:
            try:
                shadow.wait_ready(timeout_s=cfg.faults.start_timeout_s)
            except (RayActorError, GetTimeoutError) as exc:
                raise start_failure("the shadow", exc, cfg.faults.start_timeout_s, self._planned().replica) from exc
            self.echo(f"[raycheck] shadow ready at step {shadow.status['step']}")
        done = len(self.record.metrics)
        self.echo(f"[raycheck] {f'resuming after step {durable} of' if durable else 'training'} {cfg.steps} steps "
                  f"({cfg.algo}, strategy {cfg.strategy})")
        self.console.begin(cfg.steps, done=done)

        outcome: dict = {}

        def fit() -> None:
            try:
                self._trainer().fit()
                outcome["ok"] = True
            except Exception as exc:  # reported in the summary and by the exit code
                outcome["ok"] = False
                outcome["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
        thread.start()
        while True:
            self.state, actions = step(self.state, self._observe(thread.is_alive(), outcome), self.limits)
            if self._act(actions):
                break
            time.sleep(0.5)
        self._follow()
        return self._finish(outcome)

    def _observe(self, running: bool, outcome: dict) -> Observation:
        """Poll every component (never blocking long) and drain the journal: one ``Observation``.
        ``running`` is sampled before the drain, so that a finished ``fit`` is seen with its events; the
        shadow is polled before the drain, so that a worker failure announced before the shadow was
        killed is seen with it (its restart then waits for the recovery)."""
        shadow = self.shadow.observe() if self.shadow else None
        persister = self._poll_persister()
        keeper = self._poll_log_keeper() if self.log_keeper is not None else None
        self._follow()
        return Observation(workers=worker_group_status(running, outcome, self.record.events), persister=persister,
                           shadow=shadow, log_keeper=keeper)

    def _finish_shadow(self, shadow: ShadowKeeper, ok: bool, mean_step_s: float | None) -> dict:
        """The shadow's final state hash (after a last snapshot of the final state) and its figures."""
        cfg = self.cfg
        sha = None
        if ok:
            shadow.ensure_alive(timeout_s=600)
            sha = shadow.state_sha256(cfg.steps, cfg.faults.recovery_timeout_s)
            shadow.refresh_status(timeout_s=60)
            durable = self._flush(keeper=False).get("last_durable_step")
            if cfg.snapshot.every_steps and shadow.status["step"] > (durable or 0):  # e.g. its write failed in an outage
                shadow.snapshot_now(timeout_s=600)  # the final state, so storage ends complete
        replay_s = shadow.status.get("replay_seconds_per_step")
        return {
            "shadow_state_sha256": sha,
            "shadow_replay_seconds_per_step": replay_s,
            "shadow_replay_over_step": (replay_s or 0) / mean_step_s if mean_step_s else None,
            "shadow_max_lag_steps": max(self.shadow_lag.values(), default=None),
            "shadow_hashes": {str(k): v for k, v in sorted(shadow.hashes(timeout_s=60).items())},
            "shadow_cpu_capability": shadow.status.get("cpu_capability"),
            "shadow_shards": shadow.shard_figures(mean_step_s),
        }

    def _finish(self, outcome: dict) -> dict:
        """The end of a run whose ``fit`` returned (``outcome``: ``ok``, ``error``): ``metrics.parquet``,
        the shadow's final figures, the last flushes, and the summary (``orchestrator.summary.run_summary``)."""
        cfg, run = self.cfg, self.run_dir
        rows = write_metrics(self.record.metrics, {"shadow_lag_steps": self.shadow_lag, "snapshot_interval_steps": self.snapshot_interval},
                             run.root / "metrics.parquet")
        shadow = self._finish_shadow(self.shadow, outcome.get("ok", False), mean_step_seconds(rows)) if self.shadow else {}
        persisted = self._flush()
        return run_summary(Collected(
            ok=outcome.get("ok", False), error=outcome.get("error"), events=self.record.events, executions=self.record.metrics, rows=rows,
            shadow=shadow, persisted=persisted, mirror=self._mirror_status(),
            keeper=self.log_keeper_status if self.log_keeper else None, durability_level=cfg.durability, task=cfg.data.task,
            base=self._summary_base()))


def run_job(cfg: JobConfig, verify: bool = False, echo: Callable[[str], None] = print, assets: Assets | None = None) -> dict:
    """Run ``cfg``; with ``verify``, also run (or reuse) the failure-free reference in
    ``<out_dir>/reference`` and compare the final states bitwise. ``assets``: what
    ``training.assets.read_assets`` returned for ``cfg`` (read here when None)."""
    if assets is None:
        cfg, assets = read_assets(cfg)
    summary = Controller(cfg, echo, assets=assets).run()
    return compare_with_reference(cfg, summary, echo, assets) if verify and summary["ok"] else summary


def compare_with_reference(cfg: JobConfig, summary: dict, echo: Callable[[str], None] = print,
                           assets: Assets | None = None) -> dict:
    """``summary`` (of ``cfg``'s run, finished: ``ok``, ``state_sha256``) with ``reference_state_sha256``
    and ``bitwise_equal`` (the two final-state sha256s compared) from the failure-free reference, run
    or reused (``reference``); also written to ``<out_dir>/summary.json``. What ``run_job`` does after
    the run with ``verify``, and what ``raycheck run --resume --verify`` does for a run that finished."""
    if assets is None:
        cfg, assets = read_assets(cfg)
    ref = reference(cfg, echo, assets)
    summary = {**summary, "reference_state_sha256": ref["state_sha256"],
               "bitwise_equal": ref["state_sha256"] == summary["state_sha256"]}
    RunDir.write_json(pathlib.Path(cfg.out_dir) / "summary.json", summary)
    return summary


def reference(cfg: JobConfig, echo: Callable[[str], None] = print, assets: Assets | None = None) -> dict:
    """The failure-free run with the same trajectory settings (reused when already complete)."""
    out = pathlib.Path(cfg.out_dir) / "reference"
    previous = out / "summary.json"
    if previous.exists():
        ref = json.loads(previous.read_text())
        if ref.get("ok") and ref.get("trajectory_sha256") == cfg.trajectory_sha256():
            echo(f"[raycheck] reusing the failure-free reference in {out}")
            return ref
    shutil.rmtree(out, ignore_errors=True)
    echo(f"[raycheck] running the failure-free reference in {out}")
    return Controller(reference_config(cfg), echo, assets=assets).run()


def reference_config(cfg: JobConfig) -> JobConfig:
    """The configuration of ``cfg``'s failure-free reference (pure): the same trajectory in
    ``<out_dir>/reference``, with local storage (so durability ``cluster`` becomes ``node``), no
    failures, no evaluation, its own run id and its own rank-0 scratch directory."""
    return cfg.replace(
        out_dir=str(pathlib.Path(cfg.out_dir) / "reference"), eval_samples=0, run_id=f"{cfg.run_id}-ref",
        durability="node" if cfg.durability == "cluster" else cfg.durability,
        scratch_dir=str(pathlib.Path(cfg.scratch_dir) / "reference"), storage={"uri": ""}, faults={"failures": ()},
    )
