"""The CPU shadow replayer: keeps its own copy of the weights current by replaying the step log.

Source: ZOCheck (arXiv 2026), CPU-shadow checkpointing: the shadow re-executes each logged ZO step
(perturbation round trip and update, ``training.zo.replay_step_``) off the training critical path,
materialises consistent recovery images, and hands them to the snapshot persister.

``ShadowReplayer`` is the plain logic (tested without Ray); ``ShadowActor`` is the thin Ray shell
that runs it on a background thread and serves images through the object store.

Sharded (``JobConfig.shadow_shards`` K > 1): K actors each hold and replay only the contiguous range
of units ``actors.shards.split_units`` gives them (memory and replay work / K), start from their own
units of the newest snapshot, snapshot on an interval grid shared by every shard
(``AlignedSchedule``) and hand their parts to the persister, which commits a step only once every
part of it has arrived (``actors.persister``); a recovery assembles the K images of one step
(``actors.shards.assemble``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import ray
import torch

from actors.log_keeper import KeeperLogSource, RemoteKeeper
from actors.shards import ShardRange, split_units
from orchestrator.cluster import this_node
from policies.interval import SnapshotSchedule
from storage.manifest import layout_of
from storage.snapshots import NoSnapshotError, SnapshotStore
from storage.steplog import StepLogReader, StepRecord
from training.assets import shipped_model
from training.model import layout_sha256, load_model, materialise, model_dir, parameter_layout, read_parameters, trainable_parameters
from training.state import copy_state, load_into, state_sha256
from training.zo import check_dtype, check_generator, dtype_name, replay_step_

log = logging.getLogger(__name__)


class LogSource(Protocol):
    """Where a shadow reads the step log: ``storage.steplog.StepLogReader`` follows a file (tests,
    ``raycheck replay``), ``actors.log_keeper.KeeperLogSource`` the log keeper over Ray (the actor).

    Attributes:
        header: the log's header (model layout, generator).
        next_step: the step of the first record the next ``poll`` returns.
    """

    header: dict
    next_step: int

    def poll(self) -> list[StepRecord]:
        """The records that became durable since the last call (from ``next_step`` on), in order."""

    def seek(self, step: int) -> None:
        """Follow the log from ``step`` on."""


class ShadowReplayer:
    """Replays a step log into ``params`` (in place), one record at a time.

    Args:
        params: ordered parameter tensors holding the state after ``start_step`` steps.
        log: the step log to follow: a ``LogSource``, or the path of a log file.
        start_step: steps already applied to ``params``.
        hash_every: record ``state_sha256`` of ``params`` whenever the step count is a multiple of this (0: never).
        shard: the range of the model ``params`` holds (a shadow shard); None: the whole model.

    Raises:
        ValueError: the log was written for another parameter layout, or (``GeneratorMismatchError``)
            another noise generator, or (``DtypeMismatchError``) another parameter dtype than ``params``'.
    """

    def __init__(self, params: "OrderedDict[str, torch.Tensor]", log: LogSource | str | os.PathLike, start_step: int = 0,
                 hash_every: int = 0, shard: ShardRange | None = None):
        self.params = params
        self.first_index = shard.first_index if shard else 0
        self.reader = StepLogReader(log, start_step) if isinstance(log, (str, os.PathLike)) else log
        self.reader.seek(start_step)
        header = self.reader.header
        check_dtype(header, dtype_name(params), str(log))
        if shard is None:
            matches = header["layout_sha256"] == layout_sha256(parameter_layout(params))
        else:  # a shard: its tensors must be that range of the logged layout
            matches = header.get("layout", [])[shard.first_index:shard.end_index] == parameter_layout(params)
        if not matches:
            raise ValueError(f"{log}: log was written for another model layout ({header.get('model')})")
        check_generator(header, str(log))
        self.step = start_step
        self.hash_every = hash_every
        self.hashes: dict[int, str] = {}
        self.replay_seconds = 0.0
        self.replayed = 0
        self._pending: list[StepRecord] = []

    @property
    def waiting(self) -> int:
        """Records read and not yet replayed."""
        return len(self._pending)

    def poll(self) -> int:
        """Read newly durable records; returns how many are waiting to be replayed."""
        self._pending.extend(self.reader.poll())
        return len(self._pending)

    @property
    def log_end(self) -> int:
        """Steps in the log as of the last poll."""
        return self.reader.next_step

    def replay_one(self) -> bool:
        """Replay the oldest waiting record; False when none waits."""
        if not self._pending:
            return False
        rec = self._pending.pop(0)
        t0 = time.perf_counter()
        replay_step_(self.params, rec.seed, rec.projected_grad, rec.lr, rec.eps, rec.weight_decay, first_index=self.first_index)
        self.replay_seconds += time.perf_counter() - t0
        self.replayed += 1
        self.step = rec.step + 1
        if self.hash_every and self.step % self.hash_every == 0:
            self.hashes[self.step] = state_sha256(self.params)
        return True

    def catch_up(self) -> int:
        """Replay everything durable now; returns the number of steps replayed."""
        self.poll()
        n = 0
        while self.replay_one():
            n += 1
        return n

    def state_dict(self) -> dict:
        """{"step": int, "params": ordered name -> numpy copy}."""
        return {"step": self.step, "params": copy_state(self.params)}

    def load_state_dict(self, state: dict) -> None:
        """Reset to ``state`` (as returned by ``state_dict``) and follow the log from its step."""
        load_into(self.params, state["params"])
        self.reader.seek(state["step"])
        self.step = state["step"]
        self._pending.clear()


class AlignedSchedule(SnapshotSchedule):
    """The shards' schedule: a snapshot is due after ``steps_done`` steps when that is a multiple of
    the interval, so every shard takes its part at the same steps whatever its own history (a
    restarted shard, an interval change seen a step earlier by one shard than by another: at most
    one grid step differs, and the persister drops that incomplete step)."""

    def take_if_due(self, steps_done: int) -> bool:
        if not self.every_steps or steps_done % self.every_steps or steps_done == self.last_step:
            return False
        self.last_step = steps_done
        return True


@dataclass(frozen=True, kw_only=True)
class ShadowSpec:
    """What a shadow actor needs to start: the model, the log (the log keeper's actor name
    ``log_keeper_name``, or else the file ``log_path`` on the shadow's node), where snapshots live and
    how often; ``shard`` of ``shards`` (``actors.shards.split_units``) when the shadow is sharded."""

    model: str
    cache_dir: str
    dtype: str = "float32"
    """The parameters' dtype (``JobConfig.dtype``)."""
    log_path: str = ""
    log_keeper_name: str = ""
    store: SnapshotStore
    persister_name: str | None
    snapshot_every_steps: int
    hash_every: int = 0
    poll_interval_s: float = 0.05
    shard: int = 0
    shards: int = 1
    shipped: dict | None = None
    """The driver's shipped assets (``training.assets.ship``): a model folder's files come from there."""
    layout: list | None = None
    """The step log header's parameter layout (``training.model.parameter_layout``): the initial weights are
    then read from the model's files directly (``read_parameters``); None: the model is loaded."""


class ShadowActor:
    """Ray shell around ``ShadowReplayer``: starts from the newest verified snapshot (else the initial
    weights), replays on a background thread, snapshots on the interval policy, serves images.

    Create with ``ray.remote(ShadowActor).options(num_cpus=0, max_concurrency=4, name=...)``.
    """

    def __init__(self, spec: ShadowSpec) -> None:
        torch.set_num_threads(1)
        self.spec = spec
        self.started_unix_s = time.time()
        self.actor_id = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        files = shipped_model(spec.shipped, spec.model)
        folder = materialise(files, spec.cache_dir) if files is not None else model_dir(spec.model, spec.cache_dir)
        params = read_parameters(folder, spec.layout, spec.dtype) if spec.layout else None
        if params is None:
            params = trainable_parameters(load_model(spec.model, spec.cache_dir, files, spec.dtype))
        layout = layout_of(params)
        self.range = split_units({n: p.numel() for n, p in params.items()}, spec.shards)[spec.shard]
        if spec.shards > 1:  # keep only this shard's tensors: the rest of the model is freed
            params = OrderedDict((n, params[n]) for n in self.range.names(list(params)))
        try:
            info, state, _ = spec.store.load_latest(layout=layout, units=list(self.range.units) if spec.shards > 1 else None)
            load_into(params, state)
            self.base = {"source": "snapshot", "step": info.step}
        except (NoSnapshotError, OSError) as exc:  # OSError: storage unreachable; replay the whole log
            log.warning("shadow starts from the initial weights: %s", exc)
            self.base = {"source": "initial", "step": 0}
        source = KeeperLogSource(RemoteKeeper(spec.log_keeper_name)) if spec.log_keeper_name else spec.log_path
        self.replayer = ShadowReplayer(params, source, self.base["step"], spec.hash_every,
                                       self.range if spec.shards > 1 else None)
        schedule = AlignedSchedule if spec.shards > 1 else SnapshotSchedule
        self.schedule = schedule(every_steps=spec.snapshot_every_steps, last_step=self.base["step"])
        self._requested_step: int | None = None  # snapshot_at
        self.snapshots_sent = 0
        self.error: str | None = None
        self.snapshots_skipped = 0
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="shadow-replay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        polled_s = 0.0
        try:
            while not self._stop:
                if not self.replayer.waiting or time.monotonic() - polled_s >= self.spec.poll_interval_s:
                    self.replayer.poll()  # a call to the log keeper: outside the lock, at most every poll interval while busy
                    polled_s = time.monotonic()
                with self._cond:
                    progressed = self.replayer.replay_one()
                    image = None
                    if progressed and self._due(self.replayer.step):
                        image = (self.replayer.step, copy_state(self.replayer.params))
                    self._cond.notify_all()
                if image:
                    self._send(image)
                if not progressed:
                    time.sleep(self.spec.poll_interval_s)
        except Exception as exc:  # surfaced through status() and image(); never dies silently
            log.exception("shadow replay stopped")
            with self._cond:
                self.error = f"{type(exc).__name__}: {exc}"
                self._cond.notify_all()

    def _due(self, step: int) -> bool:
        """A snapshot is due after ``step`` steps: by the schedule, or requested (``snapshot_at``)."""
        if step == self._requested_step:
            self._requested_step = None
            self.schedule.taken(step)
            return True
        return self.schedule.take_if_due(step)

    def _send(self, image: tuple) -> None:
        """Hand ``image`` to the persister, looked up by name each time so that a restarted persister
        is found; while none is registered (it died and is being restarted) the image is skipped
        and counted: the step log still holds every step, and the next snapshot is due soon."""
        if not self.spec.persister_name:
            return
        try:
            persister = ray.get_actor(self.spec.persister_name)
        except ValueError:
            log.warning("no snapshot persister registered; skipping the snapshot of step %d", image[0])
            self.snapshots_skipped += 1
            return
        if self.spec.shards > 1:
            persister.submit_part.remote(image[0], self.spec.shard, self.spec.shards, image[1])
        else:
            persister.submit.remote(*image)
        self.snapshots_sent += 1

    def snapshot_now(self) -> int:
        """Hand the current state to the persister now (e.g. the final state); returns its step."""
        with self._cond:
            image = (self.replayer.step, copy_state(self.replayer.params))
            self.schedule.taken(self.replayer.step)
        self._send(image)
        return image[0]

    def snapshot_at(self, step: int) -> bool:
        """Hand the state after ``step`` steps to the persister: now if replayed exactly that far, else
        once replay gets there (one request at a time: the newest wins). Every shard is asked for the
        same step, so the parts complete one snapshot. False (nothing taken) when already past it."""
        with self._cond:
            if self.replayer.step > step:
                return False
            if self.replayer.step < step:
                self._requested_step = step
                return True
            image = (step, copy_state(self.replayer.params))
            self.schedule.taken(step)
        self._send(image)
        return True

    def set_interval(self, every_steps: int) -> None:
        """Follow a new snapshot interval (the controller's cost-model plan), in steps: a snapshot is
        due once the steps since the last one reach it (``policies.interval.snapshot_due``)."""
        with self._cond:
            self.schedule.set_interval(every_steps)

    def status(self) -> dict:
        """Step, log end, lag (steps), replay seconds per step, base of this incarnation, error if any,
        and what it holds: ``shard``, ``units``, ``elements``, its Ray ``actor_id``, and where it runs
        (``node_id``, ``node_ip``)."""
        r = self.replayer
        with self._cond:
            return {
                "shard": self.spec.shard,
                "units": self.range.describe(),
                "elements": self.range.elements,
                "actor_id": self.actor_id,
                "step": r.step,
                "log_end": r.log_end,
                "lag_steps": r.log_end - r.step,
                "replayed": r.replayed,
                "replay_seconds_per_step": r.replay_seconds / r.replayed if r.replayed else None,
                "base": self.base,
                "snapshots_sent": self.snapshots_sent,
                "snapshots_skipped": self.snapshots_skipped,
                "snapshot_every_steps": self.schedule.every_steps,
                "last_snapshot_step": self.schedule.last_step,
                "started_unix_s": self.started_unix_s,
                "error": self.error,
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # differs under ATEN_CPU_CAPABILITY
                **this_node(),
            }

    def hashes(self) -> dict[int, str]:
        """state_sha256 recorded at every ``hash_every`` steps."""
        with self._cond:
            return dict(self.replayer.hashes)

    def image(self, min_step: int, timeout_s: float) -> dict:
        """A consistent copy of the state (a shard's: its tensors only) once at least ``min_step``
        steps are replayed.

        Returns ``{"step": int, "state": ordered name -> numpy array}``; Ray puts it in the object
        store, so the caller reads it zero-copy (copy before writing).

        Raises:
            TimeoutError: not caught up within ``timeout_s``.
            RuntimeError: replay stopped on an error (e.g. a gap in the log).
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.replayer.step < min_step and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"shadow at step {self.replayer.step}, {min_step} requested")
                self._cond.wait(min(left, 1.0))
            if self.error is not None:
                raise RuntimeError(f"shadow replay failed: {self.error}")
            return {"step": self.replayer.step, "state": copy_state(self.replayer.params)}

    def state_sha256(self, step: int, timeout_s: float) -> str:
        """The hash of the state (a shard's: of its tensors) after exactly ``step`` steps (waits until
        replayed; not past it)."""
        image = self.image(step, timeout_s)
        if image["step"] != step:
            raise RuntimeError(f"shadow is at step {image['step']}, past {step}")
        return state_sha256(image["state"])

    def stop(self) -> None:
        self._stop = True
        self._thread.join(timeout=10)
