"""Canonical hashing and copying of a parameter state (ordered name -> tensor mapping).

A state is an ordered mapping from parameter name to a CPU tensor or numpy array, in
``named_parameters`` order. Exactness claims in raycheck compare ``state_sha256`` values.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from raycheck.storage.background import Postponements
from raycheck.storage.tensor_files import as_numpy


def state_sha256(state: Mapping[str, torch.Tensor | np.ndarray]) -> str:
    """sha256 over every tensor of ``state`` in its order: name, dtype, shape, then the raw bytes.

    Two states hash equal only if they are bitwise identical (same names, order, dtypes, shapes, bits).
    Cost: about 1 s for SmolLM2-135M's 538 MB on one core.
    """
    h = hashlib.sha256()
    for name, t in state.items():
        a = np.ascontiguousarray(as_numpy(t))
        h.update(f"{name}|{a.dtype.str}|{a.shape}\n".encode())
        h.update(a.data.cast("B"))
    return h.hexdigest()


def copy_state(state: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, np.ndarray]:
    """A private numpy copy of ``state`` (same order), safe to hand to another process."""
    return {n: np.array(as_numpy(t), copy=True) for n, t in state.items()}


class StepRecord(dict[str, torch.Tensor]):
    """One optimizer step's record (``training.optim_steps``) with each tensor's version counter when the
    step read it (torch bumps a tensor's ``_version`` at every in-place write), so that a gradient written
    in place after the step (``zero_grad(set_to_none=False)``, accumulation into the same tensor) is found
    before the record is used (``check``), never written or replayed."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], versions: Mapping[str, int] | None = None) -> None:
        super().__init__(tensors)
        self.versions = {n: t._version for n, t in tensors.items()} if versions is None else {n: versions[n] for n in tensors if n in versions}

    def check(self, what: str) -> None:
        """Raises ``RuntimeError`` (naming ``what`` and up to three tensors) when a tensor was written in place."""
        changed = [n for n, v in self.versions.items() if self[n]._version != v]
        if changed:
            raise RuntimeError(f"{what}: the gradients optimizer.step() read were written in place since ({changed[:3]}); "
                               "zero them with optimizer.zero_grad() (set_to_none=True, torch's default), not in place")


def record_part(record: Mapping[str, torch.Tensor], names: Iterable[str]) -> Mapping[str, torch.Tensor]:
    """The entries ``names`` of ``record`` (a ``StepRecord`` keeps their versions of the step)."""
    part = {n: record[n] for n in names}
    return StepRecord(part, record.versions) if isinstance(record, StepRecord) else part


def check_record(record: Mapping[str, torch.Tensor], what: str) -> None:
    """``StepRecord.check`` for a step record; nothing for another mapping (a gradients callable's own)."""
    if isinstance(record, StepRecord):
        record.check(what)


def require_new_tensors(previous: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor], what: str) -> None:
    """Refuse tensors kept by reference across steps that a later step wrote in place: a non-empty
    tensor of ``current`` at the same address as the same name's tensor of ``previous`` (still held,
    so its memory was not freed and reused).

    Raises:
        RuntimeError: naming ``what`` (e.g. "the gradients of step 7") and up to three such tensors.
    """
    reused = [n for n, t in previous.items() if t.numel() and n in current and t.data_ptr() == current[n].data_ptr()]
    if reused:
        raise RuntimeError(f"{what} were overwritten by the next step ({reused[:3]}): the gradients callable must return "
                           "new tensors every step (optimizer.zero_grad() with set_to_none=True, torch's default)")


def copy_into(buffers: dict[str, np.ndarray], state: Mapping[str, torch.Tensor | np.ndarray]) -> dict[str, np.ndarray]:
    """Copy every tensor of ``state`` into ``buffers`` (name -> array, updated in place: an array is
    allocated on a name's first use, or when its shape or dtype changed, and reused after that, so a
    staging copy does not page-fault fresh memory every time); returns ``{name: buffers[name]}`` in
    ``state``'s order. bfloat16 tensors are staged as their raw bits (``as_numpy``)."""
    for name, t in state.items():
        src = as_numpy(t)
        dst = buffers.get(name)
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
            dst = buffers[name] = np.empty(src.shape, src.dtype)
        np.copyto(dst, src)
    return {name: buffers[name] for name in state}


