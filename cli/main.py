"""The ``raycheck`` command line."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import re
import shlex
import shutil
import sys
import uuid
from collections.abc import Iterator
from inspect import signature
from typing import Annotated

import typer
from typer._click.core import Context
from typer._click.formatting import HelpFormatter
from typer._click.exceptions import NoArgsIsHelpError, UsageError  # typer 0.29 vendors click: its own classes
from typer.core import TyperCommand, TyperGroup

from raycheck.job.config import (PROMPT, DifferentialConfig, ElasticConfig, FailureSpec, FaultConfig, FOConfig, JobConfig, LayerwiseConfig,
                                 OldConfigError, OverlappedConfig, SnapshotConfig, StorageConfig, ZOConfig)
from raycheck.job.run_dir import RunDir
from raycheck.orchestrator.console import RunConsole, summary_table
from raycheck.cli.experiment import experiment
from raycheck.cli.merge import merge
from raycheck.cli.policy import parse_duration, policy
from raycheck.cli.replay import replay
from raycheck.orchestrator.schedule import parse_schedule
from raycheck.orchestrator.signals import EXIT_TERMINATED, Terminated, terminate_as_interrupt
from raycheck.orchestrator.driver_lock import LOCK_NAME, RunDirectoryError, driver_lock
from raycheck.cli.storage import inspect, verify
from raycheck.orchestrator.stored_config import StoredConfigError, load_config
from raycheck.policies.costs import InfeasibleError
from raycheck.storage.backend import local_path
from raycheck.storage.steplog import StepLogError, read_log
from raycheck.training.model import MODEL_NAMES, default_cache_dir


class _Commands(TyperGroup):
    """The ``raycheck`` group: a usage error that click finds (an option's value out of its range or of
    the wrong type, an unknown option or command, a ``typer.BadParameter`` a command raises) is printed as
    one ``error: ...`` line with exit 2, as the commands' own refusals are (``_refuse``), not as click's
    usage block. ``--help`` and a bare ``raycheck`` still print the help."""

    def make_context(self, *args, **kwargs) -> Context:
        with _one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Context):
        with _one_line_usage_errors():
            return super().invoke(ctx)


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    """Turn a click ``UsageError`` (but not the help that no arguments ask for) into ``_refuse``'s line and exit 2."""
    try:
        yield
    except NoArgsIsHelpError:
        raise
    except UsageError as exc:
        raise _refuse(exc.format_message()) from exc


RUN_SECTIONS: dict[str, tuple[str, ...]] = {
    "Run": ("model", "data", "steps", "fail", "verify", "out", "resume", "overwrite", "algo", "strategy", "workers", "device",
            "dtype", "json_output", "help"),
    "Data and task": ("task", "text_column", "label_column", "label_words", "prompt_template", "prompt_column",
                      "completion_column", "batch_size", "seq_len", "seed", "eval_samples"),
    "Zeroth-order (MeZO)": ("lr", "eps", "weight_decay", "torch_threads", "hash_every"),
    "First-order": ("fo_lr", "fo_max_grad_norm", "fo_parallelism", "micro_batch_size", "layer_threshold", "layer_staleness_steps",
                    "layer_max_bytes_per_check", "diff_full_every", "diff_batch_steps", "diff_topk", "overlap_chunks"),
    "Failures and restarts": ("fail_schedule", "fail_seed", "settle_failures", "max_shadow_restarts", "max_persister_restarts",
                              "max_worker_failures", "max_in_process_restarts", "warm_standby", "min_workers",
                              "elastic_resize_interval"),
    "Snapshots, step log and storage": ("snapshot_every", "snapshot_policy", "mtbf", "keep_snapshots", "durability", "storage", "s3_endpoint",
                                        "storage_consistency", "persister_priority", "persister_direct_io", "scratch_dir",
                                        "cache_dir"),
    "Shadow and placement": ("shadow_shards", "shadow_threads", "shadow_env", "worker_resource", "shadow_resource", "start_timeout"),
}
"""``raycheck run --help``'s sections, in order, and the options of each (by parameter name): what most runs set first."""


class _Sectioned(TyperCommand):
    """A command whose ``--help`` lists its options under ``RUN_SECTIONS``' headings instead of one list."""

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx)}
        for title, names in RUN_SECTIONS.items():
            rows = [row for name in names if (row := records.get(name)) is not None]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


app = typer.Typer(
    cls=_Commands,
    help="raycheck: fault-tolerant fine-tuning on Ray: MeZO with a durable step log, a CPU shadow and exact recovery; "
         "AdamW with layer-wise and differential checkpoints; failure-injection experiments.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # click's plain layout wraps at 80 columns; rich's option table truncates names there
    context_settings={"max_content_width": 120},
)


@app.callback()
def _main(ctx: typer.Context, verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Show every step and every event's detail, and log debug detail.")] = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,  # the module's name only with --verbose
                        format="%(levelname)s %(name)s: %(message)s" if verbose else "%(levelname)s: %(message)s")
    ctx.obj = {"verbose": verbose}


def _storage_uri(uri: str) -> str:
    """A local path made absolute; URIs as given."""
    folder = local_path(uri) if uri else None
    return uri if folder is None else str(folder)


