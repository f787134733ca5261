"""``raycheck inspect`` / ``raycheck verify`` on a run directory: read only, every problem named."""

import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from conftest import free_port
from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.job.stores import snapshot_store
from raycheck.cli.main import app
from raycheck.orchestrator.prepare import prepare
from raycheck.storage.backend import Storage, StorageCredentialsError
from raycheck.storage.dcp_store import SUBFOLDER, ShardedStore
from raycheck.storage.diffs import DiffStore
from raycheck.storage.snapshots import MANIFEST, SnapshotStore
from raycheck.storage.steplog import RECORD_BYTES, StepLogWriter, StepRecord
from raycheck.training.model import default_cache_dir
from raycheck.training.zo import step_seed


def make_run(root):
    store = SnapshotStore(str(root / "snapshots"))
    infos = [store.write(s, {"model.layers.0.w": np.full(8, s, dtype=np.float32)}) for s in (2, 4)]
    writer = StepLogWriter.create(root / "steplog.bin", {"model": "x"})
    for step in range(4):
        writer.append(StepRecord(step=step, seed=step, projected_grad=0.5, loss_plus=0.1, loss_minus=0.2, lr=1e-6,
                                 eps=1e-3, weight_decay=0.0, batch_id=step))
    writer.close()
    return store, infos


