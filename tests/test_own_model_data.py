"""Your own model and data, without Ray: units derived from a GPT-2 / Qwen2 model's module tree, an
unrecognised layout, tied weights, JSONL/CSV/Parquet loading, each bad-data refusal with its message,
the causal-LM loss on completion tokens only, and the trajectory hash following the files' contents."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raycheck.job.config import DataConfig
from raycheck.orchestrator.api import job_config
from raycheck.storage.units import describe_units, unit_of
from raycheck.training.assets import AssetMismatchError, read_assets
from raycheck.training.data import CausalLMEncoder, DataError, Split, make_encoder, read_table
from raycheck.training.model import default_cache_dir, load_model, load_tokenizer, read_model_files, trainable_parameters
from raycheck.training.state import state_sha256

VOCAB = 49152  # SmolLM2's tokenizer (the folder has none of its own)


def gpt2_folder(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A 2-layer GPT-2 with random weights (tied head), saved with ``save_pretrained``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64,
                               bos_token_id=1, eos_token_id=2)).save_pretrained(path)
    return path


def write_rows(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    """``rows`` as JSONL, CSV or Parquet, by ``path``'s suffix."""
    table = pa.Table.from_pylist(rows)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".csv":
        import pyarrow.csv as pcsv

        pcsv.write_csv(table, path)
    else:
        pq.write_table(table, path)
    return path


def reviews(n: int = 20) -> list[dict]:
    return [{"text": f"film number {i} was {'great' if i % 2 else 'dull'}", "label": "positive" if i % 2 else "negative"}
            for i in range(n)]


def cfg_for(tmp_path, data: str = "", **fields):
    """A job in ``tmp_path`` with the shared cache (the tokenizer is converted once per machine, not per test), training
    on the file ``data``; ``fields`` named as ``DataConfig``'s (``task``, ``text_column``, ...) go in its ``data``."""
    given = {name: fields.pop(name) for name in list(fields) if name in DataConfig.__dataclass_fields__}
    return job_config(tmp_path / "run", cache_dir=default_cache_dir(), seq_len=32, batch_size=4, data={"path": data, **given}, **fields)


