"""Notice-to-safe seconds of a preemption notice, first-order and ZO, on a cluster of nodes on this machine.

Starts a moto S3 server and a ``LocalCluster`` (``experiments.local_cluster``, root: each node in its own mount
namespace): the head (the driver), two train nodes and two replica nodes (the spares take over what the
drained node held). Then two ``raycheck run`` drivers on the head (``RAY_ADDRESS``), each with one preemption
notice (``ray drain-node`` with a deadline ``--grace`` seconds away; the node is taken down at the deadline):

- ``fo``: rank 0's node, first-order ``--fo-strategy`` (default full-async): the workers commit the current
  step (a just-in-time checkpoint) and restart on the spare at the deadline;
- ``zo``: the shadow's node: the shadow hands its image to the persister (same node), both move to the spare.

Prints, per run, what was saved, at which step, and seconds from the notice until it was safe in storage, and
the steps the restarted workers redid. ``python -m raycheck.experiments.preempt_bench --model smollm2-135m``
(about 8 minutes on 2 cores); ``--model tiny`` for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import uuid

from raycheck.experiments.local_cluster import LocalCluster, NodeSpec
from raycheck.experiments.s3_server import LocalS3Server

NODES = (NodeSpec("gpu", 2, {"train": 1}), NodeSpec("gpu2", 2, {"train": 1}),
         NodeSpec("cpu", 1, {"replica": 8}), NodeSpec("cpu2", 1, {"replica": 8}))
"""Two nodes for the single train worker, two for the shadow and the persister: one of each is drained."""


def run(cluster: LocalCluster, endpoint: str, out: pathlib.Path, args: list[str]) -> dict:
    """One ``raycheck run`` on ``cluster`` (s3 storage in a new bucket of ``endpoint``); returns its summary."""
    bucket = f"rc-{uuid.uuid4().hex[:12]}"
    env = {**cluster.env, "RAY_ADDRESS": cluster.address, **server_env()}
    subprocess.run([sys.executable, "-c", f"import boto3; boto3.client('s3', endpoint_url={endpoint!r}).create_bucket(Bucket={bucket!r})"],
                   env=env, check=True)
    command = [sys.executable, "-m", "raycheck.cli", "run", "--storage", f"s3://{bucket}/run", "--s3-endpoint", endpoint,
               "--worker-resource", "train", "--shadow-resource", "replica", "--start-timeout", "300", "--eval-samples", "0",
               "--out", str(out), *args]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, env=env, check=False)
    return json.loads((out / "summary.json").read_text())


def server_env() -> dict[str, str]:
    """The credentials the moto server takes (any)."""
    return {"AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
            "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"), "AWS_DEFAULT_REGION": "us-east-1"}


def report(name: str, summary: dict) -> None:
    """Print the run's preemptions."""
    print(f"{name}: ok {summary['ok']}, bitwise_equal {summary.get('bitwise_equal')}, error {summary.get('error')}")
    for p in summary.get("preemptions", []):
        print(f"  notice on {p['node_id'][:8]} ({', '.join(p['components'])}), grace {p['grace_s']} s; "
              f"restored step {p.get('restored_step')}, steps redone {p.get('recomputed_steps')}")
        for s in p["saved"]:
            print(f"    saved {s['component']:10s} step {s['step']}: safe {s['notice_to_safe_seconds']:.2f} s after the notice")
        for u in p["unsaved"]:
            print(f"    NOT saved {u['component']}: {u.get('error', '')}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="model name or folder (default smollm2-135m)")
    parser.add_argument("--grace", type=int, default=60, help="the notice, seconds (default 60)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (default 4; the notice comes during step 1)")
    parser.add_argument("--fo-strategy", default="full-async", help="first-order strategy (default full-async)")
    parser.add_argument("--only", choices=("fo", "zo"), help="run one of the two")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/preempt_bench"), help="where the runs go")
    a = parser.parse_args(argv)
    common = ["--model", a.model, "--steps", str(a.steps), "--batch-size", "4", "--seq-len", "32", "--overwrite"]
    runs = {"fo": ["--algo", "fo", "--strategy", a.fo_strategy, "--snapshot-every", "100", "--fail", f"1:preempt:{a.grace}"],
            "zo": ["--snapshot-every", "100", "--fail", f"1:preempt-shadow:{a.grace}"]}
    os.environ.update(server_env())
    server = LocalS3Server().start()
    private = pathlib.Path(tempfile.mkdtemp(prefix="rcpb-"))
    cluster = LocalCluster(NODES, [private]).start()
    try:
        summaries = {name: run(cluster, server.endpoint, a.out / name, [*common, *args])
                     for name, args in runs.items() if a.only in (None, name)}
    finally:
        cluster.stop()
        server.stop()
    for name, summary in summaries.items():
        report(name, summary)


if __name__ == "__main__":
    main()
