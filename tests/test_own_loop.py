"""A user's own first-order loop (``workers.own_loop``, ``training.optim_state``), without Ray: the state
view of a real tiny model + AdamW, restore round trips bitwise (sha256 of every tensor) for each
strategy, the layer-wise composite with each unit's optimizer state, and the one-line refusals."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from raycheck.job.config import DifferentialConfig, OverlappedConfig
from raycheck.policies.layerwise import LayerwiseConfig
from raycheck.storage.diffs import DiffStore
from raycheck.storage.snapshots import NoSnapshotError, SnapshotStore
from raycheck.training.differential import DiffCheckpointer
from raycheck.training.state import StepRecord
from raycheck.training.optim_state import ModelOptimizerState, StateMismatchError, UnsupportedOptimizerError
from raycheck.training.state import copy_state, state_sha256
from raycheck.storage.units import unit_of
from raycheck.workers.own_loop import FirstOrderCheckpoints, load_checkpoint
from raycheck.storage.pointers import POINTER_FILE, pointer


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(3))
        self.head = torch.nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


def make(hidden: int = 16, lr: float = 1e-2) -> tuple[Net, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = Net(hidden)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, foreach=False)


def step(model: Net, opt: torch.optim.Optimizer, i: int, set_to_none: bool = True) -> None:
    """Step ``i`` (its batch seeded by ``i``); ``set_to_none`` False zeroes the gradients in place."""
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 2, (8,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)


def reference(steps: int) -> list[dict]:
    """The failure-free states after 0..steps steps (copies)."""
    model, opt = make()
    view = ModelOptimizerState(model, opt)
    states = [copy_state(view.view())]
    for i in range(steps):
        step(model, opt, i)
        states.append(copy_state(view.view()))
    return states


def test_state_view_layout():
    model, opt = make()
    view = ModelOptimizerState(model, opt).view()
    names = list(view)
    assert names[:2] == ["embed.weight", "embed.bias"]
    assert "optim.exp_avg.layers.1.weight" in names and "optim.step.head.bias" in names
    assert view["optim.step.head.bias"].shape == (1,) and view["param_groups.0.lr"].dtype == torch.float64
    assert unit_of("optim.exp_avg_sq.layers.1.weight") == unit_of("layers.1.weight") == "layer.001"
    # the eager state is what AdamW's first step creates: same trajectory as a plain optimizer
    plain_model, plain_opt = make()
    for i in range(3):
        step(model, opt, i)
        step(plain_model, plain_opt, i)
    assert state_sha256(ModelOptimizerState(plain_model, plain_opt).view()) == state_sha256(ModelOptimizerState(model, opt).view())


def test_round_trip_restores_lr_and_is_bitwise():
    ref = reference(6)
    model, opt = make(lr=0.5)  # another lr: the saved parameter group's lr wins
    ModelOptimizerState(model, opt).load(ref[3])
    assert opt.param_groups[0]["lr"] == 1e-2 and isinstance(opt.param_groups[0]["amsgrad"], bool)
    for i in range(3, 6):
        step(model, opt, i)
    assert state_sha256(ModelOptimizerState(model, opt).view()) == state_sha256(ref[6])


@pytest.mark.parametrize("strategy", ["full-sync", "full-async", "layerwise"])
def test_restore_resumes_bitwise(tmp_path, strategy):
    ref = reference(12)
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path / "ckpt"), strategy=strategy, every_steps=3, report=False,
                                 layerwise=LayerwiseConfig(threshold=0.0), settings={"lr": 1e-2})
    assert ckpt.restore() == 0
    for i in range(8):  # "fails" after step 8 (no close: the process dies): the last checkpoint is of step 6
        step(model, opt, i)
        ckpt.after_step(i + 1)
    ckpt.flush()
    assert ckpt.checkpointer is not None and ckpt.checkpointer.close()["last_step"] == 6  # the writer stopped, as at a death
    assert [i.step for i in ckpt.store.list()] == [3, 6]

    model, opt = make(lr=0.3)
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path / "ckpt"), strategy=strategy, every_steps=3, report=False,
                                 layerwise=LayerwiseConfig(threshold=0.0), settings={"lr": 1e-2})
    start = ckpt.restore()
    assert start == 6 and state_sha256(ModelOptimizerState(model, opt).view()) == state_sha256(ref[6])
    for i in range(start, 12):
        step(model, opt, i)
        ckpt.after_step(i + 1)
    stats = ckpt.close()
    assert state_sha256(ModelOptimizerState(model, opt).view()) == state_sha256(ref[12])
    assert stats["last_step"] == 12
    # the committed snapshot loads in one call, into a fresh model and optimizer
    model, opt = make()
    assert load_checkpoint(str(tmp_path / "ckpt" / stats["newest"]), model, opt) == 12
    assert state_sha256(ModelOptimizerState(model, opt).view()) == state_sha256(ref[12])


@pytest.mark.parametrize("strategy", ["full-sync", "layerwise"])
def test_close_checkpoints_the_trained_state_when_the_last_step_is_not_on_the_interval(tmp_path, strategy):
    """8 steps at an interval of 3: the loop's last checkpoint would be step 6's; ``close`` adds step 8's, so the
    newest committed snapshot (``Result.checkpoint``) is the trained state, bitwise."""
    ref = reference(8)
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path / "ckpt"), strategy=strategy, every_steps=3, report=False,
                                 layerwise=LayerwiseConfig(threshold=0.0))
    for i in range(8):
        step(model, opt, i)
        ckpt.after_step(i + 1)
    stats = ckpt.close()
    assert stats["last_step"] == 8 and stats["newest"].startswith("step-0000000008")
    fresh, fresh_opt = make()
    assert load_checkpoint(str(tmp_path / "ckpt" / stats["newest"]), fresh, fresh_opt) == 8
    assert state_sha256(ModelOptimizerState(fresh, fresh_opt).view()) == state_sha256(ref[8])
    with pytest.raises(FileNotFoundError, match=r"^no checkpoint to load \(None"):
        load_checkpoint(None, fresh, fresh_opt)


def test_a_pointer_checkpoint_loads_its_snapshot_and_names_the_newest_once_retention_deleted_it(tmp_path):
    """What Ray Train holds for a reported snapshot (``workers.train_reports``): a folder with the pointer file.
    It loads the snapshot bitwise; after retention deleted that snapshot it names the store's newest; a
    pointer file that is not one is refused in one line."""
    ref = reference(4)
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path / "ckpt"), strategy="full-sync", every_steps=1, keep=2, report=False)
    (tmp_path / "ray").mkdir()
    for i in range(4):
        step(model, opt, i)
        ckpt.after_step(i + 1)
        info = ckpt.store.list()[-1]
        reported = tmp_path / "ray" / info.folder  # as Ray Train uploads it: named as the snapshot
        reported.mkdir()
        (reported / POINTER_FILE).write_text(json.dumps(pointer(ckpt.store, info)))
    ckpt.close()
    fresh, fresh_opt = make()
    newest = sorted((tmp_path / "ray").iterdir())[-1]
    assert load_checkpoint(str(newest), fresh, fresh_opt) == 4
    assert state_sha256(ModelOptimizerState(fresh, fresh_opt).view()) == state_sha256(ref[4])
    oldest = sorted((tmp_path / "ray").iterdir())[0]  # step 1: deleted by retention (keep 2)
    with pytest.raises(FileNotFoundError, match=rf"step-0000000001-\S+ is not a committed snapshot of {tmp_path / 'ckpt'} "
                                                rf"\(not in its index\); its newest snapshot is {tmp_path / 'ckpt' / newest.name}$"):
        load_checkpoint(str(oldest), fresh, fresh_opt)
    (oldest / POINTER_FILE).write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match=r"raycheck-snapshot.json is not a raycheck snapshot pointer \(format 'raycheck-snapshot-pointer/1' expected\)$"):
        load_checkpoint(str(oldest), fresh, fresh_opt)
    assert state_sha256(ModelOptimizerState(fresh, fresh_opt).view()) == state_sha256(ref[4])  # nothing loaded by the refusals


def test_layerwise_composite_units_carry_their_optimizer_state(tmp_path):
    """Threshold 5e-3: some units are rewritten at a check, others referenced from an older one; each
    unit (weights, moments, step count) is restored as it was at its own step."""
    ref = reference(12)
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path), every_steps=3, report=False,
                                 layerwise=LayerwiseConfig(threshold=5e-2, staleness_bound_steps=100))
    ckpt.restore()
    for i in range(12):
        step(model, opt, i)
        ckpt.after_step(i + 1)
    ckpt.close()
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path), every_steps=3, report=False)
    assert ckpt.restore() == 12
    unit_steps = ckpt.restored["unit_steps"]
    assert len(set(unit_steps.values())) > 1, unit_steps  # a real composite
    restored = copy_state(ModelOptimizerState(model, opt).view())
    for name, array in restored.items():
        assert (array == ref[unit_steps[unit_of(name)]][name]).all(), name


def test_mismatch_is_refused_and_nothing_is_overwritten(tmp_path):
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path), strategy="full-sync", every_steps=1, report=False)
    step(model, opt, 0)
    ckpt.after_step(1)
    ckpt.close()
    other, other_opt = make(hidden=12)
    before = state_sha256(ModelOptimizerState(other, other_opt).view())
    ckpt = FirstOrderCheckpoints(other, other_opt, str(tmp_path), strategy="full-sync", every_steps=1, report=False)
    with pytest.raises(StateMismatchError, match=r"'embed.weight' is <f4 \[16, 6\] there, <f4 \[12, 6\] here; nothing was loaded"):
        ckpt.restore()
    assert state_sha256(ModelOptimizerState(other, other_opt).view()) == before


def test_a_restart_whose_every_snapshot_fails_verification_is_refused_not_started_over(tmp_path):
    """Two committed snapshots, one byte flipped in a shard of each: ``restore`` neither starts over from the
    initial state (which would discard 2 committed steps and report nothing lost) nor loads anything; the
    damaged files stay. With one good snapshot left, it loads that one and names the skipped one."""
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path), strategy="full-sync", every_steps=1, report=False)
    for i in range(2):
        step(model, opt, i)
        ckpt.after_step(i + 1)
    ckpt.close()
    infos = ckpt.store.list()
    shards = [tmp_path / next(iter(i.manifest["units"].values()))["path"] for i in infos]
    for shard in shards:
        flip_last_byte(shard)
    fresh, fresh_opt = make()
    before = state_sha256(ModelOptimizerState(fresh, fresh_opt).view())
    again = FirstOrderCheckpoints(fresh, fresh_opt, str(tmp_path), strategy="full-sync", every_steps=1, report=False)
    with pytest.raises(NoSnapshotError, match=rf"^none of the 2 committed snapshot\(s\) of this run in {tmp_path} loads \(newest: step 2; "
                                              r".*refusing to start over from the initial state, which would discard 2 committed steps"):
        again.restore()
    assert state_sha256(ModelOptimizerState(fresh, fresh_opt).view()) == before and all(s.exists() for s in shards)
    flip_last_byte(shards[0])  # step 1's snapshot mended
    assert again.restore() == 1 and "sha256 differs" in again.restored["skipped"][0]


def flip_last_byte(path: pathlib.Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0xFF
    path.write_bytes(bytes(blob))


def test_refusals():
    model, _ = make()
    with pytest.raises(ValueError, match="unknown strategy 'full'; use one of full-sync, full-async, layerwise, differential, overlapped"):
        FirstOrderCheckpoints(model, torch.optim.AdamW(model.parameters()), "/tmp/unused", strategy="full")
    with pytest.raises(UnsupportedOptimizerError, match="Adamax"):
        ModelOptimizerState(model, torch.optim.Adamax(model.parameters()))
    with pytest.raises(UnsupportedOptimizerError, match="dampening"):
        ModelOptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1))
    with pytest.raises(ValueError, match="storage is required"):
        FirstOrderCheckpoints(model, torch.optim.AdamW(model.parameters()))


def test_an_optimizer_built_with_other_flags_loads():
    """Flags (``foreach``, ``fused``, ...) are not state; a scheduler's ``initial_lr`` only one side has is left as is."""
    ref = reference(2)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.01)  # foreach None, not False
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # adds initial_lr 0.5
    ModelOptimizerState(model, opt).load(ref[2])
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["initial_lr"] == 0.5
    assert all((a == ref[2][n]).all() for n, a in copy_state(ModelOptimizerState(model, opt).view()).items() if n in ref[2])


