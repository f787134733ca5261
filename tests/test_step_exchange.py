"""The step exchange's logic (``actors.step_exchange.StepExchange``, without Ray): sums per step, kept
parts for a re-executed step, a re-submission checked bitwise, barriers; and two workers stepping the
tiny model through its Ray shell in one process end with the bits of one worker."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from raycheck.actors.step_exchange import StepEvictedError, StepExchange, StepExchangeActor, StepMismatchError
from raycheck.job.config import JobConfig
from raycheck.training.model import default_cache_dir, load_model, trainable_parameters
from raycheck.training.state import state_sha256
from conftest import zo_step_
from raycheck.workers.zo_session import timed_append
from raycheck.training.zo import ZOHyper


def run(coro):
    return asyncio.run(coro)


def test_a_step_completes_when_every_rank_has_put_and_kept_steps_answer_a_replacement_at_once():
    async def scenario():
        ex = StepExchange(world=2, keep_steps=2)
        waiting = asyncio.ensure_future(ex.exchange(0, 0, [1.5, 0.0], timeout_s=5))
        await asyncio.sleep(0)
        assert not waiting.done() and ex.total(0) is None  # rank 1 is not in yet
        assert await ex.exchange(0, 1, [0.0, 2.25], timeout_s=5) == [1.5, 2.25]
        assert await waiting == [1.5, 2.25]
        # a replacement of rank 1 re-executes step 0: the same bits, the kept sum at once
        assert await ex.exchange(0, 1, [0.0, 2.25], timeout_s=5) == [1.5, 2.25]
        with pytest.raises(StepMismatchError, match="rank 1 put other values for step 0"):
            ex.put(0, 1, [0.0, 2.2500000000000004])
        for step in (1, 2):
            ex.put(step, 0, [float(step), 0.0])
            ex.put(step, 1, [0.0, float(step)])
        assert ex.total(1) == [1.0, 1.0] and ex.total(0) is None  # two complete steps kept: 1 and 2
        with pytest.raises(StepEvictedError, match="step 0 is older than the 2 complete steps"):
            ex.put(0, 1, [0.0, 2.25])
        with pytest.raises(TimeoutError, match=r"step 3: ranks \[1\] put nothing in 0.01 s"):
            await ex.exchange(3, 0, [1.0, 0.0], timeout_s=0.01)
        with pytest.raises(ValueError, match="rank 2 is not one of 2 ranks"):
            ex.put(3, 2, [0.0, 0.0])

    run(scenario())


def test_a_barrier_once_met_stays_met():
    async def scenario():
        ex = StepExchange(world=2, keep_steps=1)
        first = asyncio.ensure_future(ex.barrier("log-opened", 0, timeout_s=5))
        await asyncio.sleep(0)
        assert not first.done()
        await ex.barrier("log-opened", 1, timeout_s=5)
        await first
        await ex.barrier("log-opened", 1, timeout_s=0.01)  # a replacement of rank 1 passes at once
        with pytest.raises(TimeoutError, match=r"barrier 'settle-0': ranks \[1\] did not arrive"):
            await ex.barrier("settle-0", 0, timeout_s=0.01)

    run(scenario())


class ThreadExchange:
    """The exchange's Ray shell (``StepExchangeActor``, without Ray) shared by threads: one event loop
    in a thread, each worker's call run on it, as Ray runs an asyncio actor's calls."""

    def __init__(self, world: int) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.exchange = StepExchangeActor(world, keep_steps=8)

    def client(self, rank: int):
        def call(step: int, vec: torch.Tensor) -> torch.Tensor:
            coro = self.exchange.exchange(step, rank, vec.flatten().tolist(), timeout_s=120)
            return torch.tensor(asyncio.run_coroutine_threadsafe(coro, self.loop).result(), dtype=torch.float64).view(vec.shape)

        return call


def test_two_workers_through_the_exchange_end_with_the_bits_of_one_worker(tmp_path, data, encoder):
    """Two ranks, each its own copy of the tiny model, in two threads, sum their example groups through
    the exchange: after every step their state equals the one-worker run's (sha256 of every tensor)."""
    torch.set_num_threads(1)
    cfg = JobConfig(out_dir=str(tmp_path), cache_dir=str(default_cache_dir()), model="tiny", batch_size=8,
                    steps=3, zo={"lr": 1e-3, "micro_batch_size": 2})
    hyper = ZOHyper(lr=cfg.zo.lr, eps=cfg.zo.eps)

    def steps(rank: int, world: int, exchange, out: dict, model) -> None:
        params = trainable_parameters(model)
        out[rank] = []
        for step in range(cfg.steps):
            zo_step_(params, model, encoder, data[0], cfg, step, rank, world, hyper, fail=lambda: None,
                     commit=timed_append(None), exchange=exchange)
            out[rank].append(state_sha256(params))

    alone: dict = {}
    steps(0, 1, None, alone, load_model("tiny"))
    shared, together = ThreadExchange(2), {}
    models = [load_model("tiny") for _ in range(2)]  # loaded here: loading is not thread-safe
    threads = [threading.Thread(target=steps, args=(r, 2, shared.client(r), together, models[r])) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together[0] == together[1] == alone[0] and len(set(alone[0])) == cfg.steps
