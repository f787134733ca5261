"""The warm standby's decisions without Ray (``workers.standby``): when it applies, how the supervisor
promotes a standby, and the budget that ends a run whose executor keeps dying. The promotion through real
Ray actors: ``tests/test_end_to_end.py`` (the ``shadow`` run)."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError

from raycheck.job.config import JobConfig
from raycheck.policies.budgets import within_budget
from raycheck.workers.standby import StandbyBudgetSpentError, supervise


@pytest.mark.parametrize("kw, named", [
    (dict(workers=2, batch_size=8), "workers 2"),
    (dict(algo="fo", strategy="full-sync"), "algo fo"),
    (dict(device="cuda"), "device cuda"),
])
def test_warm_standby_is_refused_outside_one_zo_cpu_worker(tmp_path, kw, named):
    with pytest.raises(ValueError, match=rf"^faults.warm_standby needs algo zo, one worker and device cpu \(this run: .*{named}"):
        JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", faults={"warm_standby": True}, **kw)
    assert JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", faults={"warm_standby": True}).faults.warm_standby


class Executors:
    """Fake executors: numbered as started; ``dies`` lists the executors whose run dies (the rest finish)."""

    def __init__(self, dies: set[int], budget: int) -> None:
        self.dies, self.budget = dies, budget
        self.started, self.runs, self.events, self.claimed = 0, [], [], 0

    def start(self) -> int:
        self.started += 1
        return self.started

    def run_on(self, executor: int, detected_unix_s: float | None) -> None:
        self.runs.append((executor, detected_unix_s is not None))
        if executor in self.dies:
            raise ActorDiedError()

    def allowed(self) -> bool:
        self.claimed += 1
        return within_budget(self.claimed - 1, self.budget)

    def record(self, kind: str, **fields) -> None:
        self.events.append((kind, fields["promoted"], fields["promotions"]))


def test_a_dead_executor_is_replaced_by_the_standby_and_a_new_standby_starts():
    ex = Executors(dies={1, 2}, budget=10)
    assert supervise(ex.start, ex.run_on, ex.allowed, ex.record) == 2
    # 1 and its standby 2 start together; 1 dies: 2 runs (promoted), 3 starts; 2 dies: 3 runs, 4 starts
    assert ex.runs == [(1, False), (2, True), (3, True)] and ex.started == 4
    assert ex.events == [("standby_promoted", True, 1), ("standby_promoted", True, 2)]


def test_an_executor_that_keeps_dying_ends_at_the_budget():
    ex = Executors(dies=set(range(1, 100)), budget=2)
    with pytest.raises(StandbyBudgetSpentError, match="past faults.max_worker_failures"):
        supervise(ex.start, ex.run_on, ex.allowed, ex.record)
    assert [e[1] for e in ex.events] == [True, True, False] and len(ex.runs) == 3


def test_an_executor_that_raises_goes_to_ray_train():
    def run_on(executor, detected):
        raise RuntimeError("the step raised past the in-process restarts")

    ex = Executors(dies=set(), budget=10)
    with pytest.raises(RuntimeError, match="in-process restarts"):
        supervise(ex.start, run_on, ex.allowed, ex.record)
    assert ex.events == []
