"""A run's model and data as the driver ships them: read once on the driver's node, put in Ray's
object store, fetched by every worker and shadow (the cluster rule: no process on another node reads
a path that exists on the driver's node only).

The driver calls ``read_assets`` before the cluster starts (bad data and a changed model are refused
there, nothing touched), ``ship`` once connected, and passes the references: in the train loop's
config (``ASSETS_KEY``) and in the shadow's spec. A built-in model (``smollm2-135m``, ``tiny``) and the
default data (Rotten Tomatoes) are not shipped: every node builds them from its installed wheels.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from raycheck.job.config import OWN_MODEL_PREFIX, JobConfig
from raycheck.training.data import Split, load_data_file, load_rotten_tomatoes, make_encoder
from raycheck.training.model import ModelFiles, files_sha256, is_builtin, load_tokenizer, read_model_files, trainable_parameters

if TYPE_CHECKING:
    from ray import ObjectRef

ASSETS_KEY = "assets"
"""The train loop config's key of the shipped references (``ship``); not a ``JobConfig`` field."""


class AssetMismatchError(ValueError):
    """A resumed run's model folder or data file no longer has the content its trajectory was made with."""


@dataclass(frozen=True)
class Assets:
    """What the driver read: the model's files (None for a built-in) and the (train, held-out) splits of
    the data file (None: Rotten Tomatoes, loaded where needed)."""

    model: ModelFiles | None
    data: tuple[Split, Split] | None
    own: "OwnLoop | None" = None
    """Your own train loop and model (``orchestrator.api.run_own_loop``); None: raycheck's task."""


@dataclass(frozen=True)
class OwnLoop:
    """Your own ZO train loop and model on the driver (``orchestrator.api.run_own_loop``):
    ``train_loop_per_worker`` goes to Ray Train's ``TorchTrainer`` (pickled by Ray); ``model``'s initial
    parameters are shipped as the run's model (``module_files``), so the shadow and every worker start
    from the driver's weights."""

    train_loop_per_worker: Callable[[dict[str, Any]], None]
    model: torch.nn.Module


def module_files(model: torch.nn.Module, dtype: str) -> ModelFiles:
    """``model``'s parameters (``trainable_parameters``: names, order, tied tensors once) as one
    safetensors file (``model.safetensors``), the model files of an own-loop run: the shadow reads them
    with the step log header's layout (``training.model.read_parameters``), a worker loads them into your
    model (``workers.own_loop_zo``).

    Raises:
        ValueError: a parameter's dtype is not ``dtype`` (the run's ``JobConfig.dtype``).
    """
    from safetensors.torch import save

    params = trainable_parameters(model)
    wrong = next(((n, t.dtype) for n, t in params.items() if t.dtype != getattr(torch, dtype)), None)
    if wrong is not None:
        raise ValueError(f"your model's parameter {wrong[0]!r} is {str(wrong[1]).removeprefix('torch.')}, the run's dtype is {dtype}: "
                         f"give dtype={str(wrong[1]).removeprefix('torch.')!r} or convert the model")
    files = {"model.safetensors": save({n: t.detach().cpu().contiguous() for n, t in params.items()})}
    return ModelFiles(source=f"{OWN_MODEL_PREFIX}{type(model).__qualname__}", files=files, sha256=files_sha256(files))


def file_sha256(path: str | pathlib.Path) -> str:
    """sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _checked(cfg: JobConfig, field: str, found: str, what: str) -> dict[str, str]:
    """``{field: found}`` (``field`` a path, ``data.sha256``), or ``AssetMismatchError`` when ``cfg`` already records
    another hash (a resume)."""
    recorded = str(cfg.get(field))
    if recorded and recorded != found:
        raise AssetMismatchError(
            f"{what} has changed since this run started ({field} {recorded[:12]}... in its config, {found[:12]}... now): "
            "resume with the original files, or start a new run with a new --out")
    return {field: found}


def read_assets(cfg: JobConfig) -> tuple[JobConfig, Assets]:
    """Read and check ``cfg``'s model folder and data file on the driver.

    Args:
        cfg: a ``JobConfig``.

    Returns:
        (``cfg`` with ``model_sha256`` and ``data.sha256`` set, ``Assets``).

    Raises:
        ValueError: the model is no built-in name, folder or cached model id (``training.model.model_folder``).
        DataError: the data file cannot be trained on (``training.data.load_data_file``).
        AssetMismatchError: ``cfg`` records other hashes than the files have now.
    """
    hashes: dict[str, str] = {}
    files = None
    if not is_builtin(cfg.model):
        files = read_model_files(cfg.model, pathlib.Path(cfg.cache_dir))
        hashes |= _checked(cfg, "model_sha256", files.sha256, f"model {cfg.model}")
    data = None
    if cfg.data.path:
        data = load_data_file(cfg, make_encoder(cfg, load_tokenizer(cfg.cache_dir, files)))
        hashes |= _checked(cfg, "data.sha256", file_sha256(cfg.data.path), f"data file {cfg.data.path}")
    return cfg.replace(**hashes), Assets(model=files, data=data)


def ship(assets: Assets) -> dict[str, ObjectRef[Any] | None]:
    """Put ``assets`` in Ray's object store (the driver must be connected); returns ``{"model": ref or
    None, "data": ref or None}``, the value of ``ASSETS_KEY`` and of ``ShadowSpec.model_files``'s source."""
    import ray

    return {name: None if value is None else ray.put(value) for name, value in (("model", assets.model), ("data", assets.data))}


def fetch(shipped: Mapping[str, ObjectRef[Any] | None] | None, name: str) -> Any:
    """The shipped asset ``name`` (``ray.get`` of its reference), or None when it was not shipped."""
    import ray

    ref = (shipped or {}).get(name)
    return None if ref is None else ray.get(ref)


def shipped_model(shipped: Mapping[str, ObjectRef[Any] | None] | None, model: str) -> ModelFiles | None:
    """The shipped files of ``model`` (None for a built-in name), for a worker or shadow on any node.

    Raises:
        RuntimeError: ``model`` is a folder or model id but the driver shipped no files: it would be
            read by path, which the cluster rule forbids (a driver bug, not a user error).
    """
    files: ModelFiles | None = fetch(shipped, "model")
    if files is None and not is_builtin(model):
        raise RuntimeError(f"model {model} was not shipped by the driver (training.assets.ship); a worker or shadow "
                           "never reads the driver's folder by path")
    return files


def splits(data: tuple[Split, Split] | None) -> tuple[Split, Split]:
    """The shipped (train, held-out) splits, or Rotten Tomatoes' when none were shipped."""
    return data if data is not None else load_rotten_tomatoes()
