"""Analysis and report of ``raycheck experiment``: the issue's tables, plots and markdown report.

Reads the raw results the experiment harness writes into one folder, ``runs.parquet`` (one row per
strategy run) and ``recoveries.parquet`` (one row per worker recovery), and writes next to them
(the analysis itself is ``experiments.report_tables``):

- (a) ``overhead.parquet``, ``overhead.png``: seconds the training loop was blocked by checkpointing,
  per step, in total and per durable point, as run and at equal durability (every strategy durable
  every step, as the step log makes ours).
- (b) ``recovery.parquet``, ``recovery.png``: recovery latency (failure to the first new step) by
  strategy, broken down into restart, load, replay and recompute, with a 95% interval;
  ``breakdown.parquet``: per recovery path (``new_process``, ``in_process``), the measured components
  of a recovery (detection, Ray Train's restart of the worker group, imports, model and data load,
  state transfer, replay, first step) per strategy; where a target is missed, the component that is
  the floor of our recovery (``report_tables.recovery_floor``).
- (c) ``wasted.parquet``, ``measured_waste.parquet``, ``wasted.png``: end-to-end wasted time W over a
  grid of failure rates, a seeded Monte Carlo (``policies.simulate``) over the costs measured in the
  real runs, with each real run's own measured W beside it as a check.
- (d) ``exactness.parquet``: whether each strategy's final state was bitwise equal to the reference.
- ``report.md``: one section per (a)-(d), our ratios against each baseline beside ZOCheck's numbers
  and the issue's targets, and, where a target is missed, why, computed from the measurements.

Wasted time follows ``docs/algorithms.md``: W = checkpoint stalls on the training loop + per failure
(detection + restart + load + replay or recomputation + work lost after the last durable point),
reported per second of failure-free, checkpoint-free training (the waste ratio) and as the effective
training-time ratio 1 / (1 + W). Background snapshot writes are not wall-clock time and count only
with ``background_weight`` > 0.

Sources: J. W. Young, CACM 17(9), 1974 and J. T. Daly, FGCS 22(3), 2006 (the checkpoint waste models
``policies.models`` implements and the simulator plays out); ZOCheck (arXiv 2026) for the CPU shadow
and the paper's numbers (vs asynchronous full-state: 219.7x lower checkpoint overhead, 1.55x lower
recovery latency, 21.3x lower end-to-end wasted time).

    python -m raycheck.experiments.report RESULTS_DIR [--seeds 3] [--min-failures 10] [--mtbf-s 200 2000 20000]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raycheck.experiments.report_tables import (
    GRID_DECADES,
    GRID_MIN_DOWNTIMES,
    GRID_MIN_STEPS,
    GRID_POINTS,
    OURS,
    PAPER_BASELINE,
    RECOVERY_PARTS,
    Headline,
    append_inflation,
    breakdown_table,
    default_grid_mtbf_s,
    exactness_table,
    fmt_ratio,
    fmt_seconds,
    headlines,
    is_finite,
    load_results,
    measured_waste_table,
    nan_to_zero,
    ours_row,
    overhead_table,
    ratio,
    recovery_table,
    wasted_table,
)
from raycheck.policies.models import Strategy


@dataclass(frozen=True, kw_only=True)
class Report:
    """What ``write_report`` wrote and the headline ratios, for the CLI's summary."""

    results_dir: pathlib.Path
    files: dict[str, pathlib.Path]
    """Name (``report``, ``overhead``, ``overhead_png``, ...) to the path written."""
    headlines: tuple[Headline, ...]
    highest_rate_mtbf_s: float
    """The grid's smallest MTBF (seconds): the cell of the wasted-time headline (NaN: a first-order report, which has none)."""
    notes: tuple[str, ...] = ()
    """Lines the summary prints after the headlines (a first-order report's per-strategy figures)."""

    def headline(self, metric: str, baseline: Strategy | str = PAPER_BASELINE) -> Headline:
        """The headline of ``metric`` against ``baseline``.

        Raises:
            KeyError: no such headline (the baseline was not run).
        """
        for h in self.headlines:
            if h.metric == metric and h.baseline == str(baseline):
                return h
        raise KeyError(f"no {metric} headline against {baseline}")

    def summary(self) -> str:
        """A few lines for a terminal: each ratio against each baseline, with the paper, the target and the
        paths the recoveries took."""
        lines = [f"report: {self.files['report']}"]
        for h in self.headlines:
            goal = "" if h.target is None else f"  (paper {h.paper:g}x, target >= {h.target:g}x: {'met' if h.met else 'MISSED'})"
            lines.append(f"{h.metric:>9} vs {h.baseline:<10} {fmt_ratio(h.ratio)}{goal}" + (f"  [{h.paths}]" if h.paths else ""))
        return "\n".join([*lines, *self.notes])


