"""In-process restart of a single ZO worker: whether a step that raised is rolled back in the process.

When a step raises and the process is still alive (a transient runtime error, a data error, an injected
``worker:raise``), the train function (``workers.worker``) need not die: it rolls back to the freshest
complete state with the same restore a replacement worker runs (``workers.recovery.restore``), reusing
its loaded model, tokenizer, data, step log writer and Ray actor handles, and re-executes the step. No
Ray Train restart, no new process, no imports: ``docs/recovery.md`` measures what that saves.

Sources: NVIDIA Resiliency Extension, "In-process restart" (``nvidia_resiliency_ext.inprocess.Wrapper``:
the wrapped train function is re-entered in the surviving process after a fault, within a bounded number
of iterations; faults that leave the process unusable need a process restart, its in-job path);
torchft (Meta, PyTorch fault tolerance): a failed step of a replica group is discarded and training goes
on in the same process from a healthy state ("the process survives"), the job is not restarted.

This module is the decision alone (pure, ``decide``); the rollback is in ``workers.worker``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FATAL: tuple[type[BaseException], ...] = (MemoryError, torch.AcceleratorError)
"""Exceptions after which the process itself is not trusted, so Ray Train replaces it: ``MemoryError``
(the host is out of memory; the restore needs memory too), ``torch.AcceleratorError`` (a CUDA error
such as an illegal memory access or a device-side assert leaves the process's CUDA context unusable
until the process exits; a device allocation failure, ``torch.OutOfMemoryError``, is not one of these
and is restarted in process). Exceptions that are not ``Exception`` (``KeyboardInterrupt``,
``SystemExit``, ``GeneratorExit``) are a request to stop, never restarted either."""


@dataclass(frozen=True, kw_only=True)
class StepFailure:
    """A step that raised, as the decision sees it.

    Attributes:
        world: train workers in the run (Ray Train's world size).
        error: the class of the exception the step raised.
        restarts_done: in-process restarts this process has done already.
        max_restarts: ``JobConfig.faults.max_in_process_restarts`` (0: the warm path is off).
    """

    world: int
    error: type[BaseException]
    restarts_done: int
    max_restarts: int


@dataclass(frozen=True)
class Decision:
    """``restart``: roll back in this process (else re-raise, so Ray Train restarts the worker); ``reason``: why, one line."""

    restart: bool
    reason: str


def decide(failure: StepFailure) -> Decision:
    """Restart in process (pure) when all of these hold, else leave the failure to Ray Train:

    - the warm path is on (``max_restarts`` > 0) and its budget is not spent (``restarts_done`` <
      ``max_restarts``): a process that keeps failing is replaced rather than retried forever;
    - one worker (``world`` == 1): with several data-parallel workers the other ranks are blocked in the
      step's collective (the all-reduce, or the step exchange of replica groups) waiting for this one, so
      a rollback of one rank alone cannot rejoin them; Ray Train (and its replica groups,
      ``orchestrator.replica_groups``) restarts the failed worker as before;
    - the error is an ``Exception`` and not one of ``FATAL``.
    """
    if failure.max_restarts == 0:
        return Decision(False, "in-process restarts are off (--max-in-process-restarts 0)")
    if failure.world != 1:
        return Decision(False, f"{failure.world} workers: the other ranks wait in the step's collective, so Ray Train restarts the worker")
    if not issubclass(failure.error, Exception) or issubclass(failure.error, FATAL):
        return Decision(False, f"{failure.error.__name__} is fatal to the process: Ray Train replaces it")
    if failure.restarts_done >= failure.max_restarts:
        return Decision(False, f"the in-process restart budget is spent ({failure.restarts_done} of {failure.max_restarts}): "
                               "Ray Train replaces the process")
    return Decision(True, f"in-process restart {failure.restarts_done + 1} of {failure.max_restarts}")
