"""Pinned trajectories: hashes written by the code of main 71c50b6 (the unfused torch-op primitives
that held z for the whole step), which every later version must reproduce bit for bit (issue 31:
fusing the generator with the perturbation and update must not change a bit of any logged run).

Two kinds: ``zo.replay_step_`` over hand-made tensors (lengths not a multiple of 4, odd shapes,
weight decay on and off) in each dtype, and the worker's own MeZO step (``zo_step_``, the two
forward passes of the tiny model) in each dtype, by ``tests/test_dtypes.py``'s ``runs`` fixture.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import pytest
import torch

from raycheck.training import zo
from raycheck.training.state import state_sha256

SHAPES = [(257, 33), (1000,), (3, 5, 7), (1,), (6,), (4, 9)]

REPLAY = {
    "float32": ["304599e138970b92", "0d32c6344193fa5a", "7901412c82c6d6f9", "e4ab75b7faee6721", "1bd286b6bf9d15f0",
                "ee9bcab8fb5d653e"],
    "bfloat16": ["71fea5639eed7757", "125029b7dd04b4e1", "88d2e44475a87d87", "91b15f150f8fb14a", "94cb22cbbb4c12f1",
                 "480f572b9c500192"],
    "float16": ["2ace9847a1740bd8", "fc55c1ed41cef83a", "97e4874333dfe032", "17542b711fc51d33", "fb4c068ec7e3cbd8",
                "b590e95984d1cccd"],
}
"""First 16 hex digits of the sha256 of each tensor's bytes after five ``replay_step_`` calls."""

NOISE = {"float32": "eb99e4a79e666dfb", "bfloat16": "b1740156c171b92d", "float16": "71c16f2b1338da20"}
"""First 16 hex digits of the sha256 of ``zo.noise(step_seed(3, 4), 5, <1001 elements of the dtype>)``."""


def short_sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def initial(dtype: torch.dtype) -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict((f"p{i}", (zo.noise(zo.step_seed(99, 0), i, torch.empty(s)) * 0.02).to(dtype))
                       for i, s in enumerate(SHAPES))


@pytest.mark.parametrize("dtype", list(REPLAY))
@pytest.mark.parametrize("threads", [1, 2])
def test_replay_reproduces_the_pinned_hashes_of_every_tensor(dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        params = initial(zo.DTYPES[dtype])
        for t in range(5):
            zo.replay_step_(params, zo.step_seed(0, t), (-1) ** t * 0.37, 1e-3, 1e-3, 0.01 if t % 2 else 0.0)
    finally:
        torch.set_num_threads(before)
    assert [short_sha(p) for p in params.values()] == REPLAY[dtype]


@pytest.mark.parametrize("dtype", list(NOISE))
def test_noise_in_each_dtype_reproduces_the_pinned_hash(dtype):
    assert short_sha(zo.noise(zo.step_seed(3, 4), 5, torch.empty(1001, dtype=zo.DTYPES[dtype]))) == NOISE[dtype]
