"""Downstream of a model folder (GPT-2, random weights, not Llama), without Ray: the step log's header,
unit-sharded snapshots, the shadow's replay, ``raycheck replay`` (with ``--export-hf``), ``raycheck
merge --export-hf --model FOLDER``, and a replay refused once the folder's weights changed.

The run is made by the worker's own step (``conftest.zo_step_``: ``workers.zo_session.mezo_step_`` over ``workers.worker.task_batch``) on a JSONL classification file
loaded as the driver loads it (``training.assets.read_assets``)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from raycheck.actors.shadow import ShadowReplayer
from raycheck.job.run_dir import RunDir
from raycheck.job.stores import snapshot_store
from raycheck.orchestrator.api import job_config
from raycheck.cli.main import app
from raycheck.orchestrator.prepare import prepare
from raycheck.storage.steplog import StepLogWriter, read_header
from test_own_model_data import gpt2_folder, reviews, write_rows
from raycheck.training.assets import read_assets
from raycheck.training.data import make_encoder
from raycheck.training.model import load_model, load_tokenizer, trainable_parameters
from raycheck.training.state import copy_state, state_sha256
from conftest import zo_step_
from raycheck.workers.zo_session import timed_append
from raycheck.training.zo import ZOHyper

STEPS, SNAPSHOT_STEP = 4, 2


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(run directory, model folder, state sha256 after each step 0..STEPS)."""
    root = tmp_path_factory.mktemp("gpt2run")
    folder = gpt2_folder(root / "my-gpt2")
    data = write_rows(root / "reviews.jsonl", reviews(20))
    cfg, assets = read_assets(job_config(root / "run", model=str(folder), data={"path": str(data)}, steps=STEPS, batch_size=4,
                                         run_id="gpt2", zo={"lr": 1e-3}))
    pathlib.Path(cfg.out_dir).mkdir()
    prepare(cfg, RunDir(pathlib.Path(cfg.out_dir)))
    model = load_model(cfg.model, cfg.cache_dir, assets.model)
    encoder = make_encoder(cfg, load_tokenizer(cfg.cache_dir, assets.model))
    params = trainable_parameters(model)
    hashes = {0: state_sha256(params)}
    writer = StepLogWriter.open(RunDir(pathlib.Path(cfg.out_dir)).step_log)
    for step in range(STEPS):
        zo_step_(params, model, encoder, assets.data[0], cfg, step, 0, 1, ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps),
                 fail=lambda: None, commit=timed_append(writer))
        hashes[step + 1] = state_sha256(params)
        if step + 1 == SNAPSHOT_STEP:
            snapshot_store(cfg).write(SNAPSHOT_STEP, copy_state(params))
    writer.close()
    assert len(set(hashes.values())) == STEPS + 1
    return pathlib.Path(cfg.out_dir), folder, hashes, cfg


def test_header_snapshot_units_and_the_shadow_follow_the_gpt2_layout(made):
    run, folder, hashes, cfg = made
    header = read_header(RunDir(run).step_log)
    assert header["model"] == str(folder) and header["model_sha256"] == cfg.model_sha256
    assert header["units_recognised"] is True and header["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    info = snapshot_store(cfg).list()[-1]
    shards = sorted(p.name for p in (run / "snapshots" / info.folder).iterdir() if p.suffix == ".safetensors")
    assert shards == ["embed.safetensors", "layer.000.safetensors", "layer.001.safetensors", "norm.safetensors"]
    params = trainable_parameters(load_model(str(folder)))
    shadow = ShadowReplayer(params, RunDir(run).step_log)
    assert shadow.catch_up() == STEPS and state_sha256(params) == hashes[STEPS]


def test_replay_export_and_merge_export_load_as_the_same_gpt2(made, tmp_path):
    from transformers import AutoModelForCausalLM

    run, folder, hashes, cfg = made
    result = CliRunner().invoke(app, ["replay", str(run), "--step", "3", "--export-hf", str(tmp_path / "step3")])
    assert result.exit_code == 0, result.output
    assert "base snapshot of step 2" in result.output and f"state_sha256 {hashes[3]}\n" in result.output
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "step3")
    assert state_sha256({n: t.detach().numpy() for n, t in trainable_parameters(exported).items()}) == hashes[3]

    result = CliRunner().invoke(app, ["merge", "--source", f"A={run / 'snapshots'}", "--take", "0-1:A", "--take", "embed,norm:A",
                                      "--out", str(tmp_path / "merged"), "--export-hf", str(tmp_path / "merged-hf"),
                                      "--model", str(folder)])
    assert result.exit_code == 0, result.output
    weights = load_file(str(tmp_path / "merged-hf" / "model.safetensors"))
    snapshot = snapshot_store(cfg).load(snapshot_store(cfg).list()[-1])
    assert set(weights) == set(snapshot) and all(np.array_equal(weights[n], snapshot[n]) for n in snapshot)


def test_replay_refuses_a_model_folder_whose_weights_changed(made, tmp_path):
    run, folder, _, _ = made
    changed = gpt2_folder(tmp_path / "changed", seed=7)
    original = (folder / "model.safetensors").read_bytes()
    try:
        (folder / "model.safetensors").write_bytes((changed / "model.safetensors").read_bytes())
        result = CliRunner().invoke(app, ["replay", str(run), "--step", "1"])
    finally:
        (folder / "model.safetensors").write_bytes(original)
    assert result.exit_code == 2, result.output
    assert f"model {folder} has changed since the run (model_sha256 " in result.output
    assert "replay with the run's original model files" in result.output


def test_the_experiment_runs_every_strategy_on_a_model_folder_and_refuses_a_missing_one(tmp_path, monkeypatch):
    """``raycheck experiment --model FOLDER``: the preset's runs take the folder (the same controller as
    ``raycheck run``, tested above and in ``test_own_model_ray.py``); a model that is not here: exit 2."""
    import dataclasses

    import raycheck.experiments.harness as harness
    import raycheck.orchestrator.cluster as cluster

    class Started(Exception):
        """Stands in for the experiment's runs: this test checks what they are given."""

    given = {}

    def run_experiment(preset, out, cache_dir, strategies, echo, failure_kind, durability):
        given.update(preset=preset, failure_kind=failure_kind, durability=durability)
        raise Started

    monkeypatch.setattr(harness, "run_experiment", run_experiment)
    monkeypatch.setattr(cluster, "connect", lambda *args, **kwargs: True)
    folder = gpt2_folder(tmp_path / "gpt2")
    started = CliRunner().invoke(app, ["experiment", "--quick", "--model", str(folder), "--out", str(tmp_path / "exp")])
    assert isinstance(started.exception, Started), started.output
    assert given["preset"] == dataclasses.replace(harness.PRESETS["quick"], model=str(folder))
    assert given["failure_kind"] == "exit" and given["durability"] == "node"
    raised = CliRunner().invoke(app, ["experiment", "--quick", "--failure-kind", "raise", "--out", str(tmp_path / "exp")])
    assert isinstance(raised.exception, Started) and given["failure_kind"] == "raise", raised.output
    missing = CliRunner().invoke(app, ["experiment", "--quick", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "x")])
    assert missing.exit_code == 2 and missing.output.startswith("error: --model: "), missing.output
    assert not (tmp_path / "x").exists()
