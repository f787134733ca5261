"""``raycheck run``'s options come from the configuration's fields (``job.options.Opt`` in each field's metadata,
the default the field's own), checked without Ray: every option fills one field or is one of the command's own
(``cli.main.HAND_SECTIONS``), every field has an option or is listed here, and the options build the fields'
defaults."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

import raycheck.orchestrator.api
from raycheck.job.config import JobConfig, field_spec
from raycheck.job.options import SECTIONS, option_of, storage_uri
from raycheck.orchestrator.api import job_config
from raycheck.cli.main import HAND_SECTIONS, RUN_FIELDS, app, parameter

NO_OPTION = {
    "out_dir": "--out, declared by the command (the run directory, made absolute; its default is the command's)",
    "model_sha256": "set by the driver from the model's files (raycheck.orchestrator.api.check_job)",
    "data.sha256": "set by the driver from the data file",
    "run_id": "a new one per run (--resume keeps the saved one)",
    "writer_epoch": "set by the controller at each start",
    "namespace": "the Ray namespace; the Python API may set it",
    "faults.recovery_timeout_s": "the Python API and the tests may set it",
    "extra": "free-form, for the Python API",
}
"""``JobConfig`` fields (paths) that no ``Opt`` describes, and why."""


def run_options() -> dict[str, str]:
    """``raycheck run``'s options (``--shadow-env``) by parameter name."""
    command = typer.main.get_command(app).commands["run"]
    return {p.name: p.opts[0] for p in command.params}


def test_every_option_fills_one_field_or_is_the_commands_own_and_every_field_has_an_option_or_is_listed():
    options = run_options()
    described = {path: o for path in JobConfig.field_paths() if (o := option_of(field_spec(JobConfig, path))) is not None}
    assert set(described) == set(JobConfig.field_paths()) - set(NO_OPTION)
    assert {name: path for name, (path, _) in RUN_FIELDS.items()} == {o.parameter: path for path, o in described.items()}
    assert set(options) == set(RUN_FIELDS) | (set(HAND_SECTIONS) - {"help"})
    for name, (path, o) in RUN_FIELDS.items():  # the option's name is its Opt's, and the field's parameter is the option's
        assert options[name] == o.name and parameter(path) == name and o.section in SECTIONS, path
    assert len({o.name for o in described.values()}) == len(described)  # no option fills two fields


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
    assert JobConfig(out_dir="x", cache_dir="x").data.prompt_template == "Review: {text}\nSentiment:"


def test_run_help_lists_every_option_once_under_its_section():
    """``raycheck run --help`` groups its options (``cli.main.RUN_SECTIONS``): each option in exactly one
    section, none left out, and the options most runs set come first."""
    import typer.main

    from raycheck.cli.main import RUN_SECTIONS

    command = typer.main.get_command(app).commands["run"]
    listed = [name for names in RUN_SECTIONS.values() for name in names]
    assert sorted(listed) == sorted([p.name for p in command.params] + ["help"])
    for title, names in RUN_SECTIONS.items():  # each field's option under its Opt's section
        assert all(RUN_FIELDS[name][1].section == title for name in names if name in RUN_FIELDS), title
    text = CliRunner().invoke(app, ["run", "--help"]).output
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert headings == list(RUN_SECTIONS)
    assert text.index("--steps") < text.index("--fo-lr") and text.index("--fail ") < text.index("--fail-schedule")


@pytest.mark.parametrize(("uri", "error"), [
    ("file://", "'file://' names no folder: e.g. s3://BUCKET/PREFIX or file:///ABSOLUTE/PATH"),
    ("s3://", "'s3://' names no bucket: e.g. s3://BUCKET/PREFIX or file:///ABSOLUTE/PATH"),
    ("s3:/bucket/run", "'s3:/bucket/run' reads as a local folder named s3:; did you mean s3://bucket/run?"),
])
def test_a_storage_uri_that_names_nothing_or_lost_a_slash_is_refused_before_anything_is_written(uri, error):
    with pytest.raises(ValueError) as raised:
        storage_uri(uri)
    assert str(raised.value) == error
    assert storage_uri("s3://bucket/run") == "s3://bucket/run" and storage_uri("/tmp/x") == "/tmp/x"
