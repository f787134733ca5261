"""Benchmark: a checkpoint's staging copy into fresh arrays (``training.state.copy_state``, what every
staging did before) against a copy into reused arrays (``training.state.copy_into``, the staging
buffers of the checkpointers), on a model's first-order training state (weights + Adam moments).

The two are interleaved in one process, round after round, so the machine's load hits both alike; the
first ``copy_into`` allocates its arrays (it is a fresh copy too) and is reported on its own. Each
fresh copy is dropped before the next round, so its memory goes back to the allocator (and large
arrays to the OS, which is where the page faults of the next fresh copy come from).

    python -m raycheck.experiments.staging_bench --model smollm2-135m --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from raycheck.training.data import PromptEncoder
from raycheck.training.fo import FOHyper, FOTrainer
from raycheck.training.model import load_model, load_tokenizer
from raycheck.training.state import copy_into, copy_state


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"))
    p.add_argument("--rounds", type=int, default=5, help="fresh / reused copy pairs (>= 1)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    torch.set_num_threads(1)
    state = FOTrainer(load_model(args.model), FOHyper(lr=1e-5), PromptEncoder(load_tokenizer(), 32)).state_view()
    buffers: dict = {}
    first_reused_s = timed(lambda: copy_into(buffers, state))
    fresh_s, reused_s = [], []
    for _ in range(args.rounds):
        fresh_s.append(timed(lambda: copy_state(state)))
        reused_s.append(timed(lambda: copy_into(buffers, state)))
    result = {"model": args.model, "state_bytes": sum(b.nbytes for b in buffers.values()), "rounds": args.rounds,
              "first_copy_into_s": first_reused_s, "fresh_copy_s": fresh_s, "reused_copy_s": reused_s,
              "fresh_median_s": statistics.median(fresh_s), "reused_median_s": statistics.median(reused_s)}
    print(f"{args.model}: {result['state_bytes'] / 1e6:,.0f} MB state; staging copy, median of {args.rounds}: "
          f"fresh arrays {result['fresh_median_s']:.3f} s, reused arrays {result['reused_median_s']:.3f} s "
          f"({result['reused_median_s'] / result['fresh_median_s']:.2f}x); first copy into new buffers {first_reused_s:.3f} s")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
