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
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

if TYPE_CHECKING:
    from numba.core.base import BaseContext as TargetContext
    from numba.core.typing.context import BaseContext as TypingContext
    from numba.core.typing.templates import Signature

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
# Every kernel is compiled with fastmath=False (no contraction: the module docstring) and
# error_model="numpy": IEEE division, without the Python ZeroDivisionError branch that kept LLVM from
# vectorising the float stage (no divisor here can be zero: m + 1 >= 1.7).
_inline = numba.njit(cache=True, fastmath=False, error_model="numpy", inline="always")
_kernel = numba.njit(cache=True, fastmath=False, error_model="numpy", nogil=True)  # threads run them in parallel
_U = numba.uint64

@_inline
def _philox_block(c0: np.uint64, c1: np.uint64, c2: np.uint64, c3: np.uint64, k0: np.uint64, k1: np.uint64) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
    """One Philox4x32-10 block; all values uint64 holding 32-bit words."""
    m32 = _U(_M32)
    for r in range(PHILOX_ROUNDS):
        if r:
            k0 = (k0 + _U(PHILOX_W[0])) & m32
            k1 = (k1 + _U(PHILOX_W[1])) & m32
        p0 = _U(PHILOX_M[0]) * c0
        p1 = _U(PHILOX_M[1]) * c2
        c0, c1, c2, c3 = ((p1 >> _U(32)) ^ c1 ^ k0, p1 & m32, (p0 >> _U(32)) ^ c3 ^ k1, p0 & m32)
    return c0, c1, c2, c3


@_kernel
def _philox_numba(ctr: np.ndarray, key: np.ndarray, out: np.ndarray) -> None:
    """out[n, 4] = philox4x32-10(ctr[n, 4], key[2]), uint32 arrays."""
    k0, k1 = _U(key[0]), _U(key[1])
    for n in range(ctr.shape[0]):
        out[n, 0], out[n, 1], out[n, 2], out[n, 3] = _philox_block(
            _U(ctr[n, 0]), _U(ctr[n, 1]), _U(ctr[n, 2]), _U(ctr[n, 3]), k0, k1)


def _bitcast(name: str, src: types.Type, dst: types.Type, dst_ir: ir.Type) -> Callable[..., Any]:
    """A numba intrinsic ``name(x)``: the value of type ``dst`` with the IEEE-754 bits of ``x`` (exact)."""

    def cast(typingctx: TypingContext, x: types.Type) -> tuple[Signature, Callable[..., ir.Value]]:
        return dst(src), lambda context, builder, signature, args: builder.bitcast(args[0], dst_ir)

    cast.__name__ = name
    return intrinsic(cast)


_bits_f64: Callable[[float], np.uint64] = _bitcast("_bits_f64", types.float64, types.uint64, ir.IntType(64))
_f64_bits: Callable[[np.uint64], float] = _bitcast("_f64_bits", types.uint64, types.float64, ir.DoubleType())
_bits_f32: Callable[[np.float32], np.uint32] = _bitcast("_bits_f32", types.float32, types.uint32, ir.IntType(32))
_f32_bits: Callable[[np.uint32], np.float32] = _bitcast("_f32_bits", types.uint32, types.float32, ir.FloatType())


@intrinsic
def _sqrt(typingctx: TypingContext, x: types.Type) -> tuple[Signature, Callable[..., ir.Value]]:
    """sqrt of a float64 as LLVM's ``llvm.sqrt.f64``: IEEE-754's correctly rounded square root (as libm's
    ``sqrt``, which numba's ``math.sqrt`` calls), but an intrinsic LLVM can vectorise (``vsqrtpd``)."""

    def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature, args: Sequence[ir.Value]) -> ir.Value:
        return builder.call(builder.module.declare_intrinsic("llvm.sqrt", [ir.DoubleType()]), [args[0]])

    return types.float64(types.float64), codegen


