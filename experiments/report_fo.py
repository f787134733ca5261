"""Report of ``raycheck experiment --algo fo``: every first-order strategy side by side on the same
injected worker failures, against one failure-free first-order run (the reference).

Reads ``runs.parquet`` (one ``results.fo_run_row`` per strategy run), ``recoveries.parquet``
(``results.recovery_rows``) and ``preset.json`` of one results folder and writes next to them:

- (a) ``stall.parquet``, ``stall.png``: seconds the training loop was blocked by checkpointing, in total
  and as a share of the step compute, and the checkpoint bytes written, per strategy.
- (b) ``recovery.parquet``, ``recovery.png``, ``breakdown.parquet``: recovery latency (failure to the
  first new step) and its parts, with the per-component breakdown: the ZO report's tables and plot
  (``report_tables.recovery_table``, ``breakdown_table``; ``report.plot_recovery``).
- (c) ``deviation.parquet``: the final state's sha256 against the reference's, and the relative
  deviation of the per-step training loss after the first restart and of the final loss
  (``results.loss_deviation``).
- ``report.md``: the three sections and what each figure is measured on.

There is no cost model or wasted-time simulation here: ``policies.models`` has closed forms for the
ZO path's strategies only.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from raycheck.experiments.report import Report, _pyplot, _recovery_md, _save, md_table, plot_recovery, write_parquet
from raycheck.experiments.report_tables import breakdown_table, read_rows, recovery_table
from raycheck.job.config import STRATEGIES
from raycheck.policies.strategies import RunStrategy

ORDER = STRATEGIES["fo"]
FO_RUN_COLUMNS = (
    "strategy", "model", "steps", "interval_steps", "failures", "exact_by_design", "bitwise_equal", "compute_s_total",
    "block_s_total", "block_share", "block_s_max", "bytes_written", "dev_from_step", "dev_steps", "loss_dev_mean_abs",
    "loss_dev_max_abs", "first_deviating_step", "final_loss", "reference_final_loss", "final_loss_dev",
)
"""``runs.parquet``'s columns the first-order report needs (``results.fo_run_row`` writes them)."""
BYTES_BASELINE = RunStrategy.FULL_ASYNC
"""The strategy whose bytes the others' are compared with: whole-state checkpoints at the same interval."""


def load_fo_results(results_dir: pathlib.Path) -> tuple[list[dict], list[dict], dict]:
    """``runs.parquet`` and ``recoveries.parquet`` rows (strategies as ``RunStrategy``) and ``preset.json``.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file is empty, lacks columns or names a strategy that is not first-order.
    """
    results_dir = pathlib.Path(results_dir)
    runs = read_rows(results_dir / "runs.parquet", FO_RUN_COLUMNS, RunStrategy)
    recoveries = [{**r, "path": r.get("path") or "new_process"}
                  for r in read_rows(results_dir / "recoveries.parquet", ("strategy", "latency_s"), RunStrategy)]
    for r in runs + recoveries:
        if r["strategy"] not in ORDER:
            raise ValueError(f"{results_dir}: strategy {r['strategy']!s} is not first-order (expected one of {', '.join(ORDER)})")
    return runs, recoveries, json.loads((results_dir / "preset.json").read_text())


def _ordered(runs: list[dict]) -> list[dict]:
    return sorted(runs, key=lambda r: ORDER.index(r["strategy"]))


def stall_table(runs: list[dict]) -> list[dict]:
    """(a) One row per run: ``block_s_total``, ``compute_s_total`` (seconds), ``block_share`` (blocked over
    compute), ``block_s_max`` (the longest single stall), ``bytes_written`` and ``bytes_ratio`` (the
    ``BYTES_BASELINE`` run's bytes over this run's: how many times fewer; NaN without it)."""
    base = next((r["bytes_written"] for r in runs if r["strategy"] == BYTES_BASELINE), math.nan)
    return [{"strategy": str(r["strategy"]), "model": r["model"], "exact_by_design": bool(r["exact_by_design"]),
             "interval_steps": r["interval_steps"], "steps": r["steps"], "failures": r["failures"], "compute_s_total": r["compute_s_total"],
             "block_s_total": r["block_s_total"], "block_share": r["block_share"], "block_s_max": r["block_s_max"],
             "bytes_written": r["bytes_written"],
             "bytes_ratio": base / r["bytes_written"] if r["bytes_written"] > 0 else math.nan}
            for r in _ordered(runs)]


