"""``raycheck replay``: the state of a run at any logged step, rebuilt from the run's newest own snapshot
at or before that step plus the step log (``training.zo.replay_records_``, the arithmetic every replayer
shares), with its sha256; optionally committed as a snapshot or written as a transformers folder.

Where the log comes from: a run directory's ``steplog.bin`` (its snapshots: the store its
``config.json`` names, taken under the run directory itself when it lay inside the recorded one, so a
moved or copied run directory uses its own; else ``<run>/snapshots``), or, for a store URI, the log segments the persister
mirrored there (``storage.log_segments``). The run's identity (run id and trajectory hash) comes from
the log's header: only snapshots that carry it are used as a base (not other runs', not merge results:
those at or before the step are named, each merge result in a line, the other runs' snapshots in one).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated

import typer

from raycheck.job.config import OldConfigError, refuse_flat
from raycheck.cli.storage import EndpointOpt, open_store, run_of, unlogged_kind, unlogged_run
from raycheck.storage.backend import Storage, local_path, split_uri
from raycheck.storage.log_segments import read_segments
from raycheck.storage.manifest import RunIdentity, layout_of
from raycheck.storage.snapshots import FencedError, SnapshotCorruptError, SnapshotInfo, SnapshotStore
from raycheck.storage.steplog import StepLogCorruptError, StepLogError, StepLogGapError, StepRecord, header_tag, read_prefix
from raycheck.training.model import check_outside_cache, default_cache_dir, model_folder

EXIT_DAMAGED = 1
EXIT_REFUSED = 2
EXIT_NOT_EXACT = 3


class ReplayError(ValueError):
    """The request cannot be served as asked (exit code 2); the message says what to do."""


@dataclass(frozen=True)
class LoggedRun:
    """A run found at a path: its log ``header`` and ``records`` (read from ``log_url``), and the
    ``storage`` holding its snapshots (None: the run has no snapshot folder). A damaged local log
    keeps the records before its first gap or corrupt record, with that ``damage``; ``torn_bytes``:
    the bytes of a torn tail (an append cut short) that the records end before."""

    header: dict
    records: list[StepRecord]
    log_url: str
    storage: Storage | None
    damage: StepLogCorruptError | StepLogGapError | None = None
    torn_bytes: int = 0

    @property
    def identity(self) -> RunIdentity:
        return RunIdentity(self.header["run_id"], self.header["trajectory_sha256"])


@dataclass(frozen=True)
class Replayed:
    """The state after ``step`` steps (``params``, name -> CPU tensor in the model's order and the log's dtype),
    rebuilt from ``base`` (a snapshot; None: the initial weights) plus ``replayed_steps`` logged steps;
    ``skipped``: own snapshots at or before ``step`` that failed verification, with the reason;
    ``others``: the store's snapshots at or before ``step`` that are not the run's, merge results and other
    runs' (never a base: ``own_snapshots``)."""

    step: int
    base: SnapshotInfo | None
    replayed_steps: int
    params: "OrderedDict"
    skipped: list[str]
    others: list[SnapshotInfo] = field(default_factory=list)

    @property
    def base_step(self) -> int:
        return self.base.step if self.base is not None else 0


def find_run(uri: str, s3_endpoint: str = "") -> LoggedRun:
    """The run at ``uri``: a run directory (``steplog.bin``), else a store with mirrored log segments.

    Raises:
        ReplayError: neither a step log nor log segments are there, or the log names no run identity.
        storage.steplog.StepLogError: the log's header is corrupt, or the mirrored segments are corrupt
            or have a gap (a local log's damage past its header is kept in ``LoggedRun.damage``).
        OSError: storage cannot be read.
    """
    local = local_path(uri)
    if local is not None and (local / "steplog.bin").is_file():
        log = read_prefix(local / "steplog.bin")  # a torn tail is not a step
        if not log.records:
            _refuse_unlogged(local)
        run = LoggedRun(log.header, log.records, str(local / "steplog.bin"), _run_storage(local, s3_endpoint),
                        log.damage, log.torn_bytes)
    else:
        storage = open_store(uri, s3_endpoint).storage  # exits 2 naming a missing folder or bucket
        header, records = read_segments(storage)
        if header is None:
            raise ReplayError(_no_log_message(uri))
        run = LoggedRun(header, records, storage.url("log"), storage)
    if not isinstance(run.header.get("run_id"), str) or not isinstance(run.header.get("trajectory_sha256"), str):
        raise ReplayError(f"{run.log_url}: the step log names no run (run_id, trajectory_sha256): not a raycheck run's log")
    return run


