"""``raycheck run`` refusals that need no Ray: unusable storage and the ``--resume`` edge cases.

Each case is decided before a cluster starts, exits with one clear line and leaves the run directory
as it was (compared byte for byte).
"""

from __future__ import annotations

import hashlib
import os
import json
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest
from typer.testing import CliRunner

from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.cli.main import app
from raycheck.orchestrator.prepare import ResumeMismatchError, prepare
from raycheck.training.model import default_cache_dir


def tree_sha256(root: pathlib.Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def prepared_run(out: pathlib.Path, **kw) -> JobConfig:
    """A run directory as ``raycheck run`` leaves it before training: ``config.json`` and the step log."""
    cfg = JobConfig(out_dir=str(out), cache_dir=str(default_cache_dir()), model="tiny", steps=6, run_id="resume", **kw)
    out.mkdir(parents=True)
    prepare(cfg, RunDir(out))
    return cfg


def resume(out: pathlib.Path):
    return CliRunner().invoke(app, ["run", "--resume", "--out", str(out)])


def test_unusable_storage_is_refused_before_training(tmp_path, s3_endpoint):
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    result = CliRunner().invoke(app, [
        "run", "--model", "tiny", "--steps", "4", "--out", str(tmp_path / "run"),
        "--storage", f"s3://{bucket}/run", "--s3-endpoint", s3_endpoint,
    ])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [f"error: snapshot storage s3://{bucket}/run is not usable: bucket {bucket!r} does not "
                                          "exist; create it first, or check the bucket name and --s3-endpoint"]
    assert not (tmp_path / "run" / "steplog.bin").exists()


def test_unusable_ray_train_storage_is_refused_before_training(tmp_path, s3_endpoint):
    """``--ray-train-storage``: a missing bucket, and a path under a file, each refused in one line before
    anything starts (Ray Train would fail its controller a minute later, after the shadow had started)."""
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    (tmp_path / "a-file").write_text("x")
    for given, why in ((f"s3://{bucket}/rt", f"bucket {bucket!r} does not exist; create it first, or check the bucket name and --s3-endpoint"),
                       (str(tmp_path / "a-file" / "rt"), f"{tmp_path / 'a-file'} is not a folder this user can write in")):
        result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "4", "--out", str(tmp_path / "run"),
                                          "--ray-train-storage", given, "--s3-endpoint", s3_endpoint])
        assert (result.exit_code, result.output.splitlines()) == (
            2, [f"error: Ray Train's storage {given} (--ray-train-storage) is not usable: {why}"]), result.output
    assert not (tmp_path / "run").exists()


def test_resume_without_a_saved_configuration_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "steplog.bin").write_bytes(b"not a run")
    result = resume(out)
    assert result.exit_code == 2, result.output
    assert f"{out} holds no run to resume (no config.json)" in result.output
    assert tree_sha256(out) == {"steplog.bin": hashlib.sha256(b"not a run").hexdigest()}


def test_resume_of_a_finished_run_does_nothing(tmp_path):
    out = tmp_path / "run"
    cfg = prepared_run(out)
    RunDir.write_json(out / "summary.json", {"ok": True, "final_step": cfg.steps})
    before = tree_sha256(out)
    result = resume(out)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"{out}: the run already finished (summary.json); nothing to resume"
    assert tree_sha256(out) == before


