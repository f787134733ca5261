"""``raycheck replay``: any logged step rebuilt bitwise, also under other CPU kernels; clear refusals.

The run is made without Ray by the worker's own step (``conftest.zo_step_``: ``workers.zo_session.mezo_step_`` over ``workers.worker.task_batch``) on the tiny model,
with the machine's best CPU kernels, its step log written by ``StepLogWriter`` and a snapshot of step 3
committed with the run's identity, as the persister does. Its state sha256 after every step is what
the replay must reproduce.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from typer.testing import CliRunner

from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.job.stores import snapshot_store
from raycheck.cli.main import app
from raycheck.orchestrator.prepare import prepare
from raycheck.storage.backend import Storage
from raycheck.storage.log_segments import SegmentMirror
from raycheck.storage.manifest import RunIdentity
from raycheck.storage.merge import Source, merge_snapshots, parse_take
from raycheck.storage.snapshots import SnapshotInfo, SnapshotStore
from raycheck.storage.steplog import RECORD_BYTES, StepLogWriter, read_log
from raycheck.training.model import default_cache_dir, load_model, trainable_parameters
from raycheck.training.state import copy_state, state_sha256
from conftest import zo_step_
from raycheck.workers.zo_session import timed_append
from raycheck.training.zo import ZOHyper, step_seed

STEPS, SNAPSHOT_STEP = 6, 3


@pytest.fixture(scope="module")
def made(tmp_path_factory, encoder, data) -> tuple[pathlib.Path, dict[int, str]]:
    """(run directory, state sha256 after each step 0..STEPS) of a run made by the worker's step."""
    out = tmp_path_factory.mktemp("run")
    cfg = JobConfig(out_dir=str(out), cache_dir=str(default_cache_dir()), model="tiny", steps=STEPS, weight_decay=0.01,
                    run_id="replayed", zo={"lr": 1e-3})
    prepare(cfg, RunDir(out))
    model = load_model("tiny")
    params = trainable_parameters(model)
    hashes = {0: state_sha256(params)}
    writer = StepLogWriter.open(RunDir(out).step_log)
    for step in range(STEPS):
        zo_step_(params, model, encoder, data[0], cfg, step, 0, 1, ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay),
                 fail=lambda: None, commit=timed_append(writer))
        hashes[step + 1] = state_sha256(params)
        if step + 1 == SNAPSHOT_STEP:
            snapshot_store(cfg).write(SNAPSHOT_STEP, copy_state(params))
    writer.close()
    assert len(set(hashes.values())) == STEPS + 1  # every step changed the state
    return out, hashes


def replay(*args: str):
    return CliRunner().invoke(app, ["replay", *map(str, args)])


def printed_sha256(output: str) -> str:
    return output.strip().splitlines()[-1].removeprefix("state_sha256 ")


def test_every_step_is_rebuilt_bitwise_from_the_newest_own_snapshot_at_or_before_it(made):
    run, hashes = made
    bases = {0: ("the initial weights", "nothing to replay"), 2: ("the initial weights", "replayed steps 0..1 (2)"),
             3: ("snapshot of step 3", "nothing to replay"), 6: ("snapshot of step 3", "replayed steps 3..5 (3)")}
    for step, (base, replayed) in bases.items():
        result = replay(run, "--step", step)
        assert result.exit_code == 0, result.output
        assert f"step {step}: base {base}" in result.output and replayed in result.output
        assert printed_sha256(result.output) == hashes[step]
    result = replay(run, "--step", 5, "--from-initial")
    assert result.exit_code == 0, result.output
    assert "base the initial weights; replayed steps 0..4 (5)" in result.output
    assert printed_sha256(result.output) == hashes[5]


def test_replay_under_the_default_cpu_kernels_prints_the_worker_s_sha256(made):
    """The run was made in this process with the best kernels; the replay runs with
    ATEN_CPU_CAPABILITY=default and numba's generic CPU target, in its own process."""
    run, hashes = made
    probe = ("import sys, torch; print('capability', torch.backends.cpu.get_cpu_capability()); "
             "from cli.main import app; sys.argv = ['raycheck', 'replay', *sys.argv[1:]]; app()")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "NUMBA_CPU_NAME": "generic",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", probe, str(run), "--step", "5"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("capability DEFAULT\n")
    assert torch.backends.cpu.get_cpu_capability() != "DEFAULT"  # this machine's best (AVX2 here) made the run
    assert printed_sha256(proc.stdout) == hashes[5]


