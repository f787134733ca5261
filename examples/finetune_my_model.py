"""Fine-tune your own model on your own data with raycheck's Python API, e.g. under ``ray job submit``.

    python examples/finetune_my_model.py --model /models/my-gpt2 --data reviews.jsonl --out /tmp/my-run

``--model``: a Hugging Face model folder (config.json + *.safetensors) or a model id in the local
Hugging Face cache; ``--data``: a JSONL file with ``text`` and ``label`` (negative/positive) columns.
A worker is killed at step ``--fail-step`` and recovered; ``--verify`` also runs the failure-free
reference and compares the final states bitwise. Prints the summary; exits 0 only when recovery was exact.
"""

from __future__ import annotations

import argparse
import json
import sys

from raycheck.job.config import DataConfig, FailureSpec, FaultConfig, SnapshotConfig, ZOConfig
from raycheck.orchestrator.api import job_config, run_job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the dtype the workers hold and perturb the weights in (half precision halves the memory)")
    parser.add_argument("--cache-dir", default=None, help="model cache (default: $RAYCHECK_CACHE or ~/.cache/raycheck)")
    args = parser.parse_args(argv)

    fields = dict(model=args.model, data=DataConfig(path=args.data, task="classification", text_column="text", label_column="label",
                                                    label_words="negative,positive"), steps=args.steps, batch_size=4, seq_len=32, eval_samples=8, dtype=args.dtype,
                  zo=ZOConfig(lr=1e-4), snapshot=SnapshotConfig(every_steps=2),
                  faults=FaultConfig(failures=(FailureSpec(step=args.fail_step, target="worker"),)))
    if args.cache_dir:
        fields["cache_dir"] = args.cache_dir
    cfg = job_config(args.out, **fields)
    summary = run_job(cfg, verify=args.verify)
    keys = ("ok", "dtype", "final_step", "state_sha256", "bitwise_equal", "shadow_equal", "lost_steps", "eval_metric",
            "accuracy_before", "accuracy_after", "recoveries")
    print(json.dumps({k: summary.get(k) for k in keys}, indent=2))
    exact = summary["ok"] and not summary["lost_steps"] and summary.get("bitwise_equal") is not False
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