@_inline
def _radius(a: np.uint64) -> float:
    """sqrt(-2 ln x), x = (a + 1) 2^-32: step 1 of the module docstring."""
    bits = _bits_f64((numba.float64(a) + 1.0) * 2.3283064365386963e-10)  # 2^-32
    e = numba.int32(bits >> _U(52)) - numba.int32(1022)  # int32: converted to float64 by one vector op
    m = _f64_bits((bits & _U(0x000FFFFFFFFFFFFF)) | _U(0x3FE0000000000000))  # [0.5, 1)
    low = m < _SQRT_HALF
    m = m * 2.0 if low else m
    e = e - numba.int32(1) if low else e
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = _ATANH[5]
    for k in range(4, -1, -1):
        p = p * s2 + _ATANH[k]
    ln = numba.float64(e) * _LN2 + (s * 2.0) * p
    return _sqrt(ln * -2.0)  # type: ignore[call-arg, arg-type]  # numba's stubs type an @intrinsic's call with its typing function's (typingctx, x); jitted code passes x


@_inline
def _circle(b: np.uint64) -> tuple[float, float]:
    """(cos, sin) of a uniform angle from word b: step 2 of the module docstring."""
    phi = (numba.float64(numba.int32(b & _U(0x3FFFFFFF))) - 536870911.5) * _PHI_SCALE
    x2 = phi * phi
    sp = _SIN[5]
    for k in range(4, -1, -1):
        sp = sp * x2 + _SIN[k]
    cp = _COS[6]
    for k in range(5, -1, -1):
        cp = cp * x2 + _COS[k]
    sp = phi * sp
    q = b >> _U(30)
    odd = (q & _U(1)) != 0
    u = sp if odd else cp
    v = cp if odd else sp
    u = -u if ((q ^ (q >> _U(1))) & _U(1)) != 0 else u
    v = -v if q >= 2 else v
    return u, v


_CHUNK_BLOCKS = 1024
"""Blocks (4 elements each) per pass of a kernel: the words, values and parameter slice of one chunk
stay in L1/L2, and a thread's share of a tensor is a whole number of chunks."""


@_inline
def _values(key0: np.uint64, key1: np.uint64, stream: np.uint64, start: int, m: int, w: np.ndarray, z: np.ndarray) -> None:
    """z[:4 m] = elements 4 start .. 4 (start + m) - 1 of stream (key, ``stream``), float32, in element
    order: the Philox words of blocks start .. start + m - 1, then their values (word 2h -> radius, word
    2h + 1 -> angle; element 4 b + j = value j of block b). ``w``: uint32 [4, >= m] scratch."""
    for j in range(m):
        b = _U(start + j)
        w[0, j], w[1, j], w[2, j], w[3, j] = _philox_block(b & _U(_M32), b >> _U(32), stream, _U(0), key0, key1)
    for j in range(m):
        r0, r2 = _radius(w[0, j]), _radius(w[2, j])
        c0, s0 = _circle(w[1, j])
        c2, s2 = _circle(w[3, j])
        z[4 * j] = numba.float32(r0 * c0)
        z[4 * j + 1] = numba.float32(r0 * s0)
        z[4 * j + 2] = numba.float32(r2 * c2)
        z[4 * j + 3] = numba.float32(r2 * s2)


@_kernel
def _gaussian_numba(k0: int, k1: int, index: int, out: np.ndarray, first_block: int, last_block: int) -> None:
    """out[4 first_block : 4 last_block] (clipped to out.size) = those elements of stream (key (k0, k1),
    ``index``), float32."""
    w = np.empty((4, _CHUNK_BLOCKS), np.uint32)
    z = np.empty(4 * _CHUNK_BLOCKS, np.float32)
    for start in range(first_block, last_block, _CHUNK_BLOCKS):
        m = min(_CHUNK_BLOCKS, last_block - start)
        _values(_U(k0), _U(k1), _U(index), start, m, w, z)
        base = 4 * start
        for i in range(min(4 * m, out.size - base)):
            out[base + i] = z[i]


