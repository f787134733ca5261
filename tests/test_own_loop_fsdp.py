"""FSDP2 from your own first-order loop (``workers.own_loop.FirstOrderCheckpoints`` over a model you sharded
with ``fully_shard``), without Ray: 2 gloo ranks (``torch.multiprocessing``), your own module, AdamW,
sharded checkpoints in a local store. A crash after step 5 (checkpoints every 3 steps: the newest is
step 3's), a restart in the same processes restores it and trains on to step 8: bitwise the run that was
not interrupted (sha256 of every tensor, re-gathered). The final snapshot loads in one call into the
model unsharded, in a process without torch.distributed (DCP reshards): bitwise that state.

Layer-wise (``training.sharded.ShardedLayerwiseCheckpointer``): with threshold 0 the same crash and
restart is bitwise the uninterrupted run; with a byte budget per check that fits one layer, the check of
step 6 rewrites some units and the composite reads the others from step 3's checkpoint: a restore loads
each unit (weights and AdamW moments) bitwise as it was at the step the composite records for it, in the
FSDP2 ranks and unsharded in one process."""

from __future__ import annotations

import collections
import json
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from typer.testing import CliRunner

from conftest import free_port
from raycheck.cli.main import app
from raycheck.job.config import DifferentialConfig, OverlappedConfig
from raycheck.policies.layerwise import LayerwiseConfig
from raycheck.storage.dcp_store import ShardedStore
from raycheck.storage.manifest import RunIdentity
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.units import group_by_unit
from raycheck.storage.pointers import POINTER_FILE, pointer, store_at
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