def _refuse_unlogged(run_dir: pathlib.Path) -> None:
    """Raise ``ReplayError`` when the run in ``run_dir`` logs no steps by design (its ``config.json``:
    ``JobConfig.uses_step_log`` is false, e.g. every ``--algo fo`` run), so its empty step log has
    nothing to replay; return when there is no readable configuration (the log speaks for itself)."""
    cfg = unlogged_run(run_dir)
    if cfg is None:
        return
    raise ReplayError(f"{run_dir} is an --algo {cfg.algo} --strategy {cfg.strategy} run: {unlogged_kind(cfg)} no steps, so there is no "
                      f"step log to replay; its checkpoints are listed by raycheck inspect {run_dir}")


def _no_log_message(uri: str) -> str:
    """The refusal for ``uri`` holding no log: which stores hold one, and what to give instead (the run
    directory whose snapshots these are, when ``uri`` is a run's ``snapshots`` folder)."""
    local = local_path(uri)
    parent = local.parent if local is not None and (local.parent / "steplog.bin").is_file() else None
    instead = f", here {parent}" if parent is not None else ""
    return (f"no run at {uri}: it holds no step log (steplog.bin) and no mirrored log segments (log/segment-*.bin; "
            f"only a run with remote --storage, e.g. s3://, mirrors them): give the run directory instead (the folder "
            f"holding steplog.bin{instead})")


def _run_storage(run_dir: pathlib.Path, s3_endpoint: str) -> Storage | None:
    """The snapshot storage of the run in ``run_dir``: the one its ``config.json`` names (``_own_store``:
    under ``run_dir`` when it lay inside the run's recorded directory and ``run_dir`` is a moved or copied
    one), else ``<run_dir>/snapshots``; None when that local folder does not exist."""
    uri, options = str(run_dir / "snapshots"), {}
    saved = run_dir / "config.json"
    if saved.is_file():
        try:
            config = json.loads(saved.read_text())
            refuse_flat(config)
            stored, out_dir, options = config["storage"]["uri"], config["out_dir"], dict(config["storage"].get("options") or {})
        except OldConfigError as exc:
            raise ReplayError(f"{saved}: {exc}") from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise ReplayError(f"{saved} is damaged ({type(exc).__name__}: {exc}); pass the snapshot store URI "
                              "(it holds the mirrored log when storage was remote)") from exc
        uri = _own_store(stored, out_dir, run_dir) or uri
    if s3_endpoint:
        options["endpoint_url"] = s3_endpoint
    try:
        return Storage(uri, create=False, **options)
    except FileNotFoundError:
        return None  # no snapshot was ever written: replay from the initial weights


def _own_store(uri: str, out_dir: str, run_dir: pathlib.Path) -> str:
    """The run's store ``uri`` as recorded in its ``config.json``, except a local store that lay inside the
    run's recorded directory ``out_dir`` (the default ``<out>/snapshots``): that one is taken from the same
    place under ``run_dir``, so a moved run directory reads its snapshots where they moved with it, and a
    copy (``cp -r``, the original still there) reads and writes its own, never the original's.

    "Inside" holds as recorded (absolute, ``..`` folded, no symlink followed: a run's ``snapshots`` that is a
    symlink to another disk is still the run's own, and a copy made with the files (``cp -rL``) uses the
    copy's) or with every symlink resolved (the two paths recorded through different links to one folder).

    Raises:
        ReplayError: the recorded local store no longer exists and lay outside ``out_dir`` (it did not
            move with the run directory); the message names both paths.
    """
    stored = local_path(uri) if uri else None
    if stored is None:
        return uri
    as_recorded = (pathlib.Path(os.path.abspath(out_dir)), pathlib.Path(os.path.abspath(split_uri(uri)[1])))
    for recorded, place in (as_recorded, (pathlib.Path(out_dir).resolve(), stored)):
        if place.is_relative_to(recorded):
            return str(run_dir.resolve() / place.relative_to(recorded))
    if not stored.exists():
        raise ReplayError(f"the run's snapshot store {stored} (named in {run_dir / 'config.json'}) no longer exists, and "
                          f"it lay outside the run's directory ({out_dir}), so it did not move with {run_dir}: put it "
                          "back there, or set \"storage\" in config.json to where it is now")
    return uri


