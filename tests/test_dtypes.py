"""``--dtype``: the worker's MeZO steps and every replay agree bitwise in float32, bfloat16 and float16
(the contract in ``training/zo.py``); a log, resume or snapshot of another dtype is refused."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from raycheck.actors.shadow import ShadowReplayer
from raycheck.experiments.dtype_residue import main as residue_main
from raycheck.experiments.dtype_residue import round_trip_residue, step_memory_bytes
from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.cli.main import app
from raycheck.orchestrator.prepare import prepare
from raycheck.cli.replay import LoggedRun, initial_params
from raycheck.storage.manifest import layout_of
from raycheck.storage.snapshots import NoSnapshotError, SnapshotStore
from raycheck.storage.steplog import StepLogWriter
from raycheck.training.model import default_cache_dir, layout_sha256, load_model, parameter_layout, trainable_parameters
from raycheck.workers.recovery import from_storage
from raycheck.training.state import copy_state, load_into, state_sha256
from conftest import zo_step_
from raycheck.training.zo import (DTYPES, GENERATOR, DtypeMismatchError, ZOHyper, noise, perturb_, replay_records_, step_seed,
                                  update_)

STEPS = 3


def tensor_hashes(params) -> dict[str, str]:
    """sha256 of every tensor's bytes (bfloat16 through its bits), by name."""
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in params.items()}


def worker_run(dtype: str, data, encoder, tmp_path) -> tuple["OrderedDict[str, torch.Tensor]", list]:
    """``STEPS`` MeZO steps of the tiny model in ``dtype`` by the worker's own step (``zo_step_``: z, the
    round trip, the two forward passes, the update); returns its parameters and the logged records."""
    cfg = JobConfig(out_dir=str(tmp_path / dtype), cache_dir=str(default_cache_dir()), model="tiny", dtype=dtype,
                    batch_size=4, weight_decay=0.01, zo={"lr": 1e-3, "eps": 1e-3})
    model = load_model("tiny", dtype=dtype)
    params = trainable_parameters(model)
    records = []
    hyper = ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay)
    for step in range(STEPS):
        zo_step_(params, model, encoder, data[0], cfg, step, 0, 1, hyper, fail=lambda: None,
                 commit=lambda record: records.append(record) or 0.0)
    return params, records


