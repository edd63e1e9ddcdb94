"""House rules of the code's shape, checked on the source: no module imports one that imports it back (function-level
imports included: a circle hidden inside a function is still a circle), every sub-package imports only those below it
in the import order that docs/architecture.md shows, ``checkpointing`` and ``training`` never import Prefect, and
``make lint`` type-checks every product package."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ["checkpointing", "training", "flows", "tasks", "deployments", "recipes"]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ORDER_HEADING = "## The import order"


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The product modules ``path`` imports anywhere (not under ``if TYPE_CHECKING``)."""

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}  # fmt: skip
    found: set[str | None] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {resolve(f"{node.module}.{a.name}") for a in node.names}
    return {m for m in found if m is not None}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    assert circles(graph) == []


def unit_of(module: str) -> str:
    """The unit of the import order that ``module`` belongs to: a sub-package of ``training`` or ``checkpointing``
    (``training.unit.loop`` -> ``training.unit``), a top-level module of theirs as itself (``checkpointing.store``),
    and for the other packages the package (``flows.cli`` -> ``flows``)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in ("training", "checkpointing") else parts[0]


def unit_imports() -> dict[str, set[str]]:
    """Every unit, with the other units its modules import."""
    known = modules()
    graph: dict[str, set[str]] = {unit_of(name): set() for name in known}
    for name, path in known.items():
        graph[unit_of(name)] |= {unit_of(m) for m in imports(path, known)} - {unit_of(name)}
    return graph


def documented_order() -> list[str]:
    """The numbered list under docs/architecture.md's import-order heading, bottom to top: one unit per item."""
    section = ARCHITECTURE.read_text().partition(f"\n{ORDER_HEADING}\n")[2].partition("\n## ")[0]
    return re.findall(r"^\d+\. `([\w.]+)`", section, flags=re.MULTILINE)


def test_no_sub_package_imports_one_that_imports_it_back():
    assert circles(unit_imports()) == []


def test_every_unit_imports_only_units_below_it_in_the_documented_order():
    graph, order = unit_imports(), documented_order()
    assert len(order) == len(set(order)), f"{ARCHITECTURE.name} lists a unit twice: {order}"
    assert not set(graph) - set(order), f"place {sorted(set(graph) - set(order))} in {ARCHITECTURE.name}'s order"
    assert not set(order) - set(graph), f"{ARCHITECTURE.name} lists {sorted(set(order) - set(graph))}: no such unit"
    floor = {unit: i for i, unit in enumerate(order)}
    upward = sorted(f"{u} -> {v}" for u, targets in graph.items() for v in targets if floor[v] > floor[u])
    assert upward == [], f"imports that point up {ARCHITECTURE.name}'s order: {upward}"


def test_the_circle_finder_finds_a_circle_hidden_in_a_function():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_checkpointing_and_training_never_import_prefect():
    for name, path in modules().items():
        if name.split(".")[0] in ("checkpointing", "training"):
            tree = ast.parse(path.read_text())
            names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
            assert not [n for n in names if n.split(".")[0] == "prefect"], name


def test_lint_type_checks_every_product_package():
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert set(PACKAGES) <= set(mypy["files"]) and "pydantic.mypy" in mypy["plugins"]


def test_the_weights_readers_are_public_on_the_package_and_load_torch_only_when_used():
    import subprocess
    import sys

    code = ("import sys, checkpointing; assert 'torch' not in sys.modules; "
            "from checkpointing import read_weights, is_weights_file; "
            "print(read_weights.__name__, is_weights_file.__name__, 'torch' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["read_weights", "is_weights_file", "True"], done.stderr
