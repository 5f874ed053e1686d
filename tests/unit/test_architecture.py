"""The folder tree is the architecture: layers import only downwards, no module imports itself
back, modules stay small, and docs/architecture.md names every module."""

from __future__ import annotations

import ast
import re
from collections import deque
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sparkdist"
DOC = PACKAGE.parent / "docs" / "architecture.md"
#: Lowest first: a layer imports only the layers before it (front doors import anything).
LAYERS = [
    "_core",
    "_shipping",
    "_wire",
    "_checkpoint",
    "_node",
    "_backends",
    "_tracking",
    "_engine",
    "_doctor",
    "_lab",
    "_frontdoors",
]
#: Modules allowed past ~400 lines, each with the reason.
LONG_MODULES = {
    "_core/run/run_state.py": "events, decisions and the machine read together",
    "_core/launch/config.py": "the option table and the one LaunchConfig",
    "decorator.py": "public API with long docstrings and examples",
    "runtime.py": "public API with long docstrings and examples",
    "pytest_plugin.py": "pytest hooks and fixtures with their help texts",
    "_tracking/mlflow_run.py": "the MLflow run's life on its own thread",
    "_wire/channel/client.py": "the agent's I/O loop",
    "_wire/protocol.py": "every kind's field table beside the one codec that reads it",
    # Next: the /proc scans (processes, host files) into a module of their own.
    "_lab/holder.py": "the lab's request table: every operation beside the one server",
}
MAX_LINES = 400


#: ``_node``'s rooms, lowest first: a room imports only the rooms before it (the agent never
#: imports the rank: it knows the rank's entry point and file contract, ``_core.run_dir``).
NODE_ROOMS = ["host", "rank", "pool", "agent"]
NODE_ROOMS_APART = {("agent", "rank")}
#: What each layer may import when that is narrower than "every layer below it".
NARROWER = {"_checkpoint": {"_core", "_checkpoint"}}


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def sparkdist_names(path: Path) -> set[str]:
    """Every ``sparkdist...`` name the module imports (``from a import b`` gives ``a`` and
    ``a.b``), at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found.update(name for name in names if name.startswith("sparkdist."))
    return found


def imported_layers(path: Path) -> set[str]:
    return {name.split(".")[1] for name in sparkdist_names(path)}


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_layer_imports_only_the_layers_below_it(path: Path) -> None:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        return  # a front door
    layer = LAYERS.index(rel.parts[0])
    allowed = NARROWER.get(rel.parts[0], set(LAYERS[: layer + 1]))
    for target in imported_layers(path):
        assert target in allowed, f"{rel} imports sparkdist.{target}"
    if rel.parts[0] == "_node" and len(rel.parts) > 2:
        room = NODE_ROOMS.index(rel.parts[1])
        for name in sparkdist_names(path):
            parts = name.split(".")
            if parts[1] == "_node" and len(parts) > 2 and parts[2] in NODE_ROOMS:
                assert NODE_ROOMS.index(parts[2]) <= room, f"{rel} imports {name}"
                assert (rel.parts[1], parts[2]) not in NODE_ROOMS_APART, f"{rel} imports {name}"


def test_every_module_is_named_in_the_architecture_doc() -> None:
    text = DOC.read_text()
    missing = []
    for path in modules():
        rel = path.relative_to(PACKAGE)
        # Named by its file name in its layer's section (e.g. `plan.py`, `_doctor/spark.py`).
        if not re.search(
            rf"`(?:{re.escape(rel.parent.as_posix())}/)?{re.escape(path.name)}`", text
        ):
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_modules_stay_small() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    unexpected = {name: n for name, n in long.items() if name not in LONG_MODULES}
    assert not unexpected, f"modules over {MAX_LINES} lines: {unexpected}"


def module_name(path: Path) -> str:
    """``sparkdist/_core/env.py`` -> ``sparkdist._core.env``; a package is its folder."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``: a body that never runs."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_statements(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Every import in ``body`` that can run, at any depth (functions, classes, ``try``,
    ``with``), except the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs, so it counts)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            found += import_statements(node.orelse)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    found += import_statements([child])
                elif isinstance(child, (ast.ExceptHandler, ast.match_case)):
                    found += import_statements(child.body)
    return found


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports at run time: ``from a.b import c`` names
    the module ``a.b.c`` where it is one, else ``a.b``; relative imports are resolved."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in import_statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # `from . import x`, `from ..y import z`
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        found |= {target for target in targets if target in known and target != this}
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules (Tarjan's
    algorithm), the shortest one through the group's first module by name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [shortest_cycle(graph, group, min(group)) for group in groups]


def shortest_cycle(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """Breadth first from ``start`` within ``group`` until an import leads back to it."""
    parents: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph[node] & group):
            if target == start:
                path = [node]
                while (parent := parents[path[-1]]) is not None:
                    path.append(parent)
                return [*reversed(path), start]
            if target not in parents:
                parents[target] = node
                queue.append(target)
    raise AssertionError(f"{sorted(group)} is strongly connected, so it has a cycle")


def test_no_module_imports_itself_back() -> None:
    """No run-time import cycle between modules of sparkdist: imports run one way, so no module
    is ever seen half-initialised and each name has one home.

    Counted: every import that can run, at module level, in class bodies and in functions.
    Function-level (lazy) imports count too: they defer a cost (torch, pyspark: DESIGN.md rule
    5), not a dependency, and a cycle closed by one is still two modules that need each other
    (it would break the day the lazy import moves to the top). Not counted: the bodies of
    ``if TYPE_CHECKING:`` (they never run) and dynamic imports (``importlib``: the package's
    lazy ``__getattr__``), which ``ast`` cannot see. Only explicit imports are edges: importing
    ``a.b.c`` also runs ``a/__init__.py``, but the package ``__init__`` files import nothing at
    run time, so that implicit edge closes no cycle.
    """
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: imported_modules(path, set(paths)) for name, path in paths.items()}
    cycles = [" -> ".join(cycle) for cycle in import_cycles(graph)]
    assert not cycles, "import cycles (give each name one home):\n" + "\n".join(cycles)


def test_the_cycle_finder_names_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]  # a self-import is not a cycle here
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_imports_under_type_checking_do_not_count_and_lazy_ones_do() -> None:
    source = (
        "import a\n"
        "if TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
        "if typing.TYPE_CHECKING:\n    import d\n"
        "try:\n    import e\nexcept ImportError:\n    import f\n"
        "class C:\n    import g\n"
        "def later():\n    with x:\n        from h import i\n"
    )
    statements = import_statements(ast.parse(source).body)
    named = [n.names[0].name if isinstance(n, ast.Import) else n.module for n in statements]
    assert sorted(named) == ["a", "c", "e", "f", "g", "h"]
