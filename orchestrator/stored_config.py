"""The run's configuration in its storage, so that a driver with nothing but the storage URI resumes it.

The controller puts ``config.json`` (``CONFIG_OBJECT``) at the root of a run's remote storage at
every start, beside its snapshots and log segments (``Storage.put``: one atomic object write). The copy holds no
credentials and no storage options: whoever resumes reaches the storage with their own
(``--s3-endpoint``, the ``AWS_*`` environment), which is how ``raycheck run --resume --storage
URI --out NEWDIR`` found it (``load_config``).
"""

from __future__ import annotations

import json
import logging
import pathlib

from raycheck.job.config import JobConfig, OldConfigError, default_scratch_dir, refuse_flat
from raycheck.storage.backend import Storage, StorageError
from raycheck.storage.log_segments import read_segments
from raycheck.storage.steplog import StepLogError

log = logging.getLogger(__name__)

CONFIG_OBJECT = "config.json"
"""The configuration's object name, at the root of the run's storage."""


class StoredConfigError(ValueError):
    """The storage holds no run to resume, a damaged configuration, or another run's step log."""


def stored_config(cfg: JobConfig) -> dict:
    """``cfg.to_dict()`` without ``JobConfig.storage``'s options (an endpoint, and whatever else a caller put
    there, credentials included, never leaves this machine through the storage)."""
    saved = cfg.to_dict()
    return {**saved, "storage": {**saved["storage"], "options": {}}}


def save_config(cfg: JobConfig) -> bool:
    """Put ``stored_config(cfg)`` as ``CONFIG_OBJECT`` in the run's storage, unless the storage holds
    another run's (several runs may share a snapshot store: the first one's stays, and a later run is
    resumed from its run directory only; logged). Returns whether it was written.

    Raises:
        storage.backend.StorageError: the storage failed after its retries.
    """
    storage = Storage(cfg.storage.uri, **cfg.storage.options)
    try:
        held = json.loads(storage.get(CONFIG_OBJECT)).get("run_id")
    except (FileNotFoundError, ValueError, AttributeError):  # none yet, or a damaged one: (re)placed
        held = cfg.run_id
    if held != cfg.run_id:
        log.warning("%s is run %s's; run %s can be resumed from its run directory only", storage.url(CONFIG_OBJECT), held, cfg.run_id)
        return False
    storage.put(CONFIG_OBJECT, json.dumps(stored_config(cfg), indent=2, default=str).encode())
    return True


def load_config(uri: str, storage_options: dict, out_dir: pathlib.Path, cache_dir: pathlib.Path,
                scratch_dir: str = "") -> JobConfig:
    """The configuration of the run whose storage is ``uri``, to resume it in ``out_dir`` on this machine.

    Args:
        uri: the run's storage URI (``s3://BUCKET/PREFIX``, a path).
        storage_options: how this machine reaches it (e.g. ``{"endpoint_url": ...}``); kept in the result.
        out_dir: the new run directory; cache_dir: this machine's model cache.
        scratch_dir: rank 0's node-local directory; empty: the default for ``out_dir`` and the run id.

    Returns:
        The saved configuration with ``out_dir``, ``cache_dir``, ``scratch_dir`` and its storage (URI
        and options) replaced by the arguments.

    Raises:
        StoredConfigError: no ``CONFIG_OBJECT`` in ``uri`` (not the run's storage URI), a damaged one,
            one in the flat form of an older raycheck (``job.config.refuse_flat``),
            or log segments of another run or trajectory (or unreadable ones) beside it.
        storage.backend.StorageError: the storage cannot be read (``StorageUnreachableError`` at once
            when its endpoint takes no connection).
    """
    try:
        storage = Storage(uri, create=False, **storage_options)
    except FileNotFoundError:
        storage = None
    if storage is not None:
        storage.check_reachable()  # an endpoint that is down: one error at once, not four retried reads
    if storage is None or not storage.exists(CONFIG_OBJECT):
        raise StoredConfigError(f"{uri} holds no run to resume (no {CONFIG_OBJECT}): give the --storage URI "
                                "the run was started with (s3://BUCKET/PREFIX), or --out of its run directory")
    try:
        saved = json.loads(storage.get(CONFIG_OBJECT))
        refuse_flat(saved)
        cfg = JobConfig.from_dict({**saved, "out_dir": str(out_dir), "cache_dir": str(cache_dir),
                                   "storage": {"uri": uri, "options": dict(storage_options)},
                                   "scratch_dir": scratch_dir or default_scratch_dir(str(out_dir), saved["run_id"])})
    except OldConfigError as exc:
        raise StoredConfigError(f"{storage.url(CONFIG_OBJECT)}: {exc}") from exc
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # JSONDecodeError is a ValueError
        raise StoredConfigError(f"{storage.url(CONFIG_OBJECT)} is damaged ({type(exc).__name__}: {exc}); this run cannot be resumed") from exc
    _check_log(storage, cfg)
    return cfg


def _check_log(storage: Storage, cfg: JobConfig) -> None:
    """Refuse log segments in ``storage`` that are unreadable or belong to another run than ``cfg``'s."""
    try:
        header, _ = read_segments(storage)
    except StepLogError as exc:
        raise StoredConfigError(f"the step log in {storage.url('log/')} cannot be resumed: {exc}") from exc
    if header is not None and (header.get("run_id"), header.get("trajectory_sha256")) != (cfg.run_id, cfg.trajectory_sha256()):
        raise StoredConfigError(
            f"{storage.url()} holds another run's data: its {CONFIG_OBJECT} is run {cfg.run_id} (trajectory "
            f"{cfg.trajectory_sha256()[:12]}), its step log run {header.get('run_id')} (trajectory "
            f"{str(header.get('trajectory_sha256'))[:12]}); give the storage URI of one run (its own prefix)")


def store_config(cfg: JobConfig) -> bool:
    """``save_config``, at a run's start: storage that fails here does not stop the run (the step log is
    local, snapshots wait for storage); it is then resumable from its run directory only, which the
    warning says (and ``summary.json``'s ``config_stored``, False). Returns whether it was put there."""
    try:
        return save_config(cfg)
    except StorageError as exc:
        log.warning("the configuration could not be put in %s (%s): until a later start stores it, this run "
                    "resumes from its run directory only, not from the bucket alone", cfg.storage.uri, exc)
        return False