def own_snapshots(run: LoggedRun) -> tuple[SnapshotStore | None, list[SnapshotInfo], list[SnapshotInfo]]:
    """The store of ``run``'s snapshots, its own committed ones and the others there, both oldest first:
    merge results (``raycheck merge`` output: no run, a ``merge`` config; a new run's starting point) and
    other runs' snapshots. Neither is a state on ``run``'s logged trajectory, so neither is a base; replay
    names them.

    Raises:
        ReplayError: the store holds snapshots, but every one belongs to another run (or is a merge
            result): the path is probably not this run's store.
    """
    if run.storage is None:
        return None, [], []
    store = SnapshotStore(run.storage)  # store-wide: it sees the other runs' snapshots to name them
    everyone = store.list()
    own = [i for i in everyone if i.manifest["run"] == run.identity.as_dict()]
    if everyone and not own:
        others = sorted({(i.manifest["run"] or {}).get("run_id", "a merge result") for i in everyone})
        raise ReplayError(
            f"{run.storage.url()} holds {len(everyone)} snapshot(s), all of other runs ({', '.join(others[:3])}), none "
            f"of run {run.identity.run_id} whose log {run.log_url} is: pass this run's own store, or --from-initial to "
            "replay every step from the initial weights")
    return store, own, [i for i in everyone if i.manifest["run"] != run.identity.as_dict()]


