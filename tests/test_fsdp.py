"""FSDP2 first-order training with sharded checkpoints, without Ray: gloo process groups of 2, 1 and 3
ranks (``torch.multiprocessing``), the tiny model, the real snippets, checkpoints in a local store.

What must be bitwise equal, and what need not be:
- a restore loads, at any world size, weights and Adam moments (and step counts) bitwise equal to the
  state saved (compared re-gathered, by the sha256 of every tensor);
- a restart at the saved world size continues bitwise equal to the run that was not interrupted
  (same batch split, same reduction order);
- one rank under FSDP2 takes bitwise the step of the unsharded trainer (nothing to reduce);
- across world sizes the continuation is NOT expected to be bitwise equal: the batch is split
  differently and the gradients are averaged in another order (W partial means), so the next states
  differ by rounding. The test checks that they are finite and close, not equal.
"""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import typer

from conftest import free_port
from raycheck.job.config import JobConfig
from raycheck.cli.main import resume_config
from raycheck.storage.backend import Storage, StorageError
from raycheck.storage.dcp_store import ShardedStore
from raycheck.storage.manifest import RunIdentity
from raycheck.storage.tensor_files import as_numpy
from raycheck.training.data import PromptEncoder, batch_indices, load_rotten_tomatoes
from raycheck.training.fo import FOTrainer
from raycheck.training.model import load_model, load_tokenizer
from raycheck.training.sharded import ShardedCheckpointer, ShardedWriter, checkpoint_group, evaluate, full_state
from raycheck.training.state import state_sha256
from test_fo import HYPER

BATCH = 12  # divisible by 1, 2 and 3 ranks
IDENTITY = RunIdentity("fsdp-test", "0" * 64)


def tensor_hashes(state) -> dict[str, str]:
    return {n: hashlib.sha256(np.ascontiguousarray(as_numpy(t)).tobytes()).hexdigest() for n, t in state.items()}


def step(trainer: FOTrainer, split, t: int, rank: int, world: int) -> None:
    trainer.train_step(split, batch_indices(0, t, BATCH, len(split))[rank::world])