def test_verify_names_a_missing_manifest_and_a_torn_log_without_changing_anything(tmp_path):
    store, infos = make_run(tmp_path)
    assert CliRunner().invoke(app, ["verify", str(tmp_path)]).exit_code == 0
    store.storage.delete(f"{infos[0].folder}/{MANIFEST}")
    with open(tmp_path / "steplog.bin", "ab") as fh:
        fh.write(b"\x01" * (RECORD_BYTES // 3))
    size = (tmp_path / "steplog.bin").stat().st_size
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert f"BAD  {infos[0].folder}/{MANIFEST}: missing" in result.output
    assert f"steps 0..3, and a torn tail of {RECORD_BYTES // 3} bytes" in result.output
    assert (tmp_path / "steplog.bin").stat().st_size == size  # read only
    inspected = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert inspected.exit_code == 1 and "1 committed snapshot(s)" in inspected.output  # the missing manifest
    assert f"  skipped: {infos[0].folder}/{MANIFEST}: missing" in inspected.output
    assert inspected.output.splitlines()[-1] == "1 problem(s) found"


@pytest.mark.parametrize("damage", ["corrupt", "gap"])
def test_inspect_exits_1_like_verify_on_a_damaged_step_log_and_still_lists_everything(tmp_path, damage):
    """A bad record followed by more data, or a step that does not follow its predecessor: both commands
    print the listing with a BAD line, and exit 1 (a torn tail, above, is not damage)."""
    make_run(tmp_path)
    log = tmp_path / "steplog.bin"
    data = bytearray(log.read_bytes())
    second = len(data) - 3 * RECORD_BYTES  # steps 1, 2, 3 are the last three records
    if damage == "corrupt":
        data[second + 3] ^= 0xFF  # step 1's checksum fails, and steps 2 and 3 follow
    else:
        data[second:second + RECORD_BYTES] = data[second + RECORD_BYTES:second + 2 * RECORD_BYTES]  # 0, 2, 2, 3
    log.write_bytes(bytes(data))
    for command in ("inspect", "verify"):
        result = CliRunner().invoke(app, [command, str(tmp_path)])
        assert result.exit_code == 1, (command, result.output)
        assert f"BAD  step log {log}: " in result.output and result.output.splitlines()[-1] == "1 problem(s) found"
    listed = CliRunner().invoke(app, ["inspect", str(tmp_path)]).output
    assert listed.startswith(f"{tmp_path / 'snapshots'}: 2 committed snapshot(s)\n"), listed  # listed as before


def test_an_empty_step_log_says_no_steps(tmp_path):
    """A step log of a header and no records (a run stopped before its first step): ``no steps``, not
    ``steps 0..-1``."""
    make_run(tmp_path)
    (tmp_path / "steplog.bin").unlink()
    StepLogWriter.create(tmp_path / "steplog.bin", {"model": "x"}).close()
    for command in ("inspect", "verify"):
        result = CliRunner().invoke(app, [command, str(tmp_path)])
        assert result.exit_code == 0, result.output
        assert f"ok   step log {tmp_path / 'steplog.bin'}: no steps\n" in result.output and "0..-1" not in result.output


@pytest.mark.parametrize(("algo", "strategy", "kind"), [("fo", "layerwise", "first-order runs (--algo fo) log"),
                                                      ("zo", "full-sync", "--strategy full-sync logs")])
def test_a_run_that_logs_no_steps_by_design_says_so_not_no_steps(tmp_path, algo, strategy, kind):
    """A fresh user read "step log: no steps" on a first-order run as damage: its run directory (made
    as a run starts it, ``orchestrator.prepare.prepare``, with a snapshot of its own) says that such runs log none."""
    cfg = JobConfig(out_dir=str(tmp_path), cache_dir=str(default_cache_dir()), model="tiny", algo=algo, strategy=strategy,
                    steps=6, run_id="unlogged")
    prepare(cfg, RunDir(tmp_path))
    snapshot_store(cfg).write(2, {"model.layers.0.w": np.ones(8, np.float32)})
    for command in ("inspect", "verify"):
        result = CliRunner().invoke(app, [command, str(tmp_path)])
        assert result.exit_code == 0, result.output
        assert f"ok   step log {tmp_path / 'steplog.bin'}: none, {kind} no steps\n" in result.output


def test_verify_of_a_run_with_no_snapshot_says_there_is_nothing_to_rehash_and_exits_0_or_1_when_its_log_is_damaged(tmp_path):
    """A log-only run (its state is its step log) holds a run, so it is no usage error: verify exited 2
    with "no committed snapshots in DIR", and so did one whose log was damaged (that is exit 1)."""
    cfg = JobConfig(out_dir=str(tmp_path), cache_dir=str(default_cache_dir()), model="tiny", strategy="log-only", steps=6,
                    run_id="logonly")
    prepare(cfg, RunDir(tmp_path))
    writer = StepLogWriter.open(tmp_path / "steplog.bin")
    for step in range(3):  # this run's records (inspect and verify check each one's seed)
        writer.append(StepRecord(step=step, seed=step_seed(cfg.seed, step), projected_grad=0.5, loss_plus=0.1, loss_minus=0.2,
                                 lr=1e-6, eps=1e-3, weight_decay=0.0, batch_id=step))
    writer.close()
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"ok   step log {tmp_path / 'steplog.bin'}: steps 0..2",
        f"nothing damaged, nothing to re-hash: {tmp_path} holds no committed snapshot or diff batch (a log-only run, or a run "
        "stopped before its first snapshot: its state is rebuilt from the initial weights and the step log, raycheck replay)"]
    data = bytearray((tmp_path / "steplog.bin").read_bytes())
    data[-2 * RECORD_BYTES + 3] ^= 0xFF  # step 1's record fails its checksum, step 2's follows
    (tmp_path / "steplog.bin").write_bytes(bytes(data))
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert result.output.splitlines()[-1] == "1 problem(s) found" and "nothing to re-hash" not in result.output


def test_inspect_names_the_logged_steps_whose_metrics_row_was_lost(tmp_path):
    """Steps 1 and 2 are in the step log but not in metrics.jsonl (their rows never reached the driver
    before an interrupt): a note, not damage."""
    make_run(tmp_path)
    RunDir(tmp_path).append(tmp_path / "metrics.jsonl", [{"step": 0, "unix_s": 1.0}, {"step": 3, "unix_s": 2.0}])
    result = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == ("note metrics: 2 step(s) in the step log have no metrics row (logged just "
                                              "before an interrupt, not executed again after the resume; their timings "
                                              "are unknown): 1..2")
    RunDir(tmp_path).append(tmp_path / "metrics.jsonl", [{"step": 1, "unix_s": 3.0}, {"step": 2, "unix_s": 4.0}])
    assert "metrics row" not in CliRunner().invoke(app, ["inspect", str(tmp_path)]).output


def test_missing_paths_and_files_are_refused_and_never_created(tmp_path):
    for target in (tmp_path / "absent", tmp_path / "file.json"):
        if target.name == "file.json":
            target.write_text("{}")
        for command in ("inspect", "verify"):
            result = CliRunner().invoke(app, [command, str(target)])
            assert result.exit_code == 2 and "cannot read snapshot store" in result.output
    assert not (tmp_path / "absent").exists()


def test_a_file_given_for_a_store_is_named_as_a_file_with_what_is_expected(tmp_path):
    """A fresh user gave a run's summary.json, then a shard, and read "no such folder"."""
    store, infos = make_run(tmp_path)
    RunDir.write_json(tmp_path / "summary.json", {"ok": True})
    shard = tmp_path / "snapshots" / next(iter(infos[0].manifest["units"].values()))["path"]
    for target in (tmp_path / "summary.json", shard):
        for command in (["inspect"], ["verify"], ["replay", "--step", "1"]):
            result = CliRunner().invoke(app, [command[0], str(target), *command[1:]])
            assert result.exit_code == 2, result.output
            assert result.output.strip() == (f"error: cannot read snapshot store {target}: {target} is a file, not a folder: "
                                             "give a run directory (the --out of raycheck run), a snapshot store's folder "
                                             "(a path or file://PATH) or s3://BUCKET/PREFIX")


def test_inspect_prints_each_snapshots_step_size_units_and_unit_steps(tmp_path):
    store = SnapshotStore(str(tmp_path / "snapshots"))
    state = {"model.embed_tokens.weight": np.zeros((6, 4), np.float32), "model.layers.0.w": np.ones(8, np.float32),
             "model.layers.1.w": np.ones(8, np.float32), "model.norm.weight": np.ones(4, np.float32)}
    full = store.write(2, state)
    composite = store.write(7, state, unit_steps={"layer.001": 2, "embed": 5})
    result = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"{store.storage.url()}: 2 committed snapshot(s)"
    for line, info, units in ((lines[1], full, "4 @ step 2"), (lines[2], composite, "1 @ step 2, 1 @ step 5, 2 @ step 7")):
        on_disk = sum((tmp_path / "snapshots" / info.folder / f).stat().st_size
                      for f in ("embed.safetensors", "layer.000.safetensors", "layer.001.safetensors", "norm.safetensors"))
        printed = re.fullmatch(r"  step +(\d+) +([\d,]+) bytes +(\d+) units \((.*)\)  run (.*)  \S+  (\S+)", line)
        assert printed is not None, line
        assert printed.groups() == (str(info.step), f"{on_disk:,}", "4", units, "-", info.folder)  # no run: store-wide writes
    assert lines[3:] == []  # no step log in this store


def test_inspect_names_the_temp_files_of_killed_writes_with_their_count_and_bytes(tmp_path):
    store = SnapshotStore(str(tmp_path / "snapshots"))
    info = store.write(3, {"model.norm.weight": np.ones(4, np.float32)})
    for rel, size in ((f"{info.folder}/norm.safetensors.tmp-0123abcd", 1500), ("index.json.tmp-89abcdef", 20)):
        (tmp_path / "snapshots" / rel).write_bytes(bytes(size))
    result = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[2].startswith("2 temp file(s) of interrupted or ongoing writes, 1,520 bytes (never read;"), lines
    assert re.fullmatch(r"  temp: index\.json\.tmp-89abcdef  20 bytes  modified \d+ s ago", lines[3]), lines[3]
    assert lines[4].startswith(f"  temp: {info.folder}/norm.safetensors.tmp-0123abcd  1,500 bytes"), lines[4]
    verified = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert verified.exit_code == 0 and "temp" not in verified.output  # never read: not a problem of the snapshots


def test_inspect_and_verify_of_a_missing_bucket_say_so_and_exit_2(s3_endpoint):
    import uuid

    from tests.conftest import make_bucket

    bucket = f"rc-missing-{uuid.uuid4().hex[:8]}"
    for command in ("inspect", "verify"):
        result = CliRunner().invoke(app, [command, f"s3://{bucket}/run", "--s3-endpoint", s3_endpoint])
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        assert result.output.strip() == (f"error: cannot read snapshot store s3://{bucket}/run: bucket {bucket!r} does "
                                         "not exist; create it first, or check the bucket name and --s3-endpoint")
    make_bucket(s3_endpoint, bucket)  # an existing bucket with nothing under the prefix: no store, and said so
    result = CliRunner().invoke(app, ["inspect", f"s3://{bucket}/run", "--s3-endpoint", s3_endpoint])
    assert result.exit_code == 2 and result.output.startswith(f"error: no snapshot store or run found at s3://{bucket}/run:")
    SnapshotStore(Storage(f"s3://{bucket}/run", endpoint_url=s3_endpoint)).write(1, {"w": np.zeros(2, np.float32)})
    result = CliRunner().invoke(app, ["inspect", f"s3://{bucket}/run", "--s3-endpoint", s3_endpoint])
    assert result.exit_code == 0 and result.output.splitlines()[0] == f"s3://{bucket}/run: 1 committed snapshot(s)"


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_folder_that_holds_no_run_exits_2_saying_so_and_what_is_expected(tmp_path, command):
    """verify of an empty folder said only "no committed snapshots in DIR": now the line inspect gives."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a run")
    for folder in (tmp_path / "empty", tmp_path / "other"):
        result = CliRunner().invoke(app, [command, str(folder)])
        assert result.exit_code == 2, result.output
        assert result.output.strip() == (f"error: no snapshot store or run found at {folder}: it holds no snapshot index "
                                         "(index.json), snapshot folder, step log (steplog.bin) or log segments; give a "
                                         "run directory (the --out of raycheck run) or its snapshot store")
    make_run(tmp_path / "run")  # a run directory and its snapshots folder are found
    for folder in (tmp_path / "run", tmp_path / "run" / "snapshots"):
        assert CliRunner().invoke(app, [command, str(folder)]).exit_code == 0


def test_inspect_and_verify_see_an_fsdp2_runs_sharded_checkpoints_and_name_a_damaged_file(tmp_path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        store = ShardedStore(str(tmp_path / "snapshots"))
        saved = [store.save(s, {"w": torch.full((4, 3), float(s)), "b": torch.arange(3.0)}).info for s in (3, 6)]
    finally:
        dist.destroy_process_group()
    listed = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert "0 committed snapshot(s)" in listed.output and "2 sharded checkpoint(s)" in listed.output
    for info in saved:
        assert re.search(rf"step +{info.step} +{info.bytes:,} bytes  2 files of 1 rank\(s\)  run ", listed.output)
    assert CliRunner().invoke(app, ["verify", str(tmp_path)]).output.endswith("all 2 snapshot(s) verified\n")
    damaged = tmp_path / "snapshots" / SUBFOLDER / saved[1].manifest["units"]["__0_0.distcp"]["path"]
    damaged.write_bytes(damaged.read_bytes()[:-1])
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert f"ok   step        3  {SUBFOLDER}/{saved[0].folder}" in result.output
    assert f"BAD  step        6  {SUBFOLDER}/{saved[1].folder}" in result.output
    assert "__0_0.distcp" in result.output and "1 problem(s) found" in result.output


def test_verify_rehashes_a_differential_runs_diff_batches_and_names_a_corrupt_one(tmp_path):
    """A fresh user flipped 4 bytes in a diff batch and verify said "all verified" (exit 0): the
    batches a differential restore replays were not checked. Now verify re-hashes each against its
    commit record and inspect lists them (without re-hashing)."""
    make_run(tmp_path)
    diffs = DiffStore(str(tmp_path / "snapshots"))
    batches = [diffs.write_batch([(s, {"w": np.full((64,), s, np.float32)}) for s in (first, first + 1)]) for first in (4, 6)]
    listed = CliRunner().invoke(app, ["inspect", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert f"ok   diff batches in {diffs.storage.url('diffs')}: 2 committed, steps 4..7, {sum(b.bytes for b in batches):,} bytes" in listed.output
    assert CliRunner().invoke(app, ["verify", str(tmp_path)]).output.endswith("all 2 snapshot(s) verified, and the diff batches\n")
    damaged = tmp_path / "snapshots" / batches[1].path
    blob = bytearray(damaged.read_bytes())
    blob[-8:-4] = b"\xff\xff\xff\xff"
    damaged.write_bytes(bytes(blob))
    assert CliRunner().invoke(app, ["inspect", str(tmp_path)]).exit_code == 0  # inspect does not re-hash
    result = CliRunner().invoke(app, ["verify", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "BAD  diff batches" in result.output and "1 problem(s) found" in result.output
    assert "diff batch of steps 6-7" in result.output and "sha256 differs from the commit record" in result.output
    assert damaged.read_bytes() == bytes(blob)  # read only


def test_an_unreachable_endpoint_is_named_not_read_as_a_missing_bucket(monkeypatch):
    """Given with --s3-endpoint, or only resolved by botocore (here from $AWS_ENDPOINT_URL_S3; AWS's own
    endpoint when nothing is set): the endpoint is checked before the bucket and named."""
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    given = CliRunner().invoke(app, ["inspect", "s3://nope/x", "--s3-endpoint", down])
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", down)
    resolved = CliRunner().invoke(app, ["inspect", "s3://nope/x"])
    for result in (given, resolved):
        assert result.exit_code == 2, result.output
        assert result.output.strip() == (f"error: cannot read snapshot store s3://nope/x: storage endpoint {down} unreachable "
                                         "(connection refused); check that the server runs and the endpoint URL "
                                         "(--s3-endpoint or $AWS_ENDPOINT_URL)")


def test_missing_credentials_fail_at_once_saying_how_to_give_them(s3_endpoint, tmp_path, monkeypatch, caplog):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "absent"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    how = ("no S3 credentials (Unable to locate credentials): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
           "AWS_SESSION_TOKEN for temporary credentials), or AWS_PROFILE naming a profile of ~/.aws/credentials")
    result = CliRunner().invoke(app, ["inspect", "s3://some-bucket/run", "--s3-endpoint", s3_endpoint])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == ("error: cannot read snapshot store s3://some-bucket/run: check bucket s3://some-bucket "
                                     f"failed after 1 try: {how}")
    storage = Storage("s3://some-bucket/run", endpoint_url=s3_endpoint)
    with pytest.raises(StorageCredentialsError) as raised:
        storage.get("x")
    assert str(raised.value) == f"get s3://some-bucket/run/x failed after 1 try: {how}"
    assert "failed (try" not in caplog.text  # no retries
    assert storage.breaker.state()["consecutive_failures"] == 0  # not an outage
