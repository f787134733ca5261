"""The Python API: build a configuration, run it, get the summary: for a driver script of your own
(e.g. under ``ray job submit``). ``raycheck run`` is a thin layer over it.

    from raycheck.orchestrator.api import job_config, run_job

    cfg = job_config("runs/mine", model="/models/my-gpt2", data={"path": "train.jsonl"}, steps=100)
    summary = run_job(cfg, verify=True)

Your own ZO train loop and ``torch.nn.Module`` run with ``run_own_loop`` (the loop's side:
``workers.own_loop_zo``). Everything is checked before the cluster starts: a bad configuration, model or
data file raises ``ValueError`` (``training.data.DataError`` for the data) and touches nothing.
"""

from __future__ import annotations

import pathlib
import tempfile
import uuid
from typing import Any, Callable

import torch

from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.job.stores import snapshot_store
from raycheck.storage.backend import Storage, local_path
from raycheck.training.assets import Assets, OwnLoop, module_files, read_assets
from raycheck.training.model import default_cache_dir, trainable_parameters


def job_config(out_dir: str | pathlib.Path, **fields: Any) -> JobConfig:
    """A ``JobConfig`` with the run directory ``out_dir`` made absolute, a new 8-hex-digit run id and the
    default model cache (``training.model.default_cache_dir``) unless given; any ``JobConfig`` field
    may be passed (``model``, ``steps``, ...; a component such as ``data`` or ``faults`` as its
    dataclass or as a dict of its fields, e.g. ``data={"path": "train.jsonl", "task": "causal-lm"}``,
    ``faults={"failures": (FailureSpec(step=3),)}``).

    Raises:
        ValueError: a setting no run can use (the message names the field).
    """
    fields.setdefault("cache_dir", str(default_cache_dir()))
    fields.setdefault("run_id", uuid.uuid4().hex[:8])
    fields["cache_dir"] = str(pathlib.Path(fields["cache_dir"]).resolve())
    return JobConfig(out_dir=str(pathlib.Path(out_dir).resolve()), **fields)


def check_job(cfg: JobConfig) -> tuple[JobConfig, Assets]:
    """Read and check what ``cfg`` needs on this machine (the driver's) before the cluster starts:
    the model (a folder or cached id: its files and their hash), the data file (its rows, labels and
    lengths, and its hash), the shadow shards against the model's units, and remote snapshot storage.
    Nothing is written on this machine.

    Returns:
        (``cfg`` with ``model_sha256`` and ``data.sha256`` set, the ``Assets`` to ship).

    Raises:
        ValueError: the model, data or shard count is unusable (``DataError`` for data), or the
            model or data changed since the run in ``cfg`` started (``AssetMismatchError``).
        OSError: the snapshot storage cannot be reached (wrong endpoint, bucket or credentials);
            ``StorageConsistencyError``: it ignores conditional writes and ``job.config.StorageConfig.consistency`` is ``fenced``.
    """
    cfg, assets = read_assets(cfg)
    if cfg.placement.shadow_shards > 1:
        from raycheck.actors.shards import split_units
        from raycheck.training.model import load_model

        params = trainable_parameters(load_model(cfg.model, pathlib.Path(cfg.cache_dir)))
        split_units({n: p.numel() for n, p in params.items()}, cfg.placement.shadow_shards)
    check_storage(cfg)
    return cfg, assets


class RayTrainStorageError(OSError):
    """Ray Train's storage (``--ray-train-storage``) cannot be used; the message names it and why."""


