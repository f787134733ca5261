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
from inspect import Parameter, Signature, signature
from typing import Annotated, Any, cast, get_type_hints

import typer
from typer._click.core import Context
from typer._click.formatting import HelpFormatter
from typer._click.exceptions import NoArgsIsHelpError, UsageError  # typer 0.29 vendors click: its own classes
from typer.core import TyperCommand, TyperGroup

from raycheck.job.config import COMPONENTS, JobConfig, OldConfigError, field_spec
from raycheck.job.options import SECTIONS, Opt, metavar_of, option_of
from raycheck.job.run_dir import RunDir
from raycheck.orchestrator.console import RunConsole, summary_table
from raycheck.cli.experiment import experiment
from raycheck.cli.merge import export, merge
from raycheck.cli.policy import policy
from raycheck.cli.replay import replay
from raycheck.orchestrator.schedule import parse_schedule
from raycheck.orchestrator.signals import EXIT_TERMINATED, Terminated, terminate_as_interrupt
from raycheck.orchestrator.driver_lock import LOCK_NAME, RunDirectoryError, driver_lock
from raycheck.cli.storage import inspect, verify
from raycheck.orchestrator.stored_config import StoredConfigError, load_config
from raycheck.policies.costs import InfeasibleError
from raycheck.storage.backend import local_path
from raycheck.storage.steplog import StepLogError, read_log
from raycheck.training.model import default_cache_dir


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


HAND_SECTIONS = {"verify": "Run", "out": "Run", "resume": "Run", "overwrite": "Run", "json_output": "Run", "help": "Run",
                 "fail_schedule": "Failures and restarts", "fail_seed": "Failures and restarts"}
"""The sections of ``raycheck run``'s options that fill no field of their own (declared in ``_hand_options``)."""

HELP_ORDER = ("model", "data", "steps", "fail", "verify", "out", "resume", "overwrite", "algo", "strategy", "workers", "device",
              "dtype", "json_output", "help",
              "task", "text_column", "label_column", "label_words", "prompt_template", "prompt_column", "completion_column",
              "batch_size", "seq_len", "seed", "eval_samples",
              "lr", "eps", "weight_decay", "torch_threads", "hash_every", "micro_batch_size",
              "fo_lr", "fo_max_grad_norm", "fo_parallelism", "layer_threshold", "layer_staleness_steps",
              "layer_max_bytes_per_check", "diff_full_every", "diff_batch_steps", "diff_topk", "overlap_chunks",
              "fail_schedule", "fail_seed", "settle_failures", "max_shadow_restarts", "max_persister_restarts",
              "max_worker_failures", "max_preemptions", "max_in_process_restarts", "warm_standby", "min_workers", "elastic_resize_interval",
              "snapshot_every", "snapshot_policy", "mtbf", "keep_snapshots", "durability", "storage", "s3_endpoint",
              "storage_consistency", "ray_train_storage", "persister_priority", "persister_direct_io", "scratch_dir", "cache_dir",
              "shadow_shards", "shadow_threads", "shadow_env", "worker_resource", "shadow_resource", "start_timeout")
"""The order of ``raycheck run --help``'s options (by parameter name), what most runs set first; each option's section
is its field's (``job.options.Opt.section``) or ``HAND_SECTIONS``'."""

RUN_FIELDS: dict[str, tuple[str, Opt]] = {o.parameter: (path, o) for path in JobConfig.field_paths()
                                          if (o := option_of(field_spec(JobConfig, path))) is not None}
"""``raycheck run``'s options that fill a ``JobConfig`` field, by parameter name: (the field's path, its ``Opt``)."""

COMMAND_DEFAULTS = {"cache_dir": default_cache_dir()}
"""The options' defaults for the fields that have none (this machine's)."""

RUN_SECTIONS: dict[str, tuple[str, ...]] = {
    title: tuple(name for name in HELP_ORDER if HAND_SECTIONS.get(name) == title or name in RUN_FIELDS and RUN_FIELDS[name][1].section == title)
    for title in SECTIONS}
"""``raycheck run --help``'s sections, in order, and the options of each (by parameter name)."""


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


