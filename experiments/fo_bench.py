"""Benchmark: first-order checkpointing strategies, in process (no Ray), on the real snippets.

One failure-free AdamW trajectory of ``--restart-at + (--seeds - 1) * --seed-gap + --post-restart``
steps runs with every selected checkpointer attached (each with its own store under ``--out``; their
background writers run concurrently, which makes each one's figures pessimistic). Per strategy it
measures the bytes committed and the training-loop time blocked by ``after_step``, per 100 steps,
against the step's compute time. At step ``--restart-at`` every strategy but layer-wise restores its newest durable state:

* ``full-async`` and ``differential`` (exact): the restored state (snapshot; snapshot + replayed
  records) is compared bitwise with the failure-free state; equal means zero deviation afterwards.
* ``differential-topk``: restored like ``differential``; its state distance is reported.
* ``overlapped-M`` (GoCkpt, M chunks staged over M steps): its snapshots are of the last chunk's step;
  the failure-free state's sha256 is taken at each of them, and the restored state is compared bitwise.

Layer-wise deviation (after the failure-free run, one restart at a time): at each of ``--seeds``
restart points ``R = --restart-at + i * --seed-gap`` a trainer loads the newest composite of step
<= R (``SnapshotStore.load_latest``), trains the ``--post-restart`` steps after R on the failure-free
run's batches, and both are evaluated on one fixed held-out batch of ``--eval-size`` examples of the
eval split (``eval_indices``); the relative eval-loss deviation is reported per restart point and as
the mean absolute deviation with its two-sided 95% Student-t interval (``deviation_stats``). With
``--noise-floor`` the same statistic is measured for an exact restart (the failure-free state at R,
stored in a reference store) trained on another batch order (run seed 1): the deviation an equally
valid trajectory shows, which a restart's deviation is to be compared against (an exact restart on
the same batches deviates by exactly 0). The mean training loss of the post-restart steps is compared
as well (the earlier, noisier figure).

Differential full interval: ``--full-every 0`` chooses it with the cost model
(``policies.models.differential_full_interval_steps``) from costs measured on the live trainer before
the run (``calibrate_full_every``: the staging copy and background write of a full checkpoint, a
training step, the read-verify-replay of one record; the trainer is then reset to its initial state),
capped by ``--record-budget-gb`` (records kept between two full checkpoints); ``full-async`` then
checkpoints at the same interval.

Per-step stall: the maximum and the mean (over the steps that stalled) of each strategy's blocked
time, and for ``overlapped-M`` their ratios to ``full-async``'s one-shot staging copy. For
``full-async`` and ``layerwise`` the blocked time is split into the staging copies (``copy_seconds``)
and the rest (waiting for room at the background writer, handing the check over), with the checks
postponed because the writer was behind.

Printed beside the papers' figures (``docs/algorithms.md``): LayerCheck (arXiv 2026) 22.6x fewer
bytes and post-restart loss within 0.54%; LowDiff (SC'25) under 3.1% runtime overhead with
per-iteration differential checkpoints; GoCkpt (arXiv:2511.07035) -86.7% training interruption time. Results: ``fo_bench.json`` and ``fo_bench_steps.parquet``.

    python -m raycheck.experiments.fo_bench --model tiny --restart-at 110 --post-restart 100
    python -m raycheck.experiments.fo_bench --model smollm2-135m --batch-size 4 --strategies layerwise --restart-at 40 \
        --seeds 3 --seed-gap 30 --post-restart 30 --eval-size 128 --noise-floor
    python -m raycheck.experiments.fo_bench --model smollm2-135m --batch-size 4 --strategies full-async,differential \
        --full-every 0 --batch-steps 2 --record-budget-gb 16 --restart-at 70 --post-restart 0
    python -m raycheck.experiments.fo_bench --model smollm2-135m --batch-size 4 --restart-at 20 --strategies full-async,layerwise
    python -m raycheck.experiments.fo_bench --model tiny --strategies full-async,overlapped-2,overlapped-4 --restart-at 50 --post-restart 0
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import pathlib
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raycheck.experiments.report_tables import mean_ci
from raycheck.policies.costs import MeasuredCosts
from raycheck.policies.layerwise import LayerwiseConfig, relative_change
from raycheck.policies.models import differential_full_interval_steps
from raycheck.storage.backend import Storage
from raycheck.storage.diffs import DiffStore
from raycheck.storage.snapshots import SnapshotStore
from raycheck.storage.tensor_files import as_numpy
from raycheck.storage.units import group_by_unit, parameter_of
from raycheck.training.checkpointing import FullCheckpointer
from raycheck.training.data import PromptEncoder, Split, batch_indices, classification_loss, load_rotten_tomatoes
from raycheck.training.differential import DiffCheckpointer
from raycheck.training.fo import FOHyper, FOTrainer
from raycheck.training.optim_state import ModelOptimizerState
from raycheck.training.optim_steps import OptimizerSteps
from raycheck.training.layerwise import LayerwiseCheckpointer
from raycheck.training.overlapped import OverlappedCheckpointer
from raycheck.training.model import load_model, load_tokenizer
from raycheck.training.state import copy_state, state_sha256

STRATEGIES = ("full-async", "layerwise", "differential", "differential-topk", "overlapped-2", "overlapped-4")
PAPERS = {"layerwise_bytes_ratio": 22.6, "layerwise_loss_deviation_pct": 0.54, "differential_overhead_pct": 3.1,
          "gockpt_interruption_reduction_pct": 86.7}
OVERLAPPED = "overlapped-"
KEEP_ALL = 1_000_000
EVAL_SEED = 2026
"""Run seed of the held-out evaluation batch (``eval_indices``)."""
NOISE_SEED = 1
"""Run seed of the noise floor's batch order (the failure-free run uses 0)."""