class StagingPool:
    """``sets`` reusable staging buffer sets (each a name -> array dict for ``copy_into``), shared by a
    training loop that takes one per staged checkpoint and a background writer that gives it back
    once the checkpoint is written. Never blocks unless asked: ``take`` returns None when every set
    is in use, so the loop can postpone a checkpoint instead of waiting. ``take`` hands out the set given
    back last, so while the writer keeps up one set is reused over and over, and the arrays of the
    others are never allocated (``copy_into`` allocates on first use).

    Args:
        sets: buffer sets (>= 1); a checkpointer whose writer holds at most ``k`` staged checks (the
            running one and those queued) needs ``k`` sets.

    Raises:
        ValueError: ``sets`` < 1.
    """

    def __init__(self, sets: int) -> None:
        if sets < 1:
            raise ValueError(f"a staging pool needs >= 1 buffer set, got {sets}")
        self._free: list[dict[str, np.ndarray]] = [{} for _ in range(sets)]
        self._all = list(self._free)
        self._cond = threading.Condition()

    @property
    def sets(self) -> list[dict[str, np.ndarray]]:
        """Every buffer set of the pool (free or in use), in creation order."""
        return list(self._all)

    def take(self, timeout_s: float | None = 0.0) -> dict[str, np.ndarray] | None:
        """A free buffer set, or None when none came free within ``timeout_s`` seconds (0: do not wait;
        None: wait as long as it takes)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=timeout_s):
                return None
            return self._free.pop()  # the set given back last: a set is allocated only when all others are held

    def take_due(self, step: int, postponed: Postponements, wait_s: float = 0.0) -> dict[str, np.ndarray] | None:
        """A free set for the checkpoint due after ``step`` steps. ``wait_s`` 0: None when none is free now,
        the checkpoint being postponed (``postponed``), so the loop never waits; > 0 (a checkpointer whose
        checks are collectives, every rank taking each at the same step: FSDP2's): wait up to ``wait_s``
        seconds.

        Raises:
            TimeoutError: ``wait_s`` > 0 and no set came free within it.
        """
        buffers = self.take(wait_s)
        if buffers is None:
            if wait_s > 0:
                raise TimeoutError(f"no staging buffer set came free within {wait_s:.0f} s for the checkpoint due after step {step}")
            postponed.postpone(step)
        return buffers

    def give_back(self, buffers: dict[str, np.ndarray]) -> None:
        """Return a set taken with ``take``; its arrays may be overwritten from now on.

        Raises:
            ValueError: ``buffers`` is not a set of this pool in use.
        """
        with self._cond:
            if not any(b is buffers for b in self._all) or any(b is buffers for b in self._free):
                raise ValueError("give_back: not a buffer set of this pool that is in use")
            self._free.append(buffers)
            self._cond.notify_all()


def load_into(params: Mapping[str, torch.Tensor], source: Mapping[str, np.ndarray | torch.Tensor]) -> None:
    """Copy ``source`` into the tensors of ``params`` in place.

    Raises:
        ValueError: names, shapes or dtypes differ (e.g. a snapshot of another model).
    """
    if list(source) != list(params):
        missing = sorted(set(params) - set(source))[:3]
        extra = sorted(set(source) - set(params))[:3]
        raise ValueError(f"state does not match the model: missing {missing}, unexpected {extra}")
    for name, dst in params.items():
        src = as_numpy(source[name])
        if tuple(src.shape) != tuple(dst.shape) or src.dtype != as_numpy(dst).dtype:
            raise ValueError(
                f"{name}: state has shape {tuple(src.shape)} {src.dtype}, "
                f"model expects {tuple(dst.shape)} {as_numpy(dst).dtype}"
            )
        np.copyto(as_numpy(dst), src)
