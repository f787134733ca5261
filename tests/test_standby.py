"""The warm standby's decisions without Ray (``workers.standby``): when it applies, how the supervisor
promotes a standby, and the budget that ends a run whose executor keeps dying. The promotion through real
Ray actors: ``tests/test_end_to_end.py`` (the ``shadow`` run)."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError

from raycheck.job.config import FailureSpec, JobConfig
from raycheck.policies.budgets import within_budget
from raycheck.workers.standby import NoStandbyError, StandbyBudgetSpentError, likely_kept, supervise


@pytest.mark.parametrize("kw, named", [
    (dict(workers=2, batch_size=8, algo="fo", strategy="full-sync"), "first-order DDP with 2 workers"),
    (dict(workers=2, batch_size=8, algo="fo", strategy="full-sync", fo={"parallelism": "fsdp2"}), "first-order FSDP2 with 2 workers"),
    (dict(workers=2, batch_size=8, strategy="full-async"), "strategy full-async with 2 workers"),
])
def test_a_standby_is_refused_where_its_executor_could_not_join_the_collective(tmp_path, kw, named):
    with pytest.raises(ValueError, match=rf"^faults.warm_standby: this run cannot keep a warm standby: {named} all-reduces"):
        JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", faults={"warm_standby": True}, **kw)
    auto = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", **kw)
    assert auto.standby_refusal is not None and not auto.supervised  # the default trains in Ray Train's process


@pytest.mark.parametrize("kw", [dict(), dict(workers=2, batch_size=8), dict(algo="fo", strategy="layerwise"),
                                dict(device="cuda", faults={"warm_standby": True})])
def test_one_worker_zo_replica_groups_and_one_first_order_worker_are_supervised(tmp_path, kw):
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", **kw)
    assert cfg.standby_refusal is None and cfg.supervised
    off = JobConfig.from_dict({**cfg.to_dict(), "faults": {**cfg.to_dict()["faults"], "warm_standby": False}})
    assert not off.supervised


def test_the_default_keeps_no_standby_on_cuda_until_measured(tmp_path):
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", device="cuda")
    assert "scripts/device-check" in cfg.standby_refusal and not cfg.supervised


class Executors:
    """Fake executors: numbered as started; ``dies`` lists the executors whose run dies (the rest finish)."""

    def __init__(self, dies: set[int], budget: int) -> None:
        self.dies, self.budget, self.kept, self.stopped = dies, budget, True, []
        self.started, self.runs, self.events, self.claimed = 0, [], [], 0

    def start(self) -> int:
        self.started += 1
        return self.started

    def run_on(self, executor: int, detected_unix_s: float | None, stepped) -> None:
        self.runs.append((executor, detected_unix_s is not None))
        if detected_unix_s is not None:
            stepped()  # a promoted executor's first step (before it dies, in these fakes)
        if executor in self.dies:
            raise ActorDiedError()

    def stop(self, executor: int) -> None:
        self.stopped.append(executor)

    def keep(self, active: int) -> bool:
        return self.kept

    def allowed(self) -> bool:
        self.claimed += 1
        return within_budget(self.claimed - 1, self.budget)

    def record(self, kind: str, **fields) -> None:
        self.events.append((kind, fields["promoted"], fields["promotions"]))


def test_a_dead_executor_is_replaced_by_the_standby_and_a_new_standby_starts():
    ex = Executors(dies={1, 2}, budget=10)
    assert supervise(ex.start, ex.stop, ex.run_on, ex.keep, ex.allowed, ex.record) == 2
    # 1 and its standby 2 start together; 1 dies: 2 runs (promoted), 3 starts; 2 dies: 3 runs, 4 starts
    assert ex.runs == [(1, False), (2, True), (3, True)] and ex.started == 4
    assert ex.events == [("standby_promoted", True, 1), ("standby_promoted", True, 2)]


def test_an_executor_that_keeps_dying_ends_at_the_budget():
    ex = Executors(dies=set(range(1, 100)), budget=2)
    with pytest.raises(StandbyBudgetSpentError, match="past faults.max_worker_failures"):
        supervise(ex.start, ex.stop, ex.run_on, ex.keep, ex.allowed, ex.record)
    assert [e[1] for e in ex.events] == [True, True, False] and len(ex.runs) == 3


def test_an_executor_that_raises_goes_to_ray_train():
    def run_on(executor, detected, stepped):
        raise RuntimeError("the step raised past the in-process restarts")

    ex = Executors(dies=set(), budget=10)
    with pytest.raises(RuntimeError, match="in-process restarts"):
        supervise(ex.start, ex.stop, run_on, ex.keep, ex.allowed, ex.record)
    assert ex.events == []


def test_without_a_standby_a_dead_executor_goes_to_ray_train():
    ex = Executors(dies={1}, budget=10)
    ex.kept = False
    with pytest.raises(NoStandbyError, match="no standby was kept"):
        supervise(ex.start, ex.stop, ex.run_on, ex.keep, ex.allowed, ex.record)
    assert ex.stopped == [2] and ex.runs == [(1, False)] and ex.events == [("standby_promoted", False, 0)]


def test_a_standby_not_likely_kept_starts_only_once_the_decision_keeps_it():
    ex = Executors(dies={1}, budget=10)
    assert supervise(ex.start, ex.stop, ex.run_on, ex.keep, ex.allowed, ex.record, early=False) == 1
    assert ex.runs == [(1, False), (2, True)] and ex.stopped == []  # 2 started after the decision, promoted
    ex = Executors(dies=set(), budget=10)
    ex.kept = False
    assert supervise(ex.start, ex.stop, ex.run_on, ex.keep, ex.allowed, ex.record, early=False) == 0
    assert ex.started == 1 and ex.stopped == []  # no standby ever loaded


def test_a_standby_loads_beside_the_first_executor_where_worker_failures_are_injected_or_it_is_forced(tmp_path):
    base = dict(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny")
    assert likely_kept(JobConfig(**base, faults={"failures": (FailureSpec.parse("6:worker"),)}))
    assert likely_kept(JobConfig(**base, faults={"warm_standby": True}))
    assert not likely_kept(JobConfig(**base)) and not likely_kept(JobConfig(**base, faults={"failures": (FailureSpec.parse("6:shadow"),)}))
