"""The package's imports run one way: no circle inside `eagle_engine/` (every import counts:
at the top, inside a function, or under TYPE_CHECKING), the engine core imports nothing from
its tools (`eagle_engine/tools/`), its training (`eagle_engine/train/`) or the app
(`playground/`, `app.py`), and training nothing from the tools or the app."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "eagle_engine"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The `eagle_engine` modules (and `playground`, `app`) that `path` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from . import x`
    return {m for m in found if m.split(".")[0] in ("eagle_engine", "playground", "app")}


def graph(paths: list[Path]) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in paths}
    return {name: {m for m in imports_of(path) if m in modules and m != name}
                   - {"eagle_engine"} for name, path in modules.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of `edges`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None
    for start in sorted(edges):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_import_circle_in_the_package() -> None:
    assert cycle(graph(sorted(PACKAGE.rglob("*.py")))) is None


def test_the_check_finds_a_circle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_core_imports_no_tool_training_or_app_module() -> None:
    above = ("eagle_engine.tools", "eagle_engine.train", "playground", "app")
    core = [p for p in PACKAGE.rglob("*.py")  # `python -m eagle_engine` runs the command line
            if not module_name(p).startswith(("eagle_engine.tools", "eagle_engine.train",
                                              "eagle_engine.__main__"))]
    wrong = {module_name(p): sorted(m for m in imports_of(p) if m.startswith(above))
             for p in core}
    assert {k: v for k, v in wrong.items() if v} == {}


def test_training_imports_no_tool_or_app_module() -> None:
    wrong = {module_name(p): sorted(m for m in imports_of(p) if m.startswith(
        ("eagle_engine.tools", "playground", "app"))) for p in (PACKAGE / "train").rglob("*.py")}
    assert {k: v for k, v in wrong.items() if v} == {}


def test_imports_of_resolves_relative_imports() -> None:
    scheduler = PACKAGE / "scheduler.py"
    assert {"eagle_engine.run", "eagle_engine.parts"} <= imports_of(scheduler)
    assert "eagle_engine.engine" not in imports_of(scheduler)
