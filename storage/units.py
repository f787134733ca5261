"""Checkpoint units: the pieces a snapshot shards a model into, and a composite state mixes.

A unit is the embeddings, one transformer layer, the final norm, or the LM head (LLMTailor, PDSW'25,
treats embeddings, final norm and head as their own units). A unit is a function of the tensor name
alone (storage sees names, never the model), for the layouts of Hugging Face causal LMs: the decoder
layer list (``model.layers.<i>`` Llama, Qwen2, Mistral; ``transformer.h.<i>`` GPT-2, Falcon;
``gpt_neox.layers.<i>``; ``model.decoder.layers.<i>`` OPT; ``transformer.blocks.<i>``), the embeddings
(``embed_tokens``, ``wte``, ``wpe``, ``embed_in``, ...), the final norm (``norm``, ``ln_f``, ...) and the
head (``lm_head``, ``embed_out``); anything else is its own unit named after its module path.
``describe_units`` derives the same parts from a model's module tree (its ``ModuleList`` of decoder
layers, its embedding modules, its output embeddings) and says whether the names agree with it.

Optimizer state belongs to the unit of its parameter: a tensor named ``optim.<slot>.<parameter name>``
(e.g. ``optim.exp_avg.model.layers.3.mlp.up_proj.weight``) is in that parameter's unit, so a unit's
shard carries the parameter and its matching optimizer state together (LayerCheck, LLMTailor).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch

_BASES = r"(?:model\.|transformer\.|gpt_neox\.|model\.decoder\.)?"
_LAYER = re.compile(rf"^{_BASES}(?:layers|h|blocks)\.(\d+)\.")
_PARTS = {
    "embed": re.compile(rf"^{_BASES}(?:embed_tokens|wte|wpe|embed_in|word_embeddings|embed_positions)\."),
    "norm": re.compile(rf"^{_BASES}(?:norm|ln_f|final_layernorm|final_layer_norm)\."),
    "lm_head": re.compile(r"^(?:lm_head|embed_out)\."),
}
OPTIMIZER_PREFIX = "optim."
"""Names ``optim.<slot>.<parameter name>`` hold optimizer state (slot: ``exp_avg``, ``exp_avg_sq``, ...)."""
GROUP_PREFIX = "param_groups."
"""``param_groups.<i>.<key>``: a parameter group's numeric hyper-parameter, float64 (``training.optim_state``)."""


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
    for unit, pattern in _PARTS.items():
        if pattern.match(name):
            return unit
    return name.rsplit(".", 1)[0]


def group_by_unit(names: Iterable[str]) -> dict[str, list[str]]:
    """Tensor names grouped by unit, units and names in first-seen order."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(unit_of(n), []).append(n)
    return groups


@dataclass(frozen=True)
class UnitLayout:
    """A model's units as its module tree defines them.

    Attributes:
        units: unit -> parameter names, in ``named_parameters`` order (tied parameters once).
        recognised: True when ``unit_of`` gives every parameter the unit its module says (embedding,
            decoder layer i, final norm, head); False: each module is its own unit (still works).
        tied: parameter name -> the name it shares storage with (e.g. ``lm_head.weight`` ->
            ``model.embed_tokens.weight``); such a tensor is stored once, under the name it maps to.
    """

    units: dict[str, list[str]]
    recognised: bool
    tied: dict[str, str]


def describe_units(model: torch.nn.Module) -> UnitLayout:
    """Derive the units of ``model`` (a ``torch.nn.Module`` causal LM) from its module tree: the
    largest ``ModuleList`` holds the decoder layers, ``nn.Embedding`` modules outside it are the
    embeddings, ``get_output_embeddings()`` the head, the rest the final norm; then check that the
    name rule ``unit_of`` (what storage applies) agrees for every parameter."""
    import torch

    lists = [(p, m) for p, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    layers_path, layers = max(lists, key=lambda pm: len(pm[1]), default=("", []))
    # a transformers model's method (nn.Module.__getattr__ types any attribute as Tensor | Module)
    head = cast("Callable[[], torch.nn.Module | None]", model.get_output_embeddings)() if hasattr(model, "get_output_embeddings") else None
    kind_of: dict[str, str] = {}
    for path, module in model.named_modules():
        if layers_path and path.startswith(layers_path + "."):
            kind_of[path] = f"layer.{int(path[len(layers_path) + 1:].split('.')[0]):03d}"
        elif module is head and head is not None:
            kind_of[path] = "lm_head"
        elif isinstance(module, torch.nn.Embedding):
            kind_of[path] = "embed"
        elif path:
            kind_of[path] = "norm"
    params = dict(model.named_parameters())
    expected = {n: kind_of.get(n.rsplit(".", 1)[0], "norm") for n in params}
    recognised = bool(layers) and all(unit_of(n) == u for n, u in expected.items())
    first_name: dict[int, str] = {}
    tied: dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        key = p.data_ptr()
        if key in first_name and first_name[key] != n:
            tied[n] = first_name[key]
        first_name.setdefault(key, n)
    return UnitLayout(units=group_by_unit(params), recognised=recognised, tied=tied)