def test_resume_of_a_finished_run_names_the_options_it_ignores_but_not_the_budgets_or_placement(tmp_path):
    """A fresh user gave ``--steps 99 --lr ...`` to extend a finished run and nothing said they were
    ignored: the warning names them (not ``--max-worker-failures`` or ``--worker-resource``, which a
    resume takes), and nothing changes."""
    out = tmp_path / "run"
    cfg = prepared_run(out)
    RunDir.write_json(out / "summary.json", {"ok": True, "final_step": cfg.steps})
    before = tree_sha256(out)
    result = CliRunner().invoke(app, ["run", "--resume", "--out", str(out), "--steps", "99", "--lr", "1e-4",
                                      "--max-worker-failures", "20", "--worker-resource", "gpu_node"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines() == [
        "warning: --resume continues the run with the settings in its config.json; ignored: --steps, --lr",
        f"{out}: the run already finished (summary.json); nothing to resume"]
    assert tree_sha256(out) == before


@pytest.mark.parametrize("same", [True, False])
def test_resume_verify_of_a_finished_run_compares_it_with_the_reference(tmp_path, same):
    """``--resume --verify`` of a run that finished trains nothing and ends as a fresh ``--verify`` run
    does: the reference (here complete, so reused without a cluster) is compared with the run's final
    state, ``summary.json`` records the comparison, and a difference exits 3."""
    out = tmp_path / "run"
    cfg = prepared_run(out)
    finished = {"ok": True, "final_step": cfg.steps, "state_sha256": "a" * 64, "shadow_equal": True, "lost_steps": 0,
                "snapshots": {"last_durable_step": 5, "last_submitted_step": 5}}
    RunDir.write_json(out / "summary.json", finished)
    (out / "reference").mkdir()
    RunDir.write_json(out / "reference" / "summary.json", {"ok": True, "trajectory_sha256": cfg.trajectory_sha256(),
                                                           "state_sha256": "a" * 64 if same else "b" * 64})
    result = CliRunner().invoke(app, ["run", "--resume", "--verify", "--out", str(out)])
    assert result.exit_code == (0 if same else 3), result.output
    assert f"[raycheck] reusing the failure-free reference in {out / 'reference'}" in result.output
    assert "nothing to resume" not in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary == {**finished, "reference_state_sha256": "a" * 64 if same else "b" * 64, "bitwise_equal": same}
    assert ("recovery exact: bitwise equal to the failure-free run" if same else "error: recovery was not exact") in result.output


def test_resume_of_a_copied_run_directory_is_refused_and_touches_neither_directory(tmp_path):
    """A run directory copied elsewhere still names the original in ``config.json`` (its storage, its
    step log): resuming the copy would train in the original's directory, so it is refused."""
    out = tmp_path / "run"
    prepared_run(out)
    copy = tmp_path / "moved" / "run"
    shutil.copytree(out, copy)
    before, before_copy = tree_sha256(out), tree_sha256(copy)
    result = resume(copy)
    assert result.exit_code == 2, result.output
    assert f"error: {copy} is a copy of the run directory {out.resolve()}" in result.output
    assert f"resume the run with --out {out.resolve()}" in result.output
    assert (tree_sha256(out), tree_sha256(copy)) == (before, before_copy)


@pytest.mark.parametrize("parent_left", [True, False])
def test_resume_of_a_moved_run_directory_names_the_old_path_and_the_command_that_works(tmp_path, parent_left):
    """A run directory moved away (its old path gone) is not called a copy: the refusal says it was moved,
    what of its config.json still points at the old path (``--out``, its default snapshot store), and the
    command that moves it back (re-creating the old parent folder when that is gone too) and resumes it;
    that command's move brings the run back where its config.json names it. Nothing is touched."""
    out = tmp_path / "old" / "run"
    prepared_run(out)
    moved = tmp_path / "new home" / "run"
    moved.parent.mkdir()
    shutil.move(out, moved)
    if not parent_left:
        out.parent.rmdir()
    before = tree_sha256(moved)
    result = resume(moved)
    assert result.exit_code == 2, result.output
    mkdir = "" if parent_left else f"mkdir -p {out.parent} && "
    assert result.output.splitlines() == [
        f"error: {moved} is the run directory {out}, moved: {out} no longer exists, and the run's config.json still "
        f"points there (--out {out}, --storage {out / 'snapshots'}); move it back and resume it: "
        f"{mkdir}mv '{moved}' {out} && raycheck run --resume --out {out}"]
    assert "a copy" not in result.output and tree_sha256(moved) == before
    command = result.output.split("resume it: ")[1].strip()
    subprocess.run(command.split(" && raycheck ")[0], shell=True, check=True)  # the move; the resume itself starts Ray
    assert not moved.exists() and tree_sha256(out) == before
    assert json.loads((out / "config.json").read_text())["out_dir"] == str(out)


def test_resume_of_another_trajectory_is_refused_and_touches_nothing(tmp_path):
    """``config.json`` and the step log disagree (e.g. a config copied from another run): the log
    belongs to another trajectory, so the resume is refused before any cluster starts. The summary
    of a failed attempt does not count as finished."""
    out = tmp_path / "run"
    cfg = prepared_run(out)
    RunDir.write_json(out / "summary.json", {"ok": False, "final_step": None})
    other = cfg.replace(zo={"lr": cfg.zo.lr * 2})
    RunDir.write_json(out / "config.json", other.to_dict())
    before = tree_sha256(out)
    result = resume(out)
    assert result.exit_code == 2, result.output
    assert f"error: {out / 'steplog.bin'} belongs to another trajectory ({cfg.trajectory_sha256()}); use a new --out" in result.output
    assert "Traceback" not in result.output
    assert tree_sha256(out) == before
    assert json.loads((out / "config.json").read_text())["zo"]["lr"] == other.zo.lr


@pytest.mark.parametrize(("steps", "damage"), [
    ((0, 1, 3), "is step 3, expected step 2; steps 2..2 are missing"),
    ((0, 1, 2, 1), "is step 1 again or out of order, expected step 3"),
    ((0, 1, 3, 2, 4), "is step 3, expected step 2, and step 2 follows it at byte "),
    ((0, 1, 3, 4, 2), "is step 3, expected step 2, and step 2 follows it at byte "),
])
def test_resume_of_a_step_log_with_a_gap_or_out_of_order_records_is_refused_before_ray_starts(tmp_path, steps, damage):
    """Records of the run's own seeds but with a gap, or a step repeated out of order: the log cannot be
    continued, which the log keeper found only once Ray had started (seconds later, a failed run's
    summary). The resume now refuses it at once, in one line, exit 1 (the run's data is damaged, as for
    ``replay``), with Ray never initialised and the run directory as it was."""
    import ray

    from raycheck.storage.steplog import StepRecord, trajectory_tag
    from raycheck.training.zo import step_seed

    out = tmp_path / "run"
    cfg = prepared_run(out)
    records = [StepRecord(step=s, seed=step_seed(cfg.seed, s), projected_grad=0.5, loss_plus=0.7, loss_minus=0.69,
                          lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay, batch_id=s) for s in steps]
    log = out / "steplog.bin"
    tag = trajectory_tag(cfg.run_id, cfg.trajectory_sha256())
    log.write_bytes(log.read_bytes() + b"".join(r.bound(tag, log).encode() for r in records))
    before = tree_sha256(out)
    result = resume(out)
    assert result.exit_code == 1, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output, result.output
    assert result.output.startswith(f"error: {log}: record at byte ") and damage in result.output, result.output
    assert result.output.strip().endswith("; the run cannot be resumed from a damaged step log"), result.output
    assert not ray.is_initialized()
    assert tree_sha256(out) == before


@pytest.mark.parametrize("workers", ["3", "4"])
def test_resume_on_another_worker_count_is_refused_first_when_the_state_does_not_reshard(tmp_path, workers):
    """``--workers 3`` does not divide the default ``--batch-size`` 8, but ``--resume`` ignores the batch
    size typed: the refusal is the one that applies to the run, for 3 as for 4 workers."""
    out = tmp_path / "run"
    prepared_run(out, workers=2)
    before = tree_sha256(out)
    result = CliRunner().invoke(app, ["run", "--resume", "--workers", workers, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"error: --resume --workers {workers}: the run has 2 worker(s) and its state does not reshard "
                                     "(only an --algo fo --fo-parallelism fsdp2 run changes its worker count); leave --workers out")
    assert tree_sha256(out) == before


def test_a_run_whose_persister_never_answered_exits_4(tmp_path, monkeypatch):
    """The exit code's logic alone (the run itself is replaced): a shadow run whose persister never
    reported a status (it could not start) has no durable snapshot, so the run exits 4, not 0."""
    import raycheck.orchestrator.runs

    def finished(cfg, verify, echo, assets=None) -> dict:
        return {"ok": True, "error": None, "strategy": cfg.strategy, "final_step": cfg.steps, "lost_steps": 0,
                "shadow_equal": True, "bitwise_equal": None, "snapshots": {}}

    monkeypatch.setattr(raycheck.orchestrator.runs, "run_job", finished)
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "8", "--out", str(tmp_path / "run")])
    assert result.exit_code == 4, result.output
    assert ("error: the last snapshot (step None) is not durable: the snapshot persister never reported a status. "
            "Last durable snapshot: none;") in result.output and "holds all 8 steps" in result.output


def test_a_failed_run_prints_its_error_logged_steps_and_resume_command_not_an_empty_or_null_block(tmp_path, monkeypatch):
    """The exit code's and the printed block's logic alone (the run is replaced by what a shadow past its
    restart budget leaves: ``orchestrator.summary.failed_summary``'s fields and a step log of 3 steps)."""
    import raycheck.orchestrator.runs
    from raycheck.orchestrator.summary import failed_summary
    from raycheck.storage.steplog import StepLogWriter, StepRecord

    out = tmp_path / "run"
    error = "ShadowFailedError: the shadow failed after 0 restarts (max_shadow_restarts 0): actor died"

    def failed(cfg, verify, echo, assets=None) -> dict:
        out.mkdir(exist_ok=True)  # the driver lock made it
        writer = StepLogWriter.create(out / "steplog.bin", {"model": "tiny"})
        for step in range(3):
            writer.append(StepRecord(step=step, seed=step, projected_grad=0.5, loss_plus=0.1, loss_minus=0.2, lr=1e-6,
                                     eps=1e-3, weight_decay=0.0, batch_id=step))
        writer.close()
        return failed_summary(error, None, {"phase": "failed", "strategy": cfg.strategy, "wall_seconds": 1.5})

    monkeypatch.setattr(raycheck.orchestrator.runs, "run_job", failed)
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "6", "--max-shadow-restarts", "0",
                                      "--fail", "2:shadow", "--verify", "--json", "--out", str(out)])
    assert result.exit_code == 1, result.output
    block = json.loads(result.output[:result.output.index("}\n") + 1])
    assert block == {"ok": False, "error": error, "phase": "failed", "logged_steps": 3,
                     "resume": f"raycheck run --resume --out {out} --verify"}
    assert result.output.splitlines()[-1] == f"error: training failed: {error}"

    out.rename(tmp_path / "first")  # a run that failed before its step log existed: no steps are claimed
    monkeypatch.setattr(raycheck.orchestrator.runs, "run_job",
                        lambda cfg, verify, echo, assets=None: failed_summary(error, None, {"phase": "failed"}))
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "6", "--out", str(out)])
    assert result.output.splitlines() == ["raycheck run failed", f"  error    {error}", "  phase    failed",
                                          f"  resume   raycheck run --resume --out {out}",
                                          f"  results  {out}/summary.json, {out}/metrics.parquet", f"error: training failed: {error}"]


