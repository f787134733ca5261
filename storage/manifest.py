"""What a snapshot manifest and the index must look like: names, paths, run identity, layout, schema.

Everything a manifest or an index says is checked before it is trusted (``manifest_problems``,
``index_entries``): a misspelt key, a wrong type, a tensor in two units, a unit newer than its
snapshot or than the snapshot folder that holds its shard, a step that differs from the folder name,
or a path that leaves the snapshot store is a problem, named in one line, and the snapshot is skipped. Names and paths are refused at write time
by the same rules (``check_name``), so nothing written can escape the store root.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from raycheck.storage.units import group_by_unit

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 3
"""Manifest and index format (3: run identity, layout hash, manifest sha256 and writer epochs in the index)."""

FOLDER = re.compile(r"^step-(\d{10})-(?:([0-9a-f]{8})-(\d{1,9})-)?[0-9a-f]{8}$")
"""A snapshot folder: ``step-<step, 10 digits>-[<run tag, 8 hex>-<writer epoch>-]<attempt id, 8 hex>``."""
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class RunIdentityError(ValueError):
    """A run identity is malformed."""


@dataclass(frozen=True)
class RunIdentity:
    """The run a snapshot belongs to: ``run_id`` and the hash of its trajectory settings
    (``job.config.JobConfig.trajectory_sha256``). Recorded in every manifest; a restore
    takes only its own run's snapshots (and a merge result it starts from: ``SnapshotStore``'s ``step_log``)."""

    run_id: str
    trajectory_sha256: str

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id or not isinstance(self.trajectory_sha256, str):
            raise RunIdentityError(f"a run identity needs a run id and a trajectory sha256, got {self!r}")

    @property
    def tag(self) -> str:
        """8 hex digits naming the run in its snapshot folders (so retention only cleans its own)."""
        return hashlib.sha256(self.run_id.encode()).hexdigest()[:8]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_name(name: object, what: str) -> str:
    """``name`` if it is a safe tensor or unit name (letters, digits, ``_ . -``; no ``..``; not
    starting with ``.`` or ``-``), so that no path built from it leaves the store.

    Raises:
        ValueError: anything else (absolute, ``..``, ``/``, a backslash, empty, not a string).
    """
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise ValueError(f"{what} {name!r} is not allowed: use letters, digits, '_', '.' and '-' "
                         "(no '/', no '..', not starting with '.'); it would name a path outside the store")
    return name


def shard_path(folder: str, unit: str) -> str:
    """The path of ``unit``'s shard in snapshot ``folder`` (both checked)."""
    if not FOLDER.match(folder):
        raise ValueError(f"snapshot folder {folder!r} is not a step-<10 digits>-<hex> folder name")
    return f"{folder}/{check_name(unit, 'unit name')}.safetensors"


def folder_writer(folder: str) -> tuple[str, int] | None:
    """The run tag and writer epoch in a snapshot folder's name (None: written without an identity)."""
    m = FOLDER.match(folder)
    return (m.group(2), int(m.group(3))) if m and m.group(2) else None


def folder_step(folder: str) -> int:
    """The step in a snapshot folder's name. Raises ``ValueError`` for any other name."""
    m = FOLDER.match(folder)
    if not m:
        raise ValueError(f"{folder!r} is not a snapshot folder name (step-<10 digits>-<hex>)")
    return int(m.group(1))


def layout_of(state: Mapping[str, np.ndarray | torch.Tensor]) -> list[list[Any]]:
    """``[[name, dtype (numpy str, e.g. '<f4'), shape], ...]`` of a state (arrays or tensors), in order."""
    return [[n, _numpy(a).dtype.str, list(a.shape)] for n, a in state.items()]


