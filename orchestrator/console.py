"""What a run shows while it works (``raycheck run``, ``raycheck experiment``, ``run_job``): the steps'
progress, one plain sentence per event of the journal, and none of Ray's own text about the processes
raycheck killed on purpose.

- ``RunConsole`` is where every line goes: on a terminal a progress bar with an ETA (rich) under the
  lines; elsewhere (a pipe, a file, ``ray job logs``) a plain step line at the first step after each
  start or restore, then every 5 % of the run and at its last step. With ``verbose`` every step has its
  line and every event its ``key=value`` detail (``event_line``).
- ``describe`` turns an event into a sentence in steps done (the progress lines count steps from 1: "after
  step 6" is after 6 steps are done, which is step log record 5) and seconds; the events the user need
  not read (placements, phases, the worker group's starts) have none and show only with ``verbose``.
- ``InjectedFailureMessages`` keeps back Ray's raylet messages ("A worker died or was killed ...") about a
  process raycheck's failure injector ended: Ray's logs keep them; messages about any other process are
  printed as Ray would, a few seconds late.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

log = logging.getLogger(__name__)


def format_duration(seconds: float) -> str:
    """A short human reading of ``seconds``: 850 ms, 42 s, 3.5 min, 2.1 h, 1.5 d."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0), ("s", 1.0)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds * 1e3:.3g} ms"


