"""``SIGTERM`` ends a driver the way Ctrl-C does: ``ray job stop``, a pod eviction, ``kill`` and a node's
shutdown send it, and without a handler Python dies at once, leaving no ``summary.json`` and the run's
actors to Ray's reaper.

``terminate_as_interrupt`` turns the signal into ``Terminated``, a ``KeyboardInterrupt``, raised in the
main thread: every path that handles Ctrl-C handles it too (``orchestrator.controller.Controller.run``
writes the summary and kills the run's actors; ``raycheck run`` prints the command that resumes the run
and exits ``EXIT_TERMINATED``). Nothing logged is lost: every step the summary counts is in the step log.

Two parts of Ray stand in the way, and are undone here. ``ray.init`` sets its own handler (``sys.exit``),
so ``orchestrator.cluster.connect`` calls ``reclaim_sigterm`` after it. Ray's C++ failure-signal handler
(abseil's) runs before any Python handler: it prints ``*** SIGTERM received ...`` with a stack to stderr
and arms a 3 s alarm that aborts the process (ray-project/ray#64830); the handler here cancels that alarm.
``ray job stop`` itself sends ``SIGKILL`` ``RAY_JOB_STOP_WAIT_TIME_S`` (Ray's default: 3 s) after
``SIGTERM``: the summary is written before any Ray call of the failure path, and the run stays resumable
from its step log even when the kill comes first.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

EXIT_TERMINATED = 128 + signal.SIGTERM
"""The exit code of a ``raycheck run`` that ``SIGTERM`` stopped (143), as a shell reports one."""


class Terminated(KeyboardInterrupt):
    """``SIGTERM`` arrived: handled as an interrupt (a ``KeyboardInterrupt``), named for what sent it."""


_active = False
"""Whether a ``terminate_as_interrupt`` block is running (``reclaim_sigterm`` then installs the handler again)."""


def _raise_terminated(signum: int, frame: object) -> None:
    signal.alarm(0)  # the abort Ray's C++ failure handler armed for 3 s from now: the failure path needs the time
    raise Terminated(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, ``SIGTERM`` raises ``Terminated`` in the main thread; the previous handler is put
    back after it. Outside the main thread (where Python cannot install handlers) it does nothing."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    _active = True
    try:
        yield
    finally:
        _active = False
        signal.signal(signal.SIGTERM, previous)


def reclaim_sigterm() -> None:
    """Install ``Terminated``'s handler again inside a ``terminate_as_interrupt`` block, after ``ray.init``
    replaced it with Ray's (``sys.exit(15)``, which leaves no summary); elsewhere nothing."""
    if _active and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)
