"""The CPU shadow replayer: keeps its own copy of the weights current by replaying the step log.

Source: ZOCheck (arXiv 2026), CPU-shadow checkpointing: the shadow re-executes each logged ZO step
(perturbation round trip and update, ``training.zo.replay_step_``) off the training critical path,
materialises consistent recovery images, and hands them to the snapshot persister.

``ShadowReplayer`` replays the log; ``ShadowLoop`` runs it on a background thread, hands recovery
images to the persister on the snapshot schedule and serves images and hashes (both plain, tested
without Ray); ``actors.shadow_actor.ShadowActor`` is the thin Ray shell that builds them from a
``ShadowSpec`` and serves images through the object store.

Sharded (``JobConfig.placement.shadow_shards`` K > 1): K actors each hold and replay only the contiguous range
of units ``actors.shards.split_units`` gives them (memory and replay work / K), start from their own
units of the newest snapshot, snapshot on an interval grid shared by every shard
(``AlignedSchedule``) and hand their parts to the persister, which commits a step only once every
part of it has arrived (``actors.persister``); a recovery assembles the K images of one step
(``actors.shards.assemble``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from raycheck.actors.shards import ShardRange
from raycheck.policies.interval import SnapshotSchedule
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.steplog import StepLogReader, StepRecord, header_tag
from raycheck.training.model import layout_sha256, parameter_layout
from raycheck.training.state import copy_state, load_into, state_sha256
from raycheck.training.zo import check_dtype, check_generator, check_records, dtype_name, replay_step_

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
        self.run_seed, self.source, self.tag = header.get("run_seed"), str(log), header_tag(header)
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
        """Replay the oldest waiting record; False when none waits.

        Raises:
            storage.steplog.StepLogCorruptError: the record's seed is not the step seed of the header's
                ``run_seed`` (a record of another run: ``training.zo.check_records``); nothing is replayed.
        """
        if not self._pending:
            return False
        rec = self._pending.pop(0)
        if isinstance(self.run_seed, int):  # a header without one (a hand-made log) names no seed to check
            check_records([rec], self.run_seed, self.source, trajectory=self.tag)
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


class ImageSink(Protocol):
    """Where a shadow hands its recovery images: ``actors.persister.SnapshotPersister`` (tests), or
    ``actors.shadow_actor.NamedPersister``, the persister actor looked up by name (the actor).
    ``state`` / ``part``: ordered name -> numpy array (a shard's part: its tensors only), not touched
    by the shadow afterwards.

    Both methods raise ``LookupError`` when the sink cannot take an image now (no persister is
    registered): the shadow skips that image and counts it.
    """

    def submit(self, step: int, state: dict[str, np.ndarray]) -> None:
        """Take the whole model's state after ``step`` steps."""

    def submit_part(self, step: int, shard: int, shards: int, part: dict[str, np.ndarray]) -> None:
        """Take shard ``shard`` of ``shards``'s part of the state after ``step`` steps."""


class ShadowLoop:
    """The shadow's replay loop: replays ``replayer``'s log one record at a time, hands an image to
    ``sink`` whenever a snapshot is due (the interval schedule, or a step asked for by
    ``snapshot_at``), and serves images, hashes and its status. Plain logic, tested without Ray.

    ``start`` runs the loop on a background thread until ``stop``; ``run_once`` is one round of it. An
    exception in the loop stops it; it is surfaced by ``status()["error"]`` and by ``image``.

    Args:
        replayer: the replay state at its start step; that step counts as the last snapshot's (a
            restore point is durable by construction).
        sink: where images go (``ImageSink``: ``submit`` for the whole model, ``submit_part`` for a
            shard); None: nowhere, and nothing is counted.
        every_steps: the snapshot interval in steps (0: none by schedule; ``set_interval`` changes it).
        shard: this shadow's shard number, 0-based.
        shards: the shard count K; K > 1: the schedule is ``AlignedSchedule`` and images go to ``submit_part``.
        poll_interval_s: seconds between log polls while records wait to be replayed, and the wait
            before the next poll when none did.
        clock: monotonic seconds (``time.monotonic``), for the poll interval and ``image``'s timeout.

    Raises:
        ValueError: ``every_steps`` < 0.
    """

    def __init__(self, replayer: ShadowReplayer, sink: ImageSink | None, every_steps: int, *, shard: int = 0,
                 shards: int = 1, poll_interval_s: float = 0.05, clock: Callable[[], float] = time.monotonic) -> None:
        self.replayer = replayer
        self.sink = sink
        self.shard, self.shards = shard, shards
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        schedule = AlignedSchedule if shards > 1 else SnapshotSchedule
        self.schedule = schedule(every_steps=every_steps, last_step=replayer.step)
        self._requested_step: int | None = None  # snapshot_at
        self._polled_s = -math.inf
        self.snapshots_sent = 0
        self.snapshots_skipped = 0
        self.error: str | None = None
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the loop on a background thread (``run_once`` until ``stop``)."""
        self._thread = threading.Thread(target=self._run, name="shadow-replay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background thread (waits up to 10 s for its current round)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self.run_once():
                    self._stopping.wait(self.poll_interval_s)
        except Exception as exc:  # surfaced through status() and image(); never dies silently
            log.exception("shadow replay stopped")
            with self._cond:
                self.error = f"{type(exc).__name__}: {exc}"
                self._cond.notify_all()

    def run_once(self) -> bool:
        """One round of the loop: poll the log (when nothing waits, else at most every poll interval),
        replay the oldest waiting record, and hand its image to the sink if a snapshot is due after it.
        Returns whether a record was replayed.

        Raises:
            what the log source or the replay raises (e.g. ``StepLogGapError``).
        """
        if not self.replayer.waiting or self.clock() - self._polled_s >= self.poll_interval_s:
            self.replayer.poll()  # e.g. a call to the log keeper: outside the lock
            self._polled_s = self.clock()
        with self._cond:
            progressed = self.replayer.replay_one()
            image = None
            if progressed and self._due(self.replayer.step):
                image = (self.replayer.step, copy_state(self.replayer.params))
            self._cond.notify_all()
        if image:
            self._send(*image)
        return progressed

    def _due(self, step: int) -> bool:
        """A snapshot is due after ``step`` steps: by the schedule, or requested (``snapshot_at``)."""
        if step == self._requested_step:
            self._requested_step = None
            self.schedule.taken(step)
            return True
        return self.schedule.take_if_due(step)

    def _send(self, step: int, state: dict[str, np.ndarray]) -> None:
        """Hand the image of ``step`` to the sink; one it cannot take now (a persister that died and
        is being restarted) is skipped and counted: the step log still holds every step, and the
        next snapshot is due soon."""
        if self.sink is None:
            return
        try:
            if self.shards > 1:
                self.sink.submit_part(step, self.shard, self.shards, state)
            else:
                self.sink.submit(step, state)
        except LookupError as exc:
            log.warning("skipping the snapshot of step %d: %s", step, exc)
            self.snapshots_skipped += 1
            return
        self.snapshots_sent += 1

    def snapshot_now(self) -> int:
        """Hand the current state to the sink now (e.g. the final state); returns its step."""
        with self._cond:
            step, state = self.replayer.step, copy_state(self.replayer.params)
            self.schedule.taken(step)
        self._send(step, state)
        return step

    def snapshot_at(self, step: int) -> bool:
        """Hand the state after ``step`` steps to the sink: now if replayed exactly that far, else
        once replay gets there (one request at a time: the newest wins). Every shard is asked for the
        same step, so the parts complete one snapshot. False (nothing taken) when already past it."""
        with self._cond:
            if self.replayer.step > step:
                return False
            if self.replayer.step < step:
                self._requested_step = step
                return True
            state = copy_state(self.replayer.params)
            self.schedule.taken(step)
        self._send(step, state)
        return True

    def set_interval(self, every_steps: int) -> None:
        """Follow a new snapshot interval (the controller's cost-model plan), in steps: a snapshot is
        due once the steps since the last one reach it (``policies.interval.snapshot_due``; with
        shards, at the multiples of it: ``AlignedSchedule``).

        Raises:
            ValueError: ``every_steps`` < 0.
        """
        with self._cond:
            self.schedule.set_interval(every_steps)

    def status(self) -> dict:
        """``shard``; ``step`` (replayed), ``log_end`` (steps in the log as of the last poll),
        ``lag_steps``, ``replayed`` (records replayed by this loop), ``replay_seconds_per_step`` (None
        before the first), ``snapshots_sent``, ``snapshots_skipped``, ``snapshot_every_steps``,
        ``last_snapshot_step`` and ``error`` (None while the loop runs or has not failed)."""
        r = self.replayer
        with self._cond:
            return {
                "shard": self.shard,
                "step": r.step,
                "log_end": r.log_end,
                "lag_steps": r.log_end - r.step,
                "replayed": r.replayed,
                "replay_seconds_per_step": r.replay_seconds / r.replayed if r.replayed else None,
                "snapshots_sent": self.snapshots_sent,
                "snapshots_skipped": self.snapshots_skipped,
                "snapshot_every_steps": self.schedule.every_steps,
                "last_snapshot_step": self.schedule.last_step,
                "error": self.error,
            }

    def hashes(self) -> dict[int, str]:
        """step -> ``state_sha256`` recorded at every ``hash_every`` steps (the replayer's setting)."""
        with self._cond:
            return dict(self.replayer.hashes)

    def image(self, min_step: int, timeout_s: float) -> dict:
        """A consistent copy of the state (a shard's: its tensors only) once at least ``min_step``
        steps are replayed.

        Returns ``{"step": int, "state": ordered name -> numpy array}``; through Ray it is put in the
        object store, so the caller reads it zero-copy (copy before writing).

        Raises:
            TimeoutError: not caught up within ``timeout_s`` seconds.
            RuntimeError: the loop stopped on an error (e.g. a gap in the log).
        """
        with self._cond:
            deadline = self.clock() + timeout_s
            while self.replayer.step < min_step and self.error is None:
                left = deadline - self.clock()
                if left <= 0:
                    raise TimeoutError(f"shadow at step {self.replayer.step}, {min_step} requested")
                self._cond.wait(min(left, 1.0))
            if self.error is not None:
                raise RuntimeError(f"shadow replay failed: {self.error}")
            return {"step": self.replayer.step, "state": copy_state(self.replayer.params)}

    def state_sha256(self, step: int, timeout_s: float) -> str:
        """The ``state_sha256`` of the state (a shard's: of its tensors) after exactly ``step`` steps
        (waits until replayed, as ``image``).

        Raises:
            RuntimeError: already past ``step``; and what ``image`` raises.
        """
        image = self.image(step, timeout_s)
        if image["step"] != step:
            raise RuntimeError(f"shadow is at step {image['step']}, past {step}")
        return state_sha256(image["state"])


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
    threads: int = 1
    """Torch threads of the actor, which its fused replay splits large tensors over (``JobConfig.placement.shadow_threads``)."""
    shipped: dict | None = None
    """The driver's shipped assets (``training.assets.ship``): a model folder's files come from there."""
    layout: list | None = None
    """The step log header's parameter layout (``training.model.parameter_layout``): the initial weights are
    then read from the model's files directly (``read_parameters``); None: the model is loaded."""
