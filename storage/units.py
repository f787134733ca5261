"""Checkpoint units: the pieces a snapshot shards a model into, and a composite state mixes.

A unit is the embeddings, one transformer layer, the final norm, or the LM head (LLMTailor, PDSW'25,
treats embeddings, final norm and head as their own units). Names follow Hugging Face Llama-style
models (``model.layers.<i>.``, ``model.embed_tokens``, ``model.norm``, ``lm_head``); anything else
is its own unit named after its module path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def unit_of(name: str) -> str:
    """The unit of tensor ``name``: ``embed``, ``layer.007``, ``norm``, ``lm_head`` or its module path."""
    m = _LAYER.match(name)
    if m:
        return f"layer.{int(m.group(1)):03d}"
    if name.startswith("model.embed_tokens."):
        return "embed"
    if name.startswith("model.norm."):
        return "norm"
    if name.startswith("lm_head."):
        return "lm_head"
    return name.rsplit(".", 1)[0]


def group_by_unit(names: Iterable[str]) -> dict[str, list[str]]:
    """Tensor names grouped by unit, units and names in first-seen order."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(unit_of(n), []).append(n)
    return groups
