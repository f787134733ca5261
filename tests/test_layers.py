"""The layers' import direction (``docs/architecture.md``, "Layers"), checked without Ray: every import
of every module of the six packages, at module level or inside a function, read with ``ast``.

``storage`` and ``policies`` import no layer above them, and ``actors`` neither ``orchestrator`` nor
``experiments``. The imports that still go upward are listed one by one in ``ALLOWED_UPWARD`` (issue
11 holds the refactor that would remove them): a new one fails, and so does one that is gone but
still listed, so the list (and the page) stays the code's."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RANK = {"storage": 0, "policies": 0, "training": 1, "actors": 2, "orchestrator": 3, "experiments": 4}
"""Each package's layer, lowest first; ``storage`` and ``policies`` are peers."""

CLEAN = {"storage": {"training", "actors", "orchestrator", "experiments"},
         "policies": {"training", "actors", "orchestrator", "experiments"},
         "actors": {"orchestrator", "experiments"}}
"""package -> the packages above it that it never imports."""

ALLOWED_UPWARD = {
    ("orchestrator.experiment_cli", "experiments.harness"),
    ("orchestrator.experiment_cli", "experiments.report"),
    ("training.faults", "orchestrator.config"),
    ("training.faults", "orchestrator.journal"),
    ("training.faults", "orchestrator.shadow_keeper"),
    ("training.fo_worker", "orchestrator.config"),
    ("training.rank0_log", "actors.log_keeper"),
    ("training.recovery", "actors.log_keeper"),
    ("training.recovery", "actors.shards"),
    ("training.recovery", "orchestrator.config"),
    ("training.recovery", "orchestrator.journal"),
    ("training.recovery", "orchestrator.shadow_keeper"),
    ("training.worker", "actors.log_keeper"),
    ("training.worker", "actors.step_exchange"),
    ("training.worker_env", "orchestrator.config"),
    ("training.worker_env", "orchestrator.journal"),
}
"""(importing module, imported module): the upward imports left (``docs/architecture.md`` names them)."""


def imported(source: str) -> set[str]:
    """The absolute module names that ``source`` imports anywhere (module level, functions, classes);
    ``from a.b import c`` counts as ``a.b``. Relative imports are not counted (the packages use none)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def upward_imports() -> set[tuple[str, str]]:
    """Every (importing module, imported module) pair of the packages whose target is a higher layer."""
    edges = set()
    for package, rank in RANK.items():
        for file in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for target in imported(file.read_text()):
                if RANK.get(target.split(".")[0], -1) > rank:
                    edges.add((module, target))
    return edges


def test_the_parser_sees_imports_at_module_level_and_inside_functions():
    source = ("import os, storage.units\nfrom actors.shards import split_units\n"
              "def f():\n    from training.state import copy_state\n"
              "class C:\n    def g(self):\n        import orchestrator.cluster as c\n"
              "from . import sibling\n")
    assert imported(source) == {"os", "storage.units", "actors.shards", "training.state", "orchestrator.cluster"}


def test_storage_policies_and_actors_import_no_layer_they_sit_below():
    crossing = sorted((m, t) for m, t in upward_imports() if t.split(".")[0] in CLEAN.get(m.split(".")[0], set()))
    assert crossing == []


def test_the_upward_imports_left_are_exactly_the_listed_ones():
    found = upward_imports()
    assert sorted(found - ALLOWED_UPWARD) == [], "a new upward import: import downward (docs/architecture.md, Layers)"
    assert sorted(ALLOWED_UPWARD - found) == [], "an upward import is gone: delete it from ALLOWED_UPWARD and the docs"
