import pytest

from orchestrator.config import FailureSpec, JobConfig
from orchestrator.controller import Phase, next_phase


def test_failure_spec_parsing():
    assert FailureSpec.parse("20") == FailureSpec(step=20, target="worker", how="exit")
    assert FailureSpec.parse("3:both:sigkill") == FailureSpec(step=3, target="both", how="sigkill")
    with pytest.raises(ValueError, match="expected STEP"):
        FailureSpec.parse("x:worker")
    with pytest.raises(ValueError, match="choose one of worker, shadow, both"):
        FailureSpec.parse("3:gpu")
    with pytest.raises(ValueError, match="how 'melt'"):
        FailureSpec.parse("3:worker:melt")


def test_job_config_validation_names_the_field():
    base = dict(out_dir="/tmp/x", cache_dir="/tmp/c")
    assert JobConfig(**base).storage == "/tmp/x/snapshots"
    with pytest.raises(ValueError, match="model 'gpt5'"):
        JobConfig(**base, model="gpt5")
    with pytest.raises(ValueError, match="divisible by workers"):
        JobConfig(**base, batch_size=7, workers=2)
    with pytest.raises(ValueError, match="past the last step"):
        JobConfig(**base, steps=10, failures=(FailureSpec(step=10),))
    cfg = JobConfig(**base, failures=(FailureSpec(step=3, target="shadow"),))
    assert JobConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.trajectory_sha256() == cfg.replace(failures=(), out_dir="/elsewhere").trajectory_sha256()
    assert cfg.trajectory_sha256() != cfg.replace(seed=1).trajectory_sha256()


def test_controller_transitions():
    assert next_phase(Phase.INITIALISING, 0, 0, False, False) is Phase.RUNNING
    assert next_phase(Phase.RUNNING, 1, 0, False, False) is Phase.RECOVERING
    assert next_phase(Phase.RECOVERING, 1, 1, False, False) is Phase.RUNNING
    assert next_phase(Phase.RUNNING, 1, 1, True, True) is Phase.FINISHED
    assert next_phase(Phase.RECOVERING, 2, 1, True, False) is Phase.FAILED


def test_failures_and_strategies_that_do_not_fit_are_refused_up_front():
    base = dict(out_dir="/tmp/x", cache_dir="/tmp/c", steps=10)
    with pytest.raises(ValueError, match="kills the shadow, which only strategy shadow has"):
        JobConfig(**base, strategy="full-async", failures=(FailureSpec(step=3, target="both"),))
    with pytest.raises(ValueError, match="has no step log"):
        JobConfig(**base, strategy="full-sync", failures=(FailureSpec(step=3, how="torn"),))
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        JobConfig(**base, strategy="full-sync", snapshot_every=0)
    with pytest.raises(ValueError, match=r"outage in seconds, e.g. 3:storage:20 \(got none\)"):
        FailureSpec.parse("3:storage")
    assert JobConfig(**base, strategy="log-only", snapshot_every=0, failures=(FailureSpec(step=3, how="torn"),)).uses_step_log


def test_a_storage_failure_is_refused_before_an_existing_run_is_touched(tmp_path):
    from typer.testing import CliRunner

    from orchestrator.cli import app

    out = tmp_path / "run"
    out.mkdir()
    (out / "steplog.bin").write_bytes(b"keep me")
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "8", "--fail", "4:storage:5", "--overwrite", "--out", str(out)])
    assert result.exit_code == 2 and "server that raycheck owns" in result.output
    assert (out / "steplog.bin").read_bytes() == b"keep me"
