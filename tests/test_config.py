import dataclasses
import json

import pytest

from raycheck.job.config import COMPONENTS, STRATEGIES, FailureSpec, FaultConfig, JobConfig, LayerwiseConfig, OldConfigError, SnapshotConfig
from raycheck.policies.models import Strategy
from raycheck.policies.strategies import RunStrategy


def test_failure_spec_parsing():
    assert FailureSpec.parse("20") == FailureSpec(step=20, target="worker", how="exit")
    assert FailureSpec.parse("3:both:sigkill") == FailureSpec(step=3, target="both", how="sigkill")
    with pytest.raises(ValueError, match="expected STEP"):
        FailureSpec.parse("x:worker")
    with pytest.raises(ValueError, match="choose one of worker, shadow, both"):
        FailureSpec.parse("3:gpu")
    with pytest.raises(ValueError, match="how 'melt'"):
        FailureSpec.parse("3:worker:melt")
    with pytest.raises(ValueError) as err:  # was accepted and recorded as ray.kill
        FailureSpec.parse("2:shadow:exit")
    assert str(err.value) == ("bad failure '2:shadow:exit': HOW applies to worker, both, storage and preempt failures only "
                              "(a shadow failure takes a shard number instead, e.g. 2:shadow:1)")
    assert FailureSpec.parse("2:shadow:1") == FailureSpec(step=2, target="shadow", how="1")  # shard 1 of a sharded shadow


def test_only_worker_failures_save_a_how_and_an_earlier_versions_exit_on_other_targets_still_loads():
    base = dict(out_dir="/tmp/x", cache_dir="/tmp/c", steps=10)
    failures = tuple(FailureSpec.parse(f) for f in ("2:shadow", "3:persister", "4:corrupt", "5", "6:both:sigkill", "7:shadow:0"))
    assert [f.how for f in failures] == [None, None, None, "exit", "sigkill", "0"]
    assert [f.shard for f in failures] == [None, None, None, None, None, 0]
    cfg = JobConfig(**base, faults={"failures": failures})
    saved = json.loads(json.dumps(cfg.to_dict()))  # as config.json holds it
    assert [f["how"] for f in saved["faults"]["failures"]] == [None, None, None, "exit", "sigkill", "0"]
    assert JobConfig.from_dict(saved) == cfg
    old = json.loads(json.dumps(saved))  # an earlier version recorded the default "exit" for every target
    for f in old["faults"]["failures"]:
        f["how"] = f["how"] or "exit"
    loaded = JobConfig.from_dict(old)
    assert loaded == cfg and loaded.trajectory_sha256() == cfg.trajectory_sha256()
    assert json.dumps(loaded.to_dict(), sort_keys=True) == json.dumps(saved, sort_keys=True)  # saved again: the new form
    with pytest.raises(ValueError, match="a persister failure takes no how"):
        FailureSpec(step=1, target="persister", how="sigkill")
    with pytest.raises(ValueError, match=r"outage in seconds, e.g. 1:storage:20 \(got none\)"):
        FailureSpec(step=1, target="storage")


def test_job_config_validation_names_the_field():
    base = dict(out_dir="/tmp/x", cache_dir="/tmp/c")
    assert JobConfig(**base).storage.uri == "/tmp/x/snapshots"
    with pytest.raises(ValueError, match="model is empty: give smollm2-135m, tiny, a model folder or a cached model id"):
        JobConfig(**base, model="")  # a folder or cached id is checked by the driver (training.assets.read_assets)
    with pytest.raises(ValueError, match="divisible by workers"):
        JobConfig(**base, batch_size=7, workers=2)
    with pytest.raises(ValueError, match="past the last step"):
        JobConfig(**base, steps=10, faults={"failures": (FailureSpec(step=10),)})
    cfg = JobConfig(**base, faults={"failures": (FailureSpec(step=3, target="shadow"),)})
    assert JobConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.trajectory_sha256() == cfg.replace(out_dir="/elsewhere", faults={"failures": ()}).trajectory_sha256()
    assert cfg.trajectory_sha256() != cfg.replace(seed=1).trajectory_sha256()


