"""Composite snapshots: assemble units of several snapshots into one, and export it for Hugging Face.

A merge (LLMTailor, PDSW'25) takes each unit (``storage.units.unit_of``: embeddings, one
transformer layer, final norm, LM head) from a chosen snapshot, with the unit's optimizer state
(``optim.<slot>.<parameter>`` tensors travel with their parameter's unit), and writes the result
through ``SnapshotStore.write``: a new committed snapshot whose manifest records, per unit, the step
that unit's tensors belong to, and whose ``config["merge"]`` records where each unit came from.

Rules, checked before anything is read or written (``MergeError`` lists every problem, naming the
units and sources): the reference layout is the first source's manifest; every unit of it is taken
exactly once; every take names a known source and a unit of the reference; every source step exists;
the chosen unit's tensors (names, dtypes, shapes) equal the reference's; a layer range lies within
the reference's layers (it is checked before it is expanded); unit and tensor names are plain names
(``safe_name``: nothing that could leave the output root as a shard path). Shards are verified (size
and sha256) before they are parsed. The output store must hold no committed snapshot yet.

A merge is two steps so that a caller can check everything before anything is committed:
``prepare_merge`` reads and checks (writes nothing), ``commit_merge`` writes; ``merge_snapshots`` does
both. A failed commit removes what it wrote, so the retry finds the output as it was.

``export_hf`` writes a snapshot's parameters (no optimizer state) as a Hugging Face model folder;
``prepare_hf_export`` / ``write_hf_export`` split it the same way. The folder must be new or empty. It is
written in a staging folder next to it and renamed; the staging folders that killed exports left are
deleted by the next export to the same folder once ``TEMP_MAX_AGE_S`` old (``remove_stale_staging_folders``).
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors import safe_open

from raycheck.storage.backend import TEMP_MAX_AGE_S, Storage, TempFile
from raycheck.storage.files import TEMP_MARK
from raycheck.storage.pointers import committed_snapshot, is_one_snapshot, store_at
from raycheck.storage.snapshots import NoSnapshotError, SnapshotInfo, SnapshotStore
from raycheck.storage.tensor_files import FLOAT_DTYPES, dtype_name, save_file
from raycheck.storage.units import GROUP_PREFIX, parameter_of, unit_of

_LAYER_UNIT = re.compile(r"^layer\.(\d+)$")
log = logging.getLogger(__name__)


class MergeError(ValueError):
    """A merge cannot be done as asked; the message lists every problem with the units and sources."""


@dataclass(frozen=True)
class Source:
    """A snapshot to take units from: ``name`` (used by takes), its store, and ``step`` (None: newest)."""

    name: str
    store: SnapshotStore
    step: int | None = None


@dataclass(frozen=True)
class Take:
    """Units to take from source ``source``: unit ``names`` verbatim, and inclusive ``layers`` ranges
    (first, last), kept unexpanded until they are checked against the reference layout (``plan_merge``);
    ``spec`` is the text it was parsed from (for messages)."""

    names: tuple[str, ...]
    layers: tuple[tuple[int, int], ...]
    source: str
    spec: str


@dataclass(frozen=True)
class MergeResult:
    """The committed composite snapshot, and per unit the source name and step it came from."""

    info: SnapshotInfo
    unit_sources: dict[str, str]
    unit_steps: dict[str, int]


def layer_unit(index: int) -> str:
    """The unit name of transformer layer ``index`` (``layer.007``)."""
    return f"layer.{index:03d}"


def parse_source(text: str) -> tuple[str, str, int | None]:
    """``NAME=URI[@STEP]`` -> (name, uri, step or None for the newest committed snapshot).

    Raises:
        MergeError: malformed text.
    """
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or not rest or any(c in name for c in ":,@="):
        raise MergeError(f"--source {text!r}: expected NAME=URI_OR_RUNDIR[@STEP], NAME without ':,@='")
    uri, at, step = rest.rpartition("@")
    if at and step.isdigit():
        return name, uri, int(step)
    return name, rest, None


def parse_take(text: str) -> Take:
    """``UNITS:NAME`` -> ``Take``. UNITS is a comma list of layer ranges (``0-14``), layer numbers
    (``7``) and unit names taken verbatim (``embed``, ``norm``, ``lm_head``, ``layer.007``).

    Raises:
        MergeError: malformed text or a reversed range.
    """
    units_text, sep, source = text.rpartition(":")
    source = source.strip()
    if not sep or not units_text.strip() or not source:
        raise MergeError(f"--take {text!r}: expected UNITS:SOURCE, e.g. 0-14:A or embed,norm:A")
    names: list[str] = []
    layers: list[tuple[int, int]] = []
    for item in (i.strip() for i in units_text.split(",")):
        if not item:
            raise MergeError(f"--take {text!r}: empty unit in the list")
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", item)
        if m:
            first, last = int(m.group(1)), int(m.group(2))
            if last < first:
                raise MergeError(f"--take {text!r}: layer range {item} runs backwards")
            layers.append((first, last))
        elif item.isdigit():
            layers.append((int(item), int(item)))
        else:
            names.append(item)
    return Take(tuple(names), tuple(layers), source, text)


_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


def safe_name(name: object) -> bool:
    """Whether ``name`` (a unit or tensor name) is a plain name: letters, digits, ``_``, ``-`` and
    ``.``, not starting with ``.`` or ``-``, without ``..``; so no absolute path, no ``/`` or ``\\``,
    nothing that leaves a folder when used in a shard path."""
    return isinstance(name, str) and _SAFE_NAME.fullmatch(name) is not None and ".." not in name


def _name_problems(label: str, units: Mapping[str, dict[str, Any]]) -> list[str]:
    """Unsafe unit or tensor names in a manifest's ``units``, and tensors listed under another unit
    than their own (``storage.units.unit_of``): a merge would write them elsewhere."""
    problems = []
    for unit, spec in units.items():
        if not safe_name(unit):
            problems.append(f"{label}: unit name {unit!r} is not a plain name (letters, digits, '_', '-', '.'; "
                            f"no '/', no '..'); refusing a manifest raycheck did not write")
            continue
        for name in spec["tensors"]:
            if not safe_name(name):
                problems.append(f"{label}: tensor name {name!r} of unit {unit} is not a plain name; refusing it")
            elif unit_of(name) != unit:
                problems.append(f"{label}: tensor {name} is listed under unit {unit} but belongs to unit {unit_of(name)}")
    return problems


def _layer_numbers(units: Sequence[str]) -> list[int]:
    return sorted(int(m.group(1)) for u in units if (m := _LAYER_UNIT.match(u)))


def _take_units(take: Take, layers: Sequence[int], label: str) -> tuple[list[str], list[str]]:
    """(units, problems) of ``take``: its layer ranges, checked against the reference's layer
    numbers ``layers`` before they are expanded (a range past them is one problem, and only its
    part within them is expanded), then its unit names."""
    units, problems = [], []
    for first, last in take.layers:
        layers_text = f"layer{'s' if last > first else ''} {first}{f'-{last}' if last > first else ''}"
        if not layers:
            problems.append(f"--take {take.spec!r}: {layers_text}, but the reference layout ({label}) has no layers")
            continue
        if first < layers[0] or last > layers[-1]:
            problems.append(f"--take {take.spec!r}: {layers_text} go{'' if last > first else 'es'} beyond the "
                            f"reference layout ({label}), whose layers are {layers[0]}-{layers[-1]}")
        units += [layer_unit(i) for i in range(max(first, layers[0]), min(last, layers[-1]) + 1)]
    return units + list(take.names), problems


def describe_units(units: Sequence[str]) -> str:
    """Unit names for messages, with runs of consecutive layers collapsed (``layer.000-014``)."""
    out: list[str] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            out.append(layer_unit(run[0]) + (f"-{run[-1]:03d}" if len(run) > 1 else ""))
            run.clear()

    for u in sorted(units, key=_unit_order):
        m = _LAYER_UNIT.match(u)
        if m and run and int(m.group(1)) == run[-1] + 1:
            run.append(int(m.group(1)))
        else:
            flush()
            if m:
                run.append(int(m.group(1)))
            else:
                out.append(u)
    flush()
    return ", ".join(out)


def _unit_order(unit: str) -> tuple[int, int, str]:
    m = _LAYER_UNIT.match(unit)
    return (1, int(m.group(1)), "") if m else ({"embed": 0, "norm": 2, "lm_head": 3}.get(unit, 4), 0, unit)


def resolve(source: Source) -> SnapshotInfo:
    """The committed snapshot ``source`` designates (its ``step``, else the newest one).

    Raises:
        MergeError: no committed snapshot at all, or none at that step (the message lists the steps).
    """
    infos = source.store.list()
    where = f"source {source.name} ({source.store.storage.url()})"
    if not infos:
        raise MergeError(f"{where}: no committed snapshot")
    if source.step is None:
        return infos[-1]
    at_step = [i for i in infos if i.step == source.step]
    if not at_step:
        raise MergeError(f"{where}: no committed snapshot at step {source.step}; "
                         f"committed steps: {sorted({i.step for i in infos})}")
    return at_step[-1]


def _label(name: str, info: SnapshotInfo) -> str:
    return f"source {name} (step {info.step})"


def plan_merge(resolved: Mapping[str, SnapshotInfo], takes: Sequence[Take]) -> dict[str, str]:
    """Unit -> source name, checked against the reference layout (the first of ``resolved``).

    Raises:
        MergeError: every problem found (unknown source, unknown unit, a layer range outside the
            reference's layers, unit taken twice or not at all, a source lacking the unit, tensors
            that differ from the reference), one per line; or, alone, unsafe unit or tensor names
            in the reference's manifest.
    """
    if not resolved:
        raise MergeError("no sources given")
    ref_name, ref = next(iter(resolved.items()))
    ref_units = ref.manifest["units"]
    problems = _name_problems(_label(ref_name, ref), ref_units)
    if sorted(ref.manifest["names"]) != sorted(n for spec in ref_units.values() for n in spec["tensors"]):
        problems.append(f"{_label(ref_name, ref)}: its manifest's tensor names differ from the tensors of its units")
    if problems:
        raise MergeError("cannot merge:\n  " + "\n  ".join(problems))
    layers = _layer_numbers(list(ref_units))
    chosen: dict[str, tuple[str, str]] = {}  # unit -> (source, take spec)
    for take in takes:
        if take.source not in resolved:
            problems.append(f"--take {take.spec!r}: unknown source {take.source!r} (sources: {', '.join(resolved)})")
            continue
        units, range_problems = _take_units(take, layers, _label(ref_name, ref))
        problems += range_problems
        for unit in units:
            if unit not in ref_units:
                problems.append(f"unit {unit} (--take {take.spec!r}) is not a unit of the reference layout, "
                                f"{_label(ref_name, ref)}; its units: {describe_units(list(ref_units))}")
            elif unit in chosen:
                first_source, first_spec = chosen[unit]
                problems.append(f"unit {unit} is taken twice: from source {first_source} (--take {first_spec!r}) "
                                f"and from source {take.source} (--take {take.spec!r})")
            else:
                chosen[unit] = (take.source, take.spec)
    missing = [u for u in ref_units if u not in chosen]
    if missing:
        problems.append(f"unit(s) {describe_units(missing)} of the reference layout ({_label(ref_name, ref)}) "
                        f"are not taken from any source; add a --take for them")
    for unit, (name, _) in chosen.items():
        info = resolved[name]
        spec = info.manifest["units"].get(unit)
        if spec is None:
            problems.append(f"unit {unit}: {_label(name, info)} has no such unit")
            continue
        difference = _layout_difference(spec["tensors"], ref_units[unit]["tensors"])  # so its names are the reference's
        if difference:
            problems.append(f"unit {unit}: {_label(name, info)} does not match the reference layout of "
                            f"{_label(ref_name, ref)}: {difference}")
    if problems:
        raise MergeError("cannot merge:\n  " + "\n  ".join(problems))
    return {u: chosen[u][0] for u in ref_units}


def _layout_difference(tensors: Mapping[str, dict[str, Any]], reference: Mapping[str, dict[str, Any]]) -> str:
    missing = [n for n in reference if n not in tensors]
    extra = [n for n in tensors if n not in reference]
    if missing or extra:
        return f"missing tensors {missing[:3]}, unexpected tensors {extra[:3]}"
    for name, ref in reference.items():
        got = tensors[name]
        if got["dtype"] != ref["dtype"] or list(got["shape"]) != list(ref["shape"]):
            return (f"{name} is {dtype_name(got['dtype'])} {list(got['shape'])}, the reference has "
                    f"{dtype_name(ref['dtype'])} {list(ref['shape'])}")
    return ""


@dataclass(frozen=True)
class PreparedMerge:
    """A checked, loaded merge not yet written: ``state`` (canonical order, verified tensors), per
    unit its source name and step, and the ``config`` recorded in the manifest."""

    state: dict[str, np.ndarray]
    unit_sources: dict[str, str]
    unit_steps: dict[str, int]
    config: dict[str, Any]

    @property
    def step(self) -> int:
        """The composite snapshot's step: the newest unit step."""
        return max(self.unit_steps.values())