def test_units_of_gpt2_and_qwen2_come_from_the_module_tree_and_tied_weights_are_found(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    gpt2 = load_model(str(gpt2_folder(tmp_path / "gpt2")))
    layout = describe_units(gpt2)
    assert layout.recognised
    assert list(layout.units) == ["embed", "layer.000", "layer.001", "norm"]
    assert layout.units["embed"] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert layout.units["norm"] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert layout.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in trainable_parameters(gpt2)  # stored once, under the embedding

    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    layout = describe_units(qwen)
    assert layout.recognised and layout.tied == {}
    assert list(layout.units) == ["embed", "layer.000", "layer.001", "layer.002", "norm", "lm_head"]
    assert unit_of("optim.exp_avg.transformer.h.1.mlp.c_fc.weight") == "layer.001"


def test_an_unrecognised_layout_makes_each_module_its_own_unit():
    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
            self.out = torch.nn.Linear(2, 3)

    layout = describe_units(Odd())
    assert not layout.recognised
    assert layout.units == {"encoder.0": ["encoder.0.weight", "encoder.0.bias"], "encoder.1": ["encoder.1.weight", "encoder.1.bias"],
                            "out": ["out.weight", "out.bias"]}


def test_a_shipped_model_builds_the_same_weights_without_the_folder(tmp_path):
    folder = gpt2_folder(tmp_path / "gpt2")
    files = read_model_files(str(folder))
    assert sorted(files.files) == ["config.json", "generation_config.json", "model.safetensors"]
    original = state_sha256({n: t.numpy() for n, t in trainable_parameters(load_model(str(folder))).items()})
    moved = folder.rename(tmp_path / "gone")  # a worker on another node has no such path
    rebuilt = load_model(str(folder), tmp_path / "node-cache", files)
    assert state_sha256({n: t.numpy() for n, t in trainable_parameters(rebuilt).items()}) == original
    assert moved.exists() and not folder.exists()


def test_a_missing_model_is_refused_naming_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="not a built-in name .* not a folder, and not in the local Hugging Face cache"):
        read_assets(cfg_for(tmp_path, model="no-such-org/no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        read_assets(cfg_for(tmp_path, model=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match=f"^model folder {tmp_path / 'gone'} does not exist$"):
        read_assets(cfg_for(tmp_path, model=str(tmp_path / "gone")))
    with pytest.raises(ValueError, match=r"is a file, not a model folder"):
        read_assets(cfg_for(tmp_path, model=str(write_rows(tmp_path / "d.jsonl", reviews(2)))))


def test_a_folder_whose_weights_do_not_match_its_config_or_that_transformers_cannot_build_is_refused(tmp_path):
    """Loaded once on the driver before anything starts: tensors that transformers would initialise at
    random would differ between the workers and the shadow (the run would train random weights)."""
    import json
    import shutil

    from transformers import Qwen2Config

    mixed = gpt2_folder(tmp_path / "mixed")  # GPT-2's weights under a Qwen2 config
    Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1).save_pretrained(mixed)
    with pytest.raises(ValueError, match=r"its weights do not match its config.json: tensors \d+ missing \(e.g. .*\); "
                                         r"\d+ unexpected \(e.g. .*transformer\..*\)"):
        read_assets(cfg_for(tmp_path, model=str(mixed)))
    unknown = shutil.copytree(gpt2_folder(tmp_path / "gpt2"), tmp_path / "unknown")
    (unknown / "config.json").write_text(json.dumps({"model_type": "nosuch"}))
    with pytest.raises(ValueError, match=f"^model folder {unknown} cannot be loaded by transformers \\("):
        read_assets(cfg_for(tmp_path, model=str(unknown)))


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_classification_data_loads_from_each_format_with_every_tenth_row_held_out(tmp_path, suffix):
    data = write_rows(tmp_path / f"d{suffix}", reviews(20))
    cfg, assets = read_assets(cfg_for(tmp_path, data=str(data)))
    train, held = assets.data
    assert len(train) == 18 and held.texts == ("film number 9 was great", "film number 19 was great")
    assert train.labels.tolist() == [i % 2 for i in range(20) if (i + 1) % 10]
    assert held.labels.tolist() == [1, 1]
    assert cfg.data.sha256 == __import__("hashlib").sha256(data.read_bytes()).hexdigest()


def test_labels_may_be_indices_and_templates_and_words_are_the_users(tmp_path):
    rows = [{"review": f"text {i}", "stars": i % 3} for i in range(12)]
    data = write_rows(tmp_path / "d.jsonl", rows)
    cfg = cfg_for(tmp_path, data=str(data), text_column="review", label_column="stars", label_words="bad,okay,good",
                  prompt_template="Q: {text}\nA:")
    cfg, assets = read_assets(cfg)
    assert assets.data[0].labels.tolist() == [i % 3 for i in range(12) if (i + 1) % 10]
    encoder = make_encoder(cfg, load_tokenizer(cfg.cache_dir))
    tok = load_tokenizer(cfg.cache_dir)
    ids, last = encoder.encode(["text 0"])
    assert ids[0, : int(last) + 1].tolist() == tok("Q: text 0\nA:", add_special_tokens=False).input_ids
    assert encoder.label_ids == [tok(" " + w, add_special_tokens=False).input_ids[0] for w in ("bad", "okay", "good")]


def test_bad_data_is_refused_with_one_message_each(tmp_path):
    def refusal(rows_or_text, name="d.jsonl", **fields) -> str:
        path = tmp_path / name
        if isinstance(rows_or_text, str):
            path.write_text(rows_or_text)
        else:
            write_rows(path, rows_or_text)
        with pytest.raises(DataError) as info:
            read_assets(cfg_for(tmp_path, data=str(path), **fields))
        return str(info.value)

    p = tmp_path / "d.jsonl"
    assert refusal("") == f"data file {p} is empty: it has no rows"
    assert refusal(reviews(12), text_column="body") == (
        f"data file {p} has no column 'body' (its columns: text, label): set --text-column")
    rows = reviews(12)
    rows[3]["label"], rows[7]["label"] = "neutral", "meh"
    assert refusal(rows) == (f"data file {p}: 2 row(s) have a label that is not one of --label-words negative,positive "
                             "(nor its index 0..1), the first row 4: 'neutral'")
    rows = reviews(12)
    rows[5]["text"] = rows[8]["text"] = "word " * 40
    assert refusal(rows).startswith(f"data file {p}: 2 row(s) are longer than --seq-len 32 tokens, the first row 6 (")
    assert refusal(rows).endswith(" tokens): raise --seq-len or shorten them")
    assert refusal(reviews(3)) == f"data file {p} has 3 training rows (every 10th row is held out), fewer than --batch-size 4"
    q = tmp_path / "d.txt"
    assert refusal("x", name="d.txt") == f"data file {q}: unsupported type '.txt'; give a .jsonl, .csv or .parquet file"



@pytest.mark.parametrize(("text", "why"), [
    ('{"text": "a", "label": 0}\n' * 2 + '{"text": "a", label: 1}\n',
     "line 3: not valid JSON: Expecting property name enclosed in double quotes (column 15)"),
    ('{"text": "a", "label": 0}\n\n\n[1, 2]\n', "line 4: a JSON array, not an object"),  # blank lines count as lines
    ('{"text": "a", "label": "positive"}\n' * 40000 + '{"text": "a", "label": 1}\n',  # past pyarrow's first block
     "line 40001: field 'label' is a number, but a string on the lines before"),
])
def test_jsonl_errors_name_the_line_counted_from_1(tmp_path, text, why):
    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(DataError) as info:
        read_table(path)
    assert str(info.value) == f"data file {path} cannot be read as JSONL: {why}"

def test_causal_lm_loss_counts_completion_tokens_only(tmp_path):
    tok = load_tokenizer(default_cache_dir())
    model = load_model(str(gpt2_folder(tmp_path / "gpt2")))
    encoder = CausalLMEncoder(tok, 32)
    split = Split(("The answer is",), np.array([-1]), completions=(" forty two",))
    ids, mask = encoder.encode(list(split.texts), list(split.completions))
    n_prompt = len(tok("The answer is", add_special_tokens=False).input_ids)
    assert mask[0].tolist() == [i >= n_prompt for i in range(ids.shape[1])]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    expected = -sum(float(logp[i - 1, ids[0, i]]) for i in range(n_prompt, ids.shape[1])) / (ids.shape[1] - n_prompt)
    assert encoder.loss(model, split, np.array([0])) == pytest.approx(expected, rel=1e-6)
    assert encoder.evaluate(model, split, 1) == pytest.approx(expected, rel=1e-6)


def test_the_trajectory_hash_follows_the_model_files_and_data_content(tmp_path):
    folder = gpt2_folder(tmp_path / "gpt2", seed=0)
    data = write_rows(tmp_path / "d.jsonl", reviews(12))
    base = cfg_for(tmp_path, model=str(folder), data=str(data))
    cfg, _ = read_assets(base)
    assert len(cfg.model_sha256) == 64 and len(cfg.data.sha256) == 64
    assert cfg.trajectory_sha256() != base.trajectory_sha256()

    write_rows(data, reviews(13))
    cfg2, _ = read_assets(base)
    assert cfg2.data.sha256 != cfg.data.sha256 and cfg2.trajectory_sha256() != cfg.trajectory_sha256()
    with pytest.raises(AssetMismatchError, match=rf"data file {data} has changed since this run started"):
        read_assets(cfg)  # a resume: its config records the old content

    gpt2_folder(folder, seed=1)  # other weights, same names
    cfg3, _ = read_assets(base)
    assert cfg3.model_sha256 != cfg2.model_sha256 and cfg3.trajectory_sha256() != cfg2.trajectory_sha256()
    with pytest.raises(AssetMismatchError, match=rf"model {folder} has changed since this run started"):
        read_assets(cfg2)


def test_default_configs_keep_their_trajectory_hash(tmp_path):
    """The new fields count only away from their defaults: an existing run's hash is unchanged."""
    cfg = cfg_for(tmp_path, model="tiny", seed=3)
    assert cfg.trajectory_sha256() == __import__("hashlib").sha256(json.dumps(
        {path: cfg.get(path) for path in cfg.TRAJECTORY}, sort_keys=True).encode()).hexdigest()


def test_the_cli_refuses_bad_data_with_exit_2_before_anything_is_touched(tmp_path):
    from typer.testing import CliRunner

    from raycheck.cli.main import app

    rows = reviews(12)
    rows[2]["label"] = "maybe"
    data = write_rows(tmp_path / "d.jsonl", rows)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--data", str(data), "--out", str(out), "--batch-size", "4"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        f"error: --data file {data}: 1 row(s) have a label that is not one of --label-words negative,positive "
        "(nor its index 0..1), the first row 3: 'maybe'")
    assert not out.exists()
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--task", "causal-lm", "--out", str(out)])
    assert result.exit_code == 2 and "error: --task causal-lm needs a data file" in result.output
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--label-words", "yes", "--out", str(out)])
    assert result.exit_code == 2 and "error: --label-words 'yes': give two or more distinct words" in result.output
    assert not out.exists()


