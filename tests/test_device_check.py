"""The GPU path as far as a CPU-only machine can check it: ``--device``, ``--shadow-env``, and
``scripts/device-check`` saying that there is no GPU. GPU exactness itself is checked by the script on
a machine with one (docs/exactness.md)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from raycheck.job.config import JobConfig
from raycheck.cli.main import app
from raycheck.orchestrator.cluster import shadow_actor_options
from raycheck.storage.backend import storage_env

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "device-check"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")


def device_check(python: str) -> subprocess.CompletedProcess:
    """``scripts/device-check`` run with ``PYTHON=python``; it must refuse with exit 2, one line on stderr."""
    proc = subprocess.run([str(SCRIPT)], env={**os.environ, "PYTHON": python}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    return proc


def test_device_check_says_there_is_no_gpu_and_exits_2():
    assert device_check(sys.executable).stderr == (f"device-check: no CUDA device visible to {sys.executable} "
                                                   "(torch.cuda.is_available() is false): nothing checked\n")


def test_device_check_names_a_missing_interpreter(tmp_path):
    assert device_check(str(tmp_path / "python")).stderr == (
        f"device-check: no python interpreter at {tmp_path / 'python'} (set PYTHON to one with a CUDA build of torch): "
        "nothing checked\n")


def test_device_check_shows_why_torch_is_not_importable(tmp_path):
    """An interpreter without its site-packages (``-S``) is one without torch."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    assert device_check(str(python)).stderr == (
        f"device-check: torch is not importable by {python} (ModuleNotFoundError: No module named 'torch'): "
        "nothing checked\n")


def test_device_cuda_is_refused_with_one_line_before_anything_is_touched(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "2", "--device", "cuda", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: --device cuda: torch.cuda.is_available() is false on this machine")
    assert result.output.count("\n") == 1 and not out.exists()


def test_device_and_shadow_env_are_validated_and_only_a_gpu_device_changes_the_trajectory(tmp_path):
    base = dict(out_dir=str(tmp_path), cache_dir=str(tmp_path))
    cpu, cuda = JobConfig(**base), JobConfig(**base, device="cuda")
    assert cpu.trajectory_sha256() == JobConfig(**base, placement={"shadow_env": {"X": "1"}}).trajectory_sha256()
    assert cuda.trajectory_sha256() != cpu.trajectory_sha256()
    assert JobConfig.from_dict(cuda.to_dict()) == cuda
    assert shadow_actor_options(cpu) == {"runtime_env": {"env_vars": storage_env()}} and storage_env()  # conftest sets keys
    assert shadow_actor_options(JobConfig(**base, placement={"shadow_env": {"ATEN_CPU_CAPABILITY": "default"}})) == {
        "runtime_env": {"env_vars": {**storage_env(), "ATEN_CPU_CAPABILITY": "default"}}}
    for bad, message in [(dict(device="tpu"), "device 'tpu': choose one of cpu, cuda"),
                         (dict(device="cuda", algo="fo"), "device cuda runs the ZO worker only"),
                         (dict(placement={"shadow_env": {"A=B": "1"}}), "placement.shadow_env 'A=B'='1': expected NAME=VALUE"),
                         (dict(placement={"shadow_env": {"A": "b"}}, strategy="log-only"), "^placement.shadow_env is set, but strategy log-only has no shadow$")]:
        with pytest.raises(ValueError, match=message):
            JobConfig(**base, **bad)
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--shadow-env", "NOVALUE", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "--shadow-env 'NOVALUE': expected KEY=VALUE" in result.output
