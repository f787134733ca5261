"""Snapshots: safetensors shards by unit, a manifest written last, an index updated before deletion.

Layout under a ``Storage`` root::

    index.json                         the commit point: committed snapshots (folder and the sha256 of
                                       its manifest), the writer epoch of each run, a generation count
    step-0000000040-1a2b3c4d-2-1f2e3d4c/  one folder per attempt: step, run tag (sha256 of the run id),
        embed.safetensors              writer epoch, attempt id. One shard per unit: embeddings, each
        layer.000.safetensors          layer, the final norm and the LM head (``storage.units.unit_of``)
        ...
        manifest.json                  written after every shard

Manifest (format 3, ``storage.manifest``): ``step`` (the state's step, equal to the folder's),
``run`` (run id and trajectory sha256; null for a merge result or a store-wide tool), ``layout_sha256``
(names, dtypes, shapes), ``names`` (canonical tensor order), ``config``, and ``units``: for each unit
its shard's ``path`` (``<snapshot folder>/<unit>.safetensors``; a composite references shards of older
snapshots), ``bytes``, ``sha256``, the ``step`` that unit's tensors belong to (at most the snapshot's),
and each tensor's dtype and shape.

Commit protocol (``docs/algorithms.md``, "Storage commit rules"): shards are written under a
folder unique to the attempt; the manifest is written after every shard; then the index is
rewritten to include the snapshot and its manifest's sha256: that is the commit point. Index writes
are compare-and-swap (``Storage.put_if_match``) and fenced: each run has a writer epoch in the index,
raised by ``claim_epoch`` at each driver incarnation, and a writer whose epoch is older than the
index's raises ``FencedError`` instead of writing. Retention writes the new index first and only then
deletes snapshots that left it, only its own run's, never the one just committed, never the newest
one that verifies, and never a shard that a kept manifest references; it also deletes the temp files
of writes killed midway anywhere in the store, once unmodified for ``temp_max_age_s`` (never a live
writer's: ``storage.backend.TEMP_MAX_AGE_S``). A crash at any point leaves the
previous index valid, and everything it lists intact. Readers trust nothing they have not verified:
``list`` checks each manifest's sha256 against the index and its schema; ``load`` checks sizes and
sha256 of every shard before parsing it.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import hashlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from raycheck.storage.backend import TEMP_MAX_AGE_S, PreconditionFailedError, Storage, StorageError
from raycheck.storage import tensor_files
from raycheck.storage.tensor_files import load as st_load
from raycheck.storage.manifest import (
    FOLDER as FOLDER,  # re-exported (cli.storage imports it from here)
    FORMAT_VERSION,
    RunIdentity,
    check_name,
    folder_step,
    folder_writer,
    index_entries,
    layout_of,
    layout_sha256,
    manifest_layout,
    manifest_problems,
    other_layout,
    shard_path,
)
from raycheck.storage.units import group_by_unit

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
INDEX = "index.json"
INDEX_ATTEMPTS = 8
"""Compare-and-swap rounds of one index update before giving up (each lost round means another writer won)."""


class SnapshotCorruptError(Exception):
    """A snapshot's shards do not match its manifest (missing, truncated, or altered)."""


class NoSnapshotError(Exception):
    """No complete, verified snapshot could be loaded; the message lists what was tried."""


class FencedError(Exception):
    """This writer's epoch is older than its run's epoch in the index: a newer driver incarnation
    owns the run's snapshots, so this writer (a stray one of a dead driver) must stop."""


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed snapshot: ``step`` (state after that many steps), its ``folder`` and manifest."""

    step: int
    folder: str
    manifest: dict[str, Any]

    @property
    def bytes(self) -> int:
        """Bytes of every shard the snapshot's state is made of (its own and referenced ones)."""
        return sum(u["bytes"] for u in self.manifest["units"].values())

    @property
    def own_bytes(self) -> int:
        """Bytes of the shards this snapshot wrote itself (an incremental one references the rest)."""
        return sum(u["bytes"] for u in self.manifest["units"].values() if u["path"].startswith(self.folder + "/"))

    @property
    def is_merge_result(self) -> bool:
        """A ``raycheck merge`` output: no run identity and a ``merge`` configuration (a new run's starting
        point, never a state on any run's logged trajectory)."""
        return self.manifest["run"] is None and "merge" in self.manifest["config"]


