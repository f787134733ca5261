"""Benchmark: a single worker's recovery through the in-process restart (``--fail STEP:worker:raise``, the
process survives, ``training.in_process``) against a replacement worker (``--fail STEP:worker``, ``exit``:
Ray Train restarts the worker group, a new process imports and loads everything).

The two run alternately, one ``raycheck run`` each (its own local Ray cluster), so the machine's load
hits both alike. From each run's ``summary.json``: failure -> restored and failure -> first step done
(seconds), and the breakdown (``orchestrator.summary``); per kind the means, and the ratio exit / raise.

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

from raycheck.orchestrator.summary import BREAKDOWN

KINDS = ("raise", "exit")


def run_once(out: pathlib.Path, how: str, steps: int, fail_step: int, model: str) -> dict:
    """One ``raycheck run`` with a worker failure of ``how``; its one recovery row of ``summary.json``."""
    cmd = [sys.executable, "-m", "raycheck.orchestrator.cli", "run", "--model", model, "--steps", str(steps),
           "--fail", f"{fail_step}:worker:{how}", "--out", str(out), "--overwrite"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    summary = json.loads((out / "summary.json").read_text())
    [recovery] = summary["recoveries"]
    return recovery


def table(rows: dict[str, list[dict]]) -> str:
    """Markdown: one row per component (and the two totals), one column per run, the mean per kind."""
    runs = [(how, i, r) for how in KINDS for i, r in enumerate(rows[how], start=1)]
    order = [part for _, part in BREAKDOWN]
    components = sorted({c for _, _, r in runs for c in r["breakdown"]}, key=lambda c: order.index(c) if c in order else len(order))
    lines = ["| component | " + " | ".join(f"{how} {i}" for how, i, _ in runs) + " | " + " | ".join(f"mean {h}" for h in KINDS) + " |",
             "| --- " * (1 + len(runs) + len(KINDS)) + "|"]

    def line(name: str, value) -> str:
        cells = [value(r) for _, _, r in runs]
        kept = [[v for (how, _, _), v in zip(runs, cells) if how == h and v is not None] for h in KINDS]
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
    means = {how: statistics.mean(r["seconds"] for r in rows[how]) for how in KINDS}
    print(f"failure -> restored, mean: raise {means['raise']:.2f} s, exit {means['exit']:.2f} s "
          f"(exit / raise {means['exit'] / means['raise']:.1f}x); load average {os.getloadavg()}")
    return rows


if __name__ == "__main__":
    main()
