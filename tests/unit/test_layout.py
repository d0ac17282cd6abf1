"""The house rules of the layout (docs/architecture.md), checked on the code's own imports.

Every product module states its job in a docstring and is listed in docs/architecture.md; no file
is over 700 lines; the kernel imports no application; stages never import each other; nothing
imports the tests; no private name crosses modules; no two modules import each other, however
indirectly (imports inside functions count).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("flywheel", "serving", "ingest", "rewards", "trainer", "launch", "demo", "chaos", "bench", "testbed")
STAGES = ("serving", "ingest", "rewards", "trainer")
#: What each top-level package may import, besides itself.
ALLOWED = {
    "flywheel": set(),
    **{stage: {"flywheel"} for stage in STAGES},
    "testbed": {"flywheel"},
    "launch": {"flywheel"},  # roles and commands by name only (launch/cli.py's tables)
    "demo": {"flywheel", "launch"},
    "chaos": {"flywheel", *STAGES, "launch", "demo", "testbed"},  # invariants reuse pure stage code
    "bench": {"flywheel", *STAGES, "launch", "demo", "testbed"},
}
MAX_LINES = 700


def product_files() -> list[Path]:
    files = []
    for package in PACKAGES:
        files += [p for p in sorted((ROOT / package).rglob("*.py")) if "versions" not in p.relative_to(ROOT).parts]
    return files


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in product_files()}


def resolve(name: str) -> str | None:
    """The product module ``name`` is, or lives in (``a.b.c`` may be the name ``c`` of module ``a.b``)."""
    while name:
        if name in modules():
            return name
        name = name.rpartition(".")[0]
    return None


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module, names taken from it, line)`` for every import statement of the file, anywhere in it."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [alias.name for alias in node.names], node.lineno))
    return out


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules()}
    for name, path in modules().items():
        for target, names, _ in imports(path):
            for full in [f"{target}.{n}" for n in names] or [target]:
                found = resolve(full)
                if found and found != name:
                    graph[name].add(found)
    return graph


def test_every_module_states_its_job_and_is_on_the_map() -> None:
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    missing_doc = [str(p.relative_to(ROOT)) for p in product_files()
                   if p.read_text().strip() and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing_doc, f"modules without a docstring stating their job: {missing_doc}"
    off_map = [str(p.relative_to(ROOT)) for p in product_files()
               if p.read_text().strip() and f"`{p.relative_to(ROOT)}`" not in architecture]
    assert not off_map, f"modules missing from docs/architecture.md's map: {off_map}"


def test_no_file_is_a_hall() -> None:
    big = {str(p.relative_to(ROOT)): n for p in product_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"over {MAX_LINES} lines: split by job first: {big}"


def test_packages_import_only_what_is_below_them() -> None:
    wrong = []
    for name, path in modules().items():
        home = name.split(".")[0]
        for target, _, line in imports(path):
            top = target.split(".")[0]
            if top == "tests" or (top in PACKAGES and top != home and top not in ALLOWED[home]):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "imports against the layout (docs/architecture.md):\n" + "\n".join(wrong)


def test_no_private_name_crosses_modules() -> None:
    wrong = []
    for name, path in modules().items():
        for target, names, line in imports(path):
            if resolve(target) not in (None, name):
                wrong += [f"{path.relative_to(ROOT)}:{line} imports {target}.{n}" for n in names
                          if n.startswith("_") and not n.startswith("__")]
    assert not wrong, "private names used across modules:\n" + "\n".join(wrong)


def test_no_import_loops() -> None:
    graph, loops = edges(), []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not loops, f"modules that import each other: {loops}"