def _refuse(message: str) -> typer.Exit:
    """Print ``error: message`` (one line) to stderr; returns the exit (code 2) to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


OPTION_OF_FIELD = {
    "out_dir": "out", "hash_every_steps": "hash_every",
    "fo.lr": "fo_lr", "fo.max_grad_norm": "fo_max_grad_norm", "fo.parallelism": "fo_parallelism",
    "layerwise.threshold": "layer_threshold", "layerwise.staleness_bound_steps": "layer_staleness_steps",
    "layerwise.max_bytes_per_check": "layer_max_bytes_per_check",
    "differential.full_every_steps": "diff_full_every", "differential.batch_steps": "diff_batch_steps",
    "differential.topk": "diff_topk", "overlapped.chunks": "overlap_chunks",
    "snapshot.every_steps": "snapshot_every", "snapshot.policy": "snapshot_policy", "snapshot.mtbf_s": "mtbf",
    "snapshot.keep": "keep_snapshots", "storage.uri": "storage", "storage.options": "s3_endpoint",
    "storage.consistency": "storage_consistency",
    "faults.failures": "fail", "faults.start_timeout_s": "start_timeout", "elastic.resize_interval_s": "elastic_resize_interval",
}
"""``JobConfig`` field paths whose ``raycheck run`` option has another name (the names users' scripts
use); any other field's option is its last name (``zo.lr``: ``--lr``)."""
RESUME_BUDGETS = ("faults.max_shadow_restarts", "faults.max_persister_restarts", "faults.max_worker_failures",
                  "faults.max_in_process_restarts", "worker_resource", "shadow_resource", "faults.start_timeout_s")
"""Fields (paths) that ``--resume`` takes from the command line over the run's ``config.json``: restart
budgets and placement, not part of the trajectory (a run that spent one resumes with a larger one; a
run resumed on another cluster is placed there)."""


def parameter(path: str) -> str:
    """The ``raycheck run`` parameter that fills the ``JobConfig`` field ``path``: its entry in
    ``OPTION_OF_FIELD``, else the path's last name."""
    return OPTION_OF_FIELD.get(path, path.split(".")[-1])


RESUME_OPTIONS = ("out", "resume", "verify", "json_output", *(parameter(path) for path in RESUME_BUDGETS))
"""``raycheck run`` options that apply to a ``--resume``; any other one given is ignored, with a warning."""


def option(name: str) -> str:
    """The ``raycheck run`` option of the parameter or ``JobConfig`` field path ``name``, e.g. ``--shadow-env``."""
    return "--" + parameter(name).replace("_", "-")