def check_output(out: SnapshotStore) -> None:
    """Raise ``MergeError`` when ``out`` already holds a committed snapshot (a merge needs an empty store)."""
    existing = out.list()
    if existing:
        raise MergeError(f"output {out.storage.url()} already holds {len(existing)} committed snapshot(s) "
                         f"(steps {[i.step for i in existing]}); choose an empty location")


def prepare_merge(sources: Sequence[Source], takes: Sequence[Take]) -> PreparedMerge:
    """Resolve ``sources``, plan the units chosen by ``takes`` and load them (verified); writes nothing.

    Each unit keeps the step recorded for it in its source's manifest (``unit_steps``), and tensors
    keep the reference's canonical order.

    Raises:
        MergeError: a source or take is invalid (see the module docstring).
        SnapshotCorruptError: a chosen shard fails verification.
        storage.backend.StorageError: reading failed after retries.
    """
    names = [s.name for s in sources]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise MergeError(f"source name(s) {', '.join(duplicated)} given more than once")
    problems, resolved = [], {}
    for source in sources:
        try:
            resolved[source.name] = resolve(source)
        except MergeError as exc:
            problems.append(str(exc))
    if problems:
        raise MergeError("cannot merge:\n  " + "\n  ".join(problems))
    plan = plan_merge(resolved, takes)
    by_name = {s.name: s for s in sources}
    tensors: dict[str, np.ndarray] = {}
    unit_steps: dict[str, int] = {}
    for unit, name in plan.items():
        info = resolved[name]
        tensors.update(by_name[name].store.load_units(info, [unit]))
        unit_steps[unit] = int(info.manifest["units"][unit]["step"])
    reference = next(iter(resolved.values()))
    state = {n: tensors[n] for n in reference.manifest["names"]}
    config = {"merge": {
        "reference": sources[0].name,
        "sources": {n: {"uri": by_name[n].store.storage.url(), "folder": i.folder, "step": i.step}
                    for n, i in resolved.items()},
        "units": plan,
    }}
    return PreparedMerge(state, plan, unit_steps, config)


