"""Pure analysis behind ``experiments.report``: the tables of (a)-(d), the headline ratios and why a target is missed.

Input rows are the dicts of ``runs.parquet`` and ``recoveries.parquet`` (``load_results``); every
function returns rows (dicts) or text computed from them, no files and no plots. Seconds (``_s``),
steps (``_steps``) and bytes throughout; ratios are a baseline's value over ours (> 1: ours is lower).

Sources: J. W. Young, CACM 17(9), 1974 and J. T. Daly, FGCS 22(3), 2006 (the checkpoint waste models
``policies.models`` implements and ``policies.simulate`` plays out, and the first-order terms of
``waste_terms``); ZOCheck (arXiv 2026) for the CPU shadow, its cost model and the paper's numbers.
"""

from __future__ import annotations

import math
import pathlib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from raycheck.experiments.results import BREAKDOWN_PREFIX
from raycheck.orchestrator.summary import BREAKDOWN, RAY_TRAIN_COMPONENTS
from raycheck.policies.costs import InfeasibleError, MeasuredCosts
from raycheck.policies.models import Strategy, expected_waste, optimal_interval_steps
from raycheck.policies.simulate import SimResult, simulate

OURS = Strategy.SHADOW
BASELINES = (Strategy.FULL_SYNC, Strategy.FULL_ASYNC, Strategy.LOG_ONLY)
ORDER = (OURS, *BASELINES)
PAPER_BASELINE = Strategy.FULL_ASYNC
"""ZOCheck's numbers and the issue's targets are against asynchronous full-state checkpoints."""
PAPER_RATIO = {"overhead": 219.7, "recovery": 1.55, "wasted": 21.3}
"""ZOCheck (arXiv 2026), ours vs asynchronous full-state: checkpoint overhead up to 219.7x lower,
recovery latency 1.55x lower on average, end-to-end wasted time up to 21.3x lower."""
TARGET_RATIO = {"overhead": 100.0, "recovery": 5.0, "wasted": 10.0}
"""The issues' targets on SmolLM2-135M vs full-async (wasted time at the grid's highest failure rate); recovery's
is issue 13's ("Recover in seconds", item 5), the others the first experiment's."""

APPEND_INFLATION_TARGET = 2.0
"""Issue 10's target for the step log under snapshot load: our mean append while the shadow's snapshots are
written at most this many times the quiet median (the log-only run's: no snapshots, the same durability)."""

RUN_COLUMNS = (
    "strategy", "model", "steps", "interval_steps", "failures", "bitwise_equal", "wall_s", "mean_step_s",
    "block_s_total", "block_s_per_step", "checkpoints", "snapshots", "block_s_per_checkpoint", "bytes_written",
    "snapshot_s", "stall_s", "replay_step_s", "log_append_s",
)
RECOVERY_COLUMNS = (
    "strategy", "at_step", "restored_step", "source", "latency_s", "restart_s", "load_s", "replay_s",
    "replayed_steps", "recompute_s", "recompute_steps",
)
RECOVERY_PARTS = ("restart_s", "load_s", "replay_s", "recompute_s", "other_s")
"""The recovery breakdown; ``other_s`` is the latency the four measured parts leave unexplained."""

GRID_MIN_STEPS = 10
"""The default grid's highest failure rate: a failure at most every this many mean steps ..."""
GRID_MIN_DOWNTIMES = 5
"""... and at most every this many recoveries (restart + load of the slowest strategy), so that every
strategy still makes progress (a recovery takes at most 1/5 of the time between failures)."""
GRID_DECADES, GRID_POINTS = 2, 5
"""The default grid spans this many decades of MTBF above its highest rate, log-spaced."""
MAX_WASTE_RATIO = 100.0
"""A cell whose closed-form waste ratio exceeds this is reported as making no progress, not simulated."""
MEAN_FAILURES = 2000
"""Failures aimed for per seed and cell when sizing the simulated horizon (at least ``min_failures``)."""
MAX_LOG_ONLY_RUNS = 20_000
"""At most this many simulated log-only runs per seed when aiming at ``MEAN_FAILURES`` (more only if
needed for ``min_failures``): a short run against a long MTBF rarely fails."""
_MAX_DOUBLINGS = 16
_NOT_FLOAT = ("strategy", "model", "source", "path", "bitwise_equal", "durability")
PATHS = ("new_process", "in_process", "standby")
"""How a worker recovered (``recoveries.parquet``'s ``path``): Ray Train started a new process, the
failed process restored itself (``training.in_process``), or a warm standby took over (``workers.standby``)."""
NEW_PROCESS_START = tuple(c.removesuffix("_s") for _, c in BREAKDOWN[:BREAKDOWN.index(("restore_began_unix_s", "log_setup_s"))])
"""The breakdown's components that start a new process (Ray Train's restart of the worker group, then
imports, model and data load): the floor of a ``new_process`` recovery, counted as one."""
NEW_PROCESS_FLOOR = "new process start"
TOTAL = "failure -> first step done"
FIRST_STEP = BREAKDOWN_PREFIX + BREAKDOWN[-1][1]
"""The breakdown column of the first step after the restore, which the recovery latency does not hold."""
"""The breakdown table's last row per path: the sum of the components (``first_step_s``)."""
FLOOR_WHY = {
    NEW_PROCESS_FLOOR: "a replacement process must start, join a new worker group and import torch, Ray Train and "
                       "transformers and build the model before any state moves",
    "detection": "the time until the failure is acted on (Ray Train's health poll, or the train function catching the "
                 "step's exception)",
    "log_setup": "the step log made consistent (rank 0's local log reopened and made equal to the keeper's) before the "
                 "restore",
    "state_transfer": "the freshest full state is read (the shadow's image through the object store, or a snapshot from "
                      "storage): it grows with the model",
    "replay": "the logged steps after the base state are replayed and the state moved to the device",
}
"""Why each component that can be a recovery's floor costs what it does (``recovery_floor``)."""

# Two-sided 95% Student-t quantiles t_{0.975, df} for df = 1..30.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


