"""Checkpoints for YOUR first-order training loop: your Ray Train ``train_loop_per_worker``, your
``torch.nn.Module``, your loss and batches, your ``torch.optim`` optimizer. raycheck is the library
the loop calls (``from raycheck.workers.own_loop import FirstOrderCheckpoints, load_checkpoint``)::

    ckpt = FirstOrderCheckpoints(model, optimizer, strategy="layerwise", every_steps=5)
    start = ckpt.restore()              # newest committed state into model AND optimizer; 0: none
    for step in range(start, steps):
        loss = loss_fn(model, batch_of(step)); loss.backward(); optimizer.step(); optimizer.zero_grad()
        ckpt.after_step(step + 1)       # the strategy's checkpoint, written off the training thread
    ckpt.close()                        # waits for the writes, reports the newest one to Ray Train

What is saved is ``training.optim_state.ModelOptimizerState``'s view: the parameters, each one's
optimizer tensors (``optim.<slot>.<parameter>``, in that parameter's unit) and the parameter groups'
numeric hyper-parameters (``param_groups.<i>.lr``, ...). Strategies (``STRATEGIES``):

* ``full-sync``, ``full-async`` (``training.checkpointing.FullCheckpointer``);
* ``layerwise`` (``training.layerwise.LayerwiseCheckpointer``: composites of units from different steps,
  each with its own optimizer state; exact with threshold 0);
* ``differential`` (``training.differential.DiffCheckpointer``, LowDiff): a full checkpoint every
  ``differential.full_every_steps`` steps and, between them, each step's record: the gradients your
  ``optimizer.step()`` consumed and its groups' hyper-parameters (``training.optim_steps``, taken by a
  step pre-hook). ``restore`` loads the newest full checkpoint and replays the committed records after
  it through your optimizer: bitwise the steps that ran. A full checkpoint of the initial state is
  written at the first ``restore`` that finds none, so no replay ever starts from a model built anew;
* ``overlapped`` (``training.overlapped.OverlappedCheckpointer``, GoCkpt): each snapshot staged in
  ``overlapped.chunks`` chunks over as many steps, the earlier chunks caught up by the later steps'
  records through a new optimizer of your optimizer's class (``OptimizerSteps.catch_up_``).

``differential`` and ``overlapped`` ask that each step's gradients be new tensors (torch's
``zero_grad(set_to_none=True)`` default) and that ``after_step`` follow every ``optimizer.step()``.

Ray Train: every rank restores (the state is read from storage by each; rank 0 picks the snapshot and
the others load the same one), rank 0 writes. Every ``report_every_steps`` steps (default: the
checkpoint interval) and at ``close`` every rank calls ``ray.train.report`` (lockstep, as Ray Train v2
requires), and rank 0 attaches the newest committed snapshot not reported yet as a pointer checkpoint
(``workers.train_reports``: a folder named as the snapshot holding its URI; the snapshot's bytes are not
copied), so the storage may be anywhere every rank reaches. ``Result.checkpoint`` of a finished run is
then the newest committed state and ``load_checkpoint(result.checkpoint, model, optimizer)`` loads it.
``ray.train.get_checkpoint()`` in a restarted worker is the newest reported snapshot; ``restore`` loads the
newest committed one, never older than it (asynchronous writes commit between reports).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from raycheck.job.config import DifferentialConfig, OverlappedConfig
from raycheck.policies.layerwise import LayerwiseConfig
from raycheck.policies.strategies import STEP_LOG, RunStrategy
from raycheck.storage.backend import Storage
from raycheck.storage.diffs import DiffStore, rank_prefix
from raycheck.storage.manifest import RunIdentity, folder_step, layout_sha256, manifest_layout
from raycheck.storage.dcp_store import ShardedStore, global_layout
from raycheck.storage.snapshots import NoSnapshotError, SnapshotCorruptError, SnapshotInfo, SnapshotStore, unit_steps
from raycheck.storage.tensor_files import to_tensor
from raycheck.storage.units import GROUP_PREFIX, OPTIMIZER_PREFIX
from raycheck.training.checkpointing import FullCheckpointer
from raycheck.training.differential import DiffCheckpointer
from raycheck.training.layerwise import LayerwiseCheckpointer
from raycheck.training.optim_state import ModelOptimizerState, StateMismatchError, set_group_values, unwrap
from raycheck.training.optim_steps import OptimizerSteps, clone_optimizer
from raycheck.training.overlapped import OverlappedCheckpointer
from raycheck.training.sharded import (ShardedCheckpointer, ShardedDiffCheckpointer, ShardedLayerwiseCheckpointer,
                                      ShardedOverlappedCheckpointer, ShardedWriter, checkpoint_group)
from raycheck.workers.preempt import PreemptionNotices, save_before_deadline
from raycheck.storage.pointers import committed_snapshot
from raycheck.workers.train_reports import TrainReports, ray_train_context

log = logging.getLogger(__name__)

OwnCheckpointer = FullCheckpointer | LayerwiseCheckpointer | DiffCheckpointer | OverlappedCheckpointer
"""Rank 0's checkpointer, by strategy (FSDP2: ``training.sharded``'s sharded ones, on every rank)."""

STRATEGIES = tuple(s.value for s in RunStrategy if s not in STEP_LOG)
"""The strategies a user's loop can checkpoint with (all of ``raycheck run``'s first-order ones)."""


class FirstOrderCheckpoints:
    """Checkpoints of ``model`` + ``optimizer`` from a user's own training loop (see the module docstring).

    Args:
        model: your ``torch.nn.Module`` (a DDP wrapper is unwrapped: the names are the bare model's).
        optimizer: your ``torch.optim`` optimizer over ``model``'s parameters; its per-parameter state is
            created now if missing (``training.optim_state.materialise_state``).
        storage: where snapshots go: a local folder, ``file://``, ``s3://bucket/prefix``. Default in a
            Ray Train worker: ``<Ray Train experiment dir>/raycheck`` (in a bucket when Ray Train's
            ``storage_path`` is one: ``s3://...``); required elsewhere. Every rank must reach it (a shared
            filesystem or a bucket) to restore. Or a ``SnapshotStore`` with a run
            identity whose writer epoch is claimed already (``raycheck run``'s, ``job.stores.snapshot_store``):
            its identity and retention are used (``run_id``, ``settings`` and ``keep`` are not).
        strategy: ``full-sync``, ``full-async``, ``layerwise``, ``differential`` or ``overlapped``
            (``STRATEGIES``; the module docstring).
        every_steps: steps between checkpoints (>= 1; ``differential``: between reports only, its
            full checkpoints follow ``differential.full_every_steps``).
        run_id: the run the snapshots belong to (a restore takes only this run's). Default: the Ray
            Train experiment name, else ``"own-loop"``.
        settings: what fixes your trajectory (lr, seed, batch size, ...; JSON-able): hashed into the run
            identity, so a snapshot of other settings is skipped, never loaded.
        layerwise: the layer-wise rule (threshold, staleness bound, bytes per check); default
            ``LayerwiseConfig()`` (threshold 1e-3: approximate; threshold 0: every changed unit is
            rewritten at each check, so a restore is exact).
        differential: ``differential``'s full-checkpoint interval, records per object and top-k
            (0: exact records); default ``DifferentialConfig()``.
        overlapped: ``overlapped``'s chunks; default ``OverlappedConfig()``.
        keep: committed snapshots kept (>= 1; older ones deleted by raycheck, shards a kept composite
            references excepted).
        report: call ``ray.train.report`` (default: True in a Ray Train worker).
        report_every_steps: steps between reports (default ``every_steps``); every rank reports at the
            same steps.
        storage_options: the storage's options (``storage.backend.Storage``'s, e.g. ``endpoint_url`` of an
            S3-compatible server; credentials come from the environment).
        preemption: act on preemption notices (default: in a Ray Train worker): every rank asks after each
            step (``workers.preempt.PreemptionNotices``, a collective); on a notice rank 0 commits the state
            of the steps done now (``save_now``, before the deadline) and ``after_step`` does not return:
            the workers wait for Ray Train to restart the group on the nodes left, which restores that
            state and redoes no step (``workers.preempt.save_before_deadline``).
        events: receives ``(kind, fields)`` of what happened on a notice (``preemption_saved`` or
            ``preemption_unsaved``, rank 0's); default: a log line.
        reproducible_init: the model and optimizer passed in hold the run's initial state in every
            incarnation (pretrained weights, a seeded initialisation): ``differential`` then replays its
            records from step 0 when no full checkpoint exists, and writes none of the initial state.

    Raises:
        ValueError: an unknown strategy, ``every_steps`` or ``keep`` < 1, no ``storage`` outside Ray Train,
            ``differential`` with a parameter that is not float32 (its records are float32 gradients).
        training.optim_state.UnsupportedOptimizerError: an optimizer whose state cannot be created up front;
            ``overlapped`` with one that cannot be rebuilt from its parameter groups.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, storage: str | SnapshotStore | None = None, *,
                 strategy: str = "layerwise", every_steps: int = 10, run_id: str | None = None,
                 settings: Mapping[str, Any] | None = None, layerwise: LayerwiseConfig | None = None,
                 differential: DifferentialConfig | None = None, overlapped: OverlappedConfig | None = None, keep: int = 3,
                 report: bool | None = None, report_every_steps: int | None = None,
                 storage_options: Mapping[str, Any] | None = None, preemption: bool | None = None,
                 events: Callable[[str, dict[str, Any]], None] | None = None, reproducible_init: bool = False) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
        for name, value in (("every_steps", every_steps), ("keep", keep), ("report_every_steps", report_every_steps)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self._ctx = ray_train_context()
        if storage is None:
            if self._ctx is None:
                raise ValueError("storage is required outside a Ray Train worker (a folder or s3:// URI)")
            sc = self._ctx.get_storage()
            kind = getattr(sc.storage_filesystem, "type_name", "local")  # pyarrow's: "local", "s3", "gcs", ...
            storage = f"{'' if kind == 'local' else kind + '://'}{sc.experiment_fs_path}/raycheck"
        self.storage_uri = storage.storage.url() if isinstance(storage, SnapshotStore) else storage
        self.strategy, self.every_steps, self.reproducible_init = strategy, every_steps, reproducible_init
        self.rank = self._ctx.get_world_rank() if self._ctx is not None else (
            torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        self.world = self._ctx.get_world_size() if self._ctx is not None else (
            torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        self._notices = PreemptionNotices(self.rank) if (self._ctx is not None if preemption is None else preemption) else None
        self._events = events or (lambda kind, fields: log.warning("%s: %s", kind, fields))
        self.report_every_steps = report_every_steps or every_steps
        self.state = ModelOptimizerState(model, optimizer)
        self.differential = differential or DifferentialConfig()
        if strategy == RunStrategy.DIFFERENTIAL:
            odd = next((n for n, p in self.state.named.items() if p.dtype != torch.float32), None)
            if odd is not None:
                raise ValueError(f"strategy differential records float32 gradients; parameter {odd!r} is "
                                 f"{self.state.named[odd].dtype}: use another strategy")
        if strategy == RunStrategy.OVERLAPPED:
            clone_optimizer(optimizer)  # refuses, now, an optimizer the catch-up could not rebuild
        self.group: torch.distributed.ProcessGroup | None = None
        """FSDP2 (DTensor parameters): every rank's checkpoint collectives' gloo group; None otherwise."""
        if any(isinstance(p, DTensor) for p in self.state.named.values()):
            if isinstance(storage, SnapshotStore) and not isinstance(storage, ShardedStore):
                raise ValueError("FSDP2 (DTensor parameters) writes sharded checkpoints, every rank its rows: give storage as a "
                                 "path, URI or ShardedStore, not a SnapshotStore")
            self.group = checkpoint_group()
        elif isinstance(storage, ShardedStore):
            raise ValueError("a ShardedStore holds FSDP2 checkpoints: this model's parameters are not DTensors (not sharded)")
        if isinstance(storage, SnapshotStore):
            if storage.identity is None:
                raise ValueError("a SnapshotStore given as storage needs a run identity")
            self.store, claim = storage, False
        else:
            run_id = run_id or (self._ctx.get_experiment_name() if self._ctx is not None else "own-loop")
            trajectory = hashlib.sha256(json.dumps(dict(settings or {}), sort_keys=True, default=str).encode()).hexdigest()
            kind = SnapshotStore if self.group is None else ShardedStore
            self.store, claim = kind(Storage(storage, **dict(storage_options or {})), keep_last=keep,
                                     identity=RunIdentity(run_id, trajectory)), True
        self.diffs = DiffStore(self.store.storage, identity=self.store.identity, prefix=rank_prefix(self.rank, self.world)
                               if self.group is not None else "diffs") if strategy == RunStrategy.DIFFERENTIAL else None
        """``differential``'s records (FSDP2: this rank's rows, in a prefix of its own)."""
        config = {"strategy": strategy, "optimizer": type(optimizer).__name__, "settings": dict(settings or {})}
        self.steps: OptimizerSteps | None = None
        """The optimizer's step records (``differential`` and ``overlapped``; every rank: a restore replays)."""
        if strategy in (RunStrategy.DIFFERENTIAL, RunStrategy.OVERLAPPED):
            self.steps = OptimizerSteps(self.state, record=self.rank == 0 or self.group is not None)  # FSDP2: every rank's rows
        self.checkpointer: OwnCheckpointer | None = None
        if self.rank == 0 and claim:
            self.store.claim_epoch()  # fences the writers of an earlier incarnation of this run
        if self.rank == 0 or self.group is not None:  # FSDP2: every rank writes its rows
            self.checkpointer = self._checkpointer(layerwise or LayerwiseConfig(), overlapped or OverlappedConfig(), config)
        self.restored: dict[str, Any] = {"step": 0, "folder": None}
        """What ``restore`` loaded: ``step`` (the steps done), ``folder`` (None: nothing), ``source``
        (``storage``, or ``initial``: nothing loaded), ``base_step`` (the loaded snapshot's step),
        ``replayed_steps`` (``differential``'s records replayed after it; ``exact``: all were exact),
        ``seconds``, ``load_seconds``, ``replay_seconds``, ``restore_began_unix_s``,
        ``state_loaded_unix_s``, ``skipped`` (newer snapshots that did not load, or why a replay
        stopped), ``ray_checkpoint`` (``ray.train.get_checkpoint()``'s path, or None), ``unit_steps``
        (unit -> the step its tensors belong to: a composite's)."""
        self.reports = TrainReports(self.store, self.rank) if (self._ctx is not None if report is None else report) else None
        """Rank 0 attaches the newest committed snapshot to the reports (``workers.train_reports``)."""
        self._last_steps_done = 0
        self.closed = False

    def _checkpointer(self, layerwise: LayerwiseConfig, overlapped: OverlappedConfig, config: dict[str, Any]) -> OwnCheckpointer:
        """Rank 0's checkpointer for the strategy (FSDP2: every rank's)."""
        if self.group is not None:
            store, config = cast(ShardedStore, self.store), {**config, "fsdp2": True}
            if self.strategy == RunStrategy.LAYERWISE:
                return ShardedLayerwiseCheckpointer(store, self.state.view(), self.group, self.every_steps, layerwise, config)
            d = self.differential
            if self.strategy == RunStrategy.DIFFERENTIAL:
                assert self.diffs is not None and self.steps is not None
                return ShardedDiffCheckpointer(store, self.diffs, self.state.view(), self.group, self.steps.applied, d.full_every_steps,
                                               d.batch_steps, d.topk, config)
            if self.strategy == RunStrategy.OVERLAPPED:
                assert self.steps is not None
                return ShardedOverlappedCheckpointer(store, self.state.view(), self.group, self.every_steps, overlapped.chunks,
                                                     self.steps.catch_up_, self.steps.applied, config)
            return ShardedCheckpointer(ShardedWriter(store, self.state.view(), self.group), self.every_steps,
                                       self.strategy == RunStrategy.FULL_ASYNC, config)
        if self.strategy == RunStrategy.LAYERWISE:
            return LayerwiseCheckpointer(self.store, self.every_steps, layerwise, config)
        if self.strategy == RunStrategy.DIFFERENTIAL:
            assert self.diffs is not None and self.steps is not None
            d = self.differential
            return DiffCheckpointer(self.store, self.diffs, self.steps.applied, d.full_every_steps, d.batch_steps, d.topk, config)
        if self.strategy == RunStrategy.OVERLAPPED:
            assert self.steps is not None
            return OverlappedCheckpointer(self.store, self.every_steps, overlapped.chunks, self.steps.catch_up_,
                                          self.steps.applied, config)
        return FullCheckpointer(self.store, self.every_steps, self.strategy == RunStrategy.FULL_ASYNC, config)

    # -- restore ----------------------------------------------------------------------------------
    def _own(self) -> list[SnapshotInfo]:
        """This run's committed snapshots and the merge results it may start from, oldest first."""
        return self.store.list()

    def restore(self) -> int:
        """Load the newest committed snapshot of this run that verifies into the model and the optimizer
        (parameters, per-parameter state, parameter groups' hyper-parameters), in place, bitwise as
        saved; with several ranks, every rank loads the snapshot rank 0 chose. Returns its step (the
        steps done: the loop goes on with ``range(start, steps)``), 0 when there is none.

        Raises:
            training.optim_state.StateMismatchError: the newest snapshot's tensors differ from this model's
                and optimizer's (names, shapes, dtypes; the first one is named); nothing was loaded.
            storage.snapshots.NoSnapshotError: the run has committed snapshots and none loads (each fails
                verification): starting over would discard their steps; nothing is loaded or deleted.
        """
        t0, began_unix_s = time.perf_counter(), time.time()
        ray_ckpt = None
        if self._ctx is not None:
            import ray.train

            ray_ckpt = ray.train.get_checkpoint()
        chosen = self._load_newest()
        t1 = time.perf_counter()
        self.restored.update(base_step=chosen.step if chosen is not None else 0, source="storage" if chosen is not None else "initial",
                             replayed_steps=0, load_seconds=t1 - t0, restore_began_unix_s=began_unix_s,
                             state_loaded_unix_s=time.time())
        if chosen is not None:
            if isinstance(self.checkpointer, LayerwiseCheckpointer):
                self.checkpointer.resume(chosen, self.state.view())
            self.restored.update(step=chosen.step, folder=chosen.folder,
                                 unit_steps=unit_steps(chosen))
        if self.steps is not None and self.diffs is not None:
            self._replay_records(chosen)
        self._last_steps_done = int(self.restored["step"])
        self.restored.update(seconds=time.perf_counter() - t0, replay_seconds=time.perf_counter() - t1,
                             ray_checkpoint=ray_ckpt.path if ray_ckpt is not None else None)
        if ray_ckpt is not None:
            ray_step = folder_step(os.path.basename(ray_ckpt.path.rstrip("/")))
            if ray_step > self.restored["step"]:
                log.warning("restored step %d, older than Ray Train's latest reported checkpoint %s (it did not verify)",
                            self.restored["step"], ray_ckpt.path)
        return int(self.restored["step"])

    def _load_newest(self) -> SnapshotInfo | None:
        """Load the newest snapshot that verifies (rank 0's choice on every rank) into the model and the
        optimizer; returns it (None: none; ``restored["skipped"]`` names the ones that did not verify)."""
        if self.group is not None:
            return self._load_sharded()
        chosen, state, refusal = None, None, None
        if self.rank == 0:
            own = self._own()
            try:
                if own:  # refuse another model's or optimizer's state before reading any shard
                    self.state.check(manifest_layout(own[-1].manifest), f"snapshot {own[-1].folder} in {self.storage_uri}")
                skipped: list[str] = []
                for info in reversed(own):  # newest first; one that fails verification is skipped
                    try:
                        chosen, state = info, self.store.load(info)
                        break
                    except SnapshotCorruptError as exc:
                        skipped.append(str(exc))
                self.restored["skipped"] = skipped
                _refuse_to_start_over(own, chosen, skipped, self.storage_uri)
            except (StateMismatchError, NoSnapshotError) as exc:
                refusal = exc
        if self.world > 1 and torch.distributed.is_initialized():  # every rank loads rank 0's choice, or raises its refusal
            box: list[Any] = [chosen.folder if chosen is not None else None, refusal]
            torch.distributed.broadcast_object_list(box, src=0)
            folder, refusal = box
            if self.rank != 0 and folder is not None:
                chosen = next(i for i in self._own() if i.folder == folder)
                state = self.store.load(chosen)
        if refusal is not None:
            raise refusal
        if chosen is not None and state is not None:
            self.state.load(state, f"snapshot {chosen.folder}")
        return chosen

    def _load_sharded(self) -> SnapshotInfo | None:
        """FSDP2: every rank loads its rows of the newest sharded snapshot that verifies (a collective,
        ``storage.dcp_store.ShardedStore.restore``), then the parameter groups' hyper-parameters."""
        store = cast(ShardedStore, self.store)
        view = self.state.view(host=False)  # live, where the tensors live: DCP loads into them
        own = store.list()
        if own and own[-1].manifest["layout_sha256"] != layout_sha256(global_layout(view)):
            raise StateMismatchError(f"sharded snapshot {own[-1].folder} in {self.storage_uri} holds another model's or "
                                     "optimizer's tensors (names, shapes or dtypes differ); nothing was loaded")
        try:
            chosen, self.restored["skipped"] = store.restore(view, self.group)
        except NoSnapshotError as exc:
            self.restored["skipped"] = [str(exc)]
            _refuse_to_start_over(own, None, [str(exc)], self.storage_uri)
            return None
        for i, group in enumerate(self.state.optimizer.param_groups):
            set_group_values(group, i, view)
        self.restored["saved_world_size"] = chosen.manifest["world_size"]
        return chosen

    def _replay_records(self, chosen: SnapshotInfo | None) -> None:
        """``differential``: replay the committed records after the restored full checkpoint through the
        optimizer (rank 0 as far as they verify; every other rank the same steps), then count the full
        checkpoints from it. With no full checkpoint, records are replayed from step 0 only with
        ``reproducible_init``; otherwise none is (the model may not be the one the records started
        from) and the initial state is written as a full checkpoint instead. FSDP2: every rank replays its
        own rows (``_replay_rows``)."""
        assert self.steps is not None and self.diffs is not None
        base = chosen.step if chosen is not None else 0
        box = [base]
        if self.group is not None:
            box = [self._replay_rows(base) if chosen is not None or self.reproducible_init else base]
        elif self.rank == 0 and (chosen is not None or self.reproducible_init):
            replay = self.diffs.replay(base, self.steps.replay)
            box = [replay.end_step]
            self.restored["exact"] = replay.exact
            if replay.stopped:
                self.restored["skipped"] = [*self.restored.get("skipped", []), replay.stopped]
        if self.group is None and self.world > 1 and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(box, src=0)
            if self.rank != 0 and box[0] > base:
                self.diffs.replay(base, self.steps.replay, until=box[0])
        if isinstance(self.checkpointer, DiffCheckpointer):
            self.checkpointer.resume(base)
            if chosen is None and not self.reproducible_init:
                self.checkpointer.full_now(0, self.state.view)
        self.restored.update(step=box[0], replayed_steps=box[0] - base)

    def _replay_rows(self, base: int) -> int:
        """FSDP2 ``differential``: every rank verifies its own records from step ``base`` (applying none),
        the ranks take the step all of them reach, and each replays its rows up to it (records of
        another world size are under other prefixes: none, the full checkpoint is the restored state).
        Returns that step."""
        assert self.steps is not None and self.diffs is not None and self.group is not None
        verified = self.diffs.replay(base, lambda record: None)  # reads and verifies each batch, applies nothing
        ends = [base] * self.world  # all_gather_object fills each
        torch.distributed.all_gather_object(ends, verified.end_step, group=self.group)
        if verified.stopped:
            self.restored["skipped"] = [*self.restored.get("skipped", []), verified.stopped]
        end = min(ends)
        if end > base:
            self.restored["exact"] = self.diffs.replay(base, self.steps.replay, until=end).exact
        return end

    # -- the loop ---------------------------------------------------------------------------------
    def after_step(self, steps_done: int, metrics: Mapping[str, Any] | None = None) -> float:
        """Call after every optimizer step on every rank, ``steps_done`` the steps done so far (>= 1).
        Rank 0 takes the strategy's checkpoint when due (full-sync writes it now; full-async and
        layerwise stage a copy and write it on a background thread). Every ``report_every_steps`` steps
        every rank calls ``ray.train.report`` with ``metrics`` (plain numbers; rank 0's are the ones Ray
        keeps) plus ``step`` and ``checkpoint_step``, rank 0 attaching the newest committed snapshot not
        reported yet. Returns the seconds this call blocked the loop (checkpoint and report).

        Raises:
            RuntimeError: called after ``close``; ``differential`` / ``overlapped``: no ``optimizer.step()``
                since the last call, or its gradients were written in place (``zero_grad(set_to_none=False)``).
            ValueError: ``steps_done`` is not one more than the last call's (or than ``restore``'s step);
                ``differential``: a step's record holds other parameters than the earlier ones'.
            storage.backend.StorageError: a full-state write failed (``FullCheckpointer``).
        """
        if self.closed:
            raise RuntimeError("after_step after close()")
        if steps_done != self._last_steps_done + 1:
            raise ValueError(f"after_step({steps_done}) after {self._last_steps_done} steps done: call it after every "
                             f"optimizer.step() with the steps done so far (step + 1 for a 0-based step), "
                             f"{self._last_steps_done + 1} now")
        t0 = time.perf_counter()
        self._last_steps_done = steps_done
        if self.steps is not None:
            self.steps.step_done()
        if self.checkpointer is not None:
            self.checkpointer.after_step(steps_done, self.state.view)
            if self.steps is not None:
                self.steps.release()
        if self.reports is not None and steps_done % self.report_every_steps == 0:
            self.reports.report(steps_done, metrics)
        if self._notices is not None and (notice := self._notices.poll()) is not None:  # every rank asks, all get the same answer
            save_before_deadline(notice, self.checkpointer, steps_done, self.state.view, self._events if self.rank == 0 else None)
        return time.perf_counter() - t0

    def flush(self, timeout_s: float = 600.0) -> bool:
        """Wait until every checkpoint handed to the background has finished (rank 0; True elsewhere);
        False after ``timeout_s`` seconds."""
        return self.checkpointer.flush(timeout_s) if self.checkpointer is not None else True

    def close(self, steps_done: int | None = None, metrics: Mapping[str, Any] | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
        """Call once on every rank after the loop: rank 0 checkpoints the state of the last ``after_step``
        when no checkpoint holds it yet (the loop's step count need not be a multiple of the interval:
        ``Result.checkpoint`` is the trained state), waits for every write (at most ``timeout_s`` seconds) and stops the writer; then every rank reports once
        more (``steps_done``: the step in that report, default the last ``after_step``'s; every rank
        reports the same), rank 0
        attaching the newest committed snapshot if not reported yet, so it is ``Result.checkpoint``.
        Returns rank 0's checkpointer statistics (``checkpoints``, ``bytes``, ``last_step``, ...; ``{}``
        elsewhere) with ``storage`` and ``newest`` (the newest committed snapshot's folder, rank 0).

        Raises:
            TimeoutError, storage.backend.StorageError: a full-state write did not finish or failed.
        """
        if self.closed:
            return {}
        self.closed = True
        stats: dict[str, Any] = {}
        if self.checkpointer is not None:
            if self._last_steps_done:
                self._checkpoint_trained_state(self._last_steps_done)
            stats = self.checkpointer.close(timeout_s)
            if stats.get("errors"):
                log.warning("failed checkpoint writes: %s", stats["errors"])
            own = self._own() if self.rank == 0 else []
            stats.update(storage=self.storage_uri, newest=own[-1].folder if own else None)
        if self.steps is not None:
            self.steps.close()
        if self.reports is not None:
            self.reports.report(steps_done if steps_done is not None else self._last_steps_done, metrics, final=True)
        return stats

    def _checkpoint_trained_state(self, last: int) -> None:
        """Rank 0 at ``close``: take a checkpoint of the state after ``last`` steps unless one holds it or
        will (an overlapped window still open is completed from this state by the checkpointer's close)."""
        ckpt = self.checkpointer
        if isinstance(ckpt, OverlappedCheckpointer):
            if not ckpt.window_open and (ckpt.last_submitted_step or 0) < last:
                ckpt.save_now(last, self.state.view)
            return
        assert ckpt is not None
        if ckpt.schedule.last_step is not None and ckpt.schedule.last_step < last:
            ckpt.schedule.set_interval(1)
            ckpt.after_step(last, self.state.view)

    @staticmethod
    def load(checkpoint: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
        """``load_checkpoint``."""
        return load_checkpoint(checkpoint, model, optimizer)


def _refuse_to_start_over(own: list[SnapshotInfo], chosen: SnapshotInfo | None, skipped: list[str], where: str) -> None:
    """Refuse a restore that would start over from the initial state although the run has committed
    snapshots (``own``): every one failed verification (``skipped`` says why). Starting over would discard
    their steps and report nothing lost; the damaged files stay for inspection (nothing is deleted).

    Raises:
        storage.snapshots.NoSnapshotError: ``own`` is not empty and ``chosen`` is None.
    """
    if own and chosen is None:
        raise NoSnapshotError(f"none of the {len(own)} committed snapshot(s) of this run in {where} loads (newest: step "
                              f"{own[-1].step}; {skipped[0] if skipped else 'no reason given'}): refusing to start over from "
                              f"the initial state, which would discard {own[-1].step} committed steps. Repair or restore the "
                              f"files (raycheck verify {where} names them), or start a new run in another storage")


def load_checkpoint(checkpoint: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    **storage_options: Any) -> int:
    """Load one committed snapshot, e.g. ``Result.checkpoint`` of a finished run, into ``model`` (and
    ``optimizer``: its per-parameter state and parameter groups), in place, bitwise; returns its step.

    Args:
        checkpoint: a ``ray.train.Checkpoint`` reported by raycheck (a pointer, ``workers.train_reports``), or the path / URI of
            a snapshot folder (``<storage>/step-...``; e.g. a run summary's ``final_snapshot``, the trained
            weights of ``raycheck run`` or ``run_own_loop``).
        model: the same architecture (a DDP wrapper is unwrapped).
        optimizer: the same optimizer class and parameter groups; None: the parameters only.
        storage_options: the storage's options (``storage.backend.Storage``'s, e.g. ``endpoint_url`` of an
            S3-compatible server).

    Raises:
        FileNotFoundError: ``checkpoint`` is None, or the folder is not a committed snapshot of its store
            (not in its index, e.g. deleted by retention; the message names the store's newest).
        ValueError: a malformed pointer.
        storage.snapshots.SnapshotCorruptError: a shard is missing or altered.
        training.optim_state.StateMismatchError: names, shapes or dtypes differ (the first is named);
            nothing was loaded.
    """
    store, info = committed_snapshot(checkpoint, **storage_options)
    if isinstance(store, ShardedStore) and any(isinstance(p, DTensor) for p in unwrap(model).parameters()):
        return _load_sharded_checkpoint(store, info, model, optimizer)
    state = store.load(info)  # a sharded checkpoint: gathered into whole tensors
    what = f"snapshot {store.storage.url(info.folder)}"
    if optimizer is not None:
        ModelOptimizerState(model, optimizer).load(state, what)
        return info.step
    params = dict(unwrap(model).named_parameters())
    _check_parameters(what, {n: (to_tensor(a).dtype, tuple(a.shape)) for n, a in state.items()}, params)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(to_tensor(state[name]))
    return info.step


def _check_parameters(what: str, saved: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], params: Mapping[str, torch.Tensor]) -> None:
    """Refuse (before anything is loaded) a snapshot whose parameters (``saved``: name -> dtype, global shape;
    optimizer entries and parameter groups aside) are not exactly ``params``' names, dtypes and shapes.

    Raises:
        training.optim_state.StateMismatchError: the first difference named.
    """
    own = [n for n in saved if not n.startswith((OPTIMIZER_PREFIX, GROUP_PREFIX))]
    missing, extra = [n for n in params if n not in saved], [n for n in own if n not in params]
    if missing or extra:
        first = f"it has no tensor {missing[0]!r}" if missing else f"it holds {len(extra)} parameter(s) the model lacks, first {extra[0]!r}"
        raise StateMismatchError(f"{what} does not fit the model: {first}; nothing was loaded")
    for name, p in params.items():
        dtype, shape = saved[name]
        if shape != tuple(p.shape) or dtype != p.dtype:
            raise StateMismatchError(f"{what} does not fit the model: {name!r} is {dtype} {list(shape)} there, "
                                     f"{p.dtype} {list(p.shape)} here; nothing was loaded")


def _load_sharded_checkpoint(store: ShardedStore, info: SnapshotInfo, model: torch.nn.Module,
                             optimizer: torch.optim.Optimizer | None) -> int:
    """``load_checkpoint`` of an FSDP2 snapshot (``storage.dcp_store``) into a model sharded by FSDP2: DCP
    reads the rows of its sharding (a collective of its process group)."""
    what = f"sharded snapshot {store.storage.url(info.folder)}"
    state = ModelOptimizerState(model, optimizer) if optimizer is not None else None
    view = state.view(host=False) if state is not None else {n: p.detach() for n, p in unwrap(model).named_parameters()}
    saved = store.tensor_layout(info)
    _check_parameters(what, saved, {n: t for n, t in view.items() if not n.startswith((OPTIMIZER_PREFIX, GROUP_PREFIX))})
    if state is not None and info.manifest["layout_sha256"] != layout_sha256(global_layout(view)):
        raise StateMismatchError(f"{what} does not fit the optimizer (its state's names, shapes or dtypes differ); nothing was loaded")
    problems = store.load_into(info, view)
    if problems:
        raise SnapshotCorruptError(f"{what}: {'; '.join(problems)}; nothing was loaded")
    if state is not None:
        for i, group in enumerate(state.optimizer.param_groups):
            set_group_values(group, i, view)
    return info.step