def test_a_model_id_resolves_offline_from_the_local_hugging_face_cache(tmp_path, monkeypatch):
    """A cache laid out as huggingface_hub writes it (models--ORG--NAME/refs/main -> snapshots/REV)."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--someorg--tiny-gpt2"
    gpt2_folder(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg, assets = read_assets(cfg_for(tmp_path, model="someorg/tiny-gpt2"))
    assert cfg.model_sha256 == read_model_files(str(repo / "snapshots" / "abc123")).sha256 == assets.model.sha256
    with pytest.raises(ValueError, match=r"not in the local Hugging Face cache; nothing is downloaded: .*\(huggingface-cli download someorg/other\)$"):
        read_assets(cfg_for(tmp_path, model="someorg/other"))


def test_a_worker_never_falls_back_to_the_driver_s_folder_path(tmp_path):
    from raycheck.training.assets import shipped_model

    assert shipped_model({"model": None, "data": None}, "tiny") is None  # built in: each node builds its own
    with pytest.raises(RuntimeError, match=f"model {tmp_path} was not shipped by the driver"):
        shipped_model({"model": None, "data": None}, str(tmp_path))


def test_causal_lm_files_load_as_prompt_completion_or_plain_text(tmp_path):
    pairs = write_rows(tmp_path / "qa.parquet", [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(10)])
    cfg, assets = read_assets(cfg_for(tmp_path, data=str(pairs), task="causal-lm"))
    train, held = assets.data
    assert train.texts[:2] == ("Q0:", "Q1:") and train.completions[:2] == (" answer 0", " answer 1")
    assert held.texts == ("Q9:",) and held.completions == (" answer 9",)
    texts = write_rows(tmp_path / "t.csv", [{"text": f"line {i}"} for i in range(10)])
    _, assets = read_assets(cfg_for(tmp_path, data=str(texts), task="causal-lm"))
    assert assets.data[0].texts == ("",) * 9 and assets.data[0].completions[0] == "line 0"
    blank = write_rows(tmp_path / "b.jsonl", [{"prompt": "Q:", "completion": " " if i in (4, 6) else " yes"} for i in range(10)])
    with pytest.raises(DataError) as info:
        read_assets(cfg_for(tmp_path, data=str(blank), task="causal-lm"))
    assert str(info.value) == f"data file {blank}: 2 row(s) have an empty completion (no token to train on), the first row 5"
    only_prompt = write_rows(tmp_path / "p.jsonl", [{"prompt": "Q:"}] * 10)
    with pytest.raises(DataError, match=r"has no column 'completion' \(its columns: prompt\): set --completion-column"):
        read_assets(cfg_for(tmp_path, data=str(only_prompt), task="causal-lm"))


def test_a_mezo_step_trains_a_causal_lm_on_its_completion_loss(tmp_path):
    """The worker's own step (``conftest.zo_step_``: ``workers.zo_session.mezo_step_`` over ``workers.worker.task_batch``) on a prompt/completion file: its
    first loss is the encoder's completion loss at +eps z (rebuilt on a fresh copy), and the weights move."""
    from raycheck.training.data import batch_indices
    from conftest import zo_step_
    from raycheck.training.zo import ZOHyper, perturb_all_, step_seed

    folder = gpt2_folder(tmp_path / "gpt2")
    data = write_rows(tmp_path / "qa.jsonl", [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(10)])
    cfg, assets = read_assets(cfg_for(tmp_path, model=str(folder), data=str(data), task="causal-lm", zo={"lr": 1e-3}))
    model = load_model(cfg.model, cfg.cache_dir, assets.model)
    encoder = make_encoder(cfg, load_tokenizer(cfg.cache_dir, assets.model))
    params = trainable_parameters(model)
    train = assets.data[0]
    before = state_sha256(params)
    record, _ = zo_step_(params, model, encoder, train, cfg, 0, 0, 1, ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps),
                         fail=lambda: None, commit=lambda r: 0.0)
    assert state_sha256(params) != before and record.loss_plus != record.loss_minus
    fresh = load_model(cfg.model, cfg.cache_dir, assets.model)
    p = trainable_parameters(fresh)
    perturb_all_(p, step_seed(cfg.seed, 0), cfg.zo.eps)  # the step's +eps z, on a fresh copy of the initial weights
    idx = batch_indices(cfg.seed, 0, cfg.batch_size, len(train))
    assert encoder.loss(fresh, train, idx) == record.loss_plus