def test_every_run_strategy_belongs_to_an_algorithm_and_the_cost_model_models_some_of_them():
    assert sorted(set(STRATEGIES["zo"]) | set(STRATEGIES["fo"])) == sorted(RunStrategy)
    assert [RunStrategy(s) for s in Strategy] == [RunStrategy.FULL_SYNC, RunStrategy.FULL_ASYNC, RunStrategy.LOG_ONLY,
                                                  RunStrategy.SHADOW]


@pytest.mark.parametrize(("algo", "strategy"), [("zo", ""), ("fo", ""), ("fo", "overlapped"), ("zo", RunStrategy.LOG_ONLY)])
def test_a_strategy_is_kept_as_its_string_and_config_json_round_trips(algo, strategy):
    """The default and a name given as a string stay plain strings (``config.json`` and summaries hold them;
    the Python API may pass a ``RunStrategy``); the saved configuration loads back equal, and as the same JSON."""
    cfg = JobConfig(out_dir="/tmp/x", cache_dir="/tmp/c", algo=algo, strategy=strategy)
    assert cfg.strategy == (strategy or {"zo": "shadow", "fo": "layerwise"}[algo])
    assert type(cfg.strategy) is type(strategy)  # the default too: a str, not a RunStrategy
    saved = json.dumps(cfg.to_dict(), sort_keys=True)
    assert json.loads(saved)["strategy"] == str(cfg.strategy)
    loaded = JobConfig.from_dict(json.loads(saved))
    assert loaded == cfg and type(loaded.strategy) is str
    assert json.dumps(loaded.to_dict(), sort_keys=True) == saved


def test_failures_and_strategies_that_do_not_fit_are_refused_up_front():
    base = dict(out_dir="/tmp/x", cache_dir="/tmp/c", steps=10)
    with pytest.raises(ValueError, match="kills the shadow, which only strategy shadow has"):
        JobConfig(**base, strategy="full-async", faults={"failures": (FailureSpec(step=3, target="both"),)})
    with pytest.raises(ValueError, match="has no step log"):
        JobConfig(**base, strategy="full-sync", faults={"failures": (FailureSpec(step=3, how="torn"),)})
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        JobConfig(**base, strategy="full-sync", snapshot={"every_steps": 0})
    with pytest.raises(ValueError, match="strategy overlapped checkpoints every snapshot.every_steps steps: it must be >= 1, got 0"):
        JobConfig(**base, algo="fo", strategy="overlapped", snapshot={"every_steps": 0})
    with pytest.raises(ValueError, match=r"^overlapped.chunks \(20\) exceeds snapshot.every_steps \(4\): .* set overlapped.chunks to at most 4$"):
        JobConfig(**base, algo="fo", strategy="overlapped", overlapped={"chunks": 20}, snapshot={"every_steps": 4})
    assert JobConfig(**base, algo="fo", strategy="overlapped", overlapped={"chunks": 4}, snapshot={"every_steps": 4}).overlapped.chunks == 4
    with pytest.raises(ValueError, match=r"^zo.micro_batch_size is for the ZO path \(algo zo\) only: algo fo splits batch_size"):
        JobConfig(**base, algo="fo", zo={"micro_batch_size": 2})
    with pytest.raises(ValueError, match=r"outage in seconds, e.g. 3:storage:20 \(got none\)"):
        FailureSpec.parse("3:storage")
    assert JobConfig(**base, strategy="log-only", snapshot={"every_steps": 0}, faults={"failures": (FailureSpec(step=3, how="torn"),)}).uses_step_log


def test_a_storage_failure_is_refused_before_an_existing_run_is_touched(tmp_path):
    from typer.testing import CliRunner

    from raycheck.cli.main import app

    out = tmp_path / "run"
    out.mkdir()
    (out / "steplog.bin").write_bytes(b"keep me")
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "8", "--fail", "4:storage:5", "--overwrite", "--out", str(out)])
    assert result.exit_code == 2 and "server that raycheck owns" in result.output
    assert (out / "steplog.bin").read_bytes() == b"keep me"


