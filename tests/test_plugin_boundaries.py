"""The boundaries issue 38 drew, kept: no plugin imports another (what two share is in
plugins/shared/), plugins import the core through autotune.api and the engine-process toolkit
only, and the core's modules import one another without a cycle at module (type) level."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "plugins"
CORE = REPO / "autotune"
# What a plugin may import of the core: the curated API, and the built-in plugins' own surface.
ALLOWED_CORE = {"autotune.api", "autotune._builtin"}


def _imports(path: Path, package: str, module_level_only: bool = False) -> list[str]:
    """The absolute module names ``path`` imports (``from X import name`` counts X and X.name)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes: list[ast.AST] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        for child in ast.iter_child_nodes(node):
            if not (module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))):
                stack.append(child)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.append(base)
            out += [f"{base}.{a.name}" for a in node.names]
    return out


def _plugin_files():
    for path in sorted(PLUGINS.rglob("*.py")):
        rel = path.relative_to(PLUGINS)
        if len(rel.parts) > 1:
            yield rel.parts[0], path, "autotune_plugins." + ".".join(rel.parts[:-1])


def test_no_plugin_imports_another():
    crossing = sorted(
        f"{path.relative_to(REPO)}: {name}"
        for owner, path, package in _plugin_files()
        for name in _imports(path, package)
        if name.startswith("autotune_plugins.") and name.split(".")[1] not in (owner, "shared")
    )
    assert crossing == []


def test_plugins_import_the_core_through_its_api():
    modules = {p.stem for p in CORE.glob("*.py")} | {p.name for p in CORE.iterdir() if p.is_dir()}
    used = set()
    for _, path, package in _plugin_files():
        for name in _imports(path, package):
            parts = name.split(".")
            if parts[0] == "autotune" and len(parts) > 1 and parts[1] in modules:
                sub = ".".join(parts[:3])
                used.add(
                    sub
                    if (CORE / parts[1]).is_dir() and (CORE / parts[1] / f"{parts[2]}.py").exists()
                    else ".".join(parts[:2])
                )
    assert used - ALLOWED_CORE == set()


def test_the_core_has_no_import_cycle_at_module_level():
    modules = {p.stem: p for p in CORE.glob("*.py")}
    graph = {
        m: {
            n.split(".")[1]
            for n in _imports(p, "autotune", module_level_only=True)
            if n.startswith("autotune.") and n.split(".")[1] in modules
        }
        - {m}
        for m, p in modules.items()
    }

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False

    assert sorted(m for m in graph if reaches(m, m, set())) == []
