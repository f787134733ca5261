"""A long storage outage mid-run on a local Ray cluster: storage that comes back is used again
(issue 14 item 6): the breaker opens during the outage, half-opens, and snapshots and the log mirror
resume, so the storage ends complete and bitwise equal to the worker's final state."""

from __future__ import annotations

import pathlib
import time

import pytest

from experiments.s3_server import LocalS3Server
from storage.log_segments import read_segments
from storage.steplog import read_records
from test_end_to_end import cfg_store, cluster, job  # noqa: F401  (cluster is a fixture)
from training.state import state_sha256

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]
OUTAGE_S = 20.0


def test_snapshots_and_the_log_mirror_resume_after_a_20s_s3_outage(cluster, tmp_path_factory):
    """The S3 server stops during step 4 for 20 s. The outage callable returns when the server is
    back, so the run's end (its last snapshot and log upload) comes after the outage whatever the
    speed of training: the scenario forces storage calls after the breaker opened. Three failed
    operations in a row (about 4 s each with the default retries) open it well within the outage."""
    with LocalS3Server() as server:

        def outage_until_back(seconds: float) -> None:
            server.stop()
            time.sleep(seconds)  # the outage itself
            server.start()

        s = job(tmp_path_factory, "outage20", f"4:storage:{OUTAGE_S:g}", outage=outage_until_back,
                storage=server.uri("run"), storage_options={"endpoint_url": server.endpoint})
        snaps = s["snapshots"]
        assert s["final_step"] == 12 and s["lost_steps"] == 0 and s["shadow_equal"]
        assert s["shadow_hashes"] == s["worker_hashes"] and len(s["worker_hashes"]) == 6
        assert snaps["failed"] >= 1 and snaps["storage"]["opened"] >= 1  # the outage tripped the breaker
        assert snaps["storage"]["state"] == "closed" and snaps["storage"]["probes"] >= 1  # and a probe closed it
        assert snaps["last_durable_step"] == 12 and snaps["log_mirrored_steps"] == 12  # past the outage (step 4)
        latest = cfg_store(s).load_latest()
        assert latest.info.step == 12 and state_sha256(latest.state) == s["state_sha256"]
        local = read_records(pathlib.Path(s["config"]["out_dir"]) / "steplog.bin")
        assert read_segments(cfg_store(s).storage)[1] == local and len(local) == 12
