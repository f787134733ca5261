"""``raycheck merge``: composite snapshots from units of several snapshots, and the Hugging Face export."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time
import uuid

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from raycheck.cli.merge import merge as merge_command
from raycheck.storage.backend import TEMP_MAX_AGE_S, Storage, StorageError
from raycheck.storage.merge import (
    MergeError,
    Source,
    Take,
    describe_units,
    export_hf,
    merge_snapshots,
    parse_source,
    parse_take,
    plan_merge,
    staging_folders,
)
from raycheck.storage.snapshots import SnapshotCorruptError, SnapshotInfo, SnapshotStore
from raycheck.storage.units import group_by_unit, parameter_of, unit_of
from raycheck.training.model import default_cache_dir, model_folder
from raycheck.training.state import state_sha256


def tiny_state(perturb_seed: int | None = None) -> dict[str, np.ndarray]:
    """The tiny model's parameters, with Adam-like optimizer state for every layer and the norm;
    perturbed by a seeded noise when ``perturb_seed`` is given."""
    from raycheck.training.model import load_model, trainable_parameters

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


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_hf_loads_with_transformers_and_holds_the_merged_weights(tiny_stores, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    _, a, b, _ = tiny_stores
    out = SnapshotStore(str(tmp_path / "merged"))
    merge_snapshots([Source("A", a), Source("B", b, step=20)], [parse_take("0,norm:A"), parse_take("1,embed:B")], out)
    merged = out.load_latest().state
    folder = export_hf(str(tmp_path / "merged"), tmp_path / "hf", "tiny", model_folder("tiny"))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~umask()  # readable as any file of ours
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    loaded = {n: t.detach().numpy() for n, t in model.state_dict().items()}
    params = {n: a for n, a in merged.items() if parameter_of(n) is None}
    for name, value in params.items():
        assert np.array_equal(loaded[name], value), name
    assert np.array_equal(loaded["lm_head.weight"], params["model.embed_tokens.weight"])  # tied
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(params)  # parameters only, no optimizer state, no lm_head copy


def test_export_hf_of_a_bfloat16_run_writes_bfloat16_weights_that_transformers_loads_bitwise(tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    bits = {n: torch.from_numpy(a).to(torch.bfloat16).view(torch.uint16).numpy() for n, a in tiny_state(7).items()}
    store = SnapshotStore(str(tmp_path / "bf16"))
    store.write(3, bits)
    folder = export_hf(store, tmp_path / "hf", "tiny", model_folder("tiny"))
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}
    model = AutoModelForCausalLM.from_pretrained(folder)  # the dtype its config names
    loaded = {n: t.detach().view(torch.uint16).numpy() for n, t in model.state_dict().items()}
    for name, value in bits.items():
        if parameter_of(name) is None:
            assert np.array_equal(loaded[name], value), name
    mixed = {**bits, "model.norm.weight": tiny_state(7)["model.norm.weight"].astype(np.float16)}
    store.write(4, mixed)
    with pytest.raises(ValueError, match=r"snapshot mixes \['bfloat16', 'float16'\] parameters"):
        export_hf(store, tmp_path / "hf2", "tiny", model_folder("tiny"))


def test_an_export_sweeps_the_stale_staging_folders_that_killed_exports_to_its_folder_left(tmp_path):
    """A hard kill mid-export leaves ``.hf.tmp-<8 hex>`` next to the target; the next export to ``hf`` deletes
    those unmodified for ``TEMP_MAX_AGE_S`` (as stale temp files are), keeps a younger one (a live export's)
    and never touches another target's or anything else."""
    store = SnapshotStore(str(tmp_path / "store"))
    store.write(3, tiny_state(1))
    old = time.time() - TEMP_MAX_AGE_S - 60
    for name, age in ((".hf.tmp-0123abcd", old), (".hf.tmp-89abcdef", None), (".other.tmp-0123abcd", old),
                      (".hf.tmp-notahex1", old)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(bytes(100))
        if age is not None:
            for path in (tmp_path / name / "model.safetensors", tmp_path / name):
                os.utime(path, (age, age))
    listed = staging_folders(tmp_path / "hf")
    assert [(pathlib.Path(t.path).name, t.bytes, t.age_s > TEMP_MAX_AGE_S) for t in listed] == [
        (".hf.tmp-0123abcd", 100, True), (".hf.tmp-89abcdef", 100, False)]
    folder = export_hf(store, tmp_path / "hf", "tiny", model_folder("tiny"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hf.tmp-89abcdef", ".hf.tmp-notahex1", ".other.tmp-0123abcd",
                                                         "hf", "store"]
    assert folder == tmp_path / "hf" and [pathlib.Path(t.path).name for t in staging_folders(folder)] == [".hf.tmp-89abcdef"]


def test_export_hf_rejects_a_snapshot_of_another_model(tmp_path):
    store = memory_store()
    store.write(1, small_state(0))
    with pytest.raises(ValueError, match="does not match model tiny"):
        export_hf(store, tmp_path / "hf", "tiny", model_folder("tiny"))


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
    (("0-4,embed,norm:A",), r"cannot merge:\n  --take '0-4,embed,norm:A': layers 0-4 go beyond the reference layout "
                            r"\(source A \(step 5\)\), whose layers are 0-3$"),
    (("0-3,embed,norm:A", "9:B"), r"--take '9:B': layer 9 goes beyond the reference layout .* whose layers are 0-3$"),
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
    (small_state(9, up_shape=(4, 8)), r"model.layers.1.mlp.up_proj.weight is float32 \[4, 8\], the reference has float32 \[4, 4\]"),
    (small_state(9, dtype=np.float16), r"model.layers.1.mlp.up_proj.weight is float16 \[4, 4\], the reference has float32 \[4, 4\]"),
    (small_state(9, dtype=np.uint16), r"model.layers.1.mlp.up_proj.weight is bfloat16 \[4, 4\], the reference has float32 \[4, 4\]"),
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
    assert parse_take("0-2,7,embed,layer.009:B") == Take(("embed", "layer.009"), ((0, 2), (7, 7)), "B", "0-2,7,embed,layer.009:B")
    assert parse_take("0-3000000000:A").layers == ((0, 3_000_000_000),)  # kept as a range, not expanded
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
    import torch
    from transformers import AutoModelForCausalLM

    root, _, _, states = tiny_stores
    args = ["--source", f"A={root / 'A'}", "--source", f"B={root / 'B'}@20", "--take", "0:A", "--take", "1,embed,norm:B",
            "--out", str(tmp_path / "merged"), "--export-hf", str(tmp_path / "hf"), "--model", "tiny"]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    assert "layer.001    <- B @ step 20" in result.output and "committed step 20" in result.output
    store = SnapshotStore(str(tmp_path / "merged"))
    info = store.list()[-1]
    assert {u: s["step"] for u, s in info.manifest["units"].items()} == {"embed": 20, "layer.000": 10, "layer.001": 20, "norm": 20}
    merged = store.load(info)
    for unit, key in {"embed": "B20", "layer.000": "A", "layer.001": "B20", "norm": "B20"}.items():
        assert unit_sha256(merged, unit) == unit_sha256(states[key], unit), unit
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)  # offline: a local folder
    assert model.config.num_hidden_layers == 2
    loaded = {n: t.detach().numpy() for n, t in model.state_dict().items()}
    params = {n: a for n, a in merged.items() if parameter_of(n) is None}
    assert sorted(loaded) == sorted([*params, "lm_head.weight"])
    for name, value in params.items():
        assert tensor_sha256(loaded[name]) == tensor_sha256(value), name
    assert tensor_sha256(loaded["lm_head.weight"]) == tensor_sha256(params["model.embed_tokens.weight"])  # tied
    assert tensor_sha256(loaded["model.layers.0.mlp.up_proj.weight"]) != \
        tensor_sha256(states["B20"]["model.layers.0.mlp.up_proj.weight"])  # layer 0 really from A


def test_export_command_writes_the_snapshot_a_ray_train_pointer_names_and_refuses_a_deleted_one(tiny_stores, tmp_path):
    """``raycheck export`` of what Ray Train's ``Result.checkpoint`` holds (a pointer folder, ``storage.pointers``):
    the weights of the snapshot it names (step 20 of B, not B's newest), bitwise; a pointer to a snapshot that
    is not committed is refused in one line with the store's newest, and nothing is written."""
    import torch
    from transformers import AutoModelForCausalLM

    from raycheck.cli.merge import export as export_command
    from raycheck.storage.pointers import POINTER_FILE, pointer

    _, _, b, states = tiny_stores
    info = next(i for i in b.list() if i.step == 20)
    reported = tmp_path / "ray_train" / info.folder
    reported.mkdir(parents=True)
    (reported / POINTER_FILE).write_text(json.dumps(pointer(b, info)))
    app = typer.Typer()
    app.command()(export_command)
    result = CliRunner().invoke(app, [str(reported), "--hf", str(tmp_path / "hf"), "--model", "tiny"])
    assert result.exit_code == 0, result.output
    assert result.output == f"Hugging Face folder: {tmp_path / 'hf'}\n"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    loaded = {n: t.detach().numpy() for n, t in model.state_dict().items()}
    for name, value in states["B20"].items():
        if parameter_of(name) is None:
            assert tensor_sha256(loaded[name]) == tensor_sha256(value), name
    fo = SnapshotStore(str(tmp_path / "fo"))  # a first-order snapshot: AdamW's moments and the parameter groups dropped
    fo.write(7, {**states["B20"], **{f"optim.exp_avg.{n}": np.zeros_like(a) for n, a in states["B20"].items()},
                 "param_groups.0.lr": np.array([1e-3]), "param_groups.0.betas": np.array([0.9, 0.999])})
    result = CliRunner().invoke(app, [fo.storage.url(fo.list()[-1].folder), "--hf", str(tmp_path / "hf-fo"), "--model", "tiny"])
    assert result.exit_code == 0, result.output
    gone = dict(pointer(b, info), snapshot=f"{b.storage.url()}/step-0000000025-00000000-1-00000000")
    (reported / POINTER_FILE).write_text(json.dumps(gone))
    result = CliRunner().invoke(app, [str(reported), "--hf", str(tmp_path / "hf2"), "--model", "tiny"])
    newest = b.list()[-1].folder
    assert result.exit_code == 2 and result.output.strip() == (
        f"error: {b.storage.url()}/step-0000000025-00000000-1-00000000 is not a committed snapshot of {b.storage.url()} "
        f"(not in its index); its newest snapshot is {b.storage.url()}/{newest}")
    assert not (tmp_path / "hf2").exists()


def test_export_command_takes_a_run_directory_and_names_an_unreachable_bucket_in_one_line(tiny_stores, tmp_path):
    """``raycheck export RUN_DIR`` exports the newest snapshot of the run's ``snapshots/`` (as ``inspect RUN_DIR``
    reads it), bitwise; a bucket whose endpoint refuses connections is one line, exit 2, and nothing written."""
    import torch
    from transformers import AutoModelForCausalLM

    from conftest import free_port
    from raycheck.cli.merge import export as export_command

    root, _, _, states = tiny_stores
    app = typer.Typer()
    app.command()(export_command)
    result = CliRunner().invoke(app, [str(root / "A"), "--hf", str(tmp_path / "hf"), "--model", "tiny"])
    assert result.exit_code == 0 and result.output == f"Hugging Face folder: {tmp_path / 'hf'}\n", result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    loaded = {n: t.detach().numpy() for n, t in model.state_dict().items()}
    assert all(tensor_sha256(loaded[n]) == tensor_sha256(v) for n, v in states["A"].items() if parameter_of(n) is None)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(app, ["s3://raycheck-gone/run", "--hf", str(tmp_path / "hf-s3"), "--model", "tiny", "--s3-endpoint", endpoint])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert result.output.startswith("error: ") and f"storage endpoint {endpoint} unreachable (connection refused)" in result.output
    assert not (tmp_path / "hf-s3").exists()


def tensor_sha256(array: np.ndarray) -> str:
    return hashlib.sha256(array.dtype.str.encode() + str(array.shape).encode() + np.ascontiguousarray(array).tobytes()).hexdigest()


def snapshot_args(root, out) -> list[str]:
    return ["--source", f"A={root / 'A'}", "--source", f"B={root / 'B'}@20", "--take", "0:A", "--take",
            "1,embed,norm:B", "--out", str(out)]


def files_under(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("cache", ["in use", "default"])
def test_an_export_into_the_model_cache_is_refused_in_one_line_and_writes_nothing(tiny_stores, tmp_path, monkeypatch, cache):
    """A new folder inside the model cache (the one in use, or the default one while another is in use)
    would be deleted by the next first use of its name as a model (``training.model._build_once`` removes
    a folder without ``DONE``): the export is refused with one line and exit 2, before the merge makes
    its output store, and neither the export folder nor the store is created."""
    from raycheck.cli.main import app

    root, _, _, _ = tiny_stores
    in_use = tmp_path / "cache"
    in_use.mkdir()
    monkeypatch.setenv("RAYCHECK_CACHE", str(tmp_path / "default cache"))  # default_cache_dir(), never the real one
    holder = in_use if cache == "in use" else default_cache_dir()
    export = holder / f"export-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["merge", *snapshot_args(root, out), "--export-hf", str(export), "--model", "tiny",
                                      "--cache-dir", str(in_use)])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        f"error: export folder {export} is inside the model cache {holder}, which deletes a folder without a DONE file "
        f"at the next first use of its model name: export into a folder outside {holder}"]
    assert not export.exists() and not out.exists() and list(in_use.iterdir()) == []