# ---------------------------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_overhead(rows: list[dict], path: pathlib.Path) -> None:
    """Blocked seconds per step by strategy (log scale), as run and at equal durability."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    for offset, key, label in ((-0.2, "block_s_per_step", "as run"), (0.2, "eq_block_s_per_step", "durable every step")):
        values = [r[key] if is_finite(r[key]) and r[key] > 0 else np.nan for r in rows]
        ax.bar(x + offset, values, width=0.4, label=label)
    ax.set_xticks(x, [r["strategy"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("training loop blocked per step (s)")
    ax.set_title("(a) checkpoint overhead")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_recovery(rows: list[dict], path: pathlib.Path) -> None:
    """Recovery latency by strategy as stacked bars (restart, load, replay, recompute, other), with the 95% interval."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for part in RECOVERY_PARTS:
        values = np.array([max(0.0, nan_to_zero(r[part])) for r in rows])
        ax.bar(x, values, bottom=bottom, label=part[:-2])
        bottom += values
    lo = [r["latency_s"] - r["latency_lo_s"] if r["latency_lo_s"] is not None else 0.0 for r in rows]
    ax.errorbar(x, [r["latency_s"] for r in rows], yerr=lo, fmt="none", ecolor="black", capsize=4)
    ax.set_xticks(x, [f"{r['strategy']}\n(n={r['n']})" for r in rows])
    ax.set_ylabel("failure to first new step (s)")
    ax.set_title("(b) recovery latency")
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_wasted(rows: list[dict], path: pathlib.Path) -> None:
    """Simulated waste ratio against MTBF (log-log), one line per strategy, 95% error bars; the highest
    failure rate marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        line = [r for r in rows if r["strategy"] == strategy and r["status"] == "ok" and r["waste_ratio"] > 0]
        if not line:
            continue
        y = np.array([r["waste_ratio"] for r in line])
        err = np.array([[r["waste_ratio"] - (r["waste_lo"] or r["waste_ratio"]) for r in line],
                        [(r["waste_hi"] or r["waste_ratio"]) - r["waste_ratio"] for r in line]])
        err[0] = np.minimum(err[0], y * 0.999)  # a lower bar that reaches 0 cannot be drawn on a log axis
        ax.errorbar([r["mtbf_s"] for r in line], y, yerr=err, marker="o", capsize=3, label=strategy)
    ax.axvline(min(r["mtbf_s"] for r in rows), color="grey", linestyle=":", label="highest failure rate")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("job MTBF (s)")
    ax.set_ylabel("wasted s per productive s (Monte Carlo)")
    ax.set_title("(c) end-to-end wasted time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig, path: pathlib.Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


# ---------------------------------------------------------------------------------------------- markdown


def _v(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def md_table(rows: list[dict], columns: Sequence[tuple[str, str]]) -> str:
    """A markdown table of ``rows`` with ``columns`` as (key, header) pairs."""
    head = "| " + " | ".join(h for _, h in columns) + " |\n| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(_v(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, *body])


def _ci(mean: float, lo: float | None, hi: float | None) -> str:
    return _v(mean) if lo is None else f"{_v(mean)} [{_v(lo)}, {_v(hi)}]"


def _inputs_md(runs: list[dict]) -> str:
    rows = [{**r, "strategy": str(r["strategy"]), "durability": r.get("durability") or ""} for r in runs]
    return md_table(rows, [("strategy", "strategy"), ("model", "model"), ("steps", "steps"),
                           ("interval_steps", "interval (steps)"), ("durability", "step log durability"),
                           ("failures", "failures"), ("snapshots", "snapshots"), ("mean_step_s", "mean step (s)"),
                           ("wall_s", "wall (s)")])


def _headlines_md(hs: Sequence[Headline]) -> str:
    rows = [{"metric": h.metric, "baseline": h.baseline, "ours": fmt_ratio(h.ratio), "paper": f"{h.paper:g}x" if h.paper else "",
             "target": f">= {h.target:g}x" if h.target else "", "met": "" if h.met is None else ("yes" if h.met else "**no**"),
             "paths": h.paths}
            for h in hs]
    table = md_table(rows, [("metric", "metric"), ("baseline", "vs baseline"), ("ours", "ours (baseline / ours)"),
                            ("paper", "ZOCheck paper"), ("target", "issue target"), ("met", "met"),
                            ("paths", "recoveries measured (path: count)")])
    whys = [f"- **{h.metric} vs {h.baseline}**: {h.why}" for h in hs if h.why]
    return table + ("\n\nWhere a figure falls short, from the measurements:\n\n" + "\n".join(whys) if whys else "")


def _overhead_md(rows: list[dict], hs: Sequence[Headline]) -> str:
    table = md_table(rows, [("strategy", "strategy"), ("runs", "runs"), ("interval_steps", "interval (steps)"),
                            ("checkpoints", "durable points"), ("block_s_per_step", "blocked s/step (as run)"),
                            ("block_s_total", "blocked s total (as run)"), ("block_s_per_point", "blocked s per durable point"),
                            ("eq_block_s_per_step", "blocked s/step, durable every step"), ("eq_block_s_total", "... total"),
                            ("ratio_as_run", "/ ours (as run)"), ("ratio_equal_durability", "/ ours (equal durability)")])
    text = ("Seconds the training loop was blocked by checkpointing (log appends for shadow and log-only, blocking saves "
            "for full-sync, staging copies plus waits for the previous write for full-async). **Equal durability**: every "
            "strategy made as durable as ours, a durable point every step, i.e. its blocked seconds per durable point x one "
            "point per step. Ratios are the strategy's value over ours (higher: ours blocks less).\n\n" + table)
    async_row = next((r for r in rows if r["strategy"] == Strategy.FULL_ASYNC and r["eq_write_wait_s_per_step"] > 0), None)
    if async_row and ours_row(rows):
        wait_s = async_row["eq_write_wait_s_per_step"]
        bound = ratio(async_row["eq_block_s_per_step"] + wait_s, ours_row(rows)["eq_block_s_per_step"])
        text += (f"\n\nThe full-async ratio at equal durability is a lower bound: one checkpoint per step would also wait "
                 f"max(0, snapshot_s - step) = {fmt_seconds(wait_s)} per step for the previous write "
                 f"(modelled from the measured write time), which would make it {fmt_ratio(bound)}.")
    return text + "\n\n![overhead](overhead.png)" + _why_md(hs, "overhead")


def append_inflation_text(inflation: dict) -> str:
    """One sentence on ``report_tables.append_inflation``'s figures, for ``report.md`` and the CLI's summary."""
    verdict = "met" if inflation["met"] else "missed"
    level = f" at durability {inflation['durability']}" if inflation["durability"] else ""
    return (f"The step log under snapshot load: our mean append{level}, while the shadow's snapshots were "
            f"written to the same disk, {inflation['loaded_mean_s'] * 1e3:.3g} ms; the log-only run's median (no snapshots, "
            f"the same durability) {inflation['quiet_median_s'] * 1e3:.3g} ms: {inflation['ratio']:.3g}x the quiet "
            f"(log-only) median (target <= {inflation['target']:g}x: {verdict}).")


_PATH_TITLE = {
    "new_process": "`new_process`: the worker process died, Ray Train started a replacement that restored the state",
    "in_process": "`in_process`: the worker process survived the failure and restored the state itself "
                  "(`training.in_process`); it has no Ray Train, process start, import or load component",
    "standby": "`standby`: the step executor's process died and the warm standby, loaded before, took over "
               "(`workers.standby`); it has no Ray Train, process start, import or load component",
}


def _breakdown_md(rows: list[dict]) -> str:
    """The recovery breakdown tables (``breakdown_table``), one per path, or a line saying no recovery had one."""
    if not rows:
        return "No recovery recorded a breakdown (its worker's stamps are missing: a run of an older raycheck)."
    parts = []
    for path in dict.fromkeys(r["path"] for r in rows):
        on_path = [r for r in rows if r["path"] == path]
        strategies = [k for k in on_path[0] if k not in ("path", "component", "owner")]
        parts.append(f"Path {_PATH_TITLE.get(path, f'`{path}`')}:\n\n"
                     + md_table(on_path, [("component", "component"), ("owner", "whose"), *((s, f"{s} (s)") for s in strategies)]))
    return ("Where a recovery's time goes, from the failure to the first step done, mean seconds per component over "
            "each strategy's recoveries on each path (`orchestrator.summary.BREAKDOWN`, `IN_PROCESS_BREAKDOWN` and `STANDBY_BREAKDOWN` "
            "define each; `a+b`: two components the stamps could not separate). *Ray Train* marks its restart of the "
            "worker group, which no checkpointing strategy changes.\n\n" + "\n\n".join(parts))


def _recovery_md(rows: list[dict], hs: Sequence[Headline], breakdown: list[dict] | None = None, ours: bool = True) -> str:
    """(b): the latency table (``recovery_table``'s rows, with the ratio to ours when ``ours``), its plot and the breakdown."""
    view = [{**r, "latency": _ci(r["latency_s"], r["latency_lo_s"], r["latency_hi_s"])} for r in rows]
    table = md_table(view, [("strategy", "strategy"), ("n", "n"), ("latency", "latency s, mean [95% CI]"),
                            ("restart_s", "restart"), ("load_s", "load"), ("replay_s", "replay"), ("recompute_s", "recompute"),
                            ("other_s", "other"),
                            ("replayed_steps", "replayed steps"), ("recompute_steps", "recomputed steps"),
                            ("sources", "restored from"), ("paths", "path"), *([("ratio", "/ ours")] if ours else [])])
    return ("Latency from the failure to the start of the first step not executed before it, in seconds, mean over each "
            "strategy's recoveries (95% Student-t interval when n > 1; a lower bound below 0 is printed as 0: a latency "
            "cannot be negative); *other* is what restart, load, replay and "
            "recompute leave unexplained.\n\n" + table + "\n\n![recovery](recovery.png)\n\n" + _breakdown_md(breakdown or [])
            + _why_md(hs, "recovery"))


def _wasted_md(rows: list[dict], measured: list[dict], hs: Sequence[Headline], grid_note: str, seeds: int, min_failures: int,
               background_weight: float, intervals: str) -> str:
    cells = []
    for mtbf in sorted({r["mtbf_s"] for r in rows}):
        line = [r for r in rows if r["mtbf_s"] == mtbf]
        cell = {"mtbf": f"{mtbf:.4g}" + (" (highest rate)" if line[0]["highest_rate"] else ""), "steps": line[0]["mtbf_steps"]}
        for r in line:
            cell[r["strategy"]] = _ci(r["waste_ratio"], r["waste_lo"], r["waste_hi"]) if r["status"] == "ok" else r["status"]
            if r["strategy"] != OURS:
                cell[f"{r['strategy']} / ours"] = fmt_ratio(r["ratio"])
        cells.append(cell)
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    cols = [("mtbf", "MTBF (s)"), ("steps", "MTBF (steps)")] + [(s, f"{s} W") for s in strategies]
    cols += [(f"{s} / ours", f"{s} / ours") for s in strategies if s != OURS]
    notes = [f"- {r['strategy']} at MTBF {r['mtbf_s']:.4g} s: **{r['status']}**: {r['reason']}"
             for r in rows if r["status"] != "ok"]
    check = md_table(measured, [("strategy", "strategy"), ("failures", "failures"), ("wall_s", "wall (s)"),
                                ("productive_s", "steps x mean step (s)"), ("wasted_s", "W (s)"),
                                ("waste_ratio", "W / productive"), ("observed_mtbf_s", "observed MTBF (s)"),
                                ("simulated_waste_ratio", "Monte Carlo W at that MTBF")])
    counts = [r["min_failures_per_seed"] for r in rows if r["status"] == "ok"]
    interval = "each run used" if intervals == "measured" else "that minimises the closed-form waste in each cell"
    return (
        "**This is a Monte Carlo over the costs measured in the real runs**, not the real runs themselves: each strategy's "
        "`MeasuredCosts` (mean step, replay per step, snapshot write, staging stall, log append from its run; restart and "
        "load from its recoveries, where restart includes detection and any unexplained latency; for ours also the share "
        "of its recoveries that found no live shadow image, which the simulator takes as the share of failures that "
        "lose the shadow, and the steps the others replayed) go into "
        f"`policies.simulate` (exponential failures) at each MTBF, {seeds} seeds, each with at least {min_failures} failures "
        f"(fewest in any ok cell: {min(counts) if counts else 'n/a'}), the interval {interval}. "
        "Interval strategies are simulated as one long run (steady state); log-only, whose replay grows with the run, as "
        "runs of the real run's length. W = checkpoint stalls + per failure (detection + restart + load + replay or "
        "recomputation + lost work), in wasted seconds per second of failure-free, checkpoint-free training; background "
        f"writes charged at weight {background_weight:g}. Cells give the mean and 95% interval across seeds and runs (a lower bound below 0 "
        "is printed as 0: W cannot be negative).\n\n"
        f"Grid: {grid_note}\n\n" + md_table(cells, cols) + ("\n\n" + "\n".join(notes) if notes else "")
        + "\n\n![wasted](wasted.png)\n\nCheck: the real runs' own measured W (wall time minus steps x mean step; includes "
        "start-up, and their failures were scheduled, not Poisson):\n\n" + check + _why_md(hs, "wasted")
    )


def _exactness_md(rows: list[dict]) -> str:
    view = [{**r, "bitwise_equal": "yes" if r["bitwise_equal"] else "**no**"} for r in rows]
    return ("Final state sha256 against the failure-free reference run.\n\n"
            + md_table(view, [("strategy", "strategy"), ("runs", "runs"), ("failures", "failures injected"),
                              ("bitwise_equal_runs", "bitwise-equal runs"), ("bitwise_equal", "bitwise equal")]))


def _shards_md(rows: list[dict]) -> str:
    view = [{**r, "shadow_equal": "yes" if r["shadow_equal"] else "**no**"} for r in rows]
    return ("Seconds the shadow needs to replay one step, per shard, over the worker's mean step time: the shadow keeps "
            "up while every shard stays below 1. The 1-shard row is the `shadow` run above; the 2-shard rows are one "
            "extra short failure-free run (`--shadow-shards 2`), each shard holding a contiguous range of units balanced "
            "by element count.\n\n"
            + md_table(view, [("shards", "shards"), ("shard", "shard"), ("units", "units"), ("elements", "elements"),
                              ("replay_step_s", "replay s/step"), ("replay_over_step", "replay / step time"),
                              ("shadow_equal", "shadow equal to worker")]))


def _why_md(hs: Sequence[Headline], metric: str) -> str:
    lines = [f"- vs {h.baseline}: {h.why}" for h in hs if h.metric == metric and h.why]
    return "\n\nShort of the target:\n\n" + "\n".join(lines) if lines else ""


def render_markdown(runs: list[dict], overhead: list[dict], recovery: list[dict], wasted: list[dict], measured: list[dict],
                    exactness: list[dict], hs: Sequence[Headline], *, grid_note: str, seeds: int, min_failures: int,
                    background_weight: float, intervals: str, shards: list[dict] | None = None,
                    breakdown: list[dict] | None = None, inflation: dict | None = None) -> str:
    """The whole ``report.md``: inputs, headline ratios, then one section per (a)-(d) ((a) with the step log's
    ``inflation`` under snapshot load, ``report_tables.append_inflation``; (b) with the recovery ``breakdown``,
    ``breakdown_table``'s rows), and (e) replay per shadow shard when ``shards`` (the ``shards.parquet`` rows) are
    given."""
    models = ", ".join(sorted({str(r["model"]) for r in runs}))
    return "\n\n".join([
        f"# raycheck experiment: {models}",
        "Ours = `shadow` (step log + CPU shadow snapshots, ZOCheck). Ratios are baseline / ours: how many times lower ours "
        "is. ZOCheck's numbers and the issue's targets are against asynchronous full-state checkpoints (`full-async`).",
        "## Inputs\n\n" + _inputs_md(runs),
        "## Ours against each baseline, beside the paper\n\n" + _headlines_md(hs),
        "## (a) Checkpoint overhead\n\n" + _overhead_md(overhead, hs)
        + (f"\n\n{append_inflation_text(inflation)}" if inflation else ""),
        "## (b) Recovery latency\n\n" + _recovery_md(recovery, hs, breakdown),
        "## (c) End-to-end wasted time\n\n"
        + _wasted_md(wasted, measured, hs, grid_note, seeds, min_failures, background_weight, intervals),
        "## (d) Exactness\n\n" + _exactness_md(exactness),
        *(["## (e) Shadow replay per shard\n\n" + _shards_md(shards)] if shards else []),
    ]) + "\n"


# ---------------------------------------------------------------------------------------------- entry point


def results_algo(results_dir: pathlib.Path) -> str:
    """The algorithm of a results set: ``preset.json``'s ``algo``; ``zo`` without one (results older than
    the first-order experiment)."""
    preset = pathlib.Path(results_dir) / "preset.json"
    return json.loads(preset.read_text()).get("algo", "zo") if preset.is_file() else "zo"


def write_parquet(rows: list[dict], path: pathlib.Path) -> None:
    """Write rows (dicts with the same keys) as a Parquet table."""
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_report(results_dir: pathlib.Path, *, grid_mtbf_s: Sequence[float] | None = None, seeds: int = 3,
                 min_failures: int = 10, background_weight: float = 0.0, intervals: str = "measured") -> Report:
    """Turn ``runs.parquet`` and ``recoveries.parquet`` of ``results_dir`` into tables, plots and ``report.md`` there.

    ``grid_mtbf_s``: job MTBFs (seconds) for (c), default ``default_grid_mtbf_s``; ``seeds`` simulated
    per run and cell, each with at least ``min_failures`` failures; ``background_weight`` charges
    background snapshot seconds as waste (0: wall-clock W as ``docs/algorithms.md`` defines it);
    ``intervals`` ``measured`` (each run's interval) or ``optimal`` (the closed-form optimum per cell).

    A first-order results set (``preset.json``'s ``algo`` ``fo``) gets ``experiments.report_fo``'s report
    instead (the other arguments do not apply to it).

    Raises:
        FileNotFoundError, ValueError: missing, empty or malformed inputs (see ``load_results``), or bad arguments.
    """
    results_dir = pathlib.Path(results_dir)
    if results_algo(results_dir) == "fo":
        from raycheck.experiments.report_fo import write_fo_report  # it builds on this module's markdown and plots

        return write_fo_report(results_dir)
    runs, recoveries = load_results(results_dir)
    overhead, recovery, breakdown = overhead_table(runs), recovery_table(recoveries), breakdown_table(recoveries)
    if grid_mtbf_s is None:
        grid_mtbf_s = default_grid_mtbf_s(runs, recoveries)
        grid_note = (f"the default: {GRID_POINTS} MTBFs log-spaced over {GRID_DECADES} decades, from a failure every "
                     f"max({GRID_MIN_STEPS} mean steps, {GRID_MIN_DOWNTIMES} x the slowest restart + load) "
                     f"= {min(grid_mtbf_s):.4g} s, so that every strategy still progresses, to {max(grid_mtbf_s):.4g} s.")
    else:
        grid_note = f"given: MTBFs {', '.join(f'{m:.4g}' for m in sorted(grid_mtbf_s))} s."
    wasted = wasted_table(runs, recoveries, grid_mtbf_s, seeds=seeds, min_failures=min_failures,
                          background_weight=background_weight, intervals=intervals)
    measured = measured_waste_table(runs, recoveries, seeds=seeds, min_failures=min_failures, background_weight=background_weight)
    exactness = exactness_table(runs)
    inflation = append_inflation(runs)
    shards = pq.read_table(results_dir / "shards.parquet").to_pylist() if (results_dir / "shards.parquet").is_file() else None
    hs = headlines(overhead, recovery, wasted, runs, recoveries, background_weight=background_weight)
    tables = {"overhead": overhead, "recovery": recovery, "wasted": wasted, "measured_waste": measured, "exactness": exactness,
              **({"breakdown": breakdown} if breakdown else {})}
    files = {name: results_dir / f"{name}.parquet" for name in tables}
    for name, rows in tables.items():
        write_parquet(rows, files[name])
    plots = (("overhead", plot_overhead, overhead), ("recovery", plot_recovery, recovery), ("wasted", plot_wasted, wasted))
    for name, plot, rows in plots:
        files[f"{name}_png"] = results_dir / f"{name}.png"
        plot(rows, files[f"{name}_png"])
    files["report"] = results_dir / "report.md"
    files["report"].write_text(render_markdown(runs, overhead, recovery, wasted, measured, exactness, hs, grid_note=grid_note,
                                               seeds=seeds, min_failures=min_failures, background_weight=background_weight,
                                               intervals=intervals, shards=shards, breakdown=breakdown, inflation=inflation))
    return Report(results_dir=results_dir, files=files, headlines=hs, highest_rate_mtbf_s=min(grid_mtbf_s),
                  notes=(append_inflation_text(inflation),) if inflation else ())


def main(argv: list[str] | None = None) -> Report:
    """``python -m raycheck.experiments.report RESULTS_DIR ...``: write the report and print its summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results_dir", type=pathlib.Path)
    ap.add_argument("--mtbf-s", type=float, nargs="+", default=None,
                    help="Job MTBFs (seconds) for (c); default from the measurements.")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--min-failures", type=int, default=10)
    ap.add_argument("--background-weight", type=float, default=0.0)
    ap.add_argument("--intervals", choices=("measured", "optimal"), default="measured")
    args = ap.parse_args(argv)
    report = write_report(args.results_dir, grid_mtbf_s=args.mtbf_s, seeds=args.seeds, min_failures=args.min_failures,
                          background_weight=args.background_weight, intervals=args.intervals)
    print(report.summary())
    return report


if __name__ == "__main__":
    main()
