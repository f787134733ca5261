"""Benchmark: the per-step blocked time of each step-log durability level beside the full-async staging copy.

Measures in one run, with the components a training run uses (``workers.rank0_log.replicated_append``:
rank 0's local append, then the send to a ``LogKeeperActor`` on a local Ray cluster):

- ``process``: the 84-byte record written and fsynced in rank 0's local log (the send is queued);
- ``node``: also the Ray round trip to the log keeper, which appends and fsyncs it in its own file
  (on this machine the keeper is another process; on a cluster it is another node, plus the network);
- ``cluster``: also the keeper's upload of the log's open tail as a segment to an S3 server (moto on
  127.0.0.1; group commit, one upload per batch of waiting appends);
- the full-async staging copy: the copy of the model's trainable state to CPU memory
  (``training.state.copy_state``) that an async full checkpoint must make before training continues,
  for the tiny model and SmolLM2-135M (538 MB);
- with ``--snapshot-load``: ``process`` again while snapshots of SmolLM2's size are written to the same
  disk (``SnapshotStore.write``, as the persister does), once per local writer: ``one-go`` (each shard
  written whole, then fsynced: the writer before chunking), ``chunked`` (``Storage``'s default:
  ``LOCAL_WRITE_CHUNK_BYTES`` per ``fdatasync``), one per extra ``--chunk-bytes`` and
  ``--write-rate-mb-s``, and ``no disk`` (the same snapshots to ``memory://``: their CPU work alone);
  with ``--process-writers`` also the chunked writer in a process of its own (as the persister actor
  is), at normal priority and at idle CPU and I/O priority (``storage.priority.lower_to_idle``, the
  persister's ``snapshot.persister_priority = "idle"``), and the direct-I/O writer (``Storage(write_direct=True)``:
  ``O_DIRECT``, 256 KiB per ``fdatasync``) in a process of its own at normal and at idle priority, and
  at idle priority with one sync per object (``write_chunk_bytes=None``), each stopped after
  ``--load-max-s`` seconds if it has not written its snapshots by then (a starved idle writer).
  The writers take turns in ``--load-rounds`` rounds, each round starting with a quiet measurement, so
  that the machine's changing load falls on all of them alike; the records (one per 10 ms) span
  ``LOAD_SNAPSHOTS`` whole snapshots. Each writer is reported as mean under load / quiet median, staging
  copy / mean under load, its snapshot write throughput (MB/s) and the page cache's Dirty + Writeback;
- with ``--log-layouts``: a raw 84-byte record (no Ray, no keeper) made durable in each of two file
  layouts, quiet and under the chunked writer in a process of its own, in ``--load-rounds`` rounds:
  ``append + fsync`` (the step log's layout: the file grows, so on ext4 each fsync commits the
  journal) and ``pre-zeroed, overwrite + fdatasync`` (the write-ahead-log remedy of PostgreSQL's
  pre-zeroed segments: the file is extended ahead with written zeros, ``PREZERO_BYTES`` at a time,
  so an append overwrites allocated blocks and its ``fdatasync`` needs no journal commit), with the
  disk's own write and flush latency (``block_stat``) beside them.

Prints a table of median, mean and p99 (microseconds) and the ratios staging copy / level.

    python -m raycheck.experiments.durability_bench [--records 300] [--copies 5] [--snapshot-load] [--dir DIR]
        [--load-rounds 3] [--chunk-bytes N ...] [--write-rate-mb-s R ...] [--process-writers] [--load-max-s S]
        [--log-layouts]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import multiprocessing
import os
import pathlib
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray

from raycheck.actors.log_keeper import LogKeeperActor, RemoteKeeper
from raycheck.experiments.log_cost import percentile
from raycheck.experiments.s3_server import LocalS3Server
from raycheck.orchestrator.cluster import runtime_env
from raycheck.storage.backend import LOCAL_WRITE_CHUNK_BYTES, Storage
from raycheck.storage.priority import lower_to_idle
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.tensor_files import load, save_file
from raycheck.storage.steplog import StepRecord, header_tag
from raycheck.training.model import load_model, trainable_parameters
from raycheck.workers.rank0_log import KeeperSender, open_local_log, replicated_append
from raycheck.training.state import copy_state
from raycheck.workers.zo_session import on_cpu

LEVELS = ("process", "node", "cluster")
WARMUP_RECORDS = 20
"""Records appended before the measured ones (actor lookup, first connections)."""
LOAD_SNAPSHOTS = 2
"""Snapshots a writer completes while the log is measured under load (the records span whole snapshots)."""
STEP_GAP_S = 0.01
"""Seconds between two records under snapshot load and in the quiet runs between them (a step's compute)."""
PREZERO_BYTES = 1 << 20
"""Bytes of zeros the pre-zeroed layout writes (and fsyncs) ahead of its end whenever a record would pass it."""
LOG_LAYOUTS = ("append + fsync", "pre-zeroed, overwrite + fdatasync")
HEADER = {"run_id": "durability-bench", "trajectory_sha256": "0" * 64, "layout_sha256": "0" * 64, "generator": "bench"}


def record(step: int) -> StepRecord:
    return StepRecord(step=step, seed=step, projected_grad=0.1, loss_plus=0.7, loss_minus=0.6, lr=1e-6, eps=1e-3,
                      weight_decay=0.0, batch_id=step, trajectory=header_tag(HEADER))


def blocked_per_step_s(level: str, folder: pathlib.Path, records: int, s3: LocalS3Server,
                       ready: threading.Event | None = None, until: Callable[[], bool] | None = None,
                       gap_s: float = 0.0) -> list[float]:
    """Seconds each of ``records`` step records blocked rank 0 at durability ``level`` (after
    ``WARMUP_RECORDS`` unmeasured ones): a fresh keeper actor and local log in ``folder``. ``ready`` is
    set when the measured records start; with ``until``, they go on (``records`` at least) until it
    returns True; ``gap_s`` seconds pass between two records (a step's compute)."""
    folder.mkdir(parents=True)
    storage = Storage(s3.uri(f"{folder.name}/"), endpoint_url=s3.endpoint) if level == "cluster" else None
    name = f"durability-bench-{uuid.uuid4().hex[:8]}"
    actor: Any = ray.remote(LogKeeperActor).options(name=name, num_cpus=0, max_concurrency=8, runtime_env=runtime_env()).remote(
        str(folder / "keeper.bin"), header=HEADER, mirror_to=storage, commit_to_storage=storage is not None)
    keeper = RemoteKeeper(name)
    opened = open_local_log(folder / "local.bin", keeper)
    sender = KeeperSender(keeper, 0, wait=level != "process")
    commit = replicated_append(opened.writer, sender)
    try:
        for step in range(WARMUP_RECORDS):
            commit(record(step))
        if ready is not None:
            ready.set()
        blocked: list[float] = []
        for step in itertools.count(WARMUP_RECORDS):
            if len(blocked) >= records and (until is None or until()):
                break
            blocked.append(commit(record(step)))
            time.sleep(gap_s)
        sender.close()
    finally:
        opened.writer.close()
        ray.kill(actor)
    return blocked


def raw_append_s(layout: str, folder: pathlib.Path, records: int, ready: threading.Event | None = None,
                 until: Callable[[], bool] | None = None) -> list[float]:
    """Seconds each of ``records`` 84-byte records took to become durable in a fresh file of ``layout``
    (one of ``LOG_LAYOUTS``) in ``folder``, after ``WARMUP_RECORDS`` unmeasured ones, one record per
    ``STEP_GAP_S``; ``ready`` and ``until`` as in ``blocked_per_step_s``. A pre-zeroed extension is
    counted in the record that triggers it."""
    folder.mkdir(parents=True)
    data = record(0).encode()
    overwrite = layout == LOG_LAYOUTS[1]
    fd = os.open(folder / "raw.bin", os.O_WRONLY | os.O_CREAT | (0 if overwrite else os.O_APPEND))
    end = allocated = 0
    blocked: list[float] = []
    try:
        for step in itertools.count():
            if step == WARMUP_RECORDS and ready is not None:
                ready.set()
            if len(blocked) >= records and (until is None or until()):
                break
            t0 = time.perf_counter()
            if not overwrite:
                os.write(fd, data)
                os.fsync(fd)
            else:
                if end + len(data) > allocated:
                    os.pwrite(fd, bytes(PREZERO_BYTES), allocated)
                    os.fsync(fd)
                    allocated += PREZERO_BYTES
                os.pwrite(fd, data, end)
                os.fdatasync(fd)
            end += len(data)
            if step >= WARMUP_RECORDS:
                blocked.append(time.perf_counter() - t0)
            time.sleep(STEP_GAP_S)
    finally:
        os.close(fd)
    return blocked


def block_stat(path: pathlib.Path) -> tuple[int, int, int, int]:
    """(writes, ms spent on them, flushes, ms spent on them) so far on the block device holding ``path``
    (Linux ``/sys/dev/block/MAJ:MIN/stat``; zeros where it does not exist, e.g. tmpfs, or has no flush
    fields, before Linux 5.5)."""
    dev = os.stat(path).st_dev
    try:
        fields = pathlib.Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat").read_text().split()
    except OSError:
        return 0, 0, 0, 0
    if len(fields) < 17:
        return 0, 0, 0, 0
    return int(fields[4]), int(fields[7]), int(fields[15]), int(fields[16])


def log_layouts(folder: pathlib.Path, records: int, rounds: int, state: dict, write: Writer, max_s: float) -> dict:
    """``rounds`` rounds in which each of ``LOG_LAYOUTS`` in turn (the order alternating between rounds)
    is measured quiet (``records // rounds`` records) and then under ``write``'s snapshots (as
    ``under_snapshot_load``). Returns ``{layout: {"quiet": summary, "loaded": summary, "disk": {"quiet" |
    "loaded": {"write_ms", "flush_ms"}}}}``: the disk's mean milliseconds per write and per flush."""
    per_round = max(records // rounds, 1)
    runs: dict[str, dict[str, list]] = {layout: {"quiet": [], "loaded": [], "stat_quiet": [], "stat_loaded": []}
                                        for layout in LOG_LAYOUTS}
    folder.mkdir(parents=True)
    for r in range(rounds):
        for i, layout in enumerate(LOG_LAYOUTS if r % 2 == 0 else LOG_LAYOUTS[::-1]):
            def measure(log: pathlib.Path, ready: threading.Event, until: Callable[[], bool], layout: str = layout) -> list[float]:
                return raw_append_s(layout, log, 1, ready, until)

            for phase in ("quiet", "loaded"):
                before = block_stat(folder)
                if phase == "quiet":
                    blocked = raw_append_s(layout, folder / f"quiet-{r}-{i}", per_round)
                else:
                    blocked = under_snapshot_load(folder / f"load-{r}-{i}", state, write, max_s, measure)["blocked"]
                runs[layout][phase] += blocked
                runs[layout][f"stat_{phase}"].append([b - a for a, b in zip(before, block_stat(folder))])

    def disk(stats: list[list[int]]) -> dict:
        writes, write_ms, flushes, flush_ms = (sum(column) for column in zip(*stats))
        return {"write_ms": write_ms / max(writes, 1), "flush_ms": flush_ms / max(flushes, 1)}

    return {layout: {"quiet": summarize(run["quiet"]), "loaded": summarize(run["loaded"]),
                     "disk": {"quiet": disk(run["stat_quiet"]), "loaded": disk(run["stat_loaded"])}}
            for layout, run in runs.items()}


def staging_copy_s(model: str, copies: int) -> tuple[int, list[float], dict]:
    """(state bytes, seconds of each of ``copies`` staging copies, the last copy) of ``model``'s trainable state."""
    params = trainable_parameters(load_model(model))
    seconds, staged = [], {}
    for _ in range(copies):
        t0 = time.perf_counter()
        staged = copy_state(on_cpu(params))
        seconds.append(time.perf_counter() - t0)
    return sum(a.nbytes for a in staged.values()), seconds, staged


def writers(chunk_bytes: list[int], rates_mb_s: list[float]) -> dict[str, Callable[[pathlib.Path], Storage]]:
    """Snapshot writers to compare, name -> a factory of the ``Storage`` at a folder: ``one-go`` (each
    object written whole, then fsynced), ``chunked`` (the default), a chunked one per extra chunk size,
    a default-chunked one capped at each rate (MB/s), and ``no disk`` (``memory://``: the snapshot's CPU
    work, serialising and hashing, without a disk write: the CPU's share of the load)."""

    def local(**options) -> Callable[[pathlib.Path], Storage]:
        return lambda folder: Storage(str(folder), **options)

    chosen = {"one-go": local(write_chunk_bytes=None), "chunked": local()}
    for n in chunk_bytes:
        if n != LOCAL_WRITE_CHUNK_BYTES:
            chosen[f"chunks of {n / 2**20:g} MiB"] = local(write_chunk_bytes=n)
    for rate in rates_mb_s:
        chosen[f"chunked, capped at {rate:g} MB/s"] = local(write_rate_bytes_per_s=rate * 1e6)
    chosen["no disk (memory://)"] = lambda folder: Storage(f"memory://durability-bench-{uuid.uuid4().hex}")
    return chosen


Writer = Callable[[pathlib.Path, dict, threading.Event, threading.Event, threading.Event, list], None]
"""``(folder, state, prepared, measuring, done, written_s)``: writes ``state`` as snapshots under
``folder``, over and over, from the moment ``measuring`` is set until ``done`` is, appending each
snapshot's seconds to ``written_s``; sets ``prepared`` once it is ready to start (or has failed).
Runs on a thread of the bench."""


def thread_writer(make_storage: Callable[[pathlib.Path], Storage]) -> Writer:
    """Snapshots written on a thread of the bench process, into ``make_storage(folder)``."""

    def write(folder: pathlib.Path, state: dict, prepared: threading.Event, measuring: threading.Event, done: threading.Event,
              written_s: list) -> None:
        store = SnapshotStore(make_storage(folder), keep_last=1)
        step = 0
        prepared.set()
        measuring.wait()
        while not done.is_set():
            t0 = time.perf_counter()
            store.write(step, state)
            written_s.append(time.perf_counter() - t0)
            step += 1

    return write


def _child_writer(folder: str, state_file: str, idle: bool, options: dict, conn) -> None:
    """A writer process: load the state, lower itself when ``idle``, say ``ready``, wait for ``go``, then
    write snapshots (local ``Storage(folder, **options)``) and send each one's seconds until the parent ends it."""
    state = load(pathlib.Path(state_file).read_bytes())
    if idle:
        lower_to_idle()
    conn.send("ready")
    conn.recv()
    store = SnapshotStore(Storage(folder, **options), keep_last=1)
    for step in itertools.count():
        t0 = time.perf_counter()
        store.write(step, state)
        conn.send(time.perf_counter() - t0)


def process_writer(state_file: pathlib.Path, idle: bool, **options: Any) -> Writer:
    """Snapshots written by a process of its own (``multiprocessing`` spawn; the state read from
    ``state_file``) into ``Storage(folder, **options)``, at idle priority when ``idle``; killed once
    ``done`` is set."""

    def write(folder: pathlib.Path, state: dict, prepared: threading.Event, measuring: threading.Event, done: threading.Event,
              written_s: list) -> None:
        spawn = multiprocessing.get_context("spawn")
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=_child_writer, args=(str(folder), str(state_file), idle, options, child), daemon=True)
        proc.start()  # its start-up (imports, loading the state) is over before the measured records begin
        try:
            ready = parent.recv()
            prepared.set()
            if ready != "ready":
                raise RuntimeError(f"the writer process did not start: {ready!r}")
            measuring.wait()
            parent.send("go")
            while not done.is_set():
                if parent.poll(STEP_GAP_S):
                    written_s.append(parent.recv())
        finally:
            prepared.set()
            proc.kill()
            proc.join()

    return write


def process_writers(state_file: pathlib.Path) -> dict[str, Writer]:
    """The chunked writer and the direct one in a process of their own (as the persister actor), at
    normal and at idle priority, and the direct one with a single sync per object at idle priority."""
    return {"chunked, own process": process_writer(state_file, idle=False),
            "chunked, own process, idle priority": process_writer(state_file, idle=True),
            "direct, own process": process_writer(state_file, idle=False, write_direct=True),
            "direct, own process, idle priority": process_writer(state_file, idle=True, write_direct=True),
            "direct, one sync, own process, idle": process_writer(state_file, idle=True, write_direct=True,
                                                                  write_chunk_bytes=None)}


def dirty_mb() -> float:
    """The page cache's Dirty + Writeback, MB (Linux ``/proc/meminfo``; 0 where it does not exist)."""
    try:
        lines = pathlib.Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return 0.0
    return sum(int(line.split()[1]) for line in lines if line.startswith(("Dirty:", "Writeback:"))) / 1024


Measure = Callable[[pathlib.Path, threading.Event, Callable[[], bool]], list[float]]
"""``(folder, ready, until)``: blocked seconds per record, as ``blocked_per_step_s`` with those arguments."""


def under_snapshot_load(folder: pathlib.Path, state: dict, write: Writer, max_s: float, measure: Measure) -> dict:
    """``measure``'s blocked times (one record per ``STEP_GAP_S``) while ``write`` writes ``state`` as
    snapshots over and over into ``folder / "snapshots"`` (the same disk, for a local one), until
    ``LOAD_SNAPSHOTS`` snapshots are written or ``max_s`` seconds have passed. Returns ``{"blocked":
    seconds, "snapshots": written, "bytes_per_s": the writer's throughput (over the seconds spent
    writing; 0 if none was written), "dirty_mb": samples of ``dirty_mb`` every ``STEP_GAP_S``}``."""
    measuring, done = threading.Event(), threading.Event()
    state_bytes = sum(a.nbytes for a in state.values())
    written_s: list[float] = []
    dirty: list[float] = []
    deadline: list[float] = []

    prepared = threading.Event()

    def write_snapshots() -> None:
        write(folder / "snapshots", state, prepared, measuring, done, written_s)

    def sample_dirty() -> None:
        measuring.wait()
        while not done.wait(STEP_GAP_S):
            dirty.append(dirty_mb())

    threads = [threading.Thread(target=f, name=f"bench-{f.__name__}", daemon=True) for f in (write_snapshots, sample_dirty)]
    for thread in threads:
        thread.start()
    prepared.wait()
    try:
        def loaded_enough() -> bool:
            if not deadline:  # the first call: the measured records have just started
                deadline.append(time.monotonic() + max_s)
            return len(written_s) >= LOAD_SNAPSHOTS or time.monotonic() > deadline[0]

        blocked = measure(folder / "log", measuring, loaded_enough)
    finally:
        done.set()
        measuring.set()  # threads still waiting (the log failed to start) end at once
        for thread in threads:
            thread.join()
    return {"blocked": blocked, "snapshots": len(written_s),
            "bytes_per_s": state_bytes * len(written_s) / sum(written_s) if written_s else 0.0, "dirty_mb": dirty or [0.0]}


def snapshot_load(folder: pathlib.Path, records: int, rounds: int, s3: LocalS3Server, state: dict,
                  chosen: dict[str, Writer], max_s: float = float("inf")) -> dict:
    """``rounds`` rounds of a quiet ``process`` measurement (``records // rounds`` records) followed by
    one under each writer of ``chosen``; the blocked times pooled per writer. Returns ``{"quiet":
    summary, "writers": {name: summary + snapshots_written, write_mb_s (mean over rounds),
    dirty_max_mb, dirty_mean_mb}}``."""
    per_round = max(records // rounds, 1)
    quiet: list[float] = []
    runs: dict[str, list[dict]] = {name: [] for name in chosen}

    def measure(log: pathlib.Path, ready: threading.Event, until: Callable[[], bool]) -> list[float]:
        return blocked_per_step_s("process", log, 1, s3, ready=ready, until=until, gap_s=STEP_GAP_S)

    for r in range(rounds):
        quiet += blocked_per_step_s("process", folder / f"quiet-{r}", per_round, s3, gap_s=STEP_GAP_S)
        for i, (name, write) in enumerate(chosen.items()):
            runs[name].append(under_snapshot_load(folder / f"load-{r}-{i}", state, write, max_s, measure))
    return {"quiet": summarize(quiet), "writers": {name: pooled(done) for name, done in runs.items()}}


def pooled(runs: list[dict]) -> dict:
    """One writer's ``under_snapshot_load`` results of every round, pooled."""
    dirty = [mb for run in runs for mb in run["dirty_mb"]]
    return {**summarize([s for run in runs for s in run["blocked"]]),
            "snapshots_written": sum(run["snapshots"] for run in runs),
            "write_mb_s": statistics.fmean(run["bytes_per_s"] for run in runs) / 1e6,
            "dirty_max_mb": max(dirty), "dirty_mean_mb": statistics.fmean(dirty)}


def summarize(seconds: list[float]) -> dict:
    return {"median_us": statistics.median(seconds) * 1e6, "mean_us": statistics.fmean(seconds) * 1e6,
            "p99_us": percentile(seconds, 0.99) * 1e6, "n": len(seconds)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=300, help="Measured step records per level.")
    ap.add_argument("--copies", type=int, default=5, help="Staging copies per model.")
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"])
    ap.add_argument("--snapshot-load", action="store_true", help="Also measure process under SmolLM2-sized snapshot writes.")
    ap.add_argument("--load-rounds", type=int, default=3, help="Rounds in which the writers take turns (--snapshot-load).")
    ap.add_argument("--chunk-bytes", type=int, nargs="*", default=[],
                    help="Extra chunk sizes (bytes per fdatasync) to compare (--snapshot-load).")
    ap.add_argument("--write-rate-mb-s", type=float, nargs="*", default=[],
                    help="Also the default chunked writer capped at each of these rates, MB/s (--snapshot-load).")
    ap.add_argument("--process-writers", action="store_true",
                    help="Also the chunked and the direct-I/O writers in a process of their own, at normal and at idle "
                         "priority (--snapshot-load).")
    ap.add_argument("--load-max-s", type=float, default=float("inf"),
                    help="Seconds a writer may take for its snapshots before its loaded run ends (--snapshot-load).")
    ap.add_argument("--log-layouts", action="store_true",
                    help="Also a raw record append + fsync against overwrite + fdatasync in a pre-zeroed file, quiet and "
                         "under the chunked writer in its own process.")
    ap.add_argument("--dir", default=None, help="Folder for the logs (default: a temp folder; its disk is measured).")
    args = ap.parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request lines
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")  # for moto; set before Ray starts so the keeper inherits them
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")

    result: dict = {"levels": {}, "staging": {}}
    staged_states = {}
    for model in args.models:
        state_bytes, seconds, staged_states[model] = staging_copy_s(model, args.copies)
        result["staging"][model] = {"state_bytes": state_bytes, **summarize(seconds)}
    with LocalS3Server() as s3, tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=f"durability-bench-{uuid.uuid4().hex[:6]}")
        big = max(staged_states.values(), key=lambda s: sum(a.nbytes for a in s.values()))
        state_file = pathlib.Path(tmp) / "state.safetensors"
        if args.process_writers or args.log_layouts:
            save_file(big, str(state_file))
        try:
            for level in LEVELS:
                result["levels"][level] = summarize(blocked_per_step_s(level, pathlib.Path(tmp) / level, args.records, s3))
            if args.snapshot_load:
                chosen = {name: thread_writer(make) for name, make in writers(args.chunk_bytes, args.write_rate_mb_s).items()}
                if args.process_writers:
                    chosen |= process_writers(state_file)
                result["process_under_snapshot_load"] = snapshot_load(
                    pathlib.Path(tmp) / "loaded", args.records, args.load_rounds, s3, big, chosen, args.load_max_s)
            if args.log_layouts:
                result["log_layouts"] = log_layouts(pathlib.Path(tmp) / "layouts", args.records, args.load_rounds, big,
                                                    process_writer(state_file, idle=False), args.load_max_s)
        finally:
            ray.shutdown()
    print_table(result)
    return result


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``1,568x``, with two significant digits below 10 (``0.25x``)."""
    r = a / b
    return f"{r:,.0f}x" if r >= 10 else f"{r:.2g}x"


def print_table(result: dict) -> None:
    what = {"process": "local write + fsync (send queued)",
            "node": "+ Ray round trip to the log keeper (another process here)",
            "cluster": "+ segment upload to S3 (moto, 127.0.0.1), group commit"}
    print(f"{'level':<9} {'blocks the step until':<58} {'median':>9} {'mean':>9} {'p99':>9}  (us, per step)")
    rows = [(level, what[level], result["levels"][level]) for level in LEVELS]
    load = result.get("process_under_snapshot_load")
    if load is not None:
        rows.append(("process", "quiet, between the loaded runs below", load["quiet"]))
        rows += [("process", f"under snapshot load, {name} ({s['snapshots_written']} snapshots)", s)
                 for name, s in load["writers"].items()]
    for level, text, s in rows:
        print(f"{level:<9} {text:<58} {s['median_us']:9.0f} {s['mean_us']:9.0f} {s['p99_us']:9.0f}")
    for model, s in result["staging"].items():
        print(f"full-async staging copy, {model} ({s['state_bytes'] / 1e6:.1f} MB): median {s['median_us'] / 1e3:.2f} ms, "
              f"mean {s['mean_us'] / 1e3:.2f} ms")
        ratios = ", ".join(f"{level} {ratio(s['median_us'], result['levels'][level]['median_us'])} "
                           f"(mean {ratio(s['mean_us'], result['levels'][level]['mean_us'])})" for level in LEVELS)
        print(f"  staging copy / level median: {ratios}")
    if load is not None:
        print_load_ratios(load, max(result["staging"].values(), key=lambda s: s["state_bytes"]))
    if "log_layouts" in result:
        print_log_layouts(result["log_layouts"])


def print_load_ratios(load: dict, staging: dict) -> None:
    """Per writer: mean under load / quiet median (target <= 2x), staging copy / mean, write MB/s."""
    quiet = load["quiet"]
    print(f"quiet process: mean / median = {quiet['mean_us'] / quiet['median_us']:.1f}x (the CPU's share, no snapshots)")
    for name, s in load["writers"].items():
        print(f"{name:<36} mean under load / quiet median = {s['mean_us'] / quiet['median_us']:5.1f}x (target <= 2x), "
              f"staging copy / mean = {ratio(staging['median_us'], s['mean_us']):>6}, snapshot writes {s['write_mb_s']:.0f} MB/s, "
              f"dirty + writeback max {s['dirty_max_mb']:.0f} MB (mean {s['dirty_mean_mb']:.0f})")


def print_log_layouts(layouts: dict) -> None:
    """Per raw layout: quiet and loaded median / mean / p99 (us), mean under load / quiet median, and the disk's
    ms per write and per flush (machine-wide: other processes' I/O is in it too)."""
    print(f"raw 84-byte record, under the chunked writer in its own process {'median':>9} {'mean':>9} {'p99':>9}  (us)"
          f"   disk ms/write  ms/flush")
    for layout, m in layouts.items():
        for phase in ("quiet", "loaded"):
            s, disk = m[phase], m["disk"][phase]
            print(f"  {layout:<36} {phase:<7} {s['median_us']:18.0f} {s['mean_us']:9.0f} {s['p99_us']:9.0f}"
                  f"   {disk['write_ms']:13.2f} {disk['flush_ms']:9.2f}")
        print(f"  {layout:<36} mean under load / quiet median = {m['loaded']['mean_us'] / m['quiet']['median_us']:.1f}x")


if __name__ == "__main__":
    main()
