"""Benchmark: the step log's append cost against the step time and a blocking full-state save.

Measures, in one process and one run: the median and p99 of a durable 84-byte step-record append
(write + fsync), the median time of a MeZO step of the model (two forward passes and the four
perturbation passes), and the median blocking time of ``torch.save`` + fsync of the full parameter
state (the synchronous full checkpoint the step log replaces). Prints ratios.

    python -m raycheck.experiments.log_cost [--model smollm2-135m] [--appends 500] [--steps 3] [--saves 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from raycheck.storage.steplog import StepLogWriter, StepRecord
from raycheck.training.data import PromptEncoder, batch_indices, classification_loss, load_rotten_tomatoes
from raycheck.training.model import load_model, load_tokenizer, trainable_parameters
from raycheck.training.zo import perturb_all_, step_seed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--appends", type=int, default=500)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--dir", default=None, help="Folder for the log and the saves (default: a temp folder).")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    model = load_model(args.model)
    params = trainable_parameters(model)
    encoder = PromptEncoder(load_tokenizer(), args.seq_len)
    train, _ = load_rotten_tomatoes()
    state_bytes = sum(p.numel() * p.element_size() for p in params.values())

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        writer = StepLogWriter.create(os.path.join(tmp, "steplog.bin"), {"bench": True})
        appends = []
        for i in range(args.appends):
            rec = StepRecord(step=i, seed=i, projected_grad=0.1, loss_plus=0.7, loss_minus=0.6, lr=1e-6, eps=1e-3,
                             weight_decay=0.0, batch_id=i)
            t0 = time.perf_counter()
            writer.append(rec)
            appends.append(time.perf_counter() - t0)
        writer.close()

        steps = []
        for step in range(args.steps):
            t0 = time.perf_counter()
            seed = step_seed(0, step)
            idx = batch_indices(0, step, args.batch_size, len(train))
            perturb_all_(params, seed, 1e-3)
            classification_loss(model, encoder, train, idx)
            perturb_all_(params, seed, -2e-3)
            classification_loss(model, encoder, train, idx)
            perturb_all_(params, seed, 1e-3)
            steps.append(time.perf_counter() - t0)

        saves = []
        for i in range(args.saves):
            path = os.path.join(tmp, f"full-{i}.pt")
            t0 = time.perf_counter()
            with open(path, "wb") as fh:
                torch.save(dict(params), fh)
                fh.flush()
                os.fsync(fh.fileno())
            saves.append(time.perf_counter() - t0)
            os.unlink(path)

    append_s, step_s, save_s = statistics.median(appends), statistics.median(steps), statistics.median(saves)
    result = {
        "model": args.model,
        "state_bytes": state_bytes,
        "append_median_s": append_s,
        "append_p99_s": percentile(appends, 0.99),
        "step_median_s": step_s,
        "torch_save_median_s": save_s,
        "append_over_step": append_s / step_s,
        "append_over_torch_save": append_s / save_s,
    }
    print(f"model {args.model}: state {state_bytes / 1e6:.0f} MB, {args.appends} appends, {args.steps} steps, {args.saves} saves")
    print(f"  step log append (write+fsync, 84 B): median {append_s * 1e6:8.0f} us   p99 {result['append_p99_s'] * 1e6:8.0f} us")
    print(f"  MeZO step (2 forwards + perturbations): median {step_s:8.3f} s")
    print(f"  blocking torch.save + fsync of the full state: median {save_s:8.3f} s")
    print(f"  append / step time        = {result['append_over_step']:.2e}  ({100 * result['append_over_step']:.4f} % of a step)")
    print(f"  append / full torch.save  = {result['append_over_torch_save']:.2e}  (a full save costs {save_s / append_s:,.0f} appends)")
    return result


if __name__ == "__main__":
    main()