@pytest.mark.parametrize("path, value, message", [
    ("seed", -1, "seed must be an integer in [0, 2**64), got -1"),
    ("seed", 2**64, "seed must be an integer in [0, 2**64), got 18446744073709551616"),
    ("zo.lr", -1e-6, "zo.lr must be a finite number > 0, got -1e-06"),
    ("zo.lr", 0.0, "zo.lr must be a finite number > 0, got 0.0"),
    ("zo.lr", float("nan"), "zo.lr must be a finite number > 0, got nan"),
    ("zo.eps", 0.0, "zo.eps must be a finite number > 0, got 0.0"),
    ("zo.eps", float("inf"), "zo.eps must be a finite number > 0, got inf"),
    ("weight_decay", -0.1, "weight_decay must be a finite number >= 0, got -0.1"),
    ("steps", 0, "steps must be >= 1, got 0"),
    ("snapshot.keep", 0, "snapshot.keep must be >= 1, got 0"),
    ("snapshot.every_steps", -1, "snapshot.every_steps must be >= 0 (0: off), got -1"),
    ("eval_samples", -5, "eval_samples must be >= 0 (0: off), got -5"),
    ("hash_every_steps", -1, "hash_every_steps must be >= 0 (0: off), got -1"),
    ("faults.recovery_timeout_s", 0.0, "faults.recovery_timeout_s must be a finite number > 0, got 0.0"),
    ("fo.lr", -1.0, "fo.lr must be a finite number > 0, got -1.0"),
    ("overlapped.chunks", 0, "overlapped.chunks must be >= 1, got 0"),
    ("layerwise.staleness_bound_steps", 0, "layerwise.staleness_bound_steps must be >= 1, got 0"),
    ("differential.topk", 1.5, "differential.topk must be in [0, 1] (0: exact records), got 1.5"),
    ("faults.max_worker_failures", -2, "faults.max_worker_failures must be >= 0, or -1 for unlimited, got -2"),
    ("elastic.resize_interval_s", 0.0, "elastic.resize_interval_s must be a finite number > 0, got 0.0"),
])
def test_nonsense_values_are_refused_naming_the_field(path, value, message):
    """A component refuses its own nonsense (built alone or in ``JobConfig``), naming the field by its path."""
    component, _, name = path.rpartition(".")
    with pytest.raises(ValueError) as err:
        JobConfig(out_dir="/tmp/x", cache_dir="/tmp/c", **({component: {name: value}} if component else {name: value}))
    assert str(err.value) == message
    if component:
        with pytest.raises(ValueError) as alone:
            COMPONENTS[component](**{name: value})
        assert str(alone.value) == message


def test_components_are_built_from_dicts_replaced_by_dict_or_path_and_read_by_path():
    cfg = JobConfig(out_dir="/tmp/x", cache_dir="/tmp/c", layerwise={"threshold": 0.1}, faults={"max_shadow_restarts": 2})
    assert cfg.layerwise == LayerwiseConfig(threshold=0.1) and cfg.faults.max_shadow_restarts == 2
    changed = cfg.replace(steps=5, layerwise={"staleness_bound_steps": 7}, **{"faults.max_worker_failures": 4, "faults.settle_failures": True})
    assert (changed.steps, changed.layerwise.threshold, changed.layerwise.staleness_bound_steps) == (5, 0.1, 7)  # the others kept
    assert (changed.get("faults.max_shadow_restarts"), changed.get("faults.max_worker_failures"), changed.faults.settle_failures) == (2, 4, True)
    assert dataclasses.replace(cfg, layerwise=dataclasses.replace(cfg.layerwise, threshold=0.2)).get("layerwise.threshold") == 0.2
    assert cfg.replace(snapshot=SnapshotConfig(every_steps=3)).snapshot == SnapshotConfig(every_steps=3)
    with pytest.raises(ValueError, match="layerwise.threshold must be a finite relative change >= 0"):
        cfg.replace(**{"layerwise.threshold": -1.0})
    with pytest.raises(TypeError):
        cfg.replace(layerwise={"treshold": 0.1})
    paths = JobConfig.field_paths()
    assert {"zo.lr", "fo.lr", "snapshot.every_steps", "storage.uri", "faults.failures", "elastic.min_workers"} <= set(paths)
    assert all(cfg.get(p) is not None for p in paths if p != "faults.warm_standby") and len(set(paths)) == len(paths)  # None: decided per rank


