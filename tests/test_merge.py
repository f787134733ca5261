"""``raycheck merge``: composite snapshots from units of several snapshots, and the Hugging Face export."""

from __future__ import annotations

import hashlib
import json
import uuid

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from orchestrator.merge_cli import merge as merge_command
from storage.backend import Storage
from storage.merge import (
    MergeError,
    Source,
    Take,
    describe_units,
    export_hf,
    merge_snapshots,
    parse_source,
    parse_take,
)
from storage.snapshots import SnapshotCorruptError, SnapshotStore
from storage.units import group_by_unit, parameter_of, unit_of
from training.state import state_sha256


def tiny_state(perturb_seed: int | None = None) -> dict[str, np.ndarray]:
    """The tiny model's parameters, with Adam-like optimizer state for every layer and the norm;
    perturbed by a seeded noise when ``perturb_seed`` is given."""
    from training.model import load_model, trainable_parameters

    params = {n: t.numpy().copy() for n, t in trainable_parameters(load_model("tiny")).items()}
    rng = np.random.default_rng(perturb_seed)
    state: dict[str, np.ndarray] = {}
    for name, value in params.items():
        if perturb_seed is not None:
            value = value + rng.standard_normal(value.shape).astype(np.float32) * np.float32(1e-2)
        state[name] = value
        if not name.startswith("model.embed_tokens."):
            state[f"optim.exp_avg.{name}"] = rng.standard_normal(value.shape).astype(np.float32)
    return state