def test_merge_command_checks_the_model_and_the_export_folder_before_it_commits(tiny_stores, tmp_path):
    root, _, _, _ = tiny_stores
    out = tmp_path / "merged"
    result = CliRunner().invoke(cli(), [*snapshot_args(root, out), "--export-hf", str(tmp_path / "hf"), "--model", "nosuch"])
    assert result.exit_code == 2 and "error: model 'nosuch' is not a built-in name (smollm2-135m, tiny), not a folder, and not in the local Hugging Face cache" in result.output
    assert "committed" not in result.output and not out.exists() and not (tmp_path / "hf").exists()

    other = tmp_path / "other-checkpoint"  # another model's sharded export
    other.mkdir()
    (other / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (other / "model-00001-of-00002.safetensors").write_bytes(b"shard")
    before = files_under(other)
    result = CliRunner().invoke(cli(), [*snapshot_args(root, out), "--export-hf", str(other), "--model", "tiny"])
    assert result.exit_code == 2, result.output
    assert f"error: {other} is not an empty folder (it holds ['model-00001-of-00002.safetensors', " \
           "'model.safetensors.index.json']...): export into a new or empty folder" in " ".join(result.output.split())
    assert files_under(other) == before and not out.exists()

    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(cli(), [*snapshot_args(root, out), "--export-hf", str(tmp_path / "empty"), "--model", "tiny"])
    assert result.exit_code == 0, result.output  # the retry, into an empty folder, is not refused
    assert sorted(files_under(tmp_path / "empty")) == ["config.json", "generation_config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left
    with pytest.raises(FileExistsError, match="is not an empty folder"):
        export_hf(str(out), tmp_path / "empty", "tiny", model_folder("tiny"))  # the API refuses the same way
    assert sorted(files_under(tmp_path / "empty")) == ["config.json", "generation_config.json", "model.safetensors"]


def test_a_huge_layer_range_is_one_line_and_never_expanded(tiny_stores, tmp_path):
    import tracemalloc

    root, _, _, _ = tiny_stores
    args = ["--source", f"A={root / 'A'}", "--take", "0-3000000,embed,norm:A", "--out", str(tmp_path / "merged")]
    tracemalloc.start()
    result = CliRunner().invoke(cli(), args)
    peak_bytes = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        "error: cannot merge:",
        "  --take '0-3000000,embed,norm:A': layers 0-3000000 go beyond the reference layout (source A (step 10)), "
        "whose layers are 0-1"]
    assert peak_bytes < 50e6  # three million unit names would take hundreds of MB
    assert not (tmp_path / "merged").exists()


def test_merge_into_a_missing_bucket_is_one_error_and_creates_nothing(tiny_stores, s3_endpoint):
    import s3fs

    root, _, _, _ = tiny_stores
    bucket = f"rc-missing-{uuid.uuid4().hex[:8]}"
    result = CliRunner().invoke(cli(), [*snapshot_args(root, f"s3://{bucket}/merged"), "--s3-endpoint", s3_endpoint])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)  # no traceback
    assert result.output.strip() == (f"error: cannot write to snapshot store s3://{bucket}/merged: bucket {bucket!r} "
                                     "does not exist; create it first, or check the bucket name and --s3-endpoint")
    assert not s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True).exists(bucket)