def option_names(message: str) -> str:
    """``message`` (a ``JobConfig`` refusal) with the fields that are ``raycheck run`` options named as
    the options: a field path (``zo.lr must be ...``), a leading field (``steps must be ...``) and any
    snake_case one, and ``strategy NAME``."""
    paths = set(JobConfig.field_paths())
    fields = set(signature(run).parameters) | paths
    message = re.sub(r"\b[a-z]+\.[a-z][a-z0-9_]*\b", lambda m: option(m[0]) if m[0] in paths else m[0], message)
    message = re.sub(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", lambda m: option(m[0]) if m[0] in fields else m[0], message)
    message = re.sub(r"^[a-z]+\b", lambda m: option(m[0]) if m[0] in fields else m[0], message)
    return re.sub(r"(?<![-\w])strategy (?=[a-z-]+ )", "--strategy ", message)


def resume_config(saved: JobConfig, given: dict[str, object]) -> tuple[JobConfig, list[str]]:
    """The configuration a ``--resume`` runs with, and the lines to print about it.

    Args:
        saved: the run's configuration (its ``config.json``).
        given: the ``raycheck run`` options given on the command line, by parameter name.

    Returns:
        ``saved`` with the ``RESUME_BUDGETS`` given (a notice for each one that changes) and, for a
        ``fo.parallelism`` fsdp2 run, ``workers`` (its state reshards), and a warning line naming every
        given option that ``--resume`` ignores (none when there is none).

    Raises:
        typer.Exit: (code 2, the reason printed) ``--dtype`` is given and differs from the run's;
            ``--workers`` differs from the run's and its state does not reshard; the new worker count
            does not divide the batch.
    """
    budgets = {path: given[parameter(path)] for path in RESUME_BUDGETS if parameter(path) in given}
    if "workers" in given and given["workers"] != saved.workers:
        if saved.fo.parallelism != "fsdp2":
            raise _refuse(f"--resume --workers {given['workers']}: the run has {saved.workers} worker(s) and its state does not "
                          "reshard (only an --algo fo --fo-parallelism fsdp2 run changes its worker count); leave --workers out")
        budgets["workers"] = given["workers"]
    notes = [f"--resume: {parameter(path)} {saved.get(path)} -> {value}" for path, value in budgets.items() if saved.get(path) != value]
    if "dtype" in given and given["dtype"] != saved.dtype:
        raise _refuse(f"--resume --dtype {given['dtype']}: the run holds its parameters in {saved.dtype} (its step log "
                      f"and snapshots are {saved.dtype}); resume it with --dtype {saved.dtype} or leave --dtype out")
    notes += ignored_warning(given)
    try:
        return (saved.replace(**budgets) if budgets else saved), notes
    except ValueError as exc:  # e.g. a batch the new worker count does not divide
        raise _refuse(f"--resume: {option_names(str(exc))}") from exc


def ignored_warning(given: dict[str, object]) -> list[str]:
    """The warning line naming the options in ``given`` (by parameter name) that ``--resume`` ignores:
    all but ``RESUME_OPTIONS`` and ``--workers`` (which ``resume_config`` takes or refuses); none when
    there is none."""
    ignored = [option(name) for name in given if name not in (*RESUME_OPTIONS, "workers")]
    return [f"warning: --resume continues the run with the settings in its config.json; ignored: {', '.join(ignored)}"] if ignored else []


def _given_options(ctx: typer.Context) -> dict[str, object]:
    """The options typed on the command line (not defaults or environment), by parameter name. The
    source is compared by name: typer may vendor its own click, whose ``ParameterSource`` is another enum."""
    return {name: value for name, value in ctx.params.items() if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}


def _resumed_config(out: pathlib.Path, verify: bool) -> JobConfig:
    """The configuration of the run in ``out``, to resume it (exit 2 when there is none, or when ``out``
    is a copy or a move of the run directory its ``config.json`` names; it may have finished:
    ``_finished_summary``)."""
    saved = out / "config.json"
    if not saved.is_file():
        raise _refuse(f"{out} holds no run to resume (no config.json); to resume from the run's storage alone, "
                      "add --storage URI (and --s3-endpoint)")
    try:
        loaded = json.loads(saved.read_text())
        if isinstance(loaded, dict) and not {"run_id", "out_dir", "algo", "strategy", "steps"} & loaded.keys():  # e.g. a model's
            raise _refuse(f"{saved} is not a raycheck run's configuration (another tool's config.json?): {out} holds no "
                          "run to resume")
        cfg = JobConfig.from_dict(loaded)
    except OldConfigError as exc:
        raise _refuse(f"{saved}: {exc}") from exc
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # JSONDecodeError is a ValueError
        raise _refuse(f"{saved} is damaged ({type(exc).__name__}: {exc}); this run cannot be resumed") from exc
    if pathlib.Path(cfg.out_dir).resolve() != out.resolve():
        if not pathlib.Path(cfg.out_dir).exists():
            raise _moved(out, cfg, verify)
        raise _refuse(f"{out} is a copy of the run directory {cfg.out_dir} (its config.json names that one, and its "
                      f"storage {cfg.storage.uri}): resume the run with --out {cfg.out_dir}")
    return cfg


PATH_FIELDS = ("out_dir", "storage.uri", "data", "model", "cache_dir")
"""The ``JobConfig`` fields that may name a place on this machine (a path, a ``file://`` URI; a model
or storage name that is neither never lies inside a run directory)."""


def _moved(out: pathlib.Path, cfg: JobConfig, verify: bool) -> typer.Exit:
    """The refusal (exit 2) of ``--resume --out out`` where ``out`` is the run directory ``cfg.out_dir``
    moved (that path no longer exists): what of ``cfg`` still points into the old path, and the command
    that moves the run back and resumes it there."""
    old = pathlib.Path(cfg.out_dir)
    inside = [f"{option(path)} {value}" for path in PATH_FIELDS
              if (value := str(cfg.get(path))) and (where := local_path(value)) is not None and where.is_relative_to(old)]
    move = shlex.join(["mv", str(out.resolve()), str(old)])
    if not old.parent.exists():
        move = f"{shlex.join(['mkdir', '-p', str(old.parent)])} && {move}"
    return _refuse(f"{out} is the run directory {old}, moved: {old} no longer exists, and the run's config.json still "
                   f"points there ({', '.join(inside)}); move it back and resume it: {move} && {resume_command(old, verify)}")


def _finished_summary(out: pathlib.Path, cfg: JobConfig) -> dict | None:
    """The ``summary.json`` of the run in ``out`` when that run finished (``ok``, all ``cfg.steps``
    steps), else None."""
    summary = RunDir.read_json(out / "summary.json")
    return summary if summary and summary.get("ok") and summary.get("final_step") == cfg.steps else None


FROM_STORAGE_OPTIONS = ("storage", "s3_endpoint", "cache_dir", "scratch_dir")
"""Options that a ``--resume`` from the storage alone takes from the command line: how this machine
reaches the storage and where it keeps its files (the run's other settings come from the storage)."""


def _stored_config(given: JobConfig, out: pathlib.Path, scratch_dir: str) -> JobConfig:
    """The configuration of the run whose storage is ``given.storage.uri`` (the ``--storage`` given, with
    ``--s3-endpoint``), to resume it in the new directory ``out``, empty or holding only a ``reference/``
    (exit 2 when it cannot be)."""
    if not given.storage.remote:
        raise _refuse(f"--storage {given.storage.uri} is local: only remote storage (s3://) holds the run's step log and "
                      "configuration; resume with --out of the run's directory")
    if out.exists() and any(p.name not in ("reference", LOCK_NAME) for p in out.iterdir()):  # a reference put there for --verify is kept
        raise _refuse(f"{out} is not empty and holds no run (no config.json): resume from the storage into an empty or new --out")
    try:
        return load_config(given.storage.uri, given.storage.options, out.resolve(), pathlib.Path(given.cache_dir), scratch_dir)
    except StoredConfigError as exc:
        raise _refuse(str(exc)) from exc
    except OSError as exc:  # StorageError, or a local path that is a file
        raise _refuse(f"snapshot storage {given.storage.uri} is not usable: {exc}") from exc


def parse_env(pairs: list[str], option: str) -> dict[str, str]:
    """``KEY=VALUE`` strings as a dict. Raises ``ValueError`` naming ``option`` for one without ``=``."""
    bad = [p for p in pairs if "=" not in p]
    if bad:
        raise ValueError(f"{option} {bad[0]!r}: expected KEY=VALUE, e.g. ATEN_CPU_CAPABILITY=default")
    return dict(p.split("=", 1) for p in pairs)


def _require_cuda() -> None:
    """Refuse ``--device cuda`` (exit 2) on a machine where torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise _refuse(f"--device cuda: torch.cuda.is_available() is false on this machine (torch {torch.__version__}, "
                      f"built for CUDA {torch.version.cuda or 'none: a CPU-only build'}); run on a node with a GPU and a "
                      "CUDA build of torch, or use --device cpu")


def _model_arg(model: str) -> str:
    """``--model`` as the configuration keeps it: a built-in name or model id as given, a folder absolute."""
    return model if model in MODEL_NAMES or not pathlib.Path(model).is_dir() else str(pathlib.Path(model).resolve())


def _check_resumed_log(cfg: JobConfig, out: pathlib.Path) -> None:
    """``orchestrator.prepare.check_resumed_log`` on the step log in ``out`` (when there is one), before
    the model, the data or Ray: another run's log exits 2, a damaged one (a gap, a step out of order, a
    corrupt record) exits 1, each with one line."""
    from raycheck.orchestrator.prepare import ResumeMismatchError, check_resumed_log
    from raycheck.training.zo import DtypeMismatchError, GeneratorMismatchError

    run = RunDir(out)
    if not run.step_log.exists():
        return
    try:
        check_resumed_log(cfg, run)
    except StepLogError as exc:
        raise _damaged(exc) from exc
    except (ResumeMismatchError, GeneratorMismatchError, DtypeMismatchError) as exc:
        raise _refuse(str(exc)) from exc


def _damaged(exc: StepLogError) -> typer.Exit:
    """Print the one line for a run whose step log is damaged; returns the exit (code 1) to raise."""
    typer.echo(f"error: {exc}; the run cannot be resumed from a damaged step log", err=True)
    return typer.Exit(1)


def _checked_job(cfg: JobConfig):
    """``orchestrator.api.check_job``: model, data, shards and storage checked before training starts
    (exit 2 with one line: a wrong model, bad data, endpoint, bucket or credentials)."""
    from raycheck.orchestrator.api import check_job

    try:
        return check_job(cfg)
    except ValueError as exc:
        raise _refuse(option_names(str(exc))) from exc
    except OSError as exc:
        raise _refuse(f"snapshot storage {cfg.storage.uri} is not usable: {exc}") from exc


def _entries_to_replace(out: pathlib.Path, overwrite: bool) -> list[pathlib.Path]:
    """What ``--overwrite`` deletes in ``out`` (its ``reference/`` stays), once every check has passed.

    Refuses (exit 2): ``out`` is a file; it holds something and ``overwrite`` is off; it holds something
    but no ``config.json``, so it is not a raycheck run and is never emptied (``--out ~`` with
    ``--overwrite`` must not wipe a home folder)."""
    if out.exists() and not out.is_dir():
        raise _refuse(f"--out {out} is a file, not a folder")
    entries = [p for p in out.iterdir() if p.name not in ("reference", LOCK_NAME)] if out.exists() else []
    if entries and not (out / "config.json").is_file():
        raise _refuse(f"{out} is not empty and holds no raycheck run (no config.json); --overwrite replaces only a "
                      "run: choose a new or empty --out")
    if entries and not overwrite:
        raise _refuse(f"{out} already holds a run; pass --overwrite or choose another --out")
    return entries


def resume_command(out: pathlib.Path, verify: bool) -> str:
    """The shell command line that resumes the run in ``out`` (with ``--verify`` when it was given)."""
    return shlex.join(["raycheck", "run", "--resume", "--out", str(out.resolve()), *(["--verify"] if verify else [])])


EXIT_INTERRUPTED = 130
"""The exit code of an interrupted ``raycheck run``, as a shell gives a command that SIGINT ended."""


def interrupted(exc: BaseException) -> KeyboardInterrupt | None:
    """The interrupt (Ctrl-C, or ``SIGTERM`` as ``orchestrator.signals.Terminated``) that ``exc`` is or was
    raised after, while it was handled (the interrupt is in its chain of causes and contexts): e.g. a Ray
    call of the failure path that found the core worker already shut down. The interrupt was seen first, so
    the run was interrupted, whatever failed after it. None: no interrupt."""
    seen: set[int] = set()  # a chain set by hand may loop
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, KeyboardInterrupt):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _interrupted(out: pathlib.Path, verify: bool, steps: int, interrupt: KeyboardInterrupt) -> typer.Exit:
    """Print, after Ctrl-C or ``SIGTERM`` (``interrupt``) stopped ``raycheck run``, the command line that
    resumes the run in ``out`` of ``steps`` steps (or that nothing is left to resume); returns the exit to
    raise (``EXIT_INTERRUPTED``, or ``EXIT_TERMINATED`` after ``SIGTERM``)."""
    saved = out / "config.json"
    summary = RunDir.read_json(out / "summary.json")
    what = "stopped by SIGTERM" if isinstance(interrupt, Terminated) else "interrupted"
    if not saved.is_file():
        typer.echo(f"{what} before the run started: nothing to resume; run the same command again", err=True)
    elif summary and summary.get("ok") and summary.get("final_step") == steps:
        typer.echo(f"{what}: the run had finished ({out / 'summary.json'}); only its failure-free reference "
                   "(--verify) was cut short", err=True)
    else:
        typer.echo(f"{what}: the run stopped; resume it with:\n  {resume_command(out, verify)}", err=True)
    return typer.Exit(EXIT_TERMINATED if isinstance(interrupt, Terminated) else EXIT_INTERRUPTED)


FINISHED_KEYS = ("ok", "strategy", "final_step", "state_sha256", "shadow_equal", "reference_state_sha256", "bitwise_equal",
                 "lost_steps", "accuracy_before", "accuracy_after", "mean_step_seconds", "mean_checkpoint_block_seconds",
                 "shadow_replay_seconds_per_step", "shadow_max_lag_steps", "wall_seconds")
"""The ``summary.json`` fields ``raycheck run`` prints for a run that finished."""


def printed_summary(summary: dict, out: pathlib.Path, verify: bool) -> dict:
    """The block ``raycheck run`` prints: for a run that finished, its ``FINISHED_KEYS``; for one that
    failed (``ok`` false), ``ok``, ``error``, ``phase``, ``logged_steps`` (the steps ``out``'s step log
    holds, all of them recoverable; absent without a readable step log) and ``resume`` (the command that
    resumes the run), since a failed run has no final state, hashes or timings to show."""
    if summary.get("ok"):
        return {k: summary[k] for k in FINISHED_KEYS if k in summary}
    failed = {"ok": False, "error": summary.get("error"), "phase": summary.get("phase")}
    try:
        failed["logged_steps"] = len(read_log(out / "steplog.bin")[1])
    except (OSError, StepLogError):  # no step log (a strategy without one, or a run that failed before it)
        pass
    failed["resume"] = resume_command(out, verify)
    return failed


@app.command(cls=_Sectioned)
def run(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help=f"Model: {', '.join(MODEL_NAMES)}, a local Hugging Face model folder (config.json + "
                                             "*.safetensors) or a model id in the local Hugging Face cache (never downloaded).")] = "smollm2-135m",
    data: Annotated[str, typer.Option(help="Training data: a local .jsonl, .csv or .parquet file (default: the Rotten Tomatoes "
                                           "snippets); every 10th row is held out.")] = "",
    task: Annotated[str, typer.Option(help="classification (a prompt scored by its label words) or causal-lm (loss on the "
                                           "completion tokens; needs --data).")] = "classification",
    text_column: Annotated[str, typer.Option(help="Column of the text (classification; causal-lm without prompt/completion).")] = "text",
    label_column: Annotated[str, typer.Option(help="Classification: column of the label (a label word or its 0-based index).")] = "label",
    label_words: Annotated[str, typer.Option(help="Classification: label words, comma-separated.")] = "negative,positive",
    prompt_template: Annotated[str, typer.Option(help="Classification: the prompt, {text} standing for the text and \\n "
                                                      "(backslash n, as typed) for a newline.")] = PROMPT.replace("\n", "\\n"),  # as typed: help shows \n, not a space
    prompt_column: Annotated[str, typer.Option(help="Causal LM: column of the prompt.")] = "prompt",
    completion_column: Annotated[str, typer.Option(help="Causal LM: column of the completion (the tokens the loss is on).")] = "completion",
    algo: Annotated[str, typer.Option(help="zo (MeZO, zeroth-order, with a step log) or fo (AdamW, first-order).")] = "zo",
    strategy: Annotated[str, typer.Option(help=(
        "Checkpointing strategy. zo: shadow (step log + CPU shadow + snapshots, default), full-sync, full-async, "
        "log-only; fo: layerwise (default), differential, overlapped, full-sync, full-async. full-* and overlapped "
        "checkpoint every --snapshot-every steps."))] = "",
    fo_lr: Annotated[float, typer.Option(help="fo: AdamW learning rate (constant).")] = 1e-5,
    fo_max_grad_norm: Annotated[float, typer.Option(min=0, help="fo: clip the gradients' global L2 norm to this (0: off).")] = 1.0,
    fo_parallelism: Annotated[str, typer.Option(help=(
        "fo: ddp (every worker holds the whole state) or fsdp2 (state sharded over the workers with FSDP2; checkpoints "
        "per rank with torch DCP, so --resume --workers N may change the worker count; full-sync/full-async only)."))] = "ddp",
    layer_threshold: Annotated[float, typer.Option(min=0, help=(
        "fo layerwise: rewrite a unit at a check (every --snapshot-every steps) when its weights' relative change "
        "since its persisted version exceeds this."))] = 1e-3,
    layer_staleness_steps: Annotated[int, typer.Option(min=1, help="fo layerwise: rewrite a unit whose persisted version is this many steps old.")] = 100,
    layer_max_bytes_per_check: Annotated[int, typer.Option(min=0, help="fo layerwise: bytes written per check, forced units included (0: no limit).")] = 0,
    diff_full_every: Annotated[int, typer.Option(min=1, help="fo differential: steps between full checkpoints.")] = 50,
    diff_batch_steps: Annotated[int, typer.Option(min=1, help="fo differential: per-step gradient records per object.")] = 5,
    diff_topk: Annotated[float, typer.Option(min=0, max=1, help="fo differential: 0 exact records; else the fraction of elements kept (top-k, approximate).")] = 0.0,
    overlap_chunks: Annotated[int, typer.Option(min=1, help=(
        "fo overlapped: stage each snapshot in this many chunks, one per step (GoCkpt); the snapshot is of the last one's step."))] = 4,
    steps: Annotated[int, typer.Option(min=1, help="Training steps.")] = 50,
    batch_size: Annotated[int, typer.Option(min=1, help="Samples per step (split across workers).")] = 8,
    seq_len: Annotated[int, typer.Option(min=8, help="Maximum prompt length in tokens.")] = 32,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 1e-6,
    eps: Annotated[float, typer.Option(help="MeZO perturbation scale.")] = 1e-3,
    weight_decay: Annotated[float, typer.Option(help="Weight decay for matrices.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Run seed (batches and perturbations).")] = 0,
    workers: Annotated[int, typer.Option(min=1, help="Ray Train workers (data parallel, gloo).")] = 1,
    micro_batch_size: Annotated[int, typer.Option(min=0, help="zo: examples per example group; each group is one forward pass "
                                                    "whichever worker runs it, so the losses do not depend on --workers "
                                                    "(docs/elastic.md). A divisor of --batch-size giving at least --workers groups; "
                                                    "0: batch-size / workers.")] = 0,
    min_workers: Annotated[int, typer.Option(min=0, help="zo: elastic: go on with as few as this many workers when a node "
                                               "is lost, grow back to --workers when the cluster can place them (bitwise the "
                                               "same trajectory; docs/elastic.md). 0: a fixed --workers.")] = 0,
    elastic_resize_interval: Annotated[str, typer.Option(help="With --min-workers: how often Ray Train checks whether more "
                                                         "workers can be placed, e.g. 60s.")] = "60s",
    torch_threads: Annotated[int, typer.Option(min=1, help="Torch threads per worker (fixed for reproducibility).")] = 1,
    fail: Annotated[
        list[str],
        typer.Option(help="Inject a failure during step STEP (0-based, 0..steps-1): STEP[:TARGET[:HOW]], "
                          "TARGET one of worker, shadow, both, corrupt, persister, node, storage; HOW one of exit, raise, sigkill, torn (worker only; raise: an exception, "
                          "the process survives, see --max-in-process-restarts); "
                          "node: rank 0 takes down its whole Ray node (raylet and every process; needs another node "
                          "for the workers, the driver's node hosting none, and an s3:// --storage); "
                          "storage:SECONDS needs a server raycheck owns (tests, experiments/s3_server.py). Repeatable."),
    ] = [],
    fail_schedule: Annotated[
        str, typer.Option(help="Random failures: poisson:MTBF_STEPS[:TARGET] or weibull:MTBF_STEPS:SHAPE[:TARGET], seeded by --fail-seed.")
    ] = "",
    fail_seed: Annotated[int, typer.Option(help="Seed of --fail-schedule.")] = 0,
    snapshot_every: Annotated[int, typer.Option(min=0, help="Fixed snapshot/checkpoint interval in steps (0: log only).")] = 10,
    snapshot_policy: Annotated[str, typer.Option(help="fixed (--snapshot-every) or adaptive (cost model, re-planned from measured costs).")] = "fixed",
    mtbf: Annotated[str, typer.Option(help="Assumed job MTBF for the adaptive policy, e.g. 30min, 3h.")] = "1h",
    keep_snapshots: Annotated[int, typer.Option(min=1, help="Complete snapshots to keep.")] = 3,
    persister_priority: Annotated[str, typer.Option(help="CPU and I/O priority of the snapshot persister's process: normal, or "
                                                         "idle (SCHED_IDLE, nice 19, idle I/O: it writes only in CPU time the "
                                                         "training leaves).")] = "normal",
    persister_direct_io: Annotated[bool, typer.Option(help="The persister writes local snapshots with direct I/O (O_DIRECT, "
                                                           "no page cache: the disk work runs at its own priority); "
                                                           "--no-persister-direct-io: buffered.")] = True,
    storage: Annotated[str, typer.Option(help="Snapshot storage: a path, file://PATH or s3://BUCKET/PREFIX. Default: <out>/snapshots.")] = "",
    s3_endpoint: Annotated[str, typer.Option(help="S3 endpoint URL (default: $AWS_ENDPOINT_URL; keys from $AWS_ACCESS_KEY_ID/$AWS_SECRET_ACCESS_KEY).")] = "",
    storage_consistency: Annotated[str, typer.Option(help="fenced: a remote --storage must honour conditional writes "
                                                          "(probed at the start) or the run is refused; unfenced: run on one "
                                                          "that ignores them, without fencing of stale writers (recorded in "
                                                          "summary.json).")] = "fenced",
    out: Annotated[pathlib.Path, typer.Option(help="Run directory.")] = pathlib.Path("runs/default"),
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run directory (its reference/ is kept).")] = False,
    resume: Annotated[bool, typer.Option(help="Continue the run in --out (after the driver died): same run id and settings "
                                               "(from its config.json), restored from storage and the step log; "
                                               f"{', '.join(option(name) for name in RESUME_BUDGETS)} given here replace the "
                                               "saved values, and so does --workers N on an --algo fo --fo-parallelism fsdp2 "
                                               "run (its state reshards); other options are ignored (with a warning). With "
                                               "--storage URI (and --s3-endpoint) and an "
                                               "empty or new --out: resume from the run's storage alone.")] = False,
    verify: Annotated[bool, typer.Option(help="Run (or reuse) the failure-free reference and compare bitwise (with --resume of a "
                                               "run that finished: only that).")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="End with the summary as JSON (for scripts) instead of the "
                                                             "table.")] = False,
    eval_samples: Annotated[int, typer.Option(min=0, help="Held-out snippets scored before and after (0: skip).")] = 200,
    hash_every: Annotated[int, typer.Option(min=0, help="Record worker and shadow state sha256 every N steps (a sharded "
                                                  "shadow records none: a shard holds part of the state; its final shadow_state_sha256 is still compared).")] = 0,
    max_shadow_restarts: Annotated[int, typer.Option(help="Restarts of a failed shadow before the run fails (-1: unlimited; per shard).")] = 10,
    max_persister_restarts: Annotated[int, typer.Option(help="Restarts of a dead snapshot persister before the run fails (-1: unlimited).")] = 10,
    max_worker_failures: Annotated[int, typer.Option(help="Worker-group restarts after a train worker failed before the run fails "
                                                          "(-1: unlimited; injected failures count).")] = 10,
    max_in_process_restarts: Annotated[int, typer.Option(min=0, help="zo only (ignored by --algo fo), one worker: a step "
                                                         "that raises (the process alive) is rolled back to the freshest state in the same process and "
                                                         "re-executed, without a Ray Train restart, at most this many times per "
                                                         "worker process; then (or with 0) Ray Train restarts the worker.")] = 3,
    warm_standby: Annotated[bool, typer.Option(help="zo, one worker, cpu: train in a step executor actor with a second one loaded "
                                                    "and waiting; when the executor's process dies the standby takes over "
                                                    "without a Ray Train restart (counts against --max-worker-failures).")] = False,
    shadow_shards: Annotated[int, typer.Option(min=1, help="Split the shadow into K CPU actors, each replaying a contiguous range of "
                                                "units (embeddings, layers, norm, head) balanced by size, spread across nodes: "
                                                "replay work and memory per actor / K. 1..the model's unit count (tiny: 4, "
                                                "smollm2-135m: 32); --fail STEP:shadow:N kills shard N only.")] = 1,
    shadow_threads: Annotated[int, typer.Option(min=1, help="Threads of each shadow actor (each shard): its replay splits large "
                                                 "tensors over them, the same bits on any count. `raycheck policy --elements "
                                                 "--replay-rate` says how many cores keep up.")] = 1,
    settle_failures: Annotated[bool, typer.Option(help="Before each injected failure, wait until the shadow has caught up and "
                                                   "snapshots are committed, so the recovery source depends on the failure "
                                                   "steps alone (reproducible experiments; real failures do not wait).")] = False,
    device: Annotated[str, typer.Option(help="zo: where the workers compute, cpu or cuda (one GPU per worker; the step "
                                               "log and the shadow stay on the CPU; see scripts/device-check).")] = "cpu",
    dtype: Annotated[str, typer.Option(help="zo: the dtype the workers hold and perturb the parameters in: float32, bfloat16 "
                                              "or float16 (half the memory; the shadow, recoveries and replay use the same one, "
                                              "bitwise: see docs/dtypes.md). algo fo trains in float32.")] = "float32",
    shadow_env: Annotated[list[str], typer.Option(help="KEY=VALUE set in the shadow actor's process (Ray runtime_env), "
                                                       "e.g. ATEN_CPU_CAPABILITY=default. Repeatable.")] = [],
    durability: Annotated[str, typer.Option(help="zo step log: a step is durable before its update when fsynced on rank 0's node "
                                                 "(process), also acknowledged by the log keeper on the driver's node (node), or also uploaded "
                                                 "to the remote --storage (cluster, group commit).")] = "node",
    scratch_dir: Annotated[str, typer.Option(help="Node-local directory for rank 0's own step log (default: a per-run "
                                                  "directory under the system temp dir; never the run directory).")] = "",
    cache_dir: Annotated[pathlib.Path, typer.Option(help="Converted-model cache.")] = default_cache_dir(),
    worker_resource: Annotated[str, typer.Option(help="Ray custom resource each train worker asks one unit of (places the "
                                                      "workers on the nodes offering it).")] = "",
    shadow_resource: Annotated[str, typer.Option(help="Ray custom resource each shadow shard and the snapshot persister ask one "
                                                      "unit of. Default: on 2+ nodes, off every node that can host a train worker.")] = "",
    start_timeout: Annotated[float, typer.Option(min=1, help="Seconds the persister and each shadow "
                                                            "shard may take to start before the run fails.")] = 300.0,
) -> None:
    """Fine-tune (MeZO, or AdamW with --algo fo) under Ray Train, inject failures, recover; writes summary.json and metrics.parquet."""
    from raycheck.orchestrator.api import run_job
    from raycheck.orchestrator.prepare import ResumeMismatchError
    from raycheck.orchestrator.runs import compare_with_reference
    from raycheck.training.zo import DtypeMismatchError, GeneratorMismatchError

    resuming = resume and (out / "config.json").is_file()  # the run's config.json decides, not the options typed
    finished: dict | None = None  # the summary of a finished run that --resume --verify compares with its reference
    try:
        failures = tuple(FailureSpec.parse(f) for f in fail)
        if fail_schedule:
            failures += parse_schedule(fail_schedule, steps, fail_seed)
        cfg = JobConfig(
            out_dir=str(out.resolve()), cache_dir=str(cache_dir.resolve()), model=_model_arg(model), data=data and str(pathlib.Path(data).resolve()),
            task=task, text_column=text_column, label_column=label_column, label_words=label_words,
            prompt_template=prompt_template.replace("\\n", "\n"),
            prompt_column=prompt_column, completion_column=completion_column, algo=algo, strategy=strategy, steps=steps,
            batch_size=batch_size, seq_len=seq_len, seed=seed, workers=workers, torch_threads=torch_threads,
            weight_decay=weight_decay, zo=ZOConfig(lr=lr, eps=eps, micro_batch_size=micro_batch_size),
            fo=FOConfig(lr=fo_lr, max_grad_norm=fo_max_grad_norm, parallelism=fo_parallelism),
            layerwise=LayerwiseConfig(threshold=layer_threshold, staleness_bound_steps=layer_staleness_steps,
                                      max_bytes_per_check=layer_max_bytes_per_check),
            differential=DifferentialConfig(full_every_steps=diff_full_every, batch_steps=diff_batch_steps, topk=diff_topk),
            overlapped=OverlappedConfig(chunks=overlap_chunks),
            snapshot=SnapshotConfig(every_steps=snapshot_every, policy=snapshot_policy, mtbf_s=parse_duration(mtbf), keep=keep_snapshots,
                                    persister_priority=persister_priority, persister_direct_io=persister_direct_io),
            storage=StorageConfig(uri=_storage_uri(storage), options={"endpoint_url": s3_endpoint} if s3_endpoint else {},
                                  consistency=storage_consistency),
            faults=FaultConfig(failures=failures, settle_failures=settle_failures, max_shadow_restarts=max_shadow_restarts,
                               max_persister_restarts=max_persister_restarts, max_worker_failures=max_worker_failures,
                               max_in_process_restarts=max_in_process_restarts, warm_standby=warm_standby,
                               start_timeout_s=start_timeout),
            elastic=ElasticConfig(min_workers=min_workers, resize_interval_s=parse_duration(elastic_resize_interval)),
            eval_samples=eval_samples, hash_every_steps=hash_every, shadow_shards=shadow_shards, shadow_threads=shadow_threads, device=device, dtype=dtype,
            shadow_env=parse_env(shadow_env, "--shadow-env"), worker_resource=worker_resource, shadow_resource=shadow_resource,
            durability=durability, scratch_dir=scratch_dir, run_id=uuid.uuid4().hex[:8],
        )
    except ValueError as exc:  # nonsense configuration: refused before anything is touched
        if not resuming:
            raise _refuse(option_names(str(exc))) from exc
        cfg = None  # e.g. --workers 3 with the default --batch-size: resume_config judges what applies to the run
    if not resume and cfg is not None and cfg.device == "cuda":
        _require_cuda()
    if cfg is not None and not resuming and any(f.target == "storage" for f in cfg.faults.failures):
        from raycheck.orchestrator.controller import STORAGE_OUTAGE_NEEDS_SERVER

        raise _refuse(f"--fail: {STORAGE_OUTAGE_NEEDS_SERVER}")
    replaced = [] if resume else _entries_to_replace(out, overwrite)
    if resume:
        given = _given_options(ctx)
        if storage and not resuming and cfg is not None:  # a new run directory: everything from the storage
            saved = _stored_config(cfg, out, scratch_dir)
            given = {name: value for name, value in given.items() if name not in FROM_STORAGE_OPTIONS}
        else:
            saved = _resumed_config(out, verify)
            finished = _finished_summary(out, saved)
            if finished and not verify:
                for line in ignored_warning(given):  # e.g. --steps 99: a finished run is not extended
                    typer.echo(line, err=True)
                typer.echo(f"{out}: the run already finished (summary.json); nothing to resume")
                raise typer.Exit(0)
        cfg, notes = resume_config(saved, given)
        for line in notes:
            typer.echo(line, err=True)
        if resuming and not finished:
            _check_resumed_log(cfg, out)
    if cfg is None:  # refused options are let through only when resuming, and resume_config replaced them
        raise RuntimeError("no job configuration to run")
    cfg, assets = _checked_job(cfg)
    console = RunConsole(typer.echo, verbose=(ctx.obj or {}).get("verbose", False))
    try:
        with terminate_as_interrupt(), driver_lock(out):  # SIGTERM (ray job stop) as Ctrl-C; one driver per run directory (a live run is neither resumed nor overwritten)
            for p in replaced:  # every check has passed: only now is the old run deleted
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            if finished:  # nothing left to train: only the comparison a fresh --verify run ends with
                summary = compare_with_reference(cfg, finished, echo=console, assets=assets)
            else:
                summary = run_job(cfg, verify=verify, echo=console, assets=assets)
    except RunDirectoryError as exc:
        raise _refuse(str(exc)) from exc
    except (ResumeMismatchError, GeneratorMismatchError, DtypeMismatchError) as exc:  # raised before anything in the run directory is touched
        raise _refuse(str(exc)) from exc
    except StepLogError as exc:  # prepare found the log damaged (after _check_resumed_log passed): nothing touched
        raise _damaged(exc) from exc
    except InfeasibleError as exc:  # the adaptive policy's first plan, made before anything in the run directory is touched
        raise _refuse(f"--snapshot-policy adaptive has no snapshot plan for the assumed costs (--mtbf {cfg.snapshot.mtbf_s:g} s): "
                      f"{exc}") from exc
    except BaseException as exc:  # Ctrl-C or SIGTERM (the run has written its summary), or what failed after it: still an interrupt
        interrupt = interrupted(exc)
        if interrupt is None:
            raise
        raise _interrupted(out, verify, cfg.steps, interrupt) from exc
    printed = printed_summary(summary, out, verify)
    for line in [json.dumps(printed, indent=2)] if json_output else summary_table(summary, printed, out):
        typer.echo(line)
    if not summary["ok"]:
        typer.echo(f"error: training failed: {summary['error']}", err=True)
        raise typer.Exit(1)
    if summary["lost_steps"] or summary["shadow_equal"] is False or summary["bitwise_equal"] is False:
        typer.echo("error: recovery was not exact (see summary.json)", err=True)
        raise typer.Exit(3)
    snaps = summary["snapshots"]
    silent = cfg.uses_shadow and not snaps  # the persister never answered (e.g. storage was gone when it started)
    if silent or cfg.uses_shadow and snaps.get("unavailable") or snaps.get("last_durable_step") != snaps.get("last_submitted_step"):
        durable = "none" if snaps.get("last_durable_step") is None else f"step {snaps['last_durable_step']}"
        why = "the snapshot persister never reported a status" if silent else snaps.get("unavailable") or snaps.get("last_error")
        typer.echo(
            f"error: the last snapshot (step {snaps.get('last_submitted_step')}) is not durable: "
            f"{why}. Last durable snapshot: {durable}; the step log "
            f"({out / 'steplog.bin'}) holds all {summary['final_step']} steps, so the state is still recoverable",
            err=True,
        )
        raise typer.Exit(4)


app.command()(policy)
app.command()(inspect)
app.command()(verify)
app.command()(merge)
app.command()(replay)
app.command()(experiment)

SHORT_HELP = {
    "run": "Fine-tune with injected failures and exact recovery.",
    "policy": "Expected waste of each snapshot strategy, and the pick.",
    "inspect": "List a store's snapshots, their runs, and the step log.",
    "verify": "Re-hash every snapshot shard; exit 1 naming each bad one.",
    "merge": "Assemble one snapshot from units of several.",
    "replay": "Rebuild and hash the state at any logged step.",
    "experiment": "Every checkpointing strategy side by side, with a report.",
}
"""One line per command for ``raycheck --help`` (click cuts a longer first sentence with "...")."""
for _command in app.registered_commands:
    _command.short_help = _command.short_help or SHORT_HELP.get(getattr(_command.callback, "__name__", ""))


def main() -> None:
    """The ``raycheck`` command: ``app``. A command interrupted while this process is connected to Ray ends
    here with ``EXIT_INTERRUPTED`` (``EXIT_TERMINATED`` after ``SIGTERM``) at once (``os._exit``, after flushing the output and the logs): Ray's
    exit hook (``ray.shutdown``) would run while a daemon thread still waits in a Ray call (the run's
    ``ray-train-fit``), and a Ray call after that shutdown ends the process with exit 1 ("The core worker
    has already been shutdown"). The run's actors end with its driver; a cluster that ``ray.init``
    started here is ended by Ray's reaper process."""
    try:
        app()
    except SystemExit as exc:
        ray = sys.modules.get("ray")  # never imported for a command that did not use Ray
        if exc.code in (EXIT_INTERRUPTED, EXIT_TERMINATED) and ray is not None and ray.is_initialized():
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(exc.code)
        raise


if __name__ == "__main__":
    main()