def deviation_table(runs: list[dict]) -> list[dict]:
    """(c) One row per run: ``exact_by_design``, ``bitwise_equal`` (final state sha256 = the reference's),
    the first step whose loss differs from the reference's (``first_deviating_step``, -1: none), the steps
    the loss deviation covers (``dev_from_step`` .. the last, ``dev_steps`` of them) and the deviations as
    percentages: ``loss_dev_mean_abs_pct``, ``loss_dev_max_abs_pct`` (mean and largest
    |loss - reference| / reference over those steps) and ``final_loss_dev_pct`` (signed, at the last step)."""
    return [{"strategy": str(r["strategy"]), "exact_by_design": bool(r["exact_by_design"]), "bitwise_equal": bool(r["bitwise_equal"]),
             "first_deviating_step": r["first_deviating_step"], "dev_from_step": r["dev_from_step"], "dev_steps": r["dev_steps"],
             "loss_dev_mean_abs_pct": 100 * r["loss_dev_mean_abs"], "loss_dev_max_abs_pct": 100 * r["loss_dev_max_abs"],
             "final_loss": r["final_loss"], "reference_final_loss": r["reference_final_loss"],
             "final_loss_dev_pct": 100 * r["final_loss_dev"]}
            for r in _ordered(runs)]


def plot_stall(rows: list[dict], path: pathlib.Path) -> None:
    """Blocked share of compute (%) and bytes written (MB) by strategy, side by side."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    x = np.arange(len(rows))
    names = [r["strategy"] for r in rows]
    left.bar(x, [100 * r["block_share"] for r in rows])
    left.set_ylabel("loop blocked / step compute (%)")
    right.bar(x, [r["bytes_written"] / 1e6 for r in rows], color="tab:orange")
    right.set_ylabel("checkpoint bytes written (MB)")
    for ax in (left, right):
        ax.set_xticks(x, names, rotation=20)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("(a) loop stall and bytes, first-order strategies")
    _save(fig, path)


def _yes(v: bool) -> str:
    return "yes" if v else "**no**"


def _stall_md(rows: list[dict], preset: dict) -> str:
    view = [{**r, "exact_by_design": _yes(r["exact_by_design"]), "block_share": f"{100 * r['block_share']:.3g}%",
             "bytes_written": f"{r['bytes_written']:,}", "bytes_ratio": "n/a" if math.isnan(r["bytes_ratio"]) else f"{r['bytes_ratio']:.3g}x"}
            for r in rows]
    return (f"Seconds the training loop was blocked by checkpointing (`checkpoint_block_seconds` of every executed step, "
            f"re-executions after a restart included), against the seconds of step compute of the same executions. "
            f"Bytes: what each strategy's checkpointer committed over the run, summed over its worker incarnations "
            f"(shards, gradient records; a write in flight when a worker died is not counted); "
            f"*{BYTES_BASELINE} / this*: how many times fewer bytes than whole-state checkpoints at the same interval "
            f"(every {preset['interval_steps']} steps). One run per strategy: each figure is one sample, and the seconds "
            f"were measured on shared cores.\n\n"
            + md_table(view, [("strategy", "strategy"), ("exact_by_design", "exact by design"), ("interval_steps", "interval (steps)"),
                              ("compute_s_total", "compute s"), ("block_s_total", "blocked s"), ("block_share", "blocked / compute"),
                              ("block_s_max", "longest stall s"), ("bytes_written", "bytes written"),
                              ("bytes_ratio", f"{BYTES_BASELINE} / this")])
            + "\n\n![stall](stall.png)")


def _deviation_md(rows: list[dict], preset: dict) -> str:
    view = [{**r, "exact_by_design": _yes(r["exact_by_design"]), "bitwise_equal": _yes(r["bitwise_equal"]),
             "first_deviating_step": "none" if r["first_deviating_step"] < 0 else r["first_deviating_step"],
             "steps": "none (no recovery)" if r["dev_from_step"] < 0 else f"{r['dev_from_step']}..{preset['steps'] - 1} ({r['dev_steps']})"}
            for r in rows]
    table = md_table(view, [("strategy", "strategy"), ("exact_by_design", "exact by design"), ("bitwise_equal", "final state bitwise equal"),
                            ("first_deviating_step", "first step whose loss differs"), ("steps", "steps compared"), ("loss_dev_mean_abs_pct", "mean abs. loss deviation (%)"),
                            ("loss_dev_max_abs_pct", "max abs. loss deviation (%)"), ("final_loss", "final loss"),
                            ("reference_final_loss", "reference final loss"), ("final_loss_dev_pct", "final loss deviation (%)")])
    inexact = [r["strategy"] for r in rows if not r["exact_by_design"]]
    return (
        "**Final state**: the sha256 of the whole training state after the last step (weights, both AdamW moments and "
        "step counts) against the failure-free reference's; a run that differs is not measured further on its state. "
        "**First step whose loss differs**: the first step of the run whose training loss is not exactly the reference's "
        "(where the restored state first differed, seen through the loss). **Loss deviation**: at each step from the one "
        "the run's last recovery restored to the last step (the steps after the last restart), "
        "|loss - reference loss| / reference loss, where loss is that step's training loss on its batch (the same batches "
        f"as the reference: batches are a function of the seed and step; batch {preset['batch_size']}), taken from the "
        "step's last execution. An exact restart re-executes bitwise the reference's steps, so its deviation is exactly 0; "
        "a non-zero one shows the restored state differed. The final loss deviation is signed, at the last step. "
        "These are training losses of single small batches, one run per strategy: one sample each, with no interval; "
        "how large ordinary batch-order noise is on this path (the noise floor against which a layer-wise deviation must be "
        "read) is measured in docs/first-order.md (\"Post-restart deviation on a held-out batch\")."
        + (f" Inexact by design here: {', '.join(inexact)}." if inexact else "")
        + "\n\n" + table)


def render_fo_markdown(preset: dict, stall: list[dict], recovery: list[dict], breakdown: list[dict], deviation: list[dict]) -> str:
    """The whole first-order ``report.md``: the setup, then (a) stall and bytes, (b) recovery, (c) exactness and deviation."""
    return "\n\n".join([
        f"# raycheck experiment --algo fo: {preset['model']}",
        f"Every first-order strategy (AdamW) on the same trajectory ({preset['model']}, {preset['steps']} steps, batch "
        f"{preset['batch_size']}, a check every {preset['interval_steps']} steps; differential: a full checkpoint every "
        f"{2 * preset['interval_steps']} steps and gradient records between) with the same worker failures "
        f"({preset.get('failure_kind', 'exit')}) at steps {preset['failure_steps']}, each run through the same controller "
        "and recovery path (the `path` column), against one failure-free first-order run (the reference). Strategy settings are "
        "`JobConfig`'s defaults otherwise (each run's `config.json` under `runs/<strategy>/`).",
        "## (a) Loop stall and bytes written\n\n" + _stall_md(stall, preset),
        "## (b) Recovery latency\n\n" + _recovery_md(recovery, (), breakdown, ours=False),
        "## (c) Exactness and post-restart deviation\n\n" + _deviation_md(deviation, preset),
    ]) + "\n"


def write_fo_report(results_dir: pathlib.Path) -> Report:
    """Turn a first-order results folder (``load_fo_results``) into ``stall``, ``recovery``, ``breakdown`` and
    ``deviation`` Parquet tables, ``stall.png``, ``recovery.png`` and ``report.md`` there.

    Raises:
        FileNotFoundError, ValueError: missing, empty or malformed inputs (``load_fo_results``).
    """
    results_dir = pathlib.Path(results_dir)
    runs, recoveries, preset = load_fo_results(results_dir)
    stall = stall_table(runs)
    recovery, breakdown = recovery_table(recoveries, ORDER), breakdown_table(recoveries, ORDER)
    deviation = deviation_table(runs)
    tables = {"stall": stall, "recovery": recovery, "deviation": deviation, **({"breakdown": breakdown} if breakdown else {})}
    files = {name: results_dir / f"{name}.parquet" for name in tables}
    for name, rows in tables.items():
        write_parquet(rows, files[name])
    files["stall_png"], files["recovery_png"] = results_dir / "stall.png", results_dir / "recovery.png"
    plot_stall(stall, files["stall_png"])
    if recovery:
        plot_recovery(recovery, files["recovery_png"])
    files["report"] = results_dir / "report.md"
    files["report"].write_text(render_fo_markdown(preset, stall, recovery, breakdown, deviation))
    notes = tuple(f"{r['strategy']:>12}: blocked {100 * r['block_share']:.3g}% of compute, {r['bytes_written'] / 1e6:,.1f} MB, "
                  f"final state {'bitwise equal' if d['bitwise_equal'] else 'differs'}, mean abs. loss deviation "
                  f"{d['loss_dev_mean_abs_pct']:.3g}%" for r, d in zip(stall, deviation))
    return Report(results_dir=results_dir, files=files, headlines=(), highest_rate_mtbf_s=math.nan, notes=notes)