# ---------------------------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True)
class Headline:
    """One of our ratios against one baseline (baseline's value / ours: > 1 means ours is better)."""

    metric: str
    """``overhead`` (a, at equal durability), ``recovery`` (b, mean latency) or ``wasted`` (c, at the
    grid's highest failure rate)."""
    baseline: str
    ratio: float | None
    """None when either side is not measured or not feasible (``why`` says which)."""
    paper: float | None
    """ZOCheck's ratio for this metric (only against full-async)."""
    target: float | None
    """The issue's target for this metric (only against full-async)."""
    why: str | None = None
    """When the target is missed or the ratio is unavailable: the reason, from the measurements."""
    paths: str = ""
    """For ``recovery`` and ``wasted``: which path (``PATHS``) our and the baseline's measured recoveries
    took, e.g. ``shadow in_process: 2; full-async in_process: 2``."""

    @property
    def met(self) -> bool | None:
        """Whether the target is met; None without a target."""
        if self.target is None:
            return None
        return self.ratio is not None and self.ratio >= self.target


# ---------------------------------------------------------------------------------------------- inputs


def load_results(results_dir: pathlib.Path) -> tuple[list[dict], list[dict]]:
    """Read and validate ``runs.parquet`` and ``recoveries.parquet`` of ``results_dir``.

    Returns the rows of each as dicts (nulls as NaN for float columns; a recovery without ``path``,
    from results older than the in-process warm path, as ``new_process``).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file is empty, lacks columns, names an unknown strategy, or no ``shadow`` run exists.
    """
    runs = read_rows(pathlib.Path(results_dir) / "runs.parquet", RUN_COLUMNS)
    recoveries = [{**r, "path": r.get("path") or PATHS[0]}  # results older than the warm path: a new process
                  for r in read_rows(pathlib.Path(results_dir) / "recoveries.parquet", RECOVERY_COLUMNS)]
    if not any(r["strategy"] == OURS for r in runs):
        raise ValueError(f"runs.parquet has no {OURS!s} run: the ratios are ours against each baseline; run the shadow strategy")
    return runs, recoveries


def read_rows(path: pathlib.Path, columns: Sequence[str], kinds: type[StrEnum] = Strategy) -> list[dict]:
    """The rows of ``path`` with ``columns`` required, each ``strategy`` parsed as one of ``kinds``
    (default ``Strategy``, the cost model's; the first-order report passes ``RunStrategy``)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: `raycheck experiment` writes it into the results folder; run it first")
    table = pq.read_table(path)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(f"{path} lacks columns {missing} (has {table.column_names})")
    if table.num_rows == 0:
        raise ValueError(f"{path} has no rows: every strategy needs at least one run and one injected failure")
    rows = table.to_pylist()
    for r in rows:
        try:
            r["strategy"] = kinds(r["strategy"])
        except ValueError:
            known = [str(s) for s in kinds]
            raise ValueError(f"{path}: unknown strategy {r['strategy']!r}; expected one of {known}") from None
        for k, v in r.items():
            if v is None and k not in _NOT_FLOAT:
                r[k] = math.nan
    return rows


def _by_strategy(rows: list[dict], order: Sequence[StrEnum] = ORDER) -> dict[Any, list[dict]]:
    """Rows grouped by strategy in ``order`` (default: ours first, then the baselines in ``BASELINES`` order)."""
    return {s: [r for r in rows if r["strategy"] == s] for s in order if any(r["strategy"] == s for r in rows)}


# ---------------------------------------------------------------------------------------------- statistics


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (two-sided 95%).

    A table for df <= 30, the Cornish-Fisher expansion beyond (error < 1e-4).

    Raises:
        ValueError: ``df`` < 1.
    """
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values: Sequence[float], nonnegative: bool = False) -> tuple[float, float | None, float | None]:
    """Mean and two-sided 95% Student-t interval of ``values`` (NaNs dropped); (mean, None, None) for one value.
    ``nonnegative``: the quantity cannot be negative by construction (an absolute value, a duration, a
    ratio of wasted time): the interval's lower bound is clamped at 0 (the symmetric t interval of a few
    spread values reaches below 0; the tables printing it say so in their footnote).

    Raises:
        ValueError: no finite value.
    """
    x = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if x.size == 0:
        raise ValueError("no values to average")
    m = float(x.mean())
    if x.size < 2:
        return m, None, None
    half = t975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return m, max(0.0, m - half) if nonnegative else m - half, m + half


def _mean(rows: list[dict], column: str) -> float:
    """Mean of a column over rows, NaN when none is finite."""
    values = [float(r[column]) for r in rows if not math.isnan(float(r[column]))]
    return statistics.fmean(values) if values else math.nan


def ratio(baseline: float, ours: float) -> float:
    """``baseline / ours`` (how many times lower ours is); NaN when either is unknown, inf when ours is 0."""
    if baseline is None or ours is None or math.isnan(baseline) or math.isnan(ours):
        return math.nan
    if ours == 0:
        return math.inf if baseline > 0 else math.nan
    return baseline / ours


# ---------------------------------------------------------------------------------------------- (a) overhead


