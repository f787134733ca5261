"""``raycheck inspect`` / ``raycheck verify`` on a run directory: read only, every problem named."""

import numpy as np
from typer.testing import CliRunner

from orchestrator.cli import app
from storage.snapshots import MANIFEST, SnapshotStore
from storage.steplog import RECORD_BYTES, StepLogWriter, StepRecord


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
    assert inspected.exit_code == 0 and "1 committed snapshot(s)" in inspected.output


def test_missing_paths_and_files_are_refused_and_never_created(tmp_path):
    for target in (tmp_path / "absent", tmp_path / "file.json"):
        if target.name == "file.json":
            target.write_text("{}")
        for command in ("inspect", "verify"):
            result = CliRunner().invoke(app, [command, str(target)])
            assert result.exit_code == 2 and "cannot read snapshot store" in result.output
    assert not (tmp_path / "absent").exists()
