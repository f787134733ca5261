"""A portable generator for MeZO's perturbations z: the same bits on any CPU, thread count and CUDA.

Integer stage: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2,
3", SC'11; the Random123 library), a counter-based generator: block ``b`` of a stream is the pure
function ``philox(counter, key)`` with

    key     = (s & 0xffffffff, s >> 32)                 s: the step seed s_t (63 bits, ``zo.step_seed``,
                                                           itself derived from (run seed, step))
    counter = (b & 0xffffffff, b >> 32, index, 0)       index: the parameter's position in the canonical
                                                           order; b = element // 4

and element ``i`` of parameter ``index`` takes 32-bit word ``i % 4`` of block ``i // 4``. Only integer
multiplications, xors and additions modulo 2^32 are involved, so every device gives the same words.

Float stage (Box-Muller, two words -> two N(0, 1) values, computed in float64, then rounded once to
float32). Only exact operations (integer to float conversion of < 2^53, ``frexp``, scaling by powers of
two, sign flips, swaps) and correctly rounded IEEE-754 operations (+, -, *, /, sqrt in binary64) are
used; ``log``, ``sin`` and ``cos`` are NOT taken from a libm (libms round them differently) but
evaluated as fixed polynomials, one rounded operation after another:

1. radius from word a:  x = (a + 1) * 2^-32 in (0, 1]                       exact
   (m, e) = frexp(x); if m < sqrt(1/2): m = 2m, e = e - 1                    exact
            (frexp: a bit cast in the kernel, ``torch.frexp`` in the torch form)
   s = (m - 1) / (m + 1)          (m - 1 exact by Sterbenz; + and / rounded)  |s| <= 0.1716
   ln x = e * ln2 + 2s * P(s^2),  P = sum_k s^2k / (2k + 1), k = 0..5         (Horner, each op rounded)
   r = sqrt(-2 ln x)
2. angle from word b:  phi = (b mod 2^30 - 2^29 + 1/2) * (pi / 2^31) in (-pi/4, pi/4), quadrant q = b >> 30
   sin phi = phi * S(phi^2),  cos phi = C(phi^2)   (Taylor to phi^11 and phi^12: error < 1e-11)
   (c, s) rotated by q quarter turns: (c, s), (-s, c), (-c, -s), (s, -c)     exact
   The angle phi + q pi/2 is uniform on the circle, so (r c, r s) are two independent N(0, 1) values.
3. z = float32(r * c), float32(r * s): one rounding each.

Why nothing can be fused: on CPU the float stage runs in a numba kernel compiled with
``fastmath=False``: numba emits LLVM ``fmul``/``fadd`` without the ``contract`` flag, and LLVM's
default FP-op fusion mode fuses only ``llvm.fmuladd`` intrinsics, which numba never emits, so no
multiply-add becomes an FMA (``tests/test_noise.py`` checks the machine code has no FMA instruction).
The same steps written as separate torch tensor ops (``gaussian_torch``, used on CUDA and as the
reference) round every op into a tensor in memory, where no compiler can fuse across kernels; the tests
check both give the same bits.

The kernels are compiled once per machine and cached next to this file (numba ``cache=True``,
``__pycache__/noise.*.nbi``/``.nbc``). numba keys that cache by this file's path, modification time and
size, not by the module's name, and the cached code refers to the module by the name it had when it was
compiled; so a change of the package's name must come with a change of this file (as the move under
``raycheck.*`` did), or the old cache loads a second copy under the old name
(``tests/test_noise.py::test_the_compiled_generator_loads_under_its_package_name_only``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

GENERATOR = "philox4x32-10:box-muller-poly:float64->float32:v1"
"""Names the generator and its version; recorded in the step log header (``zo.GENERATOR``)."""

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_M32 = 0xFFFFFFFF

_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
# Truncated series; terms left out are below 1e-10 of the value on the ranges used (|s| <= 0.1716,
# |phi| <= pi/4), far below float32's rounding (6e-8):
_ATANH = tuple(1.0 / (2 * k + 1) for k in range(6))  # 2 atanh(s) = 2s * sum_k s^2k / (2k + 1)
_SIN = tuple((-1.0) ** k / math.factorial(2 * k + 1) for k in range(6))  # sin x = x * sum_k (-1)^k x^2k / (2k+1)!
_COS = tuple((-1.0) ** k / math.factorial(2 * k) for k in range(7))  # cos x = sum_k (-1)^k x^2k / (2k)!
_PHI_SCALE = math.pi / 2**31


@dataclass(frozen=True)
class Perturb:
    """p <- p + z * scale (``training.zo.perturb_``): scale is +eps, -2 eps or +eps."""

    scale: float


@dataclass(frozen=True)
class Update:
    """p <- p - (z * projected_grad [+ p * weight_decay]) * lr (``training.zo.update_``); weight_decay 0:
    no decay ops at all."""

    projected_grad: float
    lr: float
    weight_decay: float


Op = Perturb | Update
"""One pass of a fused kernel over a parameter (``apply_``): the ops run in order on every element,
with the element's z generated once."""


