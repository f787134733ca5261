"""The zeroth-order (MeZO) step and its exact replay.

Source: Malladi et al., "Fine-Tuning Language Models with Just Forward Passes", NeurIPS 2023,
Algorithm 1 (MeZO). For step t with seed s_t and every trainable parameter p in a fixed order:

1. p <- p + eps * z_p                       loss_plus  = L(theta + eps z; B_t)
2. p <- p - 2 eps * z_p                     loss_minus = L(theta - eps z; B_t)
3. p <- p + eps * z_p                       ("reset"; NOT an identity in floating point)
4. g_t = (loss_plus - loss_minus) / (2 eps)  the projected gradient (float64 scalar)
5. p <- p - lr * (g_t * z_p + wd * p)        wd only for weight-decayed parameters (ndim >= 2)

Exactness contract (checked bitwise by the tests): the worker and every replayer run the same ops
below, with the same z, in the same order per element (the worker through ``perturb_all_`` /
``reset_and_update_all_``, every replayer, the shadow, a recovery from storage and ``raycheck
replay``, through ``replay_step_`` / ``replay_records_``). The primitives ``perturb_`` and ``update_``
are their specification, written as single elementwise torch ops over a held z; the hot path runs them
fused (``apply_``: one pass per tensor that generates each element's z in registers and applies the
same ops to it, ``training.noise.apply_`` on CPU, ``training.noise_triton`` on CUDA), and the tests
pin trajectories of the unfused primitives. None is a reduction, so the result cannot depend on
vectorisation, thread count or device. The ops, each in float32 (the parameter's dtype), each rounded
once to nearest-even:

    perturb_(p, z, scale):               scale is +eps, -2 eps or +eps (exact in binary64; rounded once
                                         to float32 where the op reads it, the same on every device)
        t = z * scale                    1 rounding
        p = p + t                        1 rounding (in place)
    update_(p, z, g, lr, wd):
        u = z * g                        1 rounding   (g: the logged float64 projected gradient)
        v = p * wd                       1 rounding   } only for weight-decayed parameters
        u = u + v                        1 rounding   }
        t = u * lr                       1 rounding
        p = p - t                        1 rounding (in place)

Why no two of them may be fused: a fused multiply-add ``a * b + c`` rounds once where the pair
rounds twice, so its result differs in the last bit for some inputs, and whether a compiler contracts
a pair depends on the CPU (FMA units), the compiler and its flags: one device's worker and another's
shadow would then drift apart bit by bit. In the primitives every op is a separate eager torch kernel
that writes its rounded result to a tensor in memory; no compiler sees two of them in one expression,
so none can contract them (do not wrap these functions in ``torch.compile``: Inductor fuses elementwise
chains and may then contract them). The fused kernels are compiled with contraction off (numba
``fastmath=False``, Triton ``enable_fp_fusion=False``; the tests read the machine code for FMAs). Inside one kernel: torch's add/sub compute ``self + alpha * other``,
which CPU vectorisation and nvcc contract into one FMA; we never pass ``alpha``, and with alpha = 1
the product is exact, so that FMA rounds once, exactly as a plain add. Scalar operands (eps, g, lr,
wd) are Python floats, rounded once to float32 by every backend (their "opmath" type for float32 is
float32). IEEE-754 requires +, -, * to be correctly rounded, so every CPU instruction set (scalar,
SSE, AVX2, AVX-512, NEON) and CUDA give the same bits, provided subnormals are kept (torch's default:
``torch.set_flush_denormal(False)``; CUDA builds do not use ``--use_fast_math``).

Half precision (``--dtype bfloat16`` or ``float16``, ``DTYPES``): the parameters are held, perturbed
and updated in that dtype D (the worker's model, the shadow, recoveries, snapshots and ``raycheck
replay`` alike). No op computes in D itself: every primitive above runs in float32 exactly as listed,
on operands widened exactly to float32 (every bfloat16 and float16 value is a float32 value), and
the one result that is written back, p, is rounded once from float32 to D, to nearest-even:

    z                  the generator's float32 z, rounded once to D (by ``noise``, or in the fused
                       kernel, element by element), widened exactly in each op
    perturb_:          t = f32(z) * scale  (f32, 1 rounding);  p = D(f32(p) + t)  (f32 add, then to D)
    update_:           u = f32(z) * g; [v = f32(p) * wd; u = u + v]; t = u * lr  (f32, 1 rounding each);
                       p = D(f32(p) - t)  (f32 subtract, then to D)

So each write of p is rounded twice, to float32 then to D: that is not always the correctly rounded
D(p + t), but it is the same two IEEE-754 steps on every backend, which is what exactness needs.
Narrowing float32 to D is round-to-nearest-even everywhere torch does it (``_add_``'s ``copy_``,
``noise``'s ``.to``): bfloat16 by adding 0x7fff plus the kept lowest bit and truncating, NaN
apart, in c10's scalar ``round_to_nearest_even`` (c10/util/BFloat16.h), in the AVX2 / AVX-512 vector
``cvtfp32_bf16`` (aten/src/ATen/cpu/vec) and in CUDA's ``__float2bfloat16``; float16 by c10's
``fp16_ieee_from_fp32_value``, F16C ``vcvtps2ph`` with the nearest-even immediate, NEON ``vcvt``
and CUDA ``__float2half`` (all IEEE conversions, subnormal results kept). Nothing here is a reduction,
so threads cannot reorder anything, and the scalar and vectorised CPU loops run the same steps
(``tests/test_dtypes.py`` checks strided tensors, which take the scalar loop, against contiguous
ones, and several thread counts).

Why not torch's own half-precision arithmetic (``p.add_(z * scale)`` on D tensors)? It is portable
too: torch computes reduced-precision elementwise ops in their "opmath" type, float32, and rounds
each result once to D (CPU: ``Vectorized<BFloat16>`` / ``Vectorized<Half>`` widen, compute in
float32, narrow; the scalar loop's c10 operators do the same; CUDA: ``opmath_symmetric_gpu_kernel_
with_scalars`` with ``opmath_t = float``, a Python scalar held as a float32 ``original_scalar_value``,
never rounded to D). But it rounds the perturbation t = z * scale to D before the add (one rounding
more; the residue below is about the same either way), and its contract would be every kernel's
opmath path on every backend; the explicit form rests on the float32 contract above plus one
conversion per write.

The +eps, -2 eps, +eps round trip leaves a residue in every dtype: about half the elements do not
come back to their bits, each off by up to an ulp of D, so in D the residue is about 2^16 (bfloat16) or
2^13 (float16) times float32's (``experiments.dtype_residue``, docs/dtypes.md). Every replayer
re-executes the round trip and never assumes it cancels. The step log header records the run's dtype
(``check_dtype``), and the dtype is part of the trajectory hash; snapshots store the tensors in D
(safetensors ``BF16`` / ``F16``, ``storage.tensor_files``).

z_p comes from ``training.noise``: Philox4x32-10 keyed by the step seed (from run seed and step),
counted by (parameter index, element), mapped to N(0, 1) by correctly rounded ops only, so each
tensor's noise is independent of the others (a sharded shadow can replay any subset) and the same on
every CPU, thread count and CUDA. Generating each z once and applying steps 1, 2, 3 and 5 back to back
(``replay_step_``) is bitwise identical to the worker's three passes (steps 1, 2, then 3 and 5 fused
after the step log append, each regenerating z as MeZO does, so no step holds z for the model),
because every element sees the same rounded ops.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from raycheck.job.config import DTYPE_NAMES
from raycheck.storage.steplog import StepLogCorruptError, StepRecord
from raycheck.training import noise as noise_gen
from raycheck.training import noise_triton

GENERATOR = noise_gen.GENERATOR
"""Recorded in the step log header (key ``generator``); a replayer refuses a log written with another."""

_SEED_MASK = (1 << 63) - 1


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""The torch dtype of each name in ``job.config.DTYPE_NAMES`` (the step log header's ``dtype``)."""