def test_a_setting_no_loop_can_use_is_refused_naming_it(tmp_path):
    model, opt = make()
    for given, message in (({"every_steps": 0}, "every_steps must be >= 1, got 0"), ({"keep": 0}, "keep must be >= 1, got 0"),
                           ({"report_every_steps": -2}, "report_every_steps must be >= 1, got -2")):
        with pytest.raises(ValueError, match=f"^{message}$"):
            FirstOrderCheckpoints(model, opt, str(tmp_path / "ckpt"), report=False, **given)
    assert not (tmp_path / "ckpt").exists()  # refused before the store is made


def lr_at(i: int) -> float:
    """A schedule set by the loop before each step: the records must carry it."""
    return 1e-2 * 0.8 ** i


OPTIMIZERS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01, foreach=False),
    "sgd-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
}


def scheduled_step(model: Net, opt: torch.optim.Optimizer, i: int, schedule: str) -> None:
    """Step ``i`` with the lr of ``lr_at(i)``, set before the step, or after the step before (a scheduler's place)."""
    if schedule == "before":
        opt.param_groups[0]["lr"] = lr_at(i)
    step(model, opt, i)
    if schedule == "after":
        opt.param_groups[0]["lr"] = lr_at(i + 1)


def scheduled_run(optimizer: str, steps: int, schedule: str) -> list[str]:
    """The failure-free state hashes after 0..steps steps (``scheduled_step``)."""
    torch.manual_seed(0)
    model = Net()
    opt = OPTIMIZERS[optimizer](model)
    view = ModelOptimizerState(model, opt)
    hashes = [state_sha256(view.view())]
    for i in range(steps):
        scheduled_step(model, opt, i, schedule)
        hashes.append(state_sha256(view.view()))
    return hashes


