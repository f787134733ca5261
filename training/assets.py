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
from typing import TYPE_CHECKING, Any

from raycheck.job.config import JobConfig
from raycheck.training.data import Split, load_data_file, load_rotten_tomatoes, make_encoder
from raycheck.training.model import ModelFiles, is_builtin, load_tokenizer, read_model_files

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
