"""The log keeper (the step log's replica, ``actors.log_keeper``) and rank 0's side of it
(``workers.rank0_log``), without Ray: real files, a real moto bucket for the segments."""

from __future__ import annotations

import json
import pathlib
import tempfile
import threading
import uuid

import pytest
import ray
from typer.testing import CliRunner

from raycheck.actors.log_keeper import MAX_RECORDS_PER_CALL, KeeperLogSource, LogKeeper, read_range
from conftest import make_bucket
from raycheck.job.config import JobConfig
from raycheck.job.names import log_keeper_name
from raycheck.job.stores import snapshot_store
from raycheck.cli.main import app
from raycheck.orchestrator.controller import Controller
from raycheck.orchestrator.runs import reference_config
from raycheck.orchestrator.summary import durability
from raycheck.storage.backend import Storage, StorageUnavailableError
from raycheck.storage.log_segments import read_segments, segment_name
from raycheck.storage.steplog import (
    RECORD_BYTES,
    StepLogConflictError,
    StepLogGapError,
    StepLogWriter,
    StepRecord,
    header_tag,
    read_header,
    read_records,
)
from raycheck.training.model import default_cache_dir
from raycheck.workers.rank0_log import KeeperSender, KeeperUnreachableError, open_local_log, replicated_append
from raycheck.training.zo import ZOHyper, step_seed

SEED = 7
HEADER = {"run_id": "k", "trajectory_sha256": "t" * 64, "layout_sha256": "l" * 64, "generator": "g", "log_id": "a",
          "run_seed": SEED}


def rec(step: int, grad: float = 0.25, run_seed: int = SEED, lr: float = 1e-6) -> StepRecord:
    return StepRecord(step=step, seed=step_seed(run_seed, step), projected_grad=grad * step - 0.5, loss_plus=0.7,
                      loss_minus=0.69, lr=lr, eps=1e-3, weight_decay=0.0, batch_id=step)


def keeper_with(path, n: int, **kw) -> LogKeeper:
    keeper = LogKeeper(path, header=HEADER, **kw)
    keeper.append_many([rec(i) for i in range(n)])
    return keeper


def test_appends_in_order_refuses_a_gap_and_a_differing_record_and_takes_a_resend(tmp_path):
    keeper = keeper_with(tmp_path / "steplog.bin", 0)
    assert [keeper.append(rec(i)) for i in range(3)] == [1, 2, 3]
    with pytest.raises(StepLogGapError, match=r"received step 4, but the log ends at step 2; steps 3\.\.3 must be sent first"):
        keeper.append(rec(4))
    with pytest.raises(StepLogConflictError, match=r"step 1 is already logged with another record"):
        keeper.append(rec(1, grad=0.5))
    assert keeper.append(rec(1)) == 3 and keeper.append_many([rec(2), rec(3)]) == 4  # a re-send, then one new
    assert keeper.end() == 4 and read_records(tmp_path / "steplog.bin") == [rec(i) for i in range(4)]  # nothing refused got in
    keeper.close()
    reopened = LogKeeper(tmp_path / "steplog.bin")  # the file is the keeper's state
    assert reopened.header() == {**HEADER, "format_version": 2, "record_bytes": 84}
    assert reopened.records(0) == [rec(i) for i in range(4)]
    with pytest.raises(FileNotFoundError, match="no step log to keep"):
        LogKeeper(tmp_path / "missing.bin")


def test_records_are_bounded_per_call_and_wait_for_wakes_a_follower(tmp_path):
    n = MAX_RECORDS_PER_CALL + 5
    keeper = keeper_with(tmp_path / "steplog.bin", n)
    assert len(keeper.records(0, 10**6)) == MAX_RECORDS_PER_CALL
    assert keeper.records(3, 2) == [rec(3), rec(4)] and keeper.records(n) == [] and keeper.records(n + 7) == []
    assert read_range(keeper, 0, n) == [rec(i) for i in range(n)]  # several calls
    with pytest.raises(StepLogGapError, match=rf"ends at step {n - 1}"):
        read_range(keeper, n - 1, n + 1)
    source = KeeperLogSource(keeper, start_step=n - 2)
    assert source.poll() == [rec(n - 2), rec(n - 1)] and source.poll() == [] and source.next_step == n

    assert keeper.wait_for(n + 1, timeout_s=0) == n  # not there: returns at the deadline with the end
    woke = {}
    follower = threading.Thread(target=lambda: woke.setdefault("end", keeper.wait_for(n + 2, timeout_s=600)))
    follower.start()
    keeper.append(rec(n))
    assert "end" not in woke  # one step short: still waiting (it cannot have returned without the step)
    keeper.append(rec(n + 1))
    follower.join(timeout=60)
    assert woke == {"end": n + 2}
    assert source.poll() == [rec(n), rec(n + 1)]

    keeper.close()  # its file as rank 0's local log, longer than one call may carry, brings a new keeper up to date
    fresh = LogKeeper(tmp_path / "fresh.bin", header=HEADER)
    opened = open_local_log(tmp_path / "steplog.bin", fresh)
    assert (opened.local_steps, opened.sent_steps) == (n + 2, n + 2)
    assert read_range(fresh, 0, n + 2) == read_records(tmp_path / "steplog.bin") == [rec(i) for i in range(n + 2)]
    opened.writer.close()