@pytest.mark.parametrize("damage", ["null", '{"steps": 5}', "{not json"])
def test_resume_of_a_damaged_configuration_is_one_error_line(tmp_path, damage):
    out = tmp_path / "run"
    prepared_run(out)
    (out / "config.json").write_text(damage)
    before = tree_sha256(out)
    result = resume(out)
    assert result.exit_code == 2, result.output
    assert f"{out / 'config.json'} is damaged (" in result.output and "this run cannot be resumed" in result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert tree_sha256(out) == before


def run_into(out: pathlib.Path, *extra: str):
    return CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "4", "--out", str(out), *extra])


def test_overwrite_never_empties_a_folder_that_holds_no_run(tmp_path):
    out = tmp_path / "home"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    for extra in (["--overwrite"], []):  # without it too: "pass --overwrite" would be advice that cannot work
        result = run_into(out, *extra)
        assert result.exit_code == 2, result.output
        assert "holds no raycheck run (no config.json); --overwrite replaces only a run" in result.output
    assert tree_sha256(out) == {"keep.txt": hashlib.sha256(b"precious").hexdigest()}


def test_overwrite_with_unusable_storage_leaves_the_old_run_as_it_was(tmp_path, s3_endpoint):
    out = tmp_path / "run"
    prepared_run(out)
    before = tree_sha256(out)
    result = run_into(out, "--overwrite", "--storage", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run",
                      "--s3-endpoint", s3_endpoint)
    assert result.exit_code == 2, result.output
    assert "is not usable" in result.output
    assert tree_sha256(out) == before