def small_state(seed: int, layers: int = 4, dtype=np.float32, up_shape=(4, 4)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {"model.embed_tokens.weight": rng.standard_normal((10, 4)).astype(dtype)}
    for i in range(layers):
        name = f"model.layers.{i}.mlp.up_proj.weight"
        state[name] = rng.standard_normal(up_shape).astype(dtype)
        state[f"optim.exp_avg.{name}"] = rng.standard_normal(up_shape).astype(dtype)
    state["model.norm.weight"] = rng.standard_normal(4).astype(dtype)
    return state


def unit_sha256(state, unit: str) -> str:
    return state_sha256({n: a for n, a in state.items() if unit_of(n) == unit})


def memory_store() -> SnapshotStore:
    return SnapshotStore(Storage(f"memory://raycheck-merge-{uuid.uuid4().hex}"))


@pytest.fixture(scope="module")
def tiny_stores(tmp_path_factory):
    """Two runs of the tiny model with different weights: A at step 10, B at steps 20 and 30."""
    root = tmp_path_factory.mktemp("merge")
    a, b = SnapshotStore(str(root / "A" / "snapshots")), SnapshotStore(str(root / "B"))
    states = {"A": tiny_state(), "B20": tiny_state(perturb_seed=20), "B30": tiny_state(perturb_seed=30)}
    a.write(10, states["A"])
    b.write(20, states["B20"])
    b.write(30, states["B30"])
    return root, a, b, states


def test_optimizer_state_belongs_to_its_parameters_unit():
    assert unit_of("optim.exp_avg.model.layers.7.mlp.up_proj.weight") == "layer.007"
    assert unit_of("optim.exp_avg_sq.model.embed_tokens.weight") == "embed"
    assert unit_of("optim.exp_avg.model.norm.weight") == "norm"
    assert unit_of("optim.exp_avg.lm_head.weight") == "lm_head"
    assert parameter_of("model.layers.0.mlp.up_proj.weight") is None and parameter_of("optim.step") is None
    assert unit_of("model.layers.12.self_attn.q_proj.weight") == "layer.012"  # parameter names unchanged
    assert unit_of("some.module.weight") == "some.module"
    groups = group_by_unit(small_state(0, layers=2))
    assert groups["layer.001"] == ["model.layers.1.mlp.up_proj.weight", "optim.exp_avg.model.layers.1.mlp.up_proj.weight"]


def test_merge_takes_every_unit_bitwise_from_its_source(tiny_stores, tmp_path):
    _, a, b, states = tiny_stores
    out = SnapshotStore(str(tmp_path / "merged"))
    takes = [parse_take("0:A"), parse_take("1:B"), parse_take("embed:A"), parse_take("norm:B")]
    result = merge_snapshots([Source("A", a), Source("B", b, step=20)], takes, out)
    expected = {"embed": ("A", 10), "layer.000": ("A", 10), "layer.001": ("B20", 20), "norm": ("B20", 20)}
    info = out.list()[-1]
    assert info.step == 20 == result.info.step
    assert {u: s["step"] for u, s in info.manifest["units"].items()} == {u: step for u, (_, step) in expected.items()}
    assert result.unit_sources == {"embed": "A", "layer.000": "A", "layer.001": "B", "norm": "B"}
    merged = out.load(info)
    assert list(merged) == list(states["A"])  # the reference's canonical order, optimizer state included
    sources = {"A": a.list()[-1], "B20": b.list()[0]}
    for unit, (key, _) in expected.items():
        assert unit_sha256(merged, unit) == unit_sha256(states[key], unit), unit
        assert info.manifest["units"][unit]["sha256"] == sources[key].manifest["units"][unit]["sha256"], unit
    assert unit_sha256(merged, "layer.001") != unit_sha256(states["A"], "layer.001")  # really from B
    assert info.manifest["config"]["merge"]["units"] == result.unit_sources


def test_newest_snapshot_is_the_default_step(tiny_stores, tmp_path):
    _, a, b, states = tiny_stores
    out = SnapshotStore(str(tmp_path / "merged"))
    result = merge_snapshots([Source("B", b), Source("A", a)], [parse_take("0-1,embed,norm:B")], out)
    assert result.unit_steps == dict.fromkeys(["embed", "layer.000", "layer.001", "norm"], 30)
    assert state_sha256(out.load_latest().state) == state_sha256(states["B30"])


def test_export_hf_loads_with_transformers_and_holds_the_merged_weights(tiny_stores, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    _, a, b, _ = tiny_stores
    out = SnapshotStore(str(tmp_path / "merged"))
    merge_snapshots([Source("A", a), Source("B", b, step=20)], [parse_take("0,norm:A"), parse_take("1,embed:B")], out)
    merged = out.load_latest().state
    folder = export_hf(str(tmp_path / "merged"), tmp_path / "hf", "tiny")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    loaded = {n: t.detach().numpy() for n, t in model.state_dict().items()}
    params = {n: a for n, a in merged.items() if parameter_of(n) is None}
    for name, value in params.items():
        assert np.array_equal(loaded[name], value), name
    assert np.array_equal(loaded["lm_head.weight"], params["model.embed_tokens.weight"])  # tied
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(params)  # parameters only, no optimizer state, no lm_head copy


def test_export_hf_rejects_a_snapshot_of_another_model(tmp_path):
    store = memory_store()
    store.write(1, small_state(0))
    with pytest.raises(ValueError, match="does not match model tiny"):
        export_hf(store, tmp_path / "hf", "tiny")


def test_merge_round_trip_on_every_backend(storage):
    def sub(name: str) -> SnapshotStore:
        return SnapshotStore(Storage(storage.url(name), **storage.options))

    a, b, out = sub("A"), sub("B"), sub("out")
    a.write(5, small_state(5))
    b.write(8, small_state(8), unit_steps={"layer.002": 3})  # itself composite: unit steps carry over
    takes = [parse_take("0-1,embed:A"), parse_take("2-3,norm:B")]
    result = merge_snapshots([Source("A", a), Source("B", b)], takes, out)
    assert result.unit_steps == {"embed": 5, "layer.000": 5, "layer.001": 5, "layer.002": 3, "layer.003": 8, "norm": 8}
    assert result.info.step == 8
    reread = SnapshotStore(Storage(storage.url("out"), **storage.options))
    info = reread.list()[-1]
    assert reread.verify(info) == []
    merged = reread.load(info)
    for unit, name in result.unit_sources.items():
        source = small_state(5 if name == "A" else 8)
        assert unit_sha256(merged, unit) == unit_sha256(source, unit), unit
    assert {u: s["step"] for u, s in info.manifest["units"].items()} == result.unit_steps


# -- errors ---------------------------------------------------------------------------------------
@pytest.fixture()
def small_sources():
    a, b = memory_store(), memory_store()
    a.write(5, small_state(5))
    b.write(8, small_state(8))
    return [Source("A", a), Source("B", b)]


def takes(*specs: str) -> list[Take]:
    return [parse_take(s) for s in specs]


@pytest.mark.parametrize("specs, expected", [
    (("0-1,embed:A", "2,norm:B"), r"unit\(s\) layer.003 of the reference layout \(source A \(step 5\)\) are not taken"),
    (("0-3,embed:A", "3,norm:B"), r"unit layer.003 is taken twice: from source A \(--take '0-3,embed:A'\) and from source B"),
    (("0-3,embed:A", "norm:C"), r"unknown source 'C' \(sources: A, B\)"),
    (("0-3,embed,norm:A", "lm_head:B"), r"unit lm_head \(--take 'lm_head:B'\) is not a unit of the reference layout, "
                                        r"source A \(step 5\); its units: embed, layer.000-003, norm"),
    (("0-4,embed,norm:A",), r"unit layer.004 .* not a unit of the reference"),
])
def test_plan_errors_name_the_unit_and_sources(small_sources, specs, expected):
    out = memory_store()
    with pytest.raises(MergeError, match=expected):
        merge_snapshots(small_sources, takes(*specs), out)
    assert out.list() == []  # nothing written


def test_every_problem_is_reported_at_once(small_sources):
    with pytest.raises(MergeError) as info:
        merge_snapshots(small_sources, takes("0-1:A", "1:B", "norm:Z"), memory_store())
    message = str(info.value)
    assert "layer.001 is taken twice" in message and "unknown source 'Z'" in message
    assert "layer.002-003" in message and "embed" in message


def test_a_step_that_does_not_exist(small_sources):
    sources = [small_sources[0], Source("B", small_sources[1].store, step=7)]
    with pytest.raises(MergeError, match=r"source B \(memory://.*\): no committed snapshot at step 7; committed steps: \[8\]"):
        merge_snapshots(sources, takes("0-3,embed:A", "norm:B"), memory_store())
    with pytest.raises(MergeError, match=r"source E .*: no committed snapshot"):
        merge_snapshots([*small_sources, Source("E", memory_store())], takes("0-3,embed,norm:A"), memory_store())


@pytest.mark.parametrize("other, expected", [
    (small_state(9, up_shape=(4, 8)), r"model.layers.1.mlp.up_proj.weight is <f4 \[4, 8\], the reference has <f4 \[4, 4\]"),
    (small_state(9, dtype=np.float16), r"model.layers.1.mlp.up_proj.weight is <f2 \[4, 4\], the reference has <f4 \[4, 4\]"),
    ({k: v for k, v in small_state(9).items() if not k.startswith("optim.")}, r"missing tensors \['optim.exp_avg"),
])
def test_layout_mismatch_names_unit_and_sources(small_sources, other, expected):
    c = memory_store()
    c.write(9, other)
    with pytest.raises(MergeError, match=r"unit layer.001: source C \(step 9\) does not match the reference layout of "
                                         r"source A \(step 5\): " + expected):
        merge_snapshots([*small_sources, Source("C", c)], takes("0,2-3,embed,norm:A", "1:C"), memory_store())


def test_a_source_without_the_unit(small_sources):
    c = memory_store()
    c.write(9, small_state(9, layers=1))
    with pytest.raises(MergeError, match=r"unit layer.002: source C \(step 9\) has no such unit"):
        merge_snapshots([*small_sources, Source("C", c)], takes("0-1,3,embed,norm:A", "2:C"), memory_store())


def test_corrupt_shard_is_refused(small_sources):
    b = small_sources[1].store
    spec = b.list()[-1].manifest["units"]["norm"]
    b.storage.put(spec["path"], b.storage.get(spec["path"])[:-1])
    with pytest.raises(SnapshotCorruptError, match="unit norm"):
        merge_snapshots(small_sources, takes("0-3,embed:A", "norm:B"), memory_store())


def test_output_must_be_empty_and_names_unique(small_sources):
    with pytest.raises(MergeError, match="already holds 1 committed snapshot"):
        merge_snapshots(small_sources, takes("0-3,embed,norm:A"), small_sources[1].store)
    with pytest.raises(MergeError, match="source name.* A given more than once"):
        merge_snapshots([small_sources[0], small_sources[0]], takes("0-3,embed,norm:A"), memory_store())


def test_parsing():
    assert parse_source("A=runs/x") == ("A", "runs/x", None)
    assert parse_source("B=s3://bucket/p@120") == ("B", "s3://bucket/p", 120)
    assert parse_source("C=/data/a@b") == ("C", "/data/a@b", None)
    assert parse_take("0-2,7,embed,layer.009:B") == Take(
        ("layer.000", "layer.001", "layer.002", "layer.007", "embed", "layer.009"), "B", "0-2,7,embed,layer.009:B")
    for bad in ("A", "=x", "A:B=x"):
        with pytest.raises(MergeError, match="--source"):
            parse_source(bad)
    for bad in ("0-3", ":A", "0-3:", "3-1:A", "0,,1:A"):
        with pytest.raises(MergeError, match="--take"):
            parse_take(bad)
    assert describe_units(["norm", "layer.002", "embed", "layer.000", "layer.001", "layer.005"]) == \
        "embed, layer.000-002, layer.005, norm"


# -- the command ----------------------------------------------------------------------------------
def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(merge_command)
    return app


def test_merge_command_with_a_run_directory_a_step_and_export(tiny_stores, tmp_path):
    root, _, _, states = tiny_stores
    args = ["--source", f"A={root / 'A'}", "--source", f"B={root / 'B'}@20", "--take", "0:A", "--take", "1,embed,norm:B",
            "--out", str(tmp_path / "merged"), "--export-hf", str(tmp_path / "hf"), "--model", "tiny"]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    assert "layer.001    <- B @ step 20" in result.output and "committed step 20" in result.output
    info = SnapshotStore(str(tmp_path / "merged")).list()[-1]
    assert {u: s["step"] for u, s in info.manifest["units"].items()} == {"embed": 20, "layer.000": 10, "layer.001": 20, "norm": 20}
    weights = (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert hashlib.sha256(weights).hexdigest() and json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 2


def test_merge_command_errors_exit_2_with_the_message(tiny_stores, tmp_path):
    root, _, _, _ = tiny_stores
    args = ["--source", f"A={root / 'A'}", "--source", f"B={root / 'B'}@99", "--take", "0-1,embed,norm:A",
            "--out", str(tmp_path / "merged")]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 2 and "no committed snapshot at step 99; committed steps: [20, 30]" in result.output
    result = CliRunner().invoke(cli(), [*args[:2], "--take", "0-1:A", "--out", str(tmp_path / "m2")])
    assert result.exit_code == 2 and "embed, norm of the reference layout" in result.output
    result = CliRunner().invoke(cli(), [*args[:2], "--take", "0-1,embed,norm:A", "--out", str(tmp_path / "m3"),
                                        "--export-hf", str(tmp_path / "hf")])
    assert result.exit_code == 2 and "--export-hf needs --model" in result.output