def test_a_keeper_resumes_from_the_segments_in_a_bucket(tmp_path, s3_endpoint):
    bucket = f"rc-keep-{uuid.uuid4().hex[:8]}"
    make_bucket(s3_endpoint, bucket)
    storage = Storage(f"s3://{bucket}/run", endpoint_url=s3_endpoint)
    first = keeper_with(tmp_path / "a.bin", 0, mirror_to=storage, mirror_every_s=3600)  # mirrors on flush only
    first.append_many([rec(i) for i in range(7)])
    assert first.flush() == {"end": 7, "adopted_steps": 0, "adopt_error": None, "log_mirrored_steps": 7, "log_mirror_error": None}
    assert read_segments(storage)[1] == [rec(i) for i in range(7)]

    # a fresh run directory: prepare wrote a new header (another log_id) and no step
    fresh = tmp_path / "b.bin"
    keeper = LogKeeper(fresh, header={**HEADER, "log_id": "b"}, resume_from=storage)
    assert keeper.end() == 7 and keeper.adopted_steps == 7 and keeper.records(0) == [rec(i) for i in range(7)]
    assert read_records(fresh) == [rec(i) for i in range(7)] and read_header(fresh) == first.header()  # the bucket's log
    keeper.append(rec(7))
    assert read_records(fresh)[-1] == rec(7)
    keeper.close()
    assert LogKeeper(fresh, resume_from=storage).adopted_steps == 0  # longer than the segments: nothing to take

    with pytest.raises(StepLogConflictError, match=r"holds the step log of another run or trajectory \(run k, trajectory t+\)"):
        LogKeeper(tmp_path / "c.bin", header={**HEADER, "trajectory_sha256": "x" * 64}, resume_from=storage)
    shorter = keeper_with(tmp_path / "d.bin", 2)
    shorter.append(rec(2, grad=0.5))  # disagrees with the bucket on step 2
    shorter.close()
    with pytest.raises(StepLogConflictError, match="step 2 is already logged with another record"):
        LogKeeper(tmp_path / "d.bin", resume_from=storage)
    assert read_records(tmp_path / "d.bin") == [rec(0), rec(1), rec(2, grad=0.5)]  # the refused adoption wrote nothing


def test_a_keeper_refuses_to_adopt_segments_holding_records_of_another_run(tmp_path):
    """Segments whose header is this run's but whose records from step 3 on were spliced in from another
    run's log (another seed), or carry another learning rate, have valid checksums and no gap: before the
    fix the keeper copied them into its log (resume, restore and replay refuse such records). Now it
    refuses in one line naming the segment, and its file keeps what it held."""
    storage = Storage(f"memory://rc-keep-{uuid.uuid4().hex[:8]}")
    spliced = keeper_with(tmp_path / "a.bin", 3, mirror_to=storage, mirror_every_s=3600)
    spliced.append_many([rec(i, run_seed=SEED + 1) for i in range(3, 5)])
    assert spliced.flush()["log_mirrored_steps"] == 5
    segment = storage.url(segment_name(0, 4))
    with pytest.raises(StepLogConflictError) as refused:
        LogKeeper(tmp_path / "b.bin", header={**HEADER, "log_id": "b"}, resume_from=storage)
    assert str(refused.value).startswith(f"{segment}: the record of step 3 is not this run's (seed, lr, eps, weight decay ")
    assert f"for run seed {SEED}): a record of another run (the segments' header names run k); " in str(refused.value)
    assert "\n" not in str(refused.value) and read_records(tmp_path / "b.bin") == []
    assert read_header(tmp_path / "b.bin")["log_id"] == "b"  # the bucket's header was not taken either

    other_lr = Storage(f"memory://rc-keep-{uuid.uuid4().hex[:8]}")
    lr_changed = keeper_with(tmp_path / "c.bin", 2, mirror_to=other_lr, mirror_every_s=3600)
    lr_changed.append_many([rec(2, lr=1e-5)])
    assert lr_changed.flush()["log_mirrored_steps"] == 3
    hyper = ZOHyper(lr=1e-6, eps=1e-3, weight_decay=0.0)
    with pytest.raises(StepLogConflictError, match=r"the record of step 2 is not this run's .* a record of another run"):
        LogKeeper(tmp_path / "d.bin", header=HEADER, resume_from=other_lr, hyper=hyper)
    assert LogKeeper(tmp_path / "e.bin", header=HEADER, resume_from=other_lr).adopted_steps == 3  # the seed alone holds