class FailingManifestStorage(Storage):
    """A real memory store whose manifest writes fail, as a store that goes down mid-commit would."""

    def put(self, rel: str, data: bytes) -> None:
        if rel.endswith("/manifest.json"):
            raise StorageError(f"put {self.url(rel)} failed after 4 tries: injected")
        super().put(rel, data)


def test_a_failed_commit_leaves_nothing_and_the_retry_succeeds(small_sources):
    uri = f"memory://raycheck-merge-{uuid.uuid4().hex}"
    with pytest.raises(StorageError, match="injected"):
        merge_snapshots(small_sources, takes("0-3,embed,norm:A"), SnapshotStore(FailingManifestStorage(uri)))
    out = SnapshotStore(Storage(uri))
    assert out.storage.list() == []  # the shards it had put are gone
    result = merge_snapshots(small_sources, takes("0-3,embed,norm:A"), out)
    assert [i.step for i in out.list()] == [5] == [result.info.step]


def test_a_failed_merge_leaves_no_output_folder(tiny_stores, tmp_path):
    root, _, _, _ = tiny_stores
    nested = tmp_path / "new" / "merged"
    for take_args in (["--take", "0-1,embed:A"], ["--take", "0-1,embed,norm:A", "--take", "norm:B"]):
        args = ["--source", f"A={root / 'A'}", "--source", f"B={root / 'B'}", *take_args, "--out", str(nested)]
        result = CliRunner().invoke(cli(), args)
        assert result.exit_code == 2 and "cannot merge" in result.output
        assert not (tmp_path / "new").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    result = CliRunner().invoke(cli(), ["--source", f"A={root / 'A'}", "--take", "0-1:A", "--out", str(existing)])
    assert result.exit_code == 2 and existing.is_dir() and list(existing.iterdir()) == []  # kept: it was there before


