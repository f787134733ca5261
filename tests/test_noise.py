"""The portable perturbation generator (``training.noise``): known answers, pinned bits, the same bits
under other CPU kernels and thread counts, and replayers that refuse a log of another generator."""

import hashlib
import json
import math
import os
import re
import subprocess
import sys
from collections import OrderedDict

import numba
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from raycheck.actors.shadow import ShadowReplayer
from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.cli.main import app
from raycheck.orchestrator.prepare import prepare
from raycheck.storage.steplog import StepLogWriter, StepRecord
from raycheck.training import noise, zo
from raycheck.training.model import default_cache_dir, layout_sha256, parameter_layout
from raycheck.workers.recovery import from_storage
from raycheck.training.zo import GENERATOR, GeneratorMismatchError, check_generator, step_seed
from raycheck.training.zo import noise as zo_noise

# Random123 (D. E. Shaw Research), tests/kat_vectors at commit 9545ff6413f258be2f04c1d319d99aaef7521150,
# the three "philox4x32 10" lines: counter (4 words), key (2 words), expected output (4 words).
PHILOX4X32_10_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

PINNED_SEED, PINNED_INDEX = 0x0123456789ABCDEF, 5
PINNED_MILLION_SHA256 = "86794b77170d087ce629c177e1cee70ce98a27a0072435534449239e11fc550e"
"""sha256 of the float32 bytes of ``noise.gaussian(PINNED_SEED, PINNED_INDEX, 1_000_000)``."""


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def test_philox_integer_stage_matches_the_published_known_answers():
    ctr = np.array([c for c, _, _ in PHILOX4X32_10_KAT], dtype=np.uint32)
    for row, (c, key, expected) in enumerate(PHILOX4X32_10_KAT):
        assert tuple(int(w) for w in noise.philox(ctr[row:row + 1], key)[0]) == expected
        assert tuple(noise.philox_torch(torch.tensor(c, dtype=torch.int64), key).tolist()) == expected


def test_first_million_values_are_pinned_and_the_torch_op_reference_gives_the_same_bits_on_cpu():
    z = noise.gaussian(PINNED_SEED, PINNED_INDEX, 1_000_000)
    assert z.dtype == torch.float32 and z.shape == (1_000_000,)
    assert sha256(z) == PINNED_MILLION_SHA256
    assert sha256(noise.gaussian_torch(PINNED_SEED, PINNED_INDEX, 250_000)) == sha256(z[:250_000])
    # a prefix is the same stream; lengths that end inside a block included
    for n in (0, 1, 2, 3, 5, 4097):
        assert sha256(noise.gaussian(PINNED_SEED, PINNED_INDEX, n)) == sha256(z[:n])
        assert sha256(noise.gaussian_torch(PINNED_SEED, PINNED_INDEX, n)) == sha256(z[:n])