@pytest.mark.parametrize("optimizer, schedule", [("adamw", "before"), ("sgd-nesterov", "before"), ("adamw", "after")])
@pytest.mark.parametrize("strategy, resumed", [("differential", 9), ("overlapped", 6)])
def test_records_of_your_optimizer_replay_bitwise(tmp_path, strategy, resumed, optimizer, schedule):
    """Differential and overlapped through your optimizer: the loop dies after step 9.

    differential (full every 5, 2 records per object): full checkpoints of steps 0 (written by the first
    restore) and 5, records of steps 5-8; the restore replays 4 records with their lr through the optimizer.
    overlapped (every 4, 3 chunks): the snapshot started after step 4 is completed at step 6 by catching
    chunks up through a new optimizer of the same class; the window started at 8 dies open. Both rejoin the
    failure-free trajectory bit for bit, and close's snapshot of step 14 loads in one call. The lr changes
    every step, set before the step or after it (a scheduler's place: a replayed state holds the next lr)."""
    ref = scheduled_run(optimizer, 14, schedule)
    settings = dict(strategy=strategy, every_steps=4, report=False, differential=DifferentialConfig(full_every_steps=5, batch_steps=2),
                    overlapped=OverlappedConfig(chunks=3))

    def loop(start: int, stop: int) -> tuple[Net, torch.optim.Optimizer, FirstOrderCheckpoints]:
        torch.manual_seed(start + 1)  # a restarted worker's model is built anew, with other weights
        model = Net()
        opt = OPTIMIZERS[optimizer](model)
        ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path / "ckpt"), **settings)
        assert ckpt.restore() == start and state_sha256(ModelOptimizerState(model, opt).view()) == ref[start]
        for i in range(start, stop):
            scheduled_step(model, opt, i, schedule)
            ckpt.after_step(i + 1)
        return model, opt, ckpt

    torch.manual_seed(0)  # the first incarnation starts from the reference's initial model
    first = Net()
    opt = OPTIMIZERS[optimizer](first)
    ckpt = FirstOrderCheckpoints(first, opt, str(tmp_path / "ckpt"), **settings)
    assert ckpt.restore() == 0
    for i in range(9):
        scheduled_step(first, opt, i, schedule)
        ckpt.after_step(i + 1)
    assert ckpt.flush() and ckpt.steps is not None  # then the process dies: no close (its writer thread is a daemon)
    ckpt.steps.close()
    if ckpt.diffs is not None:
        [batch, *_] = ckpt.diffs.list()
        assert batch.tensors["param_groups.0.lr"] == [1]  # each record carries the step's lr

    model, opt, ckpt = loop(resumed, 14)
    assert ckpt.restored["replayed_steps" if strategy == "differential" else "step"] == (4 if strategy == "differential" else 6)
    stats = ckpt.close()
    assert state_sha256(ModelOptimizerState(model, opt).view()) == ref[14] and not stats["errors"]
    fresh = Net()
    fresh_opt = OPTIMIZERS[optimizer](fresh)
    assert load_checkpoint(str(tmp_path / "ckpt" / stats["newest"]), fresh, fresh_opt) == 14
    assert state_sha256(ModelOptimizerState(fresh, fresh_opt).view()) == ref[14]