# Parameter dtypes as the kernels hold them: the bits, widened exactly to float32 and rounded back.
_FLOAT32, _BFLOAT16, _FLOAT16 = 0, 1, 2
_KINDS = {torch.float32: (_FLOAT32, torch.int32), torch.bfloat16: (_BFLOAT16, torch.int16),
          torch.float16: (_FLOAT16, torch.int16)}
KERNEL_DTYPES = frozenset(_KINDS)
"""The parameter dtypes ``apply_`` takes (``training.zo.DTYPES``)."""


@_inline
def _widen(h: np.unsignedinteger, kind: int) -> np.float32:
    """The float32 value of the bits ``h`` (uint) of a parameter of dtype ``kind``: exact.

    float16: c10's ``fp16_ieee_to_fp32_value`` (c10/util/Half.h; M. Dukhan's FP16 library), all exact
    float32 and integer ops, subnormals included."""
    if kind == _FLOAT32:
        return _f32_bits(numba.uint32(h))
    if kind == _BFLOAT16:
        return _f32_bits(numba.uint32(_U(h) << _U(16)))
    w = _U(h) << _U(16)
    two_w = (w + w) & _U(_M32)
    normalized = _f32_bits(numba.uint32((two_w >> _U(4)) + _U(0x70000000))) * numba.float32(1.925929944387236e-34)
    denormalized = _f32_bits(numba.uint32((two_w >> _U(17)) | _U(0x3F000000))) - numba.float32(0.5)
    mag = _U(_bits_f32(denormalized)) if two_w < _U(1 << 27) else _U(_bits_f32(normalized))
    return _f32_bits(numba.uint32((w & _U(0x80000000)) | mag))


@_inline
def _narrow(x: np.float32, kind: int) -> np.uint64:
    """The bits (uint64) of float32 ``x`` rounded to nearest-even to dtype ``kind``, as torch rounds.

    bfloat16: c10's ``round_to_nearest_even`` (NaN -> 0x7FC0); float16: c10's
    ``fp16_ieee_from_fp32_value`` (exact float32 scalings, subnormal and infinite results kept)."""
    w = _U(_bits_f32(x))
    if kind == _FLOAT32:
        return w
    if kind == _BFLOAT16:
        return _U(0x7FC0) if x != x else ((w + _U(0x7FFF) + ((w >> _U(16)) & _U(1))) >> _U(16)) & _U(0xFFFF)
    base = (abs(x) * numba.float32(5.192296858534828e33)) * numba.float32(7.703719777548943e-34)  # 2^112, 2^-110
    shl1 = (w + w) & _U(_M32)
    bias = max(shl1 & _U(0xFF000000), _U(0x71000000))
    base = _f32_bits(numba.uint32((bias >> _U(1)) + _U(0x07800000))) + base
    bits = _U(_bits_f32(base))
    nonsign = ((bits >> _U(13)) & _U(0x7C00)) + (bits & _U(0x0FFF))
    return ((w & _U(0x80000000)) >> _U(16)) | (_U(0x7E00) if shl1 > _U(0xFF000000) else nonsign)


_PERTURB, _UPDATE = 0.0, 1.0


@_inline
def _ops(bits: np.ndarray, base: int, cnt: int, z: np.ndarray, x: np.ndarray, prog: np.ndarray, kind: int) -> None:
    """``_apply_numba``'s work on one chunk (``cnt`` elements from ``base``, their float32 z in ``z``,
    ``x`` scratch), for one dtype ``kind``: called with a constant ``kind``, so that every loop below is
    branch-free and vectorised for that dtype."""
    for i in range(cnt):
        x[i] = _widen(bits[base + i], kind)
    if kind != _FLOAT32:
        for i in range(cnt):
            z[i] = _widen(_narrow(z[i], kind), kind)
    for k in range(prog.shape[0]):
        if prog[k, 0] == _PERTURB:
            scale = numba.float32(prog[k, 1])
            for i in range(cnt):
                x[i] = x[i] + z[i] * scale
        elif prog[k, 3] != 0.0:
            g, lr, wd = numba.float32(prog[k, 1]), numba.float32(prog[k, 2]), numba.float32(prog[k, 3])
            for i in range(cnt):
                x[i] = x[i] - (z[i] * g + x[i] * wd) * lr
        else:
            g, lr = numba.float32(prog[k, 1]), numba.float32(prog[k, 2])
            for i in range(cnt):
                x[i] = x[i] - (z[i] * g) * lr
        if kind != _FLOAT32:
            for i in range(cnt):
                x[i] = _widen(_narrow(x[i], kind), kind)
    for i in range(cnt):
        bits[base + i] = _narrow(x[i], kind)