def overhead_table(runs: list[dict]) -> list[dict]:
    """(a) Blocked seconds per strategy (means over its runs) and our ratio against each.

    Columns: ``block_s_per_step``, ``block_s_total`` (as run), ``block_s_per_point`` (per durable
    point: a log append for shadow/log-only, a checkpoint for the full strategies), and at equal
    durability, every strategy durable every step as ours is: ``eq_block_s_per_step`` = blocked seconds
    per durable point x one point per step, ``eq_block_s_total`` = that x steps. ``ratio_as_run`` and
    ``ratio_equal_durability`` are the strategy's value over ours. ``eq_write_wait_s_per_step``
    (full-async only) is what one checkpoint per step would add on top, modelled: the wait for the
    previous write, max(0, snapshot_s - mean_step_s); the measured definition leaves it out, so the
    full-async ratio at equal durability is a lower bound.
    """
    rows: list[dict[str, Any]] = []
    for strategy, rs in _by_strategy(runs).items():
        per_point = _mean(rs, "block_s_per_checkpoint")
        checkpoints = _mean(rs, "checkpoints")
        wait = max(0.0, _mean(rs, "snapshot_s") - _mean(rs, "mean_step_s")) if strategy is Strategy.FULL_ASYNC else 0.0
        rows.append({
            "strategy": str(strategy), "runs": len(rs), "steps": _mean(rs, "steps"),
            "interval_steps": _mean(rs, "interval_steps"),
            "checkpoints": checkpoints, "snapshots": _mean(rs, "snapshots"), "mean_step_s": _mean(rs, "mean_step_s"),
            "block_s_per_step": _mean(rs, "block_s_per_step"), "block_s_total": _mean(rs, "block_s_total"),
            "block_s_per_point": per_point, "eq_block_s_per_step": per_point, "eq_block_s_total": per_point * _mean(rs, "steps"),
            "eq_write_wait_s_per_step": wait, "bytes_written": _mean(rs, "bytes_written"),
            "bytes_per_point": _mean(rs, "bytes_written") / checkpoints if checkpoints > 0 else math.nan,
        })
    ours = ours_row(rows)
    for r in rows:
        r["ratio_as_run"] = ratio(r["block_s_per_step"], ours["block_s_per_step"])
        r["ratio_equal_durability"] = ratio(r["eq_block_s_per_step"], ours["eq_block_s_per_step"])
    return rows


def append_inflation(runs: list[dict]) -> dict | None:
    """The step log's append under snapshot load against the quiet median (issue 10's target,
    ``APPEND_INFLATION_TARGET``), or None when not measured (no ``shadow`` or ``log-only`` run, results from
    before ``runs.parquet`` had ``log_append_median_s``, or runs recorded at different durability levels, as in a
    results folder assembled by hand from two experiments: their appends are not comparable).

    Returns ``loaded_mean_s`` (our mean blocked seconds per append, the shadow persisting snapshots on the
    same disk), ``quiet_median_s`` (the log-only run's median: no snapshots, the same durability level),
    ``ratio`` = the first over the second (dimensionless), ``target``, ``met`` and our ``durability`` (the step
    log's level, ``job.config.DURABILITIES``; "" in results from before it was recorded).
    """
    by = _by_strategy(runs)
    if OURS not in by or Strategy.LOG_ONLY not in by:
        return None
    levels = {str(r.get("durability") or "") for r in by[OURS] + by[Strategy.LOG_ONLY]} - {""}
    if len(levels) > 1:
        return None
    loaded = _mean(by[OURS], "log_append_s")
    quiet = statistics.median([r.get("log_append_median_s", math.nan) for r in by[Strategy.LOG_ONLY]])
    if not (is_finite(loaded) and is_finite(quiet)) or quiet <= 0:
        return None
    r = loaded / quiet
    return {"loaded_mean_s": loaded, "quiet_median_s": quiet, "ratio": r, "target": APPEND_INFLATION_TARGET,
            "met": r <= APPEND_INFLATION_TARGET, "durability": str(by[OURS][0].get("durability") or "")}


def ours_row(rows: list[dict]) -> dict:
    """Our (``shadow``) row of a table, ``{}`` when absent."""
    return next((r for r in rows if r["strategy"] == OURS), {})


def why_overhead(ours: dict, base: dict, target: float) -> str | None:
    """Why the equal-durability overhead ratio misses ``target``, from the measured blocked seconds; None if met."""
    r = base.get("ratio_equal_durability", math.nan)
    if r >= target:
        return None
    if math.isnan(r):
        return f"not measured: {base.get('strategy', 'the baseline')} made no checkpoint, or ours has no log append time"
    mb = base["bytes_per_point"] / 1e6
    per_point = base["block_s_per_point"]
    rate = f" ({mb:.3g} MB per checkpoint, {mb / per_point:.3g} MB/s)" if mb > 0 and per_point > 0 else ""
    return (
        f"one log append blocks the loop {fmt_seconds(ours['block_s_per_point'])} and one {base['strategy']} checkpoint "
        f"{fmt_seconds(per_point)}{rate}; at equal durability the ratio is their quotient, {r:.3g}x < {target:g}x. "
        f"The checkpoint's blocked time grows with the state while the append's does not: at these rates the target "
        f"needs a state about {target / r:.3g}x larger or an append {target / r:.3g}x faster."
    )


# ---------------------------------------------------------------------------------------------- (b) recovery


def recovery_table(recoveries: list[dict], order: Sequence[StrEnum] = ORDER) -> list[dict]:
    """(b) Mean recovery latency per strategy (seconds), its breakdown, n, a 95% interval, our ratio.

    ``other_s`` = latency minus restart, load, replay and recompute (what the measured parts leave
    unexplained); ``fixed_s`` = latency minus load, replay and recompute (restart, detection and
    anything else a recovery pays whatever the strategy): the simulator's ``restart_s``; ``paths``
    (``path_counts``) says which path the recoveries took; ``shadow_loss_share`` is the share of
    recoveries that did not take a live shadow's image (source other than ``object_store``) and
    ``live_replayed_steps`` the mean steps replayed by those that did (NaN: none did). The interval is Student's t over the strategy's recoveries (None for a single one), its lower bound clamped at 0.
    Strategies in ``order`` (default ``ORDER``; ``ratio`` is NaN without a ``shadow`` row).
    """
    rows: list[dict[str, Any]] = []
    for strategy, rs in _by_strategy(recoveries, order).items():
        mean, lo, hi = mean_ci([float(r["latency_s"]) for r in rs], nonnegative=True)
        parts = {p: _mean(rs, p) for p in RECOVERY_PARTS[:-1]}
        sources = sorted({r["source"] for r in rs})
        live = [r for r in rs if r["source"] == "object_store"]
        rows.append({
            "strategy": str(strategy), "n": len(rs), "latency_s": mean, "latency_lo_s": lo, "latency_hi_s": hi, **parts,
            "other_s": mean - sum(parts.values()),
            "fixed_s": max(0.0, mean - parts["load_s"] - parts["replay_s"] - parts["recompute_s"]),
            "replayed_steps": _mean(rs, "replayed_steps"), "recompute_steps": _mean(rs, "recompute_steps"),
            "sources": ", ".join(f"{s}: {sum(r['source'] == s for r in rs)}" for s in sources),
            "paths": path_counts(rs),
            "shadow_loss_share": 1 - len(live) / len(rs), "live_replayed_steps": _mean(live, "replayed_steps") if live else math.nan,
        })
    ours = ours_row(rows)
    for r in rows:
        r["ratio"] = ratio(r["latency_s"], ours.get("latency_s", math.nan))
    return rows


