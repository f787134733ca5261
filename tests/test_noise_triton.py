"""The Triton kernels (``training.noise_triton``) bit for bit against the CPU reference, without a GPU.

Triton's interpreter runs the kernels on CPU tensors with numpy's IEEE-754 arithmetic. It is chosen by
``TRITON_INTERPRET=1`` when the kernels are defined, so the kernels run in a subprocess with that
variable (this module run as a script), and this process never defines them; it computes the reference
(``zo.noise`` then ``zo.perturb_`` / ``zo.update_``, ``noise.gaussian_torch``) and compares sha256s.
What the interpreter cannot show, that the GPU code rounds every op as numpy does, a second subprocess
checks in the PTX of a compile for sm_90 (no GPU needed): no FMA, every float op with an explicit
round-to-nearest modifier (which ptxas never contracts), no flush-to-zero, no approximate op. The bits
on a GPU itself: ``scripts/device-check`` (c).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from raycheck.training import noise, noise_triton, zo
from raycheck.training.noise import Perturb, Update

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not noise_triton.available(),
                                reason="triton is not importable (`pip install -e '.[test]'` installs triton==3.9.0)")

SEED = zo.step_seed(0, 7)
EPS, G, LR, WD = 1e-3, -0.3712345678901234, 1e-3, 0.01
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

GAUSSIAN = {  # name: (seed, index, numel, block)
    "1": (SEED, 3, 1, 256),
    "5": (SEED, 3, 5, 256),
    "4099": (SEED, 3, 4099, 256),
    "100003": (SEED, 3, 100_003, 4096),
    "largest seed and index": ((1 << 64) - 1, (1 << 32) - 1, 7, 256),
}


def round_trip(eps: float, wd: float) -> list[noise.Op]:
    """The replay pass: +eps, -2 eps, +eps and the update."""
    return [Perturb(eps), Perturb(-2 * eps), Perturb(eps), Update(G, LR, wd)]


def apply_cases() -> dict[str, tuple[str, tuple[int, ...], float, list[noise.Op], int]]:
    """name: (dtype, shape, scale of the start values, ops, block). Lengths are not multiples of 4; the
    subnormal cases start and perturb below float32's (or float16's) smallest normal number."""
    cases = {}
    for dtype in DTYPES:
        cases[f"{dtype} +eps"] = (dtype, (4099,), 0.02, [Perturb(EPS)], 256)
        for wd in (0.0, WD):
            cases[f"{dtype} +eps, update wd={wd}"] = (dtype, (37, 111), 0.02, [Perturb(EPS), Update(G, LR, wd)], 256)
            cases[f"{dtype} round trip wd={wd}"] = (dtype, (4099,), 0.02, round_trip(EPS, wd), 256)
    for block in (16, 4096):
        cases[f"bfloat16 round trip block={block}"] = ("bfloat16", (4099,), 0.02, round_trip(EPS, WD), block)
    cases["float32 subnormal"] = ("float32", (1023,), 1e-39, round_trip(1e-39, WD), 256)
    cases["bfloat16 subnormal"] = ("bfloat16", (1023,), 1e-39, round_trip(1e-39, WD), 256)
    cases["float16 subnormal"] = ("float16", (1023,), 1e-5, round_trip(1e-6, WD), 256)
    return cases


def start(dtype: str, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """The parameter before the ops: scaled N(0, 1) values of another stream, in ``dtype``."""
    n = 1
    for s in shape:
        n *= s
    return (noise.gaussian(99, 0, n) * scale).view(shape).to(DTYPES[dtype])


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def run_script(mode: str, out: pathlib.Path, env: dict[str, str]) -> None:
    """This module as a script in a subprocess (``main``), with ``env`` added."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    proc = subprocess.run([sys.executable, __file__, mode, str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The Triton kernels' results of every case, under the interpreter."""
    tmp = tmp_path_factory.mktemp("triton")
    run_script("interpret", tmp / "out.pt", {"TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp / "cache")})
    return torch.load(tmp / "out.pt")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, str]:
    """PTX of the kernels compiled for sm_90 (name: text), and the refusal of a CPU tensor when compiled."""
    tmp = tmp_path_factory.mktemp("ptx")
    run_script("compile", tmp / "out.pt", {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp / "cache")})
    return torch.load(tmp / "out.pt")


@pytest.mark.parametrize("name", GAUSSIAN)
def test_gaussian_has_the_bits_of_the_torch_form(interpreted, name):
    seed, index, numel, _ = GAUSSIAN[name]
    want = noise.gaussian_torch(seed, index, numel)
    got = interpreted[f"gaussian {name}"]
    assert got.dtype == torch.float32 and got.shape == (numel,)
    assert sha(got) == sha(want)


@pytest.mark.parametrize("name", apply_cases())
def test_apply_has_the_bits_of_zo_ops(interpreted, name):
    dtype, shape, scale, ops, _ = apply_cases()[name]
    p = start(dtype, shape, scale)
    before = p.clone()
    zo.apply_reference_(p, SEED, 5, ops)
    got = interpreted[f"apply {name}"]
    assert got.dtype == p.dtype and got.shape == p.shape
    assert sha(got) == sha(p)
    assert not torch.equal(got, before)  # the ops did something