class DtypeMismatchError(ValueError):
    """A step log was written by a run that held its parameters in another dtype than this replayer."""


def dtype_name(params: Mapping[str, torch.Tensor]) -> str:
    """The ``DTYPES`` name of the parameters' dtype (that of the first tensor; a model loads in one dtype)."""
    return str(next(iter(params.values())).dtype).removeprefix("torch.")


def check_dtype(header: dict[str, Any], dtype: str, source: str) -> None:
    """Refuse to replay (or resume) a log written in another parameter dtype than ``dtype``: the round
    trip and the update round to the parameters' dtype, so another dtype is another trajectory.

    A header without ``dtype`` (a log written before ``--dtype`` existed) is a float32 run's.

    Raises:
        DtypeMismatchError: the header names another dtype.
    """
    found = header.get("dtype", "float32")
    if found != dtype:
        raise DtypeMismatchError(
            f"{source}: the step log was written by a run that held its parameters in {found}; this one holds them "
            f"in {dtype}, and a replay in another dtype is another trajectory. Use --dtype {found} (or a new --out)."
        )


class GeneratorMismatchError(ValueError):
    """A step log was written with another perturbation generator than this replayer's."""


def check_generator(header: dict[str, Any], source: str) -> None:
    """Refuse to replay a log whose header names another generator than ``GENERATOR``.

    Raises:
        GeneratorMismatchError: the header has no ``generator`` (a log written before the portable
            generator, whose z came from torch's CPU generator) or names another one.
    """
    found = header.get("generator")
    if found != GENERATOR:
        what = "names no generator (an old log, whose noise came from torch.randn)" if found is None \
            else f"was written with generator {found!r}"
        raise GeneratorMismatchError(
            f"{source}: the step log {what}; this replayer generates z with {GENERATOR!r} and cannot "
            f"replay it exactly. Replay it with the raycheck version that wrote it, or start a new run (new --out)."
        )


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes, platforms and Python versions."""
    digest = hashlib.blake2b(struct.pack(f"<{len(parts)}Q", *parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def step_seed(run_seed: int, step: int) -> int:
    """The seed s_t of step ``step`` of a run."""
    return derive_seed(run_seed, step)


def noise(seed: int, index: int, like: torch.Tensor) -> torch.Tensor:
    """z for parameter number ``index`` at step seed ``seed``: N(0, 1) with ``like``'s shape, dtype and
    device (``training.noise.gaussian``, float32, converted once when ``like`` has another dtype)."""
    if like.device.type == "cuda" and noise_triton.available():
        z = noise_triton.gaussian(seed, index, like.numel(), like.device).view(like.shape)
    else:
        z = noise_gen.gaussian(seed, index, like.numel(), like.device).view(like.shape)
    return z.to(like.dtype)  # ``z`` itself when ``like`` is float32


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay applies to matrices, not to biases or norm gains (MeZO's rule)."""
    return p.ndim >= 2