def path_counts(recoveries: list[dict]) -> str:
    """Which path (``PATHS``) ``recoveries`` took, e.g. ``in_process: 2``; ``new_process`` for a row without one."""
    paths = [r.get("path") or PATHS[0] for r in recoveries]
    return ", ".join(f"{p}: {paths.count(p)}" for p in (*PATHS, *sorted(set(paths) - set(PATHS))) if p in paths)


def _has(row: dict, column: str) -> bool:
    return column in row and row[column] is not None and not math.isnan(float(row[column]))


def breakdown_table(recoveries: list[dict], order: Sequence[StrEnum] = ORDER) -> list[dict]:
    """(b) The recovery breakdown per path (``PATHS``): for each path the recoveries took, one row per
    component they have (``orchestrator.summary.BREAKDOWN``, or ``IN_PROCESS_BREAKDOWN`` for
    ``in_process``; a combined one where two could not be separated), in the order the recoveries list
    them, with ``path``, ``owner`` (``Ray Train`` for its restart of the worker group, which only a
    ``new_process`` recovery has, else ``raycheck``) and each strategy's mean seconds over its
    recoveries on that path that have the component (NaN: none); each path's last row is ``TOTAL``
    (failure to the first step done, their sum). ``[]`` when no recovery has a breakdown. Strategies in
    ``order`` (default ``ORDER``)."""
    rows = []
    for path in dict.fromkeys(r.get("path") or PATHS[0] for r in recoveries):
        on_path = [r for r in recoveries if (r.get("path") or PATHS[0]) == path]
        columns = list(dict.fromkeys(k for r in on_path for k in r if k.startswith(BREAKDOWN_PREFIX) and _has(r, k)))
        by_strategy = _by_strategy(on_path, order)
        for column in [*columns, "first_step_s"] if columns else []:
            name = TOTAL if column == "first_step_s" else column.removeprefix(BREAKDOWN_PREFIX).removesuffix("_s")
            ray_train = path == PATHS[0] and set(name.split("+")) <= RAY_TRAIN_COMPONENTS
            row = {"path": path, "component": name, "owner": "" if name == TOTAL else "Ray Train" if ray_train else "raycheck"}
            row.update({str(s): _mean([r for r in rs if _has(r, column)], column) if any(_has(r, column) for r in rs)
                        else math.nan for s, rs in by_strategy.items()})
            rows.append(row)
    return rows


def recovery_floor(recoveries: list[dict], strategy: Strategy | str = OURS) -> dict | None:
    """The floor of ``strategy``'s recovery latency: the largest component of its measured breakdown
    before the first step (the ``first_step`` component is not in the latency), the components that start a new
    process (``NEW_PROCESS_START``) counted as one, ``NEW_PROCESS_FLOOR``. Each component's seconds
    are its mean contribution per recovery (0 for a recovery that does not have it, e.g. an in-process
    one has no process start), so the components add up to the mean breakdown.

    Returns ``component``, ``seconds``, ``parts`` (a new process start's own components, seconds
    each), ``paths`` (``path_counts``), ``why`` (``FLOOR_WHY``); None when no recovery of ``strategy``
    has a breakdown.
    """
    rs = [r for r in recoveries if r["strategy"] == strategy
          and any(k.startswith(BREAKDOWN_PREFIX) and _has(r, k) and k != FIRST_STEP for k in r)]
    if not rs:
        return None
    candidates: dict[str, float] = {}
    start: dict[str, float] = {}  # a new process start's components, only on the new-process path
    for r in rs:
        for column in (k for k in r if k.startswith(BREAKDOWN_PREFIX) and _has(r, k) and k != FIRST_STEP):
            name = column.removeprefix(BREAKDOWN_PREFIX).removesuffix("_s")
            share = float(r[column]) / len(rs)
            if (r.get("path") or PATHS[0]) == PATHS[0] and set(name.split("+")) <= set(NEW_PROCESS_START):
                start[name] = start.get(name, 0.0) + share
                name = NEW_PROCESS_FLOOR
            candidates[name] = candidates.get(name, 0.0) + share
    name, seconds = max(candidates.items(), key=lambda kv: kv[1])
    return {"component": name, "seconds": seconds, "parts": start if name == NEW_PROCESS_FLOOR else {},
            "paths": path_counts(rs), "why": FLOOR_WHY.get(name, "")}


def floor_text(floor: dict, latency_s: float) -> str:
    """``recovery_floor``'s sentence: the component, its seconds and share of ``latency_s``, its parts and why."""
    parts = ", ".join(f"{c} {v:.3g} s" for c, v in floor["parts"].items())
    return (f"the floor of our recovery ({floor['paths']}) is **{floor['component']}**, {floor['seconds']:.3g} s of our "
            f"{latency_s:.3g} s latency ({100 * floor['seconds'] / latency_s:.0f}%, mean per recovery from the breakdown"
            + (f": {parts}" if parts else "") + ")" + (f": {floor['why']}" if floor["why"] else ""))


