"""Shared fixtures: the real tokenizer and data, the tiny model, and a local Ray cluster when needed."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def data():
    from training.data import load_rotten_tomatoes

    return load_rotten_tomatoes()


@pytest.fixture(scope="session")
def encoder():
    from training.data import PromptEncoder
    from training.model import load_tokenizer

    return PromptEncoder(load_tokenizer(), seq_len=32)


@pytest.fixture()
def tiny_model():
    from training.model import load_model

    return load_model("tiny")