def test_a_store_with_mirrored_segments_write_snapshot_to_and_export_hf(made, tmp_path):
    """The log from a store's segments (no run directory); the state committed as a snapshot of the
    run (no retention, the older snapshot stays) and exported as a transformers folder."""
    run, hashes = made
    store_dir = tmp_path / "store"
    shutil.copytree(run / "snapshots", store_dir)
    SegmentMirror(Storage(str(store_dir)), run / "steplog.bin").sync(final=True)
    export = tmp_path / "hf"
    result = replay(f"file://{store_dir}", "--step", 5, "--write-snapshot", "--export-hf", export)
    assert result.exit_code == 0, result.output
    assert f"log {store_dir}/log (6 steps)" in result.output and printed_sha256(result.output.split("committed")[0]) == hashes[5]
    identity = RunIdentity("replayed", JobConfig.from_dict(json.loads((run / "config.json").read_text())).trajectory_sha256())
    own = SnapshotStore(str(store_dir), identity=identity)
    assert [i.step for i in own.list()] == [SNAPSHOT_STEP, 5]
    assert state_sha256(own.load(own.list()[-1])) == hashes[5]
    exported = load_file(str(export / "model.safetensors"))
    replayed = own.load(own.list()[-1])
    assert set(exported) == set(replayed) and all(np.array_equal(exported[n], replayed[n]) for n in replayed)
    assert (export / "config.json").is_file()

    result = replay(f"file://{store_dir}", "--step", 6)  # the written snapshot is now the base
    assert "base snapshot of step 5" in result.output and printed_sha256(result.output) == hashes[6]
    result = replay(run, "--step", 4, "--to", tmp_path / "other")
    assert result.exit_code == 0, result.output
    other = SnapshotStore(str(tmp_path / "other"), identity=identity)
    assert [(i.step, state_sha256(other.load(i))) for i in other.list()] == [(4, hashes[4])]


def _copy_run(run: pathlib.Path, to: pathlib.Path, records: slice = slice(None), **header) -> pathlib.Path:
    """A copy of ``run`` whose log keeps ``records`` and has ``header`` changes; its config points at
    its own snapshots folder."""
    shutil.copytree(run, to)
    old_header, records_kept, _ = read_log(run / "steplog.bin")
    (to / "steplog.bin").unlink()
    writer = StepLogWriter.create(to / "steplog.bin", {**old_header, **header})
    for rec in records_kept[records]:
        writer.append(rec)
    writer.close()
    config = json.loads((to / "config.json").read_text())
    RunDir.write_json(to / "config.json", {**config, "out_dir": str(to), "storage": {"uri": str(to / "snapshots")}})
    return to


def test_a_moved_run_directory_replays_from_its_own_snapshots(made, tmp_path):
    """Its ``config.json`` still names the old place: a store that lay inside the old run directory is
    taken from inside the moved one; one that lay outside and is gone is refused, naming both paths."""
    run, hashes = made
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    config = json.loads((moved / "config.json").read_text())
    old = tmp_path / "old place"  # where the run was, and is no longer
    RunDir.write_json(moved / "config.json", {**config, "out_dir": str(old), "storage": {"uri": str(old / "snapshots")}})
    result = replay(moved, "--step", 5)
    assert result.exit_code == 0, result.output
    assert f"step 5: base snapshot of step 3 ({moved / 'snapshots'}/" in result.output
    assert printed_sha256(result.output) == hashes[5]
    gone = tmp_path / "elsewhere" / "store"
    RunDir.write_json(moved / "config.json", {**config, "out_dir": str(old), "storage": {"uri": str(gone)}})
    result = replay(moved, "--step", 5)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"error: the run's snapshot store {gone} (named in {moved / 'config.json'}) no longer "
                                     f"exists, and it lay outside the run's directory ({old}), so it did not move with "
                                     f"{moved}: put it back there, or set \"storage\" in config.json to where it is now")
