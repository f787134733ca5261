"""``raycheck policy``: compare snapshot strategies and intervals for given costs and failure rates."""

from __future__ import annotations

import json
import math
import re
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from raycheck.job.options import parse_duration
from raycheck.orchestrator.console import format_duration
from raycheck.policies.compare import Option, compare, recommend
from raycheck.policies.costs import InfeasibleError, MeasuredCosts
from raycheck.policies.models import Strategy
from raycheck.policies.shadow_sizing import (DEFAULT_UTILIZATION, ReplayThroughput, cores_to_keep_up, lag_replay_s,
                                             shadow_replay_step_s)

_COUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgb]?)\s*(?:/s)?\s*$", re.I)
_COUNT_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}


def parse_count(text: str) -> float:
    """A count or a rate with an optional SI suffix: ``134515008``, ``135M``, ``1.5G``, ``2B``, ``150M/s``.

    Raises:
        ValueError: not a number with an optional k, M, G or B (1e9) suffix.
    """
    match = _COUNT.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a count: write a number with an optional suffix k, M, G or B, e.g. 135M, 150M/s")
    return float(match.group(1)) * _COUNT_SCALE[match.group(2).lower()]


def format_count(n: float) -> str:
    """A short reading of a count: 135M, 1.5G, 980k."""
    for suffix, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.3g}"


def _seconds(flag: str, text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=flag) from exc


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else "inf" if math.isinf(value) else f"{value:.2f}" if value < 1e4 else f"{value:.1e}"


def _counted(flag: str, text: str | None) -> float | None:
    try:
        value = None if text is None else parse_count(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=flag) from exc
    if value is not None and not value > 0:
        raise typer.BadParameter(f"must be > 0, got {text!r}", param_hint=flag)
    return value


def _throughput(elements: str | None, replay_rate: str | None, device_replay_rate: str | None) -> ReplayThroughput | None:
    """The replay throughput the sizing options give, or None when they are not given."""
    count, rate, device = _counted("--elements", elements), _counted("--replay-rate", replay_rate), \
        _counted("--device-replay-rate", device_replay_rate)
    if (count is None) != (rate is None):
        raise typer.BadParameter("--elements and --replay-rate size the shadow together: give both or neither",
                                 param_hint="--elements" if count is None else "--replay-rate")
    if count is None or rate is None:
        if device is not None:
            raise typer.BadParameter("--device-replay-rate needs --elements and --replay-rate", param_hint="--device-replay-rate")
        return None
    return ReplayThroughput(elements=max(1, round(count)), elements_per_s_per_core=rate, device_elements_per_s=device)


def _replay_time(replay: str | None, throughput: ReplayThroughput | None, step_s: float, shadow_cores: int | None) -> tuple[str, int | None]:
    """``--replay-time`` as given, or the sized shadow's replay of a step (and its cores)."""
    if throughput is not None and replay is not None:
        raise typer.BadParameter("give --replay-time or --elements with --replay-rate, not both: the sized shadow's "
                                 "replay time would contradict the one given", param_hint="--replay-time")
    if throughput is None:
        if replay is None:
            raise typer.BadParameter("give --replay-time, or --elements and --replay-rate to size the shadow",
                                     param_hint="--replay-time")
        return replay, shadow_cores
    cores = shadow_cores or cores_to_keep_up(throughput, step_s)
    return f"{shadow_replay_step_s(throughput, cores)}s", cores


def _sizing(throughput: ReplayThroughput, costs: MeasuredCosts, cores: int) -> dict[str, float | int]:
    return {"elements": throughput.elements, "replay_elements_per_s_per_core": throughput.elements_per_s_per_core,
            "replay_step_s_per_core": shadow_replay_step_s(throughput, 1),
            "cores_at_least": cores_to_keep_up(throughput, costs.step_s, 1.0),
            "cores_sized": cores_to_keep_up(throughput, costs.step_s), "utilization": DEFAULT_UTILIZATION,
            "shadow_cores": cores, "shadow_replay_step_s": shadow_replay_step_s(throughput, cores),
            "lag_replay_s_per_step": lag_replay_s(throughput, 1.0),
            "live_replay_s": lag_replay_s(throughput, costs.live_replay_steps)}


def _cores(n: float) -> str:
    return f"{n:g} core" + ("" if n == 1 else "s")


