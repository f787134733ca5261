"""Scale study: wasted time of each snapshot strategy from 1k to 16k accelerators, 7B to 70B models.

For every model size and job size it builds the costs below, takes each strategy at its interval
(full sync at Daly's, full async and the shadow at the model's optimum, the shadow also at Young's,
log-only over one day of training), predicts the waste in closed form (``policies.models``) and
simulates it (``policies.simulate``, exponential failures, and Weibull with shape 0.7 for bursty
failures). Writes ``scale_study.csv`` and ``scale_study.png`` and prints the table.

    python -m raycheck.experiments.scale_study [--out runs/scale_study] [--accelerators 1024 16384] [--models 7 70]

Assumptions (edit ``Assumptions`` to change them):
- Failures: 419 unexpected interruptions in 54 days on 16,384 GPUs (about one every 3.1 h), so each
  accelerator fails every 16,384 x 3.1 h on average, independently.
- Snapshot: the bf16 weights (2 bytes per parameter; MeZO keeps no optimizer state), written at
  5 GB/s, read at 10 GB/s, staged device-to-host at 20 GB/s for asynchronous snapshots.
- Step time 0.25 s per billion parameters (weak scaling: constant in the job size); the sharded
  CPU shadow replays a step in 0.3 of that; restart 10 min; log append 100 us per step.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
from dataclasses import dataclass

from raycheck.policies.compare import compare
from raycheck.policies.costs import MeasuredCosts
from raycheck.policies.simulate import Exponential, Weibull, simulate

STUDIED = (("full-sync", "daly"), ("full-async", "optimal"), ("log-only", "none"), ("shadow", "young"), ("shadow", "optimal"))


@dataclass(frozen=True, kw_only=True)
class Assumptions:
    """The inputs of the study (seconds, bytes, bytes per second)."""

    reference_accelerators: int = 16_384
    reference_job_mtbf_s: float = 54 * 86_400 / 419
    bytes_per_param: int = 2
    step_s_per_billion_params: float = 0.25
    replay_fraction: float = 0.3
    write_bytes_per_s: float = 5e9
    read_bytes_per_s: float = 10e9
    stage_bytes_per_s: float = 20e9
    restart_s: float = 600.0
    log_append_s: float = 1e-4
    log_only_horizon_s: float = 86_400.0

    def costs(self, params_billion: float, accelerators: int) -> MeasuredCosts:
        """The costs of a job training a model of ``params_billion`` on ``accelerators``."""
        snapshot_bytes = params_billion * 1e9 * self.bytes_per_param
        step_s = self.step_s_per_billion_params * params_billion
        return MeasuredCosts.for_accelerators(
            accelerator_mtbf_s=self.reference_job_mtbf_s * self.reference_accelerators, accelerators=accelerators,
            step_s=step_s, replay_step_s=self.replay_fraction * step_s, snapshot_s=snapshot_bytes / self.write_bytes_per_s,
            stall_s=snapshot_bytes / self.stage_bytes_per_s, restart_s=self.restart_s,
            load_s=snapshot_bytes / self.read_bytes_per_s, log_append_s=self.log_append_s,
        )


def study(models_billion: list[float], accelerators: list[int], sim_mtbfs: float, seed: int,
          assumptions: Assumptions = Assumptions()) -> list[dict]:
    """One row per (model, job size, strategy): interval, analytic and simulated waste."""
    rows = []
    for params in models_billion:
        for n in accelerators:
            costs = assumptions.costs(params, n)
            options = {(str(o.strategy), o.rule): o for o in compare(costs, horizon_s=assumptions.log_only_horizon_s)}
            for key in STUDIED:
                o = options[key]
                if o.overhead_pct is None:
                    raise ValueError(f"{key[0]}/{key[1]} is infeasible for a {params:g}B model on {n} accelerators: {o.error}")
                log_only = o.interval_steps is None
                horizon_s = assumptions.log_only_horizon_s if log_only else sim_mtbfs * costs.mtbf_s
                runs = max(1, round(sim_mtbfs * costs.mtbf_s / horizon_s)) if log_only else 1
                sims = [simulate(o.strategy, costs, interval_steps=o.interval_steps, horizon_s=horizon_s, runs=runs,
                                 failures=failures, seed=seed) for failures in (Exponential(), Weibull(shape=0.7))]
                rows.append({
                    "model": f"{params:g}B", "snapshot_gb": round(params * assumptions.bytes_per_param, 1),
                    "accelerators": n, "job_mtbf_h": round(costs.mtbf_s / 3600, 2), "strategy": key[0], "rule": key[1],
                    "interval_steps": o.interval_steps, "interval_min": None if o.interval_s is None else round(o.interval_s / 60, 2),
                    "analytic_pct": round(o.overhead_pct, 3), "simulated_pct": round(100 * sims[0].waste_ratio, 3),
                    "weibull07_pct": round(100 * sims[1].waste_ratio, 3),
                    "simulated_h_per_day": round(24 * sims[0].waste_ratio / (1 + sims[0].waste_ratio), 3),
                    "failures_simulated": sims[0].failures,
                })
    return rows


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Simulated wasted hours per day against job size, one panel per model, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models):
        for strategy, rule in STUDIED:
            line = [r for r in rows if r["model"] == model and (r["strategy"], r["rule"]) == (strategy, rule)]
            ax.plot([r["accelerators"] for r in line], [r["simulated_h_per_day"] for r in line], marker="o",
                    linestyle="--" if rule == "young" else "-", label=strategy if rule == "none" else f"{strategy} ({rule})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model} ({line[0]['snapshot_gb']} GB snapshot)")
        ax.set_xlabel("accelerators")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("simulated wasted hours per day")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(rows: list[dict]) -> str:
    cols = ("model", "accelerators", "job_mtbf_h", "strategy", "rule", "interval_min", "analytic_pct", "simulated_pct",
            "weibull07_pct", "simulated_h_per_day")
    cells = [[str(c) for c in cols]] + [["-" if r[c] is None else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/scale_study"))
    ap.add_argument("--accelerators", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--models", type=float, nargs="+", default=[7, 13, 70], help="Model sizes, billions of parameters.")
    ap.add_argument("--sim-mtbfs", type=float, default=2000, help="Simulated training time per point, in MTBFs.")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = study(args.models, args.accelerators, args.sim_mtbfs, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "scale_study.csv")
    plot(rows, args.out / "scale_study.png")
    print(format_table(rows))
    print(f"table: {args.out / 'scale_study.csv'}   plot: {args.out / 'scale_study.png'}")
    return rows


if __name__ == "__main__":
    main()
