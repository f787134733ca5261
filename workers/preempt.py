"""Preemption notices and node loss: the drain with a deadline that announces a preemption, how a worker
learns of it, and taking a node down (an injected ``node`` failure at once, a ``preempt`` one at its deadline).

A cloud that reclaims a spot node warns first (about 30 s on GCP, 120 s on AWS); the autoscaler passes the
warning to Ray as a drain of the node with a deadline (``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N``, ``drain_node`` here). Ray then places nothing new on the node, and lists it
with its deadline (``draining_nodes``); it does not take the node down itself: the cloud does, at the
deadline (``schedule_node_loss`` does it for an injected notice). Ray Train's watcher turns the drain of a
node holding train workers into ``ray.train.get_preemption_info()`` in every worker, and restarts the worker
group at the deadline, counting it against ``FailureConfig.max_preemption_failures``.

Just-in-time checkpointing (Gupta et al., "Just-In-Time Checkpointing: Low Cost Error Recovery from Deep
Learning Training Failures", EuroSys 2024): on the notice, save the state of the current step, so that the
restart redoes no step.
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from raycheck.training.checkpointing import Checkpointer


def raylet_of(pid: int) -> psutil.Process:
    """The raylet of the Ray node that runs process ``pid``: its nearest ancestor named ``raylet``
    (Ray's worker and actor processes are the raylet's children).

    Raises:
        RuntimeError: ``pid`` has no raylet among its ancestors (not a process Ray started).
    """
    raylet = next((p for p in psutil.Process(pid).parents() if p.name() == "raylet"), None)
    if raylet is None:
        raise RuntimeError(f"process {pid} is not a Ray worker: no raylet among its ancestors")
    return raylet


def node_processes(pid: int) -> list[psutil.Process]:
    """Every process of the Ray node that runs ``pid`` that this process can see (``pid`` among them):
    ``raylet_processes`` of its raylet."""
    return raylet_processes(raylet_of(pid))


def raylet_processes(raylet: psutil.Process) -> list[psutil.Process]:
    """Every process of the Ray node of ``raylet`` that this process can see: the raylet and its
    descendants (workers, actors, agents); and, where that raylet is the only raylet of its Ray session in
    its mount namespace (the node has its own machine or container), every other process there whose
    command line names the session's directory (e.g. the log monitor ``ray start`` started beside the
    raylet). Where several nodes of the session share a mount namespace (several ``ray start`` on one
    machine), only the raylet's tree is the node's."""
    return list({p.pid: p for p in [*tree(raylet), *beside(*node_marks(raylet))]}.values())


def tree(process: psutil.Process) -> list[psutil.Process]:
    """``process`` and its descendants ([] when it is gone)."""
    try:
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def node_marks(raylet: psutil.Process) -> tuple[str, str, bool]:
    """(its session directory, its mount namespace, whether it is the only raylet of the session there)
    of a live ``raylet``: what finds the processes of its node beside its tree (``beside``)."""
    session = next(a.split("=", 1)[1] for a in raylet.cmdline() if a.startswith("--session_dir="))
    namespace = os.readlink(f"/proc/{raylet.pid}/ns/mnt")
    raylets = [p.pid for p in beside(session, namespace, True) if p.name() == "raylet"]
    return session, namespace, raylets == [raylet.pid]


def beside(session: str, namespace: str, sole: bool) -> list[psutil.Process]:
    """With ``sole``, the processes in mount namespace ``namespace`` whose command line names ``session``
    (``node_marks``); without, none."""
    found = []
    for p in psutil.process_iter(["cmdline"]) if sole else ():
        try:
            if os.readlink(f"/proc/{p.pid}/ns/mnt") == namespace and any(session in a for a in p.info["cmdline"] or ()):
                found.append(p)
        except (OSError, psutil.Error):
            continue  # gone, or not ours to inspect
    return found


def kill_all(processes: list[psutil.Process], last: int | None = None) -> None:
    """SIGKILL ``processes`` (those already gone are skipped), the one of pid ``last`` (this process) last."""
    for p in {p.pid: p for p in processes}.values():  # a process listed twice is killed once
        if p.pid != last:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    if last is not None:
        os.kill(last, signal.SIGKILL)


def take_down_node() -> None:
    """SIGKILL every process of this process's Ray node (``node_processes``), this one last: the
    node is lost as a machine is, its raylet with it (Ray marks the node dead)."""
    me = os.getpid()
    kill_all(node_processes(me), last=me)


def draining_nodes() -> dict[str, float | None]:
    """The nodes Ray is draining: node id (hex) -> the deadline (unix seconds; None: none given).
    Ray Core's view (``ray._private.state.state.get_draining_nodes``, which Ray Train's preemption
    watcher reads too); needs ``ray.init``."""
    import ray

    return {node: (deadline_ms / 1000 if deadline_ms else None) for node, deadline_ms in ray._private.state.state.get_draining_nodes().items()}


class NodeDrainWatch:
    """Whether node ``node_id`` (e.g. rank 0's own) is being drained, asking Ray (``draining_nodes``) at most
    every ``every_s`` seconds; ``check()`` returns the deadline (unix seconds; inf without one) once, the first
    time the drain is seen, else None. No collective: for a process whose own node matters, e.g. rank 0 of a
    ZO run, whose node-local step log must be acknowledged by the log keeper before the node goes."""

    def __init__(self, node_id: str, every_s: float = 1.0) -> None:
        self.node_id, self.every_s = node_id, every_s
        self._next = 0.0
        self.seen = False

    def check(self) -> float | None:
        now = time.monotonic()
        if self.seen or now < self._next:
            return None
        self._next = now + self.every_s
        drains = draining_nodes()
        if self.node_id not in drains:
            return None
        self.seen = True
        return drains[self.node_id] or float("inf")


class PreemptionNotices:
    """Ray Train's preemption notice for this worker group (``ray.train.get_preemption_info``, a collective:
    every rank calls ``poll`` after every step). ``poll`` returns the notice once, the first time it is
    seen, else None; after it, it asks no more (every rank got the same answer, so all stop together).
    In a process outside Ray Train's worker group (one worker's step executor, ``workers.standby``) the notice
    is this node's drain (``NodeDrainWatch``), as a ``PreemptionInfo`` of rank ``rank``."""

    def __init__(self, rank: int = 0) -> None:
        self.seen: Any = None
        self.rank = rank
        self._node: NodeDrainWatch | None = None

    def poll(self) -> Any:
        if self.seen is not None:
            return None
        import ray.train

        if self._node is None:
            try:
                self.seen = ray.train.get_preemption_info()
                return self.seen
            except RuntimeError:  # not a Ray Train worker: a step executor
                self._node = NodeDrainWatch(ray.get_runtime_context().get_node_id())
        deadline = self._node.check()
        if deadline is not None:
            self.seen = SimpleNamespace(deadline_ms=None if math.isinf(deadline) else int(deadline * 1000),
                                        preempted_node_ids=[self._node.node_id], preempted_ranks=[self.rank])
        return self.seen