def _refuse(message: str) -> typer.Exit:
    """Print ``error: message`` (one line) to stderr; returns the exit (code 2) to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


FIELD_PARAMETERS = {"out_dir": "out", **{path: name for name, (path, _) in RUN_FIELDS.items()}}
"""The ``raycheck run`` parameter of each ``JobConfig`` field path that has one (``layerwise.threshold``:
``layer_threshold``, the names users' scripts use)."""
RESUME_BUDGETS = ("faults.max_shadow_restarts", "faults.max_persister_restarts", "faults.max_worker_failures", "faults.max_preemptions",
                  "faults.max_in_process_restarts", "placement.worker_resource", "placement.shadow_resource",
                  "faults.start_timeout_s", "storage.ray_train")
"""Fields (paths) that ``--resume`` takes from the command line over the run's ``config.json``: restart
budgets, placement and Ray Train's storage, not part of the trajectory (a run that spent one resumes
with a larger one; a run resumed on another cluster is placed there, and reports to a storage there)."""


def parameter(path: str) -> str:
    """The ``raycheck run`` parameter that fills the ``JobConfig`` field ``path``: its option's
    (``FIELD_PARAMETERS``), else the path's last name."""
    return FIELD_PARAMETERS.get(path, path.split(".")[-1])


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
        if saved.batch_size % cast(int, given["workers"]):  # the batch is the run's (its trajectory): --batch-size does not change it
            raise _refuse(f"--resume --workers {given['workers']}: the run's batch of {saved.batch_size} does not split over "
                          f"{given['workers']} workers; give a worker count that divides {saved.batch_size}")
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


PATH_FIELDS = ("out_dir", "storage.uri", "data.path", "model", "cache_dir")
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


def _require_cuda() -> None:
    """Refuse ``--device cuda`` (exit 2) on a machine where torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise _refuse(f"--device cuda: torch.cuda.is_available() is false on this machine (torch {torch.__version__}, "
                      f"built for CUDA {torch.version.cuda or 'none: a CPU-only build'}); run on a node with a GPU and a "
                      "CUDA build of torch, or use --device cpu")


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
    from raycheck.orchestrator.api import RayTrainStorageError, check_job

    try:
        return check_job(cfg)
    except ValueError as exc:
        raise _refuse(option_names(str(exc))) from exc
    except RayTrainStorageError as exc:
        raise _refuse(str(exc)) from exc
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


def _hand_options(
    out: Annotated[pathlib.Path, typer.Option(help="Run directory.", metavar="DIR")] = pathlib.Path("runs/default"),
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
    fail_schedule: Annotated[
        str, typer.Option(help="Random failures: poisson:MTBF_STEPS[:TARGET] or weibull:MTBF_STEPS:SHAPE[:TARGET], seeded by --fail-seed.",
                          metavar="SPEC")
    ] = "",
    fail_seed: Annotated[int, typer.Option(help="Seed of --fail-schedule.", metavar="N")] = 0,
) -> None:
    """``raycheck run``'s options that fill no ``JobConfig`` field of their own (``HAND_SECTIONS``); the others
    come from the fields (``_run_signature``)."""


def _run_signature() -> Signature:
    """``run``'s parameters: the context, ``_hand_options``', and one option per ``RUN_FIELDS`` entry, described by its
    field's ``Opt`` (type, help, range) with the field's default (shown as typed: ``Opt.show``), in ``HELP_ORDER``."""
    params = dict(signature(_hand_options, eval_str=True).parameters)
    for name, (path, o) in RUN_FIELDS.items():
        component, _, leaf = path.rpartition(".")
        kind = o.type or get_type_hints(COMPONENTS[component] if component else JobConfig)[leaf]
        default = COMMAND_DEFAULTS[name] if name in COMMAND_DEFAULTS else JobConfig.default(path)
        params[name] = Parameter(name, Parameter.KEYWORD_ONLY, annotation=Annotated[kind, typer.Option(help=o.help, min=o.min, max=o.max, metavar=metavar_of(o, kind))],
                                 default=o.show(default) if o.show else default)
    ordered = [params[name] for name in HELP_ORDER if name in params]
    return Signature([Parameter("ctx", Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
                      *(p.replace(kind=Parameter.KEYWORD_ONLY) for p in ordered)])


def options_config(options: dict[str, Any]) -> JobConfig:
    """The ``JobConfig`` that ``raycheck run``'s ``options`` (by parameter name) describe: each ``RUN_FIELDS`` option's
    value parsed (``Opt.parse``) into its field, ``--fail-schedule``'s failures added to ``--fail``'s, ``--out`` the run
    directory (absolute) and a new run id.

    Raises:
        ValueError: a value no run can use (the message names the field).
    """
    nested: dict[str, Any] = {}
    for name, (path, o) in RUN_FIELDS.items():
        component, _, leaf = path.rpartition(".")
        value = o.parse(options[name]) if o.parse else options[name]
        if component:
            nested.setdefault(component, {})[leaf] = value
        else:
            nested[leaf] = value
    if options["fail_schedule"]:
        nested["faults"]["failures"] += parse_schedule(options["fail_schedule"], options["steps"], options["fail_seed"])
    return JobConfig(out_dir=str(options["out"].resolve()), run_id=uuid.uuid4().hex[:8], **nested)


def run(ctx: typer.Context, **options: Any) -> None:
    """Fine-tune (MeZO, or AdamW with --algo fo) under Ray Train, inject failures, recover; writes summary.json and metrics.parquet."""
    from raycheck.orchestrator.api import run_job
    from raycheck.orchestrator.prepare import ResumeMismatchError
    from raycheck.orchestrator.runs import compare_with_reference
    from raycheck.training.zo import DtypeMismatchError, GeneratorMismatchError

    out, resume, verify = options["out"], options["resume"], options["verify"]
    resuming = resume and (out / "config.json").is_file()  # the run's config.json decides, not the options typed
    finished: dict | None = None  # the summary of a finished run that --resume --verify compares with its reference
    cfg: JobConfig | None
    try:
        cfg = options_config(options)
    except ValueError as exc:  # nonsense configuration: refused before anything is touched
        if not resuming:
            raise _refuse(option_names(str(exc))) from exc
        cfg = None  # e.g. --workers 3 with the default --batch-size: resume_config judges what applies to the run
    if not resume and cfg is not None and cfg.device == "cuda":
        _require_cuda()
    if cfg is not None and not resuming and any(f.target == "storage" for f in cfg.faults.failures):
        from raycheck.orchestrator.controller import STORAGE_OUTAGE_NEEDS_SERVER

        raise _refuse(f"--fail: {STORAGE_OUTAGE_NEEDS_SERVER}")
    replaced = [] if resume else _entries_to_replace(out, options["overwrite"])
    if resume:
        cfg, finished = _resume(ctx, cfg, out, resuming, verify, options["storage"], options["scratch_dir"])
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
    _report(summary, cfg, out, verify, options["json_output"])


run.__signature__ = _run_signature()  # type: ignore[attr-defined]
app.command(cls=_Sectioned)(run)


def _resume(ctx: typer.Context, cfg: JobConfig | None, out: pathlib.Path, resuming: bool, verify: bool, storage: str,
            scratch_dir: str) -> tuple[JobConfig, dict | None]:
    """``--resume``: the configuration to run (the saved one, with the options it takes: ``resume_config``) and the
    summary of a run that finished (None: training goes on). A finished run without ``--verify`` exits 0 here."""
    given = _given_options(ctx)
    finished = None
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
    resumed, notes = resume_config(saved, given)
    for line in notes:
        typer.echo(line, err=True)
    if resuming and not finished:
        _check_resumed_log(resumed, out)
    return resumed, finished


def _report(summary: dict, cfg: JobConfig, out: pathlib.Path, verify: bool, json_output: bool) -> None:
    """Print the summary (a table, or JSON); exit 1 when training failed, 3 when recovery was not exact, 4 when the
    last snapshot is not durable."""
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
app.command()(export)
app.command()(replay)
app.command()(experiment)

SHORT_HELP = {
    "run": "Fine-tune with injected failures and exact recovery.",
    "policy": "Expected waste of each snapshot strategy, and the pick.",
    "inspect": "List a store's snapshots, their runs, and the step log.",
    "verify": "Re-hash every snapshot shard; exit 1 naming each bad one.",
    "merge": "Assemble one snapshot from units of several.",
    "export": "Write a snapshot's weights as a transformers folder.",
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