def test_rank0_rebuilds_its_local_log_from_the_keeper_or_brings_the_keeper_up_to_date(tmp_path):
    keeper = keeper_with(tmp_path / "keeper.bin", 5)
    local = tmp_path / "scratch" / "steplog.bin"
    opened = open_local_log(local, keeper)  # a replacement on another node: no local log
    assert (opened.local_steps, opened.rebuilt_steps, opened.sent_steps, opened.discarded) == (0, 5, 0, None)
    assert read_records(local) == keeper.records(0) and read_header(local) == keeper.header()

    for step in (5, 6):  # durability process, the worker died before its sends arrived: only local
        opened.writer.append(rec(step))
    opened.writer.close()
    opened = open_local_log(local, keeper)
    assert (opened.local_steps, opened.rebuilt_steps, opened.sent_steps) == (7, 0, 2) and keeper.end() == 7

    sender = KeeperSender(keeper, keeper.end(), wait=True)
    commit = replicated_append(opened.writer, sender)
    assert commit(rec(7)) >= 0 and keeper.end() == 8  # durability node: acknowledged when commit returns
    sender = KeeperSender(keeper, keeper.end(), wait=False)
    commit = replicated_append(opened.writer, sender)
    commit(rec(8))
    commit(rec(9))
    sender.close()  # waits for every acknowledgement
    assert keeper.records(0) == read_records(local) == [rec(i) for i in range(10)]
    opened.writer.close()

    other = tmp_path / "other.bin"
    StepLogWriter.create(other, {**HEADER, "log_id": "stale"}).close()  # an earlier run in the same scratch dir
    opened = open_local_log(other, keeper)
    assert opened.discarded == f"{other} belongs to another log (header differs)" and opened.rebuilt_steps == 10
    assert read_records(other) == keeper.records(0)
    opened.writer.close()


@pytest.mark.parametrize("local_steps", [5, 7])
def test_rank0_and_the_keeper_disagreeing_on_a_step_both_hold_is_an_error_naming_it(tmp_path, local_steps):
    """Rank 0's node-local log holds another step 3 than the keeper's copy (same header, same lengths or
    the local one longer): neither is silently chosen, the error names the step and nothing is sent."""
    keeper = keeper_with(tmp_path / "keeper.bin", 5)
    local = tmp_path / "scratch" / "steplog.bin"
    open_local_log(local, keeper).writer.close()
    data = bytearray(local.read_bytes())
    at = len(data) - 2 * RECORD_BYTES  # step 3 of 0..4
    data[at:at + RECORD_BYTES] = rec(3, grad=9.0).bound(header_tag(HEADER), local).encode()
    local.write_bytes(bytes(data))
    writer = StepLogWriter.open(local)
    for step in range(5, local_steps):
        writer.append(rec(step))
    writer.close()
    with pytest.raises(StepLogConflictError, match=rf"^{local} and the log keeper's copy disagree at step 3: one holds a record "
                                                   r"of another run or trajectory; check both with raycheck inspect"):
        open_local_log(local, keeper)
    assert keeper.end() == 5 and len(read_records(local)) == local_steps  # nothing sent, nothing rebuilt
    StepLogWriter.open(local, lock_timeout_s=0).close()  # the refused open released its lock


class RefusingKeeper:
    """A keeper that never takes a record (pure logic of the sender's retries)."""

    def __init__(self) -> None:
        self.calls = 0

    def append_many(self, records):
        self.calls += 1
        raise ConnectionError("keeper gone")


