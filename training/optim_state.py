"""The training state of any ``torch.nn.Module`` with any supported ``torch.optim`` optimizer, as one
ordered ``name -> tensor`` mapping: what a user's own training loop checkpoints
(``workers.own_loop.FirstOrderCheckpoints``).

The state (``ModelOptimizerState.view``), in this order:

* every parameter, ``named_parameters`` order (tied tensors once; a DDP or FSDP-less wrapper's
  ``module.`` prefix removed: the names are the bare model's at any worker count);
* ``optim.<slot>.<parameter>``: each tensor of the optimizer's per-parameter state, slot-major (for
  AdamW ``exp_avg``, ``exp_avg_sq``, ``step``: ``training.fo.OPTIM_SLOTS``' order, then any other slot in
  name order), the parameter's shape, or ``(1,)`` for a 0-d tensor (Adam's step count), so
  ``storage.units.unit_of`` puts it in its parameter's unit, as ``training.fo.FOTrainer`` names them;
* ``param_groups.<i>.<key>``: every numeric hyper-parameter of parameter group ``i`` (``lr``,
  ``weight_decay``, ``betas``, ``momentum``, ``initial_lr``, ...; a tuple as a vector; flags such as
  ``foreach`` or ``amsgrad`` are not saved), float64, shape ``(1,)`` or ``(len,)``: a scheduler's changes
  to them are restored with the state (the scheduler's own counters are not: rebuild it from the
  restored step). Each group is a unit of its own. A load matches them by name (an entry only one side
  has is left as it is), so an optimizer built with other flags still loads; the parameters and the
  per-parameter state must match exactly.

Torch optimizers create their per-parameter state lazily at the first ``step``. ``materialise_state``
creates it eagerly for the optimizers whose lazy state is zeros (``Adam``, ``AdamW``, ``RMSprop``), for
``SGD`` with momentum and no dampening (a zero momentum buffer: ``0 * m + g`` is the gradient, the lazy
``clone(g)``, bitwise, except that a gradient entry of ``-0.0`` starts the buffer at ``+0.0``) and for any
optimizer whose state is already complete (``Adagrad`` creates its own in ``__init__``; or one that has
stepped). So the layout is fixed from step 0 and a fresh optimizer can be restored into. Others are
refused (``UnsupportedOptimizerError``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from raycheck.storage.manifest import layout_of
from raycheck.storage.tensor_files import as_numpy, to_tensor
from raycheck.storage.units import GROUP_PREFIX
from raycheck.training.fo import OPTIM_SLOTS




class UnsupportedOptimizerError(ValueError):
    """The optimizer's per-parameter state cannot be created before its first step without changing
    what that step computes (the message names the optimizer and what is supported)."""


class StateMismatchError(ValueError):
    """A checkpoint's state does not fit the model and optimizer it is loaded into (the message names
    the first tensor that differs); nothing was loaded."""


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP / ``DataParallel`` wrappers (their ``.module``), so parameter names do
    not depend on the worker count."""
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        inner = model.module
        assert isinstance(inner, torch.nn.Module)
        model = inner
    return model


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _step(group: Mapping[str, Any], p: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """The 0-d step count as torch's Adam / RMSprop create it (on the CPU unless capturable or fused)."""
    if group.get("capturable") or fused:
        return torch.zeros((), dtype=torch.float32, device=p.device)
    return torch.tensor(0.0, dtype=torch.float32)


def materialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the per-parameter state of every parameter that has none yet, as the optimizer's first
    ``step`` would (see the module docstring), so the state's layout is fixed before any step.

    Raises:
        UnsupportedOptimizerError: an optimizer (or setting: SGD's ``dampening`` != 0) whose lazily
            created state is not zeros, with some parameter still without state.
    """
    state = optimizer.state
    missing = [(g, p) for g in optimizer.param_groups for p in g["params"] if not state[p]]
    if not missing:
        return
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):  # AdamW subclasses Adam in torch 2.13
        for g, p in missing:
            state[p].update(step=_step(g, p, bool(g.get("fused"))), exp_avg=_zeros(p), exp_avg_sq=_zeros(p))
            if g.get("amsgrad"):
                state[p]["max_exp_avg_sq"] = _zeros(p)
    elif isinstance(optimizer, torch.optim.RMSprop):
        for g, p in missing:
            state[p].update(step=_step(g, p), square_avg=_zeros(p))
            if g["momentum"] > 0:
                state[p]["momentum_buffer"] = _zeros(p)
            if g["centered"]:
                state[p]["grad_avg"] = _zeros(p)
    elif isinstance(optimizer, torch.optim.SGD):
        for g, p in missing:
            if g["momentum"] == 0:
                continue  # no state at all
            if g["dampening"] != 0:
                raise UnsupportedOptimizerError(
                    f"SGD with dampening {g['dampening']}: its first momentum buffer is the raw gradient, not "
                    "(1 - dampening) * gradient, so it cannot be created before the first step; use dampening=0")
            state[p]["momentum_buffer"] = _zeros(p)
    else:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__} creates its state at its first step and raycheck does not know its zero "
            "state: supported are Adam, AdamW, RMSprop, SGD (dampening 0) and any optimizer whose state exists "
            "for every parameter already (e.g. Adagrad, or after one optimizer.step())")


def _slot_key(slot: str) -> tuple[int, str]:
    """``training.fo.OPTIM_SLOTS`` first, in their order (so AdamW's layout is ``FOTrainer``'s), then any other slot by name."""
    return (OPTIM_SLOTS.index(slot) if slot in OPTIM_SLOTS else len(OPTIM_SLOTS), slot)


def _group_value(value: Any) -> list[float] | None:
    """A parameter group's entry as floats (a number or a tuple/list of numbers); None for anything
    else (the parameters, flags, None, strings, tensors: not saved)."""
    if isinstance(value, bool):
        return None  # a flag (foreach, fused, amsgrad, ...): set by the code, never by a scheduler
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [float(v) for v in value]
    return None


def _restored_value(old: Any, values: list[float]) -> Any:
    """``values`` in the type of the group's current entry ``old``."""
    def one(o: Any, v: float) -> Any:
        return bool(v) if isinstance(o, bool) else int(v) if isinstance(o, int) else v
    if isinstance(old, (tuple, list)):
        return type(old)(one(o, v) for o, v in zip(old, values))
    return one(old, values[0])


def group_values(optimizer: torch.optim.Optimizer) -> OrderedDict[str, torch.Tensor]:
    """Every numeric hyper-parameter of every parameter group (see the module docstring):
    ``param_groups.<i>.<key>`` -> a new float64 tensor, shape ``(1,)`` or ``(len,)``."""
    values: OrderedDict[str, torch.Tensor] = OrderedDict()
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            floats = _group_value(value) if key != "params" else None
            if floats is not None:
                values[f"{GROUP_PREFIX}{i}.{key}"] = torch.tensor(floats, dtype=torch.float64)
    return values


def set_group_values(group: dict[str, Any], index: int, entries: Mapping[str, np.ndarray | torch.Tensor], prefix: str = "") -> None:
    """Set ``group``'s numeric hyper-parameters from ``entries``' ``<prefix>param_groups.<index>.<key>`` (as
    ``group_values`` names them), each in the type of the group's current value; an entry the group lacks,
    or one of another length, is left out (so is a key ``entries`` lacks)."""
    for key in list(group):
        name = f"{prefix}{GROUP_PREFIX}{index}.{key}"
        floats = _group_value(group[key]) if key != "params" and name in entries else None
        values = np.asarray(as_numpy(entries[name]), dtype=np.float64).ravel() if floats is not None else None
        if floats is not None and values is not None and values.size == len(floats):
            group[key] = _restored_value(group[key], [float(v) for v in values])


class ModelOptimizerState:
    """The training state of ``model`` and ``optimizer`` (see the module docstring), for checkpointing
    and restoring in place.

    Args:
        model: the user's module (a DDP wrapper is unwrapped); its parameters must all be in
            ``optimizer`` (a frozen parameter left out of it is still saved: it has no optimizer state).
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters; its per-parameter state is
            created now when missing (``materialise_state``).

    Raises:
        UnsupportedOptimizerError: from ``materialise_state``.
        ValueError: an optimizer parameter that is not a parameter of ``model``; a per-parameter state
            entry that is not a tensor (not supported: it could not be restored bitwise).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = unwrap(model), optimizer
        self.named: OrderedDict[str, torch.nn.Parameter] = OrderedDict(self.model.named_parameters())
        self._name_of = {id(p): n for n, p in self.named.items()}
        foreign = [i for i, g in enumerate(optimizer.param_groups) for p in g["params"] if id(p) not in self._name_of]
        if foreign:
            raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
                             f"(first in parameter group {foreign[0]}): pass the model the optimizer was built for")
        materialise_state(optimizer)
        for p in self.named.values():
            for slot, value in optimizer.state[p].items() if p in optimizer.state else ():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"{type(optimizer).__name__}'s state {slot!r} of {self._name_of[id(p)]} is a "
                                     f"{type(value).__name__}, not a tensor: not supported")

    def _slots(self) -> list[str]:
        slots = {s for p in self.named.values() if p in self.optimizer.state for s in self.optimizer.state[p]}
        return sorted(slots, key=_slot_key)

    def view(self, host: bool = True) -> OrderedDict[str, torch.Tensor]:
        """The training state, name -> CPU tensor: the parameters and optimizer tensors as live views
        (no copy on the CPU; with ``host``, a tensor on another device is copied to the host; without,
        every one is a live view where it lives, e.g. to load into in place), the parameter groups'
        hyper-parameters as new float64 tensors. Take a copy before the next step changes it
        (``training.state.copy_state``)."""
        def at_home(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            return t if t.device.type == "cpu" or not host else t.cpu()

        view: OrderedDict[str, torch.Tensor] = OrderedDict((n, at_home(p)) for n, p in self.named.items())
        for slot in self._slots():
            for name, p in self.named.items():
                t = self.optimizer.state[p].get(slot) if p in self.optimizer.state else None
                if t is not None:
                    view[f"optim.{slot}.{name}"] = at_home(t.view(1) if t.dim() == 0 else t)
        view.update(group_values(self.optimizer))
        return view

    def check(self, layout: list[list[Any]], what: str) -> None:
        """Refuse a state of another layout (``storage.manifest.layout_of``: names, dtypes, shapes, in
        order) before anything is loaded.

        Raises:
            StateMismatchError: naming ``what`` and the first tensor that differs.
        """
        def strict(entries: list[list[Any]]) -> list[list[Any]]:  # the parameter groups are matched by name in load
            return [e for e in entries if not e[0].startswith(GROUP_PREFIX)]

        groups = {e[0].split(".")[1] for e in layout if e[0].startswith(GROUP_PREFIX)}
        if groups and len(groups) != len(self.optimizer.param_groups):
            raise StateMismatchError(f"{what} does not fit the optimizer: it holds {len(groups)} parameter group(s), "
                                     f"this optimizer {len(self.optimizer.param_groups)}; nothing was loaded")
        layout, ours = strict(layout), strict(layout_of(self.view()))
        if layout == ours:
            return
        theirs_by_name = {n: (d, s) for n, d, s in layout}
        ours_by_name = {n: (d, s) for n, d, s in ours}
        for name, dtype, shape in ours:
            if name not in theirs_by_name:
                raise StateMismatchError(f"{what} does not fit the model and optimizer: it has no tensor {name!r} "
                                         f"({dtype} {shape} here); nothing was loaded")
            if theirs_by_name[name] != (dtype, shape):
                d, s = theirs_by_name[name]
                raise StateMismatchError(f"{what} does not fit the model and optimizer: {name!r} is {d} {s} there, "
                                         f"{dtype} {shape} here; nothing was loaded")
        extra = next(n for n, _, _ in layout if n not in ours_by_name) if set(theirs_by_name) - set(ours_by_name) else None
        raise StateMismatchError(f"{what} does not fit the model and optimizer: "
                                 + (f"it holds {extra!r}, which this model and optimizer lack" if extra
                                    else "its tensors are in another order") + "; nothing was loaded")

    def load(self, state: Mapping[str, np.ndarray | torch.Tensor], what: str = "the state") -> None:
        """Copy ``state`` (e.g. a snapshot's tensors) into the parameters, the optimizer's per-parameter
        state and its parameter groups' hyper-parameters, in place (any device); bitwise.

        Raises:
            StateMismatchError: names, order, dtypes or shapes differ (checked before anything is written).
        """
        self.check(layout_of(state), what)
        view = self.view()
        with torch.no_grad():
            for name, p in self.named.items():
                p.copy_(to_tensor(as_numpy(state[name])).reshape(p.shape))
            for name in view:
                if not name.startswith("optim."):
                    continue
                slot, param = name[len("optim."):].split(".", 1)
                live = self.optimizer.state[self.named[param]][slot]
                live.copy_(to_tensor(as_numpy(state[name])).reshape(live.shape))
        for i, group in enumerate(self.optimizer.param_groups):
            set_group_values(group, i, state)

