"""Exactness of replay, checked bitwise on the tiny model with real snippets."""

from collections import OrderedDict

import pytest
import torch

from raycheck.training.data import batch_indices, classification_loss
from raycheck.training.model import trainable_parameters
from raycheck.training.state import copy_state, load_into, state_sha256
from raycheck.training.zo import (
    ZOHyper, decays, derive_seed, noise, perturb_, perturb_all_, replay_step_, reset_and_update_all_, step_seed, update_,
)

HYPER = ZOHyper(lr=1e-3, eps=1e-3, weight_decay=0.01)  # a large lr so the updates are visible


def worker_steps(model, encoder, train, steps: int) -> list[tuple[int, float]]:
    """The worker's phase-by-phase MeZO steps (z regenerated for each of its three passes: +eps, -2 eps,
    then the reset fused with the update); returns (seed, projected_grad) per step."""
    params = trainable_parameters(model)
    out = []
    for step in range(steps):
        seed = step_seed(0, step)
        idx = batch_indices(0, step, 8, len(train))
        perturb_all_(params, seed, HYPER.eps)
        lp = classification_loss(model, encoder, train, idx)
        perturb_all_(params, seed, -2 * HYPER.eps)
        lm = classification_loss(model, encoder, train, idx)
        g = (lp - lm) / (2 * HYPER.eps)
        reset_and_update_all_(params, seed, g, HYPER)
        out.append((seed, g))
    return out


def test_fused_replay_is_bitwise_equal_to_the_worker_and_shortcut_is_not(tiny_model, encoder, data):
    params = trainable_parameters(tiny_model)
    initial = copy_state(params)
    records = worker_steps(tiny_model, encoder, data[0], steps=4)
    assert any(g != 0 for _, g in records)
    worker_sha = state_sha256(params)

    load_into(params, initial)
    for seed, g in records:
        replay_step_(params, seed, g, HYPER.lr, HYPER.eps, HYPER.weight_decay)
    assert state_sha256(params) == worker_sha

    load_into(params, initial)  # "shortcut" replay: the update only, no perturbation round trip
    for seed, g in records:
        for i, (name, p) in enumerate(params.items()):
            update_(p, noise(seed, i, p), g, HYPER.lr, HYPER.weight_decay if decays(name, p) else 0.0)
    assert state_sha256(params) != worker_sha


def test_shards_replaying_contiguous_ranges_with_their_first_index_equal_the_full_replay(tiny_model):
    params = trainable_parameters(tiny_model)
    reference = copy_state(params)
    replay_step_(params, 7, 0.5, 1e-3, 1e-3, 0.0)
    full = state_sha256(params)
    load_into(params, reference)
    names, cut = list(params), len(params) // 2  # two shards' contiguous ranges, each with its own first index
    for first, part in ((0, names[:cut]), (cut, names[cut:])):
        replay_step_(OrderedDict((n, params[n]) for n in part), 7, 0.5, 1e-3, 1e-3, 0.0, first_index=first)
    assert state_sha256(params) == full


def test_perturbation_round_trip_is_not_an_identity():
    p = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    before = p.clone()
    for scale in (1e-3, -2e-3, 1e-3):
        perturb_all_({"p": p}, 3, scale)
    changed = (p != before).float().mean().item()
    assert 0.2 < changed < 0.8


def test_noise_is_independent_of_thread_count_and_stable():
    like = torch.empty(300_001)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = noise(11, 5, like)
        torch.set_num_threads(2)
        two = noise(11, 5, like)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_derive_seed_is_pinned_63_bit_and_depends_on_every_part_and_its_order():
    # Pinned (blake2b-64 of the little-endian uint64 parts, top bit cleared): old logs must replay.
    # (1, 2) hashes to 11868681386100499350 >= 2**63, so the mask is exercised.
    pinned = {(1, 2): 2645309349245723542, (2, 1): 2978616508021363102, (1,): 9008652467591447603,
              (): 3797230976420062948, (2**64 - 1, 0): 1267674560764357290}
    assert {parts: derive_seed(*parts) for parts in pinned} == pinned
    assert step_seed(0, 0) == derive_seed(0, 0) == 1041621211125469266
    assert all(0 <= seed < 2**63 for seed in pinned.values())


def test_hyper_parameters_accept_their_bounds_and_name_the_bad_field():
    assert ZOHyper(lr=0.0, eps=1e-9, weight_decay=0.0) == ZOHyper(lr=0.0, eps=1e-9, weight_decay=0.0)
    for field, value, message in [("eps", 0.0, "eps must be > 0, got 0.0"), ("eps", float("nan"), "eps must be > 0, got nan"),
                                  ("lr", -1e-9, "lr must be >= 0, got -1e-09"),
                                  ("weight_decay", -0.5, "weight_decay must be >= 0, got -0.5")]:
        with pytest.raises(ValueError) as err:
            ZOHyper(**{field: value})
        assert str(err.value) == message


def test_primitives_compute_the_documented_arithmetic_by_hand():
    """Values exact in float32, worked by hand from the formulas in the module docstring."""
    p = torch.tensor([1.0, 2.0])
    perturb_(p, torch.tensor([2.0, -4.0]), 0.25)  # p + z * 0.25
    assert p.tolist() == [1.5, 1.0]
    update_(p, torch.tensor([0.5, -1.0]), 2.0, 0.25, 0.5)  # u = z * 2 + p * 0.5 = [1.75, -1.5]; p - u * 0.25
    assert p.tolist() == [1.0625, 1.375]
    update_(p, torch.tensor([0.5, -1.0]), 2.0, 0.25, 0.0)  # no decay: u = [1, -2]
    assert p.tolist() == [0.8125, 1.875]


def test_weight_decay_applies_to_matrices_only_in_the_update():
    assert [decays("w", torch.empty(shape)) for shape in [(), (3,), (2, 3), (2, 3, 4)]] == [False, False, True, True]
    params = {"w": torch.ones(1, 2), "b": torch.ones(2)}
    replay_step_(params, 5, 0.0, 0.5, 0.0, 0.5)  # g = 0 and eps = 0: only the decay moves p, by lr * wd * p
    assert params["w"].tolist() == [[0.75, 0.75]] and params["b"].tolist() == [1.0, 1.0]
    replay_step_(params, 5, 0.0, 0.5, 0.0, 0.5)  # g = 0 and eps = 0: the decay alone, again on w only
    assert params["w"].tolist() == [[0.5625, 0.5625]] and params["b"].tolist() == [1.0, 1.0]


def test_noise_and_step_seeds_are_pinned():
    # Pinned (the portable Philox generator, training/noise.py): a change of generator, seed derivation or
    # argument order would make old logs unreplayable.
    assert noise(1, 2, torch.empty(3)).tolist() == [-0.402845174074173, 0.2036583423614502, 1.436982274055481]
    assert noise(2, 1, torch.empty(3)).tolist() == [-0.27147021889686584, -0.5455760359764099, 1.759026288986206]
    assert noise(1, 2, torch.empty(2, 1, dtype=torch.float64)).dtype == torch.float64
    assert noise(1, 2, torch.empty(2, 1)).shape == (2, 1)
    assert step_seed(1, 2) == 2645309349245723542 and step_seed(2, 1) == 2978616508021363102
