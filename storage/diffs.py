"""Differential checkpoints of a first-order run: per-step gradient records between full checkpoints.

LowDiff (SC'25): instead of the whole state, each step persists the gradients the optimizer consumed
(optionally compressed), batched into few objects, with a full checkpoint every F steps; recovery
loads the newest full checkpoint and replays the recorded gradients through the optimizer.

Records. Step ``t``'s record holds, for every parameter, the float32 gradient fed to AdamW at step
``t`` (after DDP averaging and clipping: ``training.optim_steps.OptimizerSteps.applied``); replaying
records ``b .. e-1`` onto the state after ``b`` steps gives the state after ``e`` steps. Encodings:

* ``exact``: the dense float32 gradient. Replay is bitwise the executed trajectory.
* ``topk``: per tensor the ``ceil(ratio * numel)`` (at least 1) elements of largest magnitude, as
  ``values`` (float32) and flat ``indices`` (int32, sorted); the others replay as 0. Approximate:
  8 bytes per kept element, i.e. ``1 / (2 ratio)`` times smaller than ``exact``.

A record may also hold float64 entries, stored exact in either encoding: a user's optimizer's
parameter-group hyper-parameters at that step (``param_groups.<i>.<key>``, ``training.optim_steps``).

Layout under a ``Storage`` (shared with the run's ``SnapshotStore``, which owns ``step-*`` folders)::

    diffs/0000000040-0000000043-9a8b7c6d-1f2e3d4c.safetensors  steps 40..43: ``{step:010d}:{param}``
                                                               (topk: ``...:values``, ``...:indices``)
    diffs/0000000040-0000000043-9a8b7c6d-1f2e3d4c.commit.json  written after the batch: its size, sha256,
                                                               steps, encoding, tensor shapes and run

(first step, last step, the run's tag ``RunIdentity.tag``, absent for a store without a run identity,
and the attempt id.)

Commit rules: a batch counts only when its commit record exists and names its own batch object
(``<same stem>.safetensors``: a record pointing anywhere else is skipped) and, for a store with a run
identity (``job.stores.diff_store``), names that run (``run``: another run's batch copied
in is skipped), and it is trusted only
after its size and sha256 match (``read``); names are unique per attempt, so a restarted run never writes into
what a failed attempt left. A gap or a corrupt batch never yields a wrong state: an explicit
replay to a step raises ``DiffGapError`` / ``DiffCorruptError`` naming the steps; an open-ended
replay (recovery) stops before the first missing or corrupt step and reports it, and the steps after
it are recomputed. Garbage collection deletes, for batches wholly before the newest full checkpoint,
the commit record first and the batch after it (so a crash in between leaves an unlisted object),
and the stale temp files of interrupted local writes under the prefix (``Storage.remove_stale_temp_files``);
with a run identity only this run's batches and orphaned objects (by commit record, else by the run tag in
the name): another run's files copied into the prefix are left alone and logged.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import load as st_load

from raycheck.storage import tensor_files
from raycheck.storage.backend import Storage
from raycheck.storage.manifest import RunIdentity

log = logging.getLogger(__name__)

FORMAT = "raycheck-diff-1"
ENCODINGS = ("exact", "topk")
_COMMIT = re.compile(r"^(\d{10})-(\d{10})-(?:[0-9a-f]{8}-)?[0-9a-f]{8}\.commit\.json$")
_BATCH = re.compile(r"^(\d{10})-(\d{10})-(?:([0-9a-f]{8})-)?[0-9a-f]{8}\.(?:safetensors|commit\.json)$")
"""A batch's object or commit record: ``<first step>-<last step>-[<run tag>-]<attempt id>`` (10 digits, 8 hex)."""


class DiffError(Exception):
    """Differential records cannot give the state asked for; the message names the steps."""


class DiffGapError(DiffError):
    """No committed batch holds some of the steps asked for."""


class DiffCorruptError(DiffError):
    """A committed batch is missing, truncated or altered (size or sha256 differ from its commit record)."""


@dataclass(frozen=True)
class DiffBatch:
    """A committed batch: records of steps ``first_step .. last_step`` (inclusive), its object
    ``path`` with ``bytes`` and ``sha256``, the ``encoding``, ``topk_ratio`` (0 for exact), the
    parameter shapes (``tensors``: name -> shape, canonical order) and its ``commit`` record's path."""

    first_step: int
    last_step: int
    path: str
    bytes: int
    sha256: str
    encoding: str
    topk_ratio: float
    tensors: dict[str, list[int]]
    commit: str

    @property
    def steps(self) -> range:
        return range(self.first_step, self.last_step + 1)