def test_what_replay_cannot_do_exactly_is_refused_up_front(tmp_path):
    class Scaled(torch.optim.SGD):  # needs an argument its parameter groups do not hold
        def __init__(self, params, scale: float) -> None:
            super().__init__(params, lr=0.1 * scale)

    model, _ = make()
    with pytest.raises(UnsupportedOptimizerError, match="^Scaled cannot be built from its parameter groups alone"):
        FirstOrderCheckpoints(model, Scaled(model.parameters(), 2.0), str(tmp_path / "c"), strategy="overlapped", report=False)
    half = Net().to(torch.bfloat16)
    with pytest.raises(ValueError, match="^strategy differential records float32 gradients; parameter 'embed.weight' is torch.bfloat16"):
        FirstOrderCheckpoints(half, torch.optim.AdamW(half.parameters()), str(tmp_path / "c"), strategy="differential", report=False)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("strategy", ["differential", "overlapped"])
def test_gradients_zeroed_in_place_are_refused_and_nothing_wrong_is_committed(tmp_path, strategy):
    """The record of a step is the gradients it read; zeroed in place they would be zeros: the first
    ``after_step`` that reads one refuses it in one line, and every committed snapshot is its step's state."""
    ref = reference(8)
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path / "c"), strategy=strategy, every_steps=2, report=False,
                                 differential=DifferentialConfig(full_every_steps=3, batch_steps=1), overlapped=OverlappedConfig(chunks=2))
    with pytest.raises(RuntimeError, match=r"^after_step: the gradients optimizer.step\(\) read were written in place since "
                                           r"\(\['embed.weight', .*zero them with optimizer.zero_grad\(\) \(set_to_none=True"):
        for i in range(8):
            step(model, opt, i, set_to_none=False)
            ckpt.after_step(i + 1)
    assert ckpt.flush()
    for info in ckpt.store.list():
        assert state_sha256(ckpt.store.load(info)) == state_sha256(ref[info.step]), info.step


