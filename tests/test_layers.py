"""The one-way dependency rule between gpipe_repro's packages (docs/design.md, "Layers").

Every import in every module, including the ones inside functions, is read from the source (not
executed), so a lazy import that reaches a later layer fails here too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpipe_repro"

# Which packages each package may import. `paper` is the paper's numbers as data: a leaf anyone reads.
ALLOWED: dict[str, set[str]] = {
    "engine": set(),
    "paper": set(),
    "data": set(),
    "models": {"engine"},
    "report": {"engine"},
    "distributed": {"engine", "report"},
    "sim": {"engine", "distributed", "models", "report"},
    "memory": {"engine", "sim", "models", "report", "paper"},
    "train": {"engine", "distributed", "sim", "memory", "models", "data", "report", "paper"},
    "repro": {"engine", "distributed", "sim", "memory", "models", "data", "report", "paper", "train"},
    "commands": {"engine", "distributed", "sim", "memory", "models", "data", "report", "paper", "train",
                 "repro"},
    "cli": {"commands"},
    "__init__": {"engine"},
}


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "gpipe_repro" else \
                [f"gpipe_repro.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in names]
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_rule() -> None:
    assert {_layer(p) for p in MODULES} <= set(ALLOWED), "a new package needs a line in ALLOWED"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_earlier_layers(path: Path) -> None:
    layer = _layer(path)
    bad = []
    for line, name in _imports(path):
        if name == "experiments" or name.startswith("experiments."):
            bad.append(f"line {line}: {name} (the library never imports experiments/)")
            continue
        if not name.startswith("gpipe_repro."):
            continue
        target = name.split(".")[1]
        if target in ALLOWED and target != layer and target not in ALLOWED[layer]:
            bad.append(f"line {line}: {name} ({layer} may import only {sorted(ALLOWED[layer])})")
    assert not bad, f"{path.relative_to(PACKAGE)} reaches a later layer:\n" + "\n".join(bad)


def test_engine_depends_on_torch_only() -> None:
    allowed_roots = {"torch", "gpipe_repro", "__future__"}
    import sys
    stdlib = set(sys.stdlib_module_names)
    for path in (PACKAGE / "engine").rglob("*.py"):
        for line, name in _imports(path):
            root = name.split(".")[0]
            assert root in allowed_roots | stdlib | {"numpy"}, f"{path.name}:{line} imports {name}"