def test_a_merge_result_in_the_runs_store_is_named_with_its_use_never_taken_as_the_base(made, tmp_path):
    """The run's store is a ``raycheck merge`` output (the merge of its own snapshot of step 3) that the
    run then wrote its own snapshot of step 3 into: the merge is skipped and was skipped silently; now it
    is named at any --step at or after it."""
    run, hashes = made
    merged = SnapshotStore(str(tmp_path / "merged"))
    merge_snapshots([Source("A", SnapshotStore(str(run / "snapshots")))], [parse_take("0-1,embed,norm:A")], merged)
    [merge_info] = merged.list()
    copy = _copy_run(run, tmp_path / "run")
    config = json.loads((copy / "config.json").read_text())
    RunDir.write_json(copy / "config.json", {**config, "storage": {"uri": str(tmp_path / "merged")}})
    identity = RunIdentity("replayed", JobConfig.from_dict(config).trajectory_sha256())
    own = SnapshotStore(str(run / "snapshots"), identity=identity)
    SnapshotStore(str(tmp_path / "merged"), identity=identity).write(SNAPSHOT_STEP, own.load(own.list()[0]))
    named = (f"skipped merge result at step {SNAPSHOT_STEP} ({tmp_path / 'merged'}/{merge_info.folder}): a merge is a new run's "
             "starting point (raycheck run --algo fo --storage STORE, docs/first-order.md), never a state of run replayed's logged steps")
    result = replay(copy, "--step", 5)
    assert result.exit_code == 0, result.output
    assert named in result.output.splitlines()
    assert f"step 5: base snapshot of step 3 ({tmp_path / 'merged'}/step-" in result.output
    assert printed_sha256(result.output) == hashes[5]
    for args in (("--step", 2), ("--step", 5, "--from-initial")):  # before the merge's step, or no snapshot looked at
        result = replay(copy, *args)
        assert result.exit_code == 0 and "merge result" not in result.output, result.output


def test_other_runs_snapshots_in_the_runs_store_are_named_in_one_line_never_taken_as_the_base(made, tmp_path):
    """Snapshots of another run in the run's store (steps 2 and 4, beside the run's own of step 3): those at or
    before --step are named in one line, as merge results are; they were skipped silently before."""
    run, hashes = made
    copy = _copy_run(run, tmp_path / "run")
    own = SnapshotStore(str(copy / "snapshots"))
    state = own.load(own.list()[0])
    other = SnapshotStore(str(copy / "snapshots"), identity=RunIdentity("someone-else", "0" * 64))
    infos = [other.write(step, state) for step in (2, 4)]
    result = replay(copy, "--step", 5)
    assert result.exit_code == 0, result.output
    named = [line for line in result.output.splitlines() if "other runs" in line]
    other_run = "run someone-else (trajectory 000000000000)"
    assert named == [f"skipped 2 snapshot(s) of other runs, never a base of run replayed's logged steps: step 2 of {other_run} "
                     f"at {copy / 'snapshots'}/{infos[0].folder}, step 4 of {other_run} at {copy / 'snapshots'}/{infos[1].folder}"
                     ], result.output
    assert f"step 5: base snapshot of step 3 ({copy / 'snapshots'}/step-" in result.output
    assert printed_sha256(result.output) == hashes[5]
    result = replay(copy, "--step", 3)
    assert (f"skipped 1 snapshot(s) of other runs, never a base of run replayed's logged steps: step 2 of {other_run} at "
            f"{copy / 'snapshots'}/{infos[0].folder}\n") in result.output
    assert printed_sha256(result.output) == hashes[3]
    for args in (("--step", 1), ("--step", 5, "--from-initial")):  # before them, or no snapshot looked at
        result = replay(copy, *args)
        assert result.exit_code == 0 and "other runs" not in result.output, result.output


