"""What the driver shows of a run as it goes: the events and steps drained from the run's journal, in
time order across both streams (``orchestrator.console.RunConsole``), fed to the run's metrics
(``orchestrator.metrics.RunMetrics``), with each step's shadow lag."""

from __future__ import annotations

import functools
from collections.abc import Callable

from raycheck.orchestrator.console import RunConsole
from raycheck.orchestrator.journal import RunRecord
from raycheck.orchestrator.metrics import RunMetrics
from raycheck.orchestrator.summary import recoveries, recovery_of_event, run_checkpoints


class RunFollower:
    """Shows and measures what ``record`` (the run's drained journal) holds that it has not shown yet.

    Args:
        record: the run's events and metric rows; the ones already there (an earlier driver's, on a
            resume) are measured, not shown again.
        console: where events and steps are shown; metrics: the run's Prometheus series.
        storage_outage: takes the snapshot storage down for the given seconds (a ``storage`` failure's
            event calls it), or None.
    """

    def __init__(self, record: RunRecord, console: RunConsole, metrics: RunMetrics,
                 storage_outage: Callable[[float], None] | None = None) -> None:
        self.record, self.console, self.metrics, self.storage_outage = record, console, metrics, storage_outage
        self.shadow_lag: dict[int, int] = {}
        """Steps the shadow was behind when each step's row came in (rows after its step: the worker's lead)."""
        self.rows_seen = 0
        self._events_seen = 0
        self._earlier = (len(record.events), len(record.metrics))

    def follow(self, shadow_step: int | None, interval_at: Callable[[int], int]) -> None:
        """Show and measure the new events and rows (``shadow_step``: the shadow's newest step, None
        without a shadow; ``interval_at``: the snapshot interval planned at a step)."""
        events, rows = self.record.events, self.record.metrics
        self.metrics.recoveries(recoveries(events, rows))
        by_event = recovery_of_event(events, rows)
        shown: list[tuple[float, Callable[[], None]]] = []  # shown in time order across both streams
        for i, e in enumerate(events[self._events_seen:], start=self._events_seen):
            seconds = by_event[i].get("seconds") if i in by_event else None
            if i >= self._earlier[0]:
                e_shown = ({**e, "checkpoints": run_checkpoints(e["checkpoints"], rows, events)}
                           if e["kind"] == "final" and "checkpoints" in e else e)  # the run's bytes, not the last incarnation's
                shown.append((e["unix_s"], functools.partial(self.console.event, e_shown, seconds)))
                if e["kind"] == "failure" and e["target"] == "storage" and self.storage_outage is not None:  # set when one is due
                    self.storage_outage(e["seconds"])
            self.metrics.event(e, seconds)
        self._events_seen = len(events)
        for i, r in enumerate(rows[self.rows_seen:], start=self.rows_seen):
            lag = None if shadow_step is None else max(0, r["step"] + 1 - shadow_step)
            if lag is not None:
                self.shadow_lag.setdefault(r["step"], lag)
            self.metrics.step(r, lag or 0, interval_at(r["step"]))
            if i >= self._earlier[1]:
                shown.append((r["unix_s"], functools.partial(self.console.step, r, lag)))
        for _, show in sorted(shown, key=lambda x: x[0]):
            show()
        self.rows_seen = len(rows)
