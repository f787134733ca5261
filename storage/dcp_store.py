"""Sharded checkpoints: torch DCP files written per rank through ``Storage``, committed by our index.

A training state whose tensors are DTensors (FSDP2, ``torch.distributed.fsdp.fully_shard``) is saved
with torch Distributed Checkpoint (DCP, ``torch.distributed.checkpoint``): each rank writes the chunks
it holds, rank 0 the metadata (global shapes, each chunk's offsets and file). A load plans each rank's
reads from that metadata for the sharding of the state it loads into, so a checkpoint written at W
ranks loads at any other world size (torch's own resharding; no code of ours).

Layout under the run's storage, beside the safetensors snapshots (``SUBFOLDER``; ``SnapshotStore``
ignores it)::

    sharded/index.json                           the commit point (``SnapshotStore``'s, CAS and fenced)
    sharded/step-0000000040-<run>-<epoch>-<id>/  one folder per attempt
        __0_0.distcp  __1_0.distcp  ...           DCP: one file per rank
        .metadata                                 DCP: written by rank 0 once every rank has written
        manifest.json                             ours, written last by rank 0: size and sha256 of each file

A composite (layer-wise) checkpoint writes the tensors of some units only (``storage.units``: a layer, its
weights and optimizer state together), each unit a DCP checkpoint of its own (``<folder>/<unit>/``: its
ranks' files and ``.metadata``); its manifest's ``layers`` names, for every unit, the folder holding that
unit's rows (its own, or an older checkpoint's) and the step they belong to, and its ``units`` list the
files of every folder it reads from, so retention keeps exactly those. A load reads each folder through
its DCP metadata. A checkpoint without ``layers`` holds every unit itself, in one DCP checkpoint.

Commit rules (``storage.snapshots``): the files go under a folder unique to the attempt, each one put
atomically (``Storage.put``: fsynced local files, whole S3 objects); every rank reports the size and
sha256 of the bytes it wrote; rank 0 writes the manifest, then the index entry: that is the commit.
A crash before it leaves the previous checkpoint the newest one listed. A load verifies every file
against the manifest before DCP reads it (``SnapshotCorruptError`` naming the file), and DCP checks its
metadata against the state loaded into (names, global shapes).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import time
import warnings
from collections.abc import Generator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raycheck.storage.backend import Storage, StorageError
from raycheck.storage.manifest import FOLDER, folder_step, layout_sha256
from raycheck.storage.snapshots import NoSnapshotError, SnapshotCorruptError, SnapshotInfo, SnapshotStore, layers_of
from raycheck.storage.tensor_files import as_numpy
from raycheck.storage.units import group_by_unit, unit_of

SUBFOLDER = "sharded"
FORMAT = "raycheck-dcp-1"
"""The ``format_version`` of a sharded checkpoint's manifest."""
DCP_METADATA = ".metadata"


def _first_failure(exc: CheckpointException) -> str:
    """``rank R: ErrorType: message`` of the lowest failing rank of a DCP collective."""
    rank = min(exc.failures)
    error = exc.failures[rank][0]
    return f"rank {rank}: {type(error).__name__}: {error}"


class _Buffer(io.BytesIO):
    """A write stream that keeps its bytes after DCP closes it."""

    _closed_value = b""

    def close(self) -> None:
        if not self.closed:
            self._closed_value = self.getvalue()
        super().close()

    def value(self) -> bytes:
        return self._closed_value if self.closed else self.getvalue()