def _sizing_line(s: dict[str, float | int], step_s: float) -> str:
    per_core, lag = format_duration(float(s["replay_step_s_per_core"])), format_duration(float(s["lag_replay_s_per_step"]))
    return (f"shadow sizing: a step of {format_count(s['elements'])} elements replays in {per_core} on one core "
            f"({format_count(s['replay_elements_per_s_per_core'])} elements/s): within {s['utilization']:.0%} of a "
            f"{format_duration(step_s)} step on {_cores(s['cores_sized'])}, within the step on {_cores(s['cores_at_least'])}; "
            f"this shadow ({_cores(s['shadow_cores'])}) replays a step in {format_duration(float(s['shadow_replay_step_s']))}. "
            f"A recovery from a lagging shadow replays the lag on the worker's device: {lag} per step of lag"
            + (f", {format_duration(float(s['live_replay_s']))} for --live-replay-steps" if s["live_replay_s"] else ""))


def _costs(step: str, replay: str, snapshot: str, stall: str, log: str, restart: str, load: str,
           mtbf: str | None, gpus: int, gpu_mtbf: str | None, background_weight: float, shadow_loss: float = 1.0,
           live_replay_steps: float = 0.0) -> MeasuredCosts:
    if mtbf is not None and gpu_mtbf is not None:
        raise typer.BadParameter("--mtbf (the job's) and --gpu-mtbf (one accelerator's, with --gpus) exclude each other: "
                                 "give one of them", param_hint="--mtbf")
    if gpu_mtbf is not None:
        flag, text = "--gpu-mtbf", gpu_mtbf
    elif mtbf is not None:
        flag, text = "--mtbf", mtbf
    else:
        raise typer.BadParameter("give the job's --mtbf, or --gpus with the per-accelerator --gpu-mtbf", param_hint="--mtbf")
    mtbf_s = _seconds(flag, text)
    if not mtbf_s > 0:
        raise typer.BadParameter(f"the MTBF must be > 0, got {text!r}", param_hint=flag)
    costs = {
        "step_s": _seconds("--step-time", step), "replay_step_s": _seconds("--replay-time", replay),
        "snapshot_s": _seconds("--snapshot-time", snapshot), "stall_s": _seconds("--stall-time", stall),
        "log_append_s": _seconds("--log-time", log), "restart_s": _seconds("--restart-time", restart),
        "load_s": _seconds("--load-time", load), "background_weight": background_weight,
        "shadow_loss_fraction": shadow_loss, "live_replay_steps": live_replay_steps,
    }
    try:
        if gpu_mtbf is not None:
            return MeasuredCosts.for_accelerators(accelerator_mtbf_s=mtbf_s, accelerators=gpus, **costs)
        return MeasuredCosts(mtbf_s=mtbf_s, accelerators=gpus, **costs)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _explain(best: Option, options: list[Option]) -> str:
    classical = [(o.waste_ratio, o) for o in options
                 if o.rule in ("young", "daly") and o.strategy == Strategy.FULL_SYNC and o.waste_ratio is not None]
    interval_s = best.interval_s
    line = (f"recommended: {best.strategy} ({best.rule} interval"
            + (f", every {best.interval_steps} steps = {format_duration(interval_s)}" if best.interval_steps and interval_s is not None else "")
            + f"): expected overhead {best.overhead_pct:.2f}%, {best.wasted_h_per_day:.2f} h wasted per day")
    if classical:
        ref = min(classical, key=lambda wo: wo[0])[1]
        line += f"; full-sync at {ref.rule.capitalize()}'s interval: {_fmt(ref.overhead_pct)}%"
    return line


def _note(option: Option, best: Option | None) -> str:
    if option is best:
        return "recommended"
    return "infeasible (below)" if option.error else "" if option.makes_progress else "no progress"


