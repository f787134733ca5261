"""The step exchange: MeZO workers in separate Ray Train replica groups sum their group vectors through it.

With replica groups (``orchestrator.replica_groups``) torch.distributed spans one worker per group, so
the per-step sum of the example groups' terms (``training.groups``) and the barriers travel through this
small async actor instead. Each rank puts its vector of step t and waits until every rank's vector of
step t is in; the sum (exact in any order: one non-zero contribution per element) is returned to all.

The parts of the last ``keep_steps`` complete steps are kept, so a replacement worker that restores at
the durable step and re-executes steps the survivors already passed gets the same sum at once; a part it
puts again must be the same bits as the kept one (``StepMismatchError`` otherwise: the replacement's
state or forward pass is not the survivors', and training on would leave the trajectory).

``StepExchange`` is the plain class (all logic, tested without Ray); ``StepExchangeActor`` the thin
asyncio shell (``max_concurrency`` waiters); ``RemoteExchange`` the workers' client.
"""

from __future__ import annotations

import asyncio

import ray
import torch


class StepMismatchError(RuntimeError):
    """A rank put a step's part again with other bits than the first time."""


class StepEvictedError(RuntimeError):
    """A rank put a part of a step older than the exchange keeps."""


class StepExchange:
    """The sums of ``world`` ranks' float64 vectors per step, and named barriers (plain class, asyncio).

    Args:
        world: the ranks that put a part of every step (Ray Train's world size).
        keep_steps: complete steps whose parts are kept for re-submission (>= 1).
    """

    def __init__(self, world: int, keep_steps: int) -> None:
        if world < 1 or keep_steps < 1:
            raise ValueError(f"world ({world}) and keep_steps ({keep_steps}) must be >= 1")
        self.world, self.keep_steps = world, keep_steps
        self._parts: dict[int, dict[int, list[float]]] = {}
        self._done: dict[int, asyncio.Event] = {}
        self._arrived: dict[str, set[int]] = {}
        self._met: dict[str, asyncio.Event] = {}
        self._newest_complete = -1

    def put(self, step: int, rank: int, part: list[float]) -> None:
        """Record ``rank``'s part of ``step`` (a flat list of float64 values).

        Raises:
            StepMismatchError: ``rank`` put other bits for ``step`` before.
            StepEvictedError: ``step`` is older than the kept window.
            ValueError: ``rank`` not in [0, world), or a part of another length than the other ranks'.
        """
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not one of {self.world} ranks")
        if step <= self._newest_complete - self.keep_steps:
            raise StepEvictedError(f"step {step} is older than the {self.keep_steps} complete steps the exchange keeps "
                                   f"(newest {self._newest_complete}): raise keep_steps")
        parts = self._parts.setdefault(step, {})
        if rank in parts:
            if _bits(parts[rank]) != _bits(part):
                raise StepMismatchError(f"rank {rank} put other values for step {step} than before: its state or forward "
                                        f"pass is not the one the other ranks stepped with")
            return
        if parts and len(part) != len(next(iter(parts.values()))):
            raise ValueError(f"rank {rank} put {len(part)} values for step {step}, the others {len(next(iter(parts.values())))}")
        parts[rank] = list(part)
        if len(parts) == self.world:
            self._event(self._done, step).set()
            self._newest_complete = max(self._newest_complete, step)
            for old in [s for s in self._parts if s <= self._newest_complete - self.keep_steps]:
                del self._parts[old]
                self._done.pop(old, None)

    def total(self, step: int) -> list[float] | None:
        """The sum of every rank's part of ``step`` (rank order; exact: one non-zero part per element),
        or None until every rank has put one."""
        parts = self._parts.get(step, {})
        if len(parts) < self.world:
            return None
        total = torch.zeros(len(parts[0]), dtype=torch.float64)
        for rank in range(self.world):
            total += torch.tensor(parts[rank], dtype=torch.float64)
        return total.tolist()

    async def exchange(self, step: int, rank: int, part: list[float], timeout_s: float) -> list[float]:
        """``put`` then wait (at most ``timeout_s``) for every rank's part of ``step``; returns ``total``.

        Raises:
            TimeoutError: a rank's part did not come in time (its worker is not coming back).
        """
        self.put(step, rank, part)
        try:
            await asyncio.wait_for(self._event(self._done, step).wait(), timeout_s)
        except asyncio.TimeoutError as exc:
            missing = sorted(set(range(self.world)) - set(self._parts.get(step, {})))
            raise TimeoutError(f"step {step}: ranks {missing} put nothing in {timeout_s} s") from exc
        total = self.total(step)
        if total is None:  # complete, then evicted before this wait resumed
            raise StepEvictedError(f"step {step} completed but was evicted before rank {rank} read it: raise keep_steps")
        return total

    async def barrier(self, name: str, rank: int, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every rank has arrived at barrier ``name``; a barrier once
        met stays met (a replacement arriving later passes at once).

        Raises:
            TimeoutError: a rank did not arrive in time.
        """
        arrived = self._arrived.setdefault(name, set())
        arrived.add(rank)
        if len(arrived) == self.world:
            self._event(self._met, name).set()
        try:
            await asyncio.wait_for(self._event(self._met, name).wait(), timeout_s)
        except asyncio.TimeoutError as exc:
            raise TimeoutError(f"barrier {name!r}: ranks {sorted(set(range(self.world)) - arrived)} did not arrive in {timeout_s} s") from exc

    @staticmethod
    def _event(events: dict, key) -> asyncio.Event:
        return events.setdefault(key, asyncio.Event())


def _bits(values: list[float]) -> bytes:
    return torch.tensor(values, dtype=torch.float64).numpy().tobytes()


class StepExchangeActor:
    """Ray shell around a ``StepExchange`` (``plain_exchange``; the arguments are its):
    ``ray.remote(StepExchangeActor).options(num_cpus=0, max_concurrency=..., name=...)``. Its methods are
    async, so Ray runs it as an asyncio actor and waiters do not block one another."""

    def __init__(self, world: int, keep_steps: int) -> None:
        self.plain_exchange = StepExchange(world, keep_steps)

    async def exchange(self, step: int, rank: int, part: list[float], timeout_s: float) -> list[float]:
        """``StepExchange.exchange``."""
        return await self.plain_exchange.exchange(step, rank, part, timeout_s)

    async def barrier(self, name: str, rank: int, timeout_s: float) -> None:
        """``StepExchange.barrier``."""
        await self.plain_exchange.barrier(name, rank, timeout_s)


class RemoteExchange:
    """A worker's client of the named exchange actor ``name`` (in ``namespace``): the ``training.groups``
    ``Exchange`` (``__call__``) and ``barrier``, each waiting at most ``timeout_s``."""

    def __init__(self, name: str, namespace: str, rank: int, timeout_s: float) -> None:
        self.actor = ray.get_actor(name, namespace=namespace)
        self.rank, self.timeout_s = rank, timeout_s

    def __call__(self, step: int, vec: torch.Tensor) -> torch.Tensor:
        total: list[float] = ray.get(self.actor.exchange.remote(step, self.rank, vec.flatten().tolist(), self.timeout_s))
        return torch.tensor(total, dtype=torch.float64).view(vec.shape)

    def barrier(self, name: str) -> None:
        ray.get(self.actor.barrier.remote(name, self.rank, self.timeout_s))
