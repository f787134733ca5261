"""The fused Triton kernels on a GPU: their bits against the CPU, and the ZO hot path's time against the
forward passes (``scripts/device-check`` (c); needs CUDA and triton).

(i) Bits: z of one SmolLM2-sized tensor (49152 x 576, the embedding) from ``noise_triton.gaussian``
against the CPU kernel (``noise.gaussian``), and the replay pass (``noise_triton.apply_`` with +eps,
-2 eps, +eps, update with weight decay) on that tensor against ``zo``'s ops on the CPU, in float32,
bfloat16 and float16; and the same pass on start values below float32's smallest normal number
(flush-to-zero would show). sha256 of the bytes each.

(ii) Time per ZO step, per shape set (SmolLM2-135M and a Llama-3.2-1B-like architecture, the
``LlamaForCausalLM`` of each config on the GPU with random weights) and dtype (bfloat16, float32):
the worker's three fused passes over every trainable parameter ([+eps], [-2 eps], [+eps, update]: z
generated and applied, never stored) against the step's two forward passes (batch 8, sequence 64,
``torch.no_grad``).

(iii) Replay rate: steps per second of one fused pass per tensor (+eps, -2 eps, +eps, update), the
shadow's or a recovery's replay of the log tail on the GPU.

Times are medians of ``REPS`` after one warm-up (which compiles the kernels), with
``torch.cuda.synchronize`` around each. Prints a table; exits 1 on a bit mismatch.

    python -m raycheck.experiments.gpu_hotpath
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from raycheck.experiments.hotpath_bench import SMOLLM2_135M, SMOLLM2_135M_ELEMENTS
from raycheck.training import noise, noise_triton, zo
from raycheck.training.model import trainable_parameters
from raycheck.training.noise import Perturb, Update

LLAMA_1B_LIKE: dict[str, Any] = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
"""Llama-3.2-1B's architecture (1.24 B parameters, the embedding tied)."""
SHAPE_SETS = {"smollm2-135m": SMOLLM2_135M, "llama-1b-like": LLAMA_1B_LIKE}
BATCH, SEQ, REPS = 8, 64, 3
EPS, G, LR, WD = 1e-3, -0.37, 1e-6, 0.01


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def replay_pass(wd: float) -> list[noise.Op]:
    return [Perturb(EPS), Perturb(-2 * EPS), Perturb(EPS), Update(G, LR, wd)]


def check_bits(device: str = "cuda", numel: int = 49152 * 576) -> list[str]:
    """(i) on ``device`` (the CPU: under Triton's interpreter): the mismatches, each named (none: every
    hash matched)."""
    seed, index = zo.step_seed(0, 7), 3
    bad = []
    cpu, gpu = sha(noise.gaussian(seed, index, numel)), sha(noise_triton.gaussian(seed, index, numel, device))
    print(f"  z {numel} elements: cpu {cpu[:16]} cuda {gpu[:16]}")
    bad += [] if cpu == gpu else ["z"]
    for name, n, scale, eps in [("", numel, 0.02, EPS), (" subnormal", 4099, 1e-39, 1e-39)]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if name and dtype == torch.float16:
                continue  # float16 has no float32-subnormal values
            ops: list[noise.Op] = [Perturb(eps), Perturb(-2 * eps), Perturb(eps), Update(G, LR, WD)]
            p = (noise.gaussian(99, 0, n) * scale).to(dtype)
            q = p.to(device, copy=True)
            zo.apply_reference_(p, seed, index, ops)
            noise_triton.apply_(q, seed, index, ops)
            cpu, gpu = sha(p), sha(q)
            print(f"  replay pass{name} {str(dtype).removeprefix('torch.')} {n}: cpu {cpu[:16]} cuda {gpu[:16]}")
            bad += [] if cpu == gpu else [f"replay pass{name} {dtype}"]
    return bad


def median_s(fn: Callable[[], None], device: str) -> float:
    """Median seconds of ``fn`` over ``REPS`` runs after one warm-up, synchronised on a CUDA ``device``."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    fn()
    times = []
    for _ in range(REPS):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_shape_set(config: dict[str, Any], dtype: torch.dtype, device: str = "cuda") -> dict[str, float]:
    """(ii) and (iii) for one architecture and dtype on ``device``: seconds of the step's noise work, of its
    two forward passes, and of one replayed step; and the number of elements."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device(device):
        model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**config))
    model = model.to(dtype).eval()
    params = trainable_parameters(model)
    seed = zo.step_seed(0, 0)
    batch = torch.randint(0, config["vocab_size"], (BATCH, SEQ), device=device)

    def passes(ops_of: Callable[[str, torch.Tensor], list[noise.Op]]) -> None:
        for i, (name, p) in enumerate(params.items()):
            noise_triton.apply_(p, seed, i, ops_of(name, p))

    def wd(name: str, p: torch.Tensor) -> float:
        return WD if zo.decays(name, p) else 0.0

    def step_noise() -> None:
        passes(lambda name, p: [Perturb(EPS)])
        passes(lambda name, p: [Perturb(-2 * EPS)])
        passes(lambda name, p: [Perturb(EPS), Update(G, LR, wd(name, p))])

    def forwards() -> None:
        with torch.no_grad():
            model(input_ids=batch)
            model(input_ids=batch)

    return {"elements": float(sum(p.numel() for p in params.values())), "noise_s": median_s(step_noise, device),
            "forward_s": median_s(forwards, device),
            "replay_s": median_s(lambda: passes(lambda n, p: replay_pass(wd(n, p))), device)}


def main() -> int:
    if not (torch.cuda.is_available() and noise_triton.available()):
        print("gpu_hotpath: needs a CUDA device and triton", file=sys.stderr)
        return 2
    print(f"  {torch.cuda.get_device_name()}, triton kernels (noise_triton), torch {torch.__version__}")
    bad = check_bits()
    print(f"  {'shapes':14} {'dtype':9} {'elements':>9} {'z+perturb/step':>15} {'2 forwards':>11} {'ratio':>6} "
          f"{'replay steps/s':>15} {'replay elem/s':>14}")
    for set_name, config in SHAPE_SETS.items():
        for dtype in (torch.bfloat16, torch.float32):
            r = time_shape_set(config, dtype)
            if set_name == "smollm2-135m":
                assert r["elements"] == SMOLLM2_135M_ELEMENTS, "architecture does not match SmolLM2-135M"
            print(f"  {set_name:14} {str(dtype).removeprefix('torch.'):9} {r['elements'] / 1e6:8.1f}M "
                  f"{r['noise_s'] * 1e3:12.2f} ms {r['forward_s'] * 1e3:8.2f} ms {r['noise_s'] / r['forward_s']:6.2f} "
                  f"{1 / r['replay_s']:15.1f} {r['elements'] / r['replay_s'] / 1e9:10.2f} G/s")
    if bad:
        print(f"gpu_hotpath: MISMATCH between the Triton kernels and the CPU: {', '.join(bad)}", file=sys.stderr)
        return 1
    print("ok: the Triton kernels give the CPU's bits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
