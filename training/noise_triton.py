"""``training.noise``'s generator as fused Triton kernels for CUDA: one launch per tensor and pass, z made in
registers and never written to memory (MeZO's memory: no step holds z), the same bits as the CPU kernel
and ``noise.gaussian_torch``.

``gaussian(seed, index, numel, device)`` writes z itself (float32), ``apply_(p, seed, index, ops)``
runs ``noise.Perturb`` / ``noise.Update`` ops on each element of a parameter in one pass over its memory
(one read and one write of p per pass, against ``zo``'s torch ops: a generation of 384 launches, then
two to five more per op). Per element e of the flattened p, in p's dtype D (float32, bfloat16 or
float16), exactly ``z = zo.noise(seed, index, p)`` followed by ``zo.perturb_(p, z, scale)`` /
``zo.update_(p, z, g, lr, wd)`` for each op in order (``training.zo``'s module docstring):

    z = D(z32(seed, index, e)) widened to float32       z32: the generator's float32 value
    x = float32(p[e])                                   exact
    Perturb(scale):        t = z * scale; x = x + t
    Update(g, lr, wd):     u = z * g; [v = x * wd; u = u + v  only if wd != 0]; t = u * lr; x = x - t
                           each op one float32 rounding, scalars rounded once to float32 on the host
    after every op (half D): x = D(x) widened, D(x) rounding to nearest-even (subnormals kept)
    p[e] = D(x)

The kernels (``training.triton_kernels``) are launched with ``enable_fp_fusion=False``: no multiply-add
becomes an FMA. Under ``TRITON_INTERPRET=1`` (set before this module's first kernel use) they also run
on CPU tensors, with numpy arithmetic: how the tests check their bits without a GPU
(``tests/test_noise_triton.py``; on a GPU, ``scripts/device-check`` (c)). NaN: a bfloat16 NaN result is
stored as 0x7FC0 (c10's scalar rounding); NaN payloads are not part of the contract.

triton is imported on first use; ``available()`` says whether it can be.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import numpy as np
import torch

from raycheck.training import noise

BLOCK = 256
"""Philox blocks (4 elements each) per kernel program by default; the bits do not depend on it."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def available() -> bool:
    """Whether triton can be imported, so that ``gaussian`` and ``apply_`` can run."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels() -> ModuleType:
    from raycheck.training import triton_kernels

    return triton_kernels


def _launch(kernel: str, numel: int, block: int, device: torch.device, *args: object) -> None:
    k = _kernels()
    if device.type == "cpu" and not k.INTERPRETED:
        raise ValueError("the Triton kernels run on CPU tensors only under Triton's interpreter "
                         "(TRITON_INTERPRET=1 before the first kernel use); use training.noise on the CPU")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    grid = (-(-numel // (4 * block)),)  # programs of 4 block elements
    if grid[0]:
        getattr(k, kernel)[grid](*args, BLOCK=block, enable_fp_fusion=False)


def _f32(x: float) -> float:
    """``x`` rounded once to float32 (nearest-even, as torch rounds a Python scalar for a float32 op)."""
    return float(np.float32(x))


def gaussian(seed: int, index: int, numel: int, device: torch.device | str = "cuda", *,
             block: int = BLOCK) -> torch.Tensor:
    """z for parameter ``index`` at step seed ``seed``: ``numel`` N(0, 1) values, float32, 1-D, on ``device``;
    bitwise ``noise.gaussian_torch(seed, index, numel, device)``, in one kernel launch.

    ``block``: Philox blocks per kernel program (a power of two; any gives the same bits).

    Raises:
        ValueError: seed outside [0, 2^64), index outside [0, 2^32), numel < 0, a CPU ``device`` outside
            the interpreter, or a ``block`` that is not a power of two.
    """
    noise._check(seed, index, numel)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    _launch("_gaussian_kernel", numel, block, out.device, out, numel, seed, index)
    return out


def apply_(p: torch.Tensor, seed: int, index: int, ops: Sequence[noise.Op], *, block: int = BLOCK) -> None:
    """Run ``ops`` in order on every element of ``p`` (in place) with z of (``seed``, ``index``), in one
    kernel launch: bitwise ``zo.noise`` then ``zo.perturb_`` / ``zo.update_`` per op (the module docstring).

    ``p``: contiguous, float32, bfloat16 or float16, any shape (taken flattened), on a CUDA device (or the
    CPU under the interpreter). ``block`` as in ``gaussian``.

    Raises:
        ValueError: a non-contiguous ``p``, another dtype, an op that is not ``Perturb`` / ``Update``, an
            empty ``ops``, or the arguments ``gaussian`` refuses.
    """
    noise._check(seed, index, p.numel())
    if p.dtype not in _DTYPES:
        raise ValueError(f"p must be float32, bfloat16 or float16, got {p.dtype}")
    if not p.is_contiguous():
        raise ValueError("p must be contiguous")
    if not ops:
        raise ValueError("ops is empty")
    k = _kernels()
    kinds, scalars = [], []
    for op in ops:
        if isinstance(op, noise.Perturb):
            kinds.append(k.PERTURB)
            scalars += [op.scale, 0.0, 0.0]
        elif isinstance(op, noise.Update):
            kinds.append(k.UPDATE_DECAY if op.weight_decay != 0 else k.UPDATE)
            scalars += [op.projected_grad, op.lr, op.weight_decay]
        else:
            raise ValueError(f"not a Perturb or Update op: {op!r}")
    code = {torch.float32: k.FLOAT32, torch.bfloat16: k.BFLOAT16, torch.float16: k.FLOAT16}[p.dtype]
    target = p.view(torch.int16) if p.dtype == torch.bfloat16 else p
    _launch("_apply_kernel", p.numel(), block, p.device, target, p.numel(), seed, index,
            tuple(_f32(s) for s in scalars), tuple(kinds), code)