def _numpy(a: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    from raycheck.storage.tensor_files import as_numpy  # imports torch: only for a state of tensors

    return as_numpy(a)


def layout_sha256(layout: list[list[Any]]) -> str:
    """sha256 of a layout (``layout_of``): names, dtypes, shapes, order."""
    return hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()


def other_layout(theirs: list[list[Any]], ours: list[list[Any]]) -> str:
    """What a snapshot of layout ``theirs`` is to a model of layout ``ours`` (``layout_of``; they
    differ): the same tensors in another dtype (``a snapshot of another dtype (bfloat16; the model is
    float32)``), else ``a snapshot of another model``."""
    if [[n, s] for n, _, s in theirs] != [[n, s] for n, _, s in ours]:
        return "a snapshot of another model"
    from raycheck.storage.tensor_files import dtype_name  # imports torch: only for this message

    names = [sorted({dtype_name(d) for _, d, _ in layout}) for layout in (theirs, ours)]
    return f"a snapshot of another dtype ({', '.join(names[0])}; the model is {', '.join(names[1])})"


def manifest_layout(manifest: Mapping[str, Any]) -> list[list[Any]]:
    """The layout a (schema-valid) manifest describes, in its canonical order."""
    specs = {n: t for u in manifest["units"].values() for n, t in u["tensors"].items()}
    return [[n, specs[n]["dtype"], list(specs[n]["shape"])] for n in manifest["names"]]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _unit_problems(unit: str, spec: object, step: int) -> list[str]:
    if not isinstance(spec, dict):
        return [f"unit {unit!r} is a {type(spec).__name__}, not an object"]
    problems = [f"unit {unit!r}: key {k!r} is missing" for k in ("path", "bytes", "sha256", "step", "tensors") if k not in spec]
    if problems:
        return problems
    path = spec["path"]
    folder = path.split("/")[0] if isinstance(path, str) else ""
    try:
        if path != shard_path(folder, unit):
            problems.append(f"unit {unit!r}: path {path!r} is not <snapshot folder>/{unit}.safetensors")
    except ValueError as exc:
        problems.append(f"unit {unit!r}: path {path!r}: {exc}")
    if not _is_int(spec["bytes"]):
        problems.append(f"unit {unit!r}: bytes {spec['bytes']!r} is not a count")
    if not isinstance(spec["sha256"], str) or not _SHA256.match(spec["sha256"]):
        problems.append(f"unit {unit!r}: sha256 {spec['sha256']!r} is not 64 hex digits")
    if not _is_int(spec["step"]) or spec["step"] > step:
        problems.append(f"unit {unit!r}: step {spec['step']!r} is not a step at or before the snapshot's ({step})")
    elif FOLDER.match(folder) and spec["step"] > folder_step(folder):
        problems.append(f"unit {unit!r}: step {spec['step']} is after the step of {folder}, the snapshot that holds its shard")
    tensors = spec["tensors"]
    if not isinstance(tensors, dict) or not tensors:
        return problems + [f"unit {unit!r}: tensors must be a non-empty object"]
    for name, t in tensors.items():
        if not (isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
                and all(_is_int(d) for d in t["shape"])):
            problems.append(f"unit {unit!r}: tensor {name!r} needs a dtype string and a shape list")
    return problems


def manifest_problems(manifest: object, folder: str) -> list[str]:
    """What is wrong with ``manifest`` as the manifest of snapshot ``folder`` (empty: nothing).

    Checks: format version, every key and type; ``step`` equals the folder name's step; every unit
    step is at or before it and at or before the step of the folder its shard is in; names are safe
    and each in exactly one unit, the unit ``unit_of`` gives it; unit paths are ``<snapshot folder>/<unit>.safetensors``,
    a folder of the manifest's own run when its name carries a run tag; ``layout_sha256`` matches the
    units' dtypes and shapes; ``run`` is null (a merge result or a store-wide writer) or an identity.
    """
    if not isinstance(manifest, dict):
        return [f"the manifest is a {type(manifest).__name__}, not an object"]
    keys = ("format_version", "step", "created_unix_s", "run", "layout_sha256", "names", "config", "units")
    missing = [k for k in keys if k not in manifest]
    if missing:
        return [f"key(s) {', '.join(missing)} missing (format {manifest.get('format_version')!r}, expected {FORMAT_VERSION})"]
    if manifest["format_version"] != FORMAT_VERSION:
        return [f"format {manifest['format_version']!r}, expected {FORMAT_VERSION}"]
    step, names, units = manifest["step"], manifest["names"], manifest["units"]
    problems = []
    if not _is_int(step):
        return [f"step {step!r} is not a step"]
    try:
        if folder_step(folder) != step:
            problems.append(f"step {step} differs from the folder's step {folder_step(folder)}")
    except ValueError as exc:
        problems.append(str(exc))
    if not isinstance(manifest["created_unix_s"], (int, float)) or not isinstance(manifest["config"], dict):
        problems.append("created_unix_s must be a number and config an object")
    run = manifest["run"]
    if run is not None:
        try:
            if not isinstance(run, dict):
                raise TypeError("not an object")
            RunIdentity(**run)
        except (TypeError, RunIdentityError) as exc:
            problems.append(f"run {run!r} is not a run identity ({exc})")
    if not isinstance(names, list) or not names or not isinstance(units, dict) or not units:
        return problems + ["names must be a non-empty list and units a non-empty object"]
    for name in names:
        try:
            check_name(name, "tensor name")
        except ValueError as exc:
            problems.append(str(exc))
    if len(set(map(str, names))) != len(names):
        problems.append("a tensor name is listed twice")
    for unit, spec in units.items():
        problems += _unit_problems(unit, spec, step)
    if problems:
        return problems
    tag = RunIdentity(**run).tag if run is not None else None
    for unit, spec in units.items():  # a shard of another run (its tag in the folder name) is not this snapshot's
        writer = folder_writer(spec["path"].split("/")[0])
        if writer is not None and writer[0] != tag:
            problems.append(f"unit {unit!r}: its shard {spec['path']} is in a snapshot folder of another run (tag "
                            f"{writer[0]}, this manifest's run has {tag})")
    if problems:
        return problems
    expected = {u: sorted(ns) for u, ns in group_by_unit(names).items()}
    got = {u: sorted(spec["tensors"]) for u, spec in units.items()}
    if expected != got:
        wrong = sorted(u for u in set(expected) | set(got) if expected.get(u) != got.get(u))
        return [f"units {wrong[:4]} do not hold exactly the listed tensors of their unit"]
    if manifest["layout_sha256"] != layout_sha256(manifest_layout(manifest)):
        problems.append("layout_sha256 does not match the units' dtypes and shapes")
    return problems


def index_entries(index: object) -> list[dict[str, Any]]:
    """The ``snapshots`` entries (``{"folder", "manifest_sha256"}``, oldest first) of a parsed index.

    Raises:
        ValueError: not a format-3 index object, or an entry is malformed (the message says which).
    """
    if not isinstance(index, dict) or index.get("format_version") != FORMAT_VERSION:
        kind = f"format {index.get('format_version')!r}" if isinstance(index, dict) else f"a {type(index).__name__}"
        raise ValueError(f"the index is {kind}, expected a format {FORMAT_VERSION} object")
    entries, epochs = index.get("snapshots"), index.get("epochs")
    if not isinstance(entries, list) or not isinstance(epochs, dict) or not _is_int(index.get("generation")):
        raise ValueError("the index needs a snapshots list, an epochs object and a generation count")
    for e in entries:
        if not (isinstance(e, dict) and isinstance(e.get("folder"), str) and FOLDER.match(e["folder"])
                and isinstance(e.get("manifest_sha256"), str) and _SHA256.match(e["manifest_sha256"])):
            raise ValueError(f"index entry {e!r} is not {{folder: step-..., manifest_sha256: 64 hex}}")
    if not all(isinstance(k, str) and _is_int(v) for k, v in epochs.items()):
        raise ValueError(f"index epochs {epochs!r} are not run id -> epoch")
    return entries