def _rank_main(rank: int, world: int, port: int, root: str, mode: str, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = checkpoint_group()
    encoder = PromptEncoder(load_tokenizer(), seq_len=32)
    split = load_rotten_tomatoes()[0]
    trainer = FOTrainer(load_model("tiny"), HYPER, encoder, sharded=True)
    store = ShardedStore(root, identity=IDENTITY)
    out = {}
    if mode == "save":  # 6 steps, async checkpoints at 2, 4, 6; then step 7 uninterrupted and from a restart
        out["accuracy"] = evaluate(trainer, encoder, load_rotten_tomatoes()[1], 32)  # before any training forward
        ckpt = ShardedCheckpointer(ShardedWriter(store, trainer.state_view(), group), every=2, asynchronous=True)
        for t in range(6):
            step(trainer, split, t, rank, world)
            ckpt.after_step(t + 1, trainer.state_view)
            if (t + 1) % 2 == 0:
                out[t + 1] = tensor_hashes(full_state(trainer.state_view()))
        out["closed"] = ckpt.close()
        step(trainer, split, 6, rank, world)
        out[7] = state_sha256(full_state(trainer.state_view()))
        restarted = FOTrainer(load_model("tiny"), HYPER, encoder, sharded=True)
        info, _ = store.restore(restarted.state_view(), group)
        out["restarted"] = (info.step, tensor_hashes(full_state(restarted.state_view())))
        step(restarted, split, 6, rank, world)
        out["restarted_7"] = state_sha256(full_state(restarted.state_view()))
    else:  # restore at this world size, one step; with "corrupt": then damage the newest two, restore again
        info, _ = store.restore(trainer.state_view(), group)
        out["restored"] = (info.step, tensor_hashes(full_state(trainer.state_view())))
        out["state6"] = {n: t.numpy().copy() for n, t in full_state(trainer.state_view()).items()}
        step(trainer, split, 6, rank, world)
        out[7] = {n: t.numpy().copy() for n, t in full_state(trainer.state_view()).items()}
        if mode == "corrupt":
            newest, older = store.list()[-1], store.list()[-2]
            if rank == 0:
                damage(store.storage, newest.manifest["units"]["__1_0.distcp"]["path"], older.manifest["units"]["__0_0.distcp"]["path"])
            dist.barrier()
            info, skipped = store.restore(trainer.state_view(), group)
            out["fallback"] = (info.step, tensor_hashes(full_state(trainer.state_view())), skipped)
    if rank == 0:
        torch.save(out, result)
    dist.destroy_process_group()


def damage(storage: Storage, flip: str, remove: str) -> None:
    """Flip one byte of ``flip`` and delete ``remove`` (two shard files of two checkpoints)."""
    blob = bytearray(storage.get(flip))
    blob[len(blob) // 2] ^= 0xFF
    storage.put(flip, bytes(blob))
    storage.delete(remove)


def spawn(world: int, root: str, mode: str, tmp: pathlib.Path) -> dict:
    """Run ``_rank_main`` on ``world`` ranks (``torch.multiprocessing.spawn``: a rank that fails ends the
    others and raises here); returns what rank 0 saw."""
    result = tmp / f"{mode}-{world}.pt"
    mp.spawn(_rank_main, args=(world, free_port(), root, mode, str(result)), nprocs=world)
    return torch.load(result, weights_only=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank FSDP2 run with sharded checkpoints at steps 2, 4 and 6, and what it saw."""
    root = tmp_path_factory.mktemp("sharded")
    return str(root / "store"), spawn(2, str(root / "store"), "save", root)


@pytest.fixture(scope="module")
def restarts(saved):
    """Restores of the 2-rank checkpoints at 1 rank, then at 3 ranks (which then damages two of them)."""
    root, _ = saved
    tmp = pathlib.Path(root).parent
    return spawn(1, root, "load", tmp), spawn(3, root, "corrupt", tmp)


def test_a_two_rank_checkpoint_restores_bitwise_and_a_restart_at_two_ranks_continues_bitwise(saved):
    root, out = saved
    assert [i.step for i in ShardedStore(root, identity=IDENTITY).list()] == [2, 4, 6]
    newest = ShardedStore(root, identity=IDENTITY).list()[-1]
    assert sorted(newest.manifest["units"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert newest.manifest["world_size"] == 2 and out["closed"]["checkpoints"] == 3
    assert out["restarted"] == (6, out[6])  # weights, both moments, step counts: every tensor bitwise
    assert out["restarted_7"] == out[7]  # same world size: the same next state


def test_a_sharded_model_evaluates_as_the_unsharded_one(saved, encoder, data):
    _, out = saved
    assert out["accuracy"] == evaluate(FOTrainer(load_model("tiny"), HYPER, encoder), encoder, data[1], 32)


def test_restores_at_one_and_three_ranks_load_the_two_rank_state_bitwise_and_continue(saved, restarts, encoder):
    (_, out), (one, three) = saved, restarts
    assert one["restored"] == three["restored"] == (6, out[6])  # every tensor, re-gathered, bitwise
    assert {n.split(".")[1] for n in out[6] if n.startswith("optim.")} == {"exp_avg", "exp_avg_sq", "step"}
    # one rank: nothing to reduce, so its FSDP2 step is the unsharded trainer's step from the same state
    plain = FOTrainer(load_model("tiny"), HYPER, encoder)
    plain.load_state(one["state6"])
    assert tensor_hashes(plain.state_view()) == out[6]
    step(plain, load_rotten_tomatoes()[0], 6, 0, 1)
    assert state_sha256(plain.state_view()) == state_sha256(one[7])
    # across world sizes the rounding differs: close, not equal
    assert state_sha256(one[7]) != state_sha256(three[7])
    for name, a in one[7].items():
        assert np.isfinite(a).all() and np.allclose(a, three[7][name], rtol=1e-4, atol=1e-7), name


def test_a_corrupt_or_missing_shard_file_is_refused_and_the_previous_checkpoint_loads(saved, restarts):
    """The 3-rank restart, after its first restore, flips a byte of step 6's rank-1 file and deletes
    step 4's rank-0 file: the restore names both and loads step 2, bitwise."""
    (_, out), (_, three) = saved, restarts
    step_loaded, hashes, skipped = three["fallback"]
    assert (step_loaded, hashes) == (2, out[2])
    assert any("step-0000000006" in s and "__1_0.distcp: sha256 differs from the manifest (corrupt)" in s for s in skipped)
    assert any("step-0000000004" in s and "__0_0.distcp: missing" in s for s in skipped)


def fo_config(tmp_path, **kw) -> JobConfig:
    return JobConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path), model="tiny", **{"algo": "fo", **kw})


def test_fsdp2_is_refused_with_strategies_and_algorithms_it_does_not_support(tmp_path):
    for kw, expected in (                         (dict(fo={"parallelism": "fsdp2"}, algo="zo"), r"^fo.parallelism fsdp2 \(sharded state\) is a first-order option \(algo fo\); algo zo"),
                         (dict(fo={"parallelism": "zero3"}), "fo.parallelism 'zero3': choose one of ddp, fsdp2")):
        with pytest.raises(ValueError, match=expected):
            fo_config(tmp_path, **kw)
    assert fo_config(tmp_path, fo={"parallelism": "fsdp2"}, strategy="full-async").fo.parallelism == "fsdp2"
    assert fo_config(tmp_path, fo={"parallelism": "fsdp2"}).strategy == "layerwise"
    for strategy in ("overlapped", "differential"):
        assert fo_config(tmp_path, fo={"parallelism": "fsdp2"}, strategy=strategy).fo.parallelism == "fsdp2"


def test_resume_changes_the_worker_count_of_an_fsdp2_run_only(tmp_path, capsys):
    """An fsdp2 run's identity (trajectory hash) leaves the worker count out, so its checkpoints stay
    its own at another count; a ddp run keeps its count, and a count that does not divide the batch is
    refused, each with one line."""
    sharded = fo_config(tmp_path, fo={"parallelism": "fsdp2"}, strategy="full-sync", workers=2, batch_size=8)
    cfg, notes = resume_config(sharded, {"workers": 1})
    assert (cfg.workers, notes) == (1, ["--resume: workers 2 -> 1"])
    assert cfg.trajectory_sha256() == sharded.trajectory_sha256()
    ddp = fo_config(tmp_path, strategy="full-sync", workers=2)
    assert ddp.replace(workers=1).trajectory_sha256() != ddp.trajectory_sha256()
    assert resume_config(ddp, {"workers": 2}) == (ddp, [])  # the same count: nothing to change
    for saved, workers, expected in ((ddp, 1, "does not reshard"), (sharded, 3, "the run's batch of 8 does not split over 3 workers; give a worker count that divides 8")):
        with pytest.raises(typer.Exit) as exit_:
            resume_config(saved, {"workers": workers})
        assert exit_.value.exit_code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --resume") and expected in err


@pytest.fixture()
def one_rank_group():
    """A one-rank gloo group in this process (FSDP2 needs one) and the checkpoint group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield checkpoint_group()
    dist.destroy_process_group()


def test_a_save_that_fails_before_its_commit_leaves_the_previous_checkpoint_the_newest(one_rank_group, encoder, data, tmp_path,
                                                                                       monkeypatch):
    """The put of DCP's ``.metadata`` fails (after the rank's data file is written): the save raises,
    nothing of it is listed, the restore loads the previous checkpoint bitwise, and the next (newer)
    commit's retention deletes the attempt's leftovers."""
    trainer = FOTrainer(load_model("tiny"), HYPER, encoder, sharded=True)
    store = ShardedStore(str(tmp_path), identity=IDENTITY)
    step(trainer, data[0], 0, 0, 1)
    store.save(1, trainer.state_view(), group=one_rank_group)
    saved = tensor_hashes(full_state(trainer.state_view()))
    step(trainer, data[0], 1, 0, 1)
    put = store.storage.put

    def failing_put(path: str, blob: bytes) -> None:
        if path.endswith("/.metadata"):
            raise StorageError(f"put {path}: injected failure")
        put(path, blob)

    monkeypatch.setattr(store.storage, "put", failing_put)
    with pytest.raises(StorageError, match=r"step 2 .* not written, nothing committed .*rank 0: StorageError: put .*/\.metadata: injected"):
        store.save(2, trainer.state_view(), group=one_rank_group)
    monkeypatch.setattr(store.storage, "put", put)
    [leftover] = {p.split("/")[0] for p in store.storage.list() if p.startswith("step-0000000002")}  # its data file
    assert [i.step for i in store.list()] == [1]
    info, skipped = store.restore(trainer.state_view(), one_rank_group)
    assert (info.step, skipped, tensor_hashes(full_state(trainer.state_view()))) == (1, [], saved)
    for t in (1, 2):
        step(trainer, data[0], t, 0, 1)
    store.save(3, trainer.state_view(), group=one_rank_group)
    assert [i.step for i in store.list()] == [1, 3] and not any(p.startswith(leftover) for p in store.storage.list())


def test_an_fsdp2_differential_run_is_durable_as_far_as_every_ranks_records_reach(tmp_path):
    """``workers.fo_worker.durable_steps``: rank 0's records reach step 5, rank 1's step 3 (its later batch
    never committed): the run is durable to step 3; records of another worker count are not counted."""
    from raycheck.job.stores import diff_store
    from raycheck.workers.fo_worker import durable_steps

    cfg = fo_config(tmp_path, fo={"parallelism": "fsdp2"}, strategy="differential", workers=2, batch_size=8,
                    storage={"uri": str(tmp_path / "store")})
    grads = {"w": np.ones(3, np.float32)}
    diff_store(cfg, 0).write_batch([(s, grads) for s in range(5)])
    diff_store(cfg, 1).write_batch([(s, grads) for s in range(3)])
    assert durable_steps(cfg) == 3
    assert durable_steps(cfg.replace(workers=1)) == 0  # the records of 2 ranks do not replay at 1