def release_memory() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere): loading SmolLM2
    from GGUF leaves about 1 GB of freed arenas that would otherwise stay in the run's resident set."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def eval_indices(size: int, n: int) -> np.ndarray:
    """The fixed held-out evaluation batch: ``size`` distinct indices into an eval split of ``n``
    samples, sorted (``batch_indices(EVAL_SEED, 0, size, n)``).

    Raises:
        ValueError: ``size`` is not in [1, n].
    """
    if not 1 <= size <= n:
        raise ValueError(f"eval size must be in [1, {n}] (the eval split's samples), got {size}")
    return np.sort(batch_indices(EVAL_SEED, 0, size, n))


def eval_loss(model: torch.nn.Module, encoder: PromptEncoder, split: Split, indices: np.ndarray, chunk: int = 16) -> float:
    """Mean cross-entropy over the label words (nats) of ``split``'s samples ``indices``, evaluated
    ``chunk`` samples at a time (``training.data.classification_loss``, no gradients)."""
    total = 0.0
    for start in range(0, len(indices), chunk):
        part = indices[start:start + chunk]
        total += classification_loss(model, encoder, split, part) * len(part)
    return total / len(indices)


def deviation_stats(reference: Sequence[float], restarted: Sequence[float]) -> dict:
    """Relative deviation of restarted runs' losses from the failure-free run's, one pair per seed.

    Args:
        reference: the failure-free run's loss per seed (> 0, e.g. nats).
        restarted: the restarted run's loss per seed, same order and length.

    Returns:
        ``per_seed_pct``: 100 (restarted - reference) / reference per seed (signed);
        ``mean_abs_pct``: the mean of their absolute values, with ``ci95_pct`` its two-sided 95%
        Student-t interval (``experiments.report_tables.mean_ci``; None for one seed), the lower
        bound clamped at 0 (a mean of absolute values cannot be negative);
        ``mean_signed_pct``; ``seeds``.

    Raises:
        ValueError: no pair, lengths differ, or a reference loss is not > 0.
    """
    if len(reference) != len(restarted) or not reference:
        raise ValueError(f"need one restarted loss per reference loss (>= 1), got {len(restarted)} and {len(reference)}")
    if not all(r > 0 for r in reference):
        raise ValueError(f"reference losses must be > 0, got {list(reference)}")
    signed = [100 * (got - ref) / ref for ref, got in zip(reference, restarted)]
    mean, lo, hi = mean_ci([abs(d) for d in signed], nonnegative=True)
    return {"per_seed_pct": signed, "mean_abs_pct": mean, "ci95_pct": None if lo is None else [lo, hi],
            "mean_signed_pct": float(np.mean(signed)), "seeds": len(signed)}


