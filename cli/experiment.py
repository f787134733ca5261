"""``raycheck experiment``: every checkpointing strategy side by side, with a report."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Annotated

import typer

from raycheck.experiments.harness import FAILURE_KINDS
from raycheck.job.config import DURABILITIES, STRATEGIES
from raycheck.training.model import default_cache_dir

LOCAL_DURABILITIES = tuple(d for d in DURABILITIES if d != "cluster")
"""The step log levels an experiment can run at: it uses local storage, and ``cluster`` needs a bucket."""


def experiment(
    quick: Annotated[bool, typer.Option("--quick", help="The tiny model (zo: 40 steps, 3 failures; fo: 32 steps, 2 failures; "
                                                       "under 10 min on 2 cores).")] = False,
    out: Annotated[pathlib.Path, typer.Option(help="Results directory (runs/, Parquet tables, report.md, PNG plots).")] = pathlib.Path("runs/experiment"),
    algo: Annotated[str, typer.Option(help="zo (MeZO: shadow against the baselines) or fo (AdamW: every first-order "
                                           "strategy side by side).")] = "zo",
    strategy: Annotated[list[str], typer.Option(help="Strategies to run (repeatable; default: every one of --algo's).")] = [],  # noqa: B006
    report_only: Annotated[bool, typer.Option(help="Rebuild the report from the results already in --out.")] = False,
    cache_dir: Annotated[pathlib.Path, typer.Option(help="Converted-model cache.")] = default_cache_dir(),
    failure_kind: Annotated[str, typer.Option(
        help="exit, cold, raise or standby: how each injected worker failure happens, the same for every strategy. "
             "exit: the process exits and the run recovers as by default (a warm standby where its policy keeps one). "
             "cold: the process exits with --no-warm-standby, Ray Train starts a new one that restores the state. "
             "raise: the step raises, the process survives and restores the state in process. standby: the process "
             "exits and a warm standby (--warm-standby) takes over.")] = "exit",
    model: Annotated[str, typer.Option(help="Model of every run instead of the preset's: a built-in name, a local Hugging "
                                            "Face model folder or a model id in the local Hugging Face cache.")] = "",
    durability: Annotated[str, typer.Option(help=(
        "zo step log durability of every run: node (the run's default: each append waits for the log keeper's "
        "acknowledgement) or process (fsynced on rank 0's node only: the level of the baselines' checkpoints on "
        "the local disk). cluster needs remote storage, which the experiment does not use."))] = "node",
    overwrite: Annotated[bool, typer.Option(help="Replace the results of an earlier experiment in --out (its runs/ "
                                                 "and tables). A folder that holds anything else is never emptied.")] = False,
) -> None:
    """Run ours (shadow) and the baselines (full-sync, full-async, log-only) on the same trajectory and the
    same injected worker failures, then write runs.parquet, recoveries.parquet, report.md and plots.
    With --algo fo: every first-order strategy (full-sync, full-async, layerwise, differential, overlapped)
    against a failure-free first-order reference.

    The default preset fine-tunes SmolLM2-135M (30 steps, failures at steps 12 and 24, checkpoint
    interval 10; about 21 min on 2 cores for zo); --quick uses the tiny model.
    """
    from raycheck.experiments.harness import PRESETS_BY_ALGO, run_experiment
    from raycheck.experiments.report import write_report
    from raycheck.orchestrator.cluster import connect
    from raycheck.training.model import model_folder

    if algo not in STRATEGIES:
        _usage_error(f"--algo {algo!r}: choose zo or fo")
    unknown = [s for s in strategy if s not in STRATEGIES[algo]]
    if unknown:
        _usage_error(f"--strategy {', '.join(unknown)} is not a strategy of --algo {algo}: choose from {', '.join(STRATEGIES[algo])}")
    if failure_kind not in FAILURE_KINDS:
        _usage_error(f"--failure-kind {failure_kind!r}: choose from {', '.join(FAILURE_KINDS)}")
    if durability not in LOCAL_DURABILITIES:
        why = " (cluster needs remote storage, which the experiment does not use)" if durability == "cluster" else ""
        _usage_error(f"--durability {durability!r}: choose {' or '.join(LOCAL_DURABILITIES)}{why}")
    out = out.resolve()
    preset = PRESETS_BY_ALGO[algo]["quick" if quick else "full"]
    if model and not report_only:
        try:
            model_folder(model, cache_dir)  # a folder or cached id is read on this (the driver's) machine only
        except ValueError as exc:
            typer.echo(f"error: --model: {exc}", err=True)
            raise typer.Exit(2) from exc
        preset = dataclasses.replace(preset, model=model)
    if not report_only:
        _check_out(out, overwrite)
        connect("raycheck", num_cpus=2)
        run_experiment(preset, out, str(cache_dir.resolve()), tuple(strategy) or STRATEGIES[algo], echo=typer.echo,
                       failure_kind=failure_kind, durability=durability)
    elif not (out / "runs.parquet").is_file():
        typer.echo(f"error: {out} holds no results (runs.parquet); run without --report-only first", err=True)
        raise typer.Exit(2)
    typer.echo(write_report(out).summary())  # its first line names report.md


def _check_out(out: pathlib.Path, overwrite: bool) -> None:
    """Refuse (exit 2) an ``out`` that is a file, that holds an earlier experiment's results (``preset.json``,
    or ``runs/reference/``, its first run) without ``overwrite``, or that holds anything else: the experiment replaces ``out/runs`` and
    its tables, so it starts only in a new or empty folder or, with ``overwrite``, over an experiment's."""
    if out.exists() and not out.is_dir():
        _usage_error(f"--out {out} is a file, not a folder")
    if not out.exists() or not any(out.iterdir()):
        return
    if not ((out / "preset.json").is_file() or (out / "runs" / "reference").is_dir()):
        _usage_error(f"{out} is not empty and holds no raycheck experiment (no preset.json or runs/reference): "
                     "choose a new or empty --out")
    if not overwrite:
        _usage_error(f"{out} already holds an experiment's results; pass --overwrite to replace them (its runs/ is "
                     "deleted) or choose another --out")


def _usage_error(message: str) -> None:
    """Print ``message`` as one line and exit 2 (a usage error)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