def why_recovery(ours: dict, base: dict, target: float, floor: dict | None = None) -> str | None:
    """Why the recovery ratio misses ``target``: our largest latency part and the ratio it alone allows, or,
    given our ``floor`` (``recovery_floor``), that breakdown component and the ratio it alone allows; None if met."""
    r = base.get("ratio", math.nan)
    if r >= target:
        return None
    if not ours or math.isnan(r):
        return f"not measured: no recoveries of {OURS} or of {base.get('strategy', 'the baseline')} in recoveries.parquet"
    base_parts = ", ".join(f"{p[:-2]} {base[p]:.3g} s" for p in RECOVERY_PARTS if base[p] and not math.isnan(base[p]))
    if floor is not None and floor["seconds"] > 0:
        return (f"{floor_text(floor, ours['latency_s'])}. {base['strategy']} ({base['paths']}) takes {base['latency_s']:.3g} s "
                f"({base_parts}); our {floor['component']} alone bounds the ratio at {base['latency_s']:.3g} / "
                f"{floor['seconds']:.3g} = {fmt_ratio(ratio(base['latency_s'], floor['seconds']))} even if every other "
                f"part took no time; measured ratio {r:.3g}x < {target:g}x.")
    parts = {p: ours[p] for p in RECOVERY_PARTS if not math.isnan(ours[p])}
    name, value = max(parts.items(), key=lambda kv: kv[1])
    text = (
        f"{name[:-2]} is {value:.3g} s of our {ours['latency_s']:.3g} s latency ({100 * value / ours['latency_s']:.0f}%); "
        f"{base['strategy']} takes {base['latency_s']:.3g} s ({base_parts}). Our {name[:-2]} alone bounds the ratio at "
        f"{base['latency_s']:.3g} / {value:.3g} = {fmt_ratio(ratio(base['latency_s'], value))} "
        f"even if every other part took no time"
    )
    ours_work, base_work = ours["load_s"] + ours["replay_s"], base["load_s"] + base["recompute_s"]
    if ours_work > base_work:
        text += (f"; our load + replay ({ours_work:.3g} s, {ours['replayed_steps']:.3g} steps replayed on average) exceeds "
                 f"{base['strategy']}'s load + recompute ({base_work:.3g} s)")
    return text + f"; measured ratio {r:.3g}x < {target:g}x."


# ---------------------------------------------------------------------------------------------- (c) wasted time


def measured_costs(run: dict, recovery: dict | None, *, mtbf_s: float, background_weight: float = 0.0) -> MeasuredCosts:
    """The ``MeasuredCosts`` of one real run at an assumed MTBF (seconds).

    From the run: ``step_s`` = ``mean_step_s``; ``replay_step_s`` (the full strategies recompute
    instead, at ``step_s``, which is what the simulator charges them: their value is unused);
    ``snapshot_s`` (0 for log-only); ``stall_s``; ``log_append_s``. From the strategy's recoveries
    (``recovery_table``): ``restart_s`` = ``fixed_s`` (restart, detection and the unexplained rest)
    and ``load_s``; for the shadow also ``shadow_loss_fraction`` (the share of its recoveries that found
    no live image) and ``live_replay_steps`` (what those that found one replayed).

    Raises:
        ValueError: no recovery was measured for the strategy, or a cost is missing or invalid (the
            message names it).
    """
    strategy = Strategy(run["strategy"])
    if not recovery:
        raise ValueError(f"no recoveries of {strategy} in recoveries.parquet: its restart and load times are unknown")
    replay = run["replay_step_s"] if strategy in (Strategy.SHADOW, Strategy.LOG_ONLY) else run["mean_step_s"]
    snapshot = 0.0 if strategy is Strategy.LOG_ONLY else run["snapshot_s"]
    shadow: dict[str, Any] = {}  # MeasuredCosts field -> value
    if strategy is Strategy.SHADOW:
        shadow = {"shadow_loss_fraction": float(recovery["shadow_loss_share"]),
                  "live_replay_steps": float(nan_to_zero(recovery["live_replayed_steps"]))}
    return MeasuredCosts(
        step_s=float(run["mean_step_s"]), replay_step_s=float(replay), snapshot_s=float(snapshot),
        restart_s=float(recovery["fixed_s"]), load_s=float(recovery["load_s"]), mtbf_s=float(mtbf_s),
        stall_s=float(nan_to_zero(run["stall_s"])), log_append_s=float(nan_to_zero(run["log_append_s"])),
        background_weight=background_weight, **shadow,
    )


def nan_to_zero(x: float) -> float:
    """0 for NaN (a cost a strategy does not have), else ``x``."""
    return 0.0 if math.isnan(x) else x


def default_grid_mtbf_s(runs: list[dict], recoveries: list[dict]) -> list[float]:
    """The default grid of job MTBFs (seconds), highest failure rate first.

    The highest rate is a failure every max(``GRID_MIN_STEPS`` median mean steps,
    ``GRID_MIN_DOWNTIMES`` x the slowest strategy's restart + load), so every strategy still
    progresses; the grid spans ``GRID_DECADES`` decades above it in ``GRID_POINTS`` log-spaced MTBFs
    (e.g. every 10 to every 1000 steps when restarts are short against a step).
    """
    step_s = statistics.median(float(r["mean_step_s"]) for r in runs)
    downtime_s = max((r["fixed_s"] + r["load_s"] for r in recovery_table(recoveries)), default=0.0)
    lo = max(GRID_MIN_STEPS * step_s, GRID_MIN_DOWNTIMES * downtime_s)
    return [lo * 10 ** (GRID_DECADES * i / (GRID_POINTS - 1)) for i in range(GRID_POINTS)]


class _NoProgress(Exception):
    """The closed-form waste is beyond ``MAX_WASTE_RATIO``: the job barely progresses."""


def _interval(strategy: Strategy, run: dict, costs: MeasuredCosts, intervals: str) -> int | None:
    if strategy is Strategy.LOG_ONLY:
        return None
    if intervals == "optimal":
        return optimal_interval_steps(strategy, costs)
    k = int(run["interval_steps"]) if not math.isnan(run["interval_steps"]) else 0
    if k < 1:
        raise InfeasibleError(f"{strategy} ran with interval_steps={run['interval_steps']!r}: it needs >= 1")
    return k