def test_an_out_that_is_a_file_is_refused(tmp_path):
    out = tmp_path / "a.log"
    out.write_text("log")
    result = run_into(out)
    assert result.exit_code == 2, result.output
    assert f"--out {out} is a file, not a folder" in result.output
    assert out.read_text() == "log"


def test_an_out_under_a_file_is_refused_in_one_line(tmp_path):
    """A fresh user's ``--out FILE/run`` gave a NotADirectoryError traceback (from the driver lock's mkdir)."""
    parent = tmp_path / "a.log"
    parent.write_text("log")
    result = run_into(parent / "run")
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"error: --out {parent / 'run'} cannot be used as a run directory: Not a directory"]
    assert parent.read_text() == "log"


def test_resume_takes_the_restart_budgets_given_on_the_command_line_and_warns_about_the_rest(tmp_path):
    """The restart budgets are not part of the trajectory: given with ``--resume`` they replace the
    saved ones (a notice each); any other option given is named in one warning line and ignored."""
    from raycheck.cli.main import resume_config

    saved = JobConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path), model="tiny", steps=6, faults={"max_persister_restarts": 1})
    cfg, notes = resume_config(saved, {"out": tmp_path, "resume": True, "max_persister_restarts": 5, "max_shadow_restarts": 10,
                                       "steps": 9, "lr": 1.0})
    assert (cfg.faults.max_persister_restarts, cfg.faults.max_shadow_restarts, cfg.steps, cfg.zo.lr) == (5, 10, 6, saved.zo.lr)
    assert notes == ["--resume: max_persister_restarts 1 -> 5",
                     "warning: --resume continues the run with the settings in its config.json; ignored: --steps, --lr"]
    assert resume_config(saved, {"out": tmp_path, "resume": True, "verify": True}) == (saved, [])


