"""First-order training with sharded state (``--fo-parallelism fsdp2``): FSDP2 over gloo, sharded
checkpoints, and a restore at any world size.

``torch.distributed.fsdp.fully_shard`` shards each decoder layer and then the whole scorer (the root
group: embeddings, final norm, head): every parameter, and with it each AdamW moment, is a DTensor
whose rows (dim 0) are split over the W ranks. A forward all-gathers a layer's rows, a backward
reduce-scatters its gradients (averaged over the ranks, as DDP does), and AdamW updates each rank's
rows only. The training state keeps ``FOTrainer.state_view``'s names and order; its tensors are
DTensors (the Adam step counts stay plain tensors, the same on every rank).

Checkpoints (``storage.dcp_store.ShardedStore``, through ``workers.own_loop.FirstOrderCheckpoints`` as
for your own FSDP2 loop): each rank writes its rows through torch DCP, rank 0 commits; a restore at
another world size reads the rows of the new sharding (DCP's resharding), so weights and moments are
bitwise those saved. Strategies: ``full-sync`` and ``full-async`` (``ShardedCheckpointer``, a
``training.checkpointing.FullCheckpointer`` on every rank, with ``ShardedWriter`` as its store: the
staging copy is of this rank's rows), ``layerwise`` (``ShardedLayerwiseCheckpointer``: each unit's
change summed over the ranks' rows, composite sharded checkpoints), ``overlapped``
(``ShardedOverlappedCheckpointer``: each rank catches its own rows up) and ``differential``
(``ShardedDiffCheckpointer``: each rank records its rows of the gradients; replayed at the same world
size only). Their checks are collectives: every rank takes each at the same step.

What is and is not bitwise across world sizes: the state a restore loads is bitwise the state saved,
at any world size. The steps after it are bitwise those of the saved run only at the same world
size: at another one the batch is split differently and the gradients are reduced in another order,
so the trajectories drift apart by rounding (the reference of such a run is a run at its own sizes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from raycheck.policies.layerwise import LayerwiseConfig, UnitStatus, change_ratio, change_sums
from raycheck.storage.dcp_store import ShardedStore, global_layout
from raycheck.storage.snapshots import SnapshotInfo
from raycheck.storage.diffs import DiffStore
from raycheck.training.checkpointing import FullCheckpointer
from raycheck.training.differential import DiffCheckpointer
from raycheck.training.layerwise import LayerwiseCheckpointer
from raycheck.training.overlapped import CatchUp, OverlappedCheckpointer

STAGING_WAIT_S = 600.0
"""How long a due check of a sharded checkpointer waits for a free staging set (seconds): it is a
collective, so it is never postponed (``training.state.StagingPool.take_due``)."""

if TYPE_CHECKING:
    from raycheck.training.data import PromptEncoder, Split
    from raycheck.training.fo import FOTrainer


def shard_scorer(scorer: torch.nn.Module) -> None:
    """``fully_shard`` each decoder layer of ``scorer.lm`` (``lm.model.layers``), then ``scorer`` itself (the
    root: the remaining parameters). Needs the default process group (gloo on CPU)."""
    for layer in getattr(getattr(scorer.lm, "model", None), "layers", ()):
        fully_shard(layer)
    fully_shard(scorer)


def ensure_process_group() -> None:
    """Initialise a one-rank default process group (gloo) when none exists, as ``fully_shard`` needs one
    (e.g. in a warm standby's step executor, outside Ray Train's worker group)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def checkpoint_group() -> dist.ProcessGroup:
    """A gloo group of every rank for checkpoint collectives (a background save must not share the
    training loop's group: two threads' collectives would interleave). Initialises a one-rank default
    group first when none exists (``ensure_process_group``). Every rank calls it, once."""
    ensure_process_group()
    return cast(dist.ProcessGroup, dist.new_group(backend="gloo"))  # torch: new_group is unannotated