def save_before_deadline(notice: Any, checkpointer: Checkpointer | None, steps_done: int, state: Callable[[], Mapping[str, Any]],
                         record: Callable[[str, dict[str, Any]], None] | None) -> None:
    """A first-order worker on a preemption ``notice`` (Ray Train's ``PreemptionInfo``): ``checkpointer`` (rank 0's;
    every rank's under FSDP2; None on the other ranks) commits the state after ``steps_done`` steps now
    (``Checkpointer.save_now``, bounded by the deadline), ``record`` (rank 0's; None elsewhere) gets a
    ``preemption_saved`` event (or ``preemption_unsaved`` with the error: the restart then starts from the
    newest committed checkpoint, redoing the steps after it), then the worker waits, training no further (a
    step after the save would be redone), until Ray Train ends it at the deadline and restarts the group on
    the nodes left. Never returns."""
    t0 = time.time()
    deadline = notice.deadline_ms / 1000 if notice.deadline_ms else None
    fields = dict(component="workers", step=steps_done, notice_seen_unix_s=t0, deadline_unix_s=deadline,
                  nodes=notice.preempted_node_ids, ranks=notice.preempted_ranks)
    try:
        saved = checkpointer.save_now(steps_done, state, timeout_s=max(1.0, (deadline or t0 + 600) - t0)) if checkpointer else None
    except Exception as exc:  # a save that did not commit leaves the newest committed checkpoint as it was
        if record is not None:
            record("preemption_unsaved", {**fields, "error": f"{type(exc).__name__}: {exc}"[:300]})
    else:
        if record is not None:
            record("preemption_saved", {**fields, "seconds": time.time() - t0, "bytes": (saved or {}).get("bytes", 0),
                                        "before_deadline": deadline is None or time.time() <= deadline})
    threading.Event().wait()


