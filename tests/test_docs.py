"""The documentation site (issue 37): ``mkdocs build --strict`` passes (a broken link, a missing page or a
page outside the navigation fails it), and the generated reference pages (``docs/gen_reference.py``) are
what the code says now: the CLI's help and the configuration's fields, and every ``summary.json`` field
the code writes, no more and no fewer."""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import subprocess
import sys

from raycheck.orchestrator import summary
from raycheck.orchestrator.summary import SUMMARY_FIELDS, Collected, failed_summary, run_summary

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gen_reference():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_strictly(tmp_path):
    # not --quiet: it drops the warnings that --strict counts (a page missing from the nav passed then)
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    for page in ("index.html", "getting-started/index.html", "reference/cli/index.html", "reference/summary/index.html",
                 "results/experiment-full/report/index.html", "img/flow.svg"):
        assert (tmp_path / "site" / page).is_file(), page


def test_the_generated_reference_pages_match_the_code():
    gen = _gen_reference()
    for page, make in gen.PAGES.items():
        assert (ROOT / "docs" / page).read_text() == make(), f"docs/{page} is stale: run `make docs`"


def test_the_cli_reference_has_every_command_and_every_configuration_field():
    from raycheck.job.config import JobConfig

    text = (ROOT / "docs" / "reference" / "cli.md").read_text()
    for command in ("run", "policy", "inspect", "verify", "merge", "replay", "experiment"):
        assert f"## `raycheck {command}`" in text and f"Usage: raycheck {command} [OPTIONS]" in text, command
    for path in JobConfig.field_paths():
        assert f"| {path} |" in text, path


def _returned_keys(source: pathlib.Path, function: str) -> set[str]:
    """The string keys of the dict literal that ``function`` (a method or function in ``source``) returns."""
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            returns = [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict)]
            assert len(returns) == 1, function
            return {k.value for k in returns[0].keys if isinstance(k, ast.Constant)}
    raise LookupError(function)


def test_the_summary_reference_names_exactly_the_fields_the_code_writes():
    base = {k: None for k in _returned_keys(ROOT / "orchestrator" / "summary.py", "summary_base")}
    shadow = {k: None for k in _returned_keys(ROOT / "orchestrator" / "shadow_keeper.py", "finish")}
    assert {"phase", "config", "placement"} <= base.keys() and {"shadow_shards", "shadow_hashes"} <= shadow.keys()
    written = run_summary(Collected(ok=True, error=None, events=[], executions=[], rows=[], shadow=shadow, persisted={},
                                    mirror={}, keeper={}, durability_level="node", task="classification", base=base))
    assert sorted(written) == sorted(SUMMARY_FIELDS)
    assert set(failed_summary("ValueError: x", None, base)) <= set(SUMMARY_FIELDS)
    assert all(doc.strip() for doc in SUMMARY_FIELDS.values())


def test_the_summary_page_carries_the_breakdown_components():
    text = (ROOT / "docs" / "reference" / "summary.md").read_text()
    for _, component in summary.BREAKDOWN + summary.STANDBY_BREAKDOWN:
        assert f"``{component}``" in text, component
    for column in summary.METRIC_COLUMNS:
        assert f"`{column}`" in text, column


def test_the_readme_is_a_short_guide_that_links_into_the_site():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250  # issue 37: a guide; the reference is the site
    assert "![" in text and (ROOT / "docs" / "img" / "flow.svg").is_file()
    for page in ("how-to/own-model.md", "how-to/cluster.md", "how-to/resume.md", "how-to/inspect-verify.md",
                 "how-to/experiments.md", "performance.md", "reference/cli.md", "reference/summary.md"):
        assert f"](docs/{page})" in text, page