def commit_merge(prepared: PreparedMerge, out: SnapshotStore) -> MergeResult:
    """Write ``prepared`` as one committed snapshot in the empty store ``out``. When the write fails,
    the objects it put are deleted (best effort: a store that is down keeps them, unlisted), so a
    retry finds ``out`` as it was.

    Raises:
        MergeError: ``out`` already holds committed snapshots.
        storage.backend.StorageError: writing failed after retries (nothing is committed).
    """
    check_output(out)
    before = set(out.storage.list())
    try:
        info = out.write(prepared.step, prepared.state, config=prepared.config, unit_steps=prepared.unit_steps)
    except BaseException:
        _delete_new(out, before)
        raise
    return MergeResult(info, prepared.unit_sources, prepared.unit_steps)


def _delete_new(out: SnapshotStore, before: set[str]) -> None:
    try:
        for path in sorted(set(out.storage.list()) - before):
            out.storage.delete(path)
    except OSError as exc:
        log.warning("could not remove the partial merge from %s: %s", out.storage.url(), exc)


def merge_snapshots(sources: Sequence[Source], takes: Sequence[Take], out: SnapshotStore) -> MergeResult:
    """Assemble the units chosen by ``takes`` from ``sources`` and commit them as one snapshot in
    ``out`` (``prepare_merge`` then ``commit_merge``). The snapshot's step is the newest unit step.

    Raises:
        MergeError: a source or take is invalid (see the module docstring), or ``out`` already
            holds committed snapshots.
        SnapshotCorruptError: a chosen shard fails verification.
        storage.backend.StorageError: reading or writing failed after retries.
    """
    check_output(out)
    return commit_merge(prepare_merge(sources, takes), out)


