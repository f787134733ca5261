"""The in-process restart's decision (``training.in_process.decide``, every branch) and its restore from
weights that are not the initial ones (``workers.recovery.restore``'s ``initial``), without Ray."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from raycheck.job.config import JobConfig
from raycheck.storage.steplog import StepLogCorruptError, StepLogWriter, StepRecord
from raycheck.workers.faults import InjectedWorkerFailure
from raycheck.training.in_process import StepFailure, decide
from raycheck.training.model import layout_sha256, parameter_layout
from raycheck.workers.recovery import restore
from raycheck.training.state import state_sha256
from raycheck.training.zo import GENERATOR, step_seed



def trajectory_of(cfg: JobConfig) -> dict:
    """The header fields that name ``cfg``'s trajectory (its records' tag, ``storage.steplog.header_tag``)."""
    return {"run_id": cfg.run_id, "trajectory_sha256": cfg.trajectory_sha256()}

def failure(**kw) -> StepFailure:
    return StepFailure(**{"world": 1, "error": InjectedWorkerFailure, "restarts_done": 0, "max_restarts": 3, **kw})


def test_one_worker_with_budget_left_restarts_in_process_until_the_budget_is_spent():
    assert [decide(failure(restarts_done=n)).restart for n in range(5)] == [True, True, True, False, False]
    assert decide(failure(restarts_done=1)).reason == "in-process restart 2 of 3"
    assert decide(failure(restarts_done=3)).reason.startswith("the in-process restart budget is spent (3 of 3)")
    assert decide(failure(error=torch.OutOfMemoryError)).restart  # a device allocation failure is transient
    assert decide(failure(error=ValueError)).restart  # e.g. a bad batch


def test_off_several_workers_and_fatal_errors_go_to_ray_train():
    assert decide(failure(max_restarts=0)) == decide(failure(max_restarts=0, restarts_done=5))
    assert not decide(failure(max_restarts=0)).restart and "off" in decide(failure(max_restarts=0)).reason
    several = decide(failure(world=2))
    assert not several.restart and several.reason.startswith("2 workers: the other ranks wait in the step's collective")
    for error in (MemoryError, torch.AcceleratorError, KeyboardInterrupt, SystemExit):
        decision = decide(failure(error=error))
        assert not decision.restart and decision.reason == f"{error.__name__} is fatal to the process: Ray Train replaces it"


def test_a_negative_budget_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^faults.max_in_process_restarts must be >= 0 \(0: off\), got -1$"):
        JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", faults={"max_in_process_restarts": -1})


def _initial() -> "OrderedDict[str, torch.Tensor]":
    return OrderedDict(w=torch.linspace(-1, 1, 12).reshape(4, 3), b=torch.full((3,), 0.5))


def test_restore_of_perturbed_weights_without_a_snapshot_starts_from_the_initial_ones(tmp_path):
    """No snapshot (log-only): the restore replays the whole log onto the initial weights. A replacement
    worker holds them already; an in-process restart holds the failed step's perturbed weights and passes
    ``initial``: both end bitwise equal, while replaying onto the perturbed weights would not."""
    log = tmp_path / "steplog.bin"
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", strategy="log-only",
                    zo={"lr": 1e-2}, weight_decay=0.1)
    writer = StepLogWriter.create(log, {"layout_sha256": layout_sha256(parameter_layout(_initial())), "generator": GENERATOR,
                                        **trajectory_of(cfg)})
    for step in range(3):
        writer.append(StepRecord(step=step, seed=step_seed(0, step), projected_grad=0.25 * (step + 1), loss_plus=1.0,
                                 loss_minus=0.9, lr=1e-2, eps=1e-3, weight_decay=0.1, batch_id=step))
    writer.close()

    fresh = _initial()
    cold = restore(fresh, cfg, log, 3)
    perturbed = OrderedDict((n, t + 1e-3) for n, t in _initial().items())
    warm = restore(perturbed, cfg, log, 3, initial=_initial)
    assert (cold["source"], cold["base_step"], cold["replayed_steps"]) == (warm["source"], warm["base_step"], warm["replayed_steps"]) \
        == ("initial", 0, 3)
    assert state_sha256(perturbed) == state_sha256(fresh) != state_sha256(_initial())
    stale = OrderedDict((n, t + 1e-3) for n, t in _initial().items())
    restore(stale, cfg, log, 3)  # without ``initial`` the perturbed weights would be taken for the initial ones
    assert state_sha256(stale) != state_sha256(fresh)


def test_restore_refuses_a_logged_record_of_another_run(tmp_path):
    """A record with a valid checksum and the right step number, but another run's seed (spliced in from
    the log of a run of seed 1), is refused: before the fix the restore replayed it (a wrong state)."""
    log = tmp_path / "steplog.bin"
    cfg = JobConfig(out_dir=str(tmp_path / "run"), cache_dir=str(tmp_path), model="tiny", strategy="log-only")
    writer = StepLogWriter.create(log, {"layout_sha256": layout_sha256(parameter_layout(_initial())), "generator": GENERATOR,
                                        **trajectory_of(cfg)})
    for step, seed in enumerate([0, 0, 1]):
        writer.append(StepRecord(step=step, seed=step_seed(seed, step), projected_grad=0.25, loss_plus=1.0, loss_minus=0.9,
                                 lr=1e-6, eps=1e-3, weight_decay=0.0, batch_id=step))
    writer.close()
    assert restore(_initial(), cfg, log, 2)["replayed_steps"] == 2  # this run's records
    with pytest.raises(StepLogCorruptError, match=r"the step log \(local\): the record of step 2 is not this run's"):
        restore(_initial(), cfg, log, 3)
