"""Failure injection inside the training workers, reproducible by step.

Each ``FailureSpec`` fires once per run: before acting, the acting rank claims a marker
(``"<index>.<part>"``) in the run's journal (``actors.journal``; the failure event names it), so
a restarted worker that re-executes the same step does not fail again, nor does a resumed driver's.

With ``JobConfig.faults.settle_failures`` a failure hits a settled run, so that what a scenario recovers from depends on its failure steps
only, never on how fast a machine is: a shadow kill or a corrupted snapshot waits until the shadow
has replayed every durable step and every snapshot it handed on (and every checkpoint a worker
wrote in the background) is committed; a worker failure waits until the checkpointers' background
writes are committed and, where the strategy has a shadow, until a shadow answers (e.g. one the
controller restarted after an earlier kill).

Test gate: with ``RAYCHECK_TEST_HOLD_AT_STEP=N`` in the environment of the Ray workers, rank 0
records a ``held`` event during step N (after N durable steps) and blocks until its process is
killed, so a test can kill the driver (or change the cluster) at a known step; once per run (a journal
marker), so the workers that follow go on.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence

import ray
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from raycheck.actors.journal import RunChannel
from raycheck.actors.shadow_actor import find_shards
from raycheck.job.config import PREEMPT_TARGETS, FailureSpec, JobConfig
from raycheck.job.names import persister_name
from raycheck.job.stores import snapshot_store
from raycheck.storage.steplog import StepLogWriter
from raycheck.workers.preempt import drain_node, schedule_node_loss, take_down_node


class InjectedWorkerFailure(RuntimeError):
    """The exception of an injected ``worker:raise`` failure: the step fails, the process survives (one
    worker restarts in process, ``training.in_process``; with several, Ray Train restarts it)."""


def marker(index: int, part: str) -> str:
    """The journal marker of part ``part`` (``worker``, ``shadow``, ``shadow-killed``, ...) of failure ``index``."""
    return f"{index}.{part}"


PARTS = {"worker": ("worker",), "shadow": ("shadow", "shadow-killed"), "both": ("shadow", "shadow-killed", "worker"),
         "node": ("worker",)}
"""The markers each failure target claims (any other target claims one marker, named after it; a
``node`` failure is announced as a worker failure)."""


def fired_before(failures: Sequence[FailureSpec], durable_steps: int) -> list[str]:
    """Every marker of the failures (``FailureSpec`` sequence, indexed as in ``JobConfig.failures``) due
    at a step below ``durable_steps`` (pure). Those fired before the run logged their step: a failure
    fires during its step, before that step's record is committed, so a resumed run whose log holds
    ``durable_steps`` steps must not fire them again, whatever its run directory lost."""
    return [marker(i, part) for i, f in enumerate(failures) if f.step < durable_steps for part in PARTS.get(f.target, (f.target,))]


class FaultInjector:
    """Fires the failures of ``cfg`` that are due at a step, for worker ``rank`` of ``world``.

    The shadow part of a failure is done by rank 0 (``ray.kill``); the worker part by the last rank
    (``torn`` needs rank 0's log writer, so use it with one worker); a ``node`` failure by rank 0, which
    announces it as a worker failure (HOW ``node``) and takes down its node (``take_down_node``).
    ``run`` is the run's journal.
    ``durable_steps`` returns how many steps are durable when a worker failure hits (the steps the log
    keeper holds, ``actors.log_keeper``; strategies without a step log pass their newest committed checkpoint's step).
    ``flush`` waits until this rank's background checkpoint writes are committed (default: nothing to
    wait for). ``barrier(name)`` meets every rank (default: ``torch.distributed.barrier``; with replica
    groups the step exchange's, ``actors.step_exchange``).
    """

    def __init__(self, cfg: JobConfig, run: RunChannel, rank: int, world: int, durable_steps: Callable[[], int],
                 flush: Callable[[], object] | None = None, barrier: Callable[[str], None] | None = None) -> None:
        self.cfg, self.run, self.rank, self.world = cfg, run, rank, world
        self.durable_steps = durable_steps
        self.flush = flush or (lambda: None)
        self.barrier = barrier or (lambda _name: dist.barrier())
        self.hold_step = int(os.environ.get("RAYCHECK_TEST_HOLD_AT_STEP", -1))

    def _claim(self, index: int, part: str) -> bool:
        return self.run.claim(marker(index, part))

    def fired(self) -> bool:
        """True once any failure has fired in this run (a start is then a restart)."""
        return self.run.any_claimed()

    def _live_shadow(self) -> list | None:
        """The shadow's shards (one handle each) once all answer; if a restarted incarnation is still
        starting, wait for it (bounded: None after 180 s)."""

        def answers(handle) -> bool:
            try:
                ray.get(handle.status.remote(), timeout=120)
                return True
            except (RayActorError, GetTimeoutError):
                return False

        return find_shards(self.run, self.cfg.namespace, timeout_s=180, alive=answers)

    def _settle_snapshots(self):
        """Wait until the shadow (its shards returned; None without one) has replayed every durable step
        and the persister, and this rank's checkpointer, have committed what they were handed. Without
        ``faults.settle_failures`` only wait for a live shadow (a restarted one may still be starting)."""
        if not self.cfg.faults.settle_failures:
            return self._live_shadow() if self.cfg.uses_shadow else None
        self.flush()
        shadow = self._live_shadow() if self.cfg.uses_shadow else None
        timeout_s = self.cfg.faults.recovery_timeout_s
        try:
            handed = None  # the step of the newest image every shard took for the persister
            if shadow is not None:  # it takes each due image as it replays the step
                ray.get([s.image.remote(self.durable_steps(), timeout_s) for s in shadow], timeout=timeout_s + 30)
                statuses = ray.get([s.status.remote() for s in shadow], timeout=60)
                if all(st["last_snapshot_step"] != st["base"]["step"] for st in statuses):
                    handed = min(st["last_snapshot_step"] for st in statuses)
            persister = ray.get_actor(persister_name(self.cfg), namespace=self.cfg.namespace)
            deadline = time.monotonic() + 60  # bounded: a hand-off to a dead persister is skipped
            while True:
                submitted = ray.get(persister.flush.remote(timeout_s), timeout=timeout_s + 30)["last_submitted_step"]
                if handed is None or (submitted or 0) >= handed or time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # the shadow hands the image on after it let go of its lock
        except (ValueError, RayActorError, RayTaskError, GetTimeoutError):
            pass  # a dead shadow or persister settles nothing more: its restart starts from storage
        return shadow

    def _settle_for_worker_failure(self, index: int) -> None:
        """Every rank, before failure ``index`` kills a worker: commit the background checkpoint
        writes (rank 0's), find a live shadow (target ``worker``), then meet at a barrier so the
        failing rank dies only after all that."""
        if not self.cfg.faults.settle_failures or self.run.claimed(marker(index, "worker")):  # off, or fired before
            return
        self.flush()
        if self.cfg.faults.failures[index].target in ("worker", "node") and self.cfg.uses_shadow and self.rank == 0:
            self._live_shadow()
        if self.world > 1:
            self.barrier(f"settle-{index}")

    def _kill_shadow(self, index: int, step: int, worker_how: str | None, shard: int | None = None) -> None:
        """Kill the live shadow (every shard, or only ``shard``) once it is settled
        (``_settle_snapshots``), so the failure always hits a running shadow whose snapshots are
        committed. With ``worker_how`` (target ``both``) the worker failure is announced before the
        kill, so the controller does not restart the shadow until the worker has recovered without it."""
        shadow = self._settle_snapshots()
        if worker_how is not None:
            self._announce_worker_failure(index, step, worker_how, self.world - 1)
        self.run.event("failure", step=step, target="shadow", how="ray.kill", marker=marker(index, "shadow"),
                       found=shadow is not None, **({"shard": shard} if shard is not None else {}))
        for handle in (shadow or []) if shard is None else (shadow or [])[shard:shard + 1]:
            ray.kill(handle, no_restart=True)
        self._claim(index, "shadow-killed")

    def _corrupt_newest_snapshot(self, index: int, step: int) -> None:
        self._settle_snapshots()
        store = snapshot_store(self.cfg)
        infos = store.list()
        shard = infos[-1].manifest["units"][next(iter(infos[-1].manifest["units"]))]["path"] if infos else None
        if shard is not None:
            blob = bytearray(store.storage.get(shard))
            blob[len(blob) // 2] ^= 0x01
            store.storage.put(shard, bytes(blob))
        self.run.event("failure", step=step, target="corrupt", how="flip-byte", marker=marker(index, "corrupt"), shard=shard)

    def _kill_persister(self, index: int, step: int) -> None:
        try:
            persister = ray.get_actor(persister_name(self.cfg), namespace=self.cfg.namespace)
        except ValueError:
            persister = None
        self.run.event("failure", step=step, target="persister", how="ray.kill", marker=marker(index, "persister"),
                       found=persister is not None)
        if persister is not None:
            ray.kill(persister, no_restart=True)

    def _preempt(self, index: int, step: int, failure: FailureSpec) -> None:
        """A preemption notice (``preempt``: rank 0's node; ``preempt-shadow``: shadow shard 0's): the node's
        loss at the deadline is scheduled, then the node drained with it (``workers.preempt``). Nothing
        stops here: what the node holds is saved on the notice, and the node goes at the deadline."""
        assert failure.grace_s is not None
        node: str | None
        if failure.target == "preempt":
            node = ray.get_runtime_context().get_node_id()
        else:
            shadow = self._live_shadow()
            node = ray.get(shadow[0].status.remote(), timeout=120)["node_id"] if shadow else None
        if node is None:
            self.run.event("failure", step=step, target=failure.target, how=failure.how, marker=marker(index, failure.target), found=False)
            return
        # recorded first: with no grace the node (this process with it) ends a moment after the loss is scheduled
        self.run.event("failure", step=step, target=failure.target, how=failure.how, marker=marker(index, failure.target),
                       node_id=node, grace_s=failure.grace_s, deadline_unix_s=time.time() + failure.grace_s + 1.0)
        schedule_node_loss(node, time.time() + failure.grace_s + 1.0)  # drain_node's command takes about a second
        drain_node(node, failure.grace_s, f"raycheck: injected preemption at step {step}")

    def _hold(self, step: int) -> None:
        """The test gate (module docstring): record ``held`` and block this process for good."""
        self.run.event("held", step=step, durable_steps=self.durable_steps())
        threading.Event().wait()

    def _wait_for_claim(self, name: str, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until another rank has claimed the marker ``name``."""
        deadline = time.monotonic() + timeout_s
        while not self.run.claimed(name) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _announce_worker_failure(self, index: int, step: int, how: str | None, rank: int) -> None:
        self.run.event("failure", step=step, target="worker", how=how, rank=rank, marker=marker(index, "worker"),
                       durable_steps=self.durable_steps(), **({"pid": os.getpid()} if rank == self.rank else {}))

    def maybe_fail(self, step: int, writer: StepLogWriter | None = None) -> None:
        """Inject the failures due at ``step`` (may not return). ``writer``: rank 0's step log writer."""
        if step == self.hold_step and self.rank == 0 and self.run.claim("held"):
            self._hold(step)
        for i, f in enumerate(self.cfg.faults.failures):
            if f.step != step:
                continue
            if f.target == "persister" and self.rank == 0 and self._claim(i, "persister"):
                self._kill_persister(i, step)
            if f.target == "storage" and self.rank == 0 and self._claim(i, "storage"):
                self.run.event("failure", step=step, target="storage", how="outage", marker=marker(i, "storage"),
                               seconds=f.outage_s)  # the controller acts
            if f.target in PREEMPT_TARGETS and self.rank == 0 and self._claim(i, f.target):
                self._preempt(i, step, f)
            if f.target == "corrupt" and self.rank == 0 and self._claim(i, "corrupt"):
                self._corrupt_newest_snapshot(i, step)
            if f.target in ("shadow", "both") and self.rank == 0 and self._claim(i, "shadow"):
                self._kill_shadow(i, step, f.how if f.target == "both" else None, f.shard)
            if f.target in ("worker", "both", "node"):
                self._settle_for_worker_failure(i)
            if f.target == "node" and self.rank == 0 and self._claim(i, "worker"):
                self._announce_worker_failure(i, step, "node", self.rank)
                take_down_node()
            if f.target in ("worker", "both") and self.rank == self.world - 1 and self._claim(i, "worker"):
                if f.target == "both":  # die only after rank 0 has killed the shadow
                    self._wait_for_claim(marker(i, "shadow-killed"), timeout_s=300)
                if f.target == "worker":
                    self._announce_worker_failure(i, step, f.how, self.rank)
                if f.how == "raise":
                    raise InjectedWorkerFailure(f"raycheck: injected worker failure at step {step}")
                if f.how == "torn" and writer is not None:
                    writer.write_torn(step)
                if f.how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(1)