@pytest.mark.parametrize("unit, tensor, expected", [
    ("../../x", "model.norm.weight", r"unit name '../../x' is not a plain name"),
    ("/etc", "model.norm.weight", r"unit name '/etc' is not a plain name"),
    ("norm", "/abs/model.norm.weight", r"tensor name '/abs/model.norm.weight' of unit norm is not a plain name"),
    ("norm", "model.norm..weight", r"tensor name 'model.norm..weight' of unit norm is not a plain name"),
    ("norm", "model.layers.0.w", r"tensor model.layers.0.w is listed under unit norm but belongs to unit layer.000"),
])
def test_unsafe_names_in_a_source_manifest_are_refused(unit, tensor, expected):
    manifest = {"names": [tensor], "units": {unit: {"tensors": {tensor: {"dtype": "<f4", "shape": [4]}}, "step": 3,
                                                    "path": f"step-3/{unit}.safetensors"}}}
    with pytest.raises(MergeError, match=r"cannot merge:\n  source A \(step 3\): " + expected):
        plan_merge({"A": SnapshotInfo(3, "step-3", manifest)}, takes(f"{unit}:A"))


def test_a_unit_named_to_escape_the_output_root_writes_nothing_outside(tmp_path):
    """A source whose manifest and shard carry a tensor ``../../../escaped.weight`` (unit ``../../../escaped``):
    a merge that trusted it would write ``<out>/step-*/../../../escaped.safetensors``, outside the output root."""
    from safetensors.numpy import save

    source = SnapshotStore(str(tmp_path / "store" / "A"))
    info = source.write(3, small_state(3, layers=1))
    name, unit = "../../../escaped.weight", "../../../escaped"
    blob = save({name: np.ones(4, dtype=np.float32)})
    source.storage.put(f"{info.folder}/evil.safetensors", blob)
    manifest = json.loads(source.storage.get(f"{info.folder}/manifest.json"))
    manifest["names"].append(name)
    manifest["units"][unit] = {"path": f"{info.folder}/evil.safetensors", "bytes": len(blob),
                               "sha256": hashlib.sha256(blob).hexdigest(), "step": 3,
                               "tensors": {name: {"dtype": "<f4", "shape": [4]}}}
    source.storage.put(f"{info.folder}/manifest.json", json.dumps(manifest).encode())
    before = files_under(tmp_path)
    args = ["--source", f"A={tmp_path / 'store' / 'A'}", "--take", f"0,embed,norm,{unit}:A", "--out", str(tmp_path / "store" / "out")]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 2 and "error: " in result.output
    assert files_under(tmp_path) == before and not (tmp_path / "store" / "out").exists()


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
