"""Every reference in the repository resolves: the modules and names (a dotted name in backquotes that
starts with one of our packages), files (a path with a suffix; a Markdown heading after ``#``, a test
after ``::``; ``ray/`` paths in the installed Ray) that docstrings, comments, the README and ``docs/``
name exist, so a newcomer can follow each one (issue 11: the repository stands alone). Placeholders
(``OUT/summary.json``: a first segment in capitals) and globs (``storage.snapshots.*``) are not references."""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest
import ray

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("storage", "policies", "job", "training", "actors", "orchestrator", "experiments")
RAY = pathlib.Path(ray.__file__).parent
REF = re.compile(r"``([^`\s]+)``|`([^`\s]+)`|\]\(((?!https?:)[^)\s]+)\)")
"""A reference in double or single backquotes, or a Markdown link's relative target."""
PATH = re.compile(r"(?:[\w.-]+/)+[\w.-]+\.(?:py|md|json|sh|toml|txt)(?:#[\w-]+|::\w+)?")


@functools.cache
def names_in(module: str) -> frozenset[str]:
    """Top-level names of a repository module, and ``Class.member`` for its classes' members."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            for member in node.body if isinstance(node, ast.ClassDef) else ():
                names |= {f"{node.name}.{n}" for n in _assigned(member)}
        names |= _assigned(node)
    return frozenset(names)


def _assigned(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def unresolved(ref: str) -> str | None:
    """Why ``ref`` does not resolve, or None (also for text that is not a reference)."""
    if re.match(r"[A-Z_]+/", ref) or ref.endswith("*"):
        return None
    return unresolved_path(ref) if PATH.fullmatch(ref) else unresolved_name(ref)


def unresolved_path(ref: str) -> str | None:
    path, sep, anchor = ref.partition("#") if "#" in ref else ref.partition("::")
    base = RAY.parent if path.startswith("ray/") else ROOT
    file = base / path
    if not file.is_file():
        return f"no file {path}"
    if sep == "#" and file.suffix == ".md":
        headings = {slug(line.lstrip("#")) for line in file.read_text().splitlines() if line.startswith("#")}
        return None if anchor in headings else f"no heading #{anchor} in {path}"
    if sep == "::" and anchor not in names_in(path.removesuffix(".py").replace("/", ".")):
        return f"no {anchor} in {path}"
    return None


def unresolved_name(ref: str) -> str | None:
    parts = ref.rstrip("()").split("(")[0].split(".")
    if parts[0] not in PACKAGES or len(parts) < 2:
        return None
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if (ROOT / (module.replace(".", "/") + ".py")).is_file():
            rest, names = ".".join(parts[i:]), names_in(module)
            first = parts[i] if rest else ""  # an attribute of a module-level object that is not a class: not checked
            ok = not rest or rest in names or first in names and not any(n.startswith(first + ".") for n in names)
            return None if ok else f"no {rest} in {module}"
    return f"no module {'.'.join(parts[:2])}"


def sources() -> list[pathlib.Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).glob("*.py"))]
    return files + sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py")) + [
        ROOT / "README.md", ROOT / "mkdocs.yml", *sorted((ROOT / "docs").rglob("*.py")), *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_module_name_and_file_that_the_repository_names_exists():
    bad = []
    for file in sources():
        for match in REF.finditer(file.read_text()):
            ref = next(g for g in match.groups() if g)
            if match.group(3) and file.suffix != ".md":  # Markdown that code writes elsewhere (the experiment report)
                continue
            if match.group(3):  # a link, relative to the Markdown file's folder ("#anchor" alone: the file itself)
                target, sep, anchor = ref.partition("#")
                path = (file.parent / target).resolve() if target else file
                ref = str(path.relative_to(ROOT)) + sep + anchor
                why = None if path.is_dir() else unresolved_path(ref)
            else:
                why = unresolved(ref)
            if why:
                bad.append(f"{file.relative_to(ROOT)}: {ref}: {why}")
    assert bad == []


@pytest.mark.parametrize("ref, why", [
    ("training.zo.no_such_function", "no no_such_function in training.zo"),
    ("training.nowhere.f", "no module training.nowhere"),
    ("docs/nowhere.md", "no file docs/nowhere.md"),
    ("docs/recovery.md#no-such-heading", "no heading #no-such-heading in docs/recovery.md"),
    ("tests/test_policies.py::test_no_such_test", "no test_no_such_test in tests/test_policies.py"),
    ("ray/train/no_such_file.py", "no file ray/train/no_such_file.py"),
])
def test_a_reference_that_does_not_resolve_is_named_with_why(ref, why):
    assert unresolved(ref) == why


def test_references_that_resolve():
    for ref in ("training.zo.replay_step_", "policies.costs.MeasuredCosts.mtbf_s", "docs/recovery.md",
                "tests/test_policies.py::test_job_mtbf_from_accelerators", "ray/train/v2/torch/torchft_config.py",
                "OUT/summary.json", "storage.snapshots.*"):
        assert unresolved(ref) is None, ref