def test_values_are_box_muller_within_float32_rounding_and_standard_normal():
    n = 1_000_000
    z = noise.gaussian(PINNED_SEED, PINNED_INDEX, n).double()
    # Box-Muller with libm's log, sin and cos on the same words: the polynomials agree to float32 rounding
    b = np.arange(n // 4, dtype=np.uint64)
    ctr = np.stack([b & 0xFFFFFFFF, b >> 32, np.full_like(b, PINNED_INDEX), np.zeros_like(b)], axis=1).astype(np.uint32)
    w = noise.philox(ctr, noise.split_key(PINNED_SEED)).astype(np.float64)
    expected = np.empty((n // 4, 4))
    for h in (0, 2):
        r = np.sqrt(-2 * np.log((w[:, h] + 1) * 2.0**-32))
        theta = (np.mod(w[:, h + 1], 2**30) - 2**29 + 0.5) * (math.pi / 2**31) + np.floor(w[:, h + 1] / 2**30) * math.pi / 2
        expected[:, h], expected[:, h + 1] = r * np.cos(theta), r * np.sin(theta)
    assert np.abs(z.numpy() - expected.reshape(-1)).max() < 1e-6
    # the distribution: mean, variance and two-sided tail masses of N(0, 1)
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / n)
    for t, mass in ((1.0, 0.31731), (2.0, 0.04550), (3.0, 0.0026998)):
        assert abs((z.abs() > t).double().mean().item() - mass) < 5 * math.sqrt(mass / n)


def test_numba_kernels_have_no_fused_multiply_add():
    """fastmath off: the compiled float stage and the fused apply keep every * and + separately rounded
    (no FMA), in the vectorised code LLVM emits for them (``vmulpd``/``vmulps``, not only scalar ops)."""
    for name, args in (("_gaussian_numba", (1, 2, 3, np.empty(8, np.float32))),
                       ("_apply_numba", (1, 2, 3, np.zeros(8, np.uint32), 0, noise._program([noise.Perturb(1e-3),
                                         noise.Update(0.5, 1e-3, 0.01)])))):
        kernel = numba.njit(fastmath=False, error_model="numpy")(getattr(noise, name).py_func)  # uncached: code readable
        kernel(*args, 0, 2)
        asm = "\n".join(kernel.inspect_asm().values())
        assert re.search(r"\bv?mul[sp]d\b", asm) and re.search(r"\bv?add[sp]d\b", asm)  # the check reads real code
        assert re.search(r"\bvmulp[sd]\b", asm), name  # vectorised (the speed of issue 31)
        assert not re.search(r"\bv?f(n)?m(add|sub)", asm, re.I), name
    assert np.array_equal(noise.gaussian(0x200000001, 3, 8).numpy().view(np.uint32),
                          noise.gaussian_torch(0x200000001, 3, 8).numpy().view(np.uint32))


def test_bad_arguments_raise_one_clear_error():
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\^64\)"):
        noise.gaussian(-1, 0, 4)
    with pytest.raises(ValueError, match=r"parameter index must be in \[0, 2\^32\)"):
        noise.gaussian(1, 1 << 32, 4)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        noise.gaussian_torch(1, 0, -1)


def test_zo_noise_has_the_parameters_shape_and_dtype():
    like = torch.zeros(3, 7)
    z = zo_noise(77, 2, like)
    assert z.shape == (3, 7) and z.dtype == torch.float32
    assert sha256(z.reshape(-1)) == sha256(noise.gaussian(77, 2, 21))
    half = zo_noise(77, 2, like.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16 and torch.equal(half, z.to(torch.bfloat16))


# --------------------------------------------------------------- other CPU kernels and thread counts ---

_PROBE = r"""
import hashlib, json, os, sys
from collections import OrderedDict
import torch
torch.set_num_threads(int(sys.argv[1]))
from raycheck.training import zo
from raycheck.training.state import state_sha256

def five_steps(make_noise):
    # five MeZO steps: the fused kernels (zo.replay_step_) for the portable generator, the unfused
    # primitives over make_noise's held z for another
    params = OrderedDict((f"p{i}", make_noise(zo.step_seed(99, 0), i, torch.empty(shape)) * 0.02)
                         for i, shape in enumerate([(257, 33), (1000,), (3, 5, 7)]))
    for t in range(5):
        seed, g = zo.step_seed(0, t), (-1) ** t * 0.37
        if make_noise is zo.noise:
            zo.replay_step_(params, seed, g, 1e-3, 1e-3, 0.01)
            continue
        for i, p in enumerate(params.values()):
            z = make_noise(seed, i, p)
            for scale in (1e-3, -2e-3, 1e-3):
                zo.perturb_(p, z, scale)
            zo.update_(p, z, g, 1e-3, 0.01 if p.ndim >= 2 else 0.0)
    return state_sha256(params)

def randn(seed, index, like):  # the generator before the portable one
    gen = torch.Generator().manual_seed(zo.derive_seed(seed, index))
    return torch.randn(like.shape, generator=gen, dtype=like.dtype)

z = zo.noise(zo.step_seed(0, 7), 3, torch.empty(1_000_000))
old = randn(zo.step_seed(0, 7), 3, torch.empty(1_000_000))
print(json.dumps({
    "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
    "z": hashlib.sha256(z.numpy().tobytes()).hexdigest(), "replay": five_steps(zo.noise),
    "old_z": hashlib.sha256(old.numpy().tobytes()).hexdigest(), "old_replay": five_steps(randn),
    "bare": sorted(m for m in sys.modules if m.split(".")[0] in ("training", "storage", "policies", "job")),
}))
"""

_SETTINGS = {  # name: (ATEN_CPU_CAPABILITY or None for the machine's best, torch threads, numba's CPU target)
    "best-2-threads": (None, 2, None),
    "best-1-thread": (None, 1, None),
    "default-2-threads-generic-cpu": ("default", 2, "generic"),
}


@pytest.fixture(scope="module")
def probes() -> dict:
    """The probe's output under each of ``_SETTINGS``, each in its own process."""
    procs = {}
    for name, (capability, threads, numba_cpu) in _SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "NUMBA_CPU_NAME")}
        env.update({"ATEN_CPU_CAPABILITY": capability} if capability else {})
        env.update({"NUMBA_CPU_NAME": numba_cpu} if numba_cpu else {})
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
        procs[name] = subprocess.Popen([sys.executable, "-c", _PROBE, str(threads)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {err}"
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results


def test_same_bits_under_default_and_best_cpu_kernels_and_one_or_two_threads(probes):
    best, one, default = probes["best-2-threads"], probes["best-1-thread"], probes["default-2-threads-generic-cpu"]
    assert default["capability"] == "DEFAULT" and (best["threads"], one["threads"], default["threads"]) == (2, 1, 2)
    assert best["z"] == one["z"] == default["z"] == sha256(zo_noise(step_seed(0, 7), 3, torch.empty(1_000_000)))
    assert best["replay"] == one["replay"] == default["replay"]


def test_the_compiled_generator_loads_under_its_package_name_only(probes):
    """numba caches the compiled kernels next to ``training/noise.py`` and keys the cache by the file's
    path, time and size, not by the module's name: a cache written before the packages moved under
    ``raycheck.*`` loaded a second copy of the module as a bare ``training.noise`` (the repository root is
    on these processes' path; outside it the load fails). No probe may load a bare package."""
    assert {name: p["bare"] for name, p in probes.items()} == dict.fromkeys(probes, [])


def test_old_torch_randn_noise_differs_between_cpu_kernels(probes):
    """What the portable generator fixes: torch.randn's bits depend on the CPU kernel in use."""
    best, default = probes["best-2-threads"], probes["default-2-threads-generic-cpu"]
    if best["capability"] == "DEFAULT":
        pytest.skip("this CPU's best kernel level is the default one")
    assert best["old_z"] != default["old_z"]
    assert best["old_replay"] != default["old_replay"]
    assert best["old_z"] == probes["best-1-thread"]["old_z"]


# --------------------------------------------------------------- the step log names its generator -----

def _params() -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict(w=torch.zeros(4, 3), b=torch.zeros(3))


def _log(folder, **header) -> str:
    """A one-record step log in the new ``folder`` whose header has ``header`` and the layout of ``_params``."""
    params = _params()
    folder.mkdir()
    path = folder / "log"
    run = JobConfig(out_dir=str(folder), cache_dir=str(folder))  # JobConfig's default run: its records' trajectory tag
    writer = StepLogWriter.create(path, {"layout_sha256": layout_sha256(parameter_layout(params)), "run_id": run.run_id,
                                         "trajectory_sha256": run.trajectory_sha256(), **header})
    writer.append(StepRecord(step=0, seed=step_seed(0, 0), projected_grad=0.1, loss_plus=1.0, loss_minus=0.9, lr=1e-6,
                             eps=1e-3, weight_decay=0.0, batch_id=0))  # a record of JobConfig's default run
    writer.close()
    return str(path)


def test_replayers_refuse_a_log_of_another_generator_or_none(tmp_path):
    old = _log(tmp_path / "old", model="tiny")
    other = _log(tmp_path / "other", generator="torch-cpu-mt19937:randn:seed=blake2b64(step_seed,param_index)")
    ok = _log(tmp_path / "ok", generator=GENERATOR)
    assert GENERATOR == noise.GENERATOR and "philox4x32-10" in GENERATOR and GENERATOR.endswith(":v1")

    with pytest.raises(GeneratorMismatchError, match=re.escape(
            f"{old}: the step log names no generator (an old log, whose noise came from torch.randn); this replayer "
            f"generates z with {GENERATOR!r} and cannot replay it exactly. Replay it with the raycheck version that wrote it, "
            "or start a new run (new --out).")):
        ShadowReplayer(_params(), old)
    with pytest.raises(GeneratorMismatchError, match="written with generator 'torch-cpu-mt19937"):
        ShadowReplayer(_params(), other)
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(GeneratorMismatchError, match="names no generator"):
        from_storage(_params(), cfg, old, 1)
    params = _params()
    assert from_storage(params, cfg, ok, 1)["replayed_steps"] == 1 and params["w"].abs().sum() > 0
    shadow = ShadowReplayer(_params(), ok)
    assert shadow.catch_up() == 1 and torch.equal(shadow.params["w"], params["w"])
    check_generator({"generator": GENERATOR}, "here")  # the matching generator passes


def test_a_restore_before_any_logged_step_replays_nothing_when_no_copy_of_the_log_exists(tmp_path, monkeypatch):
    """log_end 0, no local log, no keeper, empty segments: the restore keeps the initial weights (it
    used to fail on the missing header)."""
    class NoKeeper:
        def __init__(self, *args) -> None:
            raise ValueError("no keeper registered")

    monkeypatch.setattr("raycheck.workers.recovery.RemoteKeeper", NoKeeper)
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), storage={"uri": f"memory://{tmp_path.name}"})
    params = _params()
    result = from_storage(params, cfg, None, 0)
    assert (result["source"], result["base_step"], result["replayed_steps"], result["log_source"]) == ("initial", 0, 0, "segments")
    assert params["w"].abs().sum().item() == 0.0

