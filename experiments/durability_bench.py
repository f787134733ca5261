"""Benchmark: the per-step blocked time of each step-log durability level beside the full-async staging copy.

Measures in one run, with the components a training run uses (``training.rank0_log.replicated_append``:
rank 0's local append, then the send to a ``LogKeeperActor`` on a local Ray cluster):

- ``process``: the 76-byte record written and fsynced in rank 0's local log (the send is queued);
- ``node``: also the Ray round trip to the log keeper, which appends and fsyncs it in its own file
  (on this machine the keeper is another process; on a cluster it is another node, plus the network);
- ``cluster``: also the keeper's upload of the log's open tail as a segment to an S3 server (moto on
  127.0.0.1; group commit, one upload per batch of waiting appends);
- the full-async staging copy: the copy of the model's trainable state to CPU memory
  (``training.state.copy_state``) that an async full checkpoint must make before training continues,
  for the tiny model and SmolLM2-135M (538 MB);
- with ``--snapshot-load``: ``process`` again while snapshots of SmolLM2's size are written to the same
  disk (``SnapshotStore.write``, as the persister does), against the quiet median.

Prints a table of median, mean and p99 (microseconds) and the ratios staging copy / level.

    python -m experiments.durability_bench [--records 300] [--copies 5] [--snapshot-load] [--dir DIR]
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import statistics
import tempfile
import threading
import time
import uuid

import ray

from actors.log_keeper import LogKeeperActor, RemoteKeeper
from experiments.log_cost import percentile
from experiments.s3_server import LocalS3Server
from orchestrator.cluster import runtime_env
from storage.backend import Storage
from storage.snapshots import SnapshotStore
from storage.steplog import StepRecord
from training.model import load_model, trainable_parameters
from training.rank0_log import KeeperSender, open_local_log, replicated_append
from training.state import copy_state
from training.worker import on_cpu

LEVELS = ("process", "node", "cluster")
WARMUP_RECORDS = 20
"""Records appended before the measured ones (actor lookup, first connections)."""
HEADER = {"run_id": "durability-bench", "trajectory_sha256": "0" * 64, "layout_sha256": "0" * 64, "generator": "bench"}


def record(step: int) -> StepRecord:
    return StepRecord(step=step, seed=step, projected_grad=0.1, loss_plus=0.7, loss_minus=0.6, lr=1e-6, eps=1e-3,
                      weight_decay=0.0, batch_id=step)


def blocked_per_step_s(level: str, folder: pathlib.Path, records: int, s3: LocalS3Server,
                       during: threading.Event | None = None) -> list[float]:
    """Seconds each of ``records`` step records blocked rank 0 at durability ``level`` (after
    ``WARMUP_RECORDS`` unmeasured ones): a fresh keeper actor and local log in ``folder``. With
    ``during``, the measured records start once it is set."""
    folder.mkdir(parents=True)
    storage = Storage(s3.uri(f"{folder.name}/"), endpoint_url=s3.endpoint) if level == "cluster" else None
    name = f"durability-bench-{uuid.uuid4().hex[:8]}"
    actor = ray.remote(LogKeeperActor).options(name=name, num_cpus=0, max_concurrency=8, runtime_env=runtime_env()).remote(
        str(folder / "keeper.bin"), header=HEADER, mirror_to=storage, commit_to_storage=storage is not None)
    keeper = RemoteKeeper(name)
    opened = open_local_log(folder / "local.bin", keeper)
    sender = KeeperSender(keeper, 0, wait=level != "process")
    commit = replicated_append(opened.writer, sender)
    try:
        for step in range(WARMUP_RECORDS):
            commit(record(step))
        if during is not None:
            during.wait()
        blocked = [commit(record(step)) for step in range(WARMUP_RECORDS, WARMUP_RECORDS + records)]
        sender.close()
    finally:
        opened.writer.close()
        ray.kill(actor)
    return blocked


def staging_copy_s(model: str, copies: int) -> tuple[int, list[float], dict]:
    """(state bytes, seconds of each of ``copies`` staging copies, the last copy) of ``model``'s trainable state."""
    params = trainable_parameters(load_model(model))
    seconds, staged = [], {}
    for _ in range(copies):
        t0 = time.perf_counter()
        staged = copy_state(on_cpu(params))
        seconds.append(time.perf_counter() - t0)
    return sum(a.nbytes for a in staged.values()), seconds, staged


def under_snapshot_load(folder: pathlib.Path, records: int, s3: LocalS3Server, state: dict) -> tuple[list[float], int]:
    """``process`` blocked times while ``state`` is written as snapshots to ``folder`` (the same disk) over
    and over; returns them and the snapshots written meanwhile."""
    writing, done = threading.Event(), threading.Event()
    written = []

    def write_snapshots() -> None:
        store = SnapshotStore(Storage(str(folder / "snapshots")), keep_last=1)
        step = 0
        while not done.is_set():
            writing.set()
            store.write(step, state)
            written.append(step)
            step += 1

    writer = threading.Thread(target=write_snapshots, name="bench-snapshots", daemon=True)
    writer.start()
    try:
        blocked = blocked_per_step_s("process", folder / "log", records, s3, during=writing)
    finally:
        done.set()
        writer.join()
    return blocked, len(written)


def summarize(seconds: list[float]) -> dict:
    return {"median_us": statistics.median(seconds) * 1e6, "mean_us": statistics.fmean(seconds) * 1e6,
            "p99_us": percentile(seconds, 0.99) * 1e6, "n": len(seconds)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=300, help="Measured step records per level.")
    ap.add_argument("--copies", type=int, default=5, help="Staging copies per model.")
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"])
    ap.add_argument("--snapshot-load", action="store_true", help="Also measure process under SmolLM2-sized snapshot writes.")
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
        try:
            for level in LEVELS:
                result["levels"][level] = summarize(blocked_per_step_s(level, pathlib.Path(tmp) / level, args.records, s3))
            if args.snapshot_load:
                big = max(staged_states.values(), key=lambda s: sum(a.nbytes for a in s.values()))
                blocked, snapshots = under_snapshot_load(pathlib.Path(tmp) / "loaded", args.records, s3, big)
                result["process_under_snapshot_load"] = {**summarize(blocked), "snapshots_written": snapshots}
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
    if "process_under_snapshot_load" in result:
        load = result["process_under_snapshot_load"]
        rows.append(("process", f"under snapshot load ({load['snapshots_written']} snapshots written meanwhile)", load))
    for level, text, s in rows:
        print(f"{level:<9} {text:<58} {s['median_us']:9.0f} {s['mean_us']:9.0f} {s['p99_us']:9.0f}")
    for model, s in result["staging"].items():
        print(f"full-async staging copy, {model} ({s['state_bytes'] / 1e6:.1f} MB): median {s['median_us'] / 1e3:.2f} ms, "
              f"mean {s['mean_us'] / 1e3:.2f} ms")
        ratios = ", ".join(f"{level} {ratio(s['median_us'], result['levels'][level]['median_us'])} "
                           f"(mean {ratio(s['mean_us'], result['levels'][level]['mean_us'])})" for level in LEVELS)
        print(f"  staging copy / level median: {ratios}")
    if "process_under_snapshot_load" in result:
        load, quiet = result["process_under_snapshot_load"], result["levels"]["process"]
        print(f"process under snapshot load: mean / quiet median = {load['mean_us'] / quiet['median_us']:.1f}x (target <= 2x)")


if __name__ == "__main__":
    main()
