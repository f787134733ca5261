"""Split-independent MeZO losses (``training.groups``): example groups, their assignment to ranks, the
summed group vector and its reduction in group order; the config's ``micro_batch_size``."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from raycheck.job.config import JobConfig
from raycheck.training.data import batch_indices
from raycheck.training.groups import example_groups, group_vector, groups_of_rank, reduce_groups
from raycheck.training.model import default_cache_dir, load_model, trainable_parameters
from raycheck.training.state import state_sha256
from conftest import zo_step_
from raycheck.workers.zo_session import timed_append
from raycheck.training.zo import ZOHyper, perturb_all_, step_seed


def summed_over_ranks(terms: dict[int, tuple[tuple[float, float], tuple[float, float]]], world: int) -> torch.Tensor:
    """Each rank's group vector for ``terms`` (group -> (plus, minus)), summed over ranks in every order:
    the sums must all be the same bits (asserted); returns one of them."""
    n = len(terms)
    vectors = []
    for rank in range(world):
        mine = groups_of_rank(n, rank, world)
        vectors.append(group_vector(n, mine, [terms[g][0] for g in mine], [terms[g][1] for g in mine]))
    sums = set()
    for order in itertools.permutations(vectors):
        total = torch.zeros_like(vectors[0])
        for v in order:
            total += v
        sums.add(total.numpy().tobytes())
    assert len(sums) == 1
    return total


def test_groups_are_dealt_and_every_group_is_scored_by_exactly_one_rank():
    idx = np.arange(100, 112)
    assert [g.tolist() for g in example_groups(idx, 4)] == [[100, 103, 106, 109], [101, 104, 107, 110], [102, 105, 108, 111]]
    assert [g.tolist() for g in example_groups(idx, 6)] == [idx[0::2].tolist(), idx[1::2].tolist()]  # the old 2-worker split
    assert [g.tolist() for g in example_groups(idx, 12)] == [idx.tolist()]
    for n, world in [(3, 1), (3, 2), (3, 3), (8, 3)]:
        owned = sorted(g for r in range(world) for g in groups_of_rank(n, r, world))
        assert owned == list(range(n))
    with pytest.raises(ValueError, match="cannot be cut into groups of 5"):
        example_groups(idx, 5)
    with pytest.raises(ValueError, match="2 example groups cannot be shared by 3 workers"):
        groups_of_rank(2, 0, 3)


def test_the_reduced_losses_are_the_same_bits_on_any_worker_count():
    rng = np.random.default_rng(7)
    terms = {g: ((float(rng.random() * 3), 1.0), (float(rng.random() * 3), 1.0)) for g in range(6)}
    results = {world: reduce_groups(summed_over_ranks(terms, world)) for world in (1, 2, 3, 6)}
    assert len(set(results.values())) == 1
    assert results[1] == (math.fsum(terms[g][0][0] for g in range(6)) / 6, math.fsum(terms[g][1][0] for g in range(6)) / 6)


def test_one_group_gives_back_its_own_loss_and_causal_groups_are_token_weighted():
    loss = 0.6931471824645996  # a float32 mean, as classification_loss returns it
    assert reduce_groups(group_vector(1, [0], [(loss, 1.0)], [(loss / 3, 1.0)])) == (loss, loss / 3)
    vec = group_vector(2, [0, 1], [(10.0, 4.0), (2.0, 1.0)], [(5.0, 4.0), (0.5, 1.0)])
    assert reduce_groups(vec) == (12.0 / 5.0, 5.5 / 5.0)
    with pytest.raises(ValueError, match=r"example groups \[1\] have no weight"):
        reduce_groups(group_vector(2, [0], [(1.0, 1.0)], [(1.0, 1.0)]))
    with pytest.raises(ValueError, match="group 0: loss\\+ weighs 4.0, loss- 3.0"):
        group_vector(1, [0], [(1.0, 4.0)], [(1.0, 3.0)])


def test_micro_batch_size_is_checked_and_sets_the_trajectory_hash_instead_of_the_worker_count(tmp_path):
    base = dict(out_dir=str(tmp_path), cache_dir=str(tmp_path), model="tiny", batch_size=8)
    assert JobConfig(**base).example_group_size == 8 and JobConfig(**base, workers=2).example_group_size == 4
    with pytest.raises(ValueError, match=r"batch_size 8 in micro-batches of 8 gives 1 example group\(s\), fewer than workers \(2\): "
                                         "set zo.micro_batch_size to at most 4"):
        JobConfig(**base, workers=2, zo={"micro_batch_size": 8})
    with pytest.raises(ValueError, match=r"batch_size \(8\) must be a multiple of zo.micro_batch_size \(3\)"):
        JobConfig(**base, zo={"micro_batch_size": 3})
    with pytest.raises(ValueError, match="micro_batch_size must be >= 0"):
        JobConfig(**base, zo={"micro_batch_size": -1})
    grouped = {w: JobConfig(**base, workers=w, zo={"micro_batch_size": 2}).trajectory_sha256() for w in (1, 2, 4)}
    assert len(set(grouped.values())) == 1  # one trajectory on any worker count
    assert grouped[1] != JobConfig(**base, zo={"micro_batch_size": 4}).trajectory_sha256()
    assert JobConfig(**base).trajectory_sha256() != JobConfig(**base, workers=2).trajectory_sha256()


def states_after(cfg: JobConfig, data, encoder, steps: int) -> list[str]:
    """State sha256 after each of ``steps`` MeZO steps of the tiny model by the worker's own step, one worker."""
    model = load_model("tiny")
    params = trainable_parameters(model)
    hashes = []
    for step in range(steps):
        zo_step_(params, model, encoder, data[0], cfg, step, 0, 1, ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps),
                 fail=lambda: None, commit=timed_append(None))
        hashes.append(state_sha256(params))
    return hashes