def test_a_send_that_keeps_failing_is_reported_never_dropped():
    keeper = RefusingKeeper()
    sender = KeeperSender(keeper, 0, wait=True, tries=3, backoff_s=0.001)
    with pytest.raises(KeeperUnreachableError, match=r"did not take records after 3 tries: ConnectionError: keeper gone"):
        sender.send(rec(0))
    assert keeper.calls == 3
    with pytest.raises(KeeperUnreachableError):  # every later send too, and the final close
        sender.send(rec(1))
    with pytest.raises(KeeperUnreachableError):
        sender.close()

    sender = KeeperSender(RefusingKeeper(), 0, wait=False, tries=2, backoff_s=0.001)
    sender.send(rec(0))  # process: queued, not waited for
    with pytest.raises(KeeperUnreachableError):
        sender.close()


def test_durability_is_validated_and_the_default_scratch_dir_is_per_run_and_outside_the_run_directory(tmp_path):
    base = dict(cache_dir=str(tmp_path), model="tiny", run_id="r1")
    with pytest.raises(ValueError, match=r"^durability 'rack': choose one of process, node, cluster$"):
        JobConfig(out_dir=str(tmp_path / "a"), durability="rack", **base)
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--durability", "rack", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and result.output.strip() == "error: --durability 'rack': choose one of process, node, cluster"
    result = CliRunner().invoke(app, ["run", "--model", "tiny", "--durability", "cluster", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and result.output.strip() == (
        "error: --durability cluster needs a remote storage (s3://BUCKET/PREFIX) to put each step record in before its "
        f"update, not the local path {tmp_path / 'run' / 'snapshots'} (or choose durability node)")
    assert not (tmp_path / "run").exists()
    remote = JobConfig(out_dir=str(tmp_path / "a"), durability="cluster", **base, storage={"uri": "s3://b/p"})
    assert remote.durability == "cluster"
    ref = reference_config(remote)  # --verify's reference stores locally: cluster cannot hold there, node does
    assert (ref.durability, ref.storage.remote, ref.trajectory_sha256()) == ("node", False, remote.trajectory_sha256())

    a, b = JobConfig(out_dir=str(tmp_path / "a"), **base), JobConfig(out_dir=str(tmp_path / "b"), **base)
    assert a.durability == "node" and log_keeper_name(a) == "raycheck-log-keeper-r1"
    assert a.scratch_dir != b.scratch_dir  # one run id in two directories: two scratch logs
    assert pathlib.Path(a.scratch_dir).parent == pathlib.Path(tempfile.gettempdir()) / "raycheck-scratch"
    assert JobConfig.from_dict(a.to_dict()).scratch_dir == a.scratch_dir  # the workers see the driver's choice
    given = JobConfig(out_dir=str(tmp_path / "a"), scratch_dir="/node/local", durability="process", **base)
    assert (given.scratch_dir, given.durability) == ("/node/local", "process")
    for inside in (tmp_path / "a", tmp_path / "a" / "scratch"):  # rank 0's log would be the keeper's steplog.bin
        with pytest.raises(ValueError, match="is inside the run directory"):
            JobConfig(out_dir=str(tmp_path / "a"), scratch_dir=str(inside), **base)


def test_the_summary_says_whether_durability_node_held_and_counts_the_group_commits():
    events = [{"kind": "step_log", "node_id": "n1"}, {"kind": "recovery"}, {"kind": "step_log", "node_id": "n2"}]
    n0 = {"node_id": "n0", "end": 5}
    assert durability("node", n0, events) == {"level": "node", "keeper_node_id": "n0", "rank0_node_ids": ["n1", "n2"],
                                              "node_held": True}
    assert not durability("node", {"node_id": "n2"}, events)["node_held"]  # a replacement ran on the keeper's node
    assert not durability("process", n0, events)["node_held"]
    assert not durability("node", n0, [])["node_held"]  # rank 0 never started
    assert durability("cluster", {**n0, "log_uploads": 4, "log_uploaded_steps": 10}, events) == {
        "level": "cluster", "keeper_node_id": "n0", "rank0_node_ids": ["n1", "n2"], "node_held": True,
        "uploads": 4, "uploaded_steps": 10, "records_per_upload": 2.5}
    assert durability("cluster", n0, [])["records_per_upload"] is None  # no upload yet


class GatedStorage:
    """A real ``Storage`` whose ``put`` of a log segment waits for ``gate`` (set: passes at once) after
    setting ``entered``; ``fail_puts`` puts raise first. Records the names put, in order."""

    def __init__(self, storage: Storage) -> None:
        self.storage, self.puts, self.fail_puts = storage, [], 0
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.storage, name)

    def put(self, rel: str, data: bytes) -> None:
        self.entered.set()
        self.gate.wait()
        if self.fail_puts:
            self.fail_puts -= 1
            raise StorageUnavailableError(f"{rel}: refused (test)")
        self.puts.append(rel)
        self.storage.put(rel, data)


def test_cluster_durability_acknowledges_an_append_once_it_is_in_the_bucket_with_group_commit(tmp_path, s3_endpoint):
    bucket = f"rc-commit-{uuid.uuid4().hex[:8]}"
    make_bucket(s3_endpoint, bucket)
    storage = Storage(f"s3://{bucket}/run", endpoint_url=s3_endpoint)
    gated = GatedStorage(storage)
    with pytest.raises(ValueError, match="commit_to_storage needs storage to mirror to"):
        LogKeeper(tmp_path / "none.bin", header=HEADER, commit_to_storage=True)
    keeper = LogKeeper(tmp_path / "steplog.bin", header=HEADER, mirror_to=gated, commit_to_storage=True)
    assert keeper.append(rec(0)) == 1 and read_segments(storage)[1] == [rec(0)]  # acknowledged: in the bucket

    gated.gate.clear()
    gated.entered.clear()
    acked: dict[int, int] = {}

    def append(step: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: acked.setdefault(step, keeper.append(rec(step))))
        thread.start()
        return thread

    first = append(1)
    assert gated.entered.wait(60)  # step 1's upload is in flight, held
    second = append(2)
    assert keeper.wait_for(3, timeout_s=60) == 3  # step 2 is in the local file, its append waits for the upload
    third = append(3)
    assert keeper.wait_for(4, timeout_s=60) == 4
    assert acked == {} and read_segments(storage)[1] == [rec(0)]  # nothing acknowledged before it is in the bucket
    gated.gate.set()
    for thread in (first, second, third):
        thread.join(timeout=60)
    assert acked == {1: 2, 2: 3, 3: 4}
    assert gated.puts == [segment_name(0, 0), segment_name(0, 1), segment_name(0, 3)]  # steps 2 and 3: one upload
    assert keeper.status() == {"end": 4, "adopted_steps": 0, "adopt_error": None, "log_mirrored_steps": 4, "log_mirror_error": None,
                               "log_uploads": 3, "log_uploaded_steps": 4}
    assert read_segments(storage)[1] == [rec(i) for i in range(4)] and storage.list("log/") == [segment_name(0, 3)]

    gated.fail_puts = 1  # an upload that fails: the append raises, the record stays local; a re-send gets it in
    with pytest.raises(StorageUnavailableError, match="refused"):
        keeper.append(rec(4))
    assert keeper.end() == 5 and read_segments(storage)[1] == [rec(i) for i in range(4)]
    assert keeper.status()["log_mirror_error"].startswith("StorageUnavailableError")
    assert keeper.append(rec(4)) == 5 and read_segments(storage)[1] == [rec(i) for i in range(5)]
    assert keeper.status()["log_uploads"] == 4 and keeper.status()["log_mirror_error"] is None


@pytest.mark.ray
def test_a_bucket_holding_another_runs_log_fails_the_run_at_the_keepers_start_with_a_summary(tmp_path, s3_endpoint):
    """The keeper refuses to adopt the segments of another trajectory (a --storage reused by mistake):
    the run ends before training with one error that names the bucket's run, a summary, and no actor left."""
    bucket = f"rc-other-{uuid.uuid4().hex[:8]}"
    make_bucket(s3_endpoint, bucket)
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(default_cache_dir()), model="tiny", steps=4, eval_samples=0,
                    run_id=f"o-{uuid.uuid4().hex[:6]}", storage={"uri": f"s3://{bucket}/run", "options": {"endpoint_url": s3_endpoint}})
    other = keeper_with(tmp_path / "other.bin", 2, mirror_to=snapshot_store(cfg).storage)
    assert other.flush()["log_mirrored_steps"] == 2
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="raycheck")
    try:
        summary = Controller(cfg, echo=lambda _: None).run()
        with pytest.raises(ValueError):
            ray.get_actor(log_keeper_name(cfg), namespace="raycheck")
    finally:
        ray.shutdown()
    assert summary["error"] == json.loads((tmp_path / "run" / "summary.json").read_text())["error"]
    assert (summary["ok"], summary["phase"], summary["final_step"]) == (False, "failed", None)
    assert summary["error"].startswith("LogKeeperFailedError: the step log keeper could not start on the driver's node: ")
    assert summary["error"].endswith(f"holds the step log of another run or trajectory (run k, trajectory {'t' * 64}) than "
                                     f"{tmp_path / 'run' / 'steplog.bin'}: resume with that run's settings")
