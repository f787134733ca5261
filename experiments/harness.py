"""``raycheck experiment``: every checkpointing strategy, side by side, on the same failures.

Each strategy of the preset's algorithm (``zo``, ours: ``shadow``; baselines: ``full-sync``,
``full-async``, ``log-only``; ``fo``: every first-order strategy of ``STRATEGIES["fo"]``) runs the
same trajectory (model, data, seeds) through the same controller, storage layer, failure injector
and restart path, with the same worker failures; one failure-free run is the reference for
exactness. The raw results go to ``runs.parquet`` and ``recoveries.parquet`` (``experiments.results``)
and ``experiments.report`` turns them into ``report.md``, tables and plots.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from raycheck.experiments.results import fo_run_row, recovery_rows, run_row, shard_rows
from raycheck.job.config import STRATEGIES, DifferentialConfig, FailureSpec, FaultConfig, JobConfig, SnapshotConfig
from raycheck.job.run_dir import RunDir


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One experiment: the trajectory, the checkpoint interval shared by every strategy (steps) and
    the worker failures (0-based steps) every strategy suffers."""

    name: str
    model: str
    steps: int
    interval_steps: int
    failure_steps: tuple[int, ...]
    batch_size: int = 8
    mtbf_s: float = 600.0
    """Assumed MTBF for our adaptive snapshot policy until it has measured failures (seconds)."""
    shard_run_steps: int = 10
    """Steps of the extra failure-free run with a 2-shard shadow (replay over step time per shard)."""
    algo: str = "zo"
    """``zo`` (MeZO) or ``fo`` (AdamW; ``experiments.report_fo`` reports it)."""


FAILURE_KINDS = {
    "exit": "the worker process exits (os._exit(1)) and the run recovers as it does by default: a warm standby where "
            "its policy keeps one (workers.standby), else Ray Train starts a new process, which restores the state",
    "cold": "the worker process exits (os._exit(1)) with --no-warm-standby: Ray Train starts a new process, which "
            "restores the state",
    "raise": "the step raises and the process survives: it restores the state in process (training.in_process)",
    "standby": "the worker process exits (os._exit(1)) with --warm-standby: a standby, loaded before it was needed, "
               "takes over (workers.standby): Ray Train sees no failure",
}
"""``raycheck experiment --failure-kind``: how each injected worker failure happens (``FailureSpec.how``)."""


PRESETS = {
    "quick": Preset(name="quick", model="tiny", steps=40, interval_steps=8, failure_steps=(11, 22, 33), mtbf_s=30.0),
    "full": Preset(name="full", model="smollm2-135m", steps=30, interval_steps=10, failure_steps=(12, 24), mtbf_s=120.0),
}
FO_PRESETS = {
    "quick": Preset(name="fo-quick", algo="fo", model="tiny", steps=32, interval_steps=8, failure_steps=(13, 26)),
    "full": Preset(name="fo-full", algo="fo", model="smollm2-135m", steps=30, interval_steps=10, failure_steps=(12, 24)),
}
"""First-order presets: AdamW at ``FOConfig``'s defaults (lr 1e-5), a check every ``interval_steps`` for
every strategy (``differential``: a full checkpoint every 2 intervals, gradient records between), two
worker failures: the first after one check (every layer-wise unit is written at the first check), the
second where a layer-wise composite can hold units older than its check."""
PRESETS_BY_ALGO = {"zo": PRESETS, "fo": FO_PRESETS}
REFERENCE_STRATEGY = {"zo": "shadow", "fo": "full-async"}
"""The strategy of the failure-free reference run (checkpointing does not change the trajectory)."""