def test_the_groups_decide_the_trajectory_so_the_worker_count_check_can_fail(tmp_path, data, encoder):
    """Before example groups a one-worker run scored the batch as one group and a two-worker run as two:
    different trajectories. One group (``micro_batch_size`` 8) against two (4) gives other state bits
    from the first step, so the Ray test's 1-worker = 2-worker comparison (the two-worker test of tests/test_end_to_end.py) can fail."""
    cfg = JobConfig(out_dir=str(tmp_path), cache_dir=str(default_cache_dir()), model="tiny", steps=2, batch_size=8, zo={"lr": 1e-3})
    one_group = states_after(cfg, data, encoder, 2)
    two_groups = states_after(cfg.replace(zo={"micro_batch_size": 4}), data, encoder, 2)
    assert one_group[0] != two_groups[0] and one_group[1] != two_groups[1]
    assert states_after(cfg.replace(zo={"micro_batch_size": 4}), data, encoder, 2) == two_groups  # deterministic


def test_one_group_per_worker_keeps_the_losses_of_the_split_before_groups(tmp_path, data, encoder):
    """The default groups of a 2-worker run are the old shards ``idx[r::2]``, reduced to the old float64
    mean (``(l0 + l1) / 2`` of the old all-reduce): existing runs keep their bits and trajectory hashes."""
    cfg = JobConfig(out_dir=str(tmp_path), cache_dir=str(default_cache_dir()), model="tiny", steps=1, batch_size=8, workers=2)
    model = load_model("tiny")
    params = trainable_parameters(model)
    record, _ = zo_step_(params, model, encoder, data[0], cfg.replace(workers=1, zo={"micro_batch_size": 4}), 0, 0, 1,
                         ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps), fail=lambda: None, commit=timed_append(None))
    fresh = load_model("tiny")
    fresh_params = trainable_parameters(fresh)
    idx = batch_indices(cfg.seed, 0, cfg.batch_size, len(data[0]))
    perturb_all_(fresh_params, step_seed(cfg.seed, 0), cfg.zo.eps)
    old = torch.tensor([encoder.loss(fresh, data[0], idx[r::2]) for r in range(2)], dtype=torch.float64)
    assert record.loss_plus == float(old.sum() / 2)