def test_a_copied_run_directory_replays_from_and_writes_to_its_own_snapshots_not_the_original_s(made, tmp_path):
    """``cp -r run copy``: the copy's ``config.json`` names the original's default store (inside the original
    run directory, which still exists). The copy reads its own snapshots and ``--write-snapshot`` commits
    into them; before the fix it read the original's store and committed into it (another directory)."""
    run, hashes = made
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    result = replay(copy, "--step", 5, "--write-snapshot")
    assert result.exit_code == 0, result.output
    assert f"step 5: base snapshot of step 3 ({copy / 'snapshots'}/" in result.output
    assert printed_sha256(result.output.split("committed")[0]) == hashes[5]
    assert f"committed snapshot of step 5: {copy / 'snapshots'}/" in result.output
    assert {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before
    result = replay(copy, "--step", 6)  # the copy's own new snapshot is the base
    assert f"base snapshot of step 5 ({copy / 'snapshots'}/" in result.output and printed_sha256(result.output) == hashes[6]


def test_write_snapshot_of_a_state_the_store_already_holds_commits_no_second_copy(made, tmp_path):
    """``--write-snapshot`` twice on one step, or on the step of the run's own snapshot: the store already
    holds a committed snapshot of the run at that step with the same state sha256, so nothing is written
    (before the fix each call committed another full copy of the same state); exit 0, saying so. A store
    whose snapshot of the step is damaged gets a new one."""
    run, hashes = made
    copy = _copy_run(run, tmp_path / "copy")
    assert replay(copy, "--step", 5, "--write-snapshot").exit_code == 0
    folders = sorted(p.name for p in (copy / "snapshots").iterdir())
    [written] = [f for f in folders if f.startswith("step-0000000005-")]
    for step, folder in ((5, written), (SNAPSHOT_STEP, next(f for f in folders if f.startswith("step-0000000003-")))):
        result = replay(copy, "--step", step, "--write-snapshot")
        assert result.exit_code == 0, result.output
        assert result.output.strip().splitlines()[-1] == (
            f"not committed: {copy / 'snapshots'} already holds a committed snapshot of run replayed at step {step} with "
            f"this state_sha256 ({copy / 'snapshots'}/{folder})"), result.output
        assert printed_sha256(result.output.split("not committed")[0]) == hashes[step]
        assert sorted(p.name for p in (copy / "snapshots").iterdir()) == folders
    other = tmp_path / "other"
    for _ in range(2):
        assert replay(copy, "--step", 4, "--to", other).exit_code == 0
    assert len([p for p in other.iterdir() if p.name.startswith("step-")]) == 1
    shard = next((copy / "snapshots" / written).glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    result = replay(copy, "--step", 5, "--write-snapshot")
    assert result.exit_code == 0 and f"committed snapshot of step 5: {copy / 'snapshots'}/" in result.output, result.output
    assert len(list((copy / "snapshots").glob("step-0000000005-*"))) == 2


def _off_trajectory_snapshot(run: pathlib.Path, step: int) -> tuple[SnapshotInfo, dict]:
    """Commit into ``run``'s store a snapshot of ``step`` with the run's identity (so it verifies) whose state
    is its first snapshot's with one element changed: off the run's trajectory. Returns it and that state."""
    own = SnapshotStore(str(run / "snapshots"))
    base = own.list()[0]
    state = {name: np.array(a) for name, a in own.load(base).items()}
    state[next(iter(state))].reshape(-1)[0] += 1
    wrong = SnapshotStore(str(run / "snapshots"), identity=RunIdentity(**base.manifest["run"]), keep_last=10)
    wrong.epoch = wrong.run_epoch()
    return wrong.write(step, state), state


def test_write_snapshot_over_the_run_s_snapshot_of_another_state_is_refused_as_not_bitwise_equal(made, tmp_path):
    """The store holds the run's own committed snapshot of step 5 whose state differs from the one replayed from
    the initial weights (one element changed, written with the run's identity, so it verifies): the log and the
    snapshot disagree.
    ``--write-snapshot`` exits 3 naming the snapshot and its sha256 and commits nothing; before the fix it
    committed a second, different snapshot of the step beside it."""
    run, hashes = made
    copy = _copy_run(run, tmp_path / "copy")
    info, state = _off_trajectory_snapshot(copy, 5)
    folders = sorted(p.name for p in (copy / "snapshots").iterdir())
    result = replay(copy, "--step", 5, "--write-snapshot", "--from-initial",  # the log alone, not that snapshot
                    "--export-hf", tmp_path / "hf")
    assert result.exit_code == 3, result.output
    assert not (tmp_path / "hf").exists()  # the state is in doubt: no transformers folder either
    assert printed_sha256(result.output.split("error:")[0]) == hashes[5]
    assert (f"error: not bitwise equal: {copy / 'snapshots'}/{info.folder} holds run replayed's snapshot of step 5 with "
            f"state_sha256 {state_sha256(state)}, not the replayed state's") in result.output
    assert result.output.strip().splitlines()[-1] == "error: nothing committed"
    assert sorted(p.name for p in (copy / "snapshots").iterdir()) == folders
    assert replay(copy, "--step", 4, "--write-snapshot").exit_code == 0  # another step is unaffected


def test_replay_from_a_snapshot_off_the_trajectory_is_refused_against_the_hash_the_run_recorded(made, tmp_path):
    """The store holds the run's own snapshot of step 5 with one element changed, written with the run's
    identity: it verifies, and it is the newest base for step 6. The run directory's ``summary.json`` recorded
    the worker's state sha256 after step 6 (``worker_hashes``, ``--hash-every``). ``replay --step 6`` exits 3
    naming the recorded hash and the snapshot, committing and exporting nothing; before the fix it printed the
    wrong hash and exited 0 (a fresh user's find). ``--from-initial`` gives the recorded hash and says so;
    a summary of another trajectory records nothing for this run."""
    run, hashes = made
    copy = _copy_run(run, tmp_path / "copy")
    _off_trajectory_snapshot(copy, 5)
    trajectory = read_log(copy / "steplog.bin")[0]["trajectory_sha256"]
    summary = {"ok": True, "final_step": STEPS, "state_sha256": hashes[STEPS], "trajectory_sha256": trajectory,
               "worker_hashes": {"6": hashes[6]}}
    (copy / "summary.json").write_text(json.dumps(summary))
    folders = sorted(p.name for p in (copy / "snapshots").iterdir())
    result = replay(copy, "--step", 6, "--write-snapshot", "--export-hf", tmp_path / "hf")
    assert result.exit_code == 3, result.output
    assert printed_sha256(result.output.split("error:")[0]) != hashes[6]  # the wrong base, replayed exactly
    assert (f"error: not bitwise equal: the run recorded state_sha256 {hashes[6]} at step 6 ({copy / 'summary.json'}); the "
            "snapshot of step 5 it started from is off the run's trajectory") in result.output
    assert result.output.strip().splitlines()[-1] == "error: nothing committed"
    assert sorted(p.name for p in (copy / "snapshots").iterdir()) == folders and not (tmp_path / "hf").exists()
    exact = replay(copy, "--step", 6, "--from-initial")
    assert exact.exit_code == 0 and printed_sha256(exact.output) == hashes[6], exact.output
    assert f"bitwise equal to the state the run recorded at step 6 ({copy / 'summary.json'})" in exact.output
    (copy / "summary.json").write_text(json.dumps({**summary, "trajectory_sha256": "0" * 64}))
    assert replay(copy, "--step", 6).exit_code == 0  # not this run's record: nothing to compare with


def test_a_copy_of_a_run_whose_snapshots_folder_is_a_symlink_writes_its_own_snapshots(made, tmp_path):
    """The run's ``snapshots`` is a symlink to another disk (``big/snaps``); ``shutil.copytree`` (as ``cp -rL``)
    copies the snapshots into the copy. The recorded store lies inside the recorded run directory as
    recorded, so the copy reads and writes its own: before the fix the recorded store was resolved through
    the original's symlink first, fell outside the run directory, and the copy wrote into ``big/snaps``.
    The copy reached through a symlink (``alias``) is the same copy."""
    run, hashes = made
    shutil.copytree(run / "snapshots", tmp_path / "big" / "snaps")
    original = tmp_path / "original"
    shutil.copytree(run, original, ignore=shutil.ignore_patterns("snapshots"))
    (original / "snapshots").symlink_to(tmp_path / "big" / "snaps")
    config = json.loads((original / "config.json").read_text())
    RunDir.write_json(original / "config.json", {**config, "out_dir": str(original), "storage": {"uri": str(original / "snapshots")}})
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    (tmp_path / "alias").symlink_to(copy)
    before = sorted(p.name for p in (tmp_path / "big" / "snaps").iterdir())
    result = replay(copy, "--step", 5, "--write-snapshot")
    assert result.exit_code == 0, result.output
    assert f"step 5: base snapshot of step 3 ({copy / 'snapshots'}/" in result.output, result.output
    assert f"committed snapshot of step 5: {copy / 'snapshots'}/" in result.output
    assert printed_sha256(result.output.split("committed")[0]) == hashes[5]
    assert sorted(p.name for p in (tmp_path / "big" / "snaps").iterdir()) == before
    result = replay(tmp_path / "alias", "--step", 6)  # the copy's new snapshot is the base
    assert f"step 6: base snapshot of step 5 ({copy / 'snapshots'}/" in result.output, result.output
    assert printed_sha256(result.output) == hashes[6]
    result = replay(original, "--step", 5)  # the original still reads its store, through its symlink
    assert f"step 5: base snapshot of step 3 ({tmp_path / 'big' / 'snaps'}/" in result.output, result.output


def test_refusals_are_one_line_with_their_exit_code_and_write_nothing(made, tmp_path):
    run, _ = made
    before = sorted(p.name for p in (run / "snapshots").iterdir())
    cases = []
    cases.append((replay(run, "--step", STEPS + 1, "--write-snapshot"), 2,
                  f"step {STEPS + 1} is not in the log: {run}/steplog.bin holds {STEPS} step(s), so --step can be 0..{STEPS}"))
    (tmp_path / "empty").mkdir()
    cases.append((replay(tmp_path / "empty", "--step", 1), 2, f"no run at {tmp_path / 'empty'}: it holds no step log"))
    cases.append((replay(run / "snapshots", "--step", 1), 2, f"no run at {run / 'snapshots'}: it holds no step log (steplog.bin) "
                  "and no mirrored log segments (log/segment-*.bin; only a run with remote --storage, e.g. s3://, mirrors "
                  f"them): give the run directory instead (the folder holding steplog.bin, here {run})"))
    cases.append((replay(tmp_path / "missing", "--step", 1), 2, "no such folder"))
    other = _copy_run(run, tmp_path / "generator", generator="torch-cpu-mt19937:randn")
    cases.append((replay(other, "--step", 1), 2, "was written with generator 'torch-cpu-mt19937:randn'"))

    gap = _copy_run(run, tmp_path / "gap")
    data = (gap / "steplog.bin").read_bytes()
    start = len(data) - STEPS * RECORD_BYTES
    (gap / "steplog.bin").write_bytes(data[:start + 2 * RECORD_BYTES] + data[start + 3 * RECORD_BYTES:])  # step 2 gone
    cases.append((replay(gap, "--step", 3), 1, "is step 3, expected step 2; steps 2..2 are missing"))

    spliced = _copy_run(run, tmp_path / "spliced")  # step 4's record from a run of seed 1: valid checksum, right step
    header, records, _ = read_log(spliced / "steplog.bin")
    (spliced / "steplog.bin").unlink()
    writer = StepLogWriter.create(spliced / "steplog.bin", header)
    for rec in records:
        writer.append(dataclasses.replace(rec, seed=step_seed(1, 4)) if rec.step == 4 else rec)
    writer.close()
    cases.append((replay(spliced, "--step", 5), 1, "the record of step 4 is not this run's"))  # before the fix: a wrong sha256

    foreign = _copy_run(run, tmp_path / "foreign")
    shutil.rmtree(foreign / "snapshots")
    state = SnapshotStore(str(run / "snapshots")).load(SnapshotStore(str(run / "snapshots")).list()[0])
    SnapshotStore(str(foreign / "snapshots"), identity=RunIdentity("someone-else", "0" * 64)).write(2, state)
    cases.append((replay(foreign, "--step", 4), 2, "holds 1 snapshot(s), all of other runs (someone-else), none of run replayed"))

    for result, code, message in cases:
        assert result.exit_code == code, result.output
        assert result.output.startswith("error: ") and result.output.count("\n") == 1 and message in result.output
        assert "Traceback" not in result.output
    assert sorted(p.name for p in (run / "snapshots").iterdir()) == before
    result = replay(foreign, "--step", 4, "--from-initial")  # what the refusal offers works
    assert result.exit_code == 0 and "base the initial weights" in result.output


@pytest.mark.parametrize(("algo", "strategy", "kind"), [("fo", "layerwise", "first-order runs (--algo fo) log"),
                                                      ("zo", "full-sync", "--strategy full-sync logs")])
def test_a_run_without_a_step_log_is_refused_saying_so(tmp_path, algo, strategy, kind):
    """Its ``steplog.bin`` holds a header and no records by design: not "--step can be 0..0"."""
    out = tmp_path / "run"
    out.mkdir()
    prepare(JobConfig(out_dir=str(out), cache_dir=str(default_cache_dir()), model="tiny", algo=algo, strategy=strategy,
                      steps=6, run_id="unlogged"), RunDir(out))
    result = CliRunner().invoke(app, ["replay", str(out), "--step", "3"])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"error: {out} is an --algo {algo} --strategy {strategy} run: {kind} no steps, so "
                                     f"there is no step log to replay; its checkpoints are listed by raycheck inspect {out}")


def test_an_export_folder_that_holds_files_is_refused_before_the_replay(made, tmp_path):
    run, _ = made
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "other.safetensors").write_bytes(b"x")
    result = replay(run, "--step", 2, "--export-hf", tmp_path / "hf")
    assert result.exit_code == 2 and "is not an empty folder" in result.output and "state_sha256" not in result.output
    assert hashlib.sha256((tmp_path / "hf" / "other.safetensors").read_bytes()).hexdigest() == hashlib.sha256(b"x").hexdigest()


