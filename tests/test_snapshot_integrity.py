"""Snapshot integrity (issue 14): never restore a foreign, lying, malformed, partial or escaping state,
never let retention drop the last good one, never let a stale writer roll the index back; and the
commit ordering contracts (issue 17), checked by spying on the storage calls. No Ray."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading

import numpy as np
import pytest
from typer.testing import CliRunner

from raycheck.job.stores import snapshot_store
from raycheck.actors.persister import SnapshotPersister
from raycheck.cli.main import app
from raycheck.storage.backend import PreconditionFailedError, RetryPolicy, Storage, StorageError
from raycheck.storage.diffs import DiffStore
from raycheck.storage.manifest import RunIdentity, layout_of, layout_sha256
from raycheck.storage.snapshots import INDEX, MANIFEST, FencedError, NoSnapshotError, SnapshotCorruptError, SnapshotStore
from raycheck.storage.tensor_files import save as st_save
from tests.test_storage_contract import state
from raycheck.training.state import state_sha256

RUN_A = RunIdentity("run-a", "a" * 64)
RUN_B = RunIdentity("run-b", "b" * 64)


def index_folders(storage: Storage) -> list[str]:
    return [e["folder"] for e in json.loads(storage.get(INDEX))["snapshots"]]


def rewrite_manifest(storage: Storage, folder: str, change, reindex: bool = True) -> None:
    """Replace ``folder``'s manifest by ``change(manifest)`` (a dict, or bytes as they are); ``reindex``: record its new sha256 in the
    index too (a consistent lie, so that only the manifest's own checks can catch it)."""
    manifest = change(json.loads(storage.get(f"{folder}/{MANIFEST}")))
    blob = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    storage.put(f"{folder}/{MANIFEST}", blob)
    if reindex:
        index = json.loads(storage.get(INDEX))
        for e in index["snapshots"]:
            if e["folder"] == folder:
                e["manifest_sha256"] = hashlib.sha256(blob).hexdigest()
        storage.put(INDEX, json.dumps(index).encode())


def flip_shard(storage: Storage, path: str) -> None:
    blob = bytearray(storage.get(path))
    blob[len(blob) // 2] ^= 1
    storage.put(path, bytes(blob))


# -- 1. run identity and fencing -------------------------------------------------------------------
def test_a_run_restores_only_its_own_snapshots_and_names_the_foreign_ones(storage):
    a, b = SnapshotStore(storage, identity=RUN_A), SnapshotStore(storage, identity=RUN_B)
    a.write(10, state(10))
    with pytest.raises(NoSnapshotError, match="foreign run run-a"):
        b.load_latest()  # before the fix: run B restored run A's step 10
    b.write(5, state(5))
    info, loaded, skipped = b.load_latest()
    assert (info.step, state_sha256(loaded)) == (5, state_sha256(state(5)))
    assert info.manifest["run"] == {"run_id": "run-b", "trajectory_sha256": "b" * 64}
    assert len(skipped) == 1 and "foreign run run-a" in skipped[0] and "not run run-b" in skipped[0]
    other_trajectory = SnapshotStore(storage, identity=RunIdentity("run-a", "c" * 64))
    assert other_trajectory.list() == [] and len(other_trajectory.skipped) == 2
    assert [i.step for i in SnapshotStore(storage).list()] == [5, 10]  # store-wide tools see every run
    for step in (11, 12):  # retention only ever touches the run's own snapshots
        SnapshotStore(storage, keep_last=1, identity=RUN_A).write(step, state(step))
    assert [(i.step, i.manifest["run"]["run_id"]) for i in SnapshotStore(storage).list()] == [(5, "run-b"), (12, "run-a")]


def test_a_merge_result_is_restorable_a_snapshot_without_identity_is_not(storage):
    anonymous = SnapshotStore(storage)
    anonymous.write(3, state(3))
    run = SnapshotStore(storage, identity=RUN_A)
    with pytest.raises(NoSnapshotError, match="no run identity"):
        run.load_latest()
    merged = anonymous.write(4, state(4), config={"merge": {"reference": "A"}})
    assert run.load_latest().info.folder == merged.folder


def test_a_merge_result_is_only_a_starting_point_and_never_a_step_log_runs_base(storage):
    """A merge copied into a run's store after the run began (newer than its oldest own snapshot) is
    foreign; a run with a step log never restores one (its log replays from the initial weights)."""
    run = SnapshotStore(storage, identity=RUN_A)
    start = SnapshotStore(storage).write(4, state(4), config={"merge": {"reference": "A"}})
    assert run.load_latest().info.folder == start.folder  # the run's starting point
    run.write(6, state(6))
    copied = SnapshotStore(storage).write(8, state(8), config={"merge": {"reference": "B"}})  # another run's units
    info, loaded, skipped = run.load_latest()  # before the fix: step 8, the copied merge
    assert (info.step, state_sha256(loaded)) == (6, state_sha256(state(6)))
    assert any(copied.folder in s and "after run run-a's oldest own snapshot (step 6)" in s for s in skipped)
    assert run.load_latest(max_step=5).info.folder == start.folder  # still the starting point
    logged = SnapshotStore(storage, identity=RUN_A, step_log=True)
    with pytest.raises(NoSnapshotError, match="replays its step log from the initial weights"):
        logged.load_latest(max_step=5)


def test_a_manifest_pointing_at_the_shard_of_an_older_step_is_never_a_step_log_runs_base(storage):
    """A consistent lie (manifest and index sha256 rewritten): step 12's unit points at step 8's shard.
    Claiming it is of step 12 is malformed (its shard's folder is of step 8); saying so honestly makes
    a composite, which a run without a step log may restore (LayerCheck) but one with a step log may
    not. Before the fix both restored step 8's tensors as step 12's."""
    run = SnapshotStore(storage, identity=RUN_A)
    old, new = run.write(8, state(8)), run.write(12, state(12))
    unit = next(iter(new.manifest["units"]))
    for claimed, skipped in ((12, "is after the step of " + old.folder), (8, "a composite (units of steps [8]")):
        rewrite_manifest(storage, new.folder, lambda m: {**m, "units": {**m["units"], unit: {**old.manifest["units"][unit], "step": claimed}}})
        info, _, why = SnapshotStore(storage, identity=RUN_A, step_log=True).load_latest()
        assert info.step == 8 and any(new.folder in s and skipped in s for s in why), why
    assert SnapshotStore(storage, identity=RUN_A).load_latest().info.folder == new.folder  # an honest composite


def test_a_manifest_pointing_at_a_shard_of_another_run_is_malformed(storage):
    """A consistent lie: run A's step 12 takes one unit from run B's step-8 snapshot in the same store
    (an honest unit step 8, like a layer-wise composite). Before the fix run A restored B's tensors."""
    a, b = SnapshotStore(storage, identity=RUN_A), SnapshotStore(storage, identity=RUN_B)
    theirs = b.write(8, state(80))
    a.write(8, state(8))
    ours = a.write(12, state(12))
    unit = next(iter(ours.manifest["units"]))
    rewrite_manifest(storage, ours.folder, lambda m: {**m, "units": {**m["units"], unit: theirs.manifest["units"][unit]}})
    info, _, skipped = a.load_latest()
    assert info.step == 8 and any(ours.folder in s and "in a snapshot folder of another run" in s for s in skipped), skipped


def test_a_persisted_shadow_image_records_the_run_identity():
    store = SnapshotStore(Storage("memory://integrity-persister"), identity=RUN_A)
    persister = SnapshotPersister(store)
    persister.submit(7, state(7))
    assert persister.flush(timeout_s=60)["last_durable_step"] == 7
    assert store.list()[-1].manifest["run"] == RUN_A.as_dict()


def test_a_writer_of_an_older_epoch_is_fenced_and_cannot_roll_the_index_back(storage):
    old = SnapshotStore(storage, identity=RUN_A)
    assert old.run_epoch() == 0  # nothing claimed yet
    assert old.claim_epoch() == 1
    old.write(10, state(10))
    new = SnapshotStore(storage, identity=RUN_A)
    assert new.claim_epoch() == 2  # the resumed driver's incarnation
    before = storage.get(INDEX)
    with pytest.raises(FencedError, match=f"^{re.escape(storage.url(INDEX))}: run {RUN_A.run_id} is at writer epoch 2, "
                                          "this writer has 1"):
        old.write(20, state(20))
    assert storage.get(INDEX) == before  # the stray writer changed nothing committed
    newer_attempt = f"step-0000000001-{RUN_A.tag}-3-aaaaaaaa/embed.safetensors"  # a later incarnation, mid-write
    storage.put(newer_attempt, b"in flight")
    new.write(25, state(25))
    assert [i.step for i in new.list()] == [10, 25]
    folders = {p.split("/")[0] for p in storage.list() if p.startswith("step-")}
    assert folders == {i.folder for i in new.list()} | {newer_attempt.split("/")[0]}  # the fenced step 20 is cleaned
    assert json.loads(storage.get(INDEX))["epochs"] == {"run-a": 2}
    assert SnapshotStore(storage, identity=RUN_B).claim_epoch() == 1  # epochs are per run
    assert (SnapshotStore(storage, identity=RUN_A).run_epoch(), SnapshotStore(storage, identity=RUN_B).run_epoch()) == (2, 1)
    with pytest.raises(ValueError, match="^run_epoch needs a run identity$"):
        SnapshotStore(storage).run_epoch()


def test_conditional_put_refuses_a_stale_expectation(storage):
    storage.put_if_match("obj", b"v1", None)
    with pytest.raises(PreconditionFailedError):
        storage.put_if_match("obj", b"again", None)  # create-only: it exists
    storage.put_if_match("obj", b"v2", b"v1")
    with pytest.raises(PreconditionFailedError):
        storage.put_if_match("obj", b"v1-late", b"v1")  # a late writer that read v1
    assert storage.get("obj") == b"v2"


class GatedStorage(Storage):
    """A real ``Storage`` whose first conditional put blocks until ``release`` is set (the call times
    out meanwhile, is retried, and completes afterwards); ``finished`` is set once it has."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.release, self.finished, self.outcome = threading.Event(), threading.Event(), []
        self._gated = True

    def _put_if_match(self, rel, data, expected):
        if not self._gated:
            return super()._put_if_match(rel, data, expected)
        self._gated = False
        self.release.wait()
        try:
            super()._put_if_match(rel, data, expected)
            self.outcome.append("written")
        except PreconditionFailedError:
            self.outcome.append("refused")
        finally:
            self.finished.set()


def test_an_index_write_that_completes_after_its_timeout_cannot_roll_the_index_back(storage):
    uri, options = storage.uri, storage.options
    gated = GatedStorage(uri, retry=RetryPolicy(timeout_s=2.0, base_delay_s=0.01), **options)
    slow, other = SnapshotStore(gated, identity=RUN_A), SnapshotStore(Storage(uri, **options), identity=RUN_B)
    slow.write(1, state(1))  # the first index write blocks, times out and is retried: committed
    other.write(2, state(2))  # another writer commits after it
    committed = storage.get(INDEX)
    gated.release.set()
    assert gated.finished.wait(60)
    assert gated.outcome == ["refused"] and storage.get(INDEX) == committed
    assert [i.step for i in SnapshotStore(storage).list()] == [1, 2]


class RacedStorage(Storage):
    """A real ``Storage`` whose first conditional put runs ``before`` first: another writer commits
    between this writer's read of the index and its conditional write of it."""

    def __init__(self, *args, before, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.before = before

    def _put_if_match(self, rel, data, expected):
        before, self.before = self.before, None
        if before is not None:
            before()
        return super()._put_if_match(rel, data, expected)


def test_a_writer_that_loses_the_index_race_rereads_it_and_commits_after_the_winner(storage, caplog):
    caplog.set_level(logging.INFO, logger="raycheck.storage.snapshots")
    uri, options = storage.uri, storage.options
    other = SnapshotStore(Storage(uri, **options), identity=RUN_B)
    won = []
    raced = SnapshotStore(RacedStorage(uri, before=lambda: won.append(other.write(2, state(2))), **options), identity=RUN_A)
    lost = raced.write(1, state(1))
    assert index_folders(storage) == [won[0].folder, lost.folder]  # the winner's entry kept, ours added after it
    assert [i.step for i in SnapshotStore(storage).list()] == [1, 2]
    assert f"{storage.url(INDEX)} changed while it was rewritten; retrying" in caplog.messages


class ContendedStorage(Storage):
    """A real ``Storage`` on which ``rival`` commits a snapshot before each conditional put: this writer
    loses every race for the index."""

    def __init__(self, *args, rival: SnapshotStore, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rival, self.rival_steps = rival, iter(range(100, 200))

    def _put_if_match(self, rel, data, expected):
        step = next(self.rival_steps)
        self.rival.write(step, state(step))
        return super()._put_if_match(rel, data, expected)


def test_a_writer_that_loses_every_race_gives_up_after_its_attempts_and_the_winners_stay(storage):
    rival = SnapshotStore(Storage(storage.uri, **storage.options), keep_last=10, identity=RUN_B)
    loser = SnapshotStore(ContendedStorage(storage.uri, rival=rival, **storage.options), identity=RUN_A)
    with pytest.raises(StorageError) as err:
        loser.write(1, state(1))
    assert str(err.value) == f"{storage.url(INDEX)} changed 8 times while being rewritten; giving up"
    assert [i.step for i in SnapshotStore(storage).list()] == list(range(100, 108))


def test_load_latest_at_most_a_step_and_of_some_units_only(storage):
    """``max_step``: the newest snapshot at or before it (recovery never restores past the log's end);
    ``units``: only those units are read and verified (a shadow shard's part), in canonical order."""
    store = SnapshotStore(storage, keep_last=5)
    infos = {step: store.write(step, state(step)) for step in (1, 2, 3)}
    got = store.load_latest(max_step=2)
    assert (got.info.step, state_sha256(got.state), got.skipped) == (2, state_sha256(state(2)), [])
    flip_shard(storage, infos[3].manifest["units"]["embed"]["path"])
    part = store.load_latest(units=["layer.001", "norm"])
    names = [n for n in infos[3].manifest["names"] if n in {*infos[3].manifest["units"]["layer.001"]["tensors"],
                                                            *infos[3].manifest["units"]["norm"]["tensors"]}]
    assert part.info.step == 3 and list(part.state) == names
    assert state_sha256(part.state) == state_sha256({n: state(3)[n] for n in names})
    with pytest.raises(NoSnapshotError) as err:
        store.load_latest(max_step=0)
    assert str(err.value) == f"no loadable snapshot in {storage.url()}; tried: none found"


# -- 2. a manifest that lies -----------------------------------------------------------------------
def test_a_shard_that_verifies_but_holds_other_tensors_than_its_unit_lists_is_refused_by_name(storage):
    """A consistent lie: the shard's bytes and sha256 match its manifest entry, but the tensors inside are others."""
    store = SnapshotStore(storage)
    info = store.write(1, state(1))
    spec = info.manifest["units"]["norm"]
    blob = st_save({"model.norm.weightX": np.zeros(4, np.float32)})
    storage.put(spec["path"], blob)
    rewrite_manifest(storage, info.folder, lambda m: {**m, "units": {
        **m["units"], "norm": {**spec, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}})
    lied = store.list()[-1]
    assert store.verify(lied) == []  # every shard matches its manifest entry
    with pytest.raises(SnapshotCorruptError, match=re.escape(
            f"snapshot {info.folder}: unit norm holds other tensors than its manifest lists")):
        store.load(lied)


def test_a_manifest_that_lies_about_its_step_is_skipped_and_verify_reports_it(tmp_path):
    store = SnapshotStore(str(tmp_path))
    store.write(10, state(10))
    info = store.write(20, state(20))
    rewrite_manifest(store.storage, info.folder, lambda m: {**m, "step": 25}, reindex=False)
    assert [i.step for i in store.list()] == [10]
    assert store.skipped == [f"{info.folder}/{MANIFEST}: sha256 differs from the index (altered after its commit)"]
    rewrite_manifest(store.storage, info.folder, lambda m: {**m, "step": 25})  # the index agrees: the name does not
    assert store.load_latest().info.step == 10 and "step 25 differs from the folder's step 20" in store.skipped[0]
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 1 and f"BAD  {info.folder}/{MANIFEST}: malformed: step 25 differs" in result.output
    newer_unit = {**info.manifest, "units": {**info.manifest["units"], "norm": {**info.manifest["units"]["norm"], "step": 21}}}
    rewrite_manifest(store.storage, info.folder, lambda m: newer_unit)
    assert [i.step for i in store.list()] == [10] and "unit 'norm': step 21 is not a step at or before" in store.skipped[0]


# -- 3. malformed manifests and indexes ------------------------------------------------------------
def _misspell(m):
    return {("unitz" if k == "units" else k): v for k, v in m.items()}


def _rename_tensor(m):
    units = json.loads(json.dumps(m["units"]))
    units["norm"]["tensors"]["model.norm.weightX"] = units["norm"]["tensors"].pop("model.norm.weight")
    return {**m, "units": units}


def _tensor_in_two_units(m):
    units = json.loads(json.dumps(m["units"]))
    units["embed"]["tensors"]["model.norm.weight"] = units["norm"]["tensors"]["model.norm.weight"]
    return {**m, "units": units}


MALFORMED = {
    "key misspelt": (_misspell, "key(s) units missing"),
    "tensor renamed": (_rename_tensor, "do not hold exactly the listed tensors"),
    "tensor in two units": (_tensor_in_two_units, "do not hold exactly the listed tensors"),
    "bytes not a count": (lambda m: {**m, "units": {**m["units"], "embed": {**m["units"]["embed"], "bytes": "12"}}},
                          "bytes '12' is not a count"),
    "names a string": (lambda m: {**m, "names": "model.norm.weight"}, "names must be a non-empty list"),
    "a list": (lambda m: [m], "the manifest is a list"),
    "run a string": (lambda m: {**m, "run": "run-a"}, "run 'run-a' is not a run identity"),
    "unit named ../../x": (lambda m: _escaping_unit(m), "unit '../../x': path"),
    "shape changed": (lambda m: _reshape(m), "layout_sha256 does not match"),
}


def _escaping_unit(m):
    units = json.loads(json.dumps(m["units"]))
    spec = units.pop("norm")
    units["../../x"] = {**spec, "path": spec["path"].rsplit("/", 1)[0] + "/../../x.safetensors"}
    return {**m, "units": units}


def _reshape(m):
    units = json.loads(json.dumps(m["units"]))
    units["norm"]["tensors"]["model.norm.weight"]["shape"] = [2, 2]
    return {**m, "units": units}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_manifest_is_reported_and_the_previous_snapshot_loads(storage, kind):
    change, reason = MALFORMED[kind]
    store = SnapshotStore(storage)
    store.write(10, state(10))
    info = store.write(20, state(20))
    rewrite_manifest(storage, info.folder, change)
    got = store.load_latest()
    assert (got.info.step, state_sha256(got.state)) == (10, state_sha256(state(10)))
    assert len(got.skipped) == 1 and got.skipped[0].startswith(f"{info.folder}/{MANIFEST}: malformed") and reason in got.skipped[0]


def test_every_damaged_manifest_is_skipped_with_its_reason_and_the_listing_goes_on(storage, caplog):
    """Damage in the oldest snapshots (a missing, an altered, an unreadable, a malformed manifest) never
    hides the newer ones; each is named once, in index order, with its reason."""
    store = SnapshotStore(storage, keep_last=10)
    infos = [store.write(step, state(step)) for step in (1, 2, 3, 4, 5)]
    folders = [i.folder for i in infos]
    storage.delete(f"{folders[0]}/{MANIFEST}")
    rewrite_manifest(storage, folders[1], lambda m: {**m, "config": {"altered": True}}, reindex=False)
    rewrite_manifest(storage, folders[2], lambda m: b"{not json")
    rewrite_manifest(storage, folders[3], lambda m: {**m, "step": 25})
    assert [i.step for i in store.list()] == [5]
    assert store.skipped[:3] == [f"{folders[0]}/{MANIFEST}: missing",
                                 f"{folders[1]}/{MANIFEST}: sha256 differs from the index (altered after its commit)",
                                 f"{folders[2]}/{MANIFEST}: unreadable (Expecting property name enclosed in double quotes: "
                                 "line 1 column 2 (char 1))"]
    assert len(store.skipped) == 4 and store.skipped[3].startswith(f"{folders[3]}/{MANIFEST}: malformed: step 25 differs")
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "raycheck.storage.snapshots"] == [(logging.WARNING, f"snapshot skipped: {p}") for p in store.skipped]


def test_a_manifest_with_many_problems_is_reported_by_its_first_three(storage):
    store = SnapshotStore(storage)
    info = store.write(1, state(1))
    rewrite_manifest(storage, info.folder, lambda m: {**m, "units": {u: {**spec, "sha256": "x"} for u, spec in m["units"].items()}})
    assert sorted(info.manifest["units"]) == ["embed", "layer.000", "layer.001", "norm"] and store.list() == []
    assert store.skipped == [f"{info.folder}/{MANIFEST}: malformed: unit 'embed': sha256 'x' is not 64 hex digits; "
                             "unit 'layer.000': sha256 'x' is not 64 hex digits; unit 'layer.001': sha256 'x' is not 64 hex digits"]


def test_verify_names_every_bad_shard_not_only_the_first(storage):
    store = SnapshotStore(storage)
    info = store.write(1, state(1))
    paths = {u: spec["path"] for u, spec in info.manifest["units"].items()}
    storage.delete(paths["embed"])
    flip_shard(storage, paths["layer.000"])
    storage.put(paths["layer.001"], storage.get(paths["layer.001"])[:10])
    assert store.verify(info) == [f"{paths['embed']}: missing", f"{paths['layer.000']}: sha256 differs from the manifest (corrupt)",
                                  f"{paths['layer.001']}: 10 bytes, manifest says {info.manifest['units']['layer.001']['bytes']} (truncated?)"]


def test_a_foreign_snapshot_is_named_with_both_runs_and_one_without_identity_says_so(storage, caplog):
    SnapshotStore(storage, identity=RunIdentity("run-b", "0123456789abcdef" * 4)).write(1, state(1))
    anonymous = SnapshotStore(storage).write(2, state(2))
    foreign = SnapshotStore(storage).list()[0].folder
    run = SnapshotStore(storage, identity=RunIdentity("run-a", "fedcba9876543210" * 4))
    with caplog.at_level(logging.INFO, logger="raycheck.storage.snapshots"):
        assert run.list() == []
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "raycheck.storage.snapshots"] == [(logging.INFO, f"snapshot skipped: {p}") for p in run.skipped]
    assert run.skipped == [f"{foreign}: foreign run run-b (trajectory 0123456789ab), not run run-a (trajectory fedcba987654)",
                           f"{anonymous.folder}: no run identity, not run run-a (trajectory fedcba987654)"]


@pytest.mark.parametrize("body", [b"null", b"[]", b'"step-0000000010-aaaaaaaa"', b'{"format_version": 3, "snapshots": "x"}',
                                  b'{"format_version": 3, "generation": 1, "epochs": {}, "snapshots": [{"folder": "../x"}]}'])
def test_a_malformed_index_is_reported_and_never_raises(tmp_path, body):
    store = SnapshotStore(str(tmp_path))
    store.write(10, state(10))
    store.storage.put(INDEX, body)
    assert [i.step for i in store.list()] == [10]  # found by scanning for manifests
    assert store.skipped[0].startswith(f"{INDEX}: malformed")
    assert store.load_latest().info.step == 10
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 1 and f"BAD  {INDEX}: malformed" in result.output
    inspected = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert inspected.exit_code == 1 and f"  skipped: {INDEX}: malformed" in inspected.output
    store.write(11, state(11))  # the next commit writes a well-formed index again, a new count of writes
    assert index_folders(store.storage) == [i.folder for i in store.list()] and store.skipped == []
    assert json.loads(store.storage.get(INDEX))["generation"] == 1


# -- 4. empty and partial states -------------------------------------------------------------------
def test_empty_and_partial_states_are_refused_at_write_and_a_wrong_layout_at_restore(storage):
    full = state(1)
    store = SnapshotStore(storage, layout=layout_of(full))
    with pytest.raises(ValueError, match="empty snapshot of step 1"):
        store.write(1, {})
    with pytest.raises(ValueError, match="does not cover the run's layout .1 tensors, 5 expected"):
        store.write(1, {"model.norm.weight": full["model.norm.weight"]})  # 1 of 4 units
    assert storage.list() == []  # nothing written
    run = SnapshotStore(storage, identity=RUN_A)  # no layout given: the run's newest snapshot's
    run.write(1, full)
    with pytest.raises(ValueError, match=r"does not cover the layout of snapshot step-0000000001-.*4 tensors, 5 expected; "
                                         r"tensor #3 is \['model.norm.weight'.*expected \['model.layers.1.mlp.up_proj.weight'"):
        run.write(2, {n: a for n, a in state(2).items() if not n.startswith("model.layers.1.")})
    other_model = layout_of({**full, "model.norm.weight": np.zeros(5, np.float32)})
    ours, theirs = layout_sha256(layout_of(full))[:12], layout_sha256(other_model)[:12]
    with pytest.raises(NoSnapshotError, match=re.escape(
            f"its layout (5 tensors, {ours}) differs from the model's (5 tensors, {theirs}): a snapshot of another model")):
        SnapshotStore(storage).load_latest(layout=other_model)
    assert SnapshotStore(storage).load_latest(layout=layout_of(full)).info.step == 1


def test_load_latest_skips_a_newer_snapshot_of_another_layout_and_a_corrupt_one_and_logs_the_corrupt(storage, caplog):
    full = state(1)
    SnapshotStore(storage).write(1, full)
    other = SnapshotStore(storage, layout=layout_of({**full, "model.norm.weight": np.zeros(5, np.float32)}))
    foreign = other.write(2, {**state(2), "model.norm.weight": np.zeros(5, np.float32)})
    bad = SnapshotStore(storage).write(3, state(3))
    flip_shard(storage, bad.manifest["units"]["embed"]["path"])
    store = SnapshotStore(storage, layout=layout_of(full))  # no layout passed to load_latest: the store's
    with caplog.at_level(logging.WARNING, logger="raycheck.storage.snapshots"):
        got = store.load_latest()
    assert (got.info.step, state_sha256(got.state)) == (1, state_sha256(full))
    assert len(got.skipped) == 2 and "unit embed" in got.skipped[0] and "corrupt" in got.skipped[0]
    assert got.skipped[1].startswith(f"snapshot {foreign.folder}: its layout (5 tensors, ")
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "raycheck.storage.snapshots"] == [
        (logging.WARNING, f"skipping {got.skipped[0]}")]


# -- 5. retention ----------------------------------------------------------------------------------
def test_retention_keeps_what_it_just_committed_and_the_newest_that_verifies(storage):
    first = SnapshotStore(storage, keep_last=1)
    first.write(10, state(10))
    first.write(12, state(12))
    newest = first.write(14, state(14))
    flip_shard(storage, newest.manifest["units"]["embed"]["path"])  # damaged between two incarnations
    store = SnapshotStore(storage, keep_last=1)  # a new writer trusts only what it committed itself
    store.write(5, state(5))  # before the fix: deleted at once, the corrupt step 14 kept
    assert [i.step for i in store.list()] == [5, 14]
    got = store.load_latest()
    assert (got.info.step, state_sha256(got.state)) == (5, state_sha256(state(5)))
    store.write(13, state(13))  # step 14 still fails verification: 13 is kept with it, 5 goes
    assert [i.step for i in store.list()] == [13, 14]
    store.write(11, state(11))  # now 13 is the newest that verifies, newer than 11: kept
    assert [i.step for i in store.list()] == [11, 13, 14] and store.load_latest().info.step == 13


def test_after_a_resume_damaged_snapshots_never_count_toward_keep_last_and_good_ones_stay(storage):
    """A resumed run finds its newest snapshots damaged (one truncated, one with a flipped byte): they
    do not push the good ones out; each earlier snapshot is verified once; the damaged ones are retired
    once ``keep_last`` good snapshots are newer than them."""
    first = SnapshotStore(storage, keep_last=3, identity=RUN_A, epoch=1)
    infos = {step: first.write(step, state(step)) for step in (2, 4, 6, 8)}
    flip_shard(storage, infos[6].manifest["units"]["embed"]["path"])
    truncated = infos[8].manifest["units"]["embed"]["path"]
    storage.put(truncated, storage.get(truncated)[:100])
    resumed = SnapshotStore(storage, keep_last=3, identity=RUN_A, epoch=2)
    verified = []
    real_verify = resumed.verify
    resumed.verify = lambda info: verified.append(info.step) or real_verify(info)
    resumed.write(8, state(8))
    resumed.write(10, state(10))
    assert sorted(verified) == [4, 6, 8]  # each earlier snapshot (2 was retired before) read once, its own trusted
    assert [i.step for i in resumed.list()] == [4, 6, 8, 8, 10]  # 4 is the third good one from the newest
    assert resumed.load_latest().info.step == 10
    resumed.write(12, state(12))  # three good ones (8, 10, 12) newer than the damaged: both retired
    assert [i.step for i in resumed.list()] == [8, 10, 12]
    assert not [p for p in storage.list() if p.startswith((infos[6].folder, infos[8].folder))]


def failed_attempt(storage: Storage, step: int, **store) -> str:
    """The folder of an attempt at ``step`` whose manifest put failed (its shards are stored)."""
    with pytest.raises(StorageError, match="injected failure"):
        SnapshotStore(spy(storage, fail_put=MANIFEST), **store).write(step, state(step))
    [folder] = {p.split("/")[0] for p in storage.list() if p.startswith(f"step-{step:010d}")} - {
        i.folder for i in SnapshotStore(storage).list()}
    return folder


def test_retention_deletes_failed_attempts_older_than_the_newest_snapshot_and_never_one_that_may_be_in_flight(storage):
    """This writer's own failed attempts (same epoch) older than the newest snapshot are deleted; an attempt
    at the newest step or later is kept, since it may still be in flight (an overlapped write, a composite
    written at the newest step), until a newer snapshot commits."""
    run = dict(identity=RUN_A, epoch=1)
    store = SnapshotStore(storage, keep_last=5, **run)
    store.write(1, state(1))
    old, same, later = (failed_attempt(storage, step, **run) for step in (2, 4, 6))
    store.write(4, state(4))  # newest is 4: the attempt at 2 goes, those at 4 and 6 stay
    folders = {p.split("/")[0] for p in storage.list()}
    assert old not in folders and {same, later} <= folders
    store.write(7, state(7))
    assert not {same, later} & {p.split("/")[0] for p in storage.list()}
    assert [i.step for i in store.list()] == [1, 4, 7]


class UndeletableStorage(Storage):
    """A real ``Storage`` whose deletes fail."""

    def delete(self, rel):
        raise PermissionError(f"{rel}: read-only")


def test_a_delete_that_fails_is_logged_with_its_path_and_error_and_the_index_is_already_rewritten(storage, caplog):
    store = SnapshotStore(UndeletableStorage(storage.uri, **storage.options), keep_last=1)
    first = store.write(1, state(1))
    with caplog.at_level(logging.WARNING, logger="raycheck.storage.snapshots"):
        second = store.write(2, state(2))
    path = f"{first.folder}/{MANIFEST}"
    assert f"retention could not delete {path}: {path}: read-only" in caplog.messages
    assert index_folders(storage) == [second.folder] and path in storage.list()


def test_retention_retires_unlisted_index_entries_up_to_the_committed_step_and_good_ones_past_the_kept(storage):
    """Index entries whose manifest is gone are retired only at or before the step just committed (a newer
    one may be another writer's, still to be repaired); listed snapshots not kept go whatever their step."""
    first = SnapshotStore(storage, keep_last=10, identity=RUN_A, epoch=1)
    infos = {step: first.write(step, state(step)) for step in (2, 4, 6, 7, 9, 10)}
    for step in (2, 6, 10):
        storage.delete(f"{infos[step].folder}/{MANIFEST}")
    resumed = SnapshotStore(storage, keep_last=1, identity=RUN_A, epoch=2)
    committed = resumed.write(6, state(6))  # 9 is the newest good one: kept with 6; 4 and 7 go; so do 2 and the damaged 6
    assert sorted(index_folders(storage)) == [committed.folder, infos[9].folder, infos[10].folder]
    assert [i.step for i in resumed.list()] == [6, 9]
    left = {p.split("/")[0] for p in storage.list()}
    assert not left & {infos[s].folder for s in (2, 4, 6, 7)} and infos[10].folder in left


class ManifestsUnreadable(Storage):
    """A real ``Storage`` on which no manifest can be read back (a listing that does not show them yet)."""

    def get(self, rel):
        if rel.endswith(MANIFEST):
            raise FileNotFoundError(rel)
        return super().get(rel)


def test_retention_counts_the_commit_as_newest_when_the_listing_does_not_show_it_yet(storage):
    run = dict(identity=RUN_A, epoch=1)
    older = failed_attempt(storage, 0, **run)
    info = SnapshotStore(ManifestsUnreadable(storage.uri, **storage.options), **run).write(1, state(1))
    assert index_folders(storage) == [info.folder]
    assert {p.split("/")[0] for p in storage.list()} == {info.folder, INDEX} - {older}


def test_a_composite_never_references_a_shard_that_fails_verification(storage):
    store = SnapshotStore(storage, keep_last=1)
    first = store.write(1, state(1))
    flip_shard(storage, first.manifest["units"]["embed"]["path"])
    s2 = state(2)
    changed = {n: a for n, a in s2.items() if not n.startswith("model.embed_tokens.")}
    with pytest.raises(ValueError, match=r"embed\.safetensors: sha256 differs"):
        store.write_units(2, changed, list(s2))
    info = store.write_units(2, changed, list(s2), full_state=s2)  # the failing unit is rewritten
    assert info.manifest["units"]["embed"]["path"] == f"{info.folder}/embed.safetensors"
    assert info.manifest["units"]["embed"]["step"] == 2
    assert [i.step for i in store.list()] == [2]  # retention dropped step 1 and nothing references it
    assert not [p for p in storage.list() if p.startswith(first.folder)]
    assert state_sha256(store.load_latest().state) == state_sha256(s2)


# -- 7. paths that escape the store ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["../../x", "/abs/x.weight", "model/../../x.weight", ".hidden.weight", "a\\b.weight"])
def test_names_that_would_leave_the_store_are_refused_at_write(tmp_path, name):
    store = SnapshotStore(str(tmp_path / "store"))
    with pytest.raises(ValueError, match="not allowed"):
        store.write(1, {**state(1), name: np.zeros(2, np.float32)})
    assert store.storage.list() == [] and sorted(p.name for p in tmp_path.iterdir()) == ["store"]


@pytest.mark.parametrize("path", ["../outside/embed.safetensors", "/etc/embed.safetensors",
                                  "step-0000000009-aaaaaaaa/../../x/embed.safetensors", "step-0000000009-aaaaaaaa/norm.safetensors"])
def test_a_manifest_path_pointing_elsewhere_is_never_read(tmp_path, path):
    store = SnapshotStore(str(tmp_path / "store"))
    store.write(5, state(5))
    info = store.write(9, state(9))
    rewrite_manifest(store.storage, info.folder,
                     lambda m: {**m, "units": {**m["units"], "embed": {**m["units"]["embed"], "path": path}}})
    got = store.load_latest()
    assert got.info.step == 5 and "unit 'embed': path" in got.skipped[0]


def test_a_diff_commit_record_pointing_elsewhere_is_skipped(tmp_path):
    diffs = DiffStore(str(tmp_path / "store"))
    batch = diffs.write_batch([(0, {"w": np.ones(3, np.float32)})])
    record = json.loads(diffs.storage.get(batch.commit))
    diffs.storage.put(batch.commit, json.dumps({**record, "path": "../../elsewhere.safetensors"}).encode())
    assert diffs.list() == [] and "is not its own batch" in diffs.skipped[0]


# -- 17.2 ordering contracts -----------------------------------------------------------------------
class SpyStorage(Storage):
    """A real ``Storage`` that records every put (streamed or not), conditional put and delete, in order; ``fail_put``
    makes a put of a path with that suffix fail."""

    def __init__(self, *args, fail_put: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []
        self._calls_lock = threading.Lock()
        self.fail_put = fail_put

    def _record(self, op: str, rel: str) -> None:
        with self._calls_lock:
            self.calls.append((op, rel))

    def put(self, rel, data):
        if self.fail_put and rel.endswith(self.fail_put):
            raise StorageError(f"put {rel}: injected failure")
        super().put(rel, data)  # recorded by put_stream, which every put goes through

    def put_stream(self, rel, pieces):
        written = super().put_stream(rel, pieces)
        self._record("put", rel)
        return written

    def put_if_match(self, rel, data, expected):
        super().put_if_match(rel, data, expected)
        self._record("put", rel)

    def delete(self, rel):
        self._record("delete", rel)
        super().delete(rel)


def spy(storage: Storage, **kwargs) -> SpyStorage:
    return SpyStorage(storage.uri, **storage.options, **kwargs)


def test_shards_then_manifest_then_index(storage):
    s = spy(storage)
    info = SnapshotStore(s).write(3, state(3))
    puts = [rel for op, rel in s.calls if op == "put"]
    shards = {spec["path"] for spec in info.manifest["units"].values()}
    assert set(puts[:4]) == shards and puts[4:] == [f"{info.folder}/{MANIFEST}", INDEX]


def test_retention_rewrites_the_index_before_any_delete(storage):
    s = spy(storage)
    store = SnapshotStore(s, keep_last=1)
    first = store.write(1, state(1))
    s.calls.clear()
    second = store.write(2, state(2))
    ops = [(op, rel) for op, rel in s.calls if rel == INDEX or op == "delete"]
    assert ops[0] == ("put", INDEX) and ops[1] == ("put", INDEX)  # the commit, then the index without step 1
    assert {rel for op, rel in ops[2:]} == {f"{first.folder}/{u}.safetensors" for u in first.manifest["units"]} | {
        f"{first.folder}/{MANIFEST}"} and all(op == "delete" for op, _ in ops[2:])
    assert index_folders(storage) == [second.folder]


def test_the_index_generation_counts_its_writes_from_the_first_commit(storage):
    store = SnapshotStore(storage, keep_last=5)
    for step in (1, 2):  # one index write per commit; nothing to retire
        store.write(step, state(step))
    assert json.loads(storage.get(INDEX))["generation"] == 2


def test_a_failed_manifest_put_leaves_the_index_equal_to_the_listing(storage):
    store = SnapshotStore(storage)
    store.write(1, state(1))
    before = storage.get(INDEX)
    with pytest.raises(StorageError, match="injected failure"):
        SnapshotStore(spy(storage, fail_put=MANIFEST)).write(2, state(2))
    assert storage.get(INDEX) == before
    assert index_folders(storage) == [i.folder for i in store.list()] and [i.step for i in store.list()] == [1]


def test_a_run_config_builds_a_store_of_its_identity_and_epoch_and_a_stale_persister_is_fenced(tmp_path):
    from raycheck.job.config import JobConfig

    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), model="tiny", run_id="r1")
    stale = snapshot_store(cfg)
    assert (stale.identity, stale.epoch) == (RunIdentity("r1", cfg.trajectory_sha256()), 0)
    resumed = cfg.replace(writer_epoch=snapshot_store(cfg).claim_epoch())  # what the controller does at each start
    assert resumed.writer_epoch == 1 and snapshot_store(resumed).epoch == 1
    persister = SnapshotPersister(stale)  # an actor left over from the dead driver
    persister.submit(3, state(3))
    status = persister.flush(timeout_s=60)
    assert (status["failed"], status["last_durable_step"]) == (1, None) and "FencedError" in status["last_error"]
    assert snapshot_store(resumed).list() == []


def test_a_shard_replaced_by_a_folder_is_a_bad_shard_not_a_traceback(tmp_path):
    store = SnapshotStore(str(tmp_path))
    store.write(10, state(10))
    info = store.write(20, state(20))
    paths = {u: spec["path"] for u, spec in info.manifest["units"].items()}
    (tmp_path / paths["embed"]).unlink()
    (tmp_path / paths["embed"]).mkdir()
    flip_shard(store.storage, paths["norm"])  # a unit after it: still checked
    assert store.verify(info) == [f"{paths['embed']}: not a file", f"{paths['norm']}: sha256 differs from the manifest (corrupt)"]
    assert store.load_latest().info.step == 10
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 1 and "not a file" in result.output and "Traceback" not in result.output


# -- composite (layer-wise) writes: what they refuse and what they record ------------------------------
WIDE = {f"model.layers.0.t{i}.weight": np.full(2, i, np.float32) for i in range(5)}  # one unit of five tensors


def test_a_composite_that_cannot_be_written_names_every_problem(tmp_path):
    """Part of a unit, a step older than the newest snapshot, a unit with nothing to reference and a
    committed unit that holds other tensors: one error names each (the first 3 tensor names of a unit)."""
    store = SnapshotStore(str(tmp_path))
    store.write(4, {**WIDE, "model.norm.weight": np.ones(2, np.float32)})
    folder = store.list()[-1].folder
    names = [*WIDE, "model.norm.bias", "lm_head.weight"]
    with pytest.raises(ValueError) as info:
        store.write_units(3, {n: a for n, a in WIDE.items() if not n.startswith("model.layers.0.t0")}, names)
    assert str(info.value) == "\n  ".join([
        "cannot write the composite snapshot of step 3:",
        "unit layer.000: got tensors ['model.layers.0.t1.weight', 'model.layers.0.t2.weight', 'model.layers.0.t3.weight']..., "
        "the layout has ['model.layers.0.t0.weight', 'model.layers.0.t1.weight', 'model.layers.0.t2.weight']...",
        "step 3 is older than the newest committed snapshot (step 4)",
        f"unit norm: the committed version ({folder}) holds other tensors than the layout",
        "unit lm_head is not in the new tensors and has no committed version to reference"])
    with pytest.raises(ValueError, match=r"^cannot write .*\n  unit embed: got tensors \['model.embed_tokens.weight'\]\.\.\., "
                                         r"the layout has \[\]\.\.\.$"):
        store.write_units(5, {"model.embed_tokens.weight": np.ones(2, np.float32)}, [*WIDE, "model.norm.weight"])


def test_a_composite_rewrites_exactly_the_referenced_units_whose_shards_fail_and_says_so(tmp_path, caplog):
    """Units norm and lm_head (the 2nd and 3rd referenced) have rotten shards: with the full state they
    are rewritten at the new step, with a warning each; without it the error names both problems."""
    full = {"model.embed_tokens.weight": np.ones(2, np.float32), **WIDE, "model.norm.weight": np.ones(2, np.float32),
            "lm_head.weight": np.ones(2, np.float32)}
    store = SnapshotStore(str(tmp_path), keep_last=10)
    store.write(4, full, config={"lr": 1.0})
    base = store.list()[-1]
    for unit in ("norm", "lm_head"):
        flip_shard(store.storage, base.manifest["units"][unit]["path"])
    changed = {n: a + 1 for n, a in WIDE.items()}
    with pytest.raises(ValueError) as info:
        store.write_units(6, changed, list(full))
    paths = {u: base.manifest["units"][u]["path"] for u in ("norm", "lm_head")}
    assert str(info.value) == ("cannot reference the committed shards of step 4: "
                               f"{paths['norm']}: sha256 differs from the manifest (corrupt); "
                               f"{paths['lm_head']}: sha256 differs from the manifest (corrupt)")
    with caplog.at_level(logging.WARNING, logger="raycheck.storage.snapshots"):
        info6 = store.write_units(6, changed, list(full), config={"lr": 2.0}, full_state={**full, **changed})
    assert [r.getMessage() for r in caplog.records] == [
        f"rewriting unit {u} instead of referencing a shard that failed verification: {paths[u]}: sha256 differs from "
        "the manifest (corrupt)" for u in ("norm", "lm_head")]
    steps = {u: s["step"] for u, s in info6.manifest["units"].items()}
    assert steps == {"embed": 4, "layer.000": 6, "norm": 6, "lm_head": 6} and info6.manifest["config"] == {"lr": 2.0}
    assert state_sha256(store.load(info6)) == state_sha256({**full, **changed})


def test_a_composite_may_be_written_at_the_newest_snapshots_step_and_is_held_to_the_runs_layout(tmp_path):
    full = {**WIDE, "model.norm.weight": np.ones(2, np.float32)}
    store = SnapshotStore(str(tmp_path), layout=layout_of(full))
    store.write(4, full)
    again = store.write_units(4, {"model.norm.weight": np.zeros(2, np.float32)}, list(full))  # same step: allowed
    assert again.step == 4 and again.manifest["units"]["norm"]["step"] == 4
    with pytest.raises(ValueError, match=r"^refusing the snapshot of step 6: it does not cover the run's layout"):
        store.write_units(6, {"model.norm.weight": np.zeros(2, np.float64)}, list(full))


def test_store_defaults_and_an_epoch_claim_without_a_run(tmp_path):
    store = SnapshotStore(str(tmp_path))
    for step in range(5):
        store.write(step, state(step))
    assert [i.step for i in store.list()] == [2, 3, 4]  # keep_last defaults to 3
    with pytest.raises(ValueError, match=r"^claim_epoch needs a run identity$"):
        store.claim_epoch()
