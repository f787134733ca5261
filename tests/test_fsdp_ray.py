"""FSDP2 first-order training under Ray Train (tiny model, real snippets): a 2-worker run with layer-wise
sharded checkpoints (composites) survives a worker failure, then the run resumes at 1 worker from the
2-rank checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from raycheck.job.config import FailureSpec, JobConfig
from raycheck.cli.main import resume_config
from raycheck.orchestrator.controller import Controller
from test_fo_ray import cluster  # noqa: F401 (the fixture: a local Ray cluster for this module)
from raycheck.storage.merge import export_hf
from raycheck.storage.pointers import committed_snapshot
from raycheck.training.model import default_cache_dir, model_folder

pytestmark = [pytest.mark.ray, pytest.mark.raytrain]


def test_two_fsdp2_workers_recover_from_sharded_checkpoints_and_the_run_resumes_at_one_worker(cluster, tmp_path):
    """Layer-wise at threshold 0 (every changed unit rewritten at each check: exact). Rank 1 dies during
    step 5: both ranks restore the 2-rank checkpoint of step 3 (resharded to the same 2 ranks) and finish,
    ``close`` committing the final state, a composite (the unchanged parameter groups read from an older
    checkpoint). Then ``--resume --workers 1`` of the same run restores that newest 2-rank checkpoint (step
    8) at 1 rank, bitwise the state the 2-worker run hashed after 8 steps."""
    cfg = JobConfig(out_dir=str(tmp_path), cache_dir=str(default_cache_dir()), model="tiny", algo="fo", strategy="layerwise", steps=8, batch_size=8, seq_len=32,
                    eval_samples=16, hash_every_steps=1, workers=2, run_id="fsdp2-ray", layerwise={"threshold": 0.0},
                    fo={"parallelism": "fsdp2", "lr": 1e-3},
                    snapshot={"every_steps": 3},
                    faults={"settle_failures": True, "failures": (FailureSpec.parse("5:worker"),)})
    first = Controller(cfg, echo=lambda _: None).run()
    assert first["ok"], first["error"]
    [recovery] = first["recoveries"]
    assert (recovery["source"], recovery["failure_step"], recovery["base_step"], recovery["saved_world_size"]) == ("storage", 5, 3, 2)
    hashes = first["worker_hashes"]  # after every step, re-gathered: {"1": sha256, ...}
    assert recovery["restored_state_sha256"] == hashes["3"]

    resumed_cfg, notes = resume_config(cfg, {"workers": 1})
    assert resumed_cfg.workers == 1 and notes == ["--resume: workers 2 -> 1"]
    resumed = Controller(resumed_cfg, echo=lambda _: None).run()
    assert resumed["ok"], resumed["error"]
    restart = resumed["recoveries"][-1]
    assert (restart["source"], restart["base_step"], restart["saved_world_size"]) == ("storage", 8, 2)
    assert restart["restored_state_sha256"] == hashes["8"]  # weights + Adam moments saved by 2 ranks, loaded by 1
    assert resumed["final_step"] == 8
    # Result.checkpoint (a pointer to the sharded checkpoint of step 8) exports to a folder transformers loads: the weights
    # gathered from the 2 ranks' rows, bitwise
    assert resumed["ray_train_checkpoint"]["step"] == 8 and resumed["final_snapshot"] == resumed["ray_train_checkpoint"]["snapshot"]
    folder = export_hf(resumed["ray_train_checkpoint"]["path"], tmp_path / "hf", "tiny", model_folder("tiny"))
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    store, info = committed_snapshot(resumed["ray_train_checkpoint"]["path"])
    assert {s["folder"] for s in info.manifest["layers"].values()} != {info.folder}  # a composite: it reads older folders
    state = store.load(info)
    weights = {n: a for n, a in state.items() if not n.startswith(("optim.", "param_groups."))}
    assert sorted(weights) == sorted(n for n in loaded if n != "lm_head.weight")  # tied to the embeddings
    assert all(np.array_equal(loaded[n].numpy(), a) for n, a in weights.items())
