"""Split-independent MeZO losses: a step's batch in fixed example groups, reduced in a fixed order.

A step's batch (``training.data.batch_indices``, ``batch_size`` indices) is dealt into example groups
of ``group_size`` indices (``JobConfig.example_group_size``, ``example_groups``); group g is scored by rank
``g % world`` (``groups_of_rank``), as one forward pass of exactly those examples. Each rank writes its
groups' terms into a float64 vector of every group, zeros elsewhere (``group_vector``); the vectors are
summed across ranks (each element has one non-zero contribution, so the sum is exact in any order), and
every rank reduces the summed vector in group order (``reduce_groups``). The losses, hence the projected
gradient and the whole trajectory, do not depend on the number of workers: docs/elastic.md gives the
argument and where it breaks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

Terms = tuple[float, float]
"""An example group's loss terms: (numerator, weight) with loss = numerator / weight (the encoders'
``loss_terms``: a classification group's mean loss and 1, a causal-LM group's summed nats and tokens)."""

ROWS = 3
"""Rows of a step's group vector: loss+ numerators, loss- numerators, weights."""


def example_groups(indices: np.ndarray, group_size: int) -> list[np.ndarray]:
    """``indices`` (a step's batch, in random order) dealt into G = len / ``group_size`` groups of
    ``group_size``: group g holds ``indices[g::G]``. Dealt, not cut, so that one group per worker is the
    split of the runs before example groups (rank r scored ``indices[r::world]``): their trajectories stay.

    Raises:
        ValueError: ``len(indices)`` is not a multiple of ``group_size``.
    """
    if group_size < 1 or len(indices) % group_size:
        raise ValueError(f"a batch of {len(indices)} examples cannot be cut into groups of {group_size}")
    n_groups = len(indices) // group_size
    return [indices[g::n_groups] for g in range(n_groups)]


def groups_of_rank(n_groups: int, rank: int, world: int) -> range:
    """The groups rank ``rank`` of ``world`` scores: g with g % world == rank (every group exactly once).

    Raises:
        ValueError: fewer groups than workers (a worker would score nothing), or ``rank`` not in [0, world).
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of {world} workers")
    if n_groups < world:
        raise ValueError(f"{n_groups} example groups cannot be shared by {world} workers")
    return range(rank, n_groups, world)


def group_vector(n_groups: int, groups: Sequence[int], plus: Sequence[Terms], minus: Sequence[Terms]) -> torch.Tensor:
    """[ROWS, n_groups] float64: column g holds (loss+ numerator, loss- numerator, weight) of group g
    for the ``groups`` given (``plus[i]``, ``minus[i]`` are group ``groups[i]``'s terms), zeros elsewhere.

    Raises:
        ValueError: a group's loss+ and loss- weights differ (they count the same examples and tokens).
    """
    vec = torch.zeros((ROWS, n_groups), dtype=torch.float64)
    for g, (num_plus, weight), (num_minus, weight_minus) in zip(groups, plus, minus, strict=True):
        if weight != weight_minus:
            raise ValueError(f"group {g}: loss+ weighs {weight}, loss- {weight_minus}; both count the same examples")
        vec[:, g] = torch.tensor([num_plus, num_minus, weight], dtype=torch.float64)
    return vec


def reduce_groups(vec: torch.Tensor) -> tuple[float, float]:
    """(loss+, loss-) of a step from its summed group vector (``group_vector`` of every rank, summed):
    each row summed over the groups (``math.fsum``: correctly rounded, so the same in any order), the
    numerators divided by the summed weight. One group gives back its own terms' quotient exactly.

    Raises:
        ValueError: ``vec`` is not [ROWS, G] or a group has no weight (no rank scored it).
    """
    if vec.ndim != 2 or vec.shape[0] != ROWS:
        raise ValueError(f"a group vector is [{ROWS}, groups], got {list(vec.shape)}")
    rows = vec.tolist()
    missing = [g for g, w in enumerate(rows[2]) if not w > 0]
    if missing:
        raise ValueError(f"example groups {missing} have no weight: no worker scored them")
    weight = math.fsum(rows[2])
    return math.fsum(rows[0]) / weight, math.fsum(rows[1]) / weight


Exchange = Callable[[int, torch.Tensor], torch.Tensor]
"""Sums a step's group vectors across the workers: ``exchange(step, own_vector) -> summed vector``."""


def single_worker(step: int, vec: torch.Tensor) -> torch.Tensor:
    """The ``Exchange`` of a run with one worker: its own vector is the sum."""
    return vec