def test_a_record_written_in_place_after_after_step_is_refused_in_the_loop_or_by_the_writer(tmp_path):
    """Zeroed in place after ``after_step`` and refilled by the next backward, a held record changes: the
    next ``after_step`` refuses the reused tensors; and a record changed before its batch is written (its
    version counter moved) is refused by the writer: nothing of that batch is committed."""
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path / "a"), strategy="differential", report=False,
                                 differential=DifferentialConfig(full_every_steps=100, batch_steps=4))
    ckpt.restore()  # writes the initial state as the full checkpoint of step 0
    with pytest.raises(RuntimeError, match=r"the gradients of step 0 were overwritten by the next step .*set_to_none=True"):
        for i in range(3):
            g = torch.Generator().manual_seed(1000 + i)
            torch.nn.functional.cross_entropy(model(torch.randn(8, 6, generator=g)), torch.randint(0, 2, (8,), generator=g)).backward()
            opt.step()
            ckpt.after_step(i + 1)
            opt.zero_grad(set_to_none=False)
    ckpt.close()

    store = SnapshotStore(str(tmp_path / "b"))
    writer = DiffCheckpointer(store, DiffStore(store.storage), lambda: records.pop(0), full_every=100, batch_steps=2)
    records = [StepRecord({"w": torch.ones(3)}), StepRecord({"w": torch.ones(3)})]
    held = records[0]["w"]
    writer.after_step(1, dict)
    held.zero_()  # written in place while its batch waits
    writer.after_step(2, dict)
    stats = writer.close(60)
    assert stats["batches"] == 0 and "the record of step 0: the gradients optimizer.step() read were written in place" in stats["errors"][0]
    assert DiffStore(store.storage).list() == []


