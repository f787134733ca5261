"""The steps of a user's own ``torch.optim`` optimizer as records, and their replay through the same
optimizer class: what differential checkpoints (LowDiff, SC'25) and overlapped snapshots (GoCkpt,
arXiv:2511.07035) need from a loop whose optimizer raycheck does not own
(``workers.own_loop.FirstOrderCheckpoints``).

A step record (``OptimizerSteps.applied``) is what one ``optimizer.step()`` read, taken by a step
pre-hook (``Optimizer.register_step_pre_hook``) at the moment of the call:

* ``<parameter>``: the gradient the step consumed (``p.grad`` then: after your clipping, AMP unscaling,
  DDP averaging), the parameter's shape and dtype, by reference (no copy; ``zero_grad(set_to_none=True)``,
  torch's default, makes each step's gradients new tensors). A parameter without a gradient is absent:
  the step skipped it, and so does its replay (a differential checkpointer refuses a record whose
  parameters differ from the earlier steps': its record objects hold one set).
* ``param_groups.<i>.<key>``: group ``i``'s numeric hyper-parameters at that step
  (``training.optim_state.group_values``, float64): what your scheduler had set, so a replayed step
  uses the learning rate the step used;
* ``after.param_groups.<i>.<key>``: the same once the loop's step was over (``step_done``, called by
  ``after_step``: a scheduler stepped after ``optimizer.step()`` has set the next step's), restored after
  the replayed step, so a replayed state holds what a checkpoint taken then would.

A record (``training.state.StepRecord``) keeps each gradient's version counter: a gradient written in
place after the step (``zero_grad(set_to_none=False)``) is refused before the record is used.

Replaying a record sets those gradients and hyper-parameters and calls ``step()``: given the same
state, bitwise the step that ran (the optimizer is deterministic on the CPU). ``catch_up_`` replays
records onto part of a staged copy of the state through a new optimizer of the same class over that
part (its parameter groups' settings copied), which is exact for every optimizer whose update of a
parameter reads only that parameter's gradient, state and group settings (every ``torch.optim``
optimizer except LBFGS, which needs a closure).

Under FSDP2 (DTensor parameters) a record holds this rank's rows of each gradient (``to_local``), and
``catch_up_`` steps this rank's staged rows (``training.sharded.local_view``'s copy): the update of a row
reads only that row's gradient and state, so the rows caught up in each rank are those of the whole
tensor; ``replay`` (differential checkpoints) takes this rank's rows of each recorded gradient and steps
the live optimizer with them as DTensors of the parameter's sharding: the step that ran, bitwise, at the
world size the records were taken at.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from raycheck.storage.tensor_files import as_numpy, to_tensor
from raycheck.training.optim_state import ModelOptimizerState, UnsupportedOptimizerError, group_values, set_group_values
from raycheck.training.state import StepRecord

AFTER = "after."
"""``after.param_groups.<i>.<key>``: a group's hyper-parameter when the loop's step was over (``OptimizerSteps.step_done``)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a DTensor (FSDP2), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _like_parameter(value: np.ndarray | torch.Tensor, p: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` (whole, or this rank's rows of a DTensor parameter) as a gradient of ``p``.

    Raises:
        ValueError: another shape or dtype than ``p``'s (its rows here), naming ``what``.
    """
    t = _tensor_like(value, _local(p.detach()), what)
    if isinstance(p, DTensor):
        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return t


def _tensor_like(value: np.ndarray | torch.Tensor, like: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` as a tensor of ``like``'s shape, dtype and device (a view on the CPU when it can be).

    Raises:
        ValueError: another shape or dtype, naming ``what``.
    """
    t = value if isinstance(value, torch.Tensor) else to_tensor(value)
    if tuple(t.shape) != tuple(like.shape) or t.dtype != like.dtype:
        raise ValueError(f"{what} is {t.dtype} {tuple(t.shape)}, the parameter is {like.dtype} {tuple(like.shape)}")
    return t.to(like.device)


def clone_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]] | None = None) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``groups`` (parameter groups with every setting;
    default: one group of ``optimizer``'s first group's settings over a stand-in tensor, to check early
    that the class can be rebuilt).

    Raises:
        UnsupportedOptimizerError: the class cannot be built from its parameter groups alone, or (the check)
            keeps a public attribute outside them that the rebuilt one does not have alike (e.g. a
            constructor argument with a default, stored on the optimizer)."""
    probe = groups is None
    if groups is None:
        groups = [{**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"}, "params": [torch.zeros(1)]}]
    cls = type(optimizer)
    try:
        clone = cast(torch.optim.Optimizer, cast(Any, cls)(groups))
    except (TypeError, ValueError) as exc:
        raise UnsupportedOptimizerError(f"{cls.__name__} cannot be built from its parameter groups alone ({exc}), "
                                        "which the overlapped catch-up needs: use another strategy") from exc
    own = {k: v for k, v in vars(optimizer).items() if not k.startswith("_") and k not in ("defaults", "state", "param_groups")}
    differs = [k for k, v in own.items() if not _same(v, getattr(clone, k, _MISSING))] if probe else []
    if differs:
        raise UnsupportedOptimizerError(f"{cls.__name__} keeps {differs[0]!r} outside its parameter groups "
                                        f"({own[differs[0]]!r} here, {getattr(clone, differs[0], None)!r} when rebuilt from "
                                        "them), which the overlapped catch-up rebuilds it from: use another strategy, or "
                                        "keep the setting in the parameter groups")
    return clone


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    """``a == b`` where that is one truth value, else identity."""
    try:
        return bool(a == b)
    except (RuntimeError, ValueError, TypeError):
        return a is b


class OptimizerSteps:
    """Records every ``step()`` of ``state``'s optimizer and replays such records (the module docstring).

    Args:
        state: the model and optimizer of the loop (``training.optim_state.ModelOptimizerState``).
        record: register the step pre-hook that takes the records (until ``close``); False: replay only
            (a rank that writes no checkpoint).
    """

    def __init__(self, state: ModelOptimizerState, record: bool = True) -> None:
        self.state = state
        self._last: StepRecord | None = None
        self._replaying = False
        self._hook = state.optimizer.register_step_pre_hook(self._capture) if record else None

    def _capture(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._replaying:
            return
        grads = {n: _local(p.grad.detach()) for n, p in self.state.named.items() if p.grad is not None}
        self._last = StepRecord({**grads, **group_values(optimizer)})

    def step_done(self) -> None:
        """Add to the last record the groups' hyper-parameters now, once the loop's step is over
        (``after.param_groups.<i>.<key>``: what a scheduler set for the next step, which a replay restores
        after the step, as a checkpoint taken now would hold them)."""
        if self._last is not None:
            self._last.update({AFTER + n: v for n, v in group_values(self.state.optimizer).items()})

    def applied(self) -> Mapping[str, torch.Tensor]:
        """The record of the last ``optimizer.step()`` (see the module docstring).

        Raises:
            RuntimeError: no step has run since this object was made or since ``release``; or its
                gradients were written in place since the step (``StepRecord.check``).
        """
        if self._last is None:
            raise RuntimeError("no optimizer.step() since the last after_step: call after_step once after each "
                               "optimizer.step()")
        self._last.check("after_step")
        return self._last

    def release(self) -> None:
        """Drop this object's reference to the last record (its gradients stay alive only where a
        checkpointer holds them, not through the next step's forward and backward)."""
        self._last = None

    def replay(self, record: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        """One ``step()`` of the live optimizer with ``record``'s gradients and hyper-parameters (not
        recorded again); the gradients are cleared afterwards.

        Raises:
            ValueError: a recorded gradient's shape or dtype differs from its parameter's.
        """
        for name, p in self.state.named.items():
            p.grad = _like_parameter(record[name], p, f"the recorded gradient of {name}") if name in record else None
        for i, group in enumerate(self.state.optimizer.param_groups):
            set_group_values(group, i, record)
        self._replaying = True
        try:
            self.state.optimizer.step()
        finally:
            self._replaying = False
            for p in self.state.named.values():
                p.grad = None
        for i, group in enumerate(self.state.optimizer.param_groups):
            set_group_values(group, i, record, prefix=AFTER)

    def catch_up_(self, chunk: Mapping[str, np.ndarray], records: Sequence[Mapping[str, np.ndarray | torch.Tensor]]) -> None:
        """Apply ``records`` (in step order) to part of a staged state in place (GoCkpt's catch-up):
        ``chunk`` holds some parameters' weights with their ``optim.<slot>.<parameter>`` tensors
        (writable C-contiguous arrays, e.g. a staging buffer; other entries are left alone); a new
        optimizer of the live one's class, over these parameters in their groups, steps once per record
        on the parameters' device, and the result is written back into ``chunk``.

        Raises:
            KeyError: a parameter of ``chunk`` lacks one of its optimizer state tensors.
            ValueError: a recorded gradient's shape or dtype differs from its parameter's.
            UnsupportedOptimizerError: the optimizer's class cannot be rebuilt (``clone_optimizer``).
        """
        live = self.state.optimizer
        params = OrderedDict((n, _tensor_like(chunk[n], _local(p.detach()), f"the staged {n}"))
                             for n, p in self.state.named.items() if n in chunk)
        if not params or not records:
            return
        groups, index = [], []  # the clone's groups, and the live group each one is
        for i, group in enumerate(live.param_groups):
            ids = {id(q) for q in group["params"]}
            members = [t for n, t in params.items() if id(self.state.named[n]) in ids]
            if members:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
                index.append(i)
        clone = clone_optimizer(live, groups)
        for name, t in params.items():
            slots = live.state[self.state.named[name]]
            clone.state[t] = {slot: _tensor_like(chunk[f"optim.{slot}.{name}"], s.reshape(-1) if s.dim() == 0 else s,
                                                 f"the staged optim.{slot}.{name}").reshape(s.shape)
                              for slot, s in ((slot, _local(s)) for slot, s in slots.items())}
        for record in records:
            for name, t in params.items():
                t.grad = _tensor_like(record[name], t, f"the recorded gradient of {name}") if name in record else None
            for group, i in zip(clone.param_groups, index):
                set_group_values(group, i, record)
            clone.step()
        for name, t in params.items():  # the CPU tensors are views of the chunk already
            if t.device.type != "cpu":
                np.copyto(chunk[name], as_numpy(t.detach().cpu()))
                for slot, s in clone.state[t].items():
                    np.copyto(chunk[f"optim.{slot}.{name}"], as_numpy(s.detach().cpu().reshape(-1 if s.dim() == 0 else s.shape)))

    def close(self) -> None:
        """Remove the step pre-hook (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
        self.release()