def full_state(view: Mapping[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
    """``view`` with each DTensor re-gathered into its full tensor (a collective: every rank calls it);
    a state without DTensors is returned as it is. Hashes equal an unsharded trainer's state."""
    return OrderedDict((n, t.full_tensor() if isinstance(t, DTensor) else t) for n, t in view.items())


def evaluate(trainer: FOTrainer, encoder: PromptEncoder, split: Split, limit: int, batch_size: int = 16) -> float:
    """Accuracy on the first ``limit`` samples of ``split`` (the samples of ``training.data.accuracy``),
    scored through the trainer's root module (FSDP2 gathers each group's rows in its forward; a forward
    that bypasses the root is refused): argmax of the label words' logits as the training loss computes
    them (only the label rows of the head; ``accuracy``'s full-vocabulary logits may round otherwise).
    A collective: every rank calls it and gets the same value."""
    n = min(limit, len(split))
    correct = 0
    with torch.no_grad():
        for start in range(0, n, batch_size):
            idx = np.arange(start, min(n, start + batch_size))
            pred = trainer.scorer(*encoder.encode([split.texts[i] for i in idx])).argmax(dim=1).numpy()
            correct += int((pred == split.labels[idx]).sum())
    return correct / n


def local_view(view: Mapping[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
    """This rank's part of the state: each DTensor's local rows (live views); the staging input of
    ``FullCheckpointer``."""
    return OrderedDict((n, t.to_local() if isinstance(t, DTensor) else t) for n, t in view.items())


class Written(NamedTuple):
    """One sharded checkpoint as ``FullCheckpointer`` counts it: ``bytes`` this rank wrote."""

    step: int
    bytes: int


class ShardedWriter:
    """The store ``FullCheckpointer`` writes through under FSDP2: ``write`` wraps a staged copy of this
    rank's rows back into DTensors of the live state's sharding and saves them with ``store.save`` (a
    collective over ``group``: every rank's checkpointer is due at the same steps).

    Args:
        store: the run's sharded checkpoints.
        live: the live state (``FOTrainer.state_view``), for each DTensor's mesh, placements and shape.
        group: ``checkpoint_group()``.
    """

    def __init__(self, store: ShardedStore, live: Mapping[str, torch.Tensor], group: dist.ProcessGroup) -> None:
        self.store, self.live, self.group = store, live, group

    def write(self, step: int, staged: Mapping[str, np.ndarray], config: Mapping[str, Any] | None = None) -> Written:
        return Written(step, self.store.save(step, as_dtensors(staged, self.live), config, self.group).rank_bytes)


def as_dtensors(staged: Mapping[str, np.ndarray], live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's staged rows (``local_view``'s copy) as DTensors of ``live``'s sharding (mesh, placements,
    global shape); a tensor that is not a DTensor in ``live`` stays plain. Shares the staged memory."""
    state: dict[str, torch.Tensor] = {}
    for name, array in staged.items():
        local, like = torch.from_numpy(array), live[name]
        state[name] = DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                         shape=like.shape, stride=like.stride()) if isinstance(like, DTensor) else local
    return state


class ShardedCheckpointer(FullCheckpointer):
    """``FullCheckpointer`` on every rank under FSDP2: it stages a copy of this rank's rows
    (``local_view``) and writes through a ``ShardedWriter``; ``bytes`` counts this rank's files.
    ``save_now`` is a collective as ``after_step`` is: every rank calls it at the same step."""

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        return super().after_step(steps_done, lambda: local_view(state()))

    def save_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]], timeout_s: float = 600.0) -> dict[str, Any]:
        return super().save_now(steps_done, lambda: local_view(state()), timeout_s)


class ShardedLayerwiseCheckpointer(LayerwiseCheckpointer):
    """``LayerwiseCheckpointer`` on every rank under FSDP2 (LayerCheck, arXiv 2026, over row shards).

    Each rank stages its rows (``local_view``). At a check every rank sums, for each unit, the squared
    change of its rows since the unit's persisted version and their squared norm
    (``policies.layerwise.change_sums``); one ``all_gather_object`` over ``group`` gives every rank all
    the sums, added up in rank order, so every rank computes the same relative changes and, since
    ``select_units`` is pure, the same selection. The ranks then write the selected units' rows as a
    composite sharded checkpoint (``ShardedStore.save`` with the whole ``layout``): the other units are
    read from the folders of the newest committed one. Checks are collectives, so a rank never postpones
    one: with no free staging set, ``after_step`` waits for one (the base class postpones instead).
    A referenced checkpoint is verified when a restore reads it, not before the composite is committed
    (a restore that finds it damaged falls back to an older checkpoint).

    Args:
        store: the run's sharded checkpoints.
        live: the live state (name -> DTensor or tensor, its global layout), for the sharding.
        group: ``checkpoint_group()``.
        every, policy, config, max_pending: as ``LayerwiseCheckpointer``.
    """

    def __init__(self, store: ShardedStore, live: Mapping[str, torch.Tensor], group: dist.ProcessGroup, every: int,
                 policy: LayerwiseConfig, config: Mapping[str, Any] | None = None, max_pending: int = 2) -> None:
        super().__init__(store, every, policy, config, max_pending)
        self.sharded, self.live, self.group = store, live, group
        self.layout = global_layout(live)

    def resume(self, info: SnapshotInfo, state: Mapping[str, torch.Tensor | np.ndarray]) -> None:
        super().resume(info, local_view(cast(Mapping[str, torch.Tensor], state)))

    staging_wait_s = STAGING_WAIT_S  # every rank checks at the same steps: wait, never postpone

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        return super().after_step(steps_done, lambda: local_view(state()))

    def save_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]], timeout_s: float = 600.0) -> dict[str, Any]:
        return super().save_now(steps_done, lambda: local_view(state()), timeout_s)

    def _statuses(self, step: int, layout: Mapping[str, list[str]], staged: Mapping[str, np.ndarray]) -> list[UnitStatus]:
        mine = [(*(change_sums({n: staged[n] for n in self._persisted[u][1]}, self._persisted[u][1]) if u in self._persisted
                   else (0.0, 0.0)), sum(staged[n].nbytes for n in names)) for u, names in layout.items()]
        every: list[list[tuple[float, float, int]]] = [[]] * dist.get_world_size(self.group)  # all_gather_object fills each
        dist.all_gather_object(every, mine, group=self.group)
        statuses = []
        for i, unit in enumerate(layout):
            diff_sq, base_sq, size = (sum(rank[i][k] for rank in every) for k in range(3))
            persisted = self._persisted.get(unit)
            statuses.append(UnitStatus(unit=unit, relative_change=change_ratio(diff_sq, base_sq) if persisted else 0.0,
                                       staleness_steps=step - persisted[0] if persisted else None, bytes=int(size)))
        return statuses

    def _write(self, step: int, units: tuple[str, ...], layout: Mapping[str, list[str]], staged: dict[str, np.ndarray]) -> tuple[list[str], int]:
        changed = as_dtensors({n: staged[n] for u in units for n in layout[u]}, self.live)
        return list(units), self.sharded.save(step, changed, self.config, self.group, layout=self.layout).rank_bytes


class ShardedOverlappedCheckpointer(OverlappedCheckpointer):
    """``OverlappedCheckpointer`` on every rank under FSDP2 (GoCkpt, arXiv:2511.07035, over row shards):
    each rank stages its rows of one chunk per step (``local_view``), keeps its rows of the later steps'
    gradients (``training.optim_steps.OptimizerSteps`` records ``to_local`` gradients) and catches its
    earlier chunks up through a new optimizer over its rows; then the ranks save the assembled rows as one
    sharded checkpoint (``ShardedStore.save``, a collective). Every rank opens and submits each window at
    the same steps (the chunk count is the same: one chunk per parameter at most), and with no free
    staging set ``after_step`` waits for one rather than postpone (``staging_wait_s``).

    Args:
        store: the run's sharded checkpoints.
        live: the live state (name -> DTensor or tensor), for the sharding.
        group: ``checkpoint_group()``.
        every, chunks, catch_up, gradients, config, max_pending: as ``OverlappedCheckpointer``.
    """

    staging_wait_s = STAGING_WAIT_S

    def __init__(self, store: ShardedStore, live: Mapping[str, torch.Tensor], group: dist.ProcessGroup, every: int, chunks: int,
                 catch_up: CatchUp, gradients: Callable[[], Mapping[str, torch.Tensor]], config: Mapping[str, Any] | None = None,
                 max_pending: int = 1) -> None:
        super().__init__(store, every, chunks, catch_up, gradients, config, max_pending)
        self.sharded, self.live, self.group = store, live, group

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        return super().after_step(steps_done, lambda: local_view(state()))

    def save_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]], timeout_s: float = 600.0) -> dict[str, Any]:
        return super().save_now(steps_done, lambda: local_view(state()), timeout_s)

    def _commit(self, step: int, state: dict[str, np.ndarray]) -> int:
        return self.sharded.save(step, as_dtensors(state, self.live), self.config, self.group).rank_bytes


class ShardedDiffCheckpointer(DiffCheckpointer):
    """``DiffCheckpointer`` on every rank under FSDP2 (LowDiff, SC'25, over row shards): each rank records
    its rows of each step's gradients (``training.optim_steps.OptimizerSteps`` records ``to_local``
    gradients) in a record store of its own (``diffs``, under ``storage.diffs.rank_prefix``), in batches
    cut at the same steps on every rank; the ranks save the full checkpoints together
    (``ShardedStore.save``, which returns on every rank once rank 0 has committed, so no rank's garbage
    collection of records outruns the commit). A restore (``workers.own_loop.FirstOrderCheckpoints``)
    replays every rank's rows up to the step all ranks' records reach, at the world size they were taken
    at only: at another one the rows of a gradient fall elsewhere, and the restore starts from the full
    checkpoint.

    Args:
        store: the run's sharded checkpoints (the full ones).
        diffs: this rank's records (``DiffStore`` with prefix ``rank_prefix(rank, world)``).
        live: the live state (name -> DTensor or tensor), for the sharding.
        group: ``checkpoint_group()``.
        gradients, full_every, batch_steps, topk_ratio, config, max_pending: as ``DiffCheckpointer``.
    """

    def __init__(self, store: ShardedStore, diffs: DiffStore, live: Mapping[str, torch.Tensor], group: dist.ProcessGroup,
                 gradients: Callable[[], Mapping[str, torch.Tensor]], full_every: int, batch_steps: int, topk_ratio: float = 0.0,
                 config: Mapping[str, Any] | None = None, max_pending: int = 2) -> None:
        super().__init__(store, diffs, gradients, full_every, batch_steps, topk_ratio, config, max_pending)
        self.sharded, self.live, self.group = store, live, group

    def after_step(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> float:
        return super().after_step(steps_done, lambda: local_view(state()))

    def save_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]], timeout_s: float = 600.0) -> dict[str, Any]:
        return super().save_now(steps_done, lambda: local_view(state()), timeout_s)

    def full_now(self, steps_done: int, state: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        super().full_now(steps_done, lambda: local_view(state()))

    def _records_reach(self, steps_done: int) -> bool:
        """Every rank's records reach ``steps_done`` (one answer on every rank: a full checkpoint instead
        is a collective)."""
        every: list[bool] = [False] * dist.get_world_size(self.group)  # all_gather_object fills each
        dist.all_gather_object(every, super()._records_reach(steps_done), group=self.group)
        return all(every)

    def _commit_full(self, step: int, staged: Mapping[str, np.ndarray]) -> int:
        return self.sharded.save(step, as_dtensors(staged, self.live), self.config, self.group).rank_bytes
