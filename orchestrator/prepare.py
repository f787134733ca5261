"""Before a run starts: the run directory's step log created with everything replay needs in its header,
or an existing one checked so that a resumed run continues only its own trajectory; and the cluster
checked for the node failures the run injects (``check_node_failures``)."""

from __future__ import annotations

import logging
import pathlib
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING

from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.orchestrator.cluster import Node, worker_need
from raycheck.storage.steplog import StepLogCorruptError, StepLogWriter, read_header, read_prefix, trajectory_tag
from raycheck.storage.units import describe_units
from raycheck.training.model import is_builtin, layout_sha256, load_model, model_dir, parameter_layout, tokenizer_dir, trainable_parameters
from raycheck.training.zo import GENERATOR, ZOHyper, check_dtype, check_generator, check_records
from raycheck.workers.faults import PARTS, marker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class ResumeMismatchError(ValueError):
    """The run directory holds a step log of another trajectory than the configuration's."""


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


def prepare(cfg: JobConfig, run: RunDir, module: "torch.nn.Module | None" = None) -> None:
    """Convert the model once, save the configuration (``config.json``, for ``--resume``; a resumed run
    saves it again, with the options ``--resume`` took from the command line, e.g. a larger restart
    budget) and create the step log with everything replay needs in its header. An existing step log is
    kept when ``check_resumed_log`` passes (a resumed run: its trajectory, run id, seed and every record's
    seed and hyper-parameters match, and its records are in order), else it raises what that raises
    (``ResumeMismatchError``, ``GeneratorMismatchError``, ``DtypeMismatchError``, or a ``StepLogError``
    for a damaged log); none of them touches ``config.json``. ``module``: your own model (an own-loop
    run, ``training.assets.OwnLoop``), whose parameters the header describes."""
    cache_dir = pathlib.Path(cfg.cache_dir) if cfg.cache_dir else None
    if module is None:
        tokenizer_dir(cache_dir)
    if is_builtin(cfg.model):
        model_dir(cfg.model, cache_dir)
    if run.step_log.exists():
        check_resumed_log(cfg, run)
        run.write_json(run.root / "config.json", cfg.to_dict())
        return
    run.write_json(run.root / "config.json", cfg.to_dict())
    model = module if module is not None else load_model(cfg.model, cache_dir, dtype=cfg.dtype)  # the driver's own copy: a folder is read here only
    units = describe_units(model)
    if not units.recognised:  # expected of your own module: said only with --verbose
        say = log.info if module is not None else log.warning
        say("the unit layout of %s (%s) is not recognised: each module is its own checkpoint unit (%d units)",
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


class ClusterTooSmallError(ValueError):
    """A ``node`` or ``preempt`` failure that the cluster could not survive (``check_node_failures``)."""


def check_node_failures(cfg: JobConfig, nodes: list[Node], driver_node_id: str, fired: Collection[str] = ()) -> None:
    """Refuse ``node`` and ``preempt`` failures (``workers.preempt``) still to fire on a cluster where the
    run could not survive one: rank 0's node must not be the driver's (its loss would end the run), and
    after it is gone another node must host the train workers; a ``preempt-shadow`` failure needs another
    node for the shadow (one offering ``placement.shadow_resource``, when set).

    Args:
        nodes: the alive nodes (``alive_nodes``); driver_node_id: the driver's node.
        fired: the failure markers already claimed (``workers.faults.marker``): a resumed run whose node
            failure fired before is not refused for the node it took down.

    Raises:
        ClusterTooSmallError: ``cfg`` has such a failure and the cluster has one node, or the driver's node
            can host a train worker, or fewer than two other nodes can host what the node held.
    """
    due = [f"{f.step}:{f.target}" for i, f in enumerate(cfg.faults.failures)
           if f.target in ("node", "preempt", "preempt-shadow") and not set(marker(i, part) for part in PARTS.get(f.target, (f.target,))) <= set(fired)]
    if not due:
        return
    if len(nodes) < 2:
        raise ClusterTooSmallError(f"failure {due[0]} takes down a node, which on a one-node cluster is the "
                         "driver's: the run would end with it; use a cluster of several nodes")
    for failure in due:
        shadow = failure.endswith("preempt-shadow")
        need = {cfg.placement.shadow_resource: 1.0} if shadow and cfg.placement.shadow_resource else {} if shadow else \
            worker_need(cfg.device == "cuda", cfg.placement.worker_resource)
        hosts = [n.node_id for n in nodes if n.can_host(need) and (n.node_id != driver_node_id or not shadow)]
        node, what, movers = ("the shadow's node", "the shadow", "the shadow needs") if shadow else ("rank 0's node", "a train worker", "the workers need")
        if not shadow and driver_node_id in hosts:
            raise ClusterTooSmallError(f"failure {failure} would take down the driver's node, which can host a train worker "
                             f"(it offers {need}): start the driver's node without them (ray start --head --num-cpus=0) "
                             "or set --worker-resource to a resource only the other nodes offer")
        if len(hosts) < 2:
            raise ClusterTooSmallError(f"failure {failure} takes down {node}, but {len(hosts)} node(s) of {len(nodes)} "
                             f"can host {what} (each asks {need}): {movers} another node to restart on")