@dataclass(frozen=True)
class ReplayResult:
    """What a replay did: ``replayed_steps`` records applied, the state is now after ``end_step``
    steps, ``exact`` (every record applied was ``exact``), ``stopped`` (why an open-ended replay
    stopped before a later committed batch: a gap or a corrupt batch; empty otherwise)."""

    replayed_steps: int
    end_step: int
    exact: bool
    stopped: str = ""


def topk_encode(grad: np.ndarray, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """(values float32, flat indices int32 ascending) of the ``max(1, ceil(ratio * numel))`` largest
    magnitudes of ``grad``; ``0 < ratio <= 1``."""
    flat = np.ascontiguousarray(grad, dtype=np.float32).ravel()
    k = min(flat.size, max(1, math.ceil(ratio * flat.size)))
    idx = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]) if k < flat.size else np.arange(flat.size)
    return flat[idx], idx.astype(np.int32)


def topk_decode(values: np.ndarray, indices: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """The dense float32 tensor of ``shape`` with ``values`` at the flat ``indices``, 0 elsewhere."""
    dense = np.zeros(int(np.prod(shape, dtype=np.int64)), dtype=np.float32)
    dense[indices] = values
    return dense.reshape(tuple(shape))


def rank_prefix(rank: int, world: int) -> str:
    """The ``DiffStore`` prefix of FSDP2 rank ``rank``'s records at world size ``world`` (each rank records its
    rows of the gradients: ``training.sharded.ShardedDiffCheckpointer``), beside the sharded checkpoints."""
    return f"diffs-rank-{rank:05d}-of-{world:05d}"


class DiffStore:
    """Per-step gradient records of one run in a ``Storage``, under ``prefix``.

    Args:
        storage: a ``Storage`` or a URI for one (usually the run's snapshot storage).
        prefix: folder of the records.
        identity: the run whose records these are (``storage.manifest.RunIdentity``). With it, every
            commit record names it and ``list`` (so ``chain``, ``replay``, ``durable_end``) takes only
            batches that name it: a batch of another run (or one without a run) copied into the prefix
            is skipped and named in ``skipped``. None: every batch (a store-wide tool).
    """

    def __init__(self, storage: Storage | str, prefix: str = "diffs", identity: RunIdentity | None = None) -> None:
        self.storage = storage if isinstance(storage, Storage) else Storage(storage)
        self.prefix = prefix.strip("/")
        self.identity = identity
        self.skipped: list[str] = []
        """Commit records the last ``list()`` could not read or (with an identity) of another run, with the reason."""
        self._foreign_logged: set[str] = set()  # other runs' files that garbage collection has logged

    # -- writing ------------------------------------------------------------------------------
    def write_batch(self, records: Sequence[tuple[int, Mapping[str, np.ndarray]]], topk_ratio: float = 0.0) -> DiffBatch:
        """Write the records ``[(step, {param: float32 gradient}), ...]`` of consecutive steps as one
        committed batch (``topk_ratio`` 0: exact; in (0, 1]: top-k). Returns once committed.

        Raises:
            ValueError: no records, steps not consecutive, parameters or shapes differ between
                records, an entry is neither float32 (a gradient) nor float64 (stored exact), or
                ``topk_ratio`` outside [0, 1].
            storage.backend.StorageError: writing failed after retries (nothing is committed).
        """
        if not records:
            raise ValueError("a diff batch needs at least one record")
        if not 0 <= topk_ratio <= 1:
            raise ValueError(f"topk_ratio must be in [0, 1] (0: exact), got {topk_ratio}")
        steps = [s for s, _ in records]
        if steps != list(range(steps[0], steps[0] + len(steps))) or steps[0] < 0:
            raise ValueError(f"diff batch steps must be consecutive and >= 0, got {steps}")
        shapes = {n: list(np.asarray(g).shape) for n, g in records[0][1].items()}
        tensors: dict[str, np.ndarray] = {}
        for step, grads in records:
            got = {n: list(np.asarray(g).shape) for n, g in grads.items()}
            if got != shapes:
                raise ValueError(f"step {step}: gradient names or shapes differ from step {steps[0]}'s")
            for name, g in grads.items():
                g = np.asarray(g)
                if g.dtype not in (np.float32, np.float64):
                    raise ValueError(f"step {step}, {name}: gradients must be float32 (float64: stored exact), got {g.dtype}")
                key = f"{step:010d}:{name}"
                if topk_ratio and g.dtype == np.float32:
                    tensors[key + ":values"], tensors[key + ":indices"] = topk_encode(g, topk_ratio)
                else:
                    tensors[key] = g  # by reference: the write streams from its memory
        encoding = "topk" if topk_ratio else "exact"
        tag = f"{self.identity.tag}-" if self.identity is not None else ""
        stem = f"{self.prefix}/{steps[0]:010d}-{steps[-1]:010d}-{tag}{uuid.uuid4().hex[:8]}"
        size, sha256 = tensor_files.put(self.storage, stem + ".safetensors", tensors, metadata={
            "format": FORMAT, "first_step": str(steps[0]), "last_step": str(steps[-1]), "encoding": encoding,
            "topk_ratio": repr(float(topk_ratio))})  # streamed from the gradients' memory, hashed as written
        del tensors
        batch = DiffBatch(steps[0], steps[-1], stem + ".safetensors", size, sha256, encoding, float(topk_ratio), shapes,
                          stem + ".commit.json")
        record = {"format": FORMAT, "first_step": batch.first_step, "last_step": batch.last_step, "path": batch.path,
                  "bytes": batch.bytes, "sha256": batch.sha256, "encoding": encoding, "topk_ratio": batch.topk_ratio,
                  "tensors": shapes, "created_unix_s": time.time(),
                  "run": self.identity.as_dict() if self.identity is not None else None}
        self.storage.put(batch.commit, json.dumps(record).encode())  # the commit point
        return batch

    # -- reading ------------------------------------------------------------------------------
    def list(self) -> list[DiffBatch]:
        """Committed batches, by first step (then last step). Unreadable commit records, and with an
        identity those of another run, are skipped, logged and listed in ``skipped``."""
        batches, self.skipped = [], []
        for path in self.storage.list(self.prefix):
            name = path.rsplit("/", 1)[-1]
            if not _COMMIT.match(name):
                continue
            try:
                r = json.loads(self.storage.get(path))
                if r.get("format") != FORMAT or r.get("encoding") not in ENCODINGS:
                    raise ValueError(f"format {r.get('format')!r}, encoding {r.get('encoding')!r}")
                own = path.removesuffix(".commit.json") + ".safetensors"
                if r.get("path") != own:  # never read an object elsewhere, inside the store or not
                    raise ValueError(f"path {r.get('path')!r} is not its own batch ({own})")
                if self.identity is not None and r.get("run") != self.identity.as_dict():
                    run = r.get("run")
                    who = f"run {run.get('run_id')}" if isinstance(run, dict) else "no run"
                    self.skipped.append(f"{path}: a batch of {who}, not of run {self.identity.run_id} "
                                        f"(trajectory {self.identity.trajectory_sha256[:12]})")
                    continue
                batches.append(DiffBatch(int(r["first_step"]), int(r["last_step"]), r["path"], int(r["bytes"]), r["sha256"],
                                         r["encoding"], float(r["topk_ratio"]), dict(r["tensors"]), path))
            except FileNotFoundError:
                continue  # deleted by garbage collection while listing
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                self.skipped.append(f"{path}: unreadable ({exc})")
        for problem in self.skipped:
            log.warning("diff batch skipped: %s", problem)
        return sorted(batches, key=lambda b: (b.first_step, b.last_step))

    def read(self, batch: DiffBatch) -> builtins.list[tuple[int, dict[str, np.ndarray]]]:
        """The verified records of ``batch``, decoded to dense float32 gradients, in step order.

        Raises:
            DiffCorruptError: the object is missing, or its size, sha256 or content differ from the
                commit record (the message names the steps and the object).
        """
        where = f"diff batch of steps {batch.first_step}-{batch.last_step} ({self.storage.url(batch.path)})"
        try:
            blob = self.storage.get(batch.path)
        except FileNotFoundError as exc:
            raise DiffCorruptError(f"{where}: missing") from exc
        if len(blob) != batch.bytes:
            raise DiffCorruptError(f"{where}: {len(blob)} bytes, the commit record says {batch.bytes} (truncated?)")
        if hashlib.sha256(blob).hexdigest() != batch.sha256:
            raise DiffCorruptError(f"{where}: sha256 differs from the commit record (corrupt)")
        tensors = st_load(blob)
        records = []
        try:
            for step in batch.steps:
                key = f"{step:010d}:"
                records.append((step, {n: tensors[key + n] if batch.encoding == "exact" or key + n in tensors
                                       else topk_decode(tensors[key + n + ":values"], tensors[key + n + ":indices"], shape)
                                       for n, shape in batch.tensors.items()}))
        except KeyError as exc:
            raise DiffCorruptError(f"{where}: lacks tensor {exc}") from exc
        return records

    def chain(self, from_step: int, batches: Sequence[DiffBatch] | None = None) -> builtins.list[DiffBatch]:
        """Committed batches that together hold steps ``from_step, from_step + 1, ...`` without a gap,
        as far as they go (the longest reaching batch at each point)."""
        batches = self.list() if batches is None else batches
        out: builtins.list[DiffBatch] = []
        step = from_step
        while True:
            covering = [b for b in batches if b.first_step <= step <= b.last_step]
            if not covering:
                return out
            best = max(covering, key=lambda b: b.last_step)
            out.append(best)
            step = best.last_step + 1

    def durable_end(self, from_step: int) -> int:
        """The step the committed records reach without a gap from ``from_step`` (not verified)."""
        chain = self.chain(from_step)
        return chain[-1].last_step + 1 if chain else from_step

    def replay(self, from_step: int, apply: Callable[[Mapping[str, np.ndarray]], None], until: int | None = None) -> ReplayResult:
        """Apply the records of steps ``from_step .. until - 1`` in order with ``apply`` (one optimizer
        step per record, e.g. ``training.optim_steps.OptimizerSteps.replay``) to a state that is after ``from_step`` steps.

        ``until=None``: as far as the committed records go; a missing or corrupt batch ends the
        replay before its first step and is reported in ``ReplayResult.stopped``.

        Raises:
            DiffGapError: ``until`` is given and some steps before it have no committed record.
            DiffCorruptError: ``until`` is given and a batch needed fails verification.
        """
        batches = self.list()
        chain = self.chain(from_step, batches)
        end = chain[-1].last_step + 1 if chain else from_step
        if until is not None and until > end:
            raise DiffGapError(f"no committed diff record for steps {end}..{until - 1} (replaying from step {from_step}"
                               f" in {self.storage.url(self.prefix)}); committed batches: "
                               f"{[f'{b.first_step}-{b.last_step}' for b in batches] or 'none'}")
        target = end if until is None else until
        step, exact, stopped = from_step, True, ""
        for batch in chain:
            if step >= target:
                break
            try:
                records = self.read(batch)
            except DiffCorruptError as exc:
                if until is not None:
                    raise
                stopped = str(exc)
                log.warning("replay stops at step %d: %s", step, exc)
                break
            for rec_step, grads in records:
                if step <= rec_step < target:
                    apply(grads)
                    step += 1
            exact &= batch.encoding == "exact"
        later = [b for b in batches if b.first_step > step]
        if until is None and not stopped and later:
            stopped = (f"no committed diff record for step {step}; the batches of steps "
                       f"{[f'{b.first_step}-{b.last_step}' for b in later]} after the gap are not used")
        return ReplayResult(step - from_step, step, exact, stopped)

    # -- garbage collection -------------------------------------------------------------------
    def collect_garbage(self, before_step: int) -> int:
        """Delete the batches wholly before ``before_step`` (the newest full checkpoint's step), the
        commit record first, and orphaned objects of failed attempts, then the stale temp files of
        interrupted writes under the prefix (not counted); returns objects deleted. A failed delete is
        logged and left for the next collection.

        With an identity only this run's files go: a committed batch whose record names this run (an
        unreadable record: whose name carries this run's tag), and an orphaned object whose name
        carries the tag. Another run's files (and those written without a run) are left alone and
        logged once per store."""
        deleted, foreign = 0, []
        paths = self.storage.list(self.prefix)
        commits = {p.removesuffix(".commit.json") for p in paths if p.endswith(".commit.json")}
        own_stems: set[str] = set()
        ordered = sorted(paths, key=lambda p: not p.endswith(".commit.json"))  # commit records first
        for path in ordered:
            m = _BATCH.match(path.rsplit("/", 1)[-1])
            if m is None or int(m.group(2)) >= before_step:
                continue
            stem = path.removesuffix(".commit.json").removesuffix(".safetensors")
            if self.identity is not None:
                if path.endswith(".commit.json") and self._own_record(path, m.group(3)):
                    own_stems.add(stem)
                elif stem not in own_stems and (stem in commits or m.group(3) != self.identity.tag):
                    foreign.append(path)
                    continue
            try:
                self.storage.delete(path)
                deleted += 1
            except OSError as exc:
                log.warning("diff garbage collection could not delete %s: %s", path, exc)
        new = [p for p in foreign if p not in self._foreign_logged]
        if new:
            self._foreign_logged.update(new)
            log.warning("diff garbage collection left %d object(s) of another run (or of no run) alone under %s, not of "
                        "run %s: %s", len(new), self.storage.url(self.prefix), self.identity.run_id if self.identity else "",
                        ", ".join(new))
        self.storage.remove_stale_temp_files(prefix=self.prefix)
        return deleted

    def _own_record(self, path: str, tag: str | None) -> bool:
        """Whether commit record ``path`` names this store's run (unreadable: whether its name's ``tag`` is the run's)."""
        assert self.identity is not None
        try:
            run: object = json.loads(self.storage.get(path)).get("run")
            return run == self.identity.as_dict()
        except FileNotFoundError:
            return False
        except (ValueError, AttributeError, UnicodeDecodeError):
            return tag == self.identity.tag
