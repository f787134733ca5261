"""Your own first-order training loop under Ray Train, checkpointed by raycheck (layer-wise by default).

    python examples/own_loop_fo.py --out /tmp/own-loop --fail-step 7 --verify
    python examples/own_loop_fo.py --out /tmp/own-fsdp --fail-step 7 --verify --workers 2 --fsdp2 --strategy full-async
    ray job submit --working-dir . -- python examples/own_loop_fo.py --out /tmp/own-loop --fail-step 7 --verify \
        --storage s3://bucket/own-loop --s3-endpoint http://host:9000

Everything the user owns is in this file: the model (``TinyMLP``, a residual MLP: no Hugging Face), the
data (``batch_of(step)``: a seeded, deterministic function of the step), the loss (``loss_fn``),
``torch.optim.AdamW`` and the ``train_loop_per_worker`` that Ray Train's ``TorchTrainer`` runs. raycheck
is three calls in that loop (``workers.own_loop.FirstOrderCheckpoints``: ``restore``, ``after_step``,
``close``) and one after it (``load_checkpoint(result.checkpoint, ...)``).

``--fail-step N``: the rank-0 worker process exits (``os._exit(1)``) in step N (0-based: after N steps,
between its backward and ``optimizer.step``; its background writes settled first), once (an ``Events``
actor answers "fail" the first time only); Ray Train (``FailureConfig(max_failures=2)``) restarts the
worker group, which restores the newest committed checkpoint and recomputes the lost steps. ``--verify``
also runs the failure-free loop and compares the final states (sha256 over every tensor: weights, AdamW
moments and step counts, parameter groups; ``training.state.state_sha256``). Layer-wise checkpoints use
threshold 0 by default (every changed unit is rewritten at each check), so every strategy here must be
bitwise exact; with ``--layer-threshold`` > 0 a layer-wise restore is approximate by design and
``--verify`` checks its bound instead: every unit of the restored composite at most
``--layer-staleness-steps`` old. Prints a JSON summary; exits 0 only when the run finished,
``Result.checkpoint`` is the newest committed snapshot and loads, and (``--verify``) recovery was exact
(or within the bound).

Storage: Ray Train's ``storage_path`` is ``--out/ray`` on one machine, or ``--storage`` (a bucket) on a
cluster whose nodes share no disk; the checkpoints go to ``<experiment dir>/raycheck`` in it. The workers
tell the driver what happened through the ``Events`` actor, never through a file.

Ray: connects to the cluster of ``$RAY_ADDRESS`` (what ``ray job submit`` sets) or ``--address``, else
starts a local one (``ray.init(address="local")``, never another process's local cluster).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys
import urllib.parse
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard

import ray
import ray.train
import ray.train.torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from raycheck.job.config import DifferentialConfig, OverlappedConfig
from raycheck.policies.layerwise import LayerwiseConfig
from raycheck.storage.backend import storage_env
from raycheck.training.optim_state import ModelOptimizerState
from raycheck.training.sharded import full_state
from raycheck.training.state import state_sha256
from raycheck.workers.own_loop import STRATEGIES, FirstOrderCheckpoints, load_checkpoint

FEATURES, HIDDEN, CLASSES, BATCH = 16, 64, 4, 32


class TinyMLP(torch.nn.Module):
    """A residual MLP: ``embed`` (16 -> 64), ``layers.0..3`` (64 -> 64, tanh, residual), ``head`` (64 -> 4).
    ``layers.<i>`` names make each block its own checkpoint unit (``storage.units.unit_of``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(FEATURES, HIDDEN)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.head = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return self.head(h)


TEACHER = torch.Generator().manual_seed(1234)
PROJECTION = torch.randn(FEATURES, CLASSES, generator=TEACHER)


def batch_of(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step``: ``BATCH`` x ``FEATURES`` float32 inputs and int64 labels in [0, CLASSES) from a fixed
    random teacher, a pure function of (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, (x @ PROJECTION).argmax(dim=1)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with label smoothing 0.1 (the user's own loss)."""
    return torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)


@ray.remote(num_cpus=0)
class Events:
    """What the workers tell the driver, kept in a Ray actor (no file crosses nodes): each start, the final
    state, and the one injected failure."""

    def __init__(self) -> None:
        self.starts: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self.failed = False

    def start(self, event: dict[str, Any]) -> None:
        self.starts.append(event)

    def finish(self, final: dict[str, Any]) -> None:
        self.final = final

    def fail_once(self) -> bool:
        """True the first time only: the run's one failure."""
        first, self.failed = not self.failed, True
        return first

    def report(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        return self.starts, self.final


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """The user's loop; the three raycheck calls are marked."""
    torch.set_num_threads(1)  # the same arithmetic in every run: bitwise comparable
    events, ctx = config["events"], ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(config["seed"])
    model = TinyMLP()
    if config["fsdp2"]:  # FSDP2: each rank holds its rows of every parameter (and, below, of every AdamW moment)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif world > 1:
        model = ray.train.torch.prepare_model(model)  # DDP over gloo: gradients averaged over the ranks
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.01, foreach=False)

    ckpt = FirstOrderCheckpoints(  # raycheck (1/3): storage defaults to <Ray Train experiment dir>/raycheck
        model, optimizer, strategy=config["strategy"], every_steps=config["every"],
        settings={k: config[k] for k in ("seed", "lr", "steps", "strategy")}, storage_options=config["storage_options"],
        layerwise=LayerwiseConfig(threshold=config["threshold"], staleness_bound_steps=config["staleness"]),
        differential=DifferentialConfig(full_every_steps=config["every"], batch_steps=2),
        overlapped=OverlappedConfig(chunks=config["chunks"]))
    start = ckpt.restore()  # raycheck (2/3): model AND optimizer, in place; 0: nothing committed yet
    if rank == 0:
        ray.get(events.start.remote({"step": start, **{k: ckpt.restored.get(k) for k in ("folder", "ray_checkpoint", "unit_steps")}}))

    for step in range(start, config["steps"]):
        x, y = batch_of(step, config["seed"])
        loss = loss_fn(model(x[rank::world]), y[rank::world])
        loss.backward()
        if step == config["fail_step"] and rank == 0 and ray.get(events.fail_once.remote()):
            ckpt.flush()  # settle the writes in flight, so the restore point follows from the step (a real crash may lose one)
            os._exit(1)  # the process dies: Ray Train restarts the worker group
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ckpt.after_step(step + 1, {"loss": loss.item()})  # raycheck (3/3): checkpoints and Ray Train reports

    stats = ckpt.close(config["steps"])
    final_sha256 = state_sha256(full_state(ModelOptimizerState(model, optimizer).view()))  # FSDP2: re-gathered, every rank
    if rank == 0:
        ray.get(events.finish.remote({"state_sha256": final_sha256,
                                      "checkpoints": stats.get("checkpoints"), "newest": stats.get("newest"),
                                      "storage": stats.get("storage")}))


def ray_train_storage(args: argparse.Namespace) -> dict[str, Any]:
    """``RunConfig``'s storage: ``--storage`` (a bucket, through pyarrow's S3 filesystem at ``--s3-endpoint``;
    credentials from the environment) or ``--out/ray``."""
    if not args.storage:
        return {"storage_path": str(pathlib.Path(args.out).resolve() / "ray")}
    import pyarrow.fs

    endpoint = urllib.parse.urlparse(args.s3_endpoint) if args.s3_endpoint else None
    fs = pyarrow.fs.S3FileSystem(**({"endpoint_override": endpoint.netloc, "scheme": endpoint.scheme} if endpoint else {}))
    return {"storage_path": args.storage.removeprefix("s3://"), "storage_filesystem": fs}


def run(args: argparse.Namespace, name: str, fail_step: int | None) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """One ``TorchTrainer`` run of the loop; returns (Result, the final record, the start events)."""
    events = Events.remote()
    config = dict(events=events, name=name, seed=args.seed, lr=args.lr, steps=args.steps, every=args.every,
                  strategy=args.strategy, threshold=args.layer_threshold, staleness=args.layer_staleness_steps, chunks=args.chunks,
                  fail_step=-1 if fail_step is None else fail_step, storage_options=storage_options(args), fsdp2=args.fsdp2)
    trainer = TorchTrainer(train_loop_per_worker, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=args.workers),
                           run_config=RunConfig(name=name, failure_config=FailureConfig(max_failures=2), **ray_train_storage(args),
                                                worker_runtime_env={"env_vars": storage_env()}))  # the workers reach the bucket
    result = trainer.fit()
    starts, final = ray.get(events.report.remote())
    if final is None:
        raise RuntimeError(f"run {name} ended without its final state: {result.error}")
    return result, final, starts


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """raycheck's storage options: the S3-compatible endpoint, if any."""
    return {"endpoint_url": args.s3_endpoint} if args.s3_endpoint else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", required=True, help="the run's folder (Ray Train's storage and the checkpoints, without --storage)")
    parser.add_argument("--fail-step", type=int, default=None, help="the rank-0 worker exits in this step (0-based), once")
    parser.add_argument("--verify", action="store_true", help="also run the failure-free loop and compare bitwise")
    parser.add_argument("--strategy", default="layerwise", choices=STRATEGIES, help="how raycheck checkpoints (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--every", type=int, default=5, help="steps between checkpoints (overlapped: between snapshot starts; "
                        "differential: between full ones, each step's record written in objects of 2 steps)")
    parser.add_argument("--chunks", type=int, default=2, help="overlapped: a snapshot is staged in this many chunks, one per step")
    parser.add_argument("--workers", type=int, default=1, help="Ray Train workers (DDP over gloo when > 1)")
    parser.add_argument("--fsdp2", action="store_true", help="shard the model and AdamW over the workers with FSDP2 (fully_shard) "
                        "instead of DDP: sharded checkpoints, every rank writing its rows (any --strategy)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW's learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the model's and the batches' seed (default: %(default)s)")
    parser.add_argument("--layer-threshold", type=float, default=0.0, help="layer-wise: relative change that rewrites a unit (0: exact)")
    parser.add_argument("--layer-staleness-steps", type=int, default=100, help="layer-wise: a unit this old is rewritten")
    parser.add_argument("--storage", default="", help="Ray Train's storage_path in a bucket, s3://bucket/prefix (a cluster "
                        "whose nodes share no disk); the checkpoints go to <experiment dir>/raycheck there")
    parser.add_argument("--s3-endpoint", default=None, help="an S3-compatible server's URL (default: AWS)")
    parser.add_argument("--address", default=None, help="a Ray cluster (default: $RAY_ADDRESS, else a new local one)")
    args = parser.parse_args(argv)
    for name in ("steps", "every", "chunks", "workers", "layer_staleness_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.fail_step is not None and not 0 <= args.fail_step < args.steps:
        parser.error(f"--fail-step must be in 0..{args.steps - 1}")
    if args.fsdp2 and args.workers < 2:
        parser.error(f"--fsdp2 shards over the workers: give --workers 2 or more (got {args.workers})")

    out = pathlib.Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):  # Ray Train would resume the runs found there
        parser.error(f"--out {out} is not empty: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    if not ray.is_initialized():
        address = args.address or os.environ.get("RAY_ADDRESS") or "local"
        local = {"num_cpus": max(2, args.workers + 1), "include_dashboard": False, "log_to_driver": False,
                 "logging_level": logging.WARNING}  # the workers' output stays in Ray's logs (session_latest/logs)
        ray.init(address=address, **(local if address == "local" else {}))

    if args.fail_step is not None:
        print(f"[own_loop_fo] the rank-0 worker will exit in step {args.fail_step} (the injected failure): Ray's "
              "'worker died' message below is that exit", file=sys.stderr, flush=True)
    result, final, events = run(args, "failing", args.fail_step)
    restores = [e for e in events if e["step"] > 0 or e["folder"]]
    ckpt_path = result.checkpoint.path if result.checkpoint is not None else None
    newest = final["newest"]  # rank 0's newest committed snapshot at close
    fresh_model = TinyMLP()
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
    loaded_step = load_checkpoint(result.checkpoint, fresh_model, fresh_opt, **storage_options(args)) if result.checkpoint else None
    loaded_sha = state_sha256(ModelOptimizerState(fresh_model, fresh_opt).view())
    summary: dict[str, Any] = {
        "strategy": args.strategy, "steps": args.steps, "workers": args.workers, "every_steps": args.every,
        "layer_threshold": args.layer_threshold if args.strategy == "layerwise" else None,
        "fail_step": args.fail_step, "worker_starts": len(events),
        "restored_from_steps": [e["step"] for e in restores],
        "checkpoints": final["storage"], "checkpoints_committed_by_last_worker": final["checkpoints"],
        "result_checkpoint": ckpt_path, "result_checkpoint_step": loaded_step,
        "result_checkpoint_is_newest": ckpt_path is not None and os.path.basename(ckpt_path) == newest,
        "result_checkpoint_loads_final_state": loaded_step == args.steps and loaded_sha == final["state_sha256"],
        "state_sha256": final["state_sha256"],
    }
    # layer-wise above threshold 0: the final composite holds units of earlier steps (within the staleness bound), so
    # Result.checkpoint loads the composite of the last step, not the final state bit for bit
    approximate = args.strategy == "layerwise" and args.layer_threshold > 0
    ok = summary["result_checkpoint_is_newest"] and (summary["result_checkpoint_loads_final_state"] or
                                                     (approximate and loaded_step == args.steps))
    if args.fail_step is not None:
        ok = ok and len(events) >= 2
    if args.verify:
        _, reference, _ = run(args, "reference", None)
        bitwise = final["state_sha256"] == reference["state_sha256"]
        summary.update(reference_sha256=reference["state_sha256"], bitwise_equal=bitwise)
        if approximate:  # LayerCheck's bound: every restored unit at most the staleness bound old
            ages = [e["step"] - s for e in restores for s in (e["unit_steps"] or {}).values()]
            summary["recovery"] = "within bound" if max(ages, default=0) <= args.layer_staleness_steps else "beyond bound"
            ok = ok and summary["recovery"] == "within bound"
        else:
            summary["recovery"] = "exact" if bitwise else "NOT exact"
            ok = ok and bitwise
    print(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