def one_line(exc: BaseException) -> str:
    """``exc`` in one line for a warning: its type and the first line of its text (Ray's actor errors run
    to seven lines: the actor's id, pid, name, namespace and address follow)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def event_line(event: dict, recovery_seconds: float | None = None) -> str:
    """The detail line of a journal event (shown with ``--verbose``): ``[raycheck] KIND: key=value, ...``
    without its ``kind``, ``inputs``, ``marker`` and ``*unix_s`` fields, each float to 3 significant digits
    (from 1000 up, a whole number: 1234.5 -> 1234; ``events.jsonl`` and ``summary.json`` keep every digit).
    A ``recovery`` shows its own ``seconds`` as ``restore_seconds`` and ``recovery_seconds`` (from the
    failure to the restored state, seconds) as ``seconds``, named as in summary.json."""
    shown = dict(event)
    if event["kind"] == "recovery":
        shown["restore_seconds"] = shown.pop("seconds")
        shown["seconds"] = recovery_seconds

    def short(value: object) -> object:
        if not isinstance(value, float) or not math.isfinite(value):
            return value
        return f"{value:.3g}" if abs(value) < 1e3 else f"{value:.0f}"

    fields = ", ".join(f"{k}={short(v)}" for k, v in shown.items() if k not in ("kind", "inputs", "marker") and not k.endswith("unix_s"))
    return f"[raycheck] {event['kind']}: {fields}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def restored_from(source: str, base_step: int, replayed_steps: int) -> str:
    """Where a restored state came from, in words: a recovery's or a shadow restart's ``source``
    (``object_store``: a live shadow's image; ``storage`` / ``snapshot``: a snapshot in storage;
    ``initial``: the initial weights), its ``base_step`` and the logged steps replayed on top."""
    base = {"object_store": "the shadow's image", "storage": f"the snapshot of step {base_step}",
            "snapshot": f"the snapshot of step {base_step}", "initial": "the initial weights"}.get(source, f"{source} (step {base_step})")
    return base + (f" + {_plural(replayed_steps, 'logged step')} replayed" if replayed_steps else "")


RECOVERY_PATHS = {"new_process": "a new process", "in_process": "the same process", "standby": "the warm standby"}


def _shard(e: dict) -> str:
    return f" shard {e['shard']}" if "shard" in e else ""


def _failure(e: dict) -> str:
    after = f"after step {e['step']}"
    target = e["target"]
    if target == "worker":
        how = f": {e['how']}" if e.get("how") else ""
        return f"worker {e.get('rank', 0)} failed {after} (injected{how}); {_plural(e['durable_steps'], 'step')} durable"
    if target == "shadow":
        return f"shadow{_shard(e)} killed {after} (injected)" + ("" if e.get("found", True) else "; no live shadow was found")
    if target == "persister":
        return f"snapshot persister killed {after} (injected)" + ("" if e.get("found", True) else "; none was running")
    if target == "storage":
        return f"storage down for {format_duration(e['seconds'])} {after} (injected outage)"
    if target == "corrupt":
        return f"one byte of the newest snapshot flipped {after} (injected corruption of {e.get('shard')})"
    if target in ("preempt", "preempt-shadow"):
        whose = "rank 0's node" if target == "preempt" else "the shadow's node"
        return (f"preemption notice for {whose} {after}: drained, taken down in {e['grace_s']:g} s (injected)" if e.get("node_id")
                else f"preemption notice {after}: no live shadow was found (injected)")
    return f"{target} failed {after} (injected: {e.get('how')})"


def _saved(e: dict) -> str:
    what = {"workers": "the train workers' checkpoint", "step_log": "rank 0's step log", "shadow": "the shadow's image",
            "persister": "the snapshot persister's pending write"}.get(e["component"], e["component"])
    step = f" of step {e['step']}" if e.get("step") is not None else ""
    return f"preemption: {what}{step} is safe ({e['seconds']:.1f} s)"


def _preemption_rows(summary: dict) -> list[str]:
    """One line per preemption of ``summary`` (its ``preemptions``): the node, its grace, what was saved how
    long after the notice, what was not, and the steps redone."""
    rows = []
    for p in summary.get("preemptions") or []:
        grace = f"{p['grace_s']:.0f} s notice" if p.get("grace_s") is not None else "no deadline"
        saved = ", ".join(f"{s['component']} safe in {s['notice_to_safe_seconds']:.1f} s" for s in p["saved"]) or "nothing saved"
        unsaved = "".join(f", {u['component']} not saved" for u in p["unsaved"])
        redone = f", {_plural(p['recomputed_steps'], 'step')} redone" if p.get("recomputed_steps") is not None else ""
        rows.append(f"node {p['node_id'][:8]} ({', '.join(p['components']) or 'nothing of the run'}), {grace}: {saved}{unsaved}{redone}")
    return rows


def _recovery(e: dict, recovery_seconds: float | None) -> str:
    how = RECOVERY_PATHS.get(e.get("path", ""), e.get("path", "a new process"))
    if (loading_s := e.get("standby_loaded_unix_s", 0.0) - e.get("detected_unix_s", math.inf)) > 0:
        how += f" (still loading: {loading_s:.1f} s more)"
    took = (f"{recovery_seconds:.1f} s after the failure" if recovery_seconds is not None
            else f"restore took {e['seconds']:.2f} s")
    skipped = e.get("skipped") or []  # newer states that did not load (a damaged checkpoint), or why a replay stopped
    passed_over = f"; passed over: {skipped[0]}" + (f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else "") if skipped else ""
    return (f"worker {e.get('rank', 0)} restored at step {e['restored_step']} from "
            f"{restored_from(e['source'], e['base_step'], e['replayed_steps'])} in {how}, {took}{passed_over}")


def _step_log(e: dict) -> str | None:
    notes = [f"{_plural(e['rebuilt_steps'], 'step')} copied from the log keeper"] if e.get("rebuilt_steps") else []
    notes += [f"{_plural(e['sent_steps'], 'step')} the log keeper had missed sent to it"] if e.get("sent_steps") else []
    notes += [f"an old local log was replaced ({e['discarded']})"] if e.get("discarded") else []
    return f"rank 0's local step log ({_plural(e['local_steps'], 'step')}): " + "; ".join(notes) if notes else None


_SENTENCES: dict[str, Callable[[dict], str | None]] = {
    "failure": _failure,
    "step_log": _step_log,
    "accuracy": lambda e: f"accuracy before training: {e['value']:.3f}",
    "final": lambda e: (f"training done at step {e['step']}, state sha256 {e['state_sha256'][:12]}"
                        + (f", accuracy {e['accuracy_after']:.3f}" if e.get("accuracy_after") is not None else "")),
    "in_process_restart": lambda e: f"worker {e['rank']}'s step {e['step']} raised {e['error']}: rolled back in the same process ({e['reason']})",
    "in_process_refused": lambda e: f"worker {e['rank']}'s step {e['step']} raised {e['error']}: no restart in the same process ({e['reason']})",
    "torn_tail_cut": lambda e: (f"the step log's last record was torn ({e['bytes']} bytes after step {e['step']}, never "
                                "acknowledged): cut"),
    "log_adopted": lambda e: f"the step log's {_plural(e['steps'], 'step')} were read from {e['storage']}",
    "replan": lambda e: f"snapshot interval {e['previous_interval_steps']} -> {e['interval_steps']} steps ({e['reason']})",
    "plan_infeasible": lambda e: f"the snapshot policy has no plan at step {e['step']}: {e['reason']}",
    "persister_restart": lambda e: (f"snapshot persister moved off a draining node in {e['seconds']:.1f} s" if e["reason"] == "preemption"
                                    else f"snapshot persister restarted in {e['seconds']:.1f} s (it ended with {e['reason']})"),
    "preemption_notice": lambda e: (f"preemption notice: node {e['node_id'][:8]} ({', '.join(e['components'])}) goes "
                                    + (f"in {e['grace_s']:.0f} s" if e.get("grace_s") is not None else "with no deadline given")),
    "preemption_saved": _saved,
    "preemption_unsaved": lambda e: f"preemption: {e['component']} NOT saved before the node goes ({e.get('error', 'no time')})",
    "shadow_restart": lambda e: (f"shadow{_shard(e)} restarted at step {e['step']} from {restored_from(e['source'], e['step'], 0)} "
                                 f"in {e['seconds']:.1f} s ({e['reason']})"),
    "resume": lambda e: (f"resuming: the step log holds {_plural(e['durable_steps'], 'step')}"
                         + (f", the last done {format_duration(e['unix_s'] - e['last_step_unix_s'])} ago" if e.get("last_step_unix_s") else "")),
    "standby_promoted": lambda e: (None if e["promoted"] else "the warm standby was not promoted (worker failure budget spent)"
                                   if e.get("kept", True) else "no warm standby was kept: Ray Train restarts the worker"),
    "standby_decision": lambda e: e["reason"] if e.get("rank") in (None, 0) else f"worker {e['rank']}: {e['reason']}",
}
"""The sentence of each event kind that has one (``describe``)."""


def describe(event: dict, recovery_seconds: float | None = None) -> str | None:
    """The plain line of a journal event, prefixed ``[raycheck]``, or None for an event that shows only
    with ``--verbose`` (``placement``, ``phase``, ``worker_group``, ``standby_supervisor``, ``held``,
    ``calibration_snapshot``, a ``step_log`` with nothing to report). ``recovery_seconds``: for a ``recovery``, from the failure to the restored
    state (``orchestrator.summary.recovery_of_event``; None after a resume: no failure preceded it)."""
    kind = event["kind"]
    if kind == "recovery":
        return f"[raycheck] {_recovery(event, recovery_seconds)}"
    sentence = _SENTENCES.get(kind, lambda e: None)(event)
    return None if sentence is None else f"[raycheck] {sentence}"


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


class RunConsole:
    """Where a run's lines go, and the progress of its steps.

    Call it with a line to print it (above the bar when one is shown); ``begin(total, done)`` when
    training starts (``done``: steps an earlier driver did); ``step(row, shadow_lag)`` per metrics row
    (``row``: ``step`` (0-based record), ``loss``, ``step_seconds``, ``checkpoint_block_seconds``);
    ``event(event, recovery_seconds)`` per journal event; ``end()`` when the run is over. One console can
    serve several runs in turn (a run and its failure-free reference).

    Args:
        echo: where plain lines go (default ``print``).
        verbose: a line per step and per event detail.
        bar: a rich progress bar on ``file`` (default: when ``file`` is a terminal).
        plain_lines: plain step lines per run when no bar is shown (about; default 20: every 5 %).
        file: the bar's stream (default ``sys.stdout``).
    """

    def __init__(self, echo: Callable[[str], None] = print, verbose: bool = False, bar: bool | None = None,
                 plain_lines: int = 20, file: IO[str] | None = None) -> None:
        self.echo = echo
        self.verbose = verbose
        self.file = file or sys.stdout
        self.bar = self.file.isatty() if bar is None else bar
        self.plain_lines = plain_lines
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.total = 0
        self.recent: list[float] = []
        self._show_next = True
        self._warm = False

    def __call__(self, line: str) -> None:
        if self.progress is not None:
            self.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            self.echo(line)

    def begin(self, total: int, done: int = 0) -> None:
        self.total, self.recent, self._show_next, self._warm = total, [], True, False
        if self.bar and self.progress is None:
            self.progress = Progress(TextColumn("steps"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                     TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                     console=Console(file=self.file), transient=False)
            self.progress.start()
            self.task = self.progress.add_task("steps", total=total, completed=done, info="")

    def step(self, row: dict, shadow_lag: int | None = None) -> None:
        done = row["step"] + 1
        if self._warm:  # a start's first step (imports, caches, allocator) says little of the rest: no ETA from it
            self.recent = (self.recent + [row["step_seconds"]])[-10:]
        self._warm = True
        info = (f"loss {row['loss']:.4f}  {row['step_seconds']:.2f} s/step  checkpoint stall "
                f"{format_duration(row['checkpoint_block_seconds'])}" + ("" if shadow_lag is None else f"  shadow {shadow_lag} behind"))
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=done, info=info)
        every = max(1, math.ceil(self.total / max(1, self.plain_lines)))
        if self.verbose or not self.bar and (self._show_next or done % every == 0 or done == self.total):
            left = _mean(self.recent) * (self.total - done)
            self(f"step {done:>4}/{self.total}  {100 * done / max(1, self.total):3.0f}%  {info}"
                 + (f"  ETA {format_duration(left)}" if self.recent and done < self.total else ""))
        self._show_next = False

    def event(self, event: dict, recovery_seconds: float | None = None) -> None:
        line = describe(event, recovery_seconds)
        if self.verbose:
            self(event_line(event, recovery_seconds))
        elif line is not None:
            self(line)
        if event["kind"] == "recovery":
            self._show_next, self._warm = True, False  # the first step after a restore has its line, and no say in the ETA

    def end(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress, self.task = None, None


RAYLET_PID = re.compile(r"Worker PID: (\d+)")


class InjectedFailureMessages:
    """Keeps Ray's raylet messages about the processes raycheck killed on purpose off the console.

    Ray's driver prints every error the raylet publishes (a worker process that died, ...) from a
    thread of its own, through ``ray._private.worker.print_to_stdstream`` (Ray 2.60, ``listen_error_messages``;
    there is no public switch for it). ``install`` puts ``take`` in its place: raylet messages are held;
    ``release(injected_pids)`` drops those naming a process (``Worker PID: N``) that an injected failure
    ended (to the debug log) and prints the others once they are ``hold_s`` old, or at once with
    ``final``; other output passes straight through. ``uninstall`` releases what is held and puts Ray's
    function back. Without that function (another Ray) nothing is installed and Ray prints as before.
    """

    def __init__(self, hold_s: float = 10.0) -> None:
        self.hold_s = hold_s
        self.held: list[tuple[float, dict, bool]] = []
        self.lock = threading.Lock()
        self.original: Callable[..., None] | None = None

    def install(self) -> None:
        import ray._private.worker as ray_worker

        if self.original is None and callable(getattr(ray_worker, "print_to_stdstream", None)):
            self.original = ray_worker.print_to_stdstream
            ray_worker.print_to_stdstream = self.take

    def take(self, data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            self._print(data, ignore_prefix)
            return
        with self.lock:
            self.held.append((time.monotonic(), data, ignore_prefix))

    def release(self, injected_pids: Collection[int], final: bool = False) -> None:
        now = time.monotonic()
        with self.lock:
            due = [h for h in self.held if final or now - h[0] >= self.hold_s or self._pid(h[1]) in injected_pids]
            self.held = [h for h in self.held if h not in due]
        for _, data, ignore_prefix in due:
            if self._pid(data) in injected_pids:
                log.debug("Ray's message about a process raycheck ended on purpose: %s", " ".join(data["lines"]))
            else:
                self._print(data, ignore_prefix)

    def uninstall(self, injected_pids: Collection[int]) -> None:
        self.release(injected_pids, final=True)
        if self.original is not None:
            import ray._private.worker as ray_worker

            ray_worker.print_to_stdstream = self.original
            self.original = None

    @staticmethod
    def _pid(data: dict) -> int | None:
        match = RAYLET_PID.search(" ".join(data.get("lines", [])))
        return int(match.group(1)) if match else None

    def _print(self, data: dict, ignore_prefix: bool) -> None:
        if self.original is not None:
            self.original(data, ignore_prefix=ignore_prefix)


def injected_pids(events: list[dict]) -> set[int]:
    """The processes raycheck's failure injector ended: for each injected worker failure, the process of
    that rank's latest ``placement`` before it (the failure event's own ``pid`` where it has one)."""
    pids: set[int] = set()
    placed: dict[int, int] = {}
    for e in events:
        if e["kind"] == "placement" and e.get("component") == "worker":
            placed[e["rank"]] = e["pid"]
        elif e["kind"] == "failure" and e["target"] == "worker":
            pids |= {p for p in (e.get("pid"), placed.get(e.get("rank", 0))) if p is not None}
    return pids


def _verdict(summary: dict) -> str:
    if summary.get("bitwise_equal") is True:
        return "recovery exact: bitwise equal to the failure-free run"
    if summary.get("bitwise_equal") is False or summary.get("lost_steps") or summary.get("shadow_equal") is False:
        return "recovery NOT exact (see summary.json)"
    return "no step lost (--verify also compares with a failure-free run, bitwise)"


def _exactness(summary: dict) -> str:
    parts = [f"{_plural(summary.get('lost_steps') or 0, 'step')} lost"]
    if summary.get("shadow_equal") is not None:
        parts.append(f"the shadow's state {'equals' if summary['shadow_equal'] else 'DIFFERS from'} the worker's")
    if summary.get("bitwise_equal") is not None:
        parts.append(f"the failure-free run's state {'equals' if summary['bitwise_equal'] else 'DIFFERS from'} this one's")
    if summary.get("state_sha256"):
        parts.append(f"state sha256 {summary['state_sha256'][:16]}")
    return "; ".join(parts)


def _recovery_rows(summary: dict) -> list[str]:
    rows = []
    for r in summary.get("recoveries") or []:
        took = f"{r['seconds']:.1f} s after the failure" if r.get("seconds") is not None else f"restore {r['restore_seconds']:.2f} s"
        rows.append(f"step {r['restored_step']} from {restored_from(r['source'], r['base_step'], r['replayed_steps'])} "
                    f"in {RECOVERY_PATHS.get(r.get('path', ''), 'a new process')}, {took}")
    return rows or ["none"]


def summary_table(summary: dict, printed: dict, out: object) -> list[str]:
    """The lines ``raycheck run`` ends with: a title line, then ``label  value`` rows (steps, exact or
    not, failures, recoveries with their seconds, restarts, timings, where the results are).

    Args:
        summary: the run's ``summary.json`` dict.
        printed: ``cli.main.printed_summary``'s block (for a failed run: ``logged_steps``, ``resume``).
        out: the run directory.
    """
    if not summary.get("ok"):
        rows = [("error", str(printed.get("error"))), ("phase", str(printed.get("phase")))]
        if "logged_steps" in printed:
            rows.append(("step log", f"{_plural(printed['logged_steps'], 'step')}, all recoverable"))
        rows.append(("resume", str(printed["resume"])))
        title = "raycheck run failed"
    else:
        failures = [f"{f['target']} after step {f['step']}" + (f" ({f['how']})" if f.get("how") else "") for f in summary.get("failures") or []]
        step_s, stall_s = summary.get("mean_step_seconds"), summary.get("mean_checkpoint_block_seconds")
        rows = [("exact", _exactness(summary)), ("failures", ", ".join(failures) or "none")]
        rows += [("recoveries" if i == 0 else "", row) for i, row in enumerate(_recovery_rows(summary))]
        rows.append(("restarts", f"shadow {len(summary.get('shadow_restarts') or [])}, snapshot persister "
                                 f"{summary.get('persister_restarts') or 0}, driver resumes {len(summary.get('resumes') or [])}"))
        rows += [("preemption" if i == 0 else "", row) for i, row in enumerate(_preemption_rows(summary))]
        if step_s:
            stall = stall_s or 0.0  # measured apart from the step: the loop's time is their sum
            rows.append(("step time", f"{format_duration(step_s)} mean, plus {format_duration(stall)} checkpointing blocked "
                                      f"the loop ({100 * stall / (step_s + stall):.1f} % of its time)"))
        if summary.get("accuracy_before") is not None:
            rows.append((summary.get("eval_metric") or "accuracy", f"{summary['accuracy_before']:.3f} before, "
                                                                   f"{summary['accuracy_after']:.3f} after"))
        rows.append(("wall time", format_duration(summary.get("wall_seconds") or 0.0)))
        if reported := summary.get("ray_train_checkpoint"):
            rows.append(("checkpoint", f"Ray Train's Result.checkpoint (step {reported.get('step')}): {reported['path']}"))
        title = f"raycheck run finished: {summary['final_step']} steps, {_verdict(summary)}"
    rows.append(("results", f"{out}/summary.json, {out}/metrics.parquet"))
    width = max(len(label) for label, _ in rows)
    return [title, *(f"  {label:<{width}}  {value}" for label, value in rows)]
