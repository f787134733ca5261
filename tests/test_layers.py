"""The layers' import direction (``docs/architecture.md``, "Layers"), checked without Ray: every import
of every module of the nine packages, at module level or inside a function (``TYPE_CHECKING`` blocks
included), read with ``ast``. A package is one layer: the order below is by folder alone, with no module
placed apart and no list of exceptions, and no module imports a layer above its own."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RANK = {"storage": 0, "policies": 0, "job": 1, "training": 2, "actors": 3, "workers": 4, "orchestrator": 5, "experiments": 6,
        "cli": 7}
"""Layer of each package (folder), lowest first; equal layers are peers. ``training`` is the algorithm core, the
actors use it, the workers use the actors' clients, the orchestrator starts both, the experiments drive the
orchestrator and the command line composes everything."""
PACKAGES = sorted(RANK)


def rank(module: str) -> int:
    """The layer of ``module``: that of its package; -1 for a module outside the packages (the standard
    library, third parties)."""
    return RANK.get(module.removeprefix("raycheck.").split(".")[0], -1)  # the installed name of each package (``raycheck/__init__.py``)


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


def upward(sources: dict[str, str]) -> set[tuple[str, str]]:
    """Every (importing module, imported module) pair of ``sources`` (module name -> its source) whose
    target sits in a higher layer than the importer."""
    return {(module, target) for module, source in sources.items() for target in imported(source)
            if rank(target) > rank(module)}


def package_sources() -> dict[str, str]:
    """Module name -> source of every module of the packages."""
    files = [file for package in PACKAGES for file in sorted((ROOT / package).rglob("*.py"))]
    return {".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): file.read_text()
            for file in files}


def test_the_parser_sees_imports_at_module_level_and_inside_functions():
    source = ("import os, storage.units\nfrom actors.shards import split_units\n"
              "def f():\n    from training.state import copy_state\n"
              "class C:\n    def g(self):\n        import orchestrator.cluster as c\n"
              "from . import sibling\n")
    assert imported(source) == {"os", "storage.units", "actors.shards", "training.state", "orchestrator.cluster"}


def test_a_module_takes_the_layer_of_its_folder():
    assert [rank(m) for m in ("storage.steplog", "policies.models", "job.config", "training.zo", "workers.worker_env",
                              "actors.shadow", "workers.worker", "orchestrator.controller", "experiments.harness",
                              "cli.replay", "raycheck.cli.main", "os", "ray.train")] == \
        [0, 0, 1, 2, 4, 3, 4, 5, 6, 7, 7, -1, -1]


def test_an_upward_import_is_found_even_inside_a_function():
    sources = {
        "job.config": "def f():\n    from training.data import PROMPT\n",       # job above training: no
        "training.zo": "from actors.shadow import ShadowSpec\n",               # training's core above actors: no
        "workers.recovery": "from actors.journal import RunChannel\n",          # workers above actors: no
        "actors.shadow": "import workers.faults\nfrom training.zo import noise\n",
        "orchestrator.controller": "from cli.main import app\nfrom orchestrator.cluster import connect\n",
        "cli.experiment": "from experiments.harness import PRESETS\n",
        "storage.snapshots": "from policies.interval import SnapshotSchedule\n",  # peers
    }
    assert upward(sources) == {("job.config", "training.data"), ("training.zo", "actors.shadow"),
                               ("actors.shadow", "workers.faults"), ("orchestrator.controller", "cli.main")}


def test_no_module_imports_a_layer_above_its_own():
    sources = package_sources()
    assert {"job.config", "workers.worker", "cli.main"} <= sources.keys()
    assert sorted(upward(sources)) == [], "an upward import: import downward (docs/architecture.md, Layers)"


def test_every_import_of_the_packages_goes_through_the_raycheck_namespace():
    """A bare ``import storage.x`` would load a second copy of the module beside ``raycheck.storage.x``
    (two ``SnapshotStore`` classes, two loggers), and installed it would not import at all. Checked in
    the packages, the tests, the example and the scripts (``scripts/device-check`` runs Python inline)."""
    files = [f for package in PACKAGES for f in sorted((ROOT / package).rglob("*.py"))]
    files += [*sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "examples").rglob("*.py")),
              *sorted((ROOT / "scripts").glob("*.py"))]
    bare = sorted(f"{f.relative_to(ROOT)}: {name}" for f in files for name in imported(f.read_text())
                  if name.split(".")[0] in PACKAGES)
    inline = re.compile(rf"\s*(from|import) ({'|'.join(PACKAGES)})\b")
    bare += [line.strip() for line in (ROOT / "scripts" / "device-check").read_text().splitlines() if inline.match(line)]
    assert bare == []
