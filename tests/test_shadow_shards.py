"""The sharded shadow (``--shadow-shards K``): the split, replay of a shard's own parameters, the
assembly of the shards' images, the persister's commit rule for the shards' parts (plain, no Ray),
without Ray; the end-to-end run with two shards is
``tests/test_end_to_end.py::test_two_shards_serve_an_assembled_image_restart_alone_and_are_exact`` (it
shares that module's failure-free reference run)."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict

import pytest
import torch

from raycheck.actors.persister import ShardParts, SnapshotPersister
from raycheck.actors.shadow import AlignedSchedule, ShadowReplayer, ShadowSpec
from raycheck.actors.shadow_actor import ShadowActor
from raycheck.actors.shards import assemble, layout_elements, split_units
from raycheck.job.config import FailureSpec, JobConfig
from raycheck.orchestrator.shadow_keeper import combined_status
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.steplog import StepLogWriter, StepRecord
from raycheck.training.model import default_cache_dir, layout_sha256, parameter_layout, trainable_parameters
from raycheck.training.state import copy_state, state_sha256
from raycheck.training.zo import GENERATOR


def record(step: int) -> StepRecord:
    return StepRecord(step=step, seed=700 + step, projected_grad=0.37 - step / 10, loss_plus=0.7, loss_minus=0.69,
                      lr=1e-3, eps=1e-3, weight_decay=0.01, batch_id=step)


@pytest.fixture()
def params(tiny_model):
    return trainable_parameters(tiny_model)


@pytest.fixture()
def step_log(tmp_path, params):
    """A step log of the tiny model with 6 steps (weight decay on, so matrices and gains differ)."""
    layout = parameter_layout(params)
    writer = StepLogWriter.create(tmp_path / "steplog.bin", {"layout": layout, "layout_sha256": layout_sha256(layout),
                                                               "generator": GENERATOR, "model": "tiny"})
    for step in range(6):
        writer.append(record(step))
    writer.close()
    return tmp_path / "steplog.bin"


def elements(params) -> dict[str, int]:
    return {n: p.numel() for n, p in params.items()}


def test_split_is_contiguous_by_unit_and_minimises_the_largest_shard(params):
    ranges = split_units(elements(params), 2)  # tiny: embed 3,145,728; each layer 36,992; norm 64
    assert [(r.units, r.first_index, r.end_index, r.elements) for r in ranges] == [
        (("embed",), 0, 1, 3145728), (("layer.000", "layer.001", "norm"), 1, 20, 2 * 36992 + 64)]
    assert layout_elements(parameter_layout(params)) == elements(params)
    assert [r.units for r in split_units(elements(params), 4)] == [("embed",), ("layer.000",), ("layer.001",), ("norm",)]
    whole = split_units(elements(params), 1)[0]
    assert (whole.first_index, whole.end_index, whole.describe()) == (0, len(params), "embed..norm")
    with pytest.raises(ValueError, match=r"shadow_shards must be in 1\.\.4 \(the model's units: embed \.\. norm\), got 5"):
        split_units(elements(params), 5)
    rng = random.Random(3)
    for _ in range(30):  # against brute force over every contiguous split
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(2, 8))]
        k = rng.randint(1, len(sizes))
        layout = {f"model.layers.{i}.w": s for i, s in enumerate(sizes)}
        got = max(r.elements for r in split_units(layout, k))
        best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
                   for cuts in itertools.combinations(range(1, len(sizes)), k - 1))
        assert got == best, (sizes, k)


def test_shards_replay_their_own_parameters_and_assemble_bitwise_to_the_unsharded_state(params, step_log):
    whole = ShadowReplayer(OrderedDict((n, p.clone()) for n, p in params.items()), step_log)
    assert whole.catch_up() == 6
    images = []
    for r in split_units(elements(params), 2):
        own = OrderedDict((n, params[n].clone()) for n in r.names(list(params)))
        shard = ShadowReplayer(own, step_log, shard=r)
        assert shard.catch_up() == 6
        images.append({"step": shard.step, "state": copy_state(shard.params)})
    state, problem = assemble(images, 6)
    assert problem is None and list(state) == list(params)
    assert state_sha256(state) == state_sha256(whole.params) != state_sha256(params)
    assert assemble([images[0], None], 6) == (None, "shadow shard 1 did not serve an image")
    assert assemble([images[0], {**images[1], "step": 5}], 6) == (None, "shadow shard 1 served step 5, the log ends at 6")
    assert assemble([images[0], images[0]], 6)[1].startswith("shadow shard 1 holds tensors another shard holds too")


def test_a_shard_refuses_a_log_of_another_layout(params, step_log):
    r = split_units(elements(params), 2)[1]
    wrong = OrderedDict((n, params[n].clone()) for n in r.names(list(params))[1:])  # one tensor short
    with pytest.raises(ValueError, match="another model layout"):
        ShadowReplayer(wrong, step_log, shard=r)


def test_parts_commit_one_snapshot_only_when_every_shard_delivered(tmp_path, params, step_log):
    """Incomplete steps are never written; a complete set is one manifest that loads bitwise equal."""
    store = SnapshotStore(str(tmp_path / "snapshots"))
    persister = SnapshotPersister(store)
    ranges = split_units(elements(params), 2)
    names = list(params)
    whole = ShadowReplayer(OrderedDict((n, p.clone()) for n, p in params.items()), step_log)
    whole.poll()
    states = {}
    for step in (3, 6):
        while whole.step < step:
            whole.replay_one()
        states[step] = copy_state(whole.params)

    def part(step, shard):
        return {n: states[step][n] for n in ranges[shard].names(names)}

    persister.submit_part(3, 0, 2, part(3, 0))
    assert persister.flush(60)["last_submitted_step"] is None and store.list() == []  # shard 1's part of step 3 missing
    persister.submit_part(6, 1, 2, part(6, 1))
    persister.submit_part(6, 0, 2, part(6, 0))
    status = persister.flush(60)
    assert (status["last_durable_step"], status["parts_pending_steps"], status["parts_dropped"]) == (6, [], 1)  # step 3 dropped
    persister.submit_part(3, 1, 2, part(3, 1))  # late: older than the committed step 6
    assert persister.flush(60)["parts_dropped"] == 2
    (info,) = store.list()
    assert info.step == 6 and set(info.manifest["units"]) == {"embed", "layer.000", "layer.001", "norm"}
    assert state_sha256(store.load(info)) == state_sha256(states[6])
    # a restarted shard 1 loads only its units of that snapshot, then replays the log tail
    spec = ShadowSpec(model="tiny", cache_dir=str(default_cache_dir()), log_path=str(step_log), store=store,
                      persister_name=None, snapshot_every_steps=0, shard=1, shards=2)
    threads = torch.get_num_threads()
    shard = ShadowActor(spec)
    try:
        image = shard.image(6, timeout_s=60)
        status = shard.status()
    finally:
        shard.stop()
        torch.set_num_threads(threads)
    assert status["base"] == {"source": "snapshot", "step": 6} and (status["units"], status["elements"]) == ("layer.000..norm", 74048)
    assert list(image["state"]) == ranges[1].names(names)
    assert state_sha256(image["state"]) == state_sha256(part(6, 1))


def test_parts_hold_at_most_two_incomplete_steps_and_the_grid_aligns_shards():
    parts = ShardParts(max_pending_steps=2)
    for step in (3, 6, 9):
        assert parts.add(step, 0, 2, {"a": step}) is None
    assert sorted(parts.pending) == [6, 9] and parts.dropped == 1  # memory stays bounded while shard 1 is down
    assert parts.add(9, 1, 2, {"b": 9}) == {"a": 9, "b": 9} and parts.pending == {} and parts.dropped == 2
    assert parts.add(9, 1, 2, {"b": 9}) is None and parts.pending == {9: {1: {"b": 9}}}  # a resend of 9 starts a new set
    restarted, running = AlignedSchedule(every_steps=3, last_step=6), AlignedSchedule(every_steps=3, last_step=9)
    assert [s for s in range(7, 13) if restarted.take_if_due(s)] == [9, 12]
    assert [s for s in range(10, 13) if running.take_if_due(s)] == [12]


def test_the_combined_status_is_bounded_by_the_slowest_shard():
    a = {"step": 7, "log_end": 8, "replayed": 7, "replay_seconds_per_step": 0.02, "base": {"source": "initial", "step": 0},
         "snapshots_sent": 2, "snapshots_skipped": 0, "snapshot_every_steps": 3, "last_snapshot_step": 6, "error": None}
    b = {**a, "step": 5, "log_end": 9, "replay_seconds_per_step": 0.05, "base": {"source": "snapshot", "step": 3}, "error": "x"}
    assert combined_status([a]) is a
    c = combined_status([a, b])
    assert (c["step"], c["log_end"], c["lag_steps"], c["replay_seconds_per_step"], c["base"], c["error"]) == (
        5, 9, 4, 0.05, {"source": "initial", "step": 0}, "x")
    assert c["shards"] == [a, b]


def test_shard_settings_are_validated():
    with pytest.raises(ValueError, match=r"^placement.shadow_shards 2 needs strategy shadow \(this run: log-only\)$"):
        JobConfig(out_dir="/tmp/x", cache_dir="/tmp/c", model="tiny", strategy="log-only", placement={"shadow_shards": 2})
    with pytest.raises(ValueError, match="^placement.shadow_shards must be >= 1, got 0$"):
        JobConfig(out_dir="/tmp/x", cache_dir="/tmp/c", model="tiny", placement={"shadow_shards": 0})
    with pytest.raises(ValueError, match="names shard 2, but the shadow has 2 shard"):
        JobConfig(out_dir="/tmp/x", cache_dir="/tmp/c", model="tiny", placement={"shadow_shards": 2}, faults={"failures": (FailureSpec.parse("3:shadow:2"),)})
    with pytest.raises(ValueError, match="selects a shard by its number"):
        FailureSpec(step=3, target="shadow", how="sigkill")


def test_the_experiment_reports_replay_over_step_per_shard_for_one_and_two_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raycheck.experiments.report import write_report
    from raycheck.experiments.results import shard_rows
    from test_report import GRID, all_runs, standard_recoveries, write

    def summary(run_id: str, figures: list[tuple]) -> dict:
        return {"config": {"run_id": run_id}, "shadow_equal": True, "shadow_shards": [
            {"shard": i, "units": u, "elements": e, "replay_seconds_per_step": r, "replay_over_step": r / 0.5}
            for i, (u, e, r) in enumerate(figures)]}

    rows = shard_rows(summary("one", [("embed..norm", 3219776, 0.04)])) + shard_rows(
        summary("two", [("embed", 3145728, 0.03), ("layer.000..norm", 74048, 0.01)]))
    assert [(r["shards"], r["shard"], r["replay_over_step"]) for r in rows] == [(1, 0, 0.08), (2, 0, 0.06), (2, 1, 0.02)]
    write(tmp_path, all_runs(), standard_recoveries())
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "shards.parquet")
    md = write_report(tmp_path, grid_mtbf_s=GRID, seeds=3, min_failures=10).files["report"].read_text()
    section = md.split("## (e) Shadow replay per shard")[1]
    assert "| 2 | 1 | layer.000..norm | 74048 | 0.01 | 0.02 | yes |" in section
    assert "| 1 | 0 | embed..norm | 3219776 | 0.04 | 0.08 | yes |" in section
