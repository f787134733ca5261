"""Benchmark: a single worker's recovery through the in-process restart (``raise``: ``--fail STEP:worker:raise``,
the process survives, ``training.in_process``), through a warm standby (``standby``: ``--fail STEP:worker``
with ``--warm-standby``, the process dies and a loaded standby executor takes over, ``workers.standby``)
and through a replacement worker (``exit``: ``--fail STEP:worker`` with ``--no-warm-standby``, Ray Train
restarts the worker group, a new process imports and loads everything).

The kinds run in turn, one ``raycheck run`` each (its own local Ray cluster), so the machine's load
hits all alike. From each run's ``summary.json``: failure -> restored and failure -> first step done
(seconds), and the breakdown (``orchestrator.summary``); per kind the means, and the ratios to ``exit``.

    python -m raycheck.experiments.inproc_bench --runs 3 --steps 8 --fail-step 3 --out /tmp/inproc-bench
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

from raycheck.orchestrator.summary import BREAKDOWN, STANDBY_BREAKDOWN

KINDS = {"raise": ("raise", []), "standby": ("exit", ["--warm-standby"]), "exit": ("exit", ["--no-warm-standby"])}
"""Each kind of run: the worker failure's ``how`` and the extra options."""


def run_once(out: pathlib.Path, kind: str, steps: int, fail_step: int, model: str) -> dict:
    """One ``raycheck run`` with a worker failure of ``kind`` (``KINDS``); its one recovery row of ``summary.json``."""
    how, extra = KINDS[kind]
    cmd = [sys.executable, "-m", "raycheck.cli", "run", "--model", model, "--steps", str(steps),
           "--fail", f"{fail_step}:worker:{how}", *extra, "--out", str(out), "--overwrite"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    summary = json.loads((out / "summary.json").read_text())
    [recovery] = summary["recoveries"]
    return recovery


def table(rows: dict[str, list[dict]]) -> str:
    """Markdown: one row per component (and the two totals), one column per run, the mean per kind (``rows``' keys, in order)."""
    kinds = list(rows)
    runs = [(how, i, r) for how in kinds for i, r in enumerate(rows[how], start=1)]
    order = [BREAKDOWN[0][1], STANDBY_BREAKDOWN[1][1], *(part for _, part in BREAKDOWN[1:])]  # detection, promotion, ...
    components = sorted({c for _, _, r in runs for c in r["breakdown"]}, key=lambda c: order.index(c) if c in order else len(order))
    lines = ["| component | " + " | ".join(f"{how} {i}" for how, i, _ in runs) + " | " + " | ".join(f"mean {h}" for h in kinds) + " |",
             "| --- " * (1 + len(runs) + len(kinds)) + "|"]

    def line(name: str, value) -> str:
        cells = [value(r) for _, _, r in runs]
        kept = [[v for (how, _, _), v in zip(runs, cells) if how == h and v is not None] for h in kinds]
        means = [statistics.mean(k) if k else None for k in kept]
        return f"| {name} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in cells + means) + " |"

    for c in components:
        lines.append(line(c.removesuffix("_s"), lambda r, c=c: r["breakdown"].get(c)))
    lines.append(line("**failure -> restored**", lambda r: r["seconds"]))
    lines.append(line("**failure -> first step done**", lambda r: r["first_step_seconds"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs of each kind, alternating (>= 1)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fail-step", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/inproc-bench"))
    args = p.parse_args(argv)
    if args.runs < 1 or not 0 <= args.fail_step < args.steps:
        p.error("--runs must be >= 1 and --fail-step in 0..steps-1")
    rows: dict[str, list[dict]] = {how: [] for how in KINDS}
    print(f"load average at the start {os.getloadavg()}", flush=True)
    for i in range(args.runs):
        for how in KINDS:
            rows[how].append(run_once(args.out / f"{how}{i + 1}", how, args.steps, args.fail_step, args.model))
            print(f"{how} {i + 1}: failure -> restored {rows[how][-1]['seconds']:.2f} s, path {rows[how][-1]['path']}", flush=True)
    print(table(rows))
    for name, field in (("failure -> restored", "seconds"), ("failure -> first step done", "first_step_seconds")):
        means = {how: statistics.mean(r[field] for r in rows[how]) for how in KINDS}
        print(f"{name}, mean: " + ", ".join(f"{how} {m:.2f} s" for how, m in means.items())
              + " (" + ", ".join(f"exit / {how} {means['exit'] / means[how]:.1f}x" for how in KINDS if how != "exit") + ")")
    print(f"load average at the end {os.getloadavg()}")
    return rows


if __name__ == "__main__":
    main()