class _Index(NamedTuple):
    raw: bytes | None
    """The index's bytes as read (None: no index yet): the expected value of the next conditional write."""
    entries: list[dict[str, Any]]
    epochs: dict[str, int]
    generation: int


class SnapshotStore:
    """The snapshots in a ``Storage`` (local disk, S3 or memory), seen by one run or store-wide.

    Args:
        storage: a ``Storage`` or a URI for one.
        keep_last: committed snapshots of this run to keep (>= 1).
        parallel_puts: shards uploaded concurrently (bounds the serialised bytes held in memory).
        identity: the run this store writes and restores for. With it, manifests record it, ``list``
            and restores take only this run's snapshots and merge results (the others are named in
            ``skipped`` as foreign), and retention touches only this run's. None: a store-wide
            tool (inspect, verify, merge, benchmarks) that sees every snapshot.
        epoch: this writer's epoch (see ``claim_epoch``); index writes are refused with
            ``FencedError`` once the index holds a newer one for the run.
        layout: the run's parameter layout (``storage.manifest.layout_of``): every write must cover
            it exactly, every restore must match it. None: with an identity, writes must match the
            run's newest snapshot; without one, only empty states are refused.
        temp_max_age_s: retention deletes the temp files of interrupted local writes anywhere in the store
            once unmodified for this many seconds (``Storage.remove_stale_temp_files``).
        step_log: with an identity, the run replays a step log onto what it restores, from the model's
            initial weights on: then only its own whole states are on its trajectory, so a merge result
            or a composite (a unit of an older step than the snapshot's) is skipped. False: a merge
            result (``storage.merge``) may be restored as the run's starting point only, i.e. at or before
            the run's oldest own snapshot (a merge copied in after the run began is foreign).
    """

    def __init__(self, storage: Storage | str, keep_last: int = 3, parallel_puts: int = 4, *,
                 identity: RunIdentity | None = None, epoch: int = 0, layout: list[list[Any]] | None = None,
                 temp_max_age_s: float = TEMP_MAX_AGE_S, step_log: bool = False) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if parallel_puts < 1:
            raise ValueError(f"parallel_puts must be >= 1, got {parallel_puts}")
        self.storage = storage if isinstance(storage, Storage) else Storage(storage)
        self.keep_last = keep_last
        self.parallel_puts = parallel_puts
        self.identity, self.epoch, self.layout = identity, epoch, layout
        self.temp_max_age_s = temp_max_age_s
        self.step_log = step_log
        self.skipped: list[str] = []
        """Snapshots the last ``list()`` skipped, with the reason (malformed, altered, foreign)."""
        self._verified: dict[str, bool] = {}  # folder -> its shards verified (retention's memory, ``_verifies``)

    # -- writing ------------------------------------------------------------------------------
    def claim_epoch(self) -> int:
        """Start a new writer epoch for this run (once per driver incarnation) and return it: from
        now on, writers of the run with an older epoch are fenced. The new epoch is one more than the
        newest the index holds for the run. Raises ``ValueError`` without an identity,
        ``storage.backend.StorageError`` when the index cannot be written."""
        if self.identity is None:
            raise ValueError("claim_epoch needs a run identity")
        start, run_id = self.epoch, self.identity.run_id

        def bump(index: _Index) -> list[dict[str, Any]]:
            self.epoch = max(start, index.epochs.get(run_id, 0)) + 1
            return index.entries

        self._update_index(bump)
        return self.epoch

    def run_epoch(self) -> int:
        """This run's writer epoch in the index (0: none yet), for a tool that writes beside the run at
        its current epoch instead of claiming a new one (which would fence the run's driver).
        Raises ``ValueError`` without an identity."""
        if self.identity is None:
            raise ValueError("run_epoch needs a run identity")
        return self._read_index()[0].epochs.get(self.identity.run_id, 0)

    def write(
        self,
        step: int,
        state: Mapping[str, np.ndarray],
        config: Mapping[str, Any] | None = None,
        unit_steps: Mapping[str, int] | None = None,
    ) -> SnapshotInfo:
        """Persist ``state`` (ordered name -> array) as the snapshot of ``step`` and commit it.

        ``unit_steps`` gives the step of units whose tensors are older than ``step`` (a composite
        state); by default every unit belongs to ``step``. Returns once committed.

        Raises:
            ValueError: ``state`` is empty, does not cover the run's layout, has an unsafe name, or a
                unit step is after ``step`` (nothing is written).
            FencedError: a newer incarnation of the run owns the index (nothing is committed).
            storage.backend.StorageError: a write failed (nothing partial is ever listed).
        """
        units = group_by_unit(list(state))
        bad_steps = {u: s for u, s in (unit_steps or {}).items() if u not in units or not 0 <= s <= step}
        if bad_steps:
            raise ValueError(f"unit steps {bad_steps} name no unit of the state or are not in 0..{step}")
        self._check_layout(step, layout_of(state))
        folder = self._attempt_folder(step)
        written = self._put_units(folder, state, units, step, unit_steps or {})
        return self._commit(folder, step, list(state), config, written)

    def write_units(
        self,
        step: int,
        changed: Mapping[str, np.ndarray],
        names: Sequence[str],
        config: Mapping[str, Any] | None = None,
        full_state: Mapping[str, np.ndarray] | None = None,
    ) -> SnapshotInfo:
        """Commit the state of ``step`` incrementally: the units of ``changed`` get new shards, every
        other unit of the layout ``names`` (canonical tensor order) references the newest committed
        snapshot's shard (LayerCheck, arXiv 2026: persist only the units whose update passed a
        threshold). The manifest lists every unit, so the newest snapshot is always a complete
        composite state; ``manifest["units"][u]["step"]`` is the step unit ``u`` belongs to.

        A referenced shard is verified (size and sha256) first: one that fails is never referenced;
        its unit is rewritten from ``full_state`` when given (then it belongs to ``step``).

        Args:
            step: the state's step (>= the newest committed snapshot's).
            changed: name -> array for whole units; may be empty (a new manifest over old shards).
            names: every tensor name of the layout, in canonical order.
            config: recorded in the manifest.
            full_state: the whole state of ``step`` (name -> array), to rewrite units whose
                committed shard fails verification.

        Raises:
            ValueError: ``changed`` holds part of a unit or names outside ``names``; a unit not in
                ``changed`` has no committed version, the committed one holds other tensors, or its
                shard fails verification and ``full_state`` is not given; ``step`` is older than the
                newest committed snapshot.
            FencedError, storage.backend.StorageError: as ``write``.
        """
        layout = group_by_unit(names)
        new_units = group_by_unit(changed)
        problems = [f"unit {u}: got tensors {ns[:3]}..., the layout has {layout.get(u, [])[:3]}..."
                    for u, ns in new_units.items() if ns != layout.get(u)]
        previous = self.list()
        base = previous[-1] if previous else None
        if base is not None and base.step > step:
            problems.append(f"step {step} is older than the newest committed snapshot (step {base.step})")
        referenced = [u for u in layout if u not in new_units]
        for unit in referenced:
            if base is None or base.manifest["units"].get(unit) is None:
                problems.append(f"unit {unit} is not in the new tensors and has no committed version to reference")
            elif list(base.manifest["units"][unit]["tensors"]) != layout[unit]:
                problems.append(f"unit {unit}: the committed version ({base.folder}) holds other tensors than the layout")
        if problems:
            raise ValueError("cannot write the composite snapshot of step %d:\n  %s" % (step, "\n  ".join(problems)))
        state = dict(changed)
        base_units: dict[str, dict[str, Any]] = {}
        if base is not None:
            base_units = base.manifest["units"]
            rewrite = self._failing_units(base, referenced)
            if rewrite and full_state is None:
                raise ValueError(f"cannot reference the committed shards of step {base.step}: " + "; ".join(rewrite.values()))
            for unit, problem in rewrite.items():
                log.warning("rewriting unit %s instead of referencing a shard that failed verification: %s", unit, problem)
            if full_state is not None:
                state.update({n: full_state[n] for u in rewrite for n in layout[u]})
        committed = {n: t for u in base_units.values() for n, t in u["tensors"].items()}
        self._check_layout(step, [[n, state[n].dtype.str, list(state[n].shape)] if n in state
                                  else [n, committed[n]["dtype"], committed[n]["shape"]] for n in names])
        folder = self._attempt_folder(step)
        written = self._put_units(folder, state, group_by_unit(state), step, {})
        units = {u: written[u] if u in written else base_units[u] for u in layout}
        return self._commit(folder, step, list(names), config, units)

    def _failing_units(self, base: SnapshotInfo, units: list[str]) -> dict[str, str]:
        """unit -> problem, for the units of ``base`` whose shard fails verification."""
        return {u: problem for u, (_, problem) in zip(units, self._read_units(base, units)) if problem}

    def _check_layout(self, step: int, layout: list[list[Any]]) -> None:
        """Refuse a state that is empty, has unsafe names, or does not cover the run's layout."""
        if not layout:
            raise ValueError(f"refusing to write an empty snapshot of step {step}: a snapshot must hold the whole state")
        for name, _, _ in layout:
            check_name(name, "tensor name")
        for unit in group_by_unit(n for n, _, _ in layout):
            check_name(unit, "unit name")
        expected, source = self.layout, "the run's layout"
        if expected is None and self.identity is not None:  # a run's layout does not change
            own = [i for i in self.list() if self._owned(i.folder)]
            expected, source = (manifest_layout(own[-1].manifest), f"the layout of snapshot {own[-1].folder}") if own else (None, "")
        if expected is not None and layout != expected:
            first = next(i for i in range(max(len(layout), len(expected)))
                         if i >= len(layout) or i >= len(expected) or layout[i] != expected[i])
            got, want = (x[first] if first < len(x) else "nothing" for x in (layout, expected))
            raise ValueError(
                f"refusing the snapshot of step {step}: it does not cover {source} ({len(layout)} tensors, "
                f"{len(expected)} expected; tensor #{first} is {got}, expected {want}); write the whole state of the run's model")

    def _attempt_folder(self, step: int) -> str:
        """A folder name unique to this write attempt (never reused after a failed one), tagged with the run."""
        writer = f"{self.identity.tag}-{self.epoch}-" if self.identity is not None else ""
        return f"step-{step:010d}-{writer}{uuid.uuid4().hex[:8]}"

    def _put_units(self, folder: str, state: Mapping[str, np.ndarray], units: Mapping[str, list[str]], step: int,
                   unit_steps: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        """Write one safetensors shard per unit under ``folder``, ``parallel_puts`` at a time, each streamed
        from the arrays' memory and hashed as it is written (``tensor_files.put``); returns the manifest entries."""
        with concurrent.futures.ThreadPoolExecutor(self.parallel_puts, thread_name_prefix="snapshot-put") as pool:
            puts = {unit: pool.submit(tensor_files.put, self.storage, shard_path(folder, unit), {n: state[n] for n in names})
                    for unit, names in units.items()}
            entries = {}
            for unit, names in units.items():
                size, sha256 = puts[unit].result()
                entries[unit] = {
                    "path": shard_path(folder, unit),
                    "bytes": size,
                    "sha256": sha256,
                    "step": unit_steps.get(unit, step),
                    "tensors": {n: {"dtype": state[n].dtype.str, "shape": list(state[n].shape)} for n in names},
                }
        return entries

    def _commit(self, folder: str, step: int, names: list[str], config: Mapping[str, Any] | None,
                units: dict[str, dict[str, Any]]) -> SnapshotInfo:
        """Write the manifest (after every shard), then the index (the commit point), then retain."""
        manifest: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "created_unix_s": time.time(),
            "run": self.identity.as_dict() if self.identity is not None else None,
            "names": names,
            "config": dict(config or {}),
            "units": units,
        }
        manifest["layout_sha256"] = layout_sha256(manifest_layout(manifest))
        return self._commit_manifest(folder, manifest)

    def _commit_manifest(self, folder: str, manifest: dict[str, Any]) -> SnapshotInfo:
        """Write ``manifest`` (after every file it lists), then the index (the commit point), then retain."""
        step = manifest["step"]
        blob = json.dumps(manifest, indent=1).encode()
        self.storage.put(f"{folder}/{MANIFEST}", blob)
        entry = {"folder": folder, "manifest_sha256": hashlib.sha256(blob).hexdigest()}
        self._update_index(lambda index: [e for e in index.entries if e["folder"] != folder] + [entry])
        info = SnapshotInfo(step, folder, manifest)
        self._retain(info)
        return info

    # -- the index ----------------------------------------------------------------------------
    def _read_index(self) -> tuple[_Index, str | None]:
        """The index and the problem with it (None when it is well-formed). Without an index nothing
        is committed; an unreadable or malformed one is replaced by a scan for manifests (their
        sha256 then cannot be checked, and every writer epoch is forgotten)."""
        try:
            raw = self.storage.get(INDEX)
        except FileNotFoundError:
            return _Index(None, [], {}, 0), None
        try:
            body = json.loads(raw)
            return _Index(raw, index_entries(body), body["epochs"], body["generation"]), None
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            problem = f"{INDEX}: malformed ({exc}); scanning for manifests"
            return _Index(raw, [{"folder": f, "manifest_sha256": None} for f in self._manifest_folders()], {}, 0), problem

    def _manifest_folders(self) -> list[str]:
        """Every snapshot folder that holds a manifest, indexed or not, sorted by name."""
        folders = {p.split("/")[0] for p in self.storage.list() if p.endswith("/" + MANIFEST)}
        return sorted(f for f in folders if FOLDER.match(f))

    def unindexed(self) -> list[str]:
        """Snapshot folders that hold a manifest the index does not list, sorted: committed-looking,
        yet never restored from, since the index is the commit point (left by a crash between a
        manifest and its index update, or by a deleted index). Store-wide (every run's); for tools
        that report them (``raycheck inspect``, ``raycheck verify``); ``storage.backend.StorageError``
        when storage fails."""
        listed = self.indexed()
        return [f for f in self._manifest_folders() if f not in listed]

    def indexed(self) -> set[str]:
        """The snapshot folders the index lists now (read afresh); ``storage.backend.StorageError`` when storage fails."""
        return {e["folder"] for e in self._read_index()[0].entries}

    def _update_index(self, change: Callable[[_Index], list[dict[str, Any]]]) -> None:
        """Rewrite the index with the entries ``change`` returns for the current one, by compare-and-swap
        (re-read and redone when another writer won the race), fenced by this run's epoch.

        Raises:
            FencedError: the index holds a newer epoch for this run.
            storage.backend.StorageError: the put failed, or the index kept changing.
        """
        for _ in range(INDEX_ATTEMPTS):
            index, _ = self._read_index()
            entries = change(index)
            epochs = dict(index.epochs)
            if self.identity is not None:
                run = self.identity.run_id
                if epochs.get(run, 0) > self.epoch:
                    raise FencedError(
                        f"{self.storage.url(INDEX)}: run {run} is at writer epoch {epochs[run]}, this writer has "
                        f"{self.epoch}: a newer incarnation of the run owns its snapshots; this writer must stop")
                epochs[run] = self.epoch
            body = {"format_version": FORMAT_VERSION, "generation": index.generation + 1, "epochs": epochs,
                    "snapshots": [{"folder": e["folder"], "manifest_sha256": e["manifest_sha256"] or self._manifest_sha(e["folder"])}
                                  for e in entries]}
            data = json.dumps(body, indent=1).encode()
            try:
                self.storage.put_if_match(INDEX, data, index.raw)
                return
            except PreconditionFailedError:
                if self.storage.get(INDEX) == data:  # a timed-out try of ours that landed: done
                    return
                log.info("%s changed while it was rewritten; retrying", self.storage.url(INDEX))
        raise StorageError(f"{self.storage.url(INDEX)} changed {INDEX_ATTEMPTS} times while being rewritten; giving up")

    def _manifest_sha(self, folder: str) -> str:
        return hashlib.sha256(self.storage.get(f"{folder}/{MANIFEST}")).hexdigest()

    # -- retention ----------------------------------------------------------------------------
    def _owned(self, folder: str) -> bool:
        """True for this run's snapshot folders (store-wide: every folder)."""
        if self.identity is None:
            return True
        writer = folder_writer(folder)
        return writer is not None and writer[0] == self.identity.tag

    def _retain(self, committed: SnapshotInfo) -> None:
        """Drop this run's snapshots older than its newest ``keep_last`` that verify, except
        ``committed`` (trusted: its shards' hashes come from the bytes written); index first, then delete;
        then the stale temp files of the whole store."""
        drop, newest = self._to_drop(committed)
        if drop:
            self._update_index(lambda idx: [e for e in idx.entries if e["folder"] not in drop])  # index first
        self._delete_unlisted(drop, newest)
        self.storage.remove_stale_temp_files(self.temp_max_age_s)

    def _to_drop(self, committed: SnapshotInfo) -> tuple[set[str], int]:
        """The indexed folders of this run to retire, and the run's newest snapshot step.

        Kept: ``committed``, the newest ``keep_last`` snapshots that verify, and every snapshot newer
        than the oldest of those. So a snapshot that fails verification never counts toward
        ``keep_last`` (a damaged newest one cannot push out the good ones, e.g. after a resume), and is
        never deleted on that ground alone (the failure may be the storage's, not the bytes'): it is
        retired when ``keep_last`` good ones newer than it exist. A snapshot this store committed is
        trusted (its hashes come from the bytes written); any other is verified once per store
        (``_verifies``): after a resume, the earlier incarnation's are read once."""
        listed = [i for i in self.list() if self._owned(i.folder)]
        own = sorted({i.folder: i for i in [*listed, committed]}.values(), key=_order)  # listed or not yet
        self._verified[committed.folder] = True
        newest_first = range(len(own) - 1, -1, -1)  # lazily: older snapshots are verified only when needed
        good = list(itertools.islice((p for p in newest_first if self._verifies(own[p])), self.keep_last))
        keep = {i.folder for i in own[good[-1]:]} | {committed.folder}  # good is never empty: committed verifies
        valid = {i.folder for i in listed}
        drop = {e["folder"] for e in self._read_index()[0].entries if self._owned(e["folder"]) and e["folder"] not in keep
                and (e["folder"] in valid or folder_step(e["folder"]) <= committed.step)}  # malformed: only older ones
        return drop, own[-1].step

    def _verifies(self, info: SnapshotInfo) -> bool:
        """True when every shard of ``info`` has its size and sha256 (``verify``), remembered per folder."""
        if info.folder not in self._verified:
            self._verified[info.folder] = not self.verify(info)
        return self._verified[info.folder]

    def _delete_unlisted(self, drop: set[str], newest: int) -> None:
        """Delete the objects of ``drop`` and the leftovers of this run's failed attempts older than
        ``newest`` (of this writer's epoch or older), except the files a listed manifest references (a
        composite's older shards: kept alone, without their folder's manifest, which no index lists)."""
        live = {u["path"] for i in self._list_all() for u in i.manifest["units"].values()}
        indexed = {e["folder"] for e in self._read_index()[0].entries}
        emptied: set[str] = set()
        for path in self.storage.list():
            folder = path.split("/")[0]
            writer = folder_writer(folder)  # None for a name without a writer (or no snapshot at all)
            if (path in live or folder in indexed or not FOLDER.match(folder) or not self._owned(folder)
                    or (writer and writer[1] > self.epoch)):
                continue  # referenced, not a snapshot, still listed, another run's, or a newer incarnation's attempt
            if folder in drop or folder_step(folder) < newest:
                try:
                    self.storage.delete(path)
                    parts = path.split("/")[:-1]  # the folder and any subfolder of it (a sharded composite's units)
                    emptied.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
                except OSError as exc:
                    log.warning("retention could not delete %s: %s", path, exc)
        for folder in sorted(emptied, key=lambda f: -f.count("/")):  # the deepest first
            self.storage.remove_empty_folder(folder)

    # -- reading ------------------------------------------------------------------------------
    def _list_all(self) -> list[SnapshotInfo]:
        """Every committed snapshot whose manifest checks out, oldest first; sets ``skipped``."""
        index, problem = self._read_index()
        infos, self.skipped = [], [problem] if problem else []
        for entry in index.entries:
            folder = entry["folder"]
            try:
                blob = self.storage.get(f"{folder}/{MANIFEST}")
            except FileNotFoundError:
                self.skipped.append(f"{folder}/{MANIFEST}: missing")
                continue
            if entry["manifest_sha256"] and hashlib.sha256(blob).hexdigest() != entry["manifest_sha256"]:
                self.skipped.append(f"{folder}/{MANIFEST}: sha256 differs from the index (altered after its commit)")
                continue
            try:
                manifest = json.loads(blob)
            except (ValueError, UnicodeDecodeError) as exc:
                self.skipped.append(f"{folder}/{MANIFEST}: unreadable ({exc})")
                continue
            problems = self._manifest_problems(manifest, folder)
            if problems:
                self.skipped.append(f"{folder}/{MANIFEST}: malformed: {'; '.join(problems[:3])}")
                continue
            infos.append(SnapshotInfo(manifest["step"], folder, manifest))
        return sorted(infos, key=_order)

    def _manifest_problems(self, manifest: object, folder: str) -> list[str]:
        """What is wrong with ``manifest`` as the manifest of ``folder`` (``storage.manifest.manifest_problems``;
        a store of another file format overrides it)."""
        return manifest_problems(manifest, folder)

    def list(self) -> list[SnapshotInfo]:
        """Committed snapshots, oldest first: with an identity this run's and the merge results it may
        start from (``step_log``), else every one. A snapshot whose manifest is missing, altered since
        its commit (sha256 in the index), malformed, or lies about its step, and (with an identity)
        another run's, is skipped; ``skipped`` names each with the reason. Never raises for what the
        store holds (only ``storage.backend.StorageError`` when storage fails)."""
        infos: list[SnapshotInfo] = []
        foreign: list[str] = []
        every = self._list_all()
        own = [i.step for i in every if self.identity is not None and i.manifest["run"] == self.identity.as_dict()]
        for info in every:
            reason = self._foreign(info, min(own, default=None))
            if reason:
                foreign.append(reason)
            else:
                infos.append(info)
        for problem in self.skipped:
            log.warning("snapshot skipped: %s", problem)
        for reason in foreign:
            log.info("snapshot skipped: %s", reason)
        self.skipped += foreign
        return infos

    def _foreign(self, info: SnapshotInfo, oldest_own: int | None) -> str | None:
        """Why ``info`` is not this run's to restore (None: it is, or a merge result it may start from,
        or no identity); ``oldest_own``: the step of the run's oldest own snapshot (None: none)."""
        run = info.manifest["run"]
        if self.identity is None:
            return None
        if run == self.identity.as_dict():
            if not self.step_log:
                return None
            # a sharded checkpoint's units (DCP files, storage.dcp_store) are all of its one step
            older = sorted({u.get("step", info.step) for u in info.manifest["units"].values()} - {info.step})
            if older:
                return (f"{info.folder}: a composite (units of steps {older[:3]} in a snapshot of step {info.step}); run "
                        f"{self.identity.run_id} replays its step log onto whole states only")
            return None
        if info.is_merge_result:
            if self.step_log:
                return (f"{info.folder}: a merge result; run {self.identity.run_id} replays its step log from the "
                        "initial weights, so it restores only its own snapshots")
            if oldest_own is not None and info.step > oldest_own:
                return (f"{info.folder}: a merge result of step {info.step}, after run {self.identity.run_id}'s oldest "
                        f"own snapshot (step {oldest_own}): a merge is only a run's starting point")
            return None
        who = f"foreign run {run['run_id']} (trajectory {run['trajectory_sha256'][:12]})" if run else "no run identity"
        return f"{info.folder}: {who}, not run {self.identity.run_id} (trajectory {self.identity.trajectory_sha256[:12]})"

    def verify(self, info: SnapshotInfo) -> builtins.list[str]:
        """Problems with ``info``'s shards (empty when every size and sha256 matches)."""
        return [problem for _, problem in self._read_units(info) if problem]

    def _read_units(self, info: SnapshotInfo, units: builtins.list[str] | None = None) -> Iterator[tuple[bytes | None, str | None]]:
        """(shard bytes, None) per unit of ``info`` (default all) whose shard verifies, else (None, problem)."""
        for unit in info.manifest["units"] if units is None else units:
            spec = info.manifest["units"][unit]
            try:
                blob = self.storage.get(spec["path"])
            except FileNotFoundError:
                yield None, f"{spec['path']}: missing"
                continue
            except (IsADirectoryError, NotADirectoryError):
                yield None, f"{spec['path']}: not a file"
                continue
            if len(blob) != spec["bytes"]:
                yield None, f"{spec['path']}: {len(blob)} bytes, manifest says {spec['bytes']} (truncated?)"
            elif hashlib.sha256(blob).hexdigest() != spec["sha256"]:
                yield None, f"{spec['path']}: sha256 differs from the manifest (corrupt)"
            else:
                yield blob, None

    def load_units(self, info: SnapshotInfo, units: builtins.list[str]) -> dict[str, np.ndarray]:
        """The verified tensors of ``units`` of ``info`` (name -> array).

        Raises:
            SnapshotCorruptError: a shard is missing, truncated or altered, or holds other tensors
                than its manifest lists (the message names it).
        """
        tensors: dict[str, np.ndarray] = {}
        for unit, (blob, problem) in zip(units, self._read_units(info, units)):
            if blob is None:
                raise SnapshotCorruptError(f"snapshot {info.folder} in {self.storage.url()}: unit {unit}, {problem}")
            loaded = st_load(blob)
            if set(loaded) != set(info.manifest["units"][unit]["tensors"]):
                raise SnapshotCorruptError(f"snapshot {info.folder}: unit {unit} holds other tensors than its manifest lists")
            tensors.update(loaded)
        return tensors

    def load(self, info: SnapshotInfo, units: builtins.list[str] | None = None) -> dict[str, np.ndarray]:
        """The verified state of ``info`` in canonical order (only the tensors of ``units`` when given,
        e.g. a shadow shard's part; default every unit).

        Raises:
            SnapshotCorruptError: a shard is missing, truncated or altered (the message names it).
        """
        tensors = self.load_units(info, list(info.manifest["units"]) if units is None else units)
        return {n: tensors[n] for n in info.manifest["names"] if n in tensors}

    def load_latest(self, max_step: int | None = None, layout: builtins.list[builtins.list[Any]] | None = None,
                    units: builtins.list[str] | None = None) -> Loaded:
        """The newest snapshot (at most ``max_step``) that verifies and has ``layout`` (default: the
        store's; ``storage.manifest.layout_of`` of the model restored into). Snapshots that are
        corrupt, malformed, foreign or of another layout are skipped, logged and listed in
        ``Loaded.skipped``. ``units``: load and verify only these units (a shadow shard's part).

        Raises:
            NoSnapshotError: none loads; the message names each snapshot tried and why it failed.
        """
        expected = layout if layout is not None else self.layout
        infos = self.list()
        tried = list(self.skipped)
        for info in reversed(infos):
            if max_step is not None and info.step > max_step:
                continue
            if expected is not None and manifest_layout(info.manifest) != expected:
                tried.append(f"snapshot {info.folder}: its layout ({len(info.manifest['names'])} tensors, "
                             f"{info.manifest['layout_sha256'][:12]}) differs from the model's ({len(expected)} tensors, "
                             f"{layout_sha256(expected)[:12]}): {other_layout(manifest_layout(info.manifest), expected)}")
                continue
            try:
                return Loaded(info, self.load(info, units), tried)
            except SnapshotCorruptError as exc:
                log.warning("skipping %s", exc)
                tried.append(str(exc))
        raise NoSnapshotError(f"no loadable snapshot in {self.storage.url()}; tried: {'; '.join(tried) or 'none found'}")