def ray_command() -> list[str]:
    """How to run Ray's command line here: its ``ray`` script beside this Python, on the PATH, or the module."""
    beside = pathlib.Path(sys.executable).parent / "ray"
    found = str(beside) if beside.exists() else shutil.which("ray")
    return [found] if found else [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]


def drain_node(node_id: str, grace_s: float, message: str) -> float:
    """Give node ``node_id`` a preemption notice as a cloud's autoscaler does: ``ray drain-node --reason
    DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds GRACE`` against this process's cluster.
    Returns the deadline Ray recorded (unix seconds).

    Raises:
        RuntimeError: Ray did not accept the drain (its message is in the error).
    """
    import ray

    command = [*ray_command(), "drain-node", "--address", ray.get_runtime_context().gcs_address, "--node-id", node_id,
               "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", message,
               "--deadline-remaining-seconds", str(int(grace_s))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise RuntimeError(f"ray drain-node of node {node_id} failed (exit {done.returncode}): {(done.stderr or done.stdout)[-500:]}")
    return draining_nodes().get(node_id) or time.time() + grace_s


def schedule_node_loss(node_id: str, deadline_unix_s: float) -> int:
    """Take node ``node_id`` down at ``deadline_unix_s`` (as the cloud takes a preempted node): a task on that
    node starts a detached reaper (``python -m raycheck.workers.preempt RAYLET_PID DEADLINE``, its own session,
    so no teardown of a worker stops it), which at the deadline kills the node's processes
    (``raylet_processes``). Call it before ``drain_node``: a draining node takes no new task. Returns the
    node's raylet pid."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def start_reaper(deadline: float) -> int:
        raylet = raylet_of(os.getpid()).pid
        reaper = [sys.executable, "-m", "raycheck.workers.preempt", str(raylet), repr(deadline)]
        # started by a short-lived parent, so that it belongs to no Ray worker (whose children Ray kills with it)
        subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True, "
                        "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)", *reaper], check=True, timeout=60)
        return raylet

    task = ray.remote(start_reaper).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    return ray.get(task.remote(deadline_unix_s), timeout=120)


def reap(raylet_pid: int, deadline_unix_s: float) -> None:
    """The reaper of ``schedule_node_loss``: learn the node's marks now (``node_marks``), wait until the
    deadline, then kill the node of ``raylet_pid`` (``raylet_processes``): its raylet's tree, if the
    raylet is still there (a drained raylet may have ended itself), and what runs beside it."""
    raylet = psutil.Process(raylet_pid)
    marks = node_marks(raylet)
    time.sleep(max(0.0, deadline_unix_s - time.time()))
    kill_all([*tree(raylet), *beside(*marks)])


if __name__ == "__main__":
    reap(int(sys.argv[1]), float(sys.argv[2]))
