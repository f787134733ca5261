"""Benchmark: persisting a snapshot through raycheck's storage against a raw fsspec write of the same bytes.

For each target (local disk under ``--dir``, and a real S3 server: moto on 127.0.0.1, started here),
in one run: (a) raw: the model's serialised shards written with fsspec ``pipe_file`` as plain objects,
one after another (local raw writes are followed by an fsync, so both sides are durable); (b) ours:
``SnapshotStore.write`` (per-unit safetensors serialisation, sha256 of every shard, atomic puts, the
manifest and the index). Prints MB/s for both and the ratio ours / raw (the target is >= 0.8).

    python -m raycheck.experiments.persist_throughput [--model smollm2-135m] [--repeats 2] [--dir /tmp]

``--diff-batch``: instead, one differential batch of SmolLM2-135M (2 exact records: 2 x 538 MB of random
float32 arrays in the model's shapes) written to local storage by the encode-then-hash-then-put path that
``DiffStore.write_batch`` used before (``safetensors.numpy.save``, sha256 of the bytes, the chunked
synced atomic write) and by the streaming one it uses now (``tensor_files.put``: no encoded copy, hashed
as written), interleaved; prints seconds and the peak resident memory above the arrays (the kernel's
high-water mark) for both, and the ratios new / old.

    python -m raycheck.experiments.persist_throughput --diff-batch [--repeats 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import logging
import os
import hashlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable

import fsspec
import numpy as np
from safetensors.numpy import save as st_save

from raycheck.storage import tensor_files
from raycheck.storage.backend import LOCAL_WRITE_CHUNK_BYTES, Storage
from raycheck.storage.files import atomic_write
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.units import group_by_unit
from raycheck.training.model import load_model, trainable_parameters
from raycheck.training.state import copy_state


def raw_write(fs: fsspec.AbstractFileSystem, root: str, blobs: list[bytes], local: bool) -> None:
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


SMOLLM2_SHAPES = {"embed_tokens": (49152, 576), "norm": (576,)} | {
    f"layers.{i}.{name}": shape for i in range(30) for name, shape in {
        "q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576), "gate_proj": (1536, 576),
        "up_proj": (1536, 576), "down_proj": (576, 1536), "input_layernorm": (576,), "post_attention_layernorm": (576,)}.items()}
"""SmolLM2-135M's parameter shapes (134.5 M float32: a 538 MB exact gradient record)."""


class PeakRss:
    """Peak resident set size (bytes) of this process above its size at ``__enter__``: the kernel's
    high-water mark (``VmHWM``), reset at ``__enter__`` (``/proc/self/clear_refs``), so that no peak is
    missed, even one inside a call that holds the GIL."""

    def __enter__(self) -> PeakRss:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = self._status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.extra = self._status("VmHWM") - self.base
        """Bytes of the peak above the size at ``__enter__``, once exited."""

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def diff_batch(steps: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """The tensors of one exact diff batch of ``steps`` SmolLM2-sized records (``DiffStore`` naming), random."""
    rng = np.random.default_rng(seed)
    return {f"{step:010d}:model.{name}": rng.standard_normal(shape, dtype=np.float32)
            for step in range(steps) for name, shape in SMOLLM2_SHAPES.items()}


def old_put(storage: Storage, rel: str, tensors: dict, metadata: dict) -> dict[str, float]:
    """The path before streaming: encode the whole object, hash it, then the chunked synced atomic write."""
    t0 = time.perf_counter()
    blob = st_save(tensors, metadata=metadata)
    t1 = time.perf_counter()
    hashlib.sha256(blob).hexdigest()
    t2 = time.perf_counter()
    os.makedirs(os.path.dirname(storage.path(rel)), exist_ok=True)
    atomic_write(storage.path(rel), blob, LOCAL_WRITE_CHUNK_BYTES)
    return {"encode_s": t1 - t0, "hash_s": t2 - t1, "write_s": time.perf_counter() - t2}


def new_put(storage: Storage, rel: str, tensors: dict, metadata: dict) -> dict[str, float]:
    """The streaming path (``tensor_files.put``): layout, then hash and write piece by piece."""
    tensor_files.put(storage, rel, tensors, metadata)
    return {}


def measure_diff_batch(directory: str | None, repeats: int) -> dict:
    tensors = diff_batch()
    metadata = {"format": "raycheck-diff-1", "first_step": "0", "last_step": "1", "encoding": "exact", "topk_ratio": "0.0"}
    total = sum(a.nbytes for a in tensors.values())
    print(f"diff batch: {total / 1e9:.2f} GB in {len(tensors)} float32 tensors, local storage, median of {repeats}; "
          f"load average {os.getloadavg()[0]:.1f}")
    paths: dict[str, Callable[..., dict[str, float]]] = {"old": old_put, "new": new_put}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        storage = Storage(os.path.join(tmp, "store"))
        for r in range(repeats):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):  # alternate who goes first
                rel = f"diffs/{name}-{r}.safetensors"
                with PeakRss() as rss:
                    t0 = time.perf_counter()
                    split = paths[name](storage, rel, tensors, metadata) | {"total_s": time.perf_counter() - t0}
                runs[name].append(split | {"extra_rss_gb": rss.extra / 1e9})
                storage.delete(rel)
    med = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
    for name, m in med.items():
        parts = "  ".join(f"{k} {v:6.2f}" for k, v in m.items())
        print(f"  {name}: {parts}")
    ratios = {k: med["new"][k] / med["old"][k] for k in ("total_s", "extra_rss_gb") if med["old"][k] > 0}
    print(f"  new / old: seconds {ratios.get('total_s', float('nan')):.2f}, peak extra memory "
          f"{ratios.get('extra_rss_gb', float('nan')):.3f}; load average {os.getloadavg()[0]:.1f}")
    return {"bytes": total, "median": med, "ratios": ratios}


def main(argv: list[str] | None = None) -> list[dict]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the in-process S3 server logs every request
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="Folder for the local target (default: a temp folder).")
    ap.add_argument("--no-s3", action="store_true", help="Skip the S3 target.")
    ap.add_argument("--diff-batch", action="store_true", help="Measure one SmolLM2 diff batch, old path vs streaming.")
    args = ap.parse_args(argv)
    if args.diff_batch:
        return [measure_diff_batch(args.dir, args.repeats)]
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