def split_key(seed: int) -> tuple[int, int]:
    """The two 32-bit Philox key words of a step seed (0 <= seed < 2^64)."""
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be in [0, 2^64), got {seed}")
    return seed & _M32, seed >> 32


# ---------------------------------------------------------------- numba (CPU) -------------------------

@numba.njit(cache=True, fastmath=False, inline="always")
def _philox_block(c0, c1, c2, c3, k0, k1):
    """One Philox4x32-10 block; all values uint64 holding 32-bit words."""
    m32 = numba.uint64(_M32)
    for r in range(PHILOX_ROUNDS):
        if r:
            k0 = (k0 + numba.uint64(PHILOX_W[0])) & m32
            k1 = (k1 + numba.uint64(PHILOX_W[1])) & m32
        p0 = numba.uint64(PHILOX_M[0]) * c0
        p1 = numba.uint64(PHILOX_M[1]) * c2
        c0, c1, c2, c3 = ((p1 >> numba.uint64(32)) ^ c1 ^ k0, p1 & m32, (p0 >> numba.uint64(32)) ^ c3 ^ k1, p0 & m32)
    return c0, c1, c2, c3


@numba.njit(cache=True, fastmath=False)
def _philox_numba(ctr, key, out):
    """out[n, 4] = philox4x32-10(ctr[n, 4], key[2]), uint32 arrays."""
    k0, k1 = numba.uint64(key[0]), numba.uint64(key[1])
    for n in range(ctr.shape[0]):
        out[n, 0], out[n, 1], out[n, 2], out[n, 3] = _philox_block(
            numba.uint64(ctr[n, 0]), numba.uint64(ctr[n, 1]), numba.uint64(ctr[n, 2]), numba.uint64(ctr[n, 3]), k0, k1)


@intrinsic
def _bits_f64(typingctx, x):
    """The IEEE-754 bits of a float64 as uint64 (a bit cast: exact)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.uint64(types.float64), codegen


@intrinsic
def _f64_bits(typingctx, x):
    """The float64 whose IEEE-754 bits are the uint64 ``x`` (a bit cast: exact)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.uint64), codegen


@numba.njit(cache=True, fastmath=False, inline="always")
def _radius(a):
    """sqrt(-2 ln x), x = (a + 1) 2^-32: step 1 of the module docstring."""
    bits = _bits_f64((numba.float64(a) + 1.0) * 2.3283064365386963e-10)  # 2^-32
    e = numba.int64(bits >> numba.uint64(52)) - 1022
    m = _f64_bits((bits & numba.uint64(0x000FFFFFFFFFFFFF)) | numba.uint64(0x3FE0000000000000))  # [0.5, 1)
    low = m < _SQRT_HALF
    m = m * 2.0 if low else m
    e = e - 1 if low else e
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = _ATANH[5]
    for k in range(4, -1, -1):
        p = p * s2 + _ATANH[k]
    ln = numba.float64(e) * _LN2 + (s * 2.0) * p
    return math.sqrt(ln * -2.0)


@numba.njit(cache=True, fastmath=False, inline="always")
def _circle(b):
    """(cos, sin) of a uniform angle from word b: step 2 of the module docstring."""
    phi = (numba.float64(b & numba.uint64(0x3FFFFFFF)) - 536870911.5) * _PHI_SCALE
    x2 = phi * phi
    sp = _SIN[5]
    for k in range(4, -1, -1):
        sp = sp * x2 + _SIN[k]
    cp = _COS[6]
    for k in range(5, -1, -1):
        cp = cp * x2 + _COS[k]
    sp = phi * sp
    q = b >> numba.uint64(30)
    odd = (q & numba.uint64(1)) != 0
    u = sp if odd else cp
    v = cp if odd else sp
    u = -u if ((q ^ (q >> numba.uint64(1))) & numba.uint64(1)) != 0 else u
    v = -v if q >= 2 else v
    return u, v


_CHUNK_BLOCKS = 1024  # blocks per pass: the words and values of one chunk stay in L1/L2


@numba.njit(cache=True, fastmath=False)
def _gaussian_numba(k0, k1, index, out):
    """out[i] = element i of stream (key (k0, k1), ``index``) for i < out.size, float32.

    Chunk by chunk: the Philox words of ``_CHUNK_BLOCKS`` blocks, then their values (word 2h -> radius,
    word 2h + 1 -> angle), then the values in element order (element 4 b + j = value j of block b).
    """
    n = out.size
    key0, key1, stream = numba.uint64(k0), numba.uint64(k1), numba.uint64(index)
    blocks = (n + 3) // 4
    w = np.empty((4, _CHUNK_BLOCKS), np.uint32)
    z = np.empty((4, _CHUNK_BLOCKS), np.float32)
    for start in range(0, blocks, _CHUNK_BLOCKS):
        m = min(_CHUNK_BLOCKS, blocks - start)
        for j in range(m):
            b = numba.uint64(start + j)
            w[0, j], w[1, j], w[2, j], w[3, j] = _philox_block(
                b & numba.uint64(_M32), b >> numba.uint64(32), stream, numba.uint64(0), key0, key1)
        for h in range(2):
            for j in range(m):
                r = _radius(w[2 * h, j])
                c, s = _circle(w[2 * h + 1, j])
                z[2 * h, j] = numba.float32(r * c)
                z[2 * h + 1, j] = numba.float32(r * s)
        base = 4 * start
        for i in range(min(4 * m, n - base)):
            out[base + i] = z[i & 3, i >> 2]


