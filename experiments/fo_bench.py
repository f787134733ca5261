"""Benchmark: first-order checkpointing strategies, in process (no Ray), on the real snippets.

One failure-free AdamW trajectory of ``--restart-at + --post-restart`` steps runs with every selected
checkpointer attached (each with its own store under ``--out``; their background writers run
concurrently, which makes each one's figures pessimistic). Per strategy it measures the bytes
committed and the training-loop time blocked by ``after_step``, per 100 steps, against the step's
compute time. At step ``--restart-at`` it restarts:

* ``layerwise``: a second trainer loads the newest composite (``SnapshotStore.load_latest``) and
  trains the next ``--post-restart`` steps in lockstep with the failure-free run, on the same
  batches; the loss deviation is measured against the failure-free losses of the same steps.
* ``full-async`` and ``differential`` (exact): the restored state (snapshot; snapshot + replayed
  records) is compared bitwise with the failure-free state; equal means zero deviation afterwards.
* ``differential-topk``: restored like ``differential``; its state distance is reported.
* ``overlapped-M`` (GoCkpt, M chunks staged over M steps): its snapshots are of the last chunk's step;
  the failure-free state's sha256 is taken at each of them, and the restored state is compared bitwise.

Per-step stall: the maximum and the mean (over the steps that stalled) of each strategy's blocked
time, and for ``overlapped-M`` their ratios to ``full-async``'s one-shot staging copy. For
``full-async`` and ``layerwise`` the blocked time is split into the staging copies (``copy_seconds``)
and the rest (waiting for room at the background writer, handing the check over), with the checks
postponed because the writer was behind.

Printed beside the papers' figures (``docs/algorithms.md``): LayerCheck (arXiv 2026) 22.6x fewer
bytes and post-restart loss within 0.54%; LowDiff (SC'25) under 3.1% runtime overhead with
per-iteration differential checkpoints; GoCkpt (arXiv:2511.07035) -86.7% training interruption time. Results: ``fo_bench.json`` and ``fo_bench_steps.parquet``.

    python -m experiments.fo_bench --model tiny --restart-at 110 --post-restart 100
    python -m experiments.fo_bench --model smollm2-135m --batch-size 4 --restart-at 20 --strategies full-async,layerwise
    python -m experiments.fo_bench --model tiny --strategies full-async,overlapped-2,overlapped-4 --restart-at 50 --post-restart 0
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from policies.layerwise import LayerwiseConfig, relative_change
from storage.backend import Storage
from storage.diffs import DiffStore
from storage.snapshots import SnapshotStore
from storage.units import group_by_unit, parameter_of
from training.checkpointing import FullCheckpointer
from training.data import PromptEncoder, batch_indices, load_rotten_tomatoes
from training.differential import DiffCheckpointer
from training.fo import FOHyper, FOTrainer
from training.layerwise import LayerwiseCheckpointer
from training.overlapped import OverlappedCheckpointer
from training.model import load_model, load_tokenizer
from training.state import copy_state, state_sha256

STRATEGIES = ("full-async", "layerwise", "differential", "differential-topk", "overlapped-2", "overlapped-4")
PAPERS = {"layerwise_bytes_ratio": 22.6, "layerwise_loss_deviation_pct": 0.54, "differential_overhead_pct": 3.1,
          "gockpt_interruption_reduction_pct": 86.7}
OVERLAPPED = "overlapped-"
KEEP_ALL = 1_000_000


def make_checkpointer(name: str, root: pathlib.Path, trainer: FOTrainer, args):
    store = SnapshotStore(Storage(str(root / name)), keep_last=KEEP_ALL if name == "layerwise" else 2)
    if name == "full-async":
        return store, FullCheckpointer(store, args.every, asynchronous=True)
    if name.startswith(OVERLAPPED):
        return store, OverlappedCheckpointer(store, args.every, int(name[len(OVERLAPPED):]), trainer.hyper, trainer.applied_gradients)
    if name == "layerwise":
        policy = LayerwiseConfig(threshold=args.threshold, staleness_bound_steps=args.staleness, max_bytes_per_step=args.max_bytes)
        return store, LayerwiseCheckpointer(store, args.every, policy)
    topk = args.topk if name == "differential-topk" else 0.0
    return store, DiffCheckpointer(store, DiffStore(store.storage), trainer.applied_gradients, args.full_every, args.batch_steps, topk)


def unit_changes(state: dict, previous: dict) -> dict[str, float]:
    """Relative weight change per unit between two training states (what the threshold is set against)."""
    out = {}
    for unit, names in group_by_unit(state).items():
        weights = [n for n in names if parameter_of(n) is None]
        out[unit] = relative_change({n: state[n] for n in weights}, {n: previous[n] for n in weights})
    return out


def restore(name: str, store: SnapshotStore, trainer: FOTrainer) -> int:
    """Load the strategy's newest durable state into ``trainer``; returns its step."""
    loaded = store.load_latest()
    trainer.load_state(loaded.state)
    if not name.startswith("differential"):
        return loaded.info.step
    return DiffStore(store.storage).replay(loaded.info.step, trainer.replay_gradients).end_step


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"))
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma list of {', '.join(STRATEGIES)}")
    p.add_argument("--restart-at", type=int, default=110, help="step of the restart (a multiple of --every)")
    p.add_argument("--post-restart", type=int, default=100, help="steps compared after the restart")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--every", type=int, default=10, help="checkpoint interval of full-async and layerwise (steps)")
    p.add_argument("--threshold", type=float, default=1e-3, help="layer-wise relative-change threshold")
    p.add_argument("--staleness", type=int, default=50, help="layer-wise staleness bound (steps)")
    p.add_argument("--max-bytes", type=int, default=0, help="layer-wise bytes per check (0: no limit)")
    p.add_argument("--full-every", type=int, default=50, help="differential: steps between full checkpoints")
    p.add_argument("--batch-steps", type=int, default=5, help="differential: records per object")
    p.add_argument("--topk", type=float, default=0.01, help="differential-topk: fraction of elements kept")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the training loop")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/fo_bench"))
    args = p.parse_args(argv)
    names = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(names) - set(STRATEGIES))
    if unknown or args.restart_at % args.every:
        p.error(f"unknown strategies {unknown}" if unknown else "--restart-at must be a multiple of --every")
    torch.set_num_threads(args.threads)
    shutil.rmtree(args.out / "stores", ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)

    encoder, split = PromptEncoder(load_tokenizer(), args.seq_len), load_rotten_tomatoes()[0]
    hyper = FOHyper(lr=args.lr, max_grad_norm=args.max_grad_norm)
    trainer = FOTrainer(load_model(args.model), hyper, encoder)
    ckpts = {n: make_checkpointer(n, args.out / "stores", trainer, args) for n in names}
    total = args.restart_at + args.post_restart
    rows: list[dict] = []
    restarted: FOTrainer | None = None
    restart: dict = {}
    changes: list[dict] = []
    reference_sha: dict[int, str] = {}  # the failure-free state's sha256 at the steps restores are compared at
    previous = copy_state(trainer.state_view())
    print(f"[fo_bench] {args.model}: {total} steps, batch {args.batch_size} x {args.seq_len} tokens, strategies {', '.join(names)}")
    for step in range(total):
        idx = batch_indices(0, step, args.batch_size, len(split))
        t0 = time.perf_counter()
        row = {"step": step, "loss": trainer.train_step(split, idx), "compute_seconds": time.perf_counter() - t0}
        for name, (_, ckpt) in ckpts.items():
            row[f"block_{name}"] = ckpt.after_step(step + 1, trainer.state_view)
            if name.startswith(OVERLAPPED) and ckpt.last_submitted_step == step + 1 and step + 1 not in reference_sha:
                reference_sha[step + 1] = state_sha256(trainer.state_view())
        if restarted is not None:
            row["loss_restarted"] = restarted.train_step(split, idx)
        if (step + 1) % args.every == 0:
            state = copy_state(trainer.state_view())
            changes.append({"step": step + 1, **unit_changes(state, previous)})
            previous = state
        if step + 1 == args.restart_at:
            reference_sha[step + 1] = state_sha256(trainer.state_view())
            restart, restarted = restart_all(ckpts, encoder, hyper, args, trainer, reference_sha)
        rows.append(row)
        if (step + 1) % 10 == 0 or step + 1 == total:
            print(f"[fo_bench] step {step + 1:>4}/{total}  loss {row['loss']:.4f}  compute {row['compute_seconds']:.2f} s  "
                  + "  ".join(f"{n} {row[f'block_{n}'] * 1e3:.1f} ms" for n in names), flush=True)
    stats = {n: ckpt.close() for n, (_, ckpt) in ckpts.items()}
    result = summarise(args, names, rows, stats, restart, changes)
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in rows[0] | rows[-1]}), args.out / "fo_bench_steps.parquet")
    (args.out / "fo_bench.json").write_text(json.dumps(result, indent=2))
    print_table(result)
    return result


