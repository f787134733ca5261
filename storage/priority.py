"""Idle CPU and I/O priority for a process that only writes in the background (the snapshot persister).

On Linux the scheduling policy, the nice value and the I/O priority belong to each THREAD, not to the
process: ``lower_to_idle`` sets all three on every thread of a process (``/proc/<pid>/task``), and a
thread started later inherits them from the thread that starts it. The settings: ``SCHED_IDLE``
(``sched(7)``: runs only when no normal thread wants the CPU, weight 3 against a nice-0 thread's 1024),
nice 19, and the I/O class ``IOPRIO_CLASS_IDLE`` (``ioprio_set(2)``: disk time only when no one else
wants it; honoured by the BFQ and, since Linux 5.14, the ``mq-deadline`` schedulers, ignored by
``none``). An unprivileged process may lower these but not raise them again.

Lower only a whole separate process, never some threads of a process whose other threads must run:
a lowered thread that holds the GIL (or any lock) while starved stalls the threads that wait for it
(priority inversion), e.g. a training loop waiting for a writer thread's GIL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

IDLE_NICE = 19


@dataclass(frozen=True)
class ThreadPriority:
    """One thread's ``policy`` (``os.SCHED_*``), ``nice`` (-20 .. 19) and I/O class (``psutil.IOPRIO_CLASS_*``)."""

    policy: int
    nice: int
    io_class: int

    @property
    def idle(self) -> bool:
        """Whether all three are idle (what ``lower_to_idle`` sets)."""
        return self.policy == os.SCHED_IDLE and self.nice == IDLE_NICE and self.io_class == psutil.IOPRIO_CLASS_IDLE


def thread_ids(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (Linux ``/proc/<pid>/task``), ascending.

    Raises:
        FileNotFoundError: no such process.
    """
    return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))


def priorities(pid: int) -> dict[int, ThreadPriority]:
    """Thread id -> its ``ThreadPriority``, for every thread of process ``pid`` (Linux).

    Raises:
        FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess: the process is gone.
    """
    return {tid: ThreadPriority(os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid),
                                int(psutil.Process(tid).ionice().ioclass))
            for tid in thread_ids(pid)}


def lower_to_idle(pid: int | None = None) -> list[int]:
    """Put every thread of process ``pid`` (default: this one) at idle CPU and I/O priority (the
    module docstring); threads started during the call are caught by passes repeated until no new
    thread shows up. Returns the thread ids lowered. Linux only.

    Raises:
        FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess: the process is gone.
        PermissionError: the process belongs to another user.
    """
    pid = os.getpid() if pid is None else pid
    done: set[int] = set()
    while todo := [tid for tid in thread_ids(pid) if tid not in done]:
        for tid in todo:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, IDLE_NICE)
                psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_IDLE)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass  # the thread ended meanwhile
            done.add(tid)
    return sorted(done)