def perturb_(p: torch.Tensor, z: torch.Tensor, scale: float) -> None:
    """p <- p + (z * scale) in place: two separately rounded float32 ops, then (a half-precision ``p``)
    one rounding to ``p``'s dtype (the module docstring).

    ``p`` and ``z`` have one shape, dtype (``DTYPES``) and device; ``scale`` is +eps, -2 eps or +eps."""
    _add_(p, z.float() * scale)


def update_(p: torch.Tensor, z: torch.Tensor, projected_grad: float, lr: float, weight_decay: float) -> None:
    """p <- p - ((g * z + wd * p) * lr) in place, each op a separate float32 kernel rounded on its own
    (MeZO Algorithm 1, line 'update'): z * g, [p * wd, +], * lr, p - ; a half-precision ``p`` is
    rounded once more, to its dtype, when written (the module docstring). ``weight_decay`` 0 skips the
    decay ops (so no ``+ 0 * p`` rounding is added)."""
    u = z.float() * projected_grad
    if weight_decay:
        u.add_(p.float() * weight_decay)
    _add_(p, u * lr, subtract=True)


def _add_(p: torch.Tensor, t: torch.Tensor, subtract: bool = False) -> None:
    """p <- p + t (or p - t) in place, ``t`` float32: one float32 op, rounded to nearest-even; a
    bfloat16/float16 ``p`` is widened exactly to float32 first and the float32 result rounded once to
    ``p``'s dtype (nearest-even) by ``copy_``, so no op ever computes in the half dtype itself."""
    op = torch.Tensor.sub_ if subtract else torch.Tensor.add_
    if p.dtype == torch.float32:
        op(p, t)
    else:
        p.copy_(op(p.float(), t))