def test_resume_with_a_larger_persister_budget_runs_with_it(tmp_path, monkeypatch):
    import raycheck.orchestrator.runs

    out = tmp_path / "run"
    prepared_run(out, faults={"max_persister_restarts": 1})
    seen = []

    def finished(cfg, verify, echo, assets=None) -> dict:
        seen.append(cfg)
        return {"ok": False, "error": "stop here"}

    monkeypatch.setattr(raycheck.orchestrator.runs, "run_job", finished)
    result = CliRunner().invoke(app, ["run", "--resume", "--max-persister-restarts", "5", "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert [c.faults.max_persister_restarts for c in seen] == [5], result.output
    assert "--resume: max_persister_restarts 1 -> 5" in result.output


def test_a_resumed_run_saves_its_new_budget_and_a_refused_one_leaves_config_json_alone(tmp_path):
    """``prepare`` of a resumed run writes ``config.json`` again (a later ``--resume`` starts from the larger
    budget); a resume refused for another trajectory leaves it byte for byte as it was."""
    out = tmp_path / "run"
    cfg = prepared_run(out, faults={"max_persister_restarts": 1})
    prepare(cfg.replace(**{"faults.max_persister_restarts": 5}), RunDir(out))
    saved = JobConfig.from_dict(json.loads((out / "config.json").read_text()))
    assert saved.faults.max_persister_restarts == 5 and saved.trajectory_sha256() == cfg.trajectory_sha256()
    before = (out / "config.json").read_bytes()
    with pytest.raises(ResumeMismatchError):
        prepare(cfg.replace(**{"zo.lr": 1.0}), RunDir(out))
    assert (out / "config.json").read_bytes() == before


def test_a_resume_refuses_a_log_of_another_run_or_seed_even_with_an_edited_header(tmp_path):
    """A step log whose header was edited to pass for this run's (another run id or seed), or whose
    records come from another run (valid checksums, consecutive steps), is refused before anything in
    the run directory is touched; before the fix only the header's trajectory hash was compared, and the
    other run's records were replayed onto this run's snapshots."""
    from raycheck.storage.steplog import StepLogWriter, StepRecord, read_header
    from raycheck.training.zo import step_seed

    out = tmp_path / "run"
    cfg = prepared_run(out)
    header = read_header(out / "steplog.bin")

    def rewrite(header: dict, seeds: list[int]) -> None:
        (out / "steplog.bin").unlink()
        writer = StepLogWriter.create(out / "steplog.bin", header)
        for step, seed in enumerate(seeds):
            writer.append(StepRecord(step=step, seed=step_seed(seed, step), projected_grad=0.5, loss_plus=0.1, loss_minus=0.2,
                                     lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay, batch_id=step))
        writer.close()

    rewrite(header, [0, 0, 0])
    prepare(cfg, RunDir(out))  # this run's own log resumes
    before = (out / "config.json").read_bytes()
    rewrite(header, [0, 0, 1])  # step 2 spliced in from a run of seed 1
    with pytest.raises(ResumeMismatchError, match="the record of step 2 is not this run's"):
        prepare(cfg, RunDir(out))
    rewrite({**header, "run_seed": 1}, [1, 1, 1])  # a seed-1 run's log, its trajectory hash edited to this run's
    with pytest.raises(ResumeMismatchError, match=r"belongs to run resume \(seed 1\), not to run resume \(seed 0\)"):
        prepare(cfg, RunDir(out))
    rewrite({**header, "run_id": "other"}, [0, 0, 0])
    with pytest.raises(ResumeMismatchError, match="belongs to run other"):
        prepare(cfg, RunDir(out))
    assert (out / "config.json").read_bytes() == before


@pytest.mark.parametrize(("args", "message"), [
    (["--shadow-env", "=x"], "error: --shadow-env ''='x': expected NAME=VALUE, NAME letters, digits and _ (not starting with a digit)"),
    (["--shadow-shards", "5"], "error: --shadow-shards must be in 1..4 (the model's units: embed .. norm), got 5"),
    (["--shadow-shards", "2", "--strategy", "full-sync"], "error: --shadow-shards 2 needs --strategy shadow (this run: full-sync)"),
    (["--shadow-env", "A=b", "--strategy", "log-only"], "error: --shadow-env is set, but --strategy log-only has no shadow"),
    (["--max-persister-restarts", "-2"], "error: --max-persister-restarts must be >= 0, or -1 for unlimited, got -2"),
    (["--steps", "0"], "error: Invalid value for '--steps': Input should be greater than or equal to 1"),  # click's range
    (["--diff-topk", "1.5"], "error: Invalid value for '--diff-topk': Input should be less than or equal to 1"),
    (["--batch-size", "eight"], "error: Invalid value for '--batch-size': Input should be a valid integer, unable to parse "
     "string as an integer"),
    (["--max-worker-failures", "1", "--fail", "2:worker", "--fail", "3:both"],
     "error: 2 injected worker failures exceed --max-worker-failures 1: raise --max-worker-failures (-1: unlimited)"),
    (["--algo", "fo", "--micro-batch-size", "2"], "error: --micro-batch-size is for the ZO path (algo zo) only: algo fo "
     "splits --batch-size evenly over the workers; leave --micro-batch-size out or use algo zo"),
    (["--algo", "fo", "--workers", "3"], "error: --batch-size (8) must be divisible by workers (3)"),
    (["--workers", "3"], "error: --batch-size (8) must be divisible by workers (3), or set --micro-batch-size"),
    (["--workers", "2", "--min-workers", "1", "--elastic-resize-interval", "0"],
     "error: --elastic-resize-interval must be a finite number > 0, got 0.0"),
    (["--fo-parallelism", "fsdp2"], "error: --fo-parallelism fsdp2 (sharded state) is a first-order option (algo fo); algo zo "
     "runs every worker on the whole state: leave --fo-parallelism out or use algo fo"),
    (["--algo", "fo", "--strategy", "overlapped", "--overlap-chunks", "20", "--snapshot-every", "4"],
     "error: --overlap-chunks (20) exceeds --snapshot-every (4): a snapshot is staged over --overlap-chunks steps, and its "
     "window must end before the next one is due; set --overlap-chunks to at most 4"),
])
def test_configuration_errors_name_the_options_typed(tmp_path, args, message):
    result = run_into(tmp_path / "run", *args)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["policy", "--step-time", "1s", "--replay-time", "1s", "--snapshot-time", "1s", "--restart-time", "1s", "--mtbf", "3h",
      "--shadow-loss", "1.5"], "error: Invalid value for '--shadow-loss': Input should be less than or equal to 1"),
    (["policy", "--step-time", "1s"], "error: Missing option '--snapshot-time'."),
    (["replay"], "error: Missing argument 'RUN_OR_STORE'."),
    (["verify"], "error: Missing argument 'URI'."),
    (["run", "--no-such-option"], "error: No such option: --no-such-option"),
    (["--no-such-option"], "error: No such option: --no-such-option"),
    (["no-such-command"], "error: No such command 'no-such-command'."),
])
def test_usage_errors_that_click_finds_are_one_error_line_with_exit_2(args, message):
    """An option out of its range, of the wrong type, missing or unknown, or an unknown command: one
    ``error:`` line and exit 2 on every command, as the commands' own refusals, not click's usage block
    ("Usage: ... Try '--help' ... Error: ..."). Help is still help."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert len(result.output.splitlines()) == 1 and result.output.startswith(message), result.output
    assert "Usage:" not in result.output
    for help_args in (["--help"], ["run", "--help"]):
        assert CliRunner().invoke(app, help_args).output.startswith("Usage: ")
    assert CliRunner().invoke(app, []).output.startswith("Usage: ")  # a bare raycheck prints the help


@pytest.mark.parametrize("reached", ["nothing", "prepared", "finished"])
def test_ctrl_c_exits_130_with_the_command_line_that_resumes_the_run(tmp_path, monkeypatch, reached):
    """Ctrl-C (the run's own handling replaced: it writes the summary and re-raises): no traceback, exit
    130, and the ``--resume`` command for a run that started and did not finish."""
    import raycheck.orchestrator.runs

    out = tmp_path / "my run"  # a space: the printed command quotes it

    def interrupted(cfg, verify, echo, assets=None) -> dict:
        if reached != "nothing":
            out.mkdir(exist_ok=True)  # the driver lock made it
            RunDir.write_json(out / "config.json", cfg.to_dict())
        if reached == "finished":  # Ctrl-C during the reference of --verify
            RunDir.write_json(out / "summary.json", {"ok": True, "final_step": cfg.steps})
        raise KeyboardInterrupt

    monkeypatch.setattr(raycheck.orchestrator.runs, "run_job", interrupted)
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "4", "--verify", "--out", str(out)])
    assert result.exit_code == 130 and isinstance(result.exception, SystemExit), result.output
    assert result.output.splitlines() == {
        "nothing": ["interrupted before the run started: nothing to resume; run the same command again"],
        "prepared": ["interrupted: the run stopped; resume it with:", f"  raycheck run --resume --out '{out}' --verify"],
        "finished": [f"interrupted: the run had finished ({out / 'summary.json'}); only its failure-free reference "
                     "(--verify) was cut short"],
    }[reached]


def test_sigterm_stops_the_run_like_ctrl_c_and_exits_143_with_the_resume_command(tmp_path, monkeypatch):
    """``ray job stop`` and a pod eviction send SIGTERM: the run's own failure path runs (here replaced: the
    signal arrives while it trains), the command that resumes it is printed, the exit code is 143, and the
    previous SIGTERM handler is back afterwards."""
    import signal

    import raycheck.orchestrator.runs
    from raycheck.orchestrator.signals import Terminated

    out, seen = tmp_path / "run", []

    def terminated(cfg, verify, echo, assets=None) -> dict:
        RunDir.write_json(out / "config.json", cfg.to_dict())
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in this, the main thread, at once
        except Terminated as exc:
            seen.append(str(exc))
            raise
        raise AssertionError("SIGTERM did not interrupt the run")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(raycheck.orchestrator.runs, "run_job", terminated)
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "4", "--out", str(out)])
    assert result.exit_code == 143 and isinstance(result.exception, SystemExit), result.output
    assert seen == ["stopped by SIGTERM"]
    assert result.output.splitlines() == ["stopped by SIGTERM: the run stopped; resume it with:", f"  raycheck run --resume --out {out}"]
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("after", ["RaySystemError", "RuntimeError from", "none"])
def test_an_error_raised_after_the_interrupt_still_exits_130(tmp_path, monkeypatch, after):
    """The interrupt is seen first, and the failure path's Ray call then fails (a Ray call after the core worker
    was shut down; or an error raised from the interrupt): the run was interrupted, so it exits 130 with the
    command that resumes it, as a bare interrupt does, not 1 with a traceback. The same error without an
    interrupt before it is no interrupt: it reaches the caller (exit 1)."""
    import raycheck.orchestrator.runs
    from ray.exceptions import RaySystemError

    out = tmp_path / "run"
    shutdown = "System error: The core worker has already been shutdown."

    def failing(cfg, verify, echo, assets=None) -> dict:
        out.mkdir(exist_ok=True)
        RunDir.write_json(out / "config.json", cfg.to_dict())
        if after == "none":
            raise RaySystemError(shutdown)
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            if after == "RaySystemError":
                raise RaySystemError(shutdown)  # its __context__ is the interrupt
            raise RuntimeError("the journal is gone") from exc

    monkeypatch.setattr(raycheck.orchestrator.runs, "run_job", failing)
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "4", "--out", str(out)])
    if after == "none":
        assert result.exit_code == 1 and isinstance(result.exception, RaySystemError), result.output
        return
    assert result.exit_code == 130 and isinstance(result.exception, SystemExit), result.output
    assert result.output.splitlines() == ["interrupted: the run stopped; resume it with:",
                                          f"  raycheck run --resume --out {out}"]


@pytest.mark.parametrize(("code", "connected", "ends"), [(130, True, "_exit 130"), (130, False, "SystemExit 130"),
                                                         (1, True, "SystemExit 1"), (0, True, "SystemExit 0")])
def test_the_raycheck_command_ends_an_interrupt_with_130_before_ray_s_exit_hook(monkeypatch, code, connected, ends):
    """``raycheck`` (``cli.main``): a command interrupted while this process is connected to Ray ends the process
    with 130 at once, after flushing its output and logs, so that Ray's exit hook never runs beside a thread still
    in a Ray call (which ends the process with 1: "The core worker has already been shutdown"); any other exit,
    or an interrupt without Ray, leaves through ``SystemExit`` with its code. Ray and ``os._exit`` are stand-ins."""
    import logging
    import types

    import raycheck.cli.main as cli

    calls: list[str] = []

    class Ended(BaseException):
        pass

    def exit_now(status: int):
        calls.append(f"_exit {status}")
        raise Ended

    def command():
        raise SystemExit(code)

    monkeypatch.setattr(cli, "app", command)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: connected))
    monkeypatch.setattr(logging, "shutdown", lambda: calls.append("logs flushed"))
    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises((Ended, SystemExit)) as raised:
        cli.main()
    if raised.type is SystemExit:
        calls.append(f"SystemExit {raised.value.code}")
    assert calls == (["logs flushed", ends] if ends.startswith("_exit") else [ends])


def test_an_interrupted_run_logs_one_line_without_a_traceback(caplog):
    from raycheck.orchestrator.controller import log_failure

    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        log_failure(exc)
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records if r.levelname != "DEBUG"] == [
        ("WARNING", "the run was interrupted (Ctrl-C)", None)]


@pytest.mark.parametrize("again_in", ["_announce_failure", "_kill_actors"])
def test_an_interrupt_during_the_failure_path_still_leaves_a_summary(tmp_path, monkeypatch, again_in):
    """Ctrl-C stops the run, and a second interrupt arrives while the failure path talks to Ray (``timeout -s
    INT`` signals the driver twice; a user presses Ctrl-C again): first while the journal takes the ``phase``
    event, then while the actors are killed. The interrupt reaches the caller, and ``summary.json`` is there
    (ok false, phase failed, the error without an empty message). Before the fix a fresh user's
    ``timeout -s INT 45 raycheck run ...`` left no summary; here the ``_run`` and Ray calls are stand-ins."""
    from raycheck.orchestrator.controller import Controller

    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(default_cache_dir()), model="tiny", steps=6, run_id="ctrl-c")
    controller = Controller(cfg, echo=lambda line: None)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(controller, "_run", interrupted)
    monkeypatch.setattr(controller, again_in, interrupted)
    if again_in == "_announce_failure":
        monkeypatch.setattr(controller, "_kill_actors", lambda: None)
    with pytest.raises(KeyboardInterrupt):
        controller.run()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["ok"], summary["phase"], summary["error"], summary["final_step"]) == (False, "failed", "KeyboardInterrupt", None)


def test_an_adaptive_run_whose_assumed_costs_admit_no_plan_is_refused_in_one_line(tmp_path):
    """With the assumed costs (``orchestrator.planning.INITIAL_COSTS``) and an MTBF of 1 s, a shadow restarted
    after a failure would need longer to catch up than the time between failures (``policies.models.check_shadow``):
    the adaptive policy has no first plan. The run is refused before Ray starts, with exit 2 and no run directory."""
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "2", "--eval-samples", "0",
                                      "--snapshot-policy", "adaptive", "--mtbf", "1s", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: --snapshot-policy adaptive has no snapshot plan for the assumed costs "
                                    "(--mtbf 1 s): a shadow restarted from its snapshot (every 1 steps) catches up")
    assert result.output.count("\n") == 1 and not out.exists()


def test_the_adaptive_policy_outside_the_shadow_strategy_is_refused_not_ignored(tmp_path):
    """The cost model plans the shadow's snapshots: ``--snapshot-policy adaptive`` with another strategy (first
    order, a ZO baseline) is refused in one line before anything is written, not run at a fixed interval
    under a summary that says adaptive."""
    for extra in (["--algo", "fo"], ["--strategy", "full-async"], ["--strategy", "log-only"]):
        out = tmp_path / extra[-1]
        result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "4", *extra, "--snapshot-policy", "adaptive",
                                          "--out", str(out)])
        assert result.exit_code == 2, result.output
        strategy = "layerwise" if extra[-1] == "fo" else extra[-1]
        algo = "fo" if extra[-1] == "fo" else "zo"
        assert result.output == (f"error: --snapshot-policy adaptive plans the shadow's snapshots: it needs algo zo with --strategy "
                                 f"shadow (this run: {algo} {strategy}); set a fixed interval with --snapshot-every\n")
        assert not out.exists()


def test_a_second_driver_on_a_live_run_directory_is_refused_and_a_dead_one_leaves_no_lock(tmp_path, monkeypatch):
    """While one driver holds ``--out`` (``orchestrator.driver_lock``), ``--resume`` and ``--overwrite`` of that
    directory are refused in one line naming the holder, and nothing in it changes; a driver that ends
    (here: ``run_job`` returns) removes its lock file, and a holder that died (its process exited, the
    kernel dropped the lock) does not block the next driver."""
    import multiprocessing

    import raycheck.orchestrator.runs
    from raycheck.orchestrator.driver_lock import LOCK_NAME, RunDirectoryBusyError, driver_lock

    out = tmp_path / "run"
    prepared_run(out)
    before = tree_sha256(out)
    with driver_lock(out):
        assert (out / LOCK_NAME).read_text() == f"pid {os.getpid()} on {socket.gethostname()}"
        for args in (["run", "--resume", "--out", str(out)], ["run", "--model", "tiny", "--overwrite", "--out", str(out)]):
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 2, result.output
            assert result.output == (f"error: {out} is in use by another raycheck driver (pid {os.getpid()} on "
                                     f"{socket.gethostname()}); wait for it to end, or stop it (Ctrl-C) and then --resume\n")
        with pytest.raises(RunDirectoryBusyError):
            with driver_lock(out):
                pass
    assert tree_sha256(out) == before  # the lock file went with its holder
    dead = multiprocessing.get_context("fork").Process(target=_hold_and_die, args=(out,))
    dead.start()
    dead.join()
    assert dead.exitcode == 9 and (out / LOCK_NAME).exists()  # died holding it: the file stays, the lock does not
    seen = []
    monkeypatch.setattr(raycheck.orchestrator.runs, "run_job",
                        lambda cfg, verify, echo, assets=None: seen.append(cfg) or {"ok": False, "error": "stop here"})
    result = CliRunner().invoke(app, ["run", "--resume", "--out", str(out)])
    assert result.exit_code == 1 and len(seen) == 1, result.output
    assert not (out / LOCK_NAME).exists()


def _hold_and_die(out: pathlib.Path) -> None:
    from raycheck.orchestrator.driver_lock import driver_lock

    with driver_lock(out):
        os._exit(9)


def test_resume_of_another_tools_config_json_says_it_is_not_a_raycheck_run(tmp_path):
    """A folder whose ``config.json`` is a Hugging Face model's (another tool's) is not called damaged."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"activation_function": "gelu_new", "model_type": "gpt2", "n_layer": 2}))
    result = CliRunner().invoke(app, ["run", "--resume", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [f"error: {out / 'config.json'} is not a raycheck run's configuration (another tool's "
                                          f"config.json?): {out} holds no run to resume"]
