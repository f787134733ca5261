"""The Triton kernels of ``training.noise_triton`` (this module imports triton; ``noise_triton`` imports it
only when a kernel is first used, so that raycheck runs without triton).

Each kernel program takes ``BLOCK`` consecutive Philox blocks of one parameter's stream (4 BLOCK
elements, a [BLOCK, 4] tile: row = block, column = word) and computes, in registers, exactly the steps
of ``training.noise``'s module docstring, one IEEE-754 operation after another:

- the words: ``tl.philox`` (Triton's Philox4x32, the Random123 constants ``training.noise.PHILOX_M`` /
  ``PHILOX_W``, key = the seed's low and high 32-bit words, counter (b mod 2^32, b >> 32, index, 0)),
  10 rounds; only 32-bit integer multiplies (``umulhi`` and the low product), xors and additions;
- the radius from words 0 and 2, the angle from words 1 and 3, in float64: ``frexp`` as a bit cast,
  the fixed Horner polynomials of ``training.noise`` (its coefficient tuples), ``/`` and ``sqrt`` of
  float64 (PTX ``div.rn.f64`` and ``sqrt.rn.f64``: correctly rounded); then one rounding to float32;
- ``_apply_kernel`` only: the parameter's ops (``training.noise.Perturb`` / ``Update``) in float32 on
  the exactly widened element, the result rounded to the parameter's dtype after every op.

Nothing is fused: the launches pass ``enable_fp_fusion=False``, so LLVM contracts no multiply-add into
an FMA and Triton runs ptxas with ``--fmad=false``. Under ``TRITON_INTERPRET=1`` (read when this module
is imported) the same kernels run on the CPU with numpy's IEEE-754 arithmetic, which has no FMA either.
Every element depends only on (seed, index, element), so the bits do not depend on ``BLOCK`` or the grid.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

from raycheck.training import noise

INTERPRETED = knobs.runtime.interpret
"""Whether the kernels below run under Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""

FLOAT32, BFLOAT16, FLOAT16 = 0, 1, 2
"""``DTYPE`` codes of ``_apply_kernel``; a bfloat16 parameter is passed as its int16 bit patterns."""
PERTURB, UPDATE, UPDATE_DECAY = 0, 1, 2
"""``KINDS`` codes of ``_apply_kernel``: each op reads scalars 3i, 3i + 1, 3i + 2 of ``S``."""

_LN2 = tl.constexpr(noise._LN2)
_SQRT_HALF = tl.constexpr(noise._SQRT_HALF)
_PHI_SCALE = tl.constexpr(noise._PHI_SCALE)
_ATANH = tl.constexpr(noise._ATANH)
_SIN = tl.constexpr(noise._SIN)
_COS = tl.constexpr(noise._COS)
_N_ATANH = tl.constexpr(len(noise._ATANH))
_N_SIN = tl.constexpr(len(noise._SIN))
_N_COS = tl.constexpr(len(noise._COS))
_ROUNDS = tl.constexpr(noise.PHILOX_ROUNDS)
_F32, _BF16 = tl.constexpr(FLOAT32), tl.constexpr(BFLOAT16)
_PERTURB, _UPDATE_DECAY = tl.constexpr(PERTURB), tl.constexpr(UPDATE_DECAY)


@triton.jit
def _horner(x, coeffs: tl.constexpr, n: tl.constexpr):
    """sum_k coeffs[k] x^k (n coefficients), each * and + rounded: the order of ``noise._horner``."""
    p = x * coeffs[n - 1] + coeffs[n - 2]
    for k in tl.static_range(n - 3, -1, -1):
        p = p * x + coeffs[k]
    return p


@triton.jit
def _radius(a):
    """sqrt(-2 ln x), x = (a + 1) 2^-32, float64, from uint32 words ``a``: step 1 of ``training.noise``."""
    bits = ((a.to(tl.float64) + 1.0) * 2.3283064365386963e-10).to(tl.uint64, bitcast=True)
    e = (bits >> 52).to(tl.int32) - 1022
    m = ((bits & 0x000FFFFFFFFFFFFF) | 0x3FE0000000000000).to(tl.float64, bitcast=True)  # [0.5, 1)
    low = m < _SQRT_HALF
    m = tl.where(low, m * 2.0, m)
    e = tl.where(low, e - 1, e)
    s = (m - 1.0) / (m + 1.0)
    ln = e.to(tl.float64) * _LN2 + (s * 2.0) * _horner(s * s, _ATANH, _N_ATANH)
    return tl.sqrt(ln * -2.0)