def _simulate_enough(strategy: Strategy, costs: MeasuredCosts, k: int | None, run_s: float, waste: float, seed: int,
                     min_failures: int) -> SimResult:
    """Simulate one seed, sized for ``MEAN_FAILURES`` failures, doubling the horizon (or, for log-only, the
    number of runs of the real run's length ``run_s``) until it has at least ``min_failures``."""
    target_s = max(MEAN_FAILURES, min_failures) * costs.mtbf_s / (1 + waste)
    if strategy is Strategy.LOG_ONLY:
        needed = math.ceil(2 * min_failures * costs.mtbf_s / ((1 + waste) * run_s))
        horizon_s, runs = run_s, max(1, needed, min(MAX_LOG_ONLY_RUNS, math.ceil(target_s / run_s)))
    else:
        horizon_s, runs = max(target_s, 2 * (k or 1) * costs.step_s), 1
    for _ in range(_MAX_DOUBLINGS):
        result = simulate(strategy, costs, horizon_s=horizon_s, interval_steps=k, runs=runs, seed=seed)
        if result.failures >= min_failures:
            return result
        runs, horizon_s = (runs * 2, horizon_s) if strategy is Strategy.LOG_ONLY else (runs, horizon_s * 2)
    raise RuntimeError(f"{strategy}: fewer than {min_failures} failures after {_MAX_DOUBLINGS} doublings of the horizon")


def simulate_cell(strategy: Strategy, runs: list[dict], recovery: dict | None, mtbf_s: float, *, seeds: int,
                  min_failures: int, background_weight: float = 0.0, intervals: str = "measured") -> dict:
    """One (strategy, MTBF) cell of (c): the waste ratio over ``seeds`` seeds of each real run's costs.

    Each sample is one seed (0..seeds-1, shared by every strategy: common random numbers) of one
    run's ``MeasuredCosts`` at ``mtbf_s``, with the run's interval (``intervals="measured"``) or the
    closed-form optimum (``"optimal"``). Interval strategies are simulated as one long run (steady
    state); log-only, whose replay grows with the run, as runs of the real run's length. Each seed
    has at least ``min_failures`` failures. Returns a row: ``status`` ``ok``, ``infeasible`` (a
    ``policies`` constraint fails, e.g. the shadow cannot keep up), ``no-progress`` (closed-form waste
    above ``MAX_WASTE_RATIO``) or ``unmeasured``, with ``reason``; the waste mean and 95% interval,
    the closed-form prediction (``policies.models.expected_waste``) and failure counts.
    """
    row = {"mtbf_s": mtbf_s, "strategy": str(strategy), "status": "ok", "reason": None, "interval_steps": None,
           "samples": 0, "min_failures_per_seed": None, "failures": 0, "waste_ratio": math.nan, "waste_lo": None,
           "waste_hi": None, "analytic_waste_ratio": math.nan}
    samples, analytic, per_seed = [], [], []
    try:
        for run in runs:
            costs = measured_costs(run, recovery, mtbf_s=mtbf_s, background_weight=background_weight)
            k = _interval(strategy, run, costs, intervals)
            row["interval_steps"] = row["interval_steps"] or k
            run_s = max(1.0, float(run["steps"])) * costs.step_s
            waste = expected_waste(strategy, costs, interval_steps=k, horizon_s=run_s)
            analytic.append(waste)
            if not waste <= MAX_WASTE_RATIO:
                raise _NoProgress(f"closed-form waste ratio {waste:.3g} > {MAX_WASTE_RATIO:g}: recoveries keep failing "
                                  f"at MTBF {mtbf_s:.3g} s (restart + load {costs.downtime_s:.3g} s)")
            for seed in range(seeds):
                result = _simulate_enough(strategy, costs, k, run_s, waste, seed, min_failures)
                samples.append(result.waste_ratio)
                per_seed.append(result.failures)
    except InfeasibleError as exc:
        return {**row, "status": "infeasible", "reason": str(exc)}
    except _NoProgress as exc:
        return {**row, "status": "no-progress", "reason": str(exc), "analytic_waste_ratio": statistics.fmean(analytic)}
    except ValueError as exc:
        return {**row, "status": "unmeasured", "reason": str(exc)}
    mean, lo, hi = mean_ci(samples, nonnegative=True)
    return {**row, "samples": len(samples), "min_failures_per_seed": min(per_seed), "failures": sum(per_seed),
            "waste_ratio": mean, "waste_lo": lo, "waste_hi": hi, "analytic_waste_ratio": statistics.fmean(analytic)}


def wasted_table(runs: list[dict], recoveries: list[dict], grid_mtbf_s: Sequence[float], *, seeds: int = 3,
                 min_failures: int = 10, background_weight: float = 0.0, intervals: str = "measured") -> list[dict]:
    """(c) One row per (MTBF, strategy) from ``simulate_cell``, plus ``mtbf_steps`` (MTBF over the median
    mean step), ``effective_ratio`` = 1 / (1 + W), ``ratio`` = the strategy's W over ours in the same cell
    and ``highest_rate`` (the smallest MTBF of the grid).

    Raises:
        ValueError: an empty grid, a non-positive MTBF, ``seeds`` < 1 or ``min_failures`` < 1.
    """
    if not grid_mtbf_s or min(grid_mtbf_s) <= 0 or seeds < 1 or min_failures < 1:
        raise ValueError(f"need a non-empty grid of MTBFs > 0 s, seeds >= 1, min_failures >= 1; got {list(grid_mtbf_s)}, "
                         f"{seeds}, {min_failures}")
    if intervals not in ("measured", "optimal"):
        raise ValueError(f"intervals must be 'measured' or 'optimal', got {intervals!r}")
    step_s = statistics.median(float(r["mean_step_s"]) for r in runs)
    summary = {r["strategy"]: r for r in recovery_table(recoveries)}
    rows = []
    for mtbf_s in sorted(grid_mtbf_s):
        cell = [simulate_cell(s, rs, summary.get(str(s)), mtbf_s, seeds=seeds, min_failures=min_failures,
                              background_weight=background_weight, intervals=intervals)
                for s, rs in _by_strategy(runs).items()]
        ours = ours_row(cell)
        for r in cell:
            r.update(mtbf_steps=mtbf_s / step_s, highest_rate=mtbf_s == min(grid_mtbf_s),
                     effective_ratio=1 / (1 + r["waste_ratio"]), ratio=ratio(r["waste_ratio"], ours.get("waste_ratio", math.nan)))
        rows += cell
    return rows