@dataclass(frozen=True, kw_only=True)
class ZOHyper:
    """Hyper-parameters of one ZO step.

    Attributes:
        lr: learning rate (MeZO uses 1e-6 .. 1e-7 for large models).
        eps: perturbation scale (MeZO default 1e-3).
        weight_decay: decoupled weight decay coefficient for matrices.
    """

    lr: float = 1e-6
    eps: float = 1e-3
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.lr >= 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")


def apply_(p: torch.Tensor, seed: int, index: int, ops: Sequence[noise_gen.Op]) -> None:
    """Run ``ops`` (``noise.Perturb`` / ``noise.Update``) on parameter number ``index`` in place, in one
    pass that regenerates its z from ``seed``: bitwise ``perturb_`` / ``update_`` with
    ``noise(seed, index, p)``, one op after another (the module docstring), with no z held for the tensor.

    CPU: the fused kernel ``noise.apply_`` (on ``torch.get_num_threads()`` threads). CUDA: the fused
    Triton kernel ``noise_triton.apply_`` where Triton is installed, else (and for other dtypes or a
    non-contiguous tensor) ``apply_reference_``: one parameter's z is held while its ops run."""
    apply_all_([(p, seed, index, ops)])


def apply_reference_(p: torch.Tensor, seed: int, index: int, ops: Sequence[noise_gen.Op]) -> None:
    """``apply_`` unfused, the specification every fused kernel is tested against: z = ``noise(seed,
    index, p)`` held for the tensor, then ``perturb_`` / ``update_`` for each op (any device and dtype)."""
    z = noise(seed, index, p)
    for op in ops:
        if isinstance(op, noise_gen.Perturb):
            perturb_(p, z, op.scale)
        else:
            update_(p, z, op.projected_grad, op.lr, op.weight_decay)


def apply_all_(passes: Sequence[tuple[torch.Tensor, int, int, Sequence[noise_gen.Op]]]) -> None:
    """``apply_`` for every (p, seed, index, ops) of ``passes`` (one pass over a model): the CPU
    tensors in one call of ``noise.apply_all_``, so its threads share the whole pass, the others one by one."""
    on_cpu = [item[0].device.type == "cpu" and item[0].dtype in noise_gen.KERNEL_DTYPES for item in passes]
    noise_gen.apply_all_([item for item, cpu in zip(passes, on_cpu) if cpu])
    for (p, seed, index, ops), cpu in zip(passes, on_cpu):
        if cpu:
            continue
        if p.device.type == "cuda" and p.dtype in noise_gen.KERNEL_DTYPES and p.is_contiguous() and noise_triton.available():
            noise_triton.apply_(p, seed, index, ops)
        else:
            apply_reference_(p, seed, index, ops)


def _update(name: str, p: torch.Tensor, projected_grad: float, lr: float, weight_decay: float) -> noise_gen.Update:
    return noise_gen.Update(projected_grad, lr, weight_decay if decays(name, p) else 0.0)


def perturb_all_(params: Mapping[str, torch.Tensor], seed: int, scale: float) -> None:
    """p <- p + z * scale for every parameter (MeZO steps 1 and 2), each z regenerated from ``seed``:
    the worker's extra memory is one chunk per thread, never a copy of the weights (``apply_``)."""
    apply_all_([(p, seed, i, [noise_gen.Perturb(scale)]) for i, p in enumerate(params.values())])