def policy(
    step_time: Annotated[str, typer.Option(help="Training step time, e.g. 1.2s.")],
    snapshot_time: Annotated[str, typer.Option(help="Time to write one full-state snapshot, e.g. 30s.")],
    restart_time: Annotated[str, typer.Option(help="Detect a failure and restart the job, e.g. 5min.")],
    replay_time: Annotated[str | None, typer.Option(help=(
        "Shadow replay time per step, e.g. 250ms; or leave it out and give --elements and --replay-rate."))] = None,
    elements: Annotated[str | None, typer.Option(help="Trainable elements of the model, e.g. 135M (sizes the shadow).")] = None,
    replay_rate: Annotated[str | None, typer.Option(help=(
        "Replay rate of one CPU core in elements/s, e.g. 150M (python -m raycheck.experiments.hotpath_bench)."))] = None,
    device_replay_rate: Annotated[str | None, typer.Option(help=(
        "Replay rate on the workers' device in elements/s (default: one CPU core's), for a lagging shadow's recovery."))] = None,
    shadow_cores: Annotated[int | None, typer.Option(min=1, help=(
        "Cores the shadow has (shards x threads); default with --elements: the fewest that replay within half a step."))] = None,
    load_time: Annotated[str, typer.Option(help="Load a snapshot after a restart.")] = "0s",
    stall_time: Annotated[str, typer.Option(help="Training stall of an asynchronous snapshot (staging copy).")] = "0s",
    log_time: Annotated[str, typer.Option(help="Durable step-log append per step.")] = "0s",
    mtbf: Annotated[str | None, typer.Option(help="Mean time between failures of the whole job, e.g. 3h.")] = None,
    gpus: Annotated[int, typer.Option(min=1, help="Accelerators in the job.")] = 1,
    gpu_mtbf: Annotated[str | None, typer.Option(help="MTBF of one accelerator (job MTBF = this / --gpus), e.g. 2000d.")] = None,
    background_weight: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of background snapshot time charged as waste.")] = 1.0,
    shadow_loss: Annotated[float, typer.Option(min=0.0, max=1.0, help=(
        "Share of failures that also lose the CPU shadow's image (1: every failure takes the whole job down). A train "
        "worker's own failure (its process, its GPU, its node) leaves the shadow alive: give the share of the others."))] = 1.0,
    live_replay_steps: Annotated[float, typer.Option(min=0.0, help=(
        "Steps a recovery from the live shadow replays (its lag behind the log; `raycheck experiment` measures it)."))] = 0.0,
    horizon: Annotated[str, typer.Option(help="Training time of the run (log-only waste grows with it).")] = "7d",
    max_overhead: Annotated[float, typer.Option(min=0.01, max=99.0, help="CheckFreq overhead bound, percent.")] = 3.5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Expected wasted time of each snapshot strategy at classical and model-optimal intervals, and the pick.

    Exits 2 when no strategy is feasible or none makes progress (its run would take over 101 times as
    long as without failures and snapshots), after the table (or the JSON, with recommended null) that
    shows why."""
    throughput = _throughput(elements, replay_rate, device_replay_rate)
    replay_time, shadow_cores = _replay_time(replay_time, throughput, _seconds("--step-time", step_time), shadow_cores)
    costs = _costs(step_time, replay_time, snapshot_time, stall_time, log_time, restart_time, load_time,
                   mtbf, gpus, gpu_mtbf, background_weight, shadow_loss, live_replay_steps)
    try:
        options = compare(costs, horizon_s=_seconds("--horizon", horizon), max_overhead=max_overhead / 100)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    try:
        best, problem = recommend(options), None
    except InfeasibleError as exc:  # NoProgressError included: the table still shows why
        best, problem = None, str(exc)
    if as_json:
        rows = [{k: _finite(v) if isinstance(v, float) else v for k, v in o.to_dict().items()} for o in options]
        sizing = None if throughput is None or shadow_cores is None else _sizing(throughput, costs, shadow_cores)
        typer.echo(json.dumps({"costs": costs.to_dict(), "options": rows,
                               "recommended": None if best is None else rows[options.index(best)],
                               "explanation": problem if best is None else _explain(best, options),
                               "shadow_sizing": sizing}, indent=2))
    else:
        _print_table(costs, options, best)
        if throughput is not None and shadow_cores is not None:
            Console(width=120).print(_sizing_line(_sizing(throughput, costs, shadow_cores), costs.step_s), highlight=False)
    if problem:
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(2)


def _print_table(costs: MeasuredCosts, options: list[Option], best: Option | None) -> None:
    console = Console(width=120)
    console.print(f"job MTBF {format_duration(costs.mtbf_s)} (accelerators: {costs.accelerators}), step {format_duration(costs.step_s)}, "
                  f"replay {format_duration(costs.replay_step_s)}/step, snapshot {format_duration(costs.snapshot_s)}, "
                  f"restart + load {format_duration(costs.downtime_s)}", highlight=False)
    table = Table("strategy", "interval rule", "steps", "interval", "overhead %", "wasted h/day", "")
    for o in options:
        interval = ("-", "-") if o.interval_s is None else (str(o.interval_steps), format_duration(o.interval_s))
        table.add_row(str(o.strategy), o.rule, *interval, _fmt(o.overhead_pct), _fmt(o.wasted_h_per_day), _note(o, best))
    console.print(table)
    for error in dict.fromkeys(o.error for o in options if o.error):
        names = ", ".join(f"{o.strategy}/{o.rule}" for o in options if o.error == error)
        console.print(f"{names} infeasible: {error}", highlight=False)
    if best is not None:
        console.print(_explain(best, options), highlight=False)


app = typer.Typer(add_completion=False)
app.command()(policy)
