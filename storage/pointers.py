"""Pointers to committed snapshots: what raycheck reports to Ray Train as a checkpoint
(``workers.train_reports``), and how any checkpoint a user holds (a pointer, a snapshot folder's path or
URI, a ``ray.train.Checkpoint``) resolves to one committed snapshot of its store.

A pointer is a folder named as the snapshot (``step-<10 digits>-<hex>``) holding one JSON file,
``POINTER_FILE``: the snapshot's URI, store, folder, step and run id; never a credential.
"""

from __future__ import annotations

import json
from typing import Any

from raycheck.storage.backend import Storage, local_path
from raycheck.storage.dcp_store import SUBFOLDER, ShardedStore
from raycheck.storage.snapshots import INDEX, SnapshotInfo, SnapshotStore

POINTER_FILE = "raycheck-snapshot.json"
"""The one file of a pointer checkpoint: ``{"format", "snapshot", "store", "folder", "step", "run_id"}``."""

POINTER_FORMAT = "raycheck-snapshot-pointer/1"


def pointer(store: SnapshotStore, info: SnapshotInfo) -> dict[str, Any]:
    """The pointer to ``info`` in ``store``: its URI (``snapshot``: ``<store URI>/<folder>``), store,
    folder, step and run id (None for a merge result). No storage option (credentials) is written."""
    root = store.storage.url().rstrip("/")
    run = info.manifest.get("run") or {}
    return {"format": POINTER_FORMAT, "snapshot": f"{root}/{info.folder}", "store": root, "folder": info.folder,
            "step": info.step, "run_id": run.get("run_id")}


def _location(checkpoint: Any) -> tuple[str, Any]:
    """(path, pyarrow filesystem or None) of a ``ray.train.Checkpoint``, a path or a URI."""
    return str(getattr(checkpoint, "path", checkpoint)).rstrip("/"), getattr(checkpoint, "filesystem", None)


def checkpoint_uri(checkpoint: Any) -> str:
    """Where ``checkpoint`` is: a ``ray.train.Checkpoint``'s path with its filesystem's scheme (``s3://...``;
    none for a local one), or the path or URI given."""
    path, fs = _location(checkpoint)
    inner = getattr(getattr(fs, "handler", None), "fs", None)  # an fsspec filesystem in pyarrow's FSSpecHandler
    if inner is not None:
        protocol = inner.protocol[0] if isinstance(inner.protocol, tuple) else inner.protocol
        kind = "local" if protocol in ("file", "local") else protocol
    else:
        kind = getattr(fs, "type_name", "local") if fs is not None else "local"
    return path if kind == "local" else f"{kind}://{path}"


def read_pointer(checkpoint: Any, **storage_options: Any) -> dict[str, Any] | None:
    """The pointer held by ``checkpoint`` (a ``ray.train.Checkpoint``, or a folder's path or URI, read with
    ``storage_options``), None when it holds none (e.g. it is a snapshot folder itself).

    Raises:
        ValueError: ``POINTER_FILE`` is there but is not a raycheck pointer (unreadable JSON, another format).
        storage.backend.StorageError: the folder cannot be read.
    """
    path, fs = _location(checkpoint)
    target = f"{path}/{POINTER_FILE}"
    try:
        if fs is not None:
            with fs.open_input_stream(target) as f:
                blob = f.read()
        else:
            blob = Storage(path, create=False, **storage_options).get(POINTER_FILE)
    except FileNotFoundError:
        return None
    try:
        found = json.loads(blob)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{target} is not a raycheck snapshot pointer: unreadable JSON ({exc})") from exc
    if not isinstance(found, dict) or found.get("format") != POINTER_FORMAT:
        raise ValueError(f"{target} is not a raycheck snapshot pointer (format {POINTER_FORMAT!r} expected)")
    if not isinstance(found.get("snapshot"), str) or not found["snapshot"]:
        raise ValueError(f"{target} is a raycheck snapshot pointer without its snapshot's URI ('snapshot')")
    return found