def restart_points(restart_at: int, seeds: int, gap: int) -> list[int]:
    """The layer-wise restart points ``restart_at + i * gap`` for ``i < seeds`` (steps).

    Raises:
        ValueError: ``seeds`` < 1, or ``gap`` < 1 with more than one seed.
    """
    if seeds < 1 or (seeds > 1 and gap < 1):
        raise ValueError(f"need seeds >= 1 and, for several, a gap >= 1 step; got seeds {seeds}, gap {gap}")
    return [restart_at + i * gap for i in range(seeds)]


def step_records(trainer: FOTrainer, record: bool = True) -> OptimizerSteps:
    """``trainer``'s AdamW steps as records (``training.optim_steps``): taken at each step (``record``), replayed."""
    return OptimizerSteps(ModelOptimizerState(trainer.model, trainer.optimizer), record)


def make_checkpointer(name: str, root: pathlib.Path, steps: OptimizerSteps, args: argparse.Namespace):
    store = SnapshotStore(Storage(str(root / name)), keep_last=KEEP_ALL if name == "layerwise" else 2)
    if name == "full-async":
        return store, FullCheckpointer(store, args.full_async_every, asynchronous=True)
    if name.startswith(OVERLAPPED):
        return store, OverlappedCheckpointer(store, args.every, int(name[len(OVERLAPPED):]), steps.catch_up_, steps.applied)
    if name == "layerwise":
        policy = LayerwiseConfig(threshold=args.threshold, staleness_bound_steps=args.staleness, max_bytes_per_check=args.max_bytes)
        return store, LayerwiseCheckpointer(store, args.every, policy)
    topk = args.topk if name == "differential-topk" else 0.0
    return store, DiffCheckpointer(store, DiffStore(store.storage), steps.applied, args.full_every, args.batch_steps, topk)


