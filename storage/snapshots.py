"""Snapshots: safetensors shards by unit, a manifest written last, an index updated before deletion.

Layout under a ``Storage`` root::

    index.json                         committed snapshots, newest last (the commit point)
    step-0000000040-1f2e3d4c/          one folder per attempt (attempt-unique suffix)
        embed.safetensors              one shard per unit: embeddings, each transformer layer,
        layer.000.safetensors          the final norm and the LM head (``storage.units.unit_of``)
        ...
        manifest.json                  written after every shard

Manifest (format 2): ``step`` (the state's step), ``names`` (canonical tensor order), ``config`` (run config hash, layout hash), and ``units``: for each unit its shard's
``path`` (relative to the root, so a composite snapshot may reference shards of older snapshots),
``bytes``, ``sha256``, the ``step`` that unit's tensors belong to, and each tensor's dtype and shape.

Commit protocol (``shared/notes/domain.md``, "Storage commit rules"): shards are written under a
folder unique to the attempt; the manifest is written after every shard; then the index is
rewritten to include the snapshot: that is the commit point. Retention writes the new index
first and only then deletes snapshots that left it, never the newest one and never a shard that a
kept manifest references. A crash at any point leaves the previous index valid, and everything it
lists intact. Readers trust nothing they have not verified: ``load`` checks sizes and sha256 of
every shard before parsing it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from storage.backend import Storage
from storage.units import group_by_unit

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
MANIFEST = "manifest.json"
INDEX = "index.json"


class SnapshotCorruptError(Exception):
    """A snapshot's shards do not match its manifest (missing, truncated, or altered)."""


class NoSnapshotError(Exception):
    """No complete, verified snapshot could be loaded; the message lists what was tried."""


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed snapshot: ``step`` (state after that many steps), its ``folder`` and manifest."""

    step: int
    folder: str
    manifest: dict

    @property
    def bytes(self) -> int:
        """Bytes of every shard the snapshot's state is made of (its own and referenced ones)."""
        return sum(u["bytes"] for u in self.manifest["units"].values())

    @property
    def own_bytes(self) -> int:
        """Bytes of the shards this snapshot wrote itself (an incremental one references the rest)."""
        return sum(u["bytes"] for u in self.manifest["units"].values() if u["path"].startswith(self.folder + "/"))


