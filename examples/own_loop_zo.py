"""Your own zeroth-order (MeZO) training loop under Ray Train, with raycheck's step log, CPU shadow and recovery.

    python examples/own_loop_zo.py --out /tmp/own-zo --fail-step 7 --verify
    ray job submit --working-dir . -- python examples/own_loop_zo.py --out /tmp/own-zo --fail-step 7 --verify

Everything the user owns is in this file: the model (``Regressor``, a two-layer MLP written here: no
Hugging Face), the data (``batch_of(step, ...)``: a seeded, deterministic function of the step), the loss
(``loss_fn``) and the ``train_loop_per_worker`` Ray Train runs. raycheck is one call in the loop
(``workers.own_loop_zo.zeroth_order``, then ``steps``/``step``/``close``) and one on the driver
(``orchestrator.api.run_own_loop``), which starts the run's log keeper, shadow and snapshot persister
and injects the failures, as ``raycheck run`` does.

``--fail-step N``: raycheck's failure injector makes a worker process (the last rank's) exit during step N
(0-based: after N steps; once per run); Ray Train restarts it, and it restores the freshest state (the live shadow's
image, or a snapshot plus the step log tail) and goes on. ``--verify`` also runs the failure-free loop and
compares the final weights bitwise (sha256 over every tensor). Prints the summary; exits 0 only when the
run finished, no logged step was lost and (``--verify``) recovery was exact.

Ray: connects to the cluster of ``$RAY_ADDRESS`` (what ``ray job submit`` sets), else starts a local one.
On a cluster of several nodes give ``--storage`` and ``--ray-train-storage`` buckets (``s3://...``), which
every node reaches: by default both are folders of ``--out`` on the driver's disk.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import ray.train
import torch

from raycheck.job.config import FailureSpec
from raycheck.orchestrator.api import job_config, run_own_loop
from raycheck.training.model import trainable_parameters
from raycheck.training.state import state_sha256
from raycheck.workers.own_loop import load_checkpoint
from raycheck.workers.own_loop_zo import zeroth_order

INPUTS, HIDDEN, BATCH = 8, 32, 64


class Regressor(torch.nn.Module):
    """``hidden`` (8 -> 32, GELU) then ``out`` (32 -> 1): the user's own ``nn.Module``."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(INPUTS, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(self.hidden(x))).squeeze(-1)


def batch_of(step: int, seed: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of batch ``step``: inputs [BATCH / world, 8] float32 and targets sin(sum of
    the inputs), a pure function of (seed, step): every process draws the same batch for the same step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(BATCH, INPUTS, generator=g)
    return x[rank::world], torch.sin(x.sum(dim=1))[rank::world]


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error: a scalar tensor (what ``zeroth_order`` requires)."""
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The user's loop; the raycheck calls are marked."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = Regressor()  # its initial weights are replaced by the driver's
    zo = zeroth_order(config, model, loss_fn, lambda step: batch_of(step, config["seed"], rank, world))  # raycheck (1/3): restores
    for _step in zo.steps():
        zo.step()  # raycheck (2/3): +eps, loss, -2 eps, loss, the step log, the update
    zo.close()  # raycheck (3/3): the final state's hash for the summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", required=True, help="the run's folder (step log, snapshots, summary.json)")
    parser.add_argument("--fail-step", type=int, default=None, help="a worker exits in this step (0-based: after N steps), once")
    parser.add_argument("--verify", action="store_true", help="also run the failure-free loop and compare bitwise")
    parser.add_argument("--steps", type=int, default=20, help="MeZO steps to train")
    parser.add_argument("--workers", type=int, default=1, help="Ray Train workers (each scores its share of the batch)")
    parser.add_argument("--every", type=int, default=5, help="steps between the shadow's snapshots (>= 1; the final step "
                        "is snapshotted too, and this example loads that snapshot)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of the ZO-SGD update")
    parser.add_argument("--eps", type=float, default=1e-3, help="perturbation scale of the two-point estimate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the data, the initial weights and every step's noise")
    parser.add_argument("--storage", default="", help="where snapshots go: s3://bucket/prefix on a cluster (default: --out/snapshots)")
    parser.add_argument("--s3-endpoint", default=None, help="an S3-compatible server's URL (default: AWS)")
    parser.add_argument("--ray-train-storage", default="", help="Ray Train's storage, where Result.checkpoint points from: "
                        "s3://bucket/prefix on a cluster (default: --out/ray_train, this machine's disk)")
    args = parser.parse_args(argv)
    if args.fail_step is not None and not 0 <= args.fail_step < args.steps:
        parser.error(f"--fail-step must be in 0..{args.steps - 1}")
    if args.every < 1:
        parser.error("--every must be >= 1: this example loads the final snapshot, which a run without snapshots has not")

    failures = (FailureSpec(step=args.fail_step, target="worker"),) if args.fail_step is not None else ()
    try:
        cfg = job_config(args.out, steps=args.steps, workers=args.workers, seed=args.seed, zo={"lr": args.lr, "eps": args.eps},
                         snapshot={"every_steps": args.every}, faults={"failures": failures},
                         storage={"uri": args.storage, "ray_train": args.ray_train_storage,
                                  "options": {"endpoint_url": args.s3_endpoint} if args.s3_endpoint else {}})
    except ValueError as exc:  # a setting no run can use, e.g. a storage URI with a slash lost
        parser.error(str(exc))
    torch.manual_seed(args.seed)
    summary = run_own_loop(cfg, train_loop_per_worker, Regressor(), verify=args.verify)
    trained, reported = None, None
    if summary.get("final_snapshot"):  # the trained weights, in one call
        model = Regressor()
        load_checkpoint(summary["final_snapshot"], model, **cfg.storage.options)
        trained = state_sha256(trainable_parameters(model))
    if summary.get("ray_train_checkpoint"):  # Ray Train's Result.checkpoint: a pointer to the same kind of snapshot
        model = Regressor()
        load_checkpoint(summary["ray_train_checkpoint"]["path"], model, **cfg.storage.options)
        reported = state_sha256(trainable_parameters(model))
    keys = ("ok", "final_step", "state_sha256", "reference_state_sha256", "bitwise_equal", "lost_steps", "final_snapshot",
            "ray_train_checkpoint", "recoveries", "error")
    print(json.dumps({**{k: summary.get(k) for k in keys}, "final_snapshot_loads_final_state": trained == summary["state_sha256"],
                      "ray_train_checkpoint_loads_final_state": reported == summary["state_sha256"]}, indent=2, default=str))
    exact = summary["ok"] and not summary.get("lost_steps") and (not args.verify or summary.get("bitwise_equal") is True)
    # None: Ray Train's storage is the driver's disk, which a worker on another node cannot reach
    reported_ok = reported == summary["state_sha256"] or (reported is None and not args.ray_train_storage)
    return 0 if exact and trained == summary["state_sha256"] and reported_ok else 1


if __name__ == "__main__":
    sys.exit(main())