def initial_params(run: LoggedRun, cache_dir: pathlib.Path) -> "OrderedDict":
    """The initial weights of ``run``'s model (name -> CPU tensor) in the log's parameter dtype (header
    ``dtype``: the replay rounds as the run did), checked against the log.

    Raises:
        ReplayError: the log's model is not on this machine, its files changed since the run (``model_sha256``),
            its dtype is unknown, or its parameter layout differs from the model's.
        training.zo.GeneratorMismatchError: the log was written with another noise generator.
    """
    from raycheck.training.model import is_builtin, layout_sha256, load_model, parameter_layout, read_model_files, trainable_parameters
    from raycheck.training.zo import DTYPES, check_generator

    check_generator(run.header, run.log_url)
    model, recorded = run.header.get("model"), run.header.get("model_sha256")
    if not isinstance(model, str):
        raise ReplayError(f"{run.log_url}: the log's header names no model")
    try:
        found = None if is_builtin(model) else read_model_files(model, cache_dir).sha256
    except ValueError as exc:  # not a built-in name, nor a folder or cached id on this machine
        raise ReplayError(f"{run.log_url}: the run's model is not here: {exc}") from exc
    if recorded and found != recorded:
        raise ReplayError(f"{run.log_url}: model {model} has changed since the run (model_sha256 {recorded[:12]}... in the "
                          f"log, {f'{found[:12]}...' if found else 'a built-in model'} now): replay with the run's original model files")
    dtype = run.header.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ReplayError(f"{run.log_url}: parameter dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    params = trainable_parameters(load_model(model, cache_dir, dtype=dtype))
    if run.header.get("layout_sha256") != layout_sha256(parameter_layout(params)):
        raise ReplayError(f"{run.log_url}: the log's parameter layout differs from model {run.header['model']}'s")
    return params


def check_step(run: LoggedRun, step: int) -> None:
    """Check that the log can rebuild the state after ``step`` steps (0..its intact length).

    Raises:
        StepLogCorruptError, StepLogGapError: ``step`` is past the damage of a damaged log (``run.damage``).
        ReplayError: ``step`` is negative or past the end of an intact log.
    """
    if run.damage is not None and step > len(run.records):
        raise run.damage
    if not 0 <= step <= len(run.records):
        raise ReplayError(f"step {step} is not in the log: {run.log_url} holds {len(run.records)} step(s), so --step "
                          f"can be 0..{len(run.records)} (the state after that many steps)")


def rebuild_(params: "OrderedDict", run: LoggedRun, step: int, from_initial: bool = False) -> Replayed:
    """Turn ``params`` (the initial weights, ``initial_params``) in place into the state after ``step``
    logged steps: the newest own snapshot at or before ``step`` that verifies (``from_initial``: none)
    plus the logged steps after it (``training.zo.replay_records_``).

    Raises:
        ReplayError: ``step`` is not in the log, or only other runs' snapshots are in the store.
        storage.steplog.StepLogCorruptError: a record to replay is not the run's (its seed is not the step
            seed of the header's ``run_seed``: ``training.zo.check_records``).
    """
    from raycheck.training.state import load_into
    from raycheck.training.zo import check_records, replay_records_

    check_step(run, step)
    store, own, others = (None, [], []) if from_initial else own_snapshots(run)
    base: SnapshotInfo | None = None
    skipped: list[str] = []
    for info in reversed([i for i in own if i.step <= step]):
        if store is None:  # own_snapshots gives a store with every snapshot
            raise ReplayError(f"{run.log_url}: snapshot {info.folder} without a store")
        try:
            load_into(params, store.load(info))
            base = info
            break
        except SnapshotCorruptError as exc:
            skipped.append(str(exc))
    records = run.records[base.step if base is not None else 0:step]
    seed = run.header.get("run_seed")
    if not isinstance(seed, int):
        raise ReplayError(f"{run.log_url}: the step log's header names no run seed (run_seed): not a raycheck run's log")
    check_records(records, seed, run.log_url, trajectory=header_tag(run.header))
    replayed = replay_records_(params, records)
    return Replayed(step, base, replayed, params, skipped, [i for i in others if i.step <= step])


def write_snapshot(replayed: Replayed, run: LoggedRun, target: Storage) -> SnapshotInfo:
    """Commit ``replayed`` to ``target`` as a snapshot of ``run`` (its identity), at the run's current
    writer epoch there (a new epoch would fence a live driver of the run) and deleting none of its
    snapshots (no retention). Raises ``FencedError`` when the run's epoch changed meanwhile."""
    from raycheck.training.state import copy_state

    out = SnapshotStore(target, keep_last=sys.maxsize, identity=run.identity, layout=layout_of(replayed.params))
    out.epoch = out.run_epoch()
    config = {"replay": {"log": run.log_url, "base_step": replayed.base_step, "replayed_steps": replayed.replayed_steps}}
    return out.write(replayed.step, copy_state(replayed.params), config=config)


@dataclass(frozen=True)
class HeldSnapshots:
    """The committed, verified snapshots of a run at one step in a store, split by their state's sha256
    (``training.state.state_sha256``) against the replayed state's."""

    equal: SnapshotInfo | None
    """One whose state has the replayed state's sha256: ``--write-snapshot`` commits no second copy."""
    differing: list[tuple[SnapshotInfo, str]]
    """Those whose state has another sha256 (with it): the run's trajectory and its replay disagree."""


def held_snapshots(replayed: Replayed, run: LoggedRun, target: Storage) -> HeldSnapshots:
    """The committed snapshots of ``run`` (its identity) at ``replayed.step`` in ``target``, each read and
    verified and its ``state_sha256`` compared with the replayed state's. A damaged one counts in neither
    list (a new one is written).

    Raises:
        storage.backend.StorageError: ``target`` cannot be read.
    """
    from raycheck.training.state import state_sha256

    store = SnapshotStore(target, identity=run.identity)
    same_step = [i for i in store.list() if i.step == replayed.step and i.manifest["run"] == run.identity.as_dict()]
    want = state_sha256(replayed.params) if same_step else None
    equal, differing = None, []
    for info in same_step:
        try:
            held = state_sha256(store.load(info))
        except SnapshotCorruptError:
            continue
        if held == want:
            equal = equal or info
        else:
            differing.append((info, held))
    return HeldSnapshots(equal, differing)


def commit(replayed: Replayed, run: LoggedRun, target: Storage) -> None:
    """``--write-snapshot``: commit ``replayed`` to ``target`` unless it holds the run's snapshot of the step with
    the same state (said, exit 0); exit ``EXIT_NOT_EXACT`` naming each one of the step with another state."""
    held = held_snapshots(replayed, run, target)
    for info, sha in held.differing:
        typer.echo(f"error: not bitwise equal: {target.url(info.folder)} holds run {run.identity.run_id}'s snapshot of step "
                   f"{info.step} with state_sha256 {sha}, not the replayed state's; one of them is off the run's "
                   f"trajectory (check with `raycheck verify` and `raycheck replay --from-initial`)", err=True)
    if held.differing:
        typer.echo("error: nothing committed", err=True)
        raise typer.Exit(EXIT_NOT_EXACT)
    if held.equal is not None:
        typer.echo(f"not committed: {target.url()} already holds a committed snapshot of run {run.identity.run_id} at "
                   f"step {held.equal.step} with this state_sha256 ({target.url(held.equal.folder)})")
        return
    info = write_snapshot(replayed, run, target)
    typer.echo(f"committed snapshot of step {info.step}: {target.url(info.folder)}")


def _notes(run: LoggedRun) -> list[str]:
    """One line on what of ``run``'s log is not replayed: the damage after its intact records, or a
    torn tail (none for an intact log)."""
    last = f"step {len(run.records) - 1}" if run.records else "its header"
    if run.damage is not None:
        return [f"note: the step log is damaged after {last}, so --step can be 0..{len(run.records)} ({run.damage})"]
    if run.torn_bytes:
        return [f"note: ignored a torn tail of {run.torn_bytes} bytes after {last} (an append cut short)"]
    return []


def recorded_sha256(run_or_store: str, run: LoggedRun, step: int) -> tuple[str, str] | None:
    """The state sha256 the run itself recorded after ``step`` steps, and where: the ``summary.json`` of a
    run directory (its ``worker_hashes``, recorded with ``--hash-every``, or the final ``state_sha256`` of a
    run that finished at ``step``), when that summary is of ``run``'s trajectory; None when not recorded
    (a store, no or an unreadable summary, another trajectory's, a step not hashed)."""
    local = local_path(run_or_store)
    if local is None or not (local / "summary.json").is_file():
        return None
    path = local / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("trajectory_sha256") != run.header["trajectory_sha256"]:
        return None
    sha = (summary.get("worker_hashes") or {}).get(str(step))
    if sha is None and summary.get("ok") and summary.get("final_step") == step:
        sha = summary.get("state_sha256")
    return (sha, str(path)) if isinstance(sha, str) else None


def refuse_off_trajectory(replayed: Replayed, recorded: tuple[str, str], writes: bool) -> None:
    """Exit ``EXIT_NOT_EXACT``: the replayed state is not the one the run recorded (``recorded_sha256``), so the
    base snapshot verified but is off the run's trajectory; nothing is committed or exported (``writes``: one
    was asked)."""
    want, where = recorded
    base = f"the snapshot of step {replayed.base_step} it started from" if replayed.base is not None else "the step log"
    typer.echo(f"error: not bitwise equal: the run recorded state_sha256 {want} at step {replayed.step} ({where}); {base} "
               "is off the run's trajectory (`raycheck verify` checks integrity only; `raycheck replay --from-initial` "
               "rebuilds from the log alone)", err=True)
    if writes:
        typer.echo("error: nothing committed", err=True)
    raise typer.Exit(EXIT_NOT_EXACT)


def _describe(replayed: Replayed, run: LoggedRun, sha: str) -> list[str]:
    """What ``replay`` prints: the run, the base, the replayed steps, the state's ``sha`` (last line)."""
    base = (f"snapshot of step {replayed.base_step} ({run.storage.url(replayed.base.folder)})"
            if replayed.base is not None and run.storage is not None else "the initial weights")
    steps = (f"replayed steps {replayed.base_step}..{replayed.step - 1} ({replayed.replayed_steps})"
             if replayed.replayed_steps else "nothing to replay")

    def url(info: SnapshotInfo) -> str:
        return run.storage.url(info.folder) if run.storage else info.folder

    named = [f"skipped merge result at step {i.step} ({url(i)}): a merge is a new run's starting point (raycheck run "
             f"--algo fo --storage STORE, docs/first-order.md), never a state of run {run.identity.run_id}'s logged steps"
             for i in replayed.others if i.is_merge_result]
    foreign = [f"step {i.step} of {run_of(i)} at {url(i)}" for i in replayed.others if not i.is_merge_result]
    if foreign:
        named.append(f"skipped {len(foreign)} snapshot(s) of other runs, never a base of run {run.identity.run_id}'s "
                      f"logged steps: {', '.join(foreign)}")
    return [*_notes(run), *(f"skipped: {s}" for s in replayed.skipped), *named,
            f"run {run.identity.run_id}, model {run.header['model']}, log {run.log_url} ({len(run.records)} steps)",
            f"step {replayed.step}: base {base}; {steps}",
            f"state_sha256 {sha}"]


def replay(
    run_or_store: Annotated[str, typer.Argument(metavar="RUN_OR_STORE", help=(
        "A run directory (its steplog.bin; snapshots from the store its config.json names: a store recorded inside "
        "the run's directory is taken from inside RUN_OR_STORE, so a moved or copied run directory replays from, and "
        "--write-snapshot writes to, its own snapshots), or a snapshot store "
        "(path, file://, s3://) holding the run's mirrored log segments: only a run with remote --storage (s3://) "
        "mirrors its log, so a local store (a path, file://, a --to target) needs its run directory instead."))],
    step: Annotated[int, typer.Option(help="Rebuild the state after this many logged steps (0..steps in the log).")],
    write_snapshot_: Annotated[bool, typer.Option("--write-snapshot", help=(
        "Commit the state as a snapshot of the run (its identity and writer epoch; no retention) in its store, or in --to; "
        "not again when the store already holds the run's snapshot of --step with the same state sha256 (it is named); "
        "refused (exit 3) when it holds one with another sha256."))] = False,
    to: Annotated[str, typer.Option(help="With --write-snapshot: commit into this store instead (path, file://, s3://; it "
                                         "must be writable; implies --write-snapshot).")] = "",
    export_hf_dir: Annotated[pathlib.Path | None, typer.Option(
        "--export-hf", help="Also write the state as a transformers folder here (new or empty, outside the model cache), as `merge --export-hf` does.")] = None,
    from_initial: Annotated[bool, typer.Option(help="Ignore snapshots: replay every step from the initial weights "
                                                    "(an independent check of the snapshots).")] = False,
    s3_endpoint: EndpointOpt = "",
    cache_dir: Annotated[pathlib.Path, typer.Option(help="Converted-model cache.")] = default_cache_dir(),
) -> None:
    """Rebuild a run's state at --step from its newest own snapshot at or before it plus the step log, and
    print the base, the replayed steps and the state's sha256 (training.state.state_sha256; the same
    hash the run records with --hash-every and in summary.json).

    A damaged run directory log replays up to its first gap or corrupt record, with a note.

    Exit codes: 0 rebuilt; 1 the run's data is damaged or unreadable (--step past a gap or a corrupt
    record in the step log, storage errors, a fenced write); 2 refused, nothing written: no run at the path, --step
    past the log's end, a log of another noise generator or model, only other runs' snapshots in the
    store, a run's local store that is gone and lay outside its run directory, an unusable --to or
    --export-hf target; 3 not bitwise equal, nothing committed: the run directory's summary.json recorded
    another state sha256 at --step (--hash-every, or the final state) than the replayed state's, or, with
    --write-snapshot, the store holds the run's snapshot of --step with another one."""
    from raycheck.storage.merge import prepare_hf_export, write_hf_export
    from raycheck.storage.tensor_files import as_numpy
    from raycheck.training.state import state_sha256

    try:
        if export_hf_dir is not None:  # before anything is read or probed
            check_outside_cache(export_hf_dir, cache_dir)
        run = find_run(run_or_store, s3_endpoint)
        check_step(run, step)
        target = None
        if write_snapshot_ or to:
            target = open_store(to, s3_endpoint, create=True).storage if to else run.storage
            if target is None:
                raise ReplayError(f"the run has no snapshot store to write to ({run_or_store}/snapshots does not exist): "
                                  "pass --to STORE")
            target.probe()
        params = initial_params(run, cache_dir)
        export = None
        if export_hf_dir is not None:  # checked before the replay; the views see the replayed values (in place)
            export = prepare_hf_export({n: as_numpy(t) for n, t in params.items()}, export_hf_dir, run.header["model"],
                                       model_folder(run.header["model"], cache_dir))
        replayed = rebuild_(params, run, step, from_initial)
        sha = state_sha256(replayed.params)
        recorded = recorded_sha256(run_or_store, run, step)
        lines = _describe(replayed, run, sha)
        if recorded is not None and recorded[0] == sha:
            lines.insert(-1, f"bitwise equal to the state the run recorded at step {step} ({recorded[1]})")
        for line in lines:
            typer.echo(line)
        if recorded is not None and recorded[0] != sha:
            refuse_off_trajectory(replayed, recorded, writes=target is not None or export is not None)
        if target is not None:
            commit(replayed, run, target)
        if export is not None:
            typer.echo(f"transformers folder: {write_hf_export(export)}")
    except (ValueError, FileExistsError) as exc:  # ReplayError, GeneratorMismatchError, a bad export target or state
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_REFUSED) from exc
    except (StepLogError, SnapshotCorruptError, FencedError, OSError) as exc:  # StorageError included
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_DAMAGED) from exc