def job_config(preset: Preset, strategy: str, out: pathlib.Path, cache_dir: str, failures: bool = True,
               failure_kind: str = "exit", durability: str = "node") -> JobConfig:
    """The configuration of ``strategy`` in ``preset`` (``failures=False``: the reference run), its worker
    failures of ``failure_kind`` (``FAILURE_KINDS``), its step log at ``durability`` (``job.config.DURABILITIES``
    but ``cluster``, which needs remote storage: ``process``, the level of the baselines' checkpoints on the
    local disk, or ``node``, the run's default).

    Raises:
        ValueError: an unknown ``failure_kind``.
    """
    if failure_kind not in FAILURE_KINDS:
        raise ValueError(f"failure kind {failure_kind!r}: choose one of {', '.join(FAILURE_KINDS)}")
    how = "raise" if failure_kind == "raise" else "exit"
    return JobConfig(
        out_dir=str(out), cache_dir=cache_dir, model=preset.model, steps=preset.steps, batch_size=preset.batch_size,
        algo=preset.algo, strategy=strategy, eval_samples=0, run_id=f"{strategy}-{uuid.uuid4().hex[:6]}", durability=durability,
        differential=DifferentialConfig(full_every_steps=2 * preset.interval_steps),
        snapshot=SnapshotConfig(every_steps=preset.interval_steps, policy="adaptive" if strategy == "shadow" else "fixed",
                                mtbf_s=preset.mtbf_s),
        faults=FaultConfig(failures=tuple(FailureSpec(step=s, how=how) for s in preset.failure_steps) if failures else (),
                           warm_standby={"cold": False, "standby": True}.get(failure_kind) if failures else None),
    )


def _write_table(rows: list[dict], path: pathlib.Path) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    pq.write_table(pa.table({c: [r.get(c) for r in rows] for c in columns}), path)


def run_experiment(preset: Preset, out: pathlib.Path, cache_dir: str, strategies: tuple[str, ...] = (),
                   echo: Callable[[str], None] = print, failure_kind: str = "exit", durability: str = "node") -> pathlib.Path:
    """Run the reference and ``strategies`` (default: every one of ``STRATEGIES[preset.algo]``) of
    ``preset`` into ``out``, each strategy's worker failures of ``failure_kind`` (``FAILURE_KINDS``), every
    run's step log at ``durability`` (``job_config``); returns ``out``.

    Writes ``out/runs/<strategy>/`` (each run's own files), ``runs.parquet`` (``results.run_row``; for
    algo ``fo`` ``results.fo_run_row``: with the loss deviation against the reference) and
    ``recoveries.parquet``; with ``shadow`` among the strategies also ``shards.parquet``: replay over
    step time per shard of its 1-shard shadow and of one extra short failure-free run with 2 shards
    (``shard_run_steps``); ``preset.json`` (the preset, its ``algo`` and the failure kind).
    """
    from raycheck.orchestrator.controller import Controller

    strategies = strategies or STRATEGIES[preset.algo]
    out.mkdir(parents=True, exist_ok=True)

    def quiet(line: str) -> None:  # a run's events, not its step lines
        if line.startswith("[raycheck]"):
            echo(f"    {line}")

    echo(f"[experiment] {preset.name}: {preset.model}, {preset.steps} steps, interval {preset.interval_steps}, "
         f"worker failures ({failure_kind}) at steps {list(preset.failure_steps)}"
         f"{f', step log durability {durability}' if preset.algo == 'zo' else ''}; "
         f"{len(strategies)} strategies + 1 failure-free reference")
    shutil.rmtree(out / "runs", ignore_errors=True)
    reference_cfg = job_config(preset, REFERENCE_STRATEGY[preset.algo], out / "runs" / "reference", cache_dir, failures=False,
                               durability=durability)
    runs = len(strategies) + 1 + ("shadow" in strategies)  # the reference, each strategy, the 2-shard shadow run
    started = time.monotonic()

    def progress(done: int) -> str:  # runs done of all, and the time left at the mean run's pace so far
        left_s = (time.monotonic() - started) / done * (runs - done)
        return f"run {done + 1} of {runs}, about {left_s / 60:.1f} min left"

    reference = Controller(reference_cfg, quiet).run()
    echo(f"[experiment] reference done in {reference['wall_seconds']:.0f} s")
    shards = []
    for i, strategy in enumerate(strategies, start=1):
        echo(f"[experiment] {strategy} ({progress(i)}) ...")
        cfg = job_config(preset, strategy, out / "runs" / strategy, cache_dir, failure_kind=failure_kind, durability=durability)
        summary = Controller(cfg, quiet).run()
        summary["reference_state_sha256"] = reference["state_sha256"]
        summary["bitwise_equal"] = summary["ok"] and summary["state_sha256"] == reference["state_sha256"]
        RunDir.write_json(pathlib.Path(cfg.out_dir) / "summary.json", summary)
        if strategy == "shadow":
            shards = shard_rows(summary)
        echo(f"[experiment] {strategy}: ok={summary['ok']} bitwise_equal={summary['bitwise_equal']} "
             f"blocked {summary['checkpoint_block_seconds_total']:.3f} s, {len(summary['recoveries'])} recoveries, "
             f"{summary['wall_seconds']:.0f} s")
    if "shadow" in strategies:
        echo(f"[experiment] {progress(runs - 1)}")
        shards.extend(_sharded_run(preset, out, cache_dir, echo, quiet, durability))
        _write_table(shards, out / "shards.parquet")
    collect_results(out, preset.algo, strategies)
    (out / "preset.json").write_text(json.dumps({**dataclasses.asdict(preset), "failure_kind": failure_kind, "durability": durability},
                                                indent=2))
    return out