def weights_of(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A copy of the weights of a training state (no optimizer slots)."""
    return {n: np.array(as_numpy(t), copy=True) for n, t in state.items() if parameter_of(n) is None}


def unit_changes(weights: dict, previous: dict) -> dict[str, float]:
    """Relative weight change per unit between two copies of the weights (what the threshold is set against)."""
    return {unit: relative_change({n: weights[n] for n in names}, {n: previous[n] for n in names})
            for unit, names in group_by_unit(weights).items()}


def restore(name: str, store: SnapshotStore, trainer: FOTrainer) -> int:
    """Load the strategy's newest durable state into ``trainer``; returns its step."""
    loaded = store.load_latest()
    trainer.load_state(loaded.state)
    if not name.startswith("differential"):
        return loaded.info.step
    return DiffStore(store.storage).replay(loaded.info.step, step_records(trainer, record=False).replay).end_step


def calibrate_full_every(trainer: FOTrainer, steps: OptimizerSteps, split: Split, args: argparse.Namespace) -> dict:
    """Choose the differential full-checkpoint interval from costs measured on ``trainer``, then put
    its state back bitwise (the run starts from the state it had).

    Measures (seconds): ``stall_s`` (staging copy of the state), ``snapshot_s`` (one full write to a
    scratch store), ``step_s`` (the second of two training steps), ``replay_step_s`` (reading, verifying
    and replaying one exact record written to the scratch store). Returns them with ``model_full_every``
    (``differential_full_interval_steps`` at ``--mtbf``), ``record_bytes``, ``budget_full_every``
    (``--record-budget-gb`` over the records, whole batches; None without a budget) and ``full_every``
    (the smaller).
    """
    scratch = args.out / "stores" / "calibration"
    t0 = time.perf_counter()
    initial = copy_state(trainer.state_view())
    stall = time.perf_counter() - t0
    store = SnapshotStore(Storage(str(scratch)), keep_last=1)
    t0 = time.perf_counter()
    store.write(0, initial)
    snapshot = time.perf_counter() - t0
    for step in range(2):
        t0 = time.perf_counter()
        trainer.train_step(split, batch_indices(0, step, args.batch_size, len(split)))
        step_s = time.perf_counter() - t0
    record = copy_state(steps.applied())
    record_bytes = sum(a.nbytes for a in record.values())
    diffs = DiffStore(store.storage)
    trainer.load_state(initial)
    diffs.write_batch([(0, record)])
    t0 = time.perf_counter()
    diffs.replay(0, steps.replay, until=1)
    replay = time.perf_counter() - t0
    trainer.load_state(initial)
    del initial, record
    shutil.rmtree(scratch, ignore_errors=True)
    costs = MeasuredCosts(step_s=step_s, replay_step_s=replay, snapshot_s=snapshot, stall_s=stall, restart_s=0.0,
                          load_s=0.0, mtbf_s=args.mtbf)
    model = differential_full_interval_steps(costs, args.batch_steps)
    budget = None
    if args.record_budget_gb:
        budget = max(1, int(args.record_budget_gb * 1e9 // record_bytes) // args.batch_steps) * args.batch_steps
    return {"step_s": step_s, "replay_step_s": replay, "snapshot_s": snapshot, "stall_s": stall, "mtbf_s": args.mtbf,
            "record_bytes": record_bytes, "model_full_every": model, "budget_full_every": budget,
            "full_every": min(model, budget or model)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"))
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma list of {', '.join(STRATEGIES)}")
    p.add_argument("--restart-at", type=int, default=110, help="step of the restart (a multiple of --every)")
    p.add_argument("--post-restart", type=int, default=100, help="steps trained after each layer-wise restart point")
    p.add_argument("--seeds", type=int, default=1, help="layer-wise restart points (the deviation's samples)")
    p.add_argument("--seed-gap", type=int, default=30, help="steps between layer-wise restart points (a multiple of --every)")
    p.add_argument("--eval-size", type=int, default=128, help="held-out examples the deviation is evaluated on (0: none)")
    p.add_argument("--noise-floor", action="store_true", help="also restart exactly on another batch order (the deviation's floor)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--every", type=int, default=10, help="checkpoint interval of full-async and layerwise (steps)")
    p.add_argument("--threshold", type=float, default=1e-3, help="layer-wise relative-change threshold")
    p.add_argument("--staleness", type=int, default=100, help="layer-wise staleness bound (steps)")
    p.add_argument("--max-bytes", type=int, default=0, help="layer-wise bytes per check (0: no limit)")
    p.add_argument("--full-every", type=int, default=50,
                   help="differential: steps between full checkpoints (0: the cost model's, measured before the run; "
                        "full-async then uses it too)")
    p.add_argument("--batch-steps", type=int, default=5, help="differential: records per object")
    p.add_argument("--mtbf", type=float, default=3600.0, help="--full-every 0: the job's MTBF (seconds)")
    p.add_argument("--record-budget-gb", type=float, default=0.0,
                   help="--full-every 0: at most this many GB (1e9 bytes) of records between full checkpoints (0: no cap)")
    p.add_argument("--topk", type=float, default=0.01, help="differential-topk: fraction of elements kept")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training loop")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/fo_bench"))
    args = p.parse_args(argv)
    names = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(names) - set(STRATEGIES))
    if unknown or args.restart_at % args.every or (args.seeds > 1 and args.seed_gap % args.every):
        p.error(f"unknown strategies {unknown}" if unknown else "--restart-at and --seed-gap must be multiples of --every")
    if args.full_every < 0 or args.eval_size < 0:
        p.error("--full-every and --eval-size must be >= 0")
    try:
        points = restart_points(args.restart_at, args.seeds, args.seed_gap)
    except ValueError as exc:
        p.error(str(exc))
    torch.set_num_threads(args.threads)
    shutil.rmtree(args.out / "stores", ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)

    encoder, (split, eval_split) = PromptEncoder(load_tokenizer(), args.seq_len), load_rotten_tomatoes()
    evaluate = eval_indices(args.eval_size, len(eval_split)) if args.eval_size else None
    hyper = FOHyper(lr=args.lr, max_grad_norm=args.max_grad_norm)
    trainer = FOTrainer(load_model(args.model), hyper, encoder)
    steps = step_records(trainer)  # shared by every checkpointer: one trainer feeds them all
    release_memory()
    calibration = calibrate_full_every(trainer, steps, split, args) if args.full_every == 0 and any(
        n.startswith("differential") for n in names) else None
    if calibration:
        args.full_every = calibration["full_every"]
        print(f"[fo_bench] differential full interval: {args.full_every} steps (cost model {calibration['model_full_every']}, "
              f"record budget {calibration['budget_full_every']}); measured {calibration}", flush=True)
    if args.full_every > args.restart_at and any(n.startswith("differential") for n in names):
        p.error(f"the differential full interval ({args.full_every} steps) exceeds --restart-at {args.restart_at}: "
                "the restart would find no full checkpoint; restart later")
    args.full_async_every = args.full_every if calibration else args.every
    ckpts = {n: make_checkpointer(n, args.out / "stores", steps, args) for n in names}
    layerwise = "layerwise" in names
    reference = SnapshotStore(Storage(str(args.out / "stores" / "reference")), keep_last=KEEP_ALL) \
        if layerwise and args.noise_floor else None
    total = points[-1] + args.post_restart
    full_check = args.restart_at - args.restart_at % args.full_async_every  # full-async's restore at the restart
    rows: list[dict] = []
    restart: dict = {}
    changes: list[dict] = []
    reference_sha: dict[int, str] = {}  # the failure-free state's sha256 at the steps restores are compared at
    evals: dict[int, float] = {}  # step -> the failure-free run's eval loss
    previous = weights_of(trainer.state_view()) if "layerwise" in names else None  # what the threshold is set against
    print(f"[fo_bench] {args.model}: {total} steps, batch {args.batch_size} x {args.seq_len} tokens, strategies {', '.join(names)}")
    for step in range(total):
        idx = batch_indices(0, step, args.batch_size, len(split))
        t0 = time.perf_counter()
        row = {"step": step, "loss": trainer.train_step(split, idx), "compute_seconds": time.perf_counter() - t0}
        for name, (_, ckpt) in ckpts.items():
            row[f"block_{name}"] = ckpt.after_step(step + 1, trainer.state_view)
            if name.startswith(OVERLAPPED) and ckpt.last_submitted_step == step + 1 and step + 1 not in reference_sha:
                reference_sha[step + 1] = state_sha256(trainer.state_view())
        if step + 1 == full_check and "full-async" in names and step + 1 not in reference_sha:
            reference_sha[step + 1] = state_sha256(trainer.state_view())
        if previous is not None and (step + 1) % args.every == 0:
            weights = weights_of(trainer.state_view())
            changes.append({"step": step + 1, **unit_changes(weights, previous)})
            previous = weights
        if layerwise and evaluate is not None and (step + 1 in points or step + 1 - args.post_restart in points):
            evals[step + 1] = eval_loss(trainer.model, encoder, eval_split, evaluate)
        if reference is not None and step + 1 in points:  # synchronous, outside the timed checkpointers
            reference.write(step + 1, {n: as_numpy(t) for n, t in trainer.state_view().items()})
        if step + 1 == args.restart_at:
            reference_sha[step + 1] = state_sha256(trainer.state_view())
            restart = restart_all(ckpts, encoder, hyper, args, trainer, reference_sha)
        rows.append(row)
        if (step + 1) % 10 == 0 or step + 1 == total:
            print(f"[fo_bench] step {step + 1:>4}/{total}  loss {row['loss']:.4f}  compute {row['compute_seconds']:.2f} s  "
                  + "  ".join(f"{n} {row[f'block_{n}'] * 1e3:.1f} ms" for n in names), flush=True)
    stats = {n: ckpt.close() for n, (_, ckpt) in ckpts.items()}
    full_bytes = sum(t.numel() * t.element_size() for t in trainer.state_view().values())
    stores = {n: store for n, (store, _) in ckpts.items()}
    del ckpts, trainer, previous  # the staging buffers and the failure-free trainer: the restarts below need the memory
    deviation = layerwise_deviation(args, points, stores["layerwise"], reference, encoder, hyper, split, eval_split,
                                    evaluate, rows, evals) if layerwise else None
    result = summarise(args, names, rows, stats, restart, changes, deviation, full_bytes, calibration)
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in rows[0] | rows[-1]}), args.out / "fo_bench_steps.parquet")
    (args.out / "fo_bench.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    return result


def restart_all(ckpts: dict, encoder: PromptEncoder, hyper: FOHyper, args: argparse.Namespace, reference: FOTrainer, reference_sha: dict[int, str]) -> dict:
    """Restore every strategy but layer-wise at the restart step; returns the findings per strategy.
    ``reference_sha``: step -> the failure-free state's sha256 (the restart step's, full-async's
    checkpoint's and each overlapped snapshot's); a restore is bitwise equal when its state hashes as
    the failure-free one at its step."""
    found = {}
    for name, (store, ckpt) in ckpts.items():
        if name == "layerwise":  # its restarts are measured after the run (layerwise_deviation), one trainer at a time
            continue
        ckpt.flush(1800)
        trainer = FOTrainer(load_model(args.model), hyper, encoder)
        t0 = time.perf_counter()
        step = restore(name, store, trainer)
        seconds = time.perf_counter() - t0
        found[name] = {"restored_step": step, "restore_seconds": seconds,
                       "bitwise_equal": state_sha256(trainer.state_view()) == reference_sha.get(step)}
        if name == "differential-topk":
            state, ref = weights_of(trainer.state_view()), weights_of(reference.state_view())
            found[name]["weights_relative_distance"] = relative_change(state, {n: ref[n] for n in state})
        del trainer
    return found


def layerwise_deviation(args: argparse.Namespace, points: list[int], store: SnapshotStore, reference: SnapshotStore | None, encoder: PromptEncoder,
                        hyper: FOHyper, split: Split, eval_split: Split, evaluate: np.ndarray | None, rows: list[dict],
                        evals: dict[int, float]) -> dict:
    """Restart from the newest layer-wise composite at each restart point, train ``--post-restart``
    steps on the failure-free run's batches and compare (see the module docstring); with a reference
    store, also the noise floor (the exact state at the point, trained on run seed ``NOISE_SEED``'s batches)."""
    trainer = FOTrainer(load_model(args.model), hyper, encoder)
    release_memory()
    seeds = []
    for point in points:
        steps = range(point, point + args.post_restart)
        loaded = store.load_latest(max_step=point)
        trainer.load_state(loaded.state)
        unit_steps = [u["step"] for u in loaded.info.manifest["units"].values()]
        losses = [trainer.train_step(split, batch_indices(0, s, args.batch_size, len(split))) for s in steps]
        ref = [rows[s]["loss"] for s in steps]
        seed = {"restart_at": point, "composite_step": loaded.info.step, "oldest_unit_step": min(unit_steps),
                "newest_unit_step": max(unit_steps), "units_older_than_composite": sum(u < loaded.info.step for u in unit_steps),
                "train_loss_deviation_pct": float(100 * abs(np.mean(losses) - np.mean(ref)) / np.mean(ref)) if ref else None}
        if evaluate is not None:
            seed.update(eval_at_restart=evals[point], eval_failure_free=evals[point + args.post_restart],
                        eval_restarted=eval_loss(trainer.model, encoder, eval_split, evaluate))
            if reference is not None:
                trainer.load_state(reference.load_latest(max_step=point).state)
                for s in steps:
                    trainer.train_step(split, batch_indices(NOISE_SEED, s, args.batch_size, len(split)))
                seed["eval_noise_floor"] = eval_loss(trainer.model, encoder, eval_split, evaluate)
        print(f"[fo_bench] layer-wise restart at {point}: {seed}", flush=True)
        seeds.append(seed)
    out: dict[str, Any] = {"seeds": seeds}
    if evaluate is not None:
        ff = [s["eval_failure_free"] for s in seeds]
        out["eval"] = deviation_stats(ff, [s["eval_restarted"] for s in seeds])
        out["eval_moved"] = deviation_stats([s["eval_at_restart"] for s in seeds], ff)  # how far N steps move it
        if reference is not None:
            out["noise_floor"] = deviation_stats(ff, [s["eval_noise_floor"] for s in seeds])
    return out


def summarise(args: argparse.Namespace, names: list[str], rows: list[dict], stats: dict, restart: dict, changes: list[dict],
              deviation: dict | None, full_bytes: int, calibration: dict | None) -> dict:
    """The run's figures (``fo_bench.json``); ``full_bytes``: bytes of one full checkpoint of the state,
    ``calibration``: ``calibrate_full_every``'s measurements (None when ``--full-every`` was given)."""
    steps = len(rows)
    compute = float(np.sum([r["compute_seconds"] for r in rows]))
    per100 = 100 / steps
    strategies = {}
    for name in names:
        blocks = np.array([r[f"block_{name}"] for r in rows])
        stalls = blocks[blocks > 0]
        strategies[name] = {"bytes_per_100_steps": stats[name]["bytes"] * per100, "blocked_seconds_per_100_steps": blocks.sum() * per100,
                            "overhead_pct": 100 * blocks.sum() / compute, "errors": stats[name].get("errors", []),
                            "max_stall_s": float(blocks.max()), "mean_stall_s": float(stalls.mean()) if stalls.size else 0.0,
                            "stall_steps": int(stalls.size), "checkpoints": stats[name]["checkpoints"], **restart.get(name, {}),
                            **stall_split(stats[name], float(blocks.sum()), per100)}
    for name in [n for n in names if n.startswith(OVERLAPPED)] if "full-async" in names else []:
        ours, full = strategies[name], strategies["full-async"]
        ours["max_stall_over_full_async"] = ours["max_stall_s"] / full["max_stall_s"]
        ours["mean_stall_over_full_async"] = ours["mean_stall_s"] / full["mean_stall_s"]
        ours["interruption_reduction_pct"] = 100 * (1 - ours["max_stall_over_full_async"])
        ours["largest_chunk_fraction"] = max(stats[name]["chunk_bytes"]) / sum(stats[name]["chunk_bytes"])
    if "layerwise" in names:
        lw = strategies["layerwise"]
        lw["reasons"] = stats["layerwise"]["reasons"]
        lw["units_written"] = stats["layerwise"]["units_written"]
        # what full checkpoints at the same interval write in this run (full-async measures it when attached)
        lw["full_bytes_same_interval_per_100_steps"] = full_bytes * (steps // args.every) * per100
        lw["bytes_ratio_full_over_layerwise"] = full_bytes * (steps // args.every) / max(1, stats["layerwise"]["bytes"])
        lw["steady_state_bytes_ratio_bound"] = args.staleness / args.every  # no unit over the threshold: each once per bound
        if "full-async" in names and args.full_async_every == args.every:
            lw["bytes_ratio_full_async_over_layerwise"] = stats["full-async"]["bytes"] / max(1, stats["layerwise"]["bytes"])
        lw["deviation"] = deviation
    for name in ("differential", "differential-topk"):
        if name in names:
            strategies[name].update({k: stats[name][k] for k in ("batches", "full_bytes", "diff_bytes", "last_full_step")})
            if calibration:  # what full-async alone would block at the same interval: one staging copy per full checkpoint
                strategies[name]["full_async_same_interval_overhead_pct"] = 100 * calibration["stall_s"] / (
                    args.full_every * compute / steps)
    units = [u for u in changes[0] if u != "step"] if changes else []
    return {"model": args.model, "steps": steps, "restart_at": args.restart_at, "every": args.every,
            "full_async_every": args.full_async_every, "post_restart": args.post_restart, "eval_size": args.eval_size,
            "threshold": args.threshold, "staleness_steps": args.staleness, "full_every": args.full_every,
            "full_every_calibration": calibration, "full_state_bytes": full_bytes,
            "batch_steps": args.batch_steps, "topk": args.topk, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "lr": args.lr, "compute_seconds_per_step": compute / steps, "strategies": strategies, "papers": PAPERS,
            "unit_change_per_interval": {u: {"median": float(np.median([c[u] for c in changes])),
                                             "max": float(np.max([c[u] for c in changes]))} for u in units}}


def stall_split(stats: dict, blocked_s: float, per100: float) -> dict:
    """Where a checkpointer's blocked time went (when it reports its staging copies): ``copy_seconds``
    (per staged check), the rest of the blocked time per 100 steps (waiting for room at the writer,
    handing the check over), and the checks postponed because the writer was behind."""
    if "copy_seconds" not in stats:
        return {}
    copies = stats["copy_seconds"]
    return {"copy_seconds": copies, "copy_seconds_per_100_steps": sum(copies) * per100,
            "other_blocked_seconds_per_100_steps": (blocked_s - sum(copies)) * per100,
            "postponed_checks": stats.get("postponed_checks", 0), "postponed_steps": stats.get("postponed_steps", 0)}


def print_table(result: dict) -> None:
    s = result["strategies"]
    print(f"\n{result['model']}: {result['steps']} steps, {result['compute_seconds_per_step']:.3f} s compute per step, "
          f"interval {result['every']} steps")
    print(f"{'strategy':<18} {'MB / 100 steps':>15} {'blocked s / 100':>16} {'overhead':>9}  restart")
    for name, r in s.items():
        restored = f"step {r.get('restored_step')}, bitwise {r.get('bitwise_equal')}" if "restored_step" in r else ""
        print(f"{name:<18} {r['bytes_per_100_steps'] / 1e6:>15.1f} {r['blocked_seconds_per_100_steps']:>16.3f} "
              f"{r['overhead_pct']:>8.2f}%  {restored}")
    for name in (n for n in s if "copy_seconds" in s[n]):
        r = s[name]
        print(f"{name} stall split: copies {r['copy_seconds_per_100_steps']:.3f} s / 100 steps "
              f"({', '.join(f'{c:.2f}' for c in r['copy_seconds'])} s per check), rest (waiting for the writer, hand-off) "
              f"{r['other_blocked_seconds_per_100_steps']:.3f} s / 100 steps; {r['postponed_checks']} checks postponed "
              f"({r['postponed_steps']} steps)")
    lw, papers = s.get("layerwise"), result["papers"]
    if lw:
        verdict = "meets" if lw["bytes_ratio_full_over_layerwise"] >= 5 else "BELOW the 5x target"
        print(f"layer-wise bytes: {lw['bytes_ratio_full_over_layerwise']:.1f}x fewer than full checkpoints at the same "
              f"interval in this run ({verdict}; steady state at most {lw['steady_state_bytes_ratio_bound']:.0f}x; "
              f"LayerCheck reports {papers['layerwise_bytes_ratio']}x)")
    deviation = (lw or {}).get("deviation") or {}
    for key, what in (("eval", "layer-wise restart"), ("noise_floor", "noise floor (exact restart, other batch order)"),
                      ("eval_moved", f"eval loss moved by the {result['post_restart']} failure-free steps")):
        if key in deviation:
            d = deviation[key]
            ci = "" if d["ci95_pct"] is None else (f" (95% CI {d['ci95_pct'][0]:.3f} .. {d['ci95_pct'][1]:.3f}"
                                                 f"{', its lower bound clamped at 0' if d['ci95_pct'][0] == 0 else ''})")
            paper = f" (LayerCheck: within {papers['layerwise_loss_deviation_pct']}%)" if key == "eval" else ""
            print(f"{what}: mean |eval-loss deviation| {d['mean_abs_pct']:.3f}%{ci} over {d['seeds']} restart points; "
                  f"per point {', '.join(f'{v:+.3f}' for v in d['per_seed_pct'])}%{paper}")
    for name in (n for n in s if "max_stall_over_full_async" in s[n]):
        r = s[name]
        print(f"{name} per-step stall: max {r['max_stall_s'] * 1e3:.1f} ms ({r['max_stall_over_full_async']:.2f}x full-async's "
              f"{s['full-async']['max_stall_s'] * 1e3:.1f} ms: {r['interruption_reduction_pct']:.1f}% less; GoCkpt reports "
              f"{papers['gockpt_interruption_reduction_pct']}% less), mean {r['mean_stall_s'] * 1e3:.1f} ms "
              f"({r['mean_stall_over_full_async']:.2f}x) over {r['stall_steps']} staging steps; largest chunk "
              f"{100 * r['largest_chunk_fraction']:.1f}% of the state")
    if result["full_every_calibration"]:
        c = result["full_every_calibration"]
        print(f"differential full interval {result['full_every']} steps: cost model {c['model_full_every']} (step {c['step_s']:.2f} s, "
              f"record replay {c['replay_step_s']:.2f} s, full stall {c['stall_s']:.2f} s + write {c['snapshot_s']:.2f} s, MTBF "
              f"{c['mtbf_s']:.0f} s), record budget {c['budget_full_every']} ({c['record_bytes'] / 1e6:.0f} MB per record)")
    for name in ("differential", "differential-topk"):
        if name in s:
            verdict = "within" if s[name]["overhead_pct"] <= 5 else "ABOVE"
            print(f"{name} blocked-time overhead {s[name]['overhead_pct']:.2f}% ({verdict} the 5% target; "
                  f"LowDiff reports < {papers['differential_overhead_pct']}%)")
            if "full_async_same_interval_overhead_pct" in s[name]:
                print(f"full-async at the same interval ({result['full_every']} steps; the calibration's staging copy per "
                      f"checkpoint): {s[name]['full_async_same_interval_overhead_pct']:.2f}%")
    if result["unit_change_per_interval"]:
        print("unit relative change per interval (median): " +
              ", ".join(f"{u} {v['median']:.2e}" for u, v in result["unit_change_per_interval"].items()))


if __name__ == "__main__":
    main()