def check_storage(cfg: JobConfig) -> None:
    """Probe ``cfg``'s remote snapshot storage (a local store is made by the run: checking it here would
    leave a folder behind), then Ray Train's storage when one is given (``StorageConfig.ray_train``: a
    bucket is probed with the same options; a local path must lie in a folder where a file can be made).

    Raises:
        OSError: the snapshot storage cannot be reached; ``StorageConsistencyError``: it ignores conditional
            writes and ``job.config.StorageConfig.consistency`` is ``fenced``. RayTrainStorageError: Ray
            Train's storage cannot be used.
    """
    if cfg.storage.remote:
        storage = snapshot_store(cfg).storage
        storage.probe()
        if cfg.storage.consistency == "fenced":
            storage.check_conditional_writes()
    uri = cfg.storage.ray_train
    if not uri:
        return
    folder = local_path(uri)
    try:
        if folder is None:
            Storage(uri, create=False, **cfg.storage.options).probe()
            return
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a folder this user can write in")
        try:
            with tempfile.TemporaryFile(dir=existing):  # a write, not a permission bit (root passes every os.access); deleted at once
                pass
        except OSError as exc:
            raise PermissionError(f"no file can be made in {existing} ({exc.strerror})") from exc
    except OSError as exc:
        raise RayTrainStorageError(f"Ray Train's storage {uri} (--ray-train-storage) is not usable: {exc}") from exc


def run_job(cfg: JobConfig, *, verify: bool = False, echo: Callable[[str], None] = print,
            assets: Assets | None = None) -> dict:
    """Run ``cfg`` on Ray (joining ``RAY_ADDRESS``'s cluster, else starting a local one) and return the
    summary (also in ``<out_dir>/summary.json``: ``ok``, ``final_step``, ``state_sha256``,
    ``accuracy_before``/``accuracy_after`` (``eval_metric``: accuracy, or the held-out loss in nats per
    token for causal LM), ``bitwise_equal`` with ``verify``, ...). ``assets``: from ``check_job``
    (which is called when None).

    Raises:
        ValueError, OSError: see ``check_job`` (raised before the cluster starts).
    """
    from raycheck.orchestrator.runs import run_job as run_controller

    if assets is None:
        cfg, assets = check_job(cfg)
    return run_controller(cfg, verify=verify, echo=echo, assets=assets)


def run_own_loop(cfg: JobConfig, train_loop_per_worker: Callable[[dict[str, Any]], None], model: torch.nn.Module, *,
                 verify: bool = False, echo: Callable[[str], None] = print) -> dict:
    """Run your own ZO ``train_loop_per_worker`` (which calls ``workers.own_loop_zo.zeroth_order``) on Ray
    Train with ``cfg``'s workers, step log, shadow, persister, snapshot policy and failures, as ``run_job``
    runs raycheck's task; returns the same summary, also when the run failed (``ok`` false, ``error``: e.g. a
    ``workers.zo_session.CodeError`` of your code; ``state_sha256``: your model's final parameters;
    ``bitwise_equal`` with ``verify``: against the failure-free reference, your loop run again;
    ``final_snapshot``: the trained weights, for ``workers.own_loop.load_checkpoint``).

    Args:
        cfg: from ``job_config``; ``algo`` zo. ``model`` is replaced by ``module:<class name>``; the data
            and evaluation settings are not used (your loop has its own).
        train_loop_per_worker: your function; Ray pickles it (with what it closes over) to every worker.
        model: your model with its initial weights (on the CPU, in ``cfg.dtype``): shipped once to every
            worker and to the shadow.

    Raises:
        ValueError: ``cfg.algo`` is not zo, ``cfg.out_dir`` holds a run already, ``cfg`` is elastic, a parameter is not in ``cfg.dtype``, or see
            ``check_storage``.
    """
    from raycheck.orchestrator.runs import run_job as run_controller

    if cfg.algo != "zo":
        raise ValueError(f"run_own_loop trains zeroth-order (algo zo), not {cfg.algo}: for first order, call "
                         "workers.own_loop.FirstOrderCheckpoints from your own TorchTrainer loop")
    if RunDir(pathlib.Path(cfg.out_dir)).step_log.exists():
        raise ValueError(f"{cfg.out_dir} holds a run already (its step log): give run_own_loop a new out_dir (resuming your "
                         "own loop is not supported yet)")
    if cfg.is_elastic:
        raise ValueError("run_own_loop does not run elastic worker counts: each rank's loss is one term of the step, so the "
                         "trajectory depends on the worker count; give a fixed --workers")
    files = module_files(model, cfg.dtype)
    cfg = cfg.replace(model=files.source, model_sha256=files.sha256, eval_samples=0)
    check_storage(cfg)
    return run_controller(cfg, verify=verify, echo=echo, assets=Assets(model=files, data=None, own=OwnLoop(train_loop_per_worker, model)))
