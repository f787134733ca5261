"""Benchmark: persisting a snapshot through raycheck's storage against a raw fsspec write of the same bytes.

For each target (local disk under ``--dir``, and a real S3 server: moto on 127.0.0.1, started here),
in one run: (a) raw: the model's serialised shards written with fsspec ``pipe_file`` as plain objects,
one after another (local raw writes are followed by an fsync, so both sides are durable); (b) ours:
``SnapshotStore.write`` (per-unit safetensors serialisation, sha256 of every shard, atomic puts, the
manifest and the index). Prints MB/s for both and the ratio ours / raw (the target is >= 0.8).

    python -m raycheck.experiments.persist_throughput [--model smollm2-135m] [--repeats 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import uuid

import fsspec
from safetensors.numpy import save as st_save

from raycheck.storage.backend import Storage
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.units import group_by_unit
from raycheck.training.model import load_model, trainable_parameters
from raycheck.training.state import copy_state


def raw_write(fs, root: str, blobs: list[bytes], local: bool) -> None:
    if local:
        fs.makedirs(root, exist_ok=True)
    for i, blob in enumerate(blobs):
        path = f"{root}/raw-{i:04d}.bin"
        fs.pipe_file(path, blob)
        if local:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def measure(name: str, storage: Storage, state: dict, repeats: int) -> dict:
    blobs = [st_save({n: state[n] for n in names}) for names in group_by_unit(list(state)).values()]
    total = sum(len(b) for b in blobs)
    raw_s, ours_s = [], []
    store = SnapshotStore(storage, keep_last=1)
    for r in range(repeats):  # interleaved, so drift in the machine's load hits both sides alike
        root = storage.path(f"raw-{uuid.uuid4().hex[:6]}")
        t0 = time.perf_counter()
        raw_write(storage.fs, root, blobs, storage.protocol == "file")
        raw_s.append(time.perf_counter() - t0)
        storage.fs.rm(root, recursive=True)
        t0 = time.perf_counter()
        store.write(r + 1, state)
        ours_s.append(time.perf_counter() - t0)
    raw, ours = total / statistics.median(raw_s) / 1e6, total / statistics.median(ours_s) / 1e6
    print(f"  {name:<6} {total / 1e6:8.1f} MB  raw fsspec {raw:8.1f} MB/s   raycheck snapshot {ours:8.1f} MB/s   "
          f"ratio {ours / raw:5.2f}")
    return {"target": name, "bytes": total, "raw_mb_s": raw, "ours_mb_s": ours, "ratio": ours / raw}


def main(argv: list[str] | None = None) -> list[dict]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the in-process S3 server logs every request
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="Folder for the local target (default: a temp folder).")
    ap.add_argument("--no-s3", action="store_true", help="Skip the S3 target.")
    args = ap.parse_args(argv)
    state = copy_state(trainable_parameters(load_model(args.model)))
    print(f"model {args.model}: {sum(a.nbytes for a in state.values()) / 1e6:.0f} MB in {len(state)} tensors, "
          f"median of {args.repeats}")
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results.append(measure("local", Storage(os.path.join(tmp, "store")), state, args.repeats))
    if not args.no_s3:
        from moto.server import ThreadedMotoServer

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
            fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True).mkdir("bench")
            results.append(measure("s3", Storage("s3://bench/run", endpoint_url=endpoint), state, args.repeats))
        finally:
            server.stop()
    return results


if __name__ == "__main__":
    main()