def test_resume_refuses_an_old_log_of_the_same_trajectory_with_one_error_line(tmp_path):
    cfg = JobConfig(out_dir=str(tmp_path), cache_dir=str(default_cache_dir()), model="tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    StepLogWriter.create(RunDir(tmp_path).step_log, {"trajectory_sha256": cfg.trajectory_sha256()}).close()
    with pytest.raises(GeneratorMismatchError, match="names no generator"):
        prepare(cfg, RunDir(tmp_path))
    result = CliRunner().invoke(app, ["run", "--resume", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "error: " in result.output and "names no generator (an old log" in result.output
    assert "Traceback" not in result.output and RunDir(tmp_path).step_log.exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_pass_over_many_tensors_cut_across_threads_has_the_reference_bits(dtype):
    """``noise.apply_all_`` cuts the blocks of all the pass's tensors into one share per thread, the cuts
    falling inside tensors and between them: every element still has the bits of the unfused ops."""
    shapes = [(300_001,), (5,), (70_000, 3), (1,), (99_999,)]
    start = [(noise.gaussian(11, i, math.prod(s)).view(s) * 0.02).to(dtype) for i, s in enumerate(shapes)]
    ops = [noise.Perturb(1e-3), noise.Perturb(-2e-3), noise.Perturb(1e-3), noise.Update(0.37, 1e-3, 0.01)]
    expected = [t.clone() for t in start]
    for i, t in enumerate(expected):
        zo.apply_reference_(t, 42, i, ops)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = [t.clone() for t in start]
            noise.apply_all_([(t, 42, i, ops) for i, t in enumerate(got)])
            assert noise._threads(sum((t.numel() + 3) // 4 for t in got)) == threads  # the cut is exercised
            assert [sha256(t.view(torch.uint8).reshape(-1)) for t in got] == [sha256(t.view(torch.uint8).reshape(-1)) for t in expected]
    finally:
        torch.set_num_threads(before)