def restart_all(ckpts: dict, encoder, hyper: FOHyper, args, reference: FOTrainer,
                reference_sha: dict[int, str]) -> tuple[dict, FOTrainer | None]:
    """Restore every strategy at the restart step; returns the findings and the layer-wise trainer.
    ``reference_sha``: step -> the failure-free state's sha256 (the restart step's and each overlapped
    snapshot's); a restore is bitwise equal when its state hashes as the failure-free one at its step."""
    found, layerwise = {}, None
    for name, (store, ckpt) in ckpts.items():
        ckpt.flush(1800)
        trainer = FOTrainer(load_model(args.model), hyper, encoder)
        t0 = time.perf_counter()
        step = restore(name, store, trainer)
        seconds = time.perf_counter() - t0
        state = copy_state(trainer.state_view())
        found[name] = {"restored_step": step, "restore_seconds": seconds,
                       "bitwise_equal": state_sha256(state) == reference_sha.get(step)}
        if name == "layerwise":
            info = store.load_latest().info
            found[name]["unit_steps"] = {u: s["step"] for u, s in info.manifest["units"].items()}
            layerwise = trainer
        if name == "differential-topk":
            ref = copy_state(reference.state_view())
            weights = [n for n in state if parameter_of(n) is None]
            found[name]["weights_relative_distance"] = relative_change({n: state[n] for n in weights}, {n: ref[n] for n in weights})
    return found, layerwise