# ---------------------------------------------------------------- torch (any device) -----------------

def _mulhilo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product m * c; c: int64 tensor of 32-bit words.

    The constant is split into 16-bit halves so that no intermediate reaches 2^63 (int64 tensors only).
    """
    p_lo = c * (m & 0xFFFF)  # < 2^48
    p_hi = c * (m >> 16)  # < 2^48
    t = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49
    return (p_hi >> 16) + (t >> 32), t & _M32


def philox_torch(ctr: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """Philox4x32-10 of counters ``ctr`` (int64 tensor [..., 4] of 32-bit words) under ``key`` (two
    32-bit words); returns an int64 tensor [..., 4] of 32-bit words, on ``ctr``'s device."""
    c0, c1, c2, c3 = ctr.unbind(-1)
    k0, k1 = key
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = (k0 + PHILOX_W[0]) & _M32, (k1 + PHILOX_W[1]) & _M32
        hi0, lo0 = _mulhilo(PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack([c0, c1, c2, c3], dim=-1)


def philox(ctr: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox4x32-10 of counters ``ctr`` (uint32 array [n, 4]) under ``key``, compiled (numba)."""
    out = np.empty_like(ctr, dtype=np.uint32)
    _philox_numba(np.ascontiguousarray(ctr, dtype=np.uint32), np.array(key, dtype=np.uint32), out)
    return out


def _horner(x: torch.Tensor, coeffs: tuple[float, ...]) -> torch.Tensor:
    """sum_k coeffs[k] x^k by Horner's rule, one rounded tensor op per * and + (as the numba loop)."""
    p = x * coeffs[-1] + coeffs[-2]
    for c in reversed(coeffs[:-2]):
        p = p * x + c
    return p


def _radius_torch(a: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp((a.to(torch.float64) + 1.0) * 2.3283064365386963e-10)
    low = m < _SQRT_HALF
    m = torch.where(low, m * 2.0, m)
    e = torch.where(low, e - 1, e)
    s = (m - 1.0) / (m + 1.0)
    ln = e.to(torch.float64) * _LN2 + (s * 2.0) * _horner(s * s, _ATANH)
    return torch.sqrt(ln * -2.0)


def _circle_torch(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    phi = ((b & 0x3FFFFFFF).to(torch.float64) - 536870911.5) * _PHI_SCALE
    x2 = phi * phi
    sp = phi * _horner(x2, _SIN)
    cp = _horner(x2, _COS)
    q = b >> 30
    odd = (q & 1) != 0
    u = torch.where(odd, sp, cp)
    v = torch.where(odd, cp, sp)
    return torch.where(((q ^ (q >> 1)) & 1) != 0, -u, u), torch.where(q >= 2, -v, v)


def _check(seed: int, index: int, numel: int) -> tuple[int, int]:
    if not 0 <= index < 1 << 32:
        raise ValueError(f"parameter index must be in [0, 2^32), got {index}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return split_key(seed)


def gaussian_torch(seed: int, index: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``gaussian`` written as separate torch tensor ops (each op rounded into its own tensor): runs on
    any device (CUDA included) and is the reference the compiled CPU kernel is tested against."""
    key = _check(seed, index, numel)
    b = torch.arange((numel + 3) // 4, dtype=torch.int64, device=device)
    ctr = torch.stack([b & _M32, b >> 32, torch.full_like(b, index), torch.zeros_like(b)], dim=-1)
    w = philox_torch(ctr, key)
    r0, r2 = _radius_torch(w[:, 0]), _radius_torch(w[:, 2])
    (c0, s0), (c2, s2) = _circle_torch(w[:, 1]), _circle_torch(w[:, 3])
    z = torch.stack([r0 * c0, r0 * s0, r2 * c2, r2 * s2], dim=-1).to(torch.float32)
    return z.reshape(-1)[:numel]


def gaussian(seed: int, index: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """z for parameter ``index`` at step seed ``seed``: ``numel`` N(0, 1) values, float32, 1-D.

    Element i is a pure function of (seed, index, i) (the module docstring), identical on every CPU,
    thread count and device. CPU tensors come from the compiled kernel, others from ``gaussian_torch``.

    Raises:
        ValueError: seed outside [0, 2^64), index outside [0, 2^32), or numel < 0.
    """
    k0, k1 = _check(seed, index, numel)
    if torch.device(device).type != "cpu":
        return gaussian_torch(seed, index, numel, device)
    out = torch.empty(numel, dtype=torch.float32)
    _gaussian_numba(k0, k1, index, out.numpy())
    return out