def snapshot_uri(checkpoint: Any, **storage_options: Any) -> str:
    """The URI of the snapshot ``checkpoint`` stands for: a pointer checkpoint's target, else the
    checkpoint's own location (a snapshot folder's path, ``file://`` or ``s3://`` URI, or a
    ``ray.train.Checkpoint`` on such a folder).

    Raises:
        FileNotFoundError: ``checkpoint`` is None.
        ValueError: a malformed pointer (``read_pointer``).
    """
    if checkpoint is None:
        raise FileNotFoundError("no checkpoint to load (None: e.g. the Result.checkpoint of a run that reported none)")
    found = read_pointer(checkpoint, **storage_options)
    return str(found["snapshot"]) if found is not None else checkpoint_uri(checkpoint)


def is_one_snapshot(checkpoint: Any, **storage_options: Any) -> bool:
    """Whether ``checkpoint`` stands for one snapshot (a pointer, or a folder named ``step-...``), not a store."""
    return read_pointer(checkpoint, **storage_options) is not None or checkpoint_uri(checkpoint).rsplit("/", 1)[-1].startswith("step-")


def store_root(uri: str) -> str:
    """``uri``, or for a local run directory (the ``--out`` of ``raycheck run``: it holds ``snapshots/``) its
    ``snapshots/`` folder, where the run's store is by default."""
    folder = local_path(uri)
    return str(folder / "snapshots") if folder is not None and (folder / "snapshots").is_dir() else uri


def store_at(root: str, **storage_options: Any) -> SnapshotStore:
    """The store whose folder is ``root`` (``store_root``: a run directory means its ``snapshots/``): a
    ``storage.dcp_store.ShardedStore`` for its ``sharded/`` folder (FSDP2 checkpoints), or for ``root``
    itself when only sharded checkpoints are there (an FSDP2 run's storage), else a ``SnapshotStore``."""
    root = store_root(root)
    parent, _, last = root.rpartition("/")
    if last == SUBFOLDER and parent:
        return ShardedStore(Storage(parent, create=False, **storage_options), create=False)
    storage = Storage(root, create=False, **storage_options)
    plain = SnapshotStore(storage)
    if storage.exists(f"{SUBFOLDER}/{INDEX}") and not plain.list():
        return ShardedStore(storage, create=False)
    return plain


def committed_snapshot(checkpoint: Any, **storage_options: Any) -> tuple[SnapshotStore, SnapshotInfo]:
    """The store (a ``ShardedStore`` for FSDP2 checkpoints) and committed snapshot ``checkpoint`` stands for
    (``snapshot_uri``), checked against its store's index; ``storage_options``: the store's (``storage.backend.Storage``'s, e.g. ``endpoint_url``).

    Raises:
        FileNotFoundError: ``checkpoint`` is None, or the folder is not a committed snapshot of its store (not
            in its index: never committed, or deleted by retention; the message names the store's newest),
            or it is a whole store (the message names its newest snapshot).
        ValueError: a malformed pointer.
        storage.backend.StorageError: the store cannot be read.
    """
    path = snapshot_uri(checkpoint, **storage_options)
    root, _, folder = path.rpartition("/")
    store = store_at(root, **storage_options)
    infos = store.list()
    info = next((i for i in infos if i.folder == folder), None)
    if info is not None:
        return store, info
    inner = store_at(path, **storage_options).list() if not folder.startswith("step-") else []
    if inner:  # the store itself was given
        raise FileNotFoundError(f"{path} is a snapshot store, not one snapshot: its newest is {path}/{inner[-1].folder}")
    newest = max(infos, key=lambda i: i.step, default=None)
    hint = f"; its newest snapshot is {root}/{newest.folder}" if newest is not None else ""
    why = next((reason for reason in store.skipped if reason.startswith(folder + "/")), None)
    if why is not None:  # in the index, but its manifest is gone or altered
        raise FileNotFoundError(f"{path} is in the index of {root} but does not load ({why}){hint}")
    raise FileNotFoundError(f"{path} is not a committed snapshot of {root} (not in its index){hint}")