def summarise(args, names: list[str], rows: list[dict], stats: dict, restart: dict, changes: list[dict]) -> dict:
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
        post = [r for r in rows if "loss_restarted" in r]
        ref, got = np.array([r["loss"] for r in post]), np.array([r["loss_restarted"] for r in post])
        lw = strategies["layerwise"]
        lw["post_restart_steps"] = len(post)
        lw["loss_deviation_mean_pct"] = float(100 * abs(got.mean() - ref.mean()) / ref.mean())
        lw["loss_deviation_per_step_pct"] = float(100 * np.mean(np.abs(got - ref) / ref))
        lw["reasons"] = stats["layerwise"]["reasons"]
        lw["units_written"] = stats["layerwise"]["units_written"]
        if "full-async" in names:
            lw["bytes_ratio_full_over_layerwise"] = stats["full-async"]["bytes"] / max(1, stats["layerwise"]["bytes"])
    units = [u for u in changes[0] if u != "step"] if changes else []
    return {"model": args.model, "steps": steps, "restart_at": args.restart_at, "every": args.every,
            "threshold": args.threshold, "staleness_steps": args.staleness, "full_every": args.full_every,
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
    if lw and "bytes_ratio_full_over_layerwise" in lw:
        verdict = "meets" if lw["bytes_ratio_full_over_layerwise"] >= 5 else "BELOW the 5x target"
        print(f"layer-wise bytes: {lw['bytes_ratio_full_over_layerwise']:.1f}x fewer than full at the same interval "
              f"({verdict}; LayerCheck reports {papers['layerwise_bytes_ratio']}x)")
    if lw and "loss_deviation_mean_pct" in lw:
        dev = lw["loss_deviation_mean_pct"]
        verdict = "within" if dev <= papers["layerwise_loss_deviation_pct"] else "ABOVE"
        print(f"layer-wise post-restart loss deviation over {lw['post_restart_steps']} steps: mean loss {dev:.3f}% "
              f"({verdict} LayerCheck's {papers['layerwise_loss_deviation_pct']}%), per step {lw['loss_deviation_per_step_pct']:.3f}%")
    for name in (n for n in s if "max_stall_over_full_async" in s[n]):
        r = s[name]
        print(f"{name} per-step stall: max {r['max_stall_s'] * 1e3:.1f} ms ({r['max_stall_over_full_async']:.2f}x full-async's "
              f"{s['full-async']['max_stall_s'] * 1e3:.1f} ms: {r['interruption_reduction_pct']:.1f}% less; GoCkpt reports "
              f"{papers['gockpt_interruption_reduction_pct']}% less), mean {r['mean_stall_s'] * 1e3:.1f} ms "
              f"({r['mean_stall_over_full_async']:.2f}x) over {r['stall_steps']} staging steps; largest chunk "
              f"{100 * r['largest_chunk_fraction']:.1f}% of the state")
    for name in ("differential", "differential-topk"):
        if name in s:
            verdict = "within" if s[name]["overhead_pct"] <= 5 else "ABOVE"
            print(f"{name} blocked-time overhead {s[name]['overhead_pct']:.2f}% ({verdict} the 5% target; "
                  f"LowDiff reports < {papers['differential_overhead_pct']}%)")
    print("unit relative change per interval (median): " +
          ", ".join(f"{u} {v['median']:.2e}" for u, v in result["unit_change_per_interval"].items()))


if __name__ == "__main__":
    main()
