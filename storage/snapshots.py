"""Snapshots on local disk: safetensors shard + manifest written last, verified before trust.

Layout under ``root``::

    step-0000000040-1f2e3d4c/          one folder per attempt (attempt-unique suffix)
        model.safetensors              the parameter state, tensors in canonical order
        manifest.json                  written last: the snapshot counts only once this exists

Commit protocol (what peers converged on; ``shared/notes/domain.md``): shards are written under a
folder unique to the attempt and fsynced; the manifest (sizes, sha256 of every file, step, layout)
is written to a temporary name, fsynced and renamed, then the folder is fsynced. A crash at any
point leaves either a complete snapshot or a folder without manifest, which is never listed.
Retention removes a snapshot's manifest before its data, so a half-deleted snapshot is never listed,
and never removes the newest complete snapshot (the current restore point).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from training.state import state_sha256

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD = "model.safetensors"


class SnapshotCorruptError(Exception):
    """A snapshot's files do not match its manifest (missing, truncated, or altered)."""


class NoSnapshotError(Exception):
    """No complete, verified snapshot could be loaded; the message lists what was tried."""


@dataclass(frozen=True)
class SnapshotInfo:
    """A complete snapshot: ``step`` (state after that many steps), its folder and parsed manifest."""

    step: int
    path: pathlib.Path
    manifest: dict


def _write_durable(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotStore:
    """Snapshots of one run in a local folder.

    Args:
        root: the folder (created if missing).
        keep_last: complete snapshots to keep (>= 1); older ones are deleted after each write.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last

    def write(self, step: int, state: Mapping[str, np.ndarray], meta: Mapping | None = None) -> SnapshotInfo:
        """Persist ``state`` (ordered name -> array) as the snapshot of ``step``; returns once durable.

        Cost: one serialisation copy in memory plus the write and two sha256 passes (about 2 s for
        SmolLM2-135M's 538 MB here). Raises ``OSError`` from the filesystem; nothing partial is listed.
        """
        folder = self.root / f"step-{step:010d}-{uuid.uuid4().hex[:8]}"
        folder.mkdir()
        blob = st_save(dict(state))
        _write_durable(folder / SHARD, blob)
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "created_unix_s": time.time(),
            "names": list(state),
            "state_sha256": state_sha256(state),
            "files": {SHARD: {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}},
            "meta": dict(meta or {}),
        }
        tmp = folder / (MANIFEST + ".tmp")
        _write_durable(tmp, json.dumps(manifest, indent=1).encode())
        os.replace(tmp, folder / MANIFEST)
        _fsync_dir(folder)
        info = SnapshotInfo(step, folder, manifest)
        self._retain()
        return info

    def list(self) -> list[SnapshotInfo]:
        """Complete snapshots (manifest present and parseable), oldest step first."""
        found = []
        for folder in sorted(self.root.glob("step-*")):
            try:
                manifest = json.loads((folder / MANIFEST).read_text())
            except (FileNotFoundError, NotADirectoryError):
                continue
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                log.warning("snapshot %s: unreadable manifest (%s); skipped", folder.name, exc)
                continue
            found.append(SnapshotInfo(int(manifest["step"]), folder, manifest))
        return sorted(found, key=lambda i: (i.step, i.manifest["created_unix_s"]))

    def load(self, info: SnapshotInfo) -> dict[str, np.ndarray]:
        """The verified state of ``info`` (ordered as saved).

        Raises:
            SnapshotCorruptError: a file is missing, has the wrong size, or its sha256 differs.
        """
        spec = info.manifest["files"][SHARD]
        try:
            blob = (info.path / SHARD).read_bytes()
        except FileNotFoundError as exc:
            raise SnapshotCorruptError(f"{info.path.name}/{SHARD}: missing") from exc
        if len(blob) != spec["bytes"]:
            raise SnapshotCorruptError(f"{info.path.name}/{SHARD}: {len(blob)} bytes, manifest says {spec['bytes']}")
        if hashlib.sha256(blob).hexdigest() != spec["sha256"]:
            raise SnapshotCorruptError(f"{info.path.name}/{SHARD}: sha256 differs from the manifest")
        tensors = st_load(blob)
        return {n: tensors[n] for n in info.manifest["names"]}

    def load_latest(self, max_step: int | None = None) -> tuple[SnapshotInfo, dict[str, np.ndarray]]:
        """The newest snapshot (at most ``max_step``) that verifies; corrupt ones are skipped and logged.

        Raises:
            NoSnapshotError: none loads; the message names each snapshot tried and why it failed.
        """
        tried = []
        for info in reversed(self.list()):
            if max_step is not None and info.step > max_step:
                continue
            try:
                return info, self.load(info)
            except SnapshotCorruptError as exc:
                log.warning("skipping snapshot: %s", exc)
                tried.append(str(exc))
        raise NoSnapshotError(f"no loadable snapshot under {self.root}; tried: {tried or 'none found'}")

    def _retain(self) -> None:
        complete = self.list()
        for info in complete[: -self.keep_last]:
            self._delete(info.path)
        newest = complete[-1].step if complete else -1
        for folder in self.root.glob("step-*"):
            if not (folder / MANIFEST).exists() and int(folder.name.split("-")[1]) < newest:
                self._delete(folder)  # leftovers of an attempt that never committed

    @staticmethod
    def _delete(folder: pathlib.Path) -> None:
        try:
            (folder / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(folder)
        except OSError as exc:
            log.warning("retention could not delete %s: %s", folder, exc)
