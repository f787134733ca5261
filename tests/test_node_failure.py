"""``--fail STEP:node`` without a cluster: parsing, the refusals, and which processes count as rank 0's
node (``workers.faults.node_processes``, on real process trees; the run itself is in
``tests/test_multinode.py``)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import uuid

import psutil
import pytest

from raycheck.job.config import FailureSpec, JobConfig
from raycheck.orchestrator.cluster import Node
from raycheck.orchestrator.prepare import check_node_failures
from raycheck.workers.preempt import node_processes

HEAD = Node("head", "10.0.0.1", {"driver": 1.0})
GPU_A = Node("gpu-a", "10.0.0.2", {"CPU": 2.0, "train": 2.0})
GPU_B = Node("gpu-b", "10.0.0.3", {"CPU": 2.0, "train": 2.0})
CPU = Node("cpu", "10.0.0.4", {"CPU": 1.0, "replica": 8.0})
CPU2 = Node("cpu2", "10.0.0.5", {"CPU": 1.0, "replica": 8.0})


def node_cfg(tmp_path: pathlib.Path, **fields) -> JobConfig:
    return JobConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path), model="tiny", steps=8,
                     **{"storage": {"uri": "s3://bucket/run"}, **fields}, faults={"failures": (FailureSpec.parse("3:node"),)})


def test_a_node_failure_parses_and_is_refused_where_the_run_could_not_survive_it(tmp_path):
    assert FailureSpec.parse("3:node") == FailureSpec(step=3, target="node")
    with pytest.raises(ValueError, match="HOW applies to worker, both, storage and preempt failures only"):
        FailureSpec.parse("3:node:sigkill")
    assert (FailureSpec.parse("3:preempt").grace_s, FailureSpec.parse("3:preempt-shadow:10").grace_s) == (30.0, 10.0)
    assert FailureSpec.parse("3:preempt:0").grace_s == 0.0 and FailureSpec.parse("3:node").grace_s is None
    with pytest.raises(ValueError, match=r"^a preempt failure takes its notice in whole seconds, e.g. 3:preempt:10 \(got '2.5'\)$"):
        FailureSpec.parse("3:preempt:2.5")
    for storage in ("", str(tmp_path / "snapshots"), f"file://{tmp_path}"):
        with pytest.raises(ValueError, match=r"^failure 3:node takes down rank 0's node with every file on it, but storage "
                                             r".* is node-local: give --storage a URI every node reaches \(s3://BUCKET/PREFIX\)$"):
            node_cfg(tmp_path, storage={"uri": storage})

    cfg = node_cfg(tmp_path, placement={"worker_resource": "train"})
    check_node_failures(cfg, [HEAD, GPU_A, GPU_B, CPU], driver_node_id="head")  # accepted: returns
    check_node_failures(node_cfg(tmp_path).replace(faults={"failures": ()}), [HEAD], driver_node_id="head")  # no node failure: any cluster
    with pytest.raises(ValueError, match="which on a one-node cluster is the driver's: the run would end with it"):
        check_node_failures(cfg, [GPU_A], driver_node_id="gpu-a")
    with pytest.raises(ValueError, match=r"would take down the driver's node, which can host a train worker \(it offers "
                                         r"\{'CPU': 1.0\}\): start the driver's node without them"):
        check_node_failures(node_cfg(tmp_path), [GPU_A, GPU_B], driver_node_id="gpu-a")
    with pytest.raises(ValueError, match=r"but 1 node\(s\) of 3 can host a train worker \(each asks \{'CPU': 1.0, 'train': "
                                         r"1.0\}\): the workers need another node to restart on"):
        check_node_failures(cfg, [HEAD, GPU_A, CPU], driver_node_id="head")
    check_node_failures(cfg, [HEAD, GPU_A, CPU], driver_node_id="head", fired=["0.worker"])  # a resume: it fired before
    with pytest.raises(ValueError, match="but 1 node"):  # another failure's marker does not count
        check_node_failures(cfg, [HEAD, GPU_A, CPU], driver_node_id="head", fired=["1.worker", "0.shadow"])
    preempt = cfg.replace(faults={"failures": (FailureSpec.parse("3:preempt:10"),)})
    check_node_failures(preempt, [HEAD, GPU_A, GPU_B, CPU], driver_node_id="head")
    with pytest.raises(ValueError, match=r"^failure 3:preempt takes down rank 0's node, but 1 node\(s\) of 3 can host a train worker"):
        check_node_failures(preempt, [HEAD, GPU_A, CPU], driver_node_id="head")
    shadow = cfg.replace(faults={"failures": (FailureSpec.parse("3:preempt-shadow:10"),)}, placement={"shadow_resource": "replica"})
    with pytest.raises(ValueError, match=r"^failure 3:preempt-shadow takes down the shadow's node, but 1 node\(s\) of 4 can host the "
                                         r"shadow \(each asks \{'replica': 1.0\}\): the shadow needs another node to restart on$"):
        check_node_failures(shadow, [HEAD, GPU_A, GPU_B, CPU], driver_node_id="head")
    check_node_failures(shadow, [HEAD, GPU_A, CPU, CPU2], driver_node_id="head")


def fake_raylet(tmp_path: pathlib.Path, session: str, name: str) -> tuple[subprocess.Popen, list[int]]:
    """A process named ``raylet`` (its executable's name) with ``--session_dir=session`` that starts a
    child with a grandchild, as a raylet starts workers that start their own processes; returns it
    and the pids of the three, once all have started (the child prints the grandchild's pid after
    starting it)."""
    exe = tmp_path / name / "raylet"
    exe.parent.mkdir()
    exe.write_text("#!/bin/bash\nbash -c 'sleep 300 & echo $!; wait' &\nwait\n")
    exe.chmod(0o755)
    raylet = subprocess.Popen([str(exe), f"--session_dir={session}"], stdout=subprocess.PIPE, text=True)
    grandchild = int(raylet.stdout.readline())
    return raylet, [raylet.pid, psutil.Process(grandchild).ppid(), grandchild]


def test_a_node_is_its_raylet_tree_plus_its_session_processes_where_the_raylet_is_alone_in_its_namespace(tmp_path):
    session = str(tmp_path / f"session_{uuid.uuid4().hex}")
    raylet, tree = fake_raylet(tmp_path, session, "a")
    started = [raylet]
    try:
        worker = tree[-1]
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", session]))  # beside it
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "another session"]))
        assert sorted(p.pid for p in node_processes(worker)) == sorted([*tree, started[1].pid])

        # a second raylet of the session in this namespace: two nodes share the machine, only the tree is the node's
        other, other_tree = fake_raylet(tmp_path, session, "b")
        started.append(other)
        assert sorted(p.pid for p in node_processes(worker)) == sorted(tree)
        assert sorted(p.pid for p in node_processes(other_tree[-1])) == sorted(other_tree)
    finally:
        for proc in started:
            for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                p.kill()
            proc.wait()
    with pytest.raises(RuntimeError, match=f"process {os.getpid()} is not a Ray worker: no raylet among its ancestors"):
        node_processes(os.getpid())
