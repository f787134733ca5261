"""First-order (AdamW) training on the tiny model and the real snippets: determinism, the training-state
layout, exact resume from a full checkpoint, composite states, and merged checkpoints (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raycheck.storage.merge import MergeError, Source, export_hf, merge_snapshots, parse_take
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.units import group_by_unit, parameter_of, unit_of
from raycheck.training.data import batch_indices
from raycheck.experiments.fo_bench import step_records
from raycheck.training.fo import FOHyper, FOTrainer
from raycheck.training.model import load_model, model_folder
from raycheck.training.state import copy_state, state_sha256

BATCH = 8
HYPER = FOHyper(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)


def make_trainer(encoder, hyper: FOHyper = HYPER) -> FOTrainer:
    torch.set_num_threads(1)
    return FOTrainer(load_model("tiny"), hyper, encoder)


def train(trainer: FOTrainer, split, first: int, last: int, seed: int = 0, after=None) -> list[float]:
    """Steps ``first .. last - 1`` with the batches of ``seed``; ``after(steps_done)`` after each."""
    losses = []
    for step in range(first, last):
        losses.append(trainer.train_step(split, batch_indices(seed, step, BATCH, len(split))))
        if after is not None:
            after(step + 1)
    return losses


def unit_sha(state, unit: str) -> str:
    return state_sha256({n: a for n, a in state.items() if unit_of(n) == unit})


def test_same_batches_give_the_same_state_bitwise(encoder, data):
    train_split = data[0]
    a, b = make_trainer(encoder), make_trainer(encoder)
    initial = state_sha256(a.state_view())
    losses_a, losses_b = train(a, train_split, 0, 4), train(b, train_split, 0, 4)
    assert losses_a == losses_b
    assert state_sha256(a.state_view()) == state_sha256(b.state_view()) != initial
    c = make_trainer(encoder)
    train(c, train_split, 0, 4, seed=1)  # other batches, another trajectory
    assert state_sha256(c.state_view()) != state_sha256(a.state_view())


def test_training_state_layout_units_and_counts(encoder, data):
    trainer = make_trainer(encoder)
    params = [n for n, _ in trainer.model.named_parameters()]
    view = trainer.state_view()
    assert list(view) == params + [f"optim.{slot}.{n}" for slot in ("exp_avg", "exp_avg_sq", "step") for n in params]
    assert all(t.dtype == torch.float32 for t in view.values())
    for name in params:
        assert view[f"optim.exp_avg.{name}"].shape == view[name].shape == view[f"optim.exp_avg_sq.{name}"].shape
        assert view[f"optim.step.{name}"].shape == (1,) and float(view[f"optim.step.{name}"]) == 0.0
        assert parameter_of(f"optim.step.{name}") == name and unit_of(f"optim.exp_avg.{name}") == unit_of(name)
    assert list(group_by_unit(view)) == ["embed", "layer.000", "layer.001", "norm"]  # tied head: no lm_head unit
    assert len(group_by_unit(view)["layer.000"]) == 4 * 9  # 9 tensors, each with 3 optimizer slots
    train(trainer, data[0], 0, 3)
    assert {float(view[f"optim.step.{n}"]) for n in params} == {3.0}
    assert not torch.equal(view["optim.exp_avg.model.norm.weight"], torch.zeros(64))


def test_gradients_fit_a_batch(encoder, data):
    """The gradients are real: ten AdamW steps on one batch of real snippets take its loss from
    about ln 2 (the random tiny model) to a tenth of that."""
    trainer, batch = make_trainer(encoder), batch_indices(0, 0, BATCH, len(data[0]))
    losses = [trainer.train_step(data[0], batch) for _ in range(10)]
    assert 0.6 < losses[0] < 0.8 and losses[-1] < 0.1
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))


def test_resume_from_a_full_checkpoint_is_bitwise_exact(encoder, data, tmp_path):
    reference = make_trainer(encoder)
    train(reference, data[0], 0, 6)
    store = SnapshotStore(str(tmp_path / "snapshots"))
    first = make_trainer(encoder)
    train(first, data[0], 0, 3)
    store.write(3, copy_state(first.state_view()))
    resumed = make_trainer(encoder)
    resumed.load_state(store.load_latest().state)
    assert state_sha256(resumed.state_view()) == state_sha256(first.state_view())
    train(resumed, data[0], 3, 6)
    assert state_sha256(resumed.state_view()) == state_sha256(reference.state_view())


def test_replayed_step_records_give_the_executed_step_bitwise(encoder, data):
    """raycheck's AdamW steps recorded and replayed through ``training.optim_steps`` (the records a
    differential checkpoint writes): bitwise the executed steps, and each record carries the lr."""
    executed, replayed = make_trainer(encoder), make_trainer(encoder)
    recorded, replay = step_records(executed), step_records(replayed, record=False)
    for step in range(3):
        executed.train_step(data[0], batch_indices(0, step, BATCH, len(data[0])))
        record = copy_state(recorded.applied())
        assert record["param_groups.0.lr"].tolist() == [HYPER.lr]
        replay.replay(record)
    assert state_sha256(replayed.state_view()) == state_sha256(executed.state_view())
    bad = copy_state(recorded.applied())
    bad["model.norm.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"the recorded gradient of model.norm.weight is torch.float32 \(3,\), the parameter is torch.float32 \(64,\)"):
        replay.replay(bad)


def test_load_state_names_the_mismatch(encoder):
    trainer = make_trainer(encoder)
    state = copy_state(trainer.state_view())
    del state["optim.exp_avg.model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['optim.exp_avg.model.norm.weight'\]"):
        trainer.load_state(state)
    state = copy_state(trainer.state_view())
    state["optim.step.model.norm.weight"] = np.zeros((), np.float32)
    with pytest.raises(ValueError, match=r"optim.step.model.norm.weight: state has shape \(\) float32, model expects \(1,\) float32"):
        trainer.load_state(state)


def test_a_composite_state_resumes_with_each_units_own_step_count(encoder, data):
    """Layer 0 from step 2, everything else from step 4: each unit keeps its weights, moments and count."""
    trainer = make_trainer(encoder)
    train(trainer, data[0], 0, 2)
    at2 = copy_state(trainer.state_view())
    train(trainer, data[0], 2, 4)
    at4 = copy_state(trainer.state_view())
    composite = {n: (at2 if unit_of(n) == "layer.000" else at4)[n] for n in at4}
    resumed = make_trainer(encoder)
    resumed.load_state(composite)
    view = resumed.state_view()
    assert unit_sha(view, "layer.000") == unit_sha(at2, "layer.000") and unit_sha(view, "layer.001") == unit_sha(at4, "layer.001")
    train(resumed, data[0], 4, 5)
    counts = {unit_of(n): float(t) for n, t in view.items() if n.startswith("optim.step.")}
    assert counts == {"embed": 5.0, "layer.000": 3.0, "layer.001": 5.0, "norm": 5.0}


@pytest.fixture(scope="module")
def fo_checkpoints(tmp_path_factory):
    """Two first-order runs of the tiny model (seeds 0 and 1) with full checkpoints at steps 4 and 6."""
    from raycheck.training.data import PromptEncoder, load_rotten_tomatoes
    from raycheck.training.model import load_tokenizer

    encoder, split = PromptEncoder(load_tokenizer(), seq_len=32), load_rotten_tomatoes()[0]
    root = tmp_path_factory.mktemp("fo-merge")
    states = {}
    for name, seed, steps in (("A", 0, 4), ("B", 1, 6)):
        trainer = make_trainer(encoder)
        train(trainer, split, 0, steps, seed=seed)
        states[name] = copy_state(trainer.state_view())
        SnapshotStore(str(root / name)).write(steps, states[name])
    return root, states


def test_merged_first_order_checkpoint_loads_in_transformers_and_resumes(fo_checkpoints, encoder, data, tmp_path):
    from transformers import AutoModelForCausalLM

    root, states = fo_checkpoints
    out = SnapshotStore(str(tmp_path / "merged"))
    takes = [parse_take("0,embed:A"), parse_take("1,norm:B")]
    result = merge_snapshots([Source("A", SnapshotStore(str(root / "A"))), Source("B", SnapshotStore(str(root / "B")))], takes, out)
    assert result.unit_steps == {"embed": 4, "layer.000": 4, "layer.001": 6, "norm": 6} and result.info.step == 6
    merged = out.load_latest().state
    for unit, name in result.unit_sources.items():  # weights, both moments and the step count, bitwise
        assert unit_sha(merged, unit) == unit_sha(states[name], unit), unit
    folder = export_hf(out, tmp_path / "hf", "tiny", model_folder("tiny"))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    loaded = model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight"):
        assert np.array_equal(loaded[name].numpy(), merged[name]), name
    resumed = make_trainer(encoder)
    resumed.load_state(merged)
    losses = train(resumed, data[0], 6, 8)
    assert all(np.isfinite(losses))
    counts = {unit_of(n): float(t) for n, t in resumed.state_view().items() if n.startswith("optim.step.")}
    assert counts == {"embed": 6.0, "layer.000": 6.0, "layer.001": 8.0, "norm": 8.0}


def test_merging_a_weights_only_snapshot_into_a_first_order_one_names_the_missing_optimizer_state(fo_checkpoints, tmp_path):
    root, states = fo_checkpoints
    weights_only = SnapshotStore(str(tmp_path / "zo"))
    weights_only.write(9, {n: a for n, a in states["B"].items() if parameter_of(n) is None})
    with pytest.raises(MergeError, match=r"unit layer.001: source W \(step 9\) does not match the reference layout of "
                                         r"source A \(step 4\): missing tensors \['optim.exp_avg.model.layers.1"):
        merge_snapshots([Source("A", SnapshotStore(str(root / "A"))), Source("W", weights_only)],
                        [parse_take("0,embed,norm:A"), parse_take("1:W")], SnapshotStore(str(tmp_path / "out")))
    assert SnapshotStore(str(tmp_path / "out")).list() == []