class _StorageFS(FileSystemBase):
    """DCP's file operations over a ``Storage``: paths are relative to its root. A written stream is
    put whole when it closes (atomic, retried); ``written`` records (bytes, sha256) of each. A read
    stream is verified against ``expected`` (path -> manifest entry) before DCP parses it."""

    def __init__(self, storage: Storage, expected: Mapping[str, dict[str, Any]] | None = None) -> None:
        self.storage, self.expected = storage, expected or {}
        self.written: dict[str, tuple[int, str]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        path = str(path)
        if "w" in mode:
            stream = _Buffer()
            yield stream
            data = stream.value()
            self.storage.put(path, data)
            self.written[path] = (len(data), hashlib.sha256(data).hexdigest())
            return
        data = self.storage.get(path)
        spec = self.expected.get(path)
        if spec is None or len(data) != spec["bytes"] or hashlib.sha256(data).hexdigest() != spec["sha256"]:
            raise SnapshotCorruptError(f"{self.storage.url(path)}: {len(data)} bytes whose sha256 differs from the manifest "
                                       "(corrupt or not part of the checkpoint)")
        yield io.BytesIO(data)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{path}/{suffix}"

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:  # DCP writes .metadata.tmp, then renames it
        self.storage.put(str(new_path), self.storage.get(str(path)))
        self.written[str(new_path)] = self.written.pop(str(path))
        self.storage.delete(str(path))

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return str(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        pass  # object paths need no folders; a local put creates its folder

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.storage.exists(str(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.storage.delete(str(path))


def _folder_problems(manifest: object, folder: str) -> list[str]:
    """What is wrong with ``manifest`` as the manifest of sharded checkpoint ``folder`` (empty: nothing)."""
    keys = ("format_version", "step", "created_unix_s", "run", "config", "world_size", "layout_sha256", "units")
    if not isinstance(manifest, dict) or any(k not in manifest for k in keys):
        return [f"not a sharded checkpoint manifest (keys {', '.join(keys)})"]
    if manifest["format_version"] != FORMAT:
        return [f"format {manifest['format_version']!r}, expected {FORMAT}"]
    problems = [] if manifest["step"] == folder_step(folder) else [f"step {manifest['step']!r} differs from the folder's"]
    units, layers = manifest["units"], manifest.get("layers")
    if not isinstance(units, dict):
        return problems + ["units is not a mapping"]
    sources = {folder}
    if layers is not None:
        if not (isinstance(layers, dict) and layers and all(
                isinstance(s, dict) and isinstance(s.get("step"), int) and s["step"] <= manifest["step"]
                and isinstance(s.get("folder"), str) and FOLDER.match(s["folder"].split("/")[0]) for s in layers.values())):
            return problems + ["layers: needs unit -> {step (at most the checkpoint's), folder (a checkpoint folder or one's unit)}"]
        sources = {s["folder"] for s in layers.values()}
    paths = [u.get("path") for u in units.values() if isinstance(u, dict)]
    for source in sorted(sources):
        if f"{source}/{DCP_METADATA}" not in paths:
            problems.append(f"no {source}/{DCP_METADATA} among its files")
    roots = {s.split("/")[0] for s in sources} | {folder}
    for name, spec in units.items():  # its own files by name, the files of the folders it reads from by path
        own = f"{folder}/{name}"
        if not (isinstance(spec, dict) and spec.get("path") in (own, name) and str(spec["path"]).split("/")[0] in roots
                and isinstance(spec.get("bytes"), int) and isinstance(spec.get("sha256"), str) and len(spec["sha256"]) == 64):
            problems.append(f"file {name!r}: needs path {own} (or a path in a folder of its layers), bytes and sha256")
    return problems


def global_layout(state: Mapping[str, torch.Tensor]) -> list[list[Any]]:
    """``[[name, torch dtype, global shape], ...]`` of ``state`` (a DTensor's ``shape`` is its global
    one): the same at every world size."""
    return [[n, str(t.dtype), list(t.shape)] for n, t in state.items()]


class Saved(NamedTuple):
    """A sharded save as one rank sees it: the committed checkpoint (rank 0; None elsewhere) and the
    bytes of the files this rank wrote."""

    info: SnapshotInfo | None
    rank_bytes: int


class ShardedStore(SnapshotStore):
    """A run's sharded checkpoints (see the module docstring): ``SnapshotStore``'s index, retention,
    fencing and verification, over DCP files instead of safetensors shards. ``save`` and ``restore``
    are collectives: every rank of ``group`` calls them, in the same order.

    Args:
        storage: the run's snapshot storage (a ``Storage`` or URI); checkpoints go under ``SUBFOLDER``.
        keep_last, identity, epoch: as ``SnapshotStore``.
        create: make a missing local ``SUBFOLDER`` (False for read-only tools).
    """

    def __init__(self, storage: Storage | str, keep_last: int = 3, create: bool = True, **kw: Any) -> None:
        root = storage if isinstance(storage, Storage) else Storage(storage)
        sub = Storage(f"{root.uri.rstrip('/')}/{SUBFOLDER}", retry=root.retry, create=create, write_chunk_bytes=root.write_chunk_bytes,
                      write_rate_bytes_per_s=root.write_rate_bytes_per_s, write_direct=root.write_direct, **root.options)
        super().__init__(sub, keep_last=keep_last, **kw)

    def _manifest_problems(self, manifest: object, folder: str) -> list[str]:
        return _folder_problems(manifest, folder)

    def save(self, step: int, state: Mapping[str, torch.Tensor], config: Mapping[str, Any] | None = None,
             group: dist.ProcessGroup | None = None, layout: list[list[Any]] | None = None) -> Saved:
        """Write ``state`` (name -> tensor or DTensor) as the checkpoint of step ``step`` and commit it. With
        ``layout`` (``global_layout`` of the whole state), ``state`` holds whole units of it only (possibly
        none) and the checkpoint is a composite: every other unit is read from where the newest committed
        checkpoint has it (LayerCheck, arXiv 2026: persist only the units whose update passed a threshold).

        Returns ``Saved``: the committed ``SnapshotInfo`` on rank 0 (of ``group``), and this rank's bytes;
        every rank returns once rank 0 has committed.

        Raises:
            ValueError: (every rank) ``state`` holds part of a unit or names outside ``layout``; a unit not in
                ``state`` has no committed version of this layout to read from; nothing is written.
            storage.backend.StorageError: a rank's put failed (on every rank, naming the first failure);
                nothing is committed. Rank 0's commit failed: its error on rank 0 (e.g. FencedError: a newer
                incarnation owns the run), a StorageError naming it on the others.
        """
        rank = dist.get_rank(group)
        box: list[Any] = [None, None]  # the attempt's folder, or why there is none; rank 0's plan of the composite
        if rank == 0:
            try:
                box = [self._attempt_folder(step), self._composite(step, state, layout) if layout is not None else None]
            except ValueError as exc:
                box = [None, str(exc)]
        dist.broadcast_object_list(box, group=group, group_src=0)
        folder, plan = box
        if folder is None:
            raise ValueError(plan) if plan else RuntimeError(f"rank {rank}: rank 0 broadcast no checkpoint folder for step {step}")
        fs = _StorageFS(self.storage)
        # a composite's units each in a DCP checkpoint of their own (``<folder>/<unit>/``), so that a later
        # composite reading some of them keeps those files alive, not the whole folder
        parts = {f"{folder}/{u}": ns for u, ns in group_by_unit(state).items()} if layout is not None else {folder: list(state)}
        try:
            for path, names in parts.items():
                writer = FileSystemWriter(path, sync_files=False)  # Storage.put syncs; DCP's fsync would sync the machine
                writer.fs = fs  # type: ignore[assignment]  # torch types fs as its FileSystem; any FileSystemBase is supported
                dcp.save({n: state[n] for n in names}, storage_writer=writer, process_group=group)
        except CheckpointException as exc:
            raise StorageError(f"sharded checkpoint of step {step} in {self.storage.url(folder)} not written, nothing committed "
                               f"(the previous one stays the newest): {_first_failure(exc)}") from exc
        files: list[dict[str, tuple[int, str]]] = [{}] * dist.get_world_size(group)  # all_gather_object fills each
        dist.all_gather_object(files, fs.written, group=group)
        info, failure = None, None
        if rank == 0:
            try:
                info = self._commit_files(step, folder, files, config, state, layout, plan)
            except Exception as exc:  # told to every rank first, then raised here
                failure = exc
        outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(outcome, group=group, group_src=0)  # every rank returns once rank 0 has committed
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise StorageError(f"sharded checkpoint of step {step} not committed by rank 0 (the previous one stays the newest): {outcome[0]}")
        return Saved(info, sum(n for n, _ in fs.written.values()))

    def _commit_files(self, step: int, folder: str, files: list[dict[str, tuple[int, str]]], config: Mapping[str, Any] | None,
                      state: Mapping[str, torch.Tensor], layout: list[list[Any]] | None, plan: dict[str, Any] | None) -> SnapshotInfo:
        """Rank 0: the manifest of the files every rank wrote (``files``, by rank) and the commit."""
        units = {p.split("/", 1)[1]: {"path": p, "bytes": n, "sha256": sha} for w in files for p, (n, sha) in w.items()}
        manifest = {"format_version": FORMAT, "step": step, "created_unix_s": time.time(),
                    "run": self.identity.as_dict() if self.identity is not None else None, "config": dict(config or {}),
                    "world_size": len(files), "layout_sha256": layout_sha256(layout if layout is not None else global_layout(state)),
                    "units": units, "names": [n for n, _, _ in layout] if layout is not None else list(state)}
        if plan is not None:
            manifest.update(units={**units, **plan["files"]},
                            layers={u: {"step": step, "folder": f"{folder}/{u}"} if u in plan["written"] else plan["layers"][u]
                                    for u in group_by_unit(n for n, _, _ in layout or ())})
        return self._commit_manifest(folder, manifest)

    def _composite(self, step: int, state: Mapping[str, torch.Tensor], layout: list[list[Any]]) -> dict[str, Any]:
        """Rank 0's plan of a composite: ``written`` (the units of ``state``), ``layers`` (unit -> where the
        newest committed checkpoint has it, for the others) and ``files`` (the files of those folders).

        Raises:
            ValueError: as ``save``.
        """
        units, written = group_by_unit(n for n, _, _ in layout), group_by_unit(state)
        problems = [f"unit {u}: got tensors {ns[:3]}, the layout has {units.get(u, [])[:3]}" for u, ns in written.items() if ns != units.get(u)]
        others = [u for u in units if u not in written]
        base = next((i for i in reversed(self.list()) if i.manifest["layout_sha256"] == layout_sha256(layout)), None) if others else None
        if base is not None and base.step > step:
            problems.append(f"step {step} is older than the newest committed checkpoint (step {base.step})")
        layers = {u: s for u, s in (layers_of(base) if base is not None else {}).items() if u in others}
        problems += [f"unit {u} is not in the new tensors and has no committed version to read from" for u in others if u not in layers]
        if problems:
            raise ValueError(f"cannot write the composite checkpoint of step {step}: {'; '.join(problems)}")
        sources = {s["folder"] for s in layers.values()}
        files = {spec["path"]: spec for spec in (base.manifest["units"].values() if base is not None else ())
                 if spec["path"].rsplit("/", 1)[0] in sources}
        return {"written": list(written), "layers": layers, "files": files}

    def _sources(self, info: SnapshotInfo, names: list[str]) -> dict[str, list[str]]:
        """Folder -> the tensors of ``names`` checkpoint ``info`` reads from it."""
        layers = info.manifest.get("layers")
        by_folder: dict[str, list[str]] = {}
        for name in names:
            by_folder.setdefault(layers[unit_of(name)]["folder"] if layers else info.folder, []).append(name)
        return by_folder

    def restore(self, state: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None = None) -> tuple[SnapshotInfo, list[str]]:
        """Load the newest committed checkpoint of ``state``'s global layout into ``state`` in place, at
        this world size (DCP reshards); every file is verified first, the ranks sharing that work.

        Returns the checkpoint loaded and the newer ones skipped, each with the reason (corrupt,
        missing file, other layout, foreign run).

        Raises:
            NoSnapshotError: none loads (``state`` is untouched); the message names each one tried.
            SnapshotCorruptError: DCP failed to read a checkpoint whose files had verified.
        """
        expected = layout_sha256(global_layout(state))
        infos, tried = self.list(), list(self.skipped)
        for info in reversed(infos):
            if info.manifest["layout_sha256"] != expected:
                tried.append(f"sharded checkpoint {info.folder}: another layout (another model)")
                continue
            problems = self.load_into(info, state, group)
            if problems:
                tried.append(f"sharded checkpoint {info.folder} in {self.storage.url()}: {'; '.join(problems)}")
                continue
            return info, tried
        raise NoSnapshotError(f"no loadable sharded checkpoint in {self.storage.url()}; tried: {'; '.join(tried) or 'none found'}")

    def load_into(self, info: SnapshotInfo, state: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None = None,
                  local: bool = False) -> list[str]:
        """Load checkpoint ``info`` into ``state`` (name -> tensor or DTensor, its global layout) in place, at
        this world size, after verifying every file (the ranks of ``group`` share that work; a process
        without torch.distributed, or ``local`` (whole plain tensors read by this process alone), verifies
        and reads them all). Returns the problems found in its files (nothing loaded then); ``[]``: loaded.

        Raises:
            SnapshotCorruptError: DCP failed to read a checkpoint whose files had verified.
        """
        distributed = not local and dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
        units = sorted(info.manifest["units"])
        per_rank: list[list[str]] = [[]] * world  # all_gather_object fills each
        mine = self.verify_units(info, units[rank::world])
        if distributed:
            dist.all_gather_object(per_rank, mine, group=group)
        else:
            per_rank = [mine]
        problems = [p for ps in per_rank for p in ps]
        if problems:
            return problems
        try:
            with warnings.catch_warnings():  # without torch.distributed DCP warns that it loads in one process: the intent
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                for folder, names in self._sources(info, list(state)).items():  # a composite: each folder's units
                    dcp.load({n: state[n] for n in names}, storage_reader=self._reader(info, folder),
                             process_group=group if distributed else None, no_dist=not distributed)
        except CheckpointException as exc:  # the files verified a moment ago: changed since, or another layout
            raise SnapshotCorruptError(f"sharded checkpoint {info.folder} in {self.storage.url()} failed to load after "
                                       f"its files verified (the state is partly overwritten; restart the workers): "
                                       f"{_first_failure(exc)}") from exc
        return []

    def _reader(self, info: SnapshotInfo, folder: str) -> FileSystemReader:
        """DCP's reader of ``folder`` (``info``'s own or one its layers read from), verifying each file."""
        reader = FileSystemReader(folder)
        reader.fs = _StorageFS(self.storage, {u["path"]: u for u in info.manifest["units"].values()})  # type: ignore[assignment]  # as in save
        return reader

    def tensor_layout(self, info: SnapshotInfo) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Name -> (dtype, global shape) of every tensor of checkpoint ``info`` (DCP's ``.metadata``).

        Raises:
            SnapshotCorruptError: the metadata file is missing or altered.
        """
        problems = self.verify_units(info, [u for u in info.manifest["units"] if u.endswith(DCP_METADATA)])
        if problems:
            raise SnapshotCorruptError(f"sharded checkpoint {info.folder} in {self.storage.url()}: {'; '.join(problems)}")
        layers = info.manifest.get("layers")
        found: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for folder in dict.fromkeys(s["folder"] for s in layers.values()) if layers else [info.folder]:
            metadata = self._reader(info, folder).read_metadata()
            found.update({name: (m.properties.dtype, tuple(m.size)) for name, m in metadata.state_dict_metadata.items()
                          if isinstance(m, TensorStorageMetadata) and (not layers or layers.get(unit_of(name), {}).get("folder") == folder)})
        return {n: found[n] for n in info.manifest.get("names", found) if n in found}

    def load(self, info: SnapshotInfo, units: list[str] | None = None) -> dict[str, np.ndarray]:
        """The whole state of checkpoint ``info``, every tensor gathered from the ranks' rows (DCP reads
        them into full tensors here: no process group needed), as numpy arrays (bfloat16 as its bits,
        ``storage.tensor_files.as_numpy``), in the checkpoint's order. ``units`` is not supported (a
        sharded checkpoint's files hold rows, not units).

        Raises:
            SnapshotCorruptError: a file is missing, truncated or altered.
        """
        if units is not None:
            raise ValueError("a sharded checkpoint is read whole (its files hold rows of every tensor, not units)")
        state = {name: torch.empty(shape, dtype=dtype) for name, (dtype, shape) in self.tensor_layout(info).items()}
        problems = self.load_into(info, state, local=True)
        if problems:
            raise SnapshotCorruptError(f"sharded checkpoint {info.folder} in {self.storage.url()}: {'; '.join(problems)}")
        return {name: as_numpy(t) for name, t in state.items()}

    def verify_units(self, info: SnapshotInfo, units: list[str]) -> list[str]:
        """Problems with the files ``units`` of ``info`` (missing, truncated, sha256 differs)."""
        return [problem for _, problem in self._read_units(info, units) if problem]