def reset_and_update_all_(
    params: Mapping[str, torch.Tensor], seed: int, projected_grad: float, hyper: "ZOHyper"
) -> None:
    """MeZO steps 3 and 5 on every parameter in one pass each: p <- p + eps z (the reset), then the
    update (weight decay where ``decays``), z regenerated from ``seed`` once for both."""
    apply_all_([(p, seed, i, [noise_gen.Perturb(hyper.eps), _update(name, p, projected_grad, hyper.lr, hyper.weight_decay)])
                for i, (name, p) in enumerate(params.items())])


def replay_step_(
    params: Mapping[str, torch.Tensor],
    seed: int,
    projected_grad: float,
    lr: float,
    eps: float,
    weight_decay: float,
    first_index: int = 0,
) -> None:
    """Re-execute one logged ZO step on ``params`` (in place), bitwise as the worker executed it.

    One pass per parameter (``apply_``): z generated once per element, then +eps, -2 eps, +eps and the
    update in that order. ``first_index``: the model's index of ``params``' first tensor, when ``params``
    holds only a shard's contiguous range (``actors.shards``); z of position i is that of parameter
    ``first_index + i``.
    """
    apply_all_([(p, seed, first_index + i, [noise_gen.Perturb(eps), noise_gen.Perturb(-2 * eps), noise_gen.Perturb(eps),
                                             _update(name, p, projected_grad, lr, weight_decay)])
                for i, (name, p) in enumerate(params.items())])


def check_records(records: Iterable[StepRecord], run_seed: int, source: str, hyper: ZOHyper | None = None,
                  trajectory: int | None = None) -> None:
    """Refuse step log records that are not this run's: each record's ``seed`` must be
    ``step_seed(run_seed, step)``; with ``hyper``, its ``lr``, ``eps`` and ``weight_decay`` those of
    ``hyper``; with ``trajectory`` (``storage.steplog.trajectory_tag`` of the run id and trajectory hash,
    which covers the batch schedule), its trajectory tag that one. A record of another run (a log of
    another seed whose header was edited, records spliced in from another run's log, even of the same
    seed) has a valid checksum and the right step number, so neither the log's checksums nor its gap
    check see it; replaying it would build another run's state.

    Raises:
        storage.steplog.StepLogCorruptError: the first record that is not this run's (``source`` names the log).
    """
    if (foreign := first_foreign_record(records, run_seed, hyper, trajectory)) is not None:
        raise StepLogCorruptError(f"{source}: {foreign[1]}; the log cannot be replayed")


def first_foreign_record(records: Iterable[StepRecord], run_seed: int, hyper: ZOHyper | None = None,
                         trajectory: int | None = None) -> tuple[int, str] | None:
    """(step, why) of the first of ``records`` that is not this run's by ``check_records``' rule; None when all are."""
    for rec in records:
        if trajectory is not None and rec.trajectory != trajectory:
            return rec.step, (f"the record of step {rec.step} belongs to another run or trajectory (tag {rec.trajectory:016x}, "
                              f"expected {trajectory:016x}): a record of another run")
        want = (step_seed(run_seed, rec.step),) + ((hyper.lr, hyper.eps, hyper.weight_decay) if hyper else ())
        got = (rec.seed, rec.lr, rec.eps, rec.weight_decay)[:len(want)]
        if got != want:
            return rec.step, (f"the record of step {rec.step} is not this run's (seed, lr, eps, weight decay "
                              f"{got}, expected {want} for run seed {run_seed}): a record of another run")
    return None


def replay_records_(params: Mapping[str, torch.Tensor], records: Iterable[StepRecord]) -> int:
    """Re-execute logged steps on ``params`` (in place), oldest first, with ``replay_step_``.

    ``records``: ``storage.steplog.StepRecord`` values (their ``seed``, ``projected_grad``, ``lr``,
    ``eps`` and ``weight_decay`` are used), consecutive and starting at the step ``params`` is at.
    Returns the number of steps replayed.
    """
    n = 0
    for rec in records:
        replay_step_(params, rec.seed, rec.projected_grad, rec.lr, rec.eps, rec.weight_decay)
        n += 1
    return n