def measured_waste_table(runs: list[dict], recoveries: list[dict] | None = None, *, seeds: int = 3, min_failures: int = 10,
                         background_weight: float = 0.0) -> list[dict]:
    """The real runs' own W, as a check of (c): W = wall_s - steps x mean_step_s (the failure-free,
    checkpoint-free time), as seconds and per productive second, with the run's observed MTBF
    (wall_s / failures) and, given ``recoveries``, the Monte Carlo's W at that MTBF
    (``simulated_waste_ratio``, ``simulate_cell`` on this run alone). A short run's W also holds its
    start-up and its injected failures are scheduled, not Poisson: it checks the order of magnitude."""
    summary = {r["strategy"]: r for r in recovery_table(recoveries)} if recoveries else {}
    rows = []
    for r in runs:
        productive_s = float(r["steps"]) * float(r["mean_step_s"])
        observed = r["wall_s"] / r["failures"] if r["failures"] > 0 else math.nan
        simulated = math.nan
        if summary and observed > 0:
            simulated = simulate_cell(Strategy(r["strategy"]), [r], summary.get(str(r["strategy"])), observed, seeds=seeds,
                                      min_failures=min_failures, background_weight=background_weight)["waste_ratio"]
        rows.append({
            "strategy": str(r["strategy"]), "model": r["model"], "steps": r["steps"], "failures": r["failures"],
            "wall_s": r["wall_s"], "productive_s": productive_s, "wasted_s": r["wall_s"] - productive_s,
            "waste_ratio": (r["wall_s"] - productive_s) / productive_s if productive_s > 0 else math.nan,
            "observed_mtbf_s": observed, "simulated_waste_ratio": simulated,
        })
    return rows


def model_replay_steps(costs: MeasuredCosts, k: float) -> float:
    """Steps a log-based strategy replays per failure on average, to first order: k / 2 (k: the
    snapshot interval, or log-only's run length) for the share ``shadow_loss_fraction`` of failures
    that lose the shadow (log-only: all), ``live_replay_steps`` for the others."""
    p = costs.shadow_loss_fraction
    return p * k / 2 + (1 - p) * costs.live_replay_steps


def waste_terms(strategy: Strategy, costs: MeasuredCosts, k: int | None, run_steps: float) -> dict[str, tuple[float, str]]:
    """First-order terms of the waste ratio (seconds per productive second), each with how it arises.

    Per failure (rate 1/M): restart + load D; work lost or replayed, half an interval on average
    (Young 1974's T / 2; for the shadow (k / 2) x replay time, ZOCheck's model, for the share p of the
    failures that lose the shadow, and its live lag j for the others: (p k / 2 + (1 - p) j) r; for
    log-only half the run replayed); for full-async also the persist P before a checkpoint counts. Per step: stalls and
    log appends. Their sum is the first-order expansion of ``policies.models``' exact forms.
    """
    if k is None and strategy is not Strategy.LOG_ONLY:
        raise ValueError(f"{strategy} needs its interval k")
    lam, t = costs.failure_rate_per_s, costs.step_s
    terms = {"restart + load": (lam * costs.downtime_s, f"{costs.downtime_s:.3g} s per failure")}
    if strategy in (Strategy.SHADOW, Strategy.LOG_ONLY):
        terms["log appends"] = (costs.log_append_s / t, f"{costs.log_append_s:.3g} s per {t:.3g} s step")
        n = k if strategy is Strategy.SHADOW and k is not None else run_steps
        p, j = costs.shadow_loss_fraction, costs.live_replay_steps  # log-only: p = 1 (no shadow to survive)
        how = f"{n:g}/2 steps" if p == 1 else (f"{p:.3g} x {n:g}/2 + {1 - p:.3g} x {j:.3g} steps (a share {p:.3g} of the "
                                               "failures loses the shadow; the others replay its lag)")
        terms["replay"] = (lam * model_replay_steps(costs, n) * costs.replay_step_s, f"{how} x {costs.replay_step_s:.3g} s per failure")
    if strategy is Strategy.FULL_SYNC and k is not None:
        terms["checkpoint blocking"] = (costs.snapshot_s / (k * t), f"{costs.snapshot_s:.3g} s every {k} steps")
        terms["lost work"] = (lam * (k * t + costs.snapshot_s) / 2, f"half of {k} steps + a checkpoint per failure")
    if strategy is Strategy.FULL_ASYNC and k is not None:
        terms["staging stalls"] = (costs.stall_s / (k * t), f"{costs.stall_s:.3g} s every {k} steps")
        terms["lost work"] = (lam * (k * t / 2 + costs.snapshot_s),
                              f"half of {k} steps + a {costs.snapshot_s:.3g} s persist per failure")
    if costs.background_weight and strategy in (Strategy.SHADOW, Strategy.FULL_ASYNC) and k is not None:
        terms["background writes"] = (costs.background_weight * costs.snapshot_s / (k * t),
                                      f"{costs.snapshot_s:.3g} s every {k} steps")
    return terms


