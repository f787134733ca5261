"""One background writer thread with a bounded queue: asynchronous persistence off the training loop.

Call order: the training loop stages (copies) what it wants persisted, then ``submit``s a job that
writes the copy; jobs run one at a time, in submission order (so a manifest never overtakes the
shards it references). ``submit`` blocks while ``max_pending`` jobs are already waiting: that
back-pressure bounds the staged memory, and the time it blocks is returned so callers count it as
training-loop stall. A job that raises is logged and its error kept (``errors``); the thread goes on
with the next job (it never dies silently). ``close`` waits for every job, bounded by a timeout;
``drain_or_raise`` waits and raises the error of a job queued after a mark (a just-in-time checkpoint).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


class BackgroundWriter:
    """Runs submitted jobs on one daemon thread named ``name``.

    Args:
        name: thread name (shows in stack dumps).
        max_pending: jobs that may wait behind the running one (>= 1).
    """

    def __init__(self, name: str, max_pending: int = 2) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._queue: queue.Queue[tuple[Callable[[], None], str] | None] = queue.Queue(maxsize=max_pending)
        self._idle = threading.Condition()
        self._unfinished = 0
        self.errors: list[str] = []
        """``"<what>: <error>"`` for every job that raised, in order."""
        self._failures: list[Exception] = []  # the errors of ``errors``, without their tracebacks (which hold staged copies)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], what: str) -> float:
        """Queue ``job`` (described by ``what`` in logs and errors); returns the seconds spent
        waiting for room in the queue.

        Raises:
            RuntimeError: the writer is closed.
        """
        if not self._thread.is_alive():
            raise RuntimeError(f"background writer {self._thread.name} is closed; cannot run {what}")
        with self._idle:
            self._unfinished += 1
        t0 = time.perf_counter()
        self._queue.put((job, what))
        return time.perf_counter() - t0

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, what = item
            try:
                job()
            except Exception as exc:  # kept and reported; the next job still runs
                log.exception("background write failed: %s", what)
                self.errors.append(f"{what}: {type(exc).__name__}: {exc}")
                self._failures.append(exc.with_traceback(None))
            finally:
                with self._idle:
                    self._unfinished -= 1
                    self._idle.notify_all()

    def drain(self, timeout_s: float | None) -> bool:
        """Wait until every submitted job has finished; False if ``timeout_s`` seconds passed first
        (None: no limit; 0: only ask whether it has)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout=timeout_s)

    def drain_or_raise(self, timeout_s: float, what: str, since: int) -> None:
        """``drain``, raising when it did not end in success: the jobs queued after ``len(errors)`` was
        ``since`` (the caller waited for every earlier job first) must all have finished within ``timeout_s``
        seconds and none of them failed.

        Raises:
            TimeoutError: naming ``what``, when ``timeout_s`` seconds passed first (the jobs go on).
            Exception: the first error of those jobs, as the job raised it.
        """
        if not self.drain(timeout_s):
            raise TimeoutError(f"{what} did not finish within {timeout_s:.1f} s")
        if len(self._failures) > since:
            raise self._failures[since]

    def close(self, timeout_s: float) -> bool:
        """``drain``, then stop the thread; returns whether every job finished in time."""
        finished = self.drain(timeout_s)
        if finished:
            self._queue.put(None)
            self._thread.join(timeout_s)
        return finished


@dataclass
class Postponements:
    """Checkpoints that came due while the background writer was still behind and were postponed to
    a later step instead of blocking the training loop.

    Attributes:
        checks: postponed checkpoints that have since been taken.
        steps: their delays (taken step - first due step), summed, in steps.
        due_since: the step the checkpoint postponed now first came due at; None: none is postponed.
    """

    checks: int = 0
    steps: int = 0
    due_since: int | None = None

    def postpone(self, step: int) -> None:
        """A due checkpoint could not be taken after ``step`` steps."""
        if self.due_since is None:
            self.due_since = step

    def taken(self, step: int) -> None:
        """The due checkpoint was taken after ``step`` steps (postponed or not)."""
        if self.due_since is not None:
            self.checks += 1
            self.steps += step - self.due_since
            self.due_since = None

    def stats(self) -> dict[str, int]:
        """``postponed_checks`` and ``postponed_steps`` (for a checkpointer's ``close``)."""
        return {"postponed_checks": self.checks, "postponed_steps": self.steps}
