"""The Python API: build a configuration, run it, get the summary: for a driver script of your own
(e.g. under ``ray job submit``). ``raycheck run`` is a thin layer over it.

    from raycheck.orchestrator.api import job_config, run_job

    cfg = job_config("runs/mine", model="/models/my-gpt2", data={"path": "train.jsonl"}, steps=100)
    summary = run_job(cfg, verify=True)

Everything is checked before the cluster starts: a bad configuration, model or data file raises
``ValueError`` (``training.data.DataError`` for the data) and touches nothing.
"""

from __future__ import annotations

import pathlib
import uuid
from typing import Any, Callable

from raycheck.job.config import JobConfig
from raycheck.job.stores import snapshot_store
from raycheck.training.assets import Assets, read_assets
from raycheck.training.model import default_cache_dir


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
        from raycheck.training.model import load_model, trainable_parameters

        params = trainable_parameters(load_model(cfg.model, pathlib.Path(cfg.cache_dir)))
        split_units({n: p.numel() for n, p in params.items()}, cfg.placement.shadow_shards)
    if cfg.storage.remote:  # a local store is made by the run: checking it here would leave a folder behind
        storage = snapshot_store(cfg).storage
        storage.probe()
        if cfg.storage.consistency == "fenced":
            storage.check_conditional_writes()
    return cfg, assets


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