def test_a_loop_that_breaks_what_a_strategy_needs_is_refused_in_one_line(tmp_path):
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path / "a"), strategy="full-sync", every_steps=2, report=False)
    step(model, opt, 0)
    with pytest.raises(ValueError, match=r"^after_step\(0\) after 0 steps done: call it after every optimizer.step\(\) "
                                         r"with the steps done so far \(step \+ 1 for a 0-based step\), 1 now$"):
        ckpt.after_step(0)
    ckpt.close()

    model, opt = make()  # differential: a parameter with a gradient at some steps only
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path / "b"), strategy="differential", report=False)
    step(model, opt, 0)
    ckpt.after_step(1)
    model.head.bias.requires_grad_(False)
    step(model, opt, 1)
    with pytest.raises(ValueError, match=r"^the record of step 1 holds other tensors than the earlier steps' \(\['head.bias'\]"):
        ckpt.after_step(2)
    ckpt.close()

    class ShrinkSGD(torch.optim.SGD):  # a setting kept outside the parameter groups: the catch-up could not rebuild it
        def __init__(self, params, lr: float = 0.1, shrink: float = 0.0) -> None:
            super().__init__(params, lr=lr)
            self.shrink = shrink

    with pytest.raises(UnsupportedOptimizerError, match=r"^ShrinkSGD keeps 'shrink' outside its parameter groups \(0.1 here, 0.0 when"):
        FirstOrderCheckpoints(model, ShrinkSGD(model.parameters(), shrink=0.1), str(tmp_path / "c"), strategy="overlapped", report=False)


def test_load_refuses_another_dtype_and_another_number_of_parameter_groups(tmp_path):
    model, opt = make()
    ckpt = FirstOrderCheckpoints(model, opt, str(tmp_path), strategy="full-sync", every_steps=1, report=False)
    step(model, opt, 0)
    ckpt.after_step(1)
    folder = str(tmp_path / ckpt.close()["newest"])
    half = Net().to(torch.bfloat16)
    before = state_sha256({n: p.detach() for n, p in half.named_parameters()})
    with pytest.raises(StateMismatchError, match=r"'embed.weight' is torch.float32 \[16, 6\] there, torch.bfloat16 \[16, 6\] here"):
        load_checkpoint(folder, half)
    assert state_sha256({n: p.detach() for n, p in half.named_parameters()}) == before
    two = Net()
    two_groups = torch.optim.AdamW([{"params": list(two.embed.parameters())},
                                    {"params": [p for n, p in two.named_parameters() if not n.startswith("embed.")], "lr": 5.0}])
    with pytest.raises(StateMismatchError, match=r"it holds 1 parameter group\(s\), this optimizer 2; nothing was loaded"):
        load_checkpoint(folder, two, two_groups)
    with pytest.raises(FileNotFoundError, match=rf"^{tmp_path} is a snapshot store, not one snapshot: its newest is {folder}$"):
        load_checkpoint(str(tmp_path), two)

    class Part(torch.nn.Module):  # a strict part of the saved model: its tensors fit, the rest would be dropped
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(6, 16)

    part = Part()
    with pytest.raises(StateMismatchError, match=r"it holds 8 parameter\(s\) the model lacks, first 'layers.0.weight'; nothing was loaded$"):
        load_checkpoint(folder, part)
