"""Composite snapshots written incrementally: new shards for some units, the rest referenced from before.

LayerCheck (arXiv 2026) persists only the units whose update passed a threshold; the recovery state
is a composite whose units come from different steps. ``write_units`` commits such a state through
``SnapshotStore``'s own protocol (``storage.snapshots``): the changed units' shards go into a folder
unique to the attempt, then a manifest lists every unit of the layout (the new shards, and for the
others the shard path, bytes, sha256 and step recorded by the newest committed snapshot), then the
index is rewritten (the commit point), then retention runs, which never deletes a shard that a kept
manifest references. So the newest committed snapshot is always a complete composite state, and a
crash at any point leaves the previous one as the restore point.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence

import numpy as np
from safetensors.numpy import save as st_save

from storage.snapshots import FORMAT_VERSION, MANIFEST, SnapshotInfo, SnapshotStore
from storage.units import group_by_unit


def write_units(
    store: SnapshotStore,
    step: int,
    changed: Mapping[str, np.ndarray],
    names: Sequence[str],
    config: Mapping | None = None,
) -> SnapshotInfo:
    """Commit the state of step ``step``: the units of ``changed`` are new, every other unit of the
    layout ``names`` (the canonical tensor order) is the newest committed snapshot's version.

    Args:
        store: the run's snapshots; its newest committed snapshot supplies the units not in ``changed``.
        step: the state's step (>= the step of every referenced unit).
        changed: name -> array for whole units (every tensor of each unit it touches); may be empty
            (a new manifest over the previous shards).
        names: every tensor name of the layout, in canonical order.
        config: recorded in the manifest.

    Returns:
        The committed snapshot; ``manifest["units"][u]["step"]`` is the step unit ``u`` belongs to.

    Raises:
        ValueError: ``changed`` holds part of a unit or names outside ``names``; a unit not in
            ``changed`` has no committed version, or the committed one holds other tensors, dtypes
            or shapes; ``step`` is older than the newest committed snapshot.
        storage.backend.StorageError: a write failed after retries (nothing is committed).
    """
    layout = group_by_unit(names)
    new_units = group_by_unit(changed)
    problems = [f"unit {u}: got tensors {ns[:3]}..., the layout has {layout.get(u, [])[:3]}..."
                for u, ns in new_units.items() if ns != layout.get(u)]
    previous = store.list()
    base = previous[-1] if previous else None
    if base is not None and base.step > step:
        problems.append(f"step {step} is older than the newest committed snapshot (step {base.step})")
    for unit, unit_names in layout.items():
        if unit in new_units:
            continue
        spec = base.manifest["units"].get(unit) if base is not None else None
        if spec is None:
            problems.append(f"unit {unit} is not in the new tensors and has no committed version to reference")
        elif list(spec["tensors"]) != unit_names:
            problems.append(f"unit {unit}: the committed version ({base.folder}) holds other tensors than the layout")
    if problems:
        raise ValueError("cannot write the composite snapshot of step %d:\n  %s" % (step, "\n  ".join(problems)))

    folder = f"step-{step:010d}-{uuid.uuid4().hex[:8]}"
    units = {}
    for unit, unit_names in layout.items():
        if unit not in new_units:
            units[unit] = base.manifest["units"][unit]
            continue
        blob = st_save({n: np.ascontiguousarray(changed[n]) for n in unit_names})
        path = f"{folder}/{unit}.safetensors"
        store.storage.put(path, blob)
        units[unit] = {
            "path": path,
            "bytes": len(blob),
            "sha256": hashlib.sha256(blob).hexdigest(),
            "step": step,
            "tensors": {n: {"dtype": changed[n].dtype.str, "shape": list(changed[n].shape)} for n in unit_names},
        }
    manifest = {"format_version": FORMAT_VERSION, "step": step, "created_unix_s": time.time(), "names": list(names),
                "config": dict(config or {}), "units": units}
    store.storage.put(f"{folder}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    info = SnapshotInfo(step, folder, manifest)
    committed = previous + [info]
    store._write_index(committed)  # the commit point (SnapshotStore's protocol)
    store._retain(committed)  # keeps every shard a kept manifest references
    return info


def written_bytes(info: SnapshotInfo) -> int:
    """Bytes of the shards ``info`` wrote itself (its units whose shards are in its own folder)."""
    return sum(u["bytes"] for u in info.manifest["units"].values() if u["path"].startswith(info.folder + "/"))