def test_the_trajectory_hash_covers_the_trajectory_paths_only():
    cfg = JobConfig(out_dir="/tmp/x", cache_dir="/tmp/c")
    for path, value in [("zo.lr", 2e-6), ("zo.eps", 2e-3), ("weight_decay", 0.1), ("fo.lr", 1e-4), ("fo.max_grad_norm", 0.5),
                        ("seed", 1), ("steps", 9), ("workers", 2), ("zo.micro_batch_size", 4)]:
        assert cfg.replace(**{path: value}).trajectory_sha256() != cfg.trajectory_sha256(), path
    for path, value in [("snapshot.every_steps", 5), ("layerwise.threshold", 0.5), ("differential.full_every_steps", 7),
                        ("faults.max_shadow_restarts", 1), ("storage.uri", "/elsewhere"), ("hash_every_steps", 2)]:
        assert cfg.replace(**{path: value}).trajectory_sha256() == cfg.trajectory_sha256(), path


def test_a_config_in_the_flat_form_of_an_older_raycheck_is_refused_in_one_line(tmp_path):
    flat = {"storage": "/tmp/x/snapshots", "snapshot_every": 10, "lr": 1e-6, "fo_lr": 1e-5}  # as config.json held them
    with pytest.raises(OldConfigError) as err:
        JobConfig.from_dict(flat)
    assert str(err.value).startswith("configuration written by an older raycheck") and "\n" not in str(err.value)
    from typer.testing import CliRunner

    from raycheck.cli.main import app

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({**flat, "out_dir": str(out)}))
    result = CliRunner().invoke(app, ["run", "--resume", "--out", str(out)])
    assert result.exit_code == 2
    assert result.output == f"error: {out / 'config.json'}: {err.value}\n"


def test_a_torn_append_is_refused_where_the_failing_rank_has_no_log_writer():
    base = dict(out_dir="/tmp/x", cache_dir="/tmp/c", steps=10, faults={"failures": (FailureSpec(step=3, how="torn"),)})
    with pytest.raises(ValueError, match=r"3:worker:torn tears rank 0's step-log append, but worker failures hit the last "
                                         r"rank \(1\), which has no log writer: use workers=1"):
        JobConfig(**base, workers=2)
    assert JobConfig(**base, workers=1).faults.failures[0].how == "torn"
    assert JobConfig(**{**base, "faults": {"failures": (FailureSpec(step=3, how="exit"),)}}, workers=2).workers == 2


NONSENSE = [
    (["--seed", "-1"], "error: --seed must be an integer in [0, 2**64), got -1"),
    (["--lr", "-0.001"], "error: --lr must be a finite number > 0, got -0.001"),
    (["--eps", "0"], "error: --eps must be a finite number > 0, got 0.0"),
    (["--workers", "2", "--fail", "3:worker:torn"], "error: failure 3:worker:torn tears rank 0's step-log append"),
    (["--fail", "99"], "error: failure at step 99 is past the last step (7; --fail counts steps from 0, 0..7 for 8 steps)"),
]


@pytest.mark.parametrize("args, message", NONSENSE, ids=[a[0] for a, _ in NONSENSE])
def test_the_cli_refuses_nonsense_with_one_line_and_exit_2_touching_nothing(tmp_path, args, message):
    import ray
    from typer.testing import CliRunner

    from raycheck.cli.main import app

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "steplog.bin").write_bytes(b"keep me")
    (existing / "summary.json").write_text('{"ok": true}')
    before = {p.name: p.read_bytes() for p in existing.iterdir()}
    missing = tmp_path / "missing"
    for out, extra in ((existing, ["--overwrite"]), (missing, [])):
        result = CliRunner().invoke(app, ["run", "--model", "tiny", "--steps", "8", *args, *extra, "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
        assert result.stdout == ""
    assert {p.name: p.read_bytes() for p in existing.iterdir()} == before
    assert not missing.exists() and not ray.is_initialized()


@pytest.mark.parametrize("value, got", [(5, "int"), (None, "NoneType"), (FaultConfig(), "FaultConfig")])
def test_a_component_of_the_wrong_type_is_refused_naming_the_field(tmp_path, value, got):
    with pytest.raises(ValueError, match=rf"^zo must be a ZOConfig or a dict of its fields, got {got}$"):
        JobConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path), zo=value)