def test_the_subnormal_cases_reach_subnormals():
    """The subnormal cases are what their name says: most start values below the smallest normal."""
    for name, (dtype, shape, scale, _, _) in apply_cases().items():
        if "subnormal" in name:
            p = start(dtype, shape, scale).float().abs()
            assert ((p > 0) & (p < torch.finfo(DTYPES[dtype]).tiny)).float().mean() > 0.5, name


def test_the_ptx_rounds_every_float_op_on_its_own(compiled):
    float_op = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:add|sub|mul|div|sqrt|fma|mad|rcp|rsqrt|cvt)\.[\w.]*f(?:16|32|64)\w*)",
                          re.M)
    for name, ptx in compiled.items():
        if not name.startswith("ptx "):
            continue
        ops = set(float_op.findall(ptx))
        assert {"mul.rn.f64", "add.rn.f64", "div.rn.f64", "sqrt.rn.f64", "cvt.rn.f32.f64"} <= ops, (name, ops)
        for op in ops:
            assert not op.startswith(("fma", "mad", "rcp", "rsqrt")), (name, op)
            assert ".ftz" not in op and ".approx" not in op and ".full" not in op, (name, op)
            if not op.startswith("cvt") or ".f32.f64" in op or ".f16.f32" in op:
                assert ".rn." in op, (name, op)
        if name.startswith("ptx apply"):
            assert {"mul.rn.f32", "add.rn.f32", "sub.rn.f32"} <= ops, (name, ops)


def test_the_device_check_bit_section_runs_on_the_cpu_under_the_interpreter(interpreted):
    """``experiments.gpu_hotpath.check_bits`` (``scripts/device-check`` (c)) on 4099 elements passes (its
    timing part needs a GPU: the interpreter takes minutes for a model's tensors)."""
    assert interpreted["gpu_hotpath bits"] == []


def test_cpu_tensors_are_refused_outside_the_interpreter(compiled):
    assert "only under Triton's interpreter" in compiled["cpu refusal"]


def test_bad_arguments_are_refused_before_triton_is_touched():
    p = torch.zeros(8, 4)
    for call, message in [(lambda: noise_triton.apply_(p.t(), SEED, 0, [Perturb(EPS)]), "contiguous"),
                          (lambda: noise_triton.apply_(p.double(), SEED, 0, [Perturb(EPS)]), "float32, bfloat16"),
                          (lambda: noise_triton.apply_(p, SEED, 0, []), "ops is empty"),
                          (lambda: noise_triton.apply_(p, SEED, 1 << 32, [Perturb(EPS)]), "index"),
                          (lambda: noise_triton.gaussian(1 << 64, 0, 4, "cpu"), "seed")]:
        with pytest.raises(ValueError, match=message):
            call()


def test_noise_triton_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "from raycheck.training import noise_triton\n"
            "assert not noise_triton.available()\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def main(mode: str, out: str) -> None:
    """The subprocess: ``interpret``: every case's result; ``compile``: PTX for sm_90 and the CPU refusal."""
    results: dict[str, object] = {}
    if mode == "interpret":
        for name, (seed, index, numel, block) in GAUSSIAN.items():
            results[f"gaussian {name}"] = noise_triton.gaussian(seed, index, numel, "cpu", block=block)
        for name, (dtype, shape, scale, ops, block) in apply_cases().items():
            p = start(dtype, shape, scale)
            noise_triton.apply_(p, SEED, 5, ops, block=block)
            results[f"apply {name}"] = p
        from raycheck.experiments import gpu_hotpath

        results["gpu_hotpath bits"] = gpu_hotpath.check_bits("cpu", 4099)
    else:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from raycheck.training import triton_kernels as k

        def ptx(fn, signature, constexprs):
            src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]

        results["ptx gaussian"] = ptx(k._gaussian_kernel, {"OUT": "*fp32", "n": "i32", "seed": "i64", "index": "i32",
                                                            "BLOCK": "constexpr"}, {"BLOCK": 256})
        kinds = (k.PERTURB, k.PERTURB, k.PERTURB, k.UPDATE_DECAY)
        for dtype, code, pointer in [("float32", k.FLOAT32, "*fp32"), ("bfloat16", k.BFLOAT16, "*i16"),
                                     ("float16", k.FLOAT16, "*fp16")]:
            signature = {"P": pointer, "n": "i32", "seed": "i64", "index": "i32", "S": ("fp32",) * 12,
                         "KINDS": "constexpr", "DTYPE": "constexpr", "BLOCK": "constexpr"}
            results[f"ptx apply {dtype}"] = ptx(k._apply_kernel, signature, {"KINDS": kinds, "DTYPE": code, "BLOCK": 256})
        try:
            noise_triton.apply_(torch.zeros(8), SEED, 0, [Perturb(EPS)])
        except ValueError as e:
            results["cpu refusal"] = str(e)
    torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