def unit_steps(info: SnapshotInfo) -> dict[str, int]:
    """Unit -> the step its tensors belong to in snapshot ``info`` (a composite's units differ): its
    manifest's ``units`` (safetensors shards), or ``layers`` (a sharded checkpoint's, ``storage.dcp_store``;
    one that records none: every unit of its ``names`` at its step)."""
    if info.manifest.get("format_version") == FORMAT_VERSION:
        return {u: int(s.get("step", info.step)) for u, s in info.manifest["units"].items()}
    return {u: int(s["step"]) for u, s in layers_of(info).items()}


def layers_of(info: SnapshotInfo) -> dict[str, dict[str, Any]]:
    """Unit -> ``{"step", "folder"}`` of a sharded checkpoint (``storage.dcp_store``): where it has each
    unit's rows and the step they belong to (one that is not a composite: its own folder and step, for the
    units of its ``names``; empty when it records none)."""
    return info.manifest.get("layers") or {u: {"step": info.step, "folder": info.folder}
                                           for u in group_by_unit(info.manifest.get("names", ()))}


class Loaded(NamedTuple):
    """A loaded snapshot, and the newer ones that were skipped (with the reason)."""

    info: SnapshotInfo
    state: dict[str, np.ndarray]
    skipped: list[str]


def _order(info: SnapshotInfo) -> tuple[int, float]:
    return (info.step, info.manifest["created_unix_s"])
