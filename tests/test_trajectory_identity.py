"""Issue 32's splice: a record of run D (same seed as run C, another batch size) spliced into C's step
log. Its checksum is valid and its step, seed, lr, eps and weight decay are C's, so only the trajectory
tag every record carries tells it apart: the log readers, ``check_records``, ``inspect``, ``replay``,
the log keeper and ``run --resume`` all refuse it by its step."""

from __future__ import annotations

import pathlib

import pytest
from typer.testing import CliRunner

from raycheck.actors.log_keeper import LogKeeper
from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.cli.main import app
from raycheck.orchestrator.prepare import check_resumed_log, prepare
from raycheck.storage.steplog import RECORD_BYTES, StepLogCorruptError, StepLogForeignError, StepLogWriter, StepRecord, read_log, read_prefix, trajectory_tag
from raycheck.training.model import default_cache_dir
from raycheck.training.zo import ZOHyper, check_records, step_seed

STEPS, SPLICED = 8, 5


def logged_run(out: pathlib.Path, batch_size: int) -> JobConfig:
    """A run directory (default run id, seed 1) whose log holds steps 0..STEPS - 2 with this run's seeds and hyper-parameters."""
    cfg = JobConfig(out_dir=str(out), cache_dir=str(default_cache_dir()), model="tiny", steps=STEPS, seed=1, batch_size=batch_size)
    out.mkdir(parents=True)
    prepare(cfg, RunDir(out))
    writer = StepLogWriter.open(RunDir(out).step_log)
    for s in range(STEPS - 1):
        writer.append(StepRecord(step=s, seed=step_seed(cfg.seed, s), projected_grad=0.1 * batch_size + s, loss_plus=0.7,
                                 loss_minus=0.69, lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay, batch_id=batch_size * 100 + s))
    writer.close()
    return cfg


@pytest.fixture(scope="module")
def spliced(tmp_path_factory) -> tuple[pathlib.Path, JobConfig, JobConfig]:
    """(C's run directory with D's step-5 record in place of its own, C's config, D's config)."""
    root = tmp_path_factory.mktemp("splice")
    c, d = logged_run(root / "C", 8), logged_run(root / "D", 4)
    c_log, d_log = (root / name / "steplog.bin" for name in "CD")
    c_data, d_data = bytearray(c_log.read_bytes()), d_log.read_bytes()
    at = -(STEPS - 1 - SPLICED) * RECORD_BYTES  # step 5 of 0..6, from the end (the headers' lengths differ)
    c_data[at:at + RECORD_BYTES] = d_data[at:at + RECORD_BYTES]
    c_log.write_bytes(bytes(c_data))
    return root / "C", c, d


FOREIGN = rf"the record of step {SPLICED} at byte \d+ belongs to another run or trajectory \(tag [0-9a-f]{{16}}, this log's [0-9a-f]{{16}}\)"


def test_the_two_runs_share_seed_run_id_and_hyper_parameters_and_differ_in_trajectory(spliced):
    _, c, d = spliced
    assert (c.run_id, c.seed, c.zo.lr, c.zo.eps, c.weight_decay) == (d.run_id, d.seed, d.zo.lr, d.zo.eps, d.weight_decay)
    assert c.trajectory_sha256() != d.trajectory_sha256()  # the batch size is part of the trajectory


def test_the_log_readers_and_the_keeper_refuse_the_spliced_record_by_its_step(spliced):
    run, _, _ = spliced
    log = run / "steplog.bin"
    prefix = read_prefix(log)
    assert len(prefix.records) == SPLICED and isinstance(prefix.damage, StepLogForeignError)
    assert pytest.raises(StepLogForeignError, read_log, log).match(FOREIGN)
    with pytest.raises(StepLogForeignError, match=FOREIGN):
        StepLogWriter.open(log)
    with pytest.raises(StepLogForeignError, match=FOREIGN):
        LogKeeper(log)


def test_check_records_refuses_records_of_the_same_seed_and_hyper_parameters_from_another_trajectory(spliced):
    run, c, d = spliced
    d_records = read_log(run.parent / "D" / "steplog.bin")[1]
    hyper = ZOHyper(lr=c.zo.lr, eps=c.zo.eps, weight_decay=c.weight_decay)
    check_records(d_records, c.seed, "D", hyper)  # the seed rule alone takes them: the same seed and hyper-parameters
    with pytest.raises(StepLogCorruptError, match=r"^C: the record of step 0 belongs to another run or trajectory "
                                                  r"\(tag [0-9a-f]{16}, expected [0-9a-f]{16}\): a record of another run; "
                                                  r"the log cannot be replayed$"):
        check_records(d_records, c.seed, "C", hyper, trajectory_tag(c.run_id, c.trajectory_sha256()))


def test_inspect_verify_replay_and_resume_refuse_it_in_one_line_naming_the_step(spliced):
    run, c, _ = spliced
    with pytest.raises(StepLogForeignError, match=FOREIGN):
        check_resumed_log(c, RunDir(run))
    for command in ("inspect", "verify"):
        result = CliRunner().invoke(app, [command, str(run)])
        assert result.exit_code == 1, (command, result.output)
        assert [line for line in result.output.splitlines() if line.startswith("BAD")] == [
            line for line in result.output.splitlines() if line.startswith(f"BAD  step log {run / 'steplog.bin'}: ")]
        assert f"the record of step {SPLICED} at byte" in result.output and result.output.splitlines()[-1] == "1 problem(s) found"
    replayed = CliRunner().invoke(app, ["replay", str(run), "--step", str(STEPS - 1)])
    assert replayed.exit_code == 1 and replayed.output.count("\n") == 1, replayed.output
    assert replayed.output.startswith("error: ") and f"the record of step {SPLICED} at byte" in replayed.output
    resumed = CliRunner().invoke(app, ["run", "--resume", "--out", str(run)])
    assert resumed.exit_code == 1 and resumed.output.count("\n") == 1, resumed.output
    assert resumed.output.startswith(f"error: {run / 'steplog.bin'}: the record of step {SPLICED} at byte"), resumed.output


def test_inspect_refuses_a_record_of_another_seed_as_replay_does(tmp_path):
    """A record of this log's trajectory tag whose seed is not the step seed of the header's run seed
    (a writer of another seed under this run's header): ``inspect`` and ``verify`` say BAD, as ``replay`` refuses it."""
    cfg = logged_run(tmp_path / "run", 8)
    writer = StepLogWriter.open(RunDir(tmp_path / "run").step_log)
    writer.append(StepRecord(step=STEPS - 1, seed=step_seed(cfg.seed + 1, STEPS - 1), projected_grad=0.5, loss_plus=0.7,
                             loss_minus=0.69, lr=cfg.zo.lr, eps=cfg.zo.eps, weight_decay=cfg.weight_decay, batch_id=1))
    writer.close()
    for command in ("inspect", "verify"):
        result = CliRunner().invoke(app, [command, str(tmp_path / "run")])
        assert result.exit_code == 1, (command, result.output)
        log = tmp_path / 'run' / 'steplog.bin'
        assert f"BAD  step log {log}: {log}: the record of step {STEPS - 1} is not this run's" in result.output
