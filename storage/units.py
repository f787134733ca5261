"""Checkpoint units: the pieces a snapshot shards a model into, and a composite state mixes.

A unit is the embeddings, one transformer layer, the final norm, or the LM head (LLMTailor, PDSW'25,
treats embeddings, final norm and head as their own units). Names follow Hugging Face Llama-style
models (``model.layers.<i>.``, ``model.embed_tokens``, ``model.norm``, ``lm_head``); anything else
is its own unit named after its module path.

Optimizer state belongs to the unit of its parameter: a tensor named ``optim.<slot>.<parameter name>``
(e.g. ``optim.exp_avg.model.layers.3.mlp.up_proj.weight``) is in that parameter's unit, so a unit's
shard carries the parameter and its matching optimizer state together (LayerCheck, LLMTailor).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
OPTIMIZER_PREFIX = "optim."
"""Names ``optim.<slot>.<parameter name>`` hold optimizer state (slot: ``exp_avg``, ``exp_avg_sq``, ...)."""


def parameter_of(name: str) -> str | None:
    """The parameter that optimizer-state tensor ``name`` belongs to; ``None`` for a parameter's own name."""
    if not name.startswith(OPTIMIZER_PREFIX):
        return None
    parts = name.split(".", 2)
    return parts[2] if len(parts) == 3 and parts[1] and parts[2] else None


def unit_of(name: str) -> str:
    """The unit of tensor ``name``: ``embed``, ``layer.007``, ``norm``, ``lm_head`` or its module path.

    Optimizer state (``optim.<slot>.<parameter name>``) is in the unit of its parameter.
    """
    param = parameter_of(name)
    if param is not None:
        return unit_of(param)
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