def unit_hashes(model: Net, opt: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of each unit's tensors (weights and AdamW state, re-gathered: a collective)."""
    full = full_state(ModelOptimizerState(model, opt).view())
    return {u: state_sha256({n: full[n] for n in names}) for u, names in group_by_unit(full).items()}


def crash_and_restart(rank: int, world: int, root: str, crash_after: int, save_now: bool = False, **kw) -> dict:
    """A run (``FirstOrderCheckpoints`` with ``kw``) that crashes after ``crash_after`` steps (its writes
    done; ``save_now``: after a just-in-time save of that step, as on a preemption notice), restarts,
    restores and trains on to ``STEPS``: what it restored (step, each unit's step and hash; and the hashes
    of the same checkpoint loaded into the model unsharded) and the final state."""
    def checkpoints(model: Net, opt: torch.optim.Optimizer) -> FirstOrderCheckpoints:
        return FirstOrderCheckpoints(model, opt, root, every_steps=EVERY, report=False, preemption=False, **kw)

    model, opt = sharded(rank, world)
    ckpt = checkpoints(model, opt)
    ckpt.restore()
    train(model, opt, 0, crash_after, rank, world, ckpt)
    if save_now:
        assert ckpt.checkpointer is not None
        ckpt.checkpointer.save_now(crash_after, ckpt.state.view)
    ckpt.flush()
    model, opt = sharded(rank, world)  # the restart
    ckpt = checkpoints(model, opt)
    out = {"restored": ckpt.restore(), "unit_steps": ckpt.restored.get("unit_steps"), "units": unit_hashes(model, opt),
           "folder": ckpt.restored["folder"], "base_step": ckpt.restored["base_step"], "replayed_steps": ckpt.restored["replayed_steps"]}
    plain, plain_opt = make()
    load_checkpoint(f"{root}/sharded/{out['folder']}", plain, plain_opt)  # in one process, whole tensors
    full = ModelOptimizerState(plain, plain_opt).view()
    out["unsharded_units"] = {u: state_sha256({n: full[n] for n in names}) for u, names in group_by_unit(full).items()}
    train(model, opt, out["restored"], STEPS, rank, world, ckpt)
    out.update(closed=ckpt.close(), final=state_of(model, opt))
    return out


def _rank_main(rank: int, world: int, port: int, root: str, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out: dict = {}
    model, opt = sharded(rank, world)
    out["units_at"] = {}
    for start, stop in ((0, EVERY), (EVERY, 2 * EVERY), (2 * EVERY, STEPS)):
        train(model, opt, start, stop, rank, world)
        out["units_at"][stop] = unit_hashes(model, opt)
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
        FirstOrderCheckpoints(model, opt, SnapshotStore(root, identity=RunIdentity("own", "x")), report=False, preemption=False)
    except ValueError as exc:
        out["plain_store"] = str(exc)
    out["exact"] = crash_and_restart(rank, world, f"{root}-exact", CRASH_AFTER, strategy="layerwise", layerwise=LayerwiseConfig(threshold=0.0))
    out["budget"] = crash_and_restart(rank, world, f"{root}-budget", 2 * EVERY + 1, strategy="layerwise", keep=1,
                                      layerwise=LayerwiseConfig(threshold=0.0, max_bytes_per_check=4000))
    out["differential"] = crash_and_restart(rank, world, f"{root}-differential", CRASH_AFTER + 1, strategy="differential",
                                            differential=DifferentialConfig(full_every_steps=4, batch_steps=1))
    out["differential_jit"] = crash_and_restart(rank, world, f"{root}-differential-jit", CRASH_AFTER, save_now=True, strategy="differential",
                                                differential=DifferentialConfig(full_every_steps=100, batch_steps=10))
    out["overlapped"] = crash_and_restart(rank, world, f"{root}-overlapped", CRASH_AFTER, strategy="overlapped",
                                          overlapped=OverlappedConfig(chunks=2))
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
    assert out["plain_store"] == ("FSDP2 (DTensor parameters) writes sharded checkpoints, every rank its rows: give storage as a "
                                  "path, URI or ShardedStore, not a SnapshotStore")


def test_your_fsdp2_loop_differential_replays_every_ranks_gradient_rows_and_continues_bitwise(ran):
    """A full checkpoint every 4 steps, each step's record in its own batch: the crash after step 6
    restores the full checkpoint of step 4 and replays each rank's rows of steps 4 and 5 through AdamW:
    bitwise the state after 6 steps (each unit), and the run ends bitwise the uninterrupted one."""
    _, out = ran
    differential = out["differential"]
    assert differential["restored"] == 2 * EVERY and differential["units"] == out["units_at"][2 * EVERY]
    assert differential["final"] == out["reference"]
    assert (differential["base_step"], differential["replayed_steps"]) == (4, 2)
    # a just-in-time save (a preemption notice) after step 5 writes every rank's pending records (nothing was
    # due: batches of 10 steps): the restart replays all 5 from the initial full checkpoint, bitwise
    jit = out["differential_jit"]
    assert (jit["restored"], jit["base_step"], jit["replayed_steps"]) == (CRASH_AFTER, 0, CRASH_AFTER)
    assert jit["final"] == out["reference"]


def test_your_fsdp2_loop_layerwise_at_threshold_0_restores_and_continues_bitwise(ran):
    _, out = ran
    exact = out["exact"]
    assert exact["restored"] == EVERY and set(exact["unit_steps"].values()) == {EVERY}
    assert exact["units"] == out["units_at"][EVERY] and exact["final"] == out["reference"]


def test_your_fsdp2_loop_overlapped_restores_the_caught_up_snapshot_and_continues_bitwise(ran):
    """Two chunks: the snapshot due after step 3 stages a chunk after steps 3 and 4, each rank catches the
    first up by step 4's gradient rows: the restart restores step 4, bitwise the state then (every unit),
    and ends bitwise the uninterrupted run."""
    _, out = ran
    overlapped = out["overlapped"]
    assert overlapped["restored"] == EVERY + 1 and overlapped["final"] == out["reference"]
    assert overlapped["units"] == overlapped["unsharded_units"]


def test_a_sharded_layerwise_composite_restores_each_unit_bitwise_as_of_its_own_step(ran):
    """The budget fits one layer per check: the composite of step 6 mixes units of steps 3 and 6 (the
    parameter groups, unchanged, stay at 3), each loaded bitwise as it was then: in the FSDP2 ranks, and
    into the model unsharded. With ``keep`` 1, step 3's checkpoint left the index but the files of its
    units that the composite reads stayed; the newest composite (step 8) still reads older folders."""
    root, out = ran
    budget = out["budget"]
    steps = budget["unit_steps"]
    assert budget["restored"] == 2 * EVERY and set(steps.values()) == {EVERY, 2 * EVERY} and steps["param_groups.0"] == EVERY
    assert budget["units"] == budget["unsharded_units"] == {u: out["units_at"][s][u] for u, s in steps.items()}
    store = ShardedStore(f"{root}-budget")
    [newest] = store.list()
    assert newest.step == STEPS and {s["folder"] for s in newest.manifest["layers"].values()} != {newest.folder}
    assert store.unindexed() == [] and store.verify(newest) == []
    # each unit of a composite is a DCP checkpoint of its own: of the older folders, retention kept the files of
    # the units the newest composite reads, and nothing else
    kept = {p for p in store.storage.list() if p.startswith("step-")}
    assert kept == {u["path"] for u in newest.manifest["units"].values()} | {f"{newest.folder}/manifest.json"}
    assert all(s["folder"] == f"{s['folder'].split('/')[0]}/{u}" for u, s in newest.manifest["layers"].items())
    found = store_at(f"{root}-budget")  # the store's folder stands for its sharded checkpoints (raycheck export STORE)
    assert isinstance(found, ShardedStore) and found.list()[-1].folder == newest.folder
    listed = CliRunner().invoke(app, ["inspect", f"{root}-budget"])
    steps = collections.Counter(s["step"] for s in newest.manifest["layers"].values())
    assert listed.exit_code == 0 and f"units ({', '.join(f'{n} @ step {s}' for s, n in sorted(steps.items()))})" in listed.output


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