def test_an_export_into_the_model_cache_is_refused_before_the_replay(made, tmp_path):
    """``replay --export-hf`` shares ``merge``'s refusal of a folder inside the model cache in use (its next
    first use as a model name would delete the export): one line, exit 2, nothing replayed or written."""
    run, _ = made
    cache = tmp_path / "cache"
    cache.mkdir()
    result = replay(run, "--step", 2, "--export-hf", cache / "hf", "--cache-dir", cache)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        f"error: export folder {cache / 'hf'} is inside the model cache {cache}, which deletes a folder without a DONE "
        f"file at the next first use of its model name: export into a folder outside {cache}"]
    assert list(cache.iterdir()) == []


def _damaged_copy(run: pathlib.Path, to: pathlib.Path, record: int, damage) -> pathlib.Path:
    """A copy of ``run`` whose log has ``damage(data, start of record)`` applied at ``record``."""
    _copy_run(run, to)
    data = bytearray((to / "steplog.bin").read_bytes())
    (to / "steplog.bin").write_bytes(damage(data, len(data) - (STEPS - record) * RECORD_BYTES))
    return to


def test_the_intact_prefix_of_a_damaged_log_is_replayed_with_a_note(made, tmp_path):
    """A gap (step 3's record cut out) or a flipped byte (in step 4's record, step 5's after it):
    the steps before it replay bitwise with one note; a step past them exits 1 naming the damage."""
    run, hashes = made
    gap = _damaged_copy(run, tmp_path / "gap", 3, lambda d, at: d[:at] + d[at + RECORD_BYTES:])
    flipped = _damaged_copy(run, tmp_path / "flip", 4, lambda d, at: d[:at + 5] + bytes([d[at + 5] ^ 1]) + d[at + 6:])
    for damaged, intact, damage in [(gap, 3, "is step 4, expected step 3"), (flipped, 4, "fails its checksum")]:
        for step in (2, intact):
            result = replay(damaged, "--step", step)
            assert result.exit_code == 0, result.output
            assert result.output.startswith(f"note: the step log is damaged after step {intact - 1}, so --step can be "
                                            f"0..{intact} (") and damage in result.output.splitlines()[0]
            assert printed_sha256(result.output) == hashes[step]
        result = replay(damaged, "--step", intact + 1)
        assert result.exit_code == 1 and result.output.count("\n") == 1
        assert result.output.startswith("error: ") and damage in result.output


def test_a_torn_tail_is_ignored_with_a_note_of_its_bytes(made, tmp_path):
    run, hashes = made
    torn = _copy_run(run, tmp_path / "torn")
    os.truncate(torn / "steplog.bin", (torn / "steplog.bin").stat().st_size - 7)
    result = replay(torn, "--step", 5)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"note: ignored a torn tail of {RECORD_BYTES - 7} bytes after step 4 (an append cut short)\n")
    assert printed_sha256(result.output) == hashes[5]
    result = replay(run, "--step", 5)
    assert result.exit_code == 0 and "note:" not in result.output
