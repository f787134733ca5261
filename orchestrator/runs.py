"""A run with its failure-free reference: ``run_job`` runs a configuration (``orchestrator.controller``) and,
to verify it, runs (or reuses) the reference of the same trajectory and compares the final states bitwise."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Callable

from raycheck.job.config import JobConfig
from raycheck.job.run_dir import RunDir
from raycheck.orchestrator.controller import Controller
from raycheck.training.assets import Assets, read_assets


def run_job(cfg: JobConfig, verify: bool = False, echo: Callable[[str], None] = print, assets: Assets | None = None) -> dict:
    """Run ``cfg``; with ``verify``, also run (or reuse) the failure-free reference in
    ``<out_dir>/reference`` and compare the final states bitwise. ``assets``: what
    ``training.assets.read_assets`` returned for ``cfg`` (read here when None)."""
    if assets is None:
        cfg, assets = read_assets(cfg)
    summary = Controller(cfg, echo, assets=assets).run()
    return compare_with_reference(cfg, summary, echo, assets) if verify and summary["ok"] else summary


def compare_with_reference(cfg: JobConfig, summary: dict, echo: Callable[[str], None] = print,
                           assets: Assets | None = None) -> dict:
    """``summary`` (of ``cfg``'s run, finished: ``ok``, ``state_sha256``) with ``reference_state_sha256``
    and ``bitwise_equal`` (the two final-state sha256s compared) from the failure-free reference, run
    or reused (``reference``); also written to ``<out_dir>/summary.json``. What ``run_job`` does after
    the run with ``verify``, and what ``raycheck run --resume --verify`` does for a run that finished."""
    if assets is None:
        cfg, assets = read_assets(cfg)
    ref = reference(cfg, echo, assets)
    summary = {**summary, "reference_state_sha256": ref["state_sha256"],
               "bitwise_equal": ref["state_sha256"] == summary["state_sha256"]}
    RunDir.write_json(pathlib.Path(cfg.out_dir) / "summary.json", summary)
    return summary


def reference(cfg: JobConfig, echo: Callable[[str], None] = print, assets: Assets | None = None) -> dict:
    """The failure-free run with the same trajectory settings (reused when already complete)."""
    out = pathlib.Path(cfg.out_dir) / "reference"
    previous = out / "summary.json"
    if previous.exists():
        ref = json.loads(previous.read_text())
        if ref.get("ok") and ref.get("trajectory_sha256") == cfg.trajectory_sha256():
            echo(f"[raycheck] reusing the failure-free reference in {out}")
            return ref
    shutil.rmtree(out, ignore_errors=True)
    echo(f"[raycheck] running the failure-free reference in {out}")
    return Controller(reference_config(cfg), echo, assets=assets).run()


def reference_config(cfg: JobConfig) -> JobConfig:
    """The configuration of ``cfg``'s failure-free reference (pure): the same trajectory in
    ``<out_dir>/reference``, with local storage (so durability ``cluster`` becomes ``node``), no
    failures, no evaluation, its own run id and its own rank-0 scratch directory."""
    return cfg.replace(
        out_dir=str(pathlib.Path(cfg.out_dir) / "reference"), eval_samples=0, run_id=f"{cfg.run_id}-ref",
        durability="node" if cfg.durability == "cluster" else cfg.durability,
        scratch_dir=str(pathlib.Path(cfg.scratch_dir) / "reference"), storage={"uri": ""}, faults={"failures": ()},
    )
