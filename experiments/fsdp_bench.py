"""Benchmark: sharded (FSDP2) first-order checkpoints, save and restore at 1 and 2 ranks, no Ray.

For each world size W of ``--workers`` (gloo process groups of ``torch.multiprocessing``): W ranks
shard the model (``FOTrainer(sharded=True)``), take one AdamW step (non-zero moments), and save the
state through ``storage.dcp_store.ShardedStore`` into ``--out/saved-W`` (synchronously: the
seconds from the first rank's start to the commit). Then, for each W' of ``--workers``, W' ranks
restore every saved checkpoint (file verification + DCP's resharded read), and the restored state is
compared bitwise with the saved one (``state_sha256`` re-gathered). Figures: bytes each rank wrote,
save seconds, restore seconds; ``fsdp_bench.json`` under ``--out``.

    python -m raycheck.experiments.fsdp_bench --model smollm2-135m --workers 1 2 --out /tmp/fsdp-bench
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raycheck.experiments.s3_server import free_port
from raycheck.storage.dcp_store import ShardedStore
from raycheck.training.data import PromptEncoder, batch_indices, load_rotten_tomatoes
from raycheck.training.fo import FOHyper, FOTrainer
from raycheck.training.model import load_model, load_tokenizer
from raycheck.training.sharded import checkpoint_group, full_state
from raycheck.training.state import state_sha256

BATCH = 4


T = TypeVar("T")


def _timed(fn: Callable[[], T], group) -> tuple[T, float]:
    """``fn()`` between two barriers: its result and the seconds the slowest rank took."""
    dist.barrier(group)
    t0 = time.perf_counter()
    result = fn()
    dist.barrier(group)
    return result, time.perf_counter() - t0


def _rank(rank: int, world: int, port: int, model: str, out: str, mode: str, sources: list[str], result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = checkpoint_group()
    trainer = FOTrainer(load_model(model), FOHyper(lr=1e-5), PromptEncoder(load_tokenizer(), seq_len=32), sharded=True)
    figures = {}
    if mode == "save":
        split = load_rotten_tomatoes()[0]
        trainer.train_step(split, batch_indices(0, 0, BATCH, len(split))[rank::world])
        saved, seconds = _timed(lambda: ShardedStore(out).save(1, trainer.state_view(), group=group), group)
        figures = {"save_seconds": seconds, "rank_bytes": [int(b) for b in _gather(saved.rank_bytes, group)],
                   "state_sha256": state_sha256(full_state(trainer.state_view()))}
    for source in sources:
        (info, _), seconds = _timed(lambda: ShardedStore(source).restore(trainer.state_view(), group), group)
        figures[source] = {"restore_seconds": seconds, "saved_world_size": info.manifest["world_size"],
                           "state_sha256": state_sha256(full_state(trainer.state_view()))}
    if rank == 0:
        pathlib.Path(result).write_text(json.dumps(figures))
    dist.destroy_process_group()


def _gather(value: int, group) -> list[int]:
    values = [0] * dist.get_world_size(group)  # all_gather_object fills each
    dist.all_gather_object(values, value, group=group)
    return values


def _spawn(world: int, model: str, out: pathlib.Path, mode: str, sources: list[str]) -> dict:
    result = out / f"{mode}-{world}.json"
    mp.spawn(_rank, args=(world, free_port(), model, str(out / f"saved-{world}"), mode, sources, str(result)), nprocs=world)
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/fsdp-bench"))
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    saved = {w: _spawn(w, args.model, args.out, "save", []) for w in args.workers}
    sources = [str(args.out / f"saved-{w}") for w in args.workers]
    loads = {w: _spawn(w, args.model, args.out, "load", sources) for w in args.workers}
    rows = []
    for w, s in saved.items():
        rows.append({"workers": w, "rank_bytes": s["rank_bytes"], "save_seconds": round(s["save_seconds"], 2),
                     "restore_seconds_at": {w2: round(loads[w2][str(args.out / f"saved-{w}")]["restore_seconds"], 2) for w2 in loads},
                     "restored_bitwise_at": {w2: loads[w2][str(args.out / f"saved-{w}")]["state_sha256"] == s["state_sha256"]
                                             for w2 in loads}})
        print(json.dumps(rows[-1]))
    (args.out / "fsdp_bench.json").write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
