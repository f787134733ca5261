"""``raycheck inspect`` and ``raycheck verify``: look into a snapshot store and re-hash it."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import logging
import pathlib
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer

from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.orchestrator.summary import metric_coverage, missing_steps_line
from raycheck.storage.backend import TEMP_MAX_AGE_S, Storage, TempFile, local_path
from raycheck.storage.dcp_store import SUBFOLDER, ShardedStore
from raycheck.storage.diffs import DiffCorruptError, DiffStore
from raycheck.storage.log_segments import PREFIX, read_segments
from raycheck.storage.pointers import store_root
from raycheck.storage.snapshots import FOLDER, INDEX, SnapshotInfo, SnapshotStore
from raycheck.storage.steplog import StepLogError, read_log
from raycheck.training.zo import check_records

UriArg = Annotated[str, typer.Argument(metavar="URI", help="Snapshot store: a run directory, a path, file://PATH or s3://BUCKET/PREFIX.")]
EndpointOpt = Annotated[str, typer.Option(help="S3 endpoint URL (default: $AWS_ENDPOINT_URL).")]
ConsistencyOpt = Annotated[str, typer.Option(help="fenced: refuse an S3 server that ignores conditional writes (probed "
                                                  "with a scratch object); unfenced: read it anyway.")]


def open_store(uri: str, s3_endpoint: str, create: bool = False, consistency: str = "unfenced") -> SnapshotStore:
    """The store at ``uri`` (a run directory means its ``snapshots/``); exits 2 with one clear error
    when it cannot be used: a missing folder or bucket, an unreadable store, with ``create`` (a
    store to write) one that fails a write probe (``Storage.probe``, which leaves nothing behind), or
    with ``consistency`` ``fenced`` an S3 server that ignores conditional writes
    (``Storage.check_conditional_writes``, on a scratch object it deletes).
    Only ``create`` makes a missing local folder. A local path that is a file (a run's summary.json,
    a shard) is named as one, with what is expected instead."""
    uri = store_root(uri)  # a run directory means its snapshots/
    folder = local_path(uri)
    try:
        if folder is not None and folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file, not a folder: give a run directory (the --out of raycheck run), "
                                     "a snapshot store's folder (a path or file://PATH) or s3://BUCKET/PREFIX")
        options: dict[str, Any] = {"endpoint_url": s3_endpoint} if s3_endpoint else {}
        store = SnapshotStore(Storage(uri, create=create, **options))
        store.storage.check_bucket()  # the endpoint, then the bucket
        if create:
            store.storage.probe()
        if consistency == "fenced":
            store.storage.check_conditional_writes()
        with _skips_not_logged():
            store.list()
        return store
    except (OSError, ValueError) as exc:
        typer.echo(f"error: cannot {'write to' if create else 'read'} snapshot store {uri}: {exc}", err=True)
        raise typer.Exit(2) from exc


def _log_lines(uri: str, storage: Storage) -> tuple[list[str], int]:
    """Lines describing the run directory's local step log and the mirrored segments (read only),
    and the number of problems found."""
    lines, bad = [], 0
    local = _local_log(uri)
    if local is not None:
        try:
            log_header, records, torn = read_log(local)
            if isinstance(run_seed := log_header.get("run_seed"), int):  # a raycheck run's log: each record this run's
                check_records(records, run_seed, str(local))
            note = f", and a torn tail of {torn} bytes (cut when the run resumes)" if torn else ""
            unlogged = None if records else unlogged_run(local.parent)
            steps = f"none, {unlogged_kind(unlogged)} no steps" if unlogged is not None else _steps(records)
            lines.append(f"ok   step log {local}: {steps}{note}")
        except StepLogError as exc:
            lines.append(f"BAD  step log {local}: {exc}")
            bad += 1
    try:
        header, records = read_segments(storage)
        if header is not None:
            lines.append(f"ok   step log segments in {storage.url('log')}: {_steps(records)}")
    except (StepLogError, OSError) as exc:
        lines.append(f"BAD  step log segments: {exc}")
        bad += 1
    return lines, bad


def _metrics_lines(uri: str) -> list[str]:
    """The line naming the steps that the run directory's step log holds without a row in its
    ``metrics.jsonl`` (``orchestrator.summary.metric_coverage``: rows lost across an interrupt); none
    without both files, a readable log, or a missing row."""
    local, folder = _local_log(uri), local_path(uri)
    if local is None or folder is None or not (folder / "metrics.jsonl").is_file():
        return []
    try:
        records = read_log(local)[1]
    except StepLogError:  # named by _log_lines
        return []
    line = missing_steps_line(metric_coverage(len(records), RunDir.read(folder / "metrics.jsonl")))
    return [f"note metrics: {line}"] if line else []


def _local_log(uri: str) -> pathlib.Path | None:
    """The step log of the run directory ``uri`` (its ``steplog.bin``); None when there is none."""
    folder = local_path(uri)
    return folder / "steplog.bin" if folder is not None and (folder / "steplog.bin").is_file() else None


def unlogged_run(run_dir: pathlib.Path) -> JobConfig | None:
    """The configuration of the run in ``run_dir`` (its ``config.json``) when that run logs no steps by
    design (``JobConfig.uses_step_log`` false, e.g. every ``--algo fo`` run: its step log holds a header
    only); None when it logs them or has no readable configuration."""
    try:
        cfg = JobConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # JSONDecodeError and OldConfigError are ValueErrors
        return None
    return None if cfg.uses_step_log else cfg


def unlogged_kind(cfg: JobConfig) -> str:
    """Who logs no steps, for a run ``unlogged_run`` gave: ``first-order runs (--algo fo) log`` or
    ``--strategy full-sync logs``."""
    return "first-order runs (--algo fo) log" if cfg.algo == "fo" else f"--strategy {cfg.strategy} logs"


def _holds_a_run(uri: str, stores: list[SnapshotStore]) -> bool:
    """Whether ``uri`` holds anything a run writes: a snapshot index, a snapshot folder with a manifest,
    sharded checkpoints, a step log or mirrored log segments (not so an empty or unrelated folder)."""
    storage = stores[0].storage
    return (len(stores) > 1 or storage.exists(INDEX) or bool(stores[0].unindexed()) or _local_log(uri) is not None
            or bool(storage.list(PREFIX)))


def _refuse_no_run(uri: str, stores: list[SnapshotStore]) -> None:
    """Exit 2, saying what is expected instead, when ``uri`` (opened as ``stores``) holds nothing of a
    run (``_holds_a_run``): an empty or unrelated folder or prefix."""
    if not _holds_a_run(uri, stores):
        typer.echo(f"error: no snapshot store or run found at {uri}: it holds no snapshot index ({INDEX}), snapshot "
                   "folder, step log (steplog.bin) or log segments; give a run directory (the --out of raycheck run) "
                   "or its snapshot store", err=True)
        raise typer.Exit(2)


def _steps(records: list) -> str:
    """``steps 0..N-1`` for a step log of N records, ``no steps`` for one without (a run that stopped before
    its first step; a run that logs none by design is named as one: ``unlogged_run``)."""
    return f"steps 0..{len(records) - 1}" if records else "no steps"


def _stores(store: SnapshotStore) -> list[SnapshotStore]:
    """``store``, and the sharded checkpoints next to it when it has any (an ``--fo-parallelism fsdp2``
    run's, in its ``sharded/`` folder: ``storage.dcp_store``); creates nothing."""
    if not store.storage.exists(f"{SUBFOLDER}/{INDEX}"):
        return [store]
    return [store, ShardedStore(store.storage, create=False)]


def _units(manifest: dict) -> str:
    """The ``inspect`` column of a snapshot's units and the step of each (``4 units (3 @ step 2, 1 @ step 5)``),
    or of a sharded checkpoint's files (``3 files of 2 rank(s)``: DCP files of every rank), with its units'
    steps when it is a composite (layer-wise: ``..., 7 units (5 @ step 20, 2 @ step 10)``)."""
    if "world_size" in manifest:
        files = f"{len(manifest['units'])} files of {manifest['world_size']} rank(s)"
        layers = manifest.get("layers")
        return f"{files}, {_unit_steps([s['step'] for s in layers.values()])}" if layers else files
    return _unit_steps([spec["step"] for spec in manifest["units"].values()], width=4)


def _unit_steps(steps: list[int], width: int = 0) -> str:
    """``N units (a @ step s, ...)``: how many units belong to each step (``N`` right-aligned in ``width``)."""
    counts = collections.Counter(steps)
    return f"{len(steps):>{width}} units ({', '.join(f'{n} @ step {s}' for s, n in sorted(counts.items()))})"


def run_of(info: SnapshotInfo) -> str:
    """The run that wrote ``info``, short: ``run ID (trajectory SHA12)``, or ``run -`` (a merge
    result or a store-wide writer)."""
    run = info.manifest["run"]
    return f"run {run['run_id']} (trajectory {run['trajectory_sha256'][:12]})" if run else "run -"


@contextlib.contextmanager
def _skips_not_logged(lister: Callable = SnapshotStore.list) -> Iterator[None]:
    """Drop ``lister``'s log lines about what it skipped (``SnapshotStore.list``: snapshots;
    ``DiffStore.list``: diff batches), for listings whose skips are reported otherwise: inspect and
    verify print each one, and ``open_store``'s check leaves them to the listing that follows it (else
    each would be printed once per listing)."""

    def not_from_list(record: logging.LogRecord) -> bool:
        return record.funcName != lister.__name__

    logger = logging.getLogger(lister.__module__)
    logger.addFilter(not_from_list)
    try:
        yield
    finally:
        logger.removeFilter(not_from_list)


@dataclasses.dataclass(frozen=True)
class Listing:
    """What ``inspect`` and ``verify`` read of a store that may be live (``listing``).

    Attributes:
        infos: the committed snapshots of the index read first.
        skipped: problems with snapshots that are still there on the re-check (damage).
        unindexed: folders with a manifest that the index still does not list on the re-check (damage).
        retired: folders that retention retired (or a writer committed) while they were read: no damage.
    """

    infos: list[SnapshotInfo]
    skipped: list[str]
    unindexed: list[str]
    retired: list[str]


def _folder_of(problem: str) -> str:
    """The snapshot folder a ``SnapshotStore.skipped`` line names (its first path part)."""
    return problem.split(":", 1)[0].split("/", 1)[0]


def listing(store: SnapshotStore) -> Listing:
    """The committed snapshots of ``store``, its skipped snapshots and unindexed folders, each problem
    re-checked against a fresh read of the index: a snapshot skipped (its manifest missing) or a folder
    found not indexed, whose folder the index no longer lists and that was listed when the read began, or
    that the index lists now, was retired or committed during the read (``retired``), not damaged.

    Raises:
        storage.backend.StorageError: storage fails.
    """
    with _skips_not_logged():
        infos, unindexed = store.list(), store.unindexed()
        if not store.skipped and not unindexed:
            return Listing(infos, [], [], [])
        now, still = store.indexed(), set(store.unindexed())
    read = {i.folder for i in infos}
    skipped = [p for p in store.skipped if not (FOLDER.match(_folder_of(p)) and _folder_of(p) not in now)]
    kept = [f for f in unindexed if f in still and f not in read]
    retired = sorted({_folder_of(p) for p in store.skipped if p not in skipped} | (set(unindexed) - set(kept)))
    return Listing(infos, skipped, kept, retired)


def rehash(store: SnapshotStore, info: SnapshotInfo) -> list[str] | None:
    """``store.verify(info)``'s problems; None when there are some but the index no longer lists
    ``info``'s folder (retention retired it while it was read: no damage)."""
    problems = store.verify(info)
    return None if problems and info.folder not in store.indexed() else problems


def _unindexed_line(folders: list[str]) -> str:
    n = len(folders)
    return (f"{n} committed-looking snapshot folder{'s are' if n > 1 else ' is'} not in the index (restores never use "
            f"{'them' if n > 1 else 'it'}): {', '.join(folders)}")


def _diff_lines(storage: Storage, rehash: bool) -> tuple[list[str], int]:
    """Lines for a differential run's gradient records (``storage.diffs.DiffStore``, under ``diffs/``)
    and the number of problems: each commit record that cannot be read and, with ``rehash``, each
    batch whose object is missing, truncated or altered (read whole and checked against its commit
    record's size and sha256 by ``DiffStore.read``). No lines when the store holds no batch."""
    diffs = DiffStore(storage)
    with _skips_not_logged(DiffStore.list):
        batches = diffs.list()
    problems = list(diffs.skipped)
    for batch in batches if rehash else []:
        try:
            diffs.read(batch)
        except DiffCorruptError as exc:
            problems.append(str(exc))
    lines = [f"{'BAD' if problems else 'ok '}  diff batches in {storage.url(diffs.prefix)}: {len(batches)} committed, "
             f"steps {batches[0].first_step}..{max(b.last_step for b in batches)}, {sum(b.bytes for b in batches):,} bytes"
             + (" (re-hashed)" if rehash else "")] if batches else []
    return lines + [f"       {p}" for p in problems], len(problems)


def _temp_lines(temps: list[TempFile]) -> list[str]:
    """``inspect``'s lines for the temp files of interrupted (or ongoing) local writes: their count and
    bytes, then each one's path, size and age; none when there are none."""
    if not temps:
        return []
    head = (f"{len(temps)} temp file(s) of interrupted or ongoing writes, {sum(t.bytes for t in temps):,} bytes "
            f"(never read; retention deletes those unmodified for {TEMP_MAX_AGE_S / 3600:g} h):")
    return [head] + [f"  temp: {t.path}  {t.bytes:,} bytes  modified {t.age_s:.0f} s ago" for t in temps]


def inspect(uri: UriArg, s3_endpoint: EndpointOpt = "", storage_consistency: ConsistencyOpt = "fenced") -> None:
    """List committed snapshots: step, size (bytes of every shard its state is made of), units and the
    step each unit belongs to, the run that wrote it, and the step log; then folders with a manifest
    that the index does not list ("not indexed"). An fsdp2 run's sharded checkpoints (its sharded/
    folder) are listed after the snapshots, then the temp files that killed writes left in the store
    (count, bytes, each one's path), and the steps of a run
    directory's step log without a row in its metrics.jsonl (lost across an interrupt); a differential
    run's diff batches (count, steps, bytes; unreadable commit records are problems).

    Exit codes: 0 when nothing listed is damaged; 1 (after the listing, with a count of problems)
    when a snapshot was skipped (missing, altered or malformed manifest, malformed index), a folder
    is not indexed, or the step log or its segments are damaged (a corrupt record or a gap; a torn
    tail is not damage). Temp files are not problems. 2: a missing store (folder or bucket), a folder
    or prefix that holds nothing of a run, or (--storage-consistency fenced, the default) an S3
    server that ignores conditional writes. Shards are not re-hashed: see verify."""
    main = open_store(uri, s3_endpoint, consistency=storage_consistency)
    stores = _stores(main)
    _refuse_no_run(uri, stores)
    problems = 0
    for store in stores:
        seen = listing(store)
        problems += len(seen.skipped) + len(seen.unindexed)
        kind = "sharded checkpoint" if isinstance(store, ShardedStore) else "committed snapshot"
        typer.echo(f"{store.storage.url()}: {len(seen.infos)} {kind}(s)")
        for info in seen.infos:
            created = datetime.datetime.fromtimestamp(info.manifest["created_unix_s"]).isoformat(timespec="seconds")
            typer.echo(f"  step {info.step:>8}  {info.bytes:>15,} bytes  {_units(info.manifest)}  {run_of(info)}  "
                       f"{created}  {info.folder}")
        for problem in seen.skipped:
            typer.echo(f"  skipped: {problem}")
        for folder in seen.unindexed:
            typer.echo(f"  not indexed: {folder}")
        for folder in seen.retired:
            typer.echo(f"  retired during the read: {folder}")
    log_lines, log_problems = _log_lines(uri, main.storage)
    diff_lines, diff_problems = _diff_lines(main.storage, rehash=False)
    for line in _temp_lines(main.storage.temp_files()) + diff_lines + log_lines + _metrics_lines(uri):
        typer.echo(line)
    problems += log_problems + diff_problems
    if problems:
        typer.echo(f"{problems} problem(s) found", err=True)
        raise typer.Exit(1)


def verify(uri: UriArg, s3_endpoint: EndpointOpt = "", storage_consistency: ConsistencyOpt = "fenced") -> None:
    """Re-hash every shard of every committed snapshot, every file of an fsdp2 run's sharded
    checkpoints, every diff batch of a differential run (against its commit record) and the mirrored
    step log; exit 1 naming each bad one, and the snapshot folders with a manifest that the index does
    not list. Exit 2: a missing store (folder or bucket), or a folder or prefix that holds nothing of a
    run, or (--storage-consistency fenced) an S3 server that ignores conditional writes. A run with nothing to re-hash (no committed snapshot or diff batch: a log-only run, or one
    stopped before its first snapshot) is no usage error: exit 0 saying so, or 1 when its step log is damaged."""
    main = open_store(uri, s3_endpoint, consistency=storage_consistency)
    stores = _stores(main)
    _refuse_no_run(uri, stores)
    bad, verified = [], 0
    for store in stores:
        seen = listing(store)
        for info in seen.infos:
            problems = rehash(store, info)
            where = f"{SUBFOLDER}/{info.folder}" if isinstance(store, ShardedStore) else info.folder
            if problems is None:
                typer.echo(f"note step {info.step:>8}  {where}: retired during the read")
                continue
            verified += 1
            typer.echo(f"{'BAD' if problems else 'ok '}  step {info.step:>8}  {where}")
            for p in problems:
                typer.echo(f"       {p}")
            bad += problems
        for problem in seen.skipped:
            typer.echo(f"BAD  {problem}")
            bad.append(problem)
        if seen.unindexed:
            typer.echo(f"BAD  {_unindexed_line(seen.unindexed)}")
            bad += seen.unindexed
        for folder in seen.retired:
            typer.echo(f"note {folder}: retired during the read")
    lines, log_problems = _log_lines(uri, main.storage)
    diff_lines, diff_problems = _diff_lines(main.storage, rehash=True)
    for line in diff_lines + lines:
        typer.echo(line)
    if bad or log_problems or diff_problems:
        typer.echo(f"{len(bad) + log_problems + diff_problems} problem(s) found", err=True)
        raise typer.Exit(1)
    if not verified and not diff_lines:
        typer.echo(f"nothing damaged, nothing to re-hash: {main.storage.url()} holds no committed snapshot or diff batch "
                   "(a log-only run, or a run stopped before its first snapshot: its state is rebuilt from the initial "
                   "weights and the step log, raycheck replay)")
        return
    typer.echo(f"all {verified} snapshot(s) verified" + (", and the diff batches" if diff_lines else ""))