def collect_results(out: pathlib.Path, algo: str, strategies: tuple[str, ...]) -> None:
    """Write ``runs.parquet`` and ``recoveries.parquet`` of ``out`` from the run directories the experiment left
    under ``out/runs/`` (``reference`` and one per strategy, each ``summary.json`` with its ``bitwise_equal``):
    ``results.run_row`` per strategy for ``zo``, ``results.fo_run_row`` (against the reference's losses) for
    ``fo``, and ``results.recovery_rows``. Reads only those files, so the tables can be rebuilt after a change
    of the row functions without running anything again.

    Raises:
        FileNotFoundError: a run directory or its ``summary.json`` is missing.
    """
    reference = RunDir(out / "runs" / "reference")
    reference_executions = reference.read(reference.metrics)
    runs, recoveries = [], []
    for strategy in strategies:
        run = RunDir(out / "runs" / strategy)
        summary = RunDir.read_json(run.root / "summary.json")
        if summary is None:
            raise FileNotFoundError(f"{run.root / 'summary.json'} not found: run the experiment first")
        executions, events = run.read(run.metrics), run.read(run.events)
        runs.append(run_row(summary, executions) if algo == "zo" else fo_run_row(summary, executions, events, reference_executions))
        recoveries.extend(recovery_rows(summary, events, executions))
    _write_table(runs, out / "runs.parquet")
    _write_table(recoveries, out / "recoveries.parquet")


def _sharded_run(preset: Preset, out: pathlib.Path, cache_dir: str, echo: Callable[[str], None],
                 quiet: Callable[[str], None], durability: str) -> list[dict]:
    """The extra failure-free ``shadow`` run with ``placement.shadow_shards`` 2; returns its ``shard_rows``."""
    from raycheck.orchestrator.controller import Controller

    echo(f"[experiment] shadow with 2 shards, {preset.shard_run_steps} steps, no failures ...")
    cfg = job_config(preset, "shadow", out / "runs" / "shadow-2shards", cache_dir, failures=False, durability=durability).replace(
        placement={"shadow_shards": 2}, steps=min(preset.steps, preset.shard_run_steps))
    summary = Controller(cfg, quiet).run()
    rows = shard_rows(summary)
    echo("[experiment] shadow with 2 shards: ok={} shadow_equal={} replay/step {}".format(
        summary["ok"], summary["shadow_equal"], ", ".join(f"{r['units']} {r['replay_over_step'] or float('nan'):.3f}" for r in rows)))
    return rows
