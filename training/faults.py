"""Failure injection inside the training workers, reproducible by step.

Each ``FailureSpec`` fires once per run: before acting, the acting rank writes a marker file (and an
event), so a restarted worker that re-executes the same step does not fail again.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from orchestrator.config import JobConfig
from orchestrator.run_dir import RunDir
from orchestrator.shadow_keeper import find_shadow
from storage.steplog import StepLogWriter, read_records


class FaultInjector:
    """Fires the failures of ``cfg`` that are due at a step, for worker ``rank`` of ``world``.

    The shadow part of a failure is done by rank 0 (``ray.kill``); the worker part by the last rank
    (``torn`` needs rank 0's log writer, so use it with one worker). ``durable_steps`` returns how
    many steps are durable when a worker failure hits (default: the step log's complete records;
    strategies without a step log pass their newest committed checkpoint's step).
    """

    def __init__(self, cfg: JobConfig, run: RunDir, rank: int, world: int, durable_steps: Callable[[], int] | None = None) -> None:
        self.cfg, self.run, self.rank, self.world = cfg, run, rank, world
        self.durable_steps = durable_steps or (lambda: len(read_records(run.step_log)))
        run.markers.mkdir(exist_ok=True)

    def _claim(self, index: int, part: str) -> bool:
        marker = self.run.markers / f"{index}.{part}"
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        os.fsync(fd)
        os.close(fd)
        return True

    def fired(self) -> bool:
        """True once any failure has fired in this run (a start is then a restart)."""
        return any(self.run.markers.iterdir())

    def _kill_shadow(self, index: int, step: int, worker_how: str | None) -> None:
        """Kill the live shadow. If a restarted incarnation is still starting, wait for it (bounded),
        so the failure always hits a running shadow. With ``worker_how`` (target ``both``) the worker
        failure is announced before the kill, so the controller does not restart the shadow until the
        worker has recovered without it."""

        def answers(handle) -> bool:
            try:
                ray.get(handle.status.remote(), timeout=120)
                return True
            except (RayActorError, GetTimeoutError):
                return False

        shadow = find_shadow(self.run, self.cfg.namespace, timeout_s=180, alive=answers)
        if worker_how is not None:
            self._announce_worker_failure(step, worker_how, self.world - 1)
        self.run.event("failure", step=step, target="shadow", how="ray.kill", found=shadow is not None)
        if shadow is not None:
            ray.kill(shadow, no_restart=True)
        self._claim(index, "shadow-killed")

    def _corrupt_newest_snapshot(self, step: int) -> None:
        store = self.cfg.snapshot_store()
        infos = store.list()
        shard = infos[-1].manifest["units"][next(iter(infos[-1].manifest["units"]))]["path"] if infos else None
        if shard is not None:
            blob = bytearray(store.storage.get(shard))
            blob[len(blob) // 2] ^= 0x01
            store.storage.put(shard, bytes(blob))
        self.run.event("failure", step=step, target="corrupt", how="flip-byte", shard=shard)

    def _kill_persister(self, step: int) -> None:
        try:
            persister = ray.get_actor(self.cfg.persister_name, namespace=self.cfg.namespace)
        except ValueError:
            persister = None
        self.run.event("failure", step=step, target="persister", how="ray.kill", found=persister is not None)
        if persister is not None:
            ray.kill(persister, no_restart=True)

    def _wait_for_marker(self, name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not (self.run.markers / name).exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    def _announce_worker_failure(self, step: int, how: str, rank: int) -> None:
        self.run.event("failure", step=step, target="worker", how=how, rank=rank, durable_steps=self.durable_steps())

    def maybe_fail(self, step: int, writer: StepLogWriter | None = None) -> None:
        """Inject the failures due at ``step`` (may not return). ``writer``: rank 0's step log writer."""
        for i, f in enumerate(self.cfg.failures):
            if f.step != step:
                continue
            if f.target == "persister" and self.rank == 0 and self._claim(i, "persister"):
                self._kill_persister(step)
            if f.target == "storage" and self.rank == 0 and self._claim(i, "storage"):
                self.run.event("failure", step=step, target="storage", how="outage", seconds=float(f.how))  # the controller acts
            if f.target == "corrupt" and self.rank == 0 and self._claim(i, "corrupt"):
                self._corrupt_newest_snapshot(step)
            if f.target in ("shadow", "both") and self.rank == 0 and self._claim(i, "shadow"):
                self._kill_shadow(i, step, f.how if f.target == "both" else None)
            if f.target in ("worker", "both") and self.rank == self.world - 1 and self._claim(i, "worker"):
                if f.target == "both":  # die only after rank 0 has killed the shadow
                    self._wait_for_marker(f"{i}.shadow-killed", timeout_s=300)
                if f.target == "worker":
                    self._announce_worker_failure(step, f.how, self.rank)
                if f.how == "raise":
                    raise RuntimeError(f"raycheck: injected worker failure at step {step}")
                if f.how == "torn" and writer is not None:
                    writer.write_torn(step)
                if f.how == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(1)
