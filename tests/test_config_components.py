"""The ``data`` and ``placement`` components of ``JobConfig`` (``job.config.DataConfig``, ``PlacementConfig``),
checked without Ray: the trajectory hashes of every configuration are those from before the components (a run
started then resumes now), and a ``config.json`` of that raycheck, its data and placement fields at the top
level, is read into the components."""

from __future__ import annotations

import json

import pytest

from raycheck.job.config import NESTED_NAMES, DataConfig, JobConfig, PlacementConfig

BASE = dict(out_dir="/tmp/x", cache_dir="/tmp/c")

PINNED = {
    "default": ({}, "0f1497eba78cefd1ce160582f736e54611f8f3ad9fd92c995775adbc0b535375"),
    "data and task": (dict(data=dict(path="/tmp/d.jsonl", sha256="ab" * 32, task="causal-lm", text_column="body")),
                      "e93d53c459171c1875bb313d737493077ece65876ae1edc3db15309feb7f6384"),
    "classification columns": (dict(data=dict(path="/tmp/d.csv", sha256="cd" * 32, label_column="y", label_words="bad,good",
                                              prompt_template="T: {text}\nA:", prompt_column="p", completion_column="c")),
                               "070f0d207409889c47c1f7d4f0d2003adace97a0f2067d67ad8bbe500a165450"),
    "device cuda": (dict(device="cuda"), "0f31a28944cb3588a974ead7c97f3feaa8c47ac2ccc1a4ef23940f44b4a04504"),
    "fo ddp": (dict(algo="fo", fo={"lr": 1e-4}), "3045215f863d0fd6a976a88817f2f61f0f13f8dc2e8f2b9b87243d4ea111b983"),
    "fo fsdp2": (dict(algo="fo", strategy="full-sync", workers=2, fo={"parallelism": "fsdp2"}),
                 "6603c6d07100283908ccf58af42416138166539f96860e1a988116aa07d5fa59"),
    "groups, model hash, bfloat16": (dict(workers=2, zo={"micro_batch_size": 2}, model_sha256="ef" * 32, dtype="bfloat16"),
                                     "30bb8f9ec3696c40f688fbe309add3547635f9e930aabcb9769e13675ca5ac92"),
}
"""Configurations and their trajectory hashes, computed by raycheck before ``DataConfig`` (commit 98b4503, with the
data fields at the top level: ``data=..., data_sha256=..., task=...``)."""


@pytest.mark.parametrize("name", PINNED)
def test_the_trajectory_hashes_are_those_from_before_the_components(name):
    fields, digest = PINNED[name]
    assert JobConfig(**BASE, **fields).trajectory_sha256() == digest


def test_placement_does_not_change_the_trajectory():
    placed = JobConfig(**BASE, placement=PlacementConfig(worker_resource="w", shadow_resource="s", shadow_shards=2, shadow_threads=4,
                                                         shadow_env={"A": "b"}))
    assert placed.trajectory_sha256() == PINNED["default"][1]


def test_an_earlier_config_json_with_flat_data_and_placement_fields_is_read_into_the_components():
    saved = JobConfig(**BASE, data=DataConfig(path="/tmp/d.jsonl", sha256="ab" * 32, task="causal-lm", text_column="body"),
                      placement=PlacementConfig(worker_resource="w", shadow_env={"A": "b"}, shadow_threads=3))
    nested = json.loads(json.dumps(saved.to_dict()))
    flat = {k: v for k, v in nested.items() if k not in ("data", "placement")}
    for old, path in NESTED_NAMES.items():  # the form of raycheck before the components
        component, _, leaf = path.partition(".")
        flat[old] = nested[component][leaf]
    loaded = JobConfig.from_dict(flat)
    assert loaded == saved and loaded.trajectory_sha256() == PINNED["data and task"][1]
    assert JobConfig.from_dict(nested) == saved


def test_the_components_validate_their_own_fields_named_by_path():
    with pytest.raises(ValueError, match=r"^data.task 'x': choose one of classification, causal-lm$"):
        DataConfig(task="x")
    with pytest.raises(ValueError, match=r"^data.task causal-lm needs a data file"):
        JobConfig(**BASE, data={"task": "causal-lm"})
    with pytest.raises(ValueError, match=r"^data.label_words 'a': give two or more distinct words"):
        DataConfig(label_words="a")
    with pytest.raises(ValueError, match=r"must contain \{text\} exactly once$"):
        DataConfig(prompt_template="no text")
    with pytest.raises(ValueError, match=r"^data.task causal-lm runs with algo zo only, not algo fo$"):
        JobConfig(**BASE, algo="fo", data={"path": "/tmp/d.jsonl", "task": "causal-lm"})
    with pytest.raises(ValueError, match=r"^placement.shadow_threads must be >= 1, got 0$"):
        PlacementConfig(shadow_threads=0)
    assert JobConfig.default("data.task") == "classification" and JobConfig.default("placement.shadow_env") == {}