class SnapshotStore:
    """The snapshots of one run in a ``Storage`` (local disk, S3 or memory).

    Args:
        storage: a ``Storage`` or a URI for one.
        keep_last: committed snapshots to keep (>= 1).
        parallel_puts: shards uploaded concurrently (bounds the serialised bytes held in memory).
    """

    def __init__(self, storage: Storage | str, keep_last: int = 3, parallel_puts: int = 4) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if parallel_puts < 1:
            raise ValueError(f"parallel_puts must be >= 1, got {parallel_puts}")
        self.storage = storage if isinstance(storage, Storage) else Storage(storage)
        self.keep_last = keep_last
        self.parallel_puts = parallel_puts
        self.skipped: list[str] = []
        """Snapshots the last ``list()`` skipped, with the reason (e.g. an indexed one whose manifest is gone)."""

    # -- writing ------------------------------------------------------------------------------
    def write(
        self,
        step: int,
        state: Mapping[str, np.ndarray],
        config: Mapping | None = None,
        unit_steps: Mapping[str, int] | None = None,
    ) -> SnapshotInfo:
        """Persist ``state`` (ordered name -> array) as the snapshot of ``step`` and commit it.

        ``unit_steps`` gives the step of units whose tensors are older than ``step`` (a composite
        state); by default every unit belongs to ``step``. Returns once committed.
        Raises ``storage.backend.StorageError`` (nothing partial is ever listed).
        """
        previous = self.list()
        folder = _attempt_folder(step)
        units = self._put_units(folder, state, group_by_unit(list(state)), step, unit_steps or {})
        return self._commit(previous, folder, step, list(state), config, units)

    def write_units(
        self,
        step: int,
        changed: Mapping[str, np.ndarray],
        names: Sequence[str],
        config: Mapping | None = None,
    ) -> SnapshotInfo:
        """Commit the state of ``step`` incrementally: the units of ``changed`` get new shards, every
        other unit of the layout ``names`` (canonical tensor order) references the newest committed
        snapshot's shard (LayerCheck, arXiv 2026: persist only the units whose update passed a
        threshold). The manifest lists every unit, so the newest snapshot is always a complete
        composite state; ``manifest["units"][u]["step"]`` is the step unit ``u`` belongs to.

        Args:
            step: the state's step (>= the newest committed snapshot's).
            changed: name -> array for whole units; may be empty (a new manifest over old shards).
            names: every tensor name of the layout, in canonical order.
            config: recorded in the manifest.

        Raises:
            ValueError: ``changed`` holds part of a unit or names outside ``names``; a unit not in
                ``changed`` has no committed version, or the committed one holds other tensors;
                ``step`` is older than the newest committed snapshot.
            storage.backend.StorageError: a write failed after retries (nothing is committed).
        """
        layout = group_by_unit(names)
        new_units = group_by_unit(changed)
        problems = [f"unit {u}: got tensors {ns[:3]}..., the layout has {layout.get(u, [])[:3]}..."
                    for u, ns in new_units.items() if ns != layout.get(u)]
        previous = self.list()
        base = previous[-1] if previous else None
        if base is not None and base.step > step:
            problems.append(f"step {step} is older than the newest committed snapshot (step {base.step})")
        for unit, unit_names in layout.items():
            spec = base.manifest["units"].get(unit) if base is not None else None
            if unit in new_units:
                continue
            if spec is None:
                problems.append(f"unit {unit} is not in the new tensors and has no committed version to reference")
            elif list(spec["tensors"]) != unit_names:
                problems.append(f"unit {unit}: the committed version ({base.folder}) holds other tensors than the layout")
        if problems:
            raise ValueError("cannot write the composite snapshot of step %d:\n  %s" % (step, "\n  ".join(problems)))
        folder = _attempt_folder(step)
        written = self._put_units(folder, changed, new_units, step, {})
        units = {u: written[u] if u in written else base.manifest["units"][u] for u in layout}
        return self._commit(previous, folder, step, list(names), config, units)

    def _put_units(self, folder: str, state: Mapping[str, np.ndarray], units: Mapping[str, list[str]], step: int,
                   unit_steps: Mapping[str, int]) -> dict[str, dict]:
        """Write one safetensors shard per unit under ``folder``; returns the manifest entries."""
        entries, in_flight = {}, []
        with concurrent.futures.ThreadPoolExecutor(self.parallel_puts, thread_name_prefix="snapshot-put") as pool:
            for unit, names in units.items():
                blob = st_save({n: np.ascontiguousarray(state[n]) for n in names})
                path = f"{folder}/{unit}.safetensors"
                in_flight.append(pool.submit(self.storage.put, path, blob))  # hashing below overlaps the upload
                entries[unit] = {
                    "path": path,
                    "bytes": len(blob),
                    "sha256": hashlib.sha256(blob).hexdigest(),
                    "step": unit_steps.get(unit, step),
                    "tensors": {n: {"dtype": state[n].dtype.str, "shape": list(state[n].shape)} for n in names},
                }
                del blob
                if len(in_flight) >= self.parallel_puts:  # bounded memory: at most parallel_puts shards in flight
                    in_flight.pop(0).result()
            for future in in_flight:
                future.result()
        return entries

    def _commit(self, previous: list[SnapshotInfo], folder: str, step: int, names: list[str], config: Mapping | None,
                units: dict[str, dict]) -> SnapshotInfo:
        """Write the manifest (after every shard), then the index (the commit point), then retain."""
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "created_unix_s": time.time(),
            "names": names,
            "config": dict(config or {}),
            "units": units,
        }
        self.storage.put(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        info = SnapshotInfo(step, folder, manifest)
        committed = previous + [info]
        self._write_index(committed)
        self._retain(committed)
        return info

    def _write_index(self, infos: list[SnapshotInfo]) -> None:
        body = {"format_version": FORMAT_VERSION, "snapshots": [i.folder for i in sorted(infos, key=_order)]}
        self.storage.put(INDEX, json.dumps(body, indent=1).encode())

    def _retain(self, committed: list[SnapshotInfo]) -> None:
        ordered = sorted(committed, key=_order)
        keep, drop = ordered[-self.keep_last:], ordered[: -self.keep_last]
        live = {u["path"].split("/")[0] for i in keep for u in i.manifest["units"].values()} | {i.folder for i in keep}
        if drop:
            self._write_index(keep)  # the index moves first: a crash now leaves only unlisted folders
        newest = ordered[-1].step
        for path in self.storage.list():
            folder = path.split("/")[0]
            if folder in live or not folder.startswith("step-"):
                continue
            if any(d.folder == folder for d in drop) or int(folder.split("-")[1]) < newest:
                try:
                    self.storage.delete(path)
                except OSError as exc:
                    log.warning("retention could not delete %s: %s", path, exc)

    # -- reading ------------------------------------------------------------------------------
    def list(self) -> list[SnapshotInfo]:
        """Committed snapshots, oldest first. Uses the index; without a readable index, scans for
        manifests. Entries whose manifest is missing or unreadable are skipped with a warning."""
        try:
            folders = json.loads(self.storage.get(INDEX))["snapshots"]
        except FileNotFoundError:
            folders = sorted({p.split("/")[0] for p in self.storage.list() if p.endswith("/" + MANIFEST)})
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError) as exc:
            log.warning("%s: unreadable index (%s); scanning for manifests", self.storage.url(INDEX), exc)
            folders = sorted({p.split("/")[0] for p in self.storage.list() if p.endswith("/" + MANIFEST)})
        infos, self.skipped = [], []
        for folder in folders:
            try:
                manifest = json.loads(self.storage.get(f"{folder}/{MANIFEST}"))
                if manifest.get("format_version") != FORMAT_VERSION:
                    raise ValueError(f"format {manifest.get('format_version')}, expected {FORMAT_VERSION}")
                infos.append(SnapshotInfo(int(manifest["step"]), folder, manifest))
            except FileNotFoundError:
                self.skipped.append(f"{folder}/{MANIFEST}: missing")
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
                self.skipped.append(f"{folder}/{MANIFEST}: unreadable ({exc})")
        for problem in self.skipped:
            log.warning("snapshot skipped: %s", problem)
        return sorted(infos, key=_order)

    def verify(self, info: SnapshotInfo) -> list[str]:
        """Problems with ``info``'s shards (empty when every size and sha256 matches)."""
        return [problem for _, problem in self._read_units(info) if problem]

    def _read_units(self, info: SnapshotInfo, units: list[str] | None = None):
        for unit in info.manifest["units"] if units is None else units:
            spec = info.manifest["units"][unit]
            try:
                blob = self.storage.get(spec["path"])
            except FileNotFoundError:
                yield None, f"{spec['path']}: missing"
                continue
            if len(blob) != spec["bytes"]:
                yield None, f"{spec['path']}: {len(blob)} bytes, manifest says {spec['bytes']} (truncated?)"
            elif hashlib.sha256(blob).hexdigest() != spec["sha256"]:
                yield None, f"{spec['path']}: sha256 differs from the manifest (corrupt)"
            else:
                yield blob, None

    def load_units(self, info: SnapshotInfo, units: list[str]) -> dict[str, np.ndarray]:
        """The verified tensors of ``units`` of ``info`` (name -> array).

        Raises:
            SnapshotCorruptError: a shard is missing, truncated or altered, or holds other tensors
                than its manifest lists (the message names it).
        """
        tensors: dict[str, np.ndarray] = {}
        for unit, (blob, problem) in zip(units, self._read_units(info, units)):
            if problem:
                raise SnapshotCorruptError(f"snapshot {info.folder} in {self.storage.url()}: unit {unit}, {problem}")
            loaded = st_load(blob)
            if set(loaded) != set(info.manifest["units"][unit]["tensors"]):
                raise SnapshotCorruptError(f"snapshot {info.folder}: unit {unit} holds other tensors than its manifest lists")
            tensors.update(loaded)
        return tensors

    def load(self, info: SnapshotInfo) -> dict[str, np.ndarray]:
        """The verified state of ``info`` in canonical order.

        Raises:
            SnapshotCorruptError: a shard is missing, truncated or altered (the message names it).
        """
        tensors = self.load_units(info, list(info.manifest["units"]))
        return {n: tensors[n] for n in info.manifest["names"]}

    def load_latest(self, max_step: int | None = None) -> Loaded:
        """The newest snapshot (at most ``max_step``) that verifies; corrupt ones are skipped, logged
        and listed in ``Loaded.skipped``.

        Raises:
            NoSnapshotError: none loads; the message names each snapshot tried and why it failed.
        """
        tried = []
        for info in reversed(self.list()):
            if max_step is not None and info.step > max_step:
                continue
            try:
                return Loaded(info, self.load(info), tried)
            except SnapshotCorruptError as exc:
                log.warning("skipping %s", exc)
                tried.append(str(exc))
        raise NoSnapshotError(f"no loadable snapshot in {self.storage.url()}; tried: {tried or 'none found'}")


class Loaded(NamedTuple):
    """A loaded snapshot, and the newer ones that were skipped (with the reason)."""

    info: SnapshotInfo
    state: dict[str, np.ndarray]
    skipped: list[str]


def _attempt_folder(step: int) -> str:
    """A folder name unique to this write attempt (never reused after a failed one)."""
    return f"step-{step:010d}-{uuid.uuid4().hex[:8]}"


def _order(info: SnapshotInfo) -> tuple:
    return (info.step, info.manifest["created_unix_s"])