# -- Hugging Face export ---------------------------------------------------------------------------
def _reference_tensors(folder: pathlib.Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of the weights in a Hugging Face folder."""
    layout: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():
                s = f.get_slice(name)
                layout[name] = (s.get_dtype(), list(s.get_shape()))
    if not layout:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights to take the layout from")
    return layout


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
"""safetensors dtype -> ``storage.tensor_files.dtype_name``."""


@dataclass(frozen=True)
class HFExport:
    """A checked Hugging Face export not yet written: the target ``folder``, the model folder
    ``model_source`` (config files), and ``params`` (name -> array, the model's tensor order)."""

    folder: pathlib.Path
    model_source: pathlib.Path
    params: dict[str, np.ndarray]
    dtype: str | None = None
    """The run's dtype (``float32``, ``bfloat16``, ``float16``) where it differs from the model folder's
    weights: ``config.json`` then names it; None: the folder's config as it is."""


def prepare_hf_export(state: Mapping[str, np.ndarray], out_dir: str | pathlib.Path, model_name: str,
                      model_source: str | pathlib.Path) -> HFExport:
    """Check that ``state``'s parameters fit model ``model_name``, whose local folder is
    ``model_source`` (``training.model.model_folder``: its config files and weights), and that
    ``out_dir`` is new or empty; writes nothing.

    With tied embeddings the LM head is not exported (a snapshot's ``lm_head.weight``, if any, must
    equal the embedding). Optimizer state (``optim.*``) is dropped.

    Raises:
        ValueError: the parameters do not match the model's (names, shapes, dtypes).
        FileExistsError: ``out_dir`` is a file, or a folder that already holds files (say, another
            checkpoint's index and shards, which would stay beside the new weights).
    """
    folder = pathlib.Path(out_dir)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        held = sorted(p.name for p in folder.iterdir())[:4] if folder.is_dir() else []
        raise FileExistsError(f"{folder} is not an empty folder{f' (it holds {held}...)' if held else ''}: export into "
                              "a new or empty folder, so that no other checkpoint's files stay beside this one")
    source = pathlib.Path(model_source)
    config = json.loads((source / "config.json").read_text())
    expected = _reference_tensors(source)
    params = {n: a for n, a in state.items() if parameter_of(n) is None and not n.startswith(GROUP_PREFIX)}  # weights only
    if config.get("tie_word_embeddings") and "lm_head.weight" in params and "lm_head.weight" not in expected:
        head = params.pop("lm_head.weight")
        embed = params.get("model.embed_tokens.weight")
        if embed is None or not np.array_equal(head, embed):
            raise ValueError(f"{model_name} ties the LM head to the embedding, but the snapshot's "
                             "lm_head.weight differs from model.embed_tokens.weight")
    missing = [n for n in expected if n not in params]
    extra = [n for n in params if n not in expected]
    if missing or extra:
        raise ValueError(f"snapshot does not match model {model_name}: missing {missing[:3]}, unexpected {extra[:3]}")
    run_dtypes = set()
    for name, (st_dtype, shape) in expected.items():
        got, want = dtype_name(params[name].dtype), _ST_DTYPES.get(st_dtype, st_dtype)
        if list(params[name].shape) != shape or (got != want and not {got, want} <= FLOAT_DTYPES):
            raise ValueError(f"{name}: snapshot has {got} {list(params[name].shape)}, model {model_name} "
                             f"expects {want} {shape}")
        if got != want:
            run_dtypes.add(got)
    if len(run_dtypes) > 1:
        raise ValueError(f"snapshot mixes {sorted(run_dtypes)} parameters: a run trains in one dtype")
    return HFExport(folder, source, {n: params[n] for n in expected}, next(iter(run_dtypes), None))


def staging_folders(folder: pathlib.Path) -> list[TempFile]:
    """The staging folders that exports to ``folder`` left in its parent (``.<name>.tmp-<8 hex>``,
    ``write_hf_export``: a hard kill leaves one), sorted: each one's path, bytes (of its files) and age_s
    (seconds since the newest modification of it or of a file in it, by this host's clock). Only that
    exact name pattern, never anything else of the parent (an export may go next to a user's files)."""
    pattern = re.compile(rf"\.{re.escape(folder.name)}{re.escape(TEMP_MARK)}[0-9a-f]{{8}}")
    found, now = [], time.time()
    for entry in sorted(folder.parent.iterdir()) if folder.parent.is_dir() else []:
        if not (pattern.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink()):
            continue
        try:
            stats = [entry.stat(), *(p.stat() for p in entry.rglob("*") if p.is_file())]
        except FileNotFoundError:  # renamed or removed meanwhile
            continue
        found.append(TempFile(str(entry), sum(st.st_size for st in stats[1:]), max(now - max(st.st_mtime for st in stats), 0.0)))
    return found


def remove_stale_staging_folders(folder: pathlib.Path, max_age_s: float = TEMP_MAX_AGE_S) -> list[TempFile]:
    """Delete the staging folders of exports to ``folder`` (``staging_folders``) unmodified for at least
    ``max_age_s`` seconds, as ``Storage.remove_stale_temp_files`` does for temp files (``TEMP_MAX_AGE_S``:
    a younger one may belong to a live export); returns those deleted. A failed delete is logged and
    left for the next export."""
    removed = []
    for staging in staging_folders(folder):
        if staging.age_s < max_age_s:
            continue
        try:
            shutil.rmtree(staging.path)
            removed.append(staging)
        except OSError as exc:
            log.warning("could not delete the stale export staging folder %s: %s", staging.path, exc)
    if removed:
        log.info("deleted %d stale export staging folder(s) of killed exports (%d bytes) next to %s", len(removed),
                 sum(t.bytes for t in removed), folder)
    return removed


def write_hf_export(export: HFExport) -> pathlib.Path:
    """Write ``export``: ``config.json`` (and ``generation_config.json`` when the model has one) and
    ``model.safetensors``, into a temporary sibling folder renamed into place at the end, so the
    target never holds a partial export; first deletes the stale staging folders of earlier exports to
    it that were killed (``remove_stale_staging_folders``). Returns the folder.

    Raises:
        OSError: writing failed (the temporary folder is removed; the target is untouched).
    """
    folder = export.folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging_folders(folder)  # those of earlier exports to it that a hard kill left
    staging = folder.parent / f".{folder.name}{TEMP_MARK}{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        for name in ("config.json", "generation_config.json"):
            if (export.model_source / name).exists():
                shutil.copyfile(export.model_source / name, staging / name)
        if export.dtype is not None:
            config = json.loads((staging / "config.json").read_text())
            config.update({key: export.dtype for key in ("dtype", "torch_dtype") if key in config} or {"dtype": export.dtype})
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({n: np.ascontiguousarray(a) for n, a in export.params.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt"})
        if folder.exists():
            folder.rmdir()  # empty (checked by prepare_hf_export); a file put there since makes this fail
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def export_hf(
    source: Any,
    out_dir: str | pathlib.Path,
    model_name: str,
    model_source: str | pathlib.Path,
    *,
    step: int | None = None,
    **storage_options: Any,
) -> pathlib.Path:
    """Write a snapshot's parameters as a Hugging Face folder that ``from_pretrained`` loads.

    ``source``: one snapshot (a ``ray.train.Checkpoint`` raycheck reported, e.g. ``Result.checkpoint``; a
    pointer folder, ``storage.pointers``; a snapshot folder's path or URI) or a store (a ``SnapshotStore``,
    ``Storage``, its URI or a run directory, ``storage.pointers.store_root``: its newest snapshot that verifies,
    or the one at ``step``), read with
    ``storage_options`` (e.g. ``endpoint_url``). ``config.json`` (and ``generation_config.json`` when
    present) come from ``model_source``, the local folder of model ``model_name``
    (``training.model.model_folder``: a built-in name, a model folder or a cached model id); the weights go
    to ``model.safetensors``, parameters only (optimizer state dropped), in the model's own tensor names
    (``prepare_hf_export``, ``write_hf_export``).

    Raises:
        ValueError: the snapshot's parameters do not match the model's (names, shapes, dtypes); a malformed pointer.
        FileExistsError: ``out_dir`` is not a new or empty folder.
        FileNotFoundError: ``source`` names a snapshot that is not committed in its store.
        NoSnapshotError: no snapshot (at ``step``) verifies.
    """
    if not isinstance(source, SnapshotStore | Storage) and step is None and is_one_snapshot(source, **storage_options):
        store, info = committed_snapshot(source, **storage_options)
        state = store.load(info)
    else:
        store = source if isinstance(source, SnapshotStore) else (
            SnapshotStore(source) if isinstance(source, Storage) else store_at(str(source), **storage_options))
        if step is None:
            state = store.load_latest().state
        else:
            infos = [i for i in store.list() if i.step == step]
            if not infos:
                raise NoSnapshotError(f"no committed snapshot at step {step} in {store.storage.url()}")
            state = store.load(infos[-1])
    return write_hf_export(prepare_hf_export(state, out_dir, model_name, model_source))