@triton.jit
def _circle(b):
    """(cos, sin) of the uniform angle of uint32 words ``b``, float64: step 2 of ``training.noise``."""
    phi = ((b & 0x3FFFFFFF).to(tl.float64) - 536870911.5) * _PHI_SCALE
    x2 = phi * phi
    sp = phi * _horner(x2, _SIN, _N_SIN)
    cp = _horner(x2, _COS, _N_COS)
    q = b >> 30
    odd = (q & 1) != 0
    u = tl.where(odd, sp, cp)
    v = tl.where(odd, cp, sp)
    return tl.where(((q ^ (q >> 1)) & 1) != 0, -u, u), tl.where(q >= 2, -v, v)


@triton.jit
def _tile(seed, index, BLOCK: tl.constexpr):
    """(element offsets int64 [BLOCK, 4], z float32 [BLOCK, 4]) of this program's Philox blocks."""
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    c2 = (tl.zeros([BLOCK], tl.int64) + index).to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, (b & 0xFFFFFFFF).to(tl.uint32), (b >> 32).to(tl.uint32), c2,
                               tl.zeros([BLOCK], tl.uint32), _ROUNDS)
    r0, r2 = _radius(w0), _radius(w2)
    cos0, sin0 = _circle(w1)
    cos2, sin2 = _circle(w3)
    col = tl.arange(0, 4)[None, :]
    first = col < 2  # words 0, 1 give elements 4b, 4b + 1; words 2, 3 give 4b + 2, 4b + 3
    r = tl.where(first, r0[:, None], r2[:, None])
    c = tl.where(first, cos0[:, None], cos2[:, None])
    s = tl.where(first, sin0[:, None], sin2[:, None])
    z = (r * tl.where((col & 1) == 0, c, s)).to(tl.float32)
    return b[:, None] * 4 + col, z


@triton.jit(do_not_specialize=["n", "seed", "index"])
def _gaussian_kernel(OUT, n, seed, index, BLOCK: tl.constexpr):
    """OUT[e] = z of element e of stream (seed, index), e < n; float32."""
    e, z = _tile(seed, index, BLOCK)
    tl.store(OUT + e, z, mask=e < n)


@triton.jit
def _narrow(x, DTYPE: tl.constexpr):
    """float32 ``x`` rounded to nearest-even to DTYPE, as stored (bfloat16: int16 bit patterns)."""
    if DTYPE == _BF16:
        u = x.to(tl.uint32, bitcast=True)
        rounded = tl.where(x != x, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)  # c10 round_to_nearest_even
        out = rounded.to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        out = x.to(tl.float16)
    return out


@triton.jit
def _widen(v, DTYPE: tl.constexpr):
    """The float32 value of stored DTYPE values ``v`` (exact)."""
    if DTYPE == _BF16:
        out = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        out = v.to(tl.float32)
    return out


@triton.jit(do_not_specialize=["n", "seed", "index"])
def _apply_kernel(P, n, seed, index, S, KINDS: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """P[e] <- the ops ``KINDS`` (scalars ``S``, float32 values) applied in order to P[e], with z of
    element e of stream (seed, index) rounded once to DTYPE; e < n."""
    e, z = _tile(seed, index, BLOCK)
    mask = e < n
    x = tl.load(P + e, mask=mask)
    if DTYPE != _F32:
        x = _widen(x, DTYPE)
        z = _widen(_narrow(z, DTYPE), DTYPE)
    for i in tl.static_range(len(KINDS)):
        if KINDS[i] == _PERTURB:
            t = z * S[3 * i]
            x = x + t
        else:
            u = z * S[3 * i]
            if KINDS[i] == _UPDATE_DECAY:
                v = x * S[3 * i + 2]
                u = u + v
            t = u * S[3 * i + 1]
            x = x - t
        if DTYPE != _F32:
            x = _widen(_narrow(x, DTYPE), DTYPE)
    if DTYPE != _F32:
        x = _narrow(x, DTYPE)
    tl.store(P + e, x, mask=mask)

