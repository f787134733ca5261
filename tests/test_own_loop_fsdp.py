"""FSDP2 from your own first-order loop (``workers.own_loop.FirstOrderCheckpoints`` over a model you sharded
with ``fully_shard``), without Ray: 2 gloo ranks (``torch.multiprocessing``), your own module, AdamW,
sharded checkpoints in a local store. A crash after step 5 (checkpoints every 3 steps: the newest is
step 3's), a restart in the same processes restores it and trains on to step 8: bitwise the run that was
not interrupted (sha256 of every tensor, re-gathered). The final snapshot loads in one call into the
model unsharded, in a process without torch.distributed (DCP reshards): bitwise that state."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from conftest import free_port
from raycheck.storage.dcp_store import ShardedStore
from raycheck.storage.pointers import POINTER_FILE, pointer
from raycheck.training.optim_state import ModelOptimizerState, StateMismatchError
from raycheck.training.sharded import full_state
from raycheck.training.state import state_sha256
from raycheck.workers.own_loop import FirstOrderCheckpoints, load_checkpoint
from test_own_loop import Net, make

STEPS, CRASH_AFTER, EVERY = 8, 5, 3


def sharded(rank: int, world: int) -> tuple[Net, torch.optim.AdamW]:
    """``make()``'s model and AdamW, the model sharded by FSDP2 (each layer, then the root)."""
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train(model: Net, opt: torch.optim.Optimizer, start: int, stop: int, rank: int, world: int,
          ckpt: FirstOrderCheckpoints | None = None) -> None:
    """Steps ``start`` to ``stop`` - 1, rank ``rank``'s part of each step's batch (seeded by the step)."""
    for i in range(start, stop):
        g = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(4 * world, 6, generator=g), torch.randint(0, 2, (4 * world,), generator=g)
        torch.nn.functional.cross_entropy(model(x[rank::world]), y[rank::world]).backward()
        opt.step()
        opt.zero_grad()
        if ckpt is not None:
            ckpt.after_step(i + 1)


def state_of(model: Net, opt: torch.optim.Optimizer) -> str:
    return state_sha256(full_state(ModelOptimizerState(model, opt).view()))


def _rank_main(rank: int, world: int, port: int, root: str, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out: dict = {}
    model, opt = sharded(rank, world)
    train(model, opt, 0, STEPS, rank, world)
    out["reference"] = state_of(model, opt)

    model, opt = sharded(rank, world)  # the first incarnation: crashes after step 5 (its writes done, never closed)
    ckpt = FirstOrderCheckpoints(model, opt, root, strategy="full-async", every_steps=EVERY, report=False, preemption=False)
    out["start"] = ckpt.restore()
    train(model, opt, 0, CRASH_AFTER, rank, world, ckpt)
    ckpt.flush()

    model, opt = sharded(rank, world)  # the restart
    ckpt = FirstOrderCheckpoints(model, opt, root, strategy="full-async", every_steps=EVERY, report=False, preemption=False)
    out["restored"] = ckpt.restore()
    out["restored_state"] = state_of(model, opt)
    train(model, opt, out["restored"], STEPS, rank, world, ckpt)
    out["closed"] = ckpt.close()
    out["final"] = state_of(model, opt)
    try:
        FirstOrderCheckpoints(model, opt, root, strategy="layerwise", report=False, preemption=False)
    except ValueError as exc:
        out["layerwise"] = str(exc)
    if rank == 0:
        torch.save(out, result)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    root = tmp_path_factory.mktemp("own-fsdp")
    result = root / "rank0.pt"
    mp.spawn(_rank_main, args=(2, free_port(), str(root / "store"), str(result)), nprocs=2)
    return root / "store", torch.load(result, weights_only=False)


def test_your_fsdp2_loop_restores_its_sharded_checkpoint_and_continues_bitwise(ran):
    root, out = ran
    assert out["start"] == 0 and out["restored"] == 3
    assert out["final"] == out["reference"] and out["restored_state"] != out["reference"]
    assert out["closed"]["newest"].startswith("step-0000000008-") and out["closed"]["storage"] == str(root)
    assert [i.step for i in ShardedStore(str(root)).list()] == [3, 6, 8]
    assert out["layerwise"] == ("FSDP2 (DTensor parameters): strategy full-sync or full-async with storage as a path, URI or "
                                "ShardedStore (sharded checkpoints, every rank writes its rows); got layerwise")


def test_the_final_sharded_snapshot_loads_into_the_model_unsharded_in_one_call(ran, tmp_path):
    """From its folder, and from the pointer Ray Train would hold (``storage.pointers``)."""
    root, out = ran
    model, opt = make()
    assert load_checkpoint(str(root / "sharded" / out["closed"]["newest"]), model, opt) == STEPS
    assert state_sha256(ModelOptimizerState(model, opt).view()) == out["final"]
    store = ShardedStore(str(root))
    (tmp_path / out["closed"]["newest"]).mkdir()
    (tmp_path / out["closed"]["newest"] / POINTER_FILE).write_text(json.dumps(pointer(store, store.list()[-1])))
    model, opt = make()
    assert load_checkpoint(str(tmp_path / out["closed"]["newest"]), model, opt) == STEPS
    assert state_sha256(ModelOptimizerState(model, opt).view()) == out["final"]
    narrow = Net(hidden=8)  # another shape: refused before DCP reads a byte, not taken for a corrupt checkpoint
    with pytest.raises(StateMismatchError, match=r"'embed.weight' is torch.float32 \[16, 6\] there, torch.float32 \[8, 6\] here; nothing was loaded$"):
        load_checkpoint(str(tmp_path / out["closed"]["newest"]), narrow)
