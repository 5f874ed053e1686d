"""The folder tree is the architecture: layers import only downwards, modules stay small, and
docs/architecture.md names every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sparkdist"
DOC = PACKAGE.parent / "docs" / "architecture.md"
#: Lowest first: a layer imports only the layers before it (front doors import anything).
LAYERS = ["_core", "_shipping", "_wire", "_node", "_backends", "_tracking", "_engine",
          "_doctor", "_lab", "_frontdoors"]
#: Modules allowed past ~400 lines, each with the reason.
LONG_MODULES = {
    "_wire/channel.py": "the server's single I/O loop; splitting it spreads one state machine",
    "_core/run_state.py": "events, decisions and the machine read together",
    "_core/config.py": "the option table and the one LaunchConfig",
    "decorator.py": "public API with long docstrings and examples",
    "runtime.py": "public API with long docstrings and examples",
    "pytest_plugin.py": "pytest hooks and fixtures with their help texts",
    "_tracking/mlflow_run.py": "the MLflow run's life on its own thread",
    "_wire/client.py": "the agent's I/O loop",
    "_wire/protocol.py": "every kind's field table beside the one codec that reads it",
    # To split next (issue 26's doctor work landed at the end of a session): the barrier task's
    # probes and the driver's listener can be two modules.
    "_doctor/network_probe.py": "the network preflight's barrier job, both of its ends",
    # Next: the /proc scans (processes, host files) into a module of their own.
    "_lab/holder.py": "the lab's request table: every operation beside the one server",
}
MAX_LINES = 400


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def imported_layers(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "sparkdist" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_layer_imports_only_the_layers_below_it(path: Path) -> None:
    rel = path.relative_to(PACKAGE)
    if len(rel.parts) == 1:
        return  # a front door
    layer = LAYERS.index(rel.parts[0])
    for target in imported_layers(path):
        assert target in LAYERS[: layer + 1], f"{rel} imports sparkdist.{target}"


def test_every_module_is_named_in_the_architecture_doc() -> None:
    text = DOC.read_text()
    missing = []
    for path in modules():
        rel = path.relative_to(PACKAGE)
        # Named by its file name in its layer's section (e.g. `plan.py`, `_doctor/spark.py`).
        if not re.search(rf"`(?:{re.escape(rel.parent.as_posix())}/)?{re.escape(path.name)}`", text):
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
