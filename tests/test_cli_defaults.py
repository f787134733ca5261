"""``raycheck run``'s defaults are ``JobConfig``'s (the one place they live), checked without Ray.

The options repeat the defaults by hand, so that ``raycheck run --help`` shows them; these tests fail
on any option whose default differs from the field it fills, and on an option or a field (a path, e.g.
``layerwise.threshold``, whose option keeps its old name ``--layer-threshold``) that is new and not
accounted for here."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

import raycheck.orchestrator.api
from raycheck.job.config import JobConfig
from raycheck.orchestrator.api import job_config
from raycheck.cli.main import app, option

NOT_FIELDS = {
    "overwrite": "what to do with an existing run directory, not part of the run",
    "resume": "continue the run in --out (its config.json), not part of the run",
    "verify": "run the failure-free reference too, not part of the run",
    "json_output": "how the summary is printed (--json), not part of the run",
    "fail_schedule": "random failures, drawn into JobConfig.faults.failures with --fail",
    "fail_seed": "the seed of --fail-schedule's draw",
}
"""``raycheck run`` options that fill no ``JobConfig`` field of their own, and why."""

NO_OPTION = {
    "model_sha256": "set by the driver from the model's files (raycheck.orchestrator.api.check_job)",
    "data_sha256": "set by the driver from the data file",
    "run_id": "a new one per run (--resume keeps the saved one)",
    "writer_epoch": "set by the controller at each start",
    "namespace": "the Ray namespace; the Python API may set it",
    "faults.recovery_timeout_s": "the Python API and the tests may set it",
    "extra": "free-form, for the Python API",
}
"""``JobConfig`` fields (paths) that ``raycheck run`` has no option for, and why."""


def run_options() -> dict[str, str]:
    """``raycheck run``'s options (``--shadow-env``) by parameter name."""
    command = typer.main.get_command(app).commands["run"]
    return {p.name: p.opts[0] for p in command.params}


def test_every_option_fills_one_field_or_is_listed_and_every_field_has_an_option_or_is_listed():
    options = run_options()
    field_of = {option(path): path for path in JobConfig.field_paths()}
    assert {name for name, opt in options.items() if opt not in field_of} == set(NOT_FIELDS)
    assert set(field_of.values()) - {field_of[opt] for opt in options.values() if opt in field_of} == set(NO_OPTION)


def test_the_options_defaults_are_the_fields_defaults(tmp_path, monkeypatch):
    """The configuration ``raycheck run --out DIR`` builds (stopped at ``check_job``, before anything
    is read or written) is ``JobConfig``'s defaults: units converted (``--mtbf 1h`` is ``snapshot.mtbf_s`` 3600),
    ``--cache-dir`` the default cache, the new run id aside."""
    built = []

    def stop(cfg: JobConfig):
        built.append(cfg)
        raise ValueError("stopped before check_job")

    monkeypatch.setattr(raycheck.orchestrator.api, "check_job", stop)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "--out", str(out)])
    assert result.output.strip() == "error: stopped before check_job"
    [cfg] = built
    assert cfg.to_dict() == job_config(out, run_id=cfg.run_id).to_dict()
    assert not out.exists()


def test_the_prompt_templates_help_shows_its_newline_as_typed():
    """click re-wraps help text, so a newline in the default prompt showed as a space and a user who
    copied it lost it: the default is shown as typed (``\\n``, which ``--prompt-template`` turns into a
    newline), and the built configuration still holds the newline (above)."""
    result = CliRunner().invoke(app, ["run", "--help"])
    assert result.exit_code == 0, result.output
    shown = " ".join(result.output.split())
    assert "[default: Review: {text}\\nSentiment:]" in shown and "\\n (backslash n, as typed) for a newline" in shown
    assert JobConfig(out_dir="x", cache_dir="x").prompt_template == "Review: {text}\nSentiment:"


def test_run_help_lists_every_option_once_under_its_section():
    """``raycheck run --help`` groups its options (``cli.main.RUN_SECTIONS``): each option in exactly one
    section, none left out, and the options most runs set come first."""
    import typer.main

    from raycheck.cli.main import RUN_SECTIONS

    command = typer.main.get_command(app).commands["run"]
    listed = [name for names in RUN_SECTIONS.values() for name in names]
    assert sorted(listed) == sorted([p.name for p in command.params] + ["help"])
    text = CliRunner().invoke(app, ["run", "--help"]).output
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == list(RUN_SECTIONS)
    assert text.index("--steps") < text.index("--fo-lr") and text.index("--fail ") < text.index("--fail-schedule")