def why_wasted(ours_cell: dict, base_cell: dict, ours_costs: MeasuredCosts | None, ours_run: dict, target: float,
               base_costs: MeasuredCosts | None = None, base_run: dict | None = None, floor: dict | None = None,
               ours_recovery: dict | None = None) -> str | None:
    """Why the wasted-time ratio at the highest failure rate misses ``target``: our largest first-order
    term (``waste_terms``) and the ratio it alone allows; given our ``recovery_table`` row
    ``ours_recovery``, where the model's replay per failure (``model_replay_steps``) exceeds the steps our
    recoveries replayed, that gap; and, given our recovery ``floor`` (``recovery_floor``), the
    breakdown component that is the floor of our per-failure cost; None if met."""
    r = base_cell.get("ratio", math.nan)
    if r >= target:
        return None
    for cell in (ours_cell, base_cell):
        if cell.get("status", "unmeasured") != "ok":
            return f"{cell.get('strategy', OURS)} at MTBF {base_cell['mtbf_s']:.3g} s: {cell.get('status')}: {cell.get('reason')}"
    if ours_costs is None:
        return f"{OURS} at MTBF {base_cell['mtbf_s']:.3g} s: its costs were not measured (a run and a recovery of it are needed)"
    terms = sorted(waste_terms(OURS, ours_costs, ours_cell["interval_steps"], float(ours_run["steps"])).items(),
                   key=lambda kv: -kv[1][0])
    name, (value, _) = terms[0]
    listed = ", ".join(f"{n} ~{v:.3g} ({how})" for n, (v, how) in terms)
    text = (
        f"at MTBF {base_cell['mtbf_s']:.3g} s ({base_cell['mtbf_steps']:.3g} steps) we waste {ours_cell['waste_ratio']:.3g} s "
        f"per productive second and {base_cell['strategy']} {base_cell['waste_ratio']:.3g}. Our terms, to first order: {listed}; "
        f"{name} alone bounds the ratio at {base_cell['waste_ratio']:.3g} / {value:.3g} = "
        f"{fmt_ratio(ratio(base_cell['waste_ratio'], value))}"
    )
    if base_costs is not None and base_run is not None:
        bterms = waste_terms(Strategy(base_cell["strategy"]), base_costs, base_cell["interval_steps"], float(base_run["steps"]))
        bname, (bvalue, bhow) = max(bterms.items(), key=lambda kv: kv[1][0])
        text += f"; {base_cell['strategy']}'s largest is {bname} (~{bvalue:.3g}: {bhow})"
    k = ours_cell["interval_steps"]
    modelled = model_replay_steps(ours_costs, k) if k else 0.0
    if name == "replay" and ours_recovery and ours_recovery["replayed_steps"] < modelled:
        text += (f". The model replays {modelled:.3g} steps per failure on average; our measured recoveries replayed "
                 f"{ours_recovery['replayed_steps']:.3g} steps on average (restored from {ours_recovery['sources']}), so this "
                 "term, not a measured component, is the floor")
    if floor is not None and floor["seconds"] > 0 and ours_recovery:
        text += f". Per failure, {floor_text(floor, ours_recovery['latency_s'])}"
    return text + f"; simulated ratio {r:.3g}x < {target:g}x."


# ---------------------------------------------------------------------------------------------- (d) exactness


def exactness_table(runs: list[dict]) -> list[dict]:
    """(d) Per strategy: runs, failures injected, runs whose final state was bitwise equal to the reference."""
    return [{
        "strategy": str(s), "runs": len(rs), "failures": int(sum(r["failures"] for r in rs)),
        "bitwise_equal_runs": int(sum(bool(r["bitwise_equal"]) for r in rs)),
        "bitwise_equal": all(bool(r["bitwise_equal"]) for r in rs),
    } for s, rs in _by_strategy(runs).items()]


# ---------------------------------------------------------------------------------------------- headlines


def headlines(overhead: list[dict], recovery: list[dict], wasted: list[dict], runs: list[dict], recoveries: list[dict], *,
              background_weight: float = 0.0) -> tuple[Headline, ...]:
    """Our ratio against each baseline for (a), (b) and (c), with ZOCheck's number, the issue's target and,
    against full-async, why a target is missed."""
    out = []
    tables = {"overhead": (overhead, "ratio_equal_durability"), "recovery": (recovery, "ratio")}
    highest = [r for r in wasted if r["highest_rate"]]
    for metric in ("overhead", "recovery", "wasted"):
        rows, key = tables.get(metric, (highest, "ratio"))
        for base in BASELINES:
            row = next((r for r in rows if r["strategy"] == base), None)
            if row is None:
                continue
            paper = base is PAPER_BASELINE
            target = TARGET_RATIO[metric] if paper else None
            value = row.get(key, math.nan)
            why = _why(metric, ours_row(rows), row, target, runs, recoveries, background_weight) if target is not None else None
            if why is None and math.isnan(value):
                failed = next((r for r in (row, ours_row(rows)) if r.get("reason")), None)
                why = f"{failed['strategy']}: {failed['reason']}" if failed else "not measured"
            paths = "" if metric == "overhead" else "; ".join(
                f"{s} {path_counts(rs)}" for s in (OURS, base) if (rs := [r for r in recoveries if r["strategy"] == s]))
            out.append(Headline(metric=metric, baseline=str(base), ratio=None if math.isnan(value) else value,
                                paper=PAPER_RATIO[metric] if paper else None, target=target, why=why, paths=paths))
    return tuple(out)


def _why(metric: str, ours: dict, base: dict, target: float, runs: list[dict], recoveries: list[dict],
         background_weight: float) -> str | None:
    if metric == "overhead":
        return why_overhead(ours, base, target)
    floor = recovery_floor(recoveries)
    if metric == "recovery":
        return why_recovery(ours, base, target, floor)
    summary = {r["strategy"]: r for r in recovery_table(recoveries)}
    first = {s: rs[0] for s, rs in _by_strategy(runs).items()}

    def costs(strategy: Strategy) -> MeasuredCosts | None:
        try:
            return measured_costs(first[strategy], summary.get(str(strategy)), mtbf_s=base["mtbf_s"],
                                  background_weight=background_weight)
        except (KeyError, ValueError):
            return None

    base_strategy = Strategy(base["strategy"])
    return why_wasted(ours, base, costs(OURS), first[OURS], target, costs(base_strategy), first.get(base_strategy),
                      floor, summary.get(str(OURS)))


def is_finite(x: float | None) -> bool:
    """Whether ``x`` is a finite number (not None, NaN or infinite)."""
    return x is not None and not math.isnan(x) and not math.isinf(x)




def fmt_ratio(r: float | None) -> str:
    """A ratio for text: ``750x``, ``11,625x``, ``1.69x``; ``n/a`` when unknown."""
    if r is None or math.isnan(r):
        return "n/a"
    return "inf" if math.isinf(r) else f"{r:,.0f}x" if r >= 1000 else f"{r:.3g}x"


def fmt_seconds(v: float | None) -> str:
    """Seconds for text, 3 significant digits: ``0.06 s``; ``n/a`` when unknown."""
    return "n/a" if v is None or math.isnan(v) else f"{v:.3g} s"