@pytest.fixture(scope="module")
def runs(data, encoder, tmp_path_factory) -> dict:
    """The worker's run in each dtype (one torch thread, as ``JobConfig.torch_threads``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {dtype: worker_run(dtype, data, encoder, tmp_path_factory.mktemp("runs")) for dtype in DTYPES}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_replay_equals_the_worker_bitwise_in_each_dtype_and_thread_count(runs, dtype):
    worker, records = runs[dtype]
    assert all(t.dtype == DTYPES[dtype] for t in worker.values())
    assert any(r.projected_grad != 0 for r in records)  # the updates moved the weights
    expected = tensor_hashes(worker)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            replayed = trainable_parameters(load_model("tiny", dtype=dtype))
            assert replay_records_(replayed, records) == STEPS
            assert tensor_hashes(replayed) == expected, f"{dtype}, {n} threads"
    finally:
        torch.set_num_threads(threads)
    skipped = trainable_parameters(load_model("tiny", dtype=dtype))  # a replayer that assumed the round trip cancels
    for rec in records:
        for i, (name, p) in enumerate(skipped.items()):
            update_(p, noise(rec.seed, i, p), rec.projected_grad, rec.lr, rec.weight_decay if p.ndim >= 2 else 0.0)
    assert tensor_hashes(skipped) != expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_round_trip_residue_is_not_zero_in_half_precision_and_larger_than_in_float32(dtype):
    half = trainable_parameters(load_model("tiny", dtype=dtype))
    full = trainable_parameters(load_model("tiny"))
    res, res32 = round_trip_residue(half, step_seed(0, 0), 1e-3), round_trip_residue(full, step_seed(0, 0), 1e-3)
    assert res["elements"] == res32["elements"] == 3_219_776
    assert res["changed"] > 0.3 * res["elements"]
    assert res["max_abs_change"] > 100 * res32["max_abs_change"] > 0
    assert step_memory_bytes(half)["parameter_bytes"] * 2 == step_memory_bytes(full)["parameter_bytes"] == 4 * 3_219_776


def test_residue_script_prints_a_row_per_dtype_and_arithmetic(capsys):
    rows = residue_main(["--models", "tiny"])
    assert [(r["dtype"], r["arithmetic"]) for r in rows] == [
        ("float32", "raycheck"), ("bfloat16", "raycheck"), ("bfloat16", "torch half ops"),
        ("float16", "raycheck"), ("float16", "torch half ops")]
    out = capsys.readouterr().out
    assert "| tiny | bfloat16 | raycheck | 3,219,776 |" in out and out.count("| 6.1 MiB |\n") == 4


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_strided_tensors_take_the_scalar_loop_and_give_the_same_bits(dtype):
    """A tensor of every other column is not contiguous, so torch runs its scalar (non-vectorised)
    loop for each op and conversion; the bits must equal those of the contiguous (vectorised) run."""
    torch.manual_seed(3)
    wide = (torch.randn(64, 2 * 129) * 0.05).to(DTYPES[dtype])
    strided, contiguous = wide[:, ::2], wide[:, ::2].contiguous()
    start = contiguous.clone()
    assert not strided.is_contiguous()
    z = noise(step_seed(5, 1), 0, contiguous)
    zs = torch.empty_like(wide)[:, ::2].copy_(z)
    for p, zz in ((strided, zs), (contiguous, z)):
        for scale in (1e-3, -2e-3, 1e-3):
            perturb_(p, zz, scale)
        update_(p, zz, 0.37, 1e-3, 0.01)
    assert torch.equal(strided.contiguous().view(torch.uint8), contiguous.view(torch.uint8))
    assert not torch.equal(contiguous.view(torch.uint8), start.view(torch.uint8))


def test_half_precision_snapshot_keeps_its_dtype_and_loads_only_into_that_dtype(runs, tmp_path):
    params = runs["bfloat16"][0]
    store = SnapshotStore(str(tmp_path / "store"))
    info = store.write(STEPS, copy_state(params))
    shard = next(iter(info.manifest["units"].values()))["path"]
    with safe_open(str(tmp_path / "store" / shard), framework="pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}
    restored = trainable_parameters(load_model("tiny", dtype="bfloat16"))
    _, state, _ = store.load_latest(layout=layout_of(restored))
    load_into(restored, state)
    assert tensor_hashes(restored) == tensor_hashes(params)
    full = trainable_parameters(load_model("tiny"))
    with pytest.raises(ValueError, match="float32"):  # a bf16 image never lands in float32 tensors
        load_into(full, state)
    with pytest.raises(NoSnapshotError, match=r"its layout .* differs from the model's .*: a snapshot of another dtype "
                                              r"\(bfloat16; the model is float32\)"):  # a float32 restore skips it
        store.load_latest(layout=layout_of(full))


def _log(path, dtype: str | None, params) -> str:
    header = {"model": "tiny", "layout": parameter_layout(params), "layout_sha256": layout_sha256(parameter_layout(params)),
              "generator": GENERATOR, "run_id": "r", "trajectory_sha256": "t"}
    StepLogWriter.create(path, header if dtype is None else {**header, "dtype": dtype}).close()
    return str(path)


def test_a_log_of_another_dtype_is_refused_by_every_replayer_and_resume(tmp_path):
    bf16 = OrderedDict(w=torch.zeros(4, 3, dtype=torch.bfloat16))
    fp32 = OrderedDict(w=torch.zeros(4, 3))
    old = _log(tmp_path / "old.log", None, fp32)  # before --dtype: a float32 run's
    with pytest.raises(DtypeMismatchError, match="held its parameters in float32; this one holds them in bfloat16.*--dtype float32"):
        ShadowReplayer(bf16, old)
    assert ShadowReplayer(fp32, old).step == 0
    half = _log(tmp_path / "bf16.log", "bfloat16", bf16)  # the header's dtype is read, not assumed
    with pytest.raises(DtypeMismatchError, match="held its parameters in bfloat16; this one holds them in float32.*--dtype bfloat16"):
        ShadowReplayer(fp32, half)
    assert ShadowReplayer(bf16, half).step == 0
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), dtype="bfloat16")
    with pytest.raises(DtypeMismatchError, match="float32"):
        from_storage(bf16, cfg, old, 0)

    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    saved = JobConfig(out_dir=str(run_dir), cache_dir=str(default_cache_dir()), model="tiny")
    (run_dir / "config.json").write_text(json.dumps(saved.to_dict()))
    _log(RunDir(run_dir).step_log, "float32", fp32)
    with pytest.raises(DtypeMismatchError, match="float32.*bfloat16"):
        prepare(saved.replace(dtype="bfloat16"), RunDir(run_dir))
    result = CliRunner().invoke(app, ["run", "--resume", "--dtype", "float16", "--out", str(run_dir)])
    assert result.exit_code == 2 and "error: --resume --dtype float16: the run holds its parameters in float32" in result.output


def test_replay_cli_loads_the_initial_weights_in_the_logs_dtype(tmp_path):
    params = trainable_parameters(load_model("tiny", dtype="float16"))
    path = _log(tmp_path / "log", "float16", params)
    run = LoggedRun({"model": "tiny", "dtype": "float16", "layout_sha256": layout_sha256(parameter_layout(params)),
                     "generator": GENERATOR}, [], path, None)
    assert {t.dtype for t in initial_params(run, default_cache_dir()).values()} == {torch.float16}


def test_config_refuses_an_unknown_dtype_and_a_half_dtype_for_first_order(tmp_path):
    base = dict(out_dir=str(tmp_path), cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="dtype 'float64': choose one of float32, bfloat16, float16"):
        JobConfig(**base, dtype="float64")
    with pytest.raises(ValueError, match="dtype bfloat16 is for the ZO path .*algo fo"):
        JobConfig(**base, algo="fo", dtype="bfloat16")
    fp32 = JobConfig(**base)
    assert JobConfig(**base, dtype="float32").trajectory_sha256() == fp32.trajectory_sha256()
    assert len({JobConfig(**base, dtype=d).trajectory_sha256() for d in DTYPES}) == 3
    result = CliRunner().invoke(app, ["run", "--algo", "fo", "--dtype", "float16", "--out", str(tmp_path / "fo")])
    assert result.exit_code == 2 and "error: --dtype float16 is for the ZO path" in result.output


WORKER_PINS = {
    "AVX2": {
        "float32": "a5fa8e65e0e8e3ef55c202a358601ea05a599fa5aabd3291a627ed7f984b9930",
        "bfloat16": "22caea21c82121d231049d42ad34d51127177fdf35168f9dcf1ac1d64849c7e6",
        "float16": "38ee4bead2066e03d3d4546dba2392cb9b21da8c6897676b513f9c87f0f926eb",
    },
    "AVX512": {
        "float32": "09775b9a1862c891870930da81610e8f9062911652198b4bcbf40277904a3c1c",
        "bfloat16": "021f0ded912c163259031b5a5b4d4970d4497b502e643924813dcb5fe7aba7e4",
        "float16": ("6a7429350ea516c16d363076e69578a8876a569760f23afc95770b9015b1d6b4",  # Intel, 2026-12-05
                    "2fe62951f5ea3fa96cf966cc2d9a58e028a1c53c07e58f9d320d7233bc86a8ad"),  # AMD EPYC (AVX-512 BF16, no FP16), 2026-12-06
    },
}
"""state_sha256 of the worker's parameters after ``STEPS`` MeZO steps of the tiny model, by the CPU capability
torch dispatches to (``torch.backends.cpu.get_cpu_capability()``): the forward pass's matmul kernels, and so the
projected gradients, differ in their last bits between AVX2 and AVX-512 machines (the replay does not:
``tests/test_pinned_trajectories.py`` pins it on any CPU). The AVX2 pins were written by the code of main 71c50b6
(issue 31's pinned trajectories), the AVX-512 ones by the same trajectory on an AVX-512 machine (2026-12-05). Within
one capability float16's half-precision kernels still differ between CPU families (an Intel and an AMD EPYC AVX-512
machine give two hashes): such a pin is the tuple of the hashes recorded, each on the machine named beside it."""


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_worker_step_reproduces_the_pinned_trajectory(runs, dtype):
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in WORKER_PINS:
        pytest.skip(f"no worker pins for CPU capability {capability} (pinned: {', '.join(WORKER_PINS)}): record them from this test's hashes")
    pins = WORKER_PINS[capability][dtype]
    assert state_sha256(runs[dtype][0]) in (pins if isinstance(pins, tuple) else (pins,))