@_kernel
def _apply_numba(k0: int, k1: int, index: int, bits: np.ndarray, kind: int, prog: np.ndarray, first_block: int, last_block: int) -> None:
    """Run ``prog`` on elements 4 first_block .. 4 last_block - 1 (clipped to bits.size) of a parameter
    held as ``bits`` (uint32 for float32, uint16 for bfloat16 and float16; ``kind``), in place.

    ``prog``: float64 [k, 4], one row per op: (_PERTURB, scale, 0, 0) or (_UPDATE, g, lr, wd). Per
    element: z of stream (key, ``index``), rounded once to the parameter's dtype; x = the element widened
    to float32; each op in float32, every * + - rounded on its own (``zo.perturb_``, ``zo.update_``),
    then x rounded to the dtype (exactly as ``zo._add_`` writes p); the element = x."""
    w = np.empty((4, _CHUNK_BLOCKS), np.uint32)
    z = np.empty(4 * _CHUNK_BLOCKS, np.float32)
    x = np.empty(4 * _CHUNK_BLOCKS, np.float32)
    for start in range(first_block, last_block, _CHUNK_BLOCKS):
        m = min(_CHUNK_BLOCKS, last_block - start)
        _values(_U(k0), _U(k1), _U(index), start, m, w, z)
        base = 4 * start
        cnt = min(4 * m, bits.size - base)
        if kind == _FLOAT32:
            _ops(bits, base, cnt, z, x, prog, _FLOAT32)
        elif kind == _BFLOAT16:
            _ops(bits, base, cnt, z, x, prog, _BFLOAT16)
        else:
            _ops(bits, base, cnt, z, x, prog, _FLOAT16)


