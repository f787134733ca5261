"""Splitting the shadow into K shards, and putting their images back together (pure, no Ray).

Every parameter's perturbation z depends only on (run seed, step, parameter index)
(``training.zo.noise``), so a shard that holds parameters ``first_index .. end_index - 1`` of the
canonical order replays exactly those, bitwise as the unsharded shadow would. A shard owns whole
checkpoint units (``storage.units``: embeddings, each layer, the final norm, the LM head) in layout
order, so its parameters are one contiguous range and its part of a snapshot is a set of whole
unit shards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from raycheck.storage.units import group_by_unit


@dataclass(frozen=True)
class ShardRange:
    """The part of the model one shard owns.

    Attributes:
        shard: its number, 0-based.
        units: its units in layout order (``storage.units.unit_of`` names).
        first_index: index of its first parameter in the canonical order.
        end_index: one past its last parameter.
        elements: its parameters' elements (4 bytes each in fp32).
    """

    shard: int
    units: tuple[str, ...]
    first_index: int
    end_index: int
    elements: int

    def names(self, ordered: Sequence[str]) -> list[str]:
        """Its parameter names, from the model's canonical name order ``ordered``."""
        return list(ordered[self.first_index:self.end_index])

    def describe(self) -> str:
        """``embed..layer.004`` style: its first and last unit."""
        return self.units[0] if len(self.units) == 1 else f"{self.units[0]}..{self.units[-1]}"


def layout_elements(layout: Sequence[Sequence]) -> dict[str, int]:
    """name -> element count of a step-log header layout (``[[name, shape, dtype], ...]``)."""
    return {name: math.prod(shape) for name, shape, *_ in layout}


def split_units(elements: Mapping[str, int], shards: int) -> list[ShardRange]:
    """Split the model's units, in layout order, into ``shards`` contiguous ranges balanced by element
    count: the largest range's element count is the smallest any contiguous split reaches (the
    shadow keeps up only as fast as its slowest shard). Ties go to the split that fills earlier
    shards first, so the result is a pure function of the layout.

    Args:
        elements: parameter name -> element count, in canonical (``named_parameters``) order.
        shards: K >= 1.

    Raises:
        ValueError: ``shards`` < 1 or more than the model has units (the message names the count).
    """
    groups = group_by_unit(elements)
    units = list(groups)
    if not 1 <= shards <= len(units):
        raise ValueError(f"shadow_shards must be in 1..{len(units)} (the model's units: {units[0]} .. {units[-1]}), got {shards}")
    sizes = [sum(elements[n] for n in groups[u]) for u in units]
    cuts = _balanced_cuts(sizes, shards)
    ranges, first = [], 0
    for shard, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, len(units)])):
        count = sum(len(groups[u]) for u in units[lo:hi])
        ranges.append(ShardRange(shard, tuple(units[lo:hi]), first, first + count, sum(sizes[lo:hi])))
        first += count
    return ranges


def _balanced_cuts(sizes: list[int], parts: int) -> list[int]:
    """The ``parts - 1`` cut positions into ``sizes`` that minimise the largest part's sum (every part
    non-empty); a dynamic programme over prefixes, O(parts * n^2), n = units (tens)."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[p][i]: the smallest largest-part sum splitting sizes[:i] into p parts; cut[p][i]: where the last part starts
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(i - 1, p - 2, -1):  # the last part is sizes[j:i]; larger j first: earlier parts fuller
                cost = max(best[p - 1][j], prefix[i] - prefix[j])
                if cost < best[p][i]:
                    best[p][i], cut[p][i] = cost, j
    cuts, i = [], n
    for p in range(parts, 1, -1):
        i = cut[p][i]
        cuts.append(i)
    return cuts[::-1]


def assemble(images: Sequence[Mapping], step: int) -> tuple[dict | None, str | None]:
    """One state from the shards' images of ``step``, or the reason there is none.

    Args:
        images: each shard's ``ShadowActor.image`` answer, ``{"step": int, "state": ordered name ->
            array}``, in shard order (None for a shard that did not answer).
        step: the step every image must be at (the end of the durable log).

    Returns:
        ``(state, None)``: name -> array, the shards' tensors in shard order (the canonical order,
        as shards are contiguous); or ``(None, reason)`` when a shard is missing, at another step,
        or two shards hold the same tensor.
    """
    state: dict = {}
    for shard, image in enumerate(images):
        if image is None:
            return None, f"shadow shard {shard} did not serve an image"
        if image["step"] != step:
            return None, f"shadow shard {shard} served step {image['step']}, the log ends at {step}"
        overlap = state.keys() & image["state"].keys()
        if overlap:
            return None, f"shadow shard {shard} holds tensors another shard holds too ({sorted(overlap)[:3]})"
        state.update(image["state"])
    return state, None