def _threads(blocks: int) -> int:
    """Threads for a pass over ``blocks`` blocks: torch's thread count (the cores this process was
    given: ``torch.set_num_threads``, Ray's ``num_cpus``), at most one per ``_MIN_CHUNKS`` chunks."""
    return max(1, min(torch.get_num_threads(), blocks // (_CHUNK_BLOCKS * _MIN_CHUNKS)))


_MIN_CHUNKS = 8  # a thread's share is worth its hand-off (about 20 us) from 32K elements on
_pool: ThreadPoolExecutor | None = None


def _reset_pool() -> None:
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_reset_pool)  # a forked child has the pool object but not its threads


def _run_all(kernel: Callable[..., None], jobs: Sequence[tuple[tuple[Any, ...], int]]) -> None:
    """``kernel(*args, first_block, last_block)`` over [0, blocks) for every (args, blocks) of ``jobs``
    (the tensors of a pass), on ``_threads`` of their total blocks: the jobs' blocks, one after another,
    are cut into that many equal contiguous shares, each share run by one thread (the caller's among
    them; the kernels release the GIL), so a pass over many tensors hands work off once, not per tensor.
    Every element is computed by the same ops whatever the cut: the bits do not depend on it."""
    global _pool
    total = sum(blocks for _, blocks in jobs)
    threads = _threads(total)
    if threads == 1:
        _run_share(kernel, [(args, 0, blocks) for args, blocks in jobs])
        return
    bounds = [total * t // threads for t in range(threads + 1)]
    shares: list[list[tuple[tuple[Any, ...], int, int]]] = [[] for _ in range(threads)]
    offset = 0
    for args, blocks in jobs:
        for t, share in enumerate(shares):
            lo, hi = max(bounds[t], offset), min(bounds[t + 1], offset + blocks)
            if lo < hi:
                share.append((args, lo - offset, hi - offset))
        offset += blocks
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="raycheck-noise")
    futures = [_pool.submit(_run_share, kernel, share) for share in shares[1:]]
    try:
        _run_share(kernel, shares[0])
    finally:
        for f in futures:
            f.result()


def _run_share(kernel: Callable[..., None], share: Sequence[tuple[tuple[Any, ...], int, int]]) -> None:
    for args, lo, hi in share:
        kernel(*args, lo, hi)


def _program(ops: Sequence[Op]) -> np.ndarray:
    """The float64 [k, 4] rows ``_apply_numba`` reads for ``ops``."""
    rows = []
    for op in ops:
        if isinstance(op, Perturb):
            rows.append((_PERTURB, op.scale, 0.0, 0.0))
        elif isinstance(op, Update):
            rows.append((_UPDATE, op.projected_grad, op.lr, op.weight_decay))
        else:
            raise TypeError(f"not a noise.Op: {op!r}")
    return np.array(rows, dtype=np.float64).reshape(-1, 4)


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
    thread count and device. CPU tensors come from the compiled kernel (on ``torch.get_num_threads()``
    threads), others from ``gaussian_torch``.

    Raises:
        ValueError: seed outside [0, 2^64), index outside [0, 2^32), or numel < 0.
    """
    k0, k1 = _check(seed, index, numel)
    if torch.device(device).type != "cpu":
        return gaussian_torch(seed, index, numel, device)
    out = torch.empty(numel, dtype=torch.float32)
    _run_all(_gaussian_numba, [((k0, k1, index, out.numpy()), (numel + 3) // 4)])
    return out


def apply_(p: torch.Tensor, seed: int, index: int, ops: Sequence[Op]) -> None:
    """Run ``ops`` on CPU parameter ``p`` (parameter number ``index``, step seed ``seed``) in place, in
    one pass: each element's z is generated once, in registers, and never held for the tensor.

    Bitwise the same as ``z = zo.noise(seed, index, p)`` followed by ``zo.perturb_(p, z, op.scale)`` /
    ``zo.update_(p, z, op.projected_grad, op.lr, op.weight_decay)`` for each op (the contract in
    ``training/zo.py``: z rounded once to p's dtype; every float32 * + - rounded on its own; p rounded to
    its dtype after each op), on any thread count (``torch.get_num_threads()``). Extra memory: three
    chunk buffers per thread (48 KiB), nothing proportional to ``p``; a non-contiguous ``p`` is worked
    on as a contiguous copy.

    ``p``: any shape, float32, bfloat16 or float16, on the CPU.

    Raises:
        ValueError: ``p`` not on the CPU or of another dtype; seed or index out of range (``gaussian``).
        TypeError: an op that is not a ``Perturb`` or ``Update``.
    """
    apply_all_([(p, seed, index, ops)])


def apply_all_(passes: Sequence[tuple[torch.Tensor, int, int, Sequence[Op]]]) -> None:
    """``apply_(p, seed, index, ops)`` for every (p, seed, index, ops) of ``passes`` (the tensors of one
    pass over a model), the threads sharing the work of all of them (``_run_all``). Raises as ``apply_``."""
    jobs, works = [], []
    for p, seed, index, ops in passes:
        if p.device.type != "cpu" or p.dtype not in _KINDS:
            raise ValueError(f"noise.apply_ takes a CPU float32, bfloat16 or float16 tensor, got {p.dtype} on {p.device}")
        k0, k1 = _check(seed, index, p.numel())
        kind, as_bits = _KINDS[p.dtype]
        work = p.detach() if p.is_contiguous() else p.detach().contiguous()
        bits = work.view(as_bits).numpy().reshape(-1).view(np.uint32 if kind == _FLOAT32 else np.uint16)
        jobs.append(((k0, k1, index, bits, kind, _program(ops)), (p.numel() + 3) // 4))
        works.append(work)
    _run_all(_apply_numba, jobs)
    for (p, *_), work in zip(passes, works):
        if work.data_ptr() != p.data_ptr():
            with torch.no_grad():
                p.copy_(work)
