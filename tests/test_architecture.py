"""The core's import graph: no cycle, imports at the top, modules of a readable length.

Read from the source (pure AST, nothing imported), so it is fast and sees imports inside
functions too. An import is an edge from the importing module to the imported one; one under
``if TYPE_CHECKING:`` is not (it never runs). ``from autotune.study import records`` is an edge
to the submodule ``autotune.study.records``, and, because Python runs a package's
``__init__.py`` before any of its submodules, also to the package ``autotune.study`` when the
importer lies outside it. A cycle through a function-level import is a cycle too: it only
waits for the first call to break (or to be dodged by the import's place).
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO

CORE = REPO / "autotune"

# Imports inside functions, allowed only where the reason is not a cycle: the CLI's modules
# import the study machinery (optuna, SQLAlchemy, the runner: about as long again as the CLI's
# own import) only in the commands that use it, so that `autotune --help` and an estimate
# without --study start fast.
FUNCTION_LEVEL_ALLOWED = {"autotune.cli", "autotune.estimate"}

MAX_LINES = 600


@dataclass
class Graph:
    modules: dict[str, Path]
    edges: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> {imported: "file:line"}
    function_level: list[str] = field(default_factory=list)  # "file:line module -> imported"
    from_lazy_package: list[str] = field(default_factory=list)  # "file:line from PACKAGE import NAME"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _is_lazy_package(path: Path) -> bool:
    """A package whose names are loaded on first use (a module-level ``__getattr__``)."""
    tree = ast.parse(path.read_text())
    return path.name == "__init__.py" and any(
        isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body
    )


@functools.cache
def import_graph(root: Path, type_level: bool = False) -> Graph:
    """The import graph of the package at ``root`` (``autotune``), imports of other packages left out;
    with ``type_level``, the imports under ``TYPE_CHECKING`` too."""
    modules = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = Graph(modules, {m: {} for m in modules})
    lazy = {m for m, p in modules.items() if _is_lazy_package(p)}

    def resolve(name: str) -> str | None:
        while name not in modules:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = set() if type_level else _type_checking_nodes(tree)
        top = {id(n) for n in tree.body}
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = []
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    targets.append(sub if sub in modules else node.module)
                    if sub not in modules and node.module in lazy and not module.startswith(node.module + "."):
                        graph.from_lazy_package.append(f"{where}:{node.lineno} from {node.module} import {a.name}")
            else:
                continue
            targets = [t for t in targets if t.split(".")[0] == root.name]
            if targets and id(node) not in top:
                graph.function_level.append(f"{where}:{node.lineno} {module} -> {', '.join(targets)}")
            for target in targets:
                hit = resolve(target)
                if hit is None:
                    continue
                # The imported module, and each enclosing package whose __init__ runs first.
                reached = [hit] + [hit.rsplit(".", k)[0] for k in range(1, hit.count("."))]
                for other in reached:
                    if other != module and not module.startswith(other + "."):
                        graph.edges[module].setdefault(other, f"{where}:{node.lineno}")
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph.modules):
        if v not in index:
            visit(v)
    return found


def _describe(graph: Graph, component: list[str]) -> str:
    inside = set(component)
    lines = [" <-> ".join(component)]
    for a in component:
        for b, at in sorted(graph.edges[a].items()):
            if b in inside:
                lines.append(f"    {at}: {a} -> {b}")
    return "\n".join(lines)


def test_no_import_cycle_in_the_core():
    graph = import_graph(CORE)
    found = cycles(graph)
    assert not found, (
        "import cycles in autotune/ (move the shared piece to the module that owns it, or to a "
        "new small module; not into a function):\n" + "\n".join(_describe(graph, c) for c in found)
    )


def test_no_import_cycle_even_through_type_annotations():
    """A cycle held apart only by ``TYPE_CHECKING`` is still two modules that need each other:
    the shared type goes to a module below both (``study/prepared.py``)."""
    graph = import_graph(CORE, type_level=True)
    found = cycles(graph)
    assert not found, "type-level import cycles in autotune/:\n" + "\n".join(_describe(graph, c) for c in found)


def test_imports_are_at_the_top_except_where_the_cli_starts_fast():
    graph = import_graph(CORE)
    stray = [line for line in graph.function_level if line.split(" ")[1] not in FUNCTION_LEVEL_ALLOWED]
    assert not stray, "imports of autotune inside functions (move them to the top):\n" + "\n".join(stray)


def test_the_core_imports_a_lazy_package_s_names_from_their_modules():
    """``autotune.study`` loads its names on first use; a core module that imports one of them
    from the package hides its real dependency (on ``runner``, say) from the graph above."""
    graph = import_graph(CORE)
    assert not graph.from_lazy_package, "\n".join(graph.from_lazy_package)


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_the_lazy_package_s_names_are_where_it_loads_them_from():
    """Each name of ``autotune.study.__all__`` is defined in the module ``_HOME`` names for it."""
    init = CORE / "study" / "__init__.py"
    tree = ast.parse(init.read_text())
    values = {
        t.id: ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name) and t.id in ("__all__", "_HOME")
    }
    assert set(values["__all__"]) == set(values["_HOME"])
    misplaced = {
        name: home
        for name, home in values["_HOME"].items()
        if name not in _top_level_names(CORE / "study" / f"{home}.py")
    }
    assert not misplaced


def test_no_module_of_the_core_or_a_plugin_is_over_600_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in (*CORE.rglob("*.py"), *(REPO / "plugins").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


# The core names no engine (issue 25): an engine's name, its backends' and strategies' names and
# the weight-format families its plugin declares live in that plugin. Docstrings may name them
# (they explain), and so may ``__all__`` (the module's own names, such as ``read_gguf``).
# Prose may say what kind of file the core's model-source readers read (".gguf file", "EXL2
# model directory"), as it says "safetensors", but not name an engine; code may not compare
# with a family or a plugin's name, nor spell a format: ``"exl2"``, ``"twin"``, ``"gguf:"``.
ENGINE_NAMES = re.compile(r"llama[.\-_ ]?(cpp|server)|exllama|vllm|sglang|tabby", re.IGNORECASE)
FORMAT_SPEC = re.compile(r"\b(gguf|exl2):", re.IGNORECASE)
PLUGIN_NAME = re.compile(r"(gguf|exl2|twin)([-_.][\w.-]*)?", re.IGNORECASE)
# Help is documentation, as docstrings are (click shows a command's docstring beside it): an
# option's ``help=`` and these constants, (module, name), that are one.
HELP_CONSTANTS = {("autotune.estimate", "BACKEND_RULE")}  # the --backend help, with the estimate's rule


def engine_literals(root: Path) -> list[str]:
    """``file:line: 'literal'`` for each string literal of the package at ``root`` that names an
    engine, spells a format or is a family's or a plugin's name; docstrings, ``__all__`` and help
    left out."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = _module_name(path, root)
        skip: set[int] = set()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (
                isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
            ):
                skip.add(id(body[0].value))
            names = {t.id for t in getattr(node, "targets", ()) if isinstance(t, ast.Name)}
            if isinstance(node, ast.Assign) and ("__all__" in names or {(module, n) for n in names} & HELP_CONSTANTS):
                skip.update(id(n) for n in ast.walk(node.value))
            if isinstance(node, ast.keyword) and node.arg == "help":
                skip.update(id(n) for n in ast.walk(node.value))
        for node in sorted(ast.walk(tree), key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0))):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
                continue
            text = node.value
            if ENGINE_NAMES.search(text) or FORMAT_SPEC.search(text) or PLUGIN_NAME.fullmatch(text.strip()):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {text!r}")
    return found


def test_the_core_names_no_engine_outside_docstrings():
    assert not engine_literals(CORE), "\n".join(engine_literals(CORE))


def test_engine_literals_are_found_and_docstrings_are_not(tmp_path):
    root = _package(
        tmp_path,
        {
            "a.py": (
                '"""Reads llama.cpp\'s gguf:Q4_K_M."""\n__all__ = ["read_gguf"]\n'
                'def f(x):\n    """The twin\'s exl2:4.0."""\n'
                '    return x == "exl2" or x == "twin" or x.startswith("gguf:") or "a .gguf file" in x\n'
                'MSG = "start llama-server first"\nSAMPLER = "twin-llama.cpp"\nOK = "a digital twin of an EXL2 directory"\n'
                'option("--weights", help="gguf:<TYPE> or exl2:<bpw>")\n'
            )
        },
    )
    assert [line.split(": ", 1)[1] for line in engine_literals(root)] == [
        "'exl2'",
        "'twin'",
        "'gguf:'",
        "'start llama-server first'",
        "'twin-llama.cpp'",
    ]


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_graph_finds_a_cycle_held_apart_by_a_function_level_import(tmp_path):
    root = _package(
        tmp_path,
        {
            "a.py": "from pkg.b import g\n",
            "b.py": "def g():\n    from pkg import a\n",
            "c.py": "import pkg.a\nif TYPE_CHECKING:\n    from pkg.d import x\n",
            "d.py": "from pkg import c\n",
        },
    )
    graph = import_graph(root)
    assert cycles(graph) == [["pkg.a", "pkg.b"]]  # c <-> d only under TYPE_CHECKING
    assert graph.function_level == [f"{root / 'b.py'}:2 pkg.b -> pkg.a"]


def test_the_graph_finds_a_cycle_through_a_package_s_init(tmp_path):
    """Importing pkg.sub.records from outside runs pkg/sub/__init__.py, which imports runner,
    which imports the importer back: a cycle no single pair of modules shows."""
    root = _package(
        tmp_path,
        {
            "dashboard.py": "from pkg.sub.records import Record\n",
            "sub/__init__.py": "from pkg.sub.runner import Runner\n",
            "sub/records.py": "",
            "sub/runner.py": "from pkg.sub import records\nfrom pkg.dashboard import note\n",
        },
    )
    assert cycles(import_graph(root)) == [["pkg.dashboard", "pkg.sub", "pkg.sub.runner"]]
    lazy = _package(
        tmp_path / "lazy",
        {
            "dashboard.py": "from pkg.sub.records import Record\n",
            "sub/__init__.py": "def __getattr__(name):\n    pass\n",
            "sub/records.py": "",
            "sub/runner.py": "from pkg.sub import records\nfrom pkg.dashboard import note\nfrom pkg.sub import Runner\n",
        },
    )
    graph = import_graph(lazy)
    assert cycles(graph) == []
    assert graph.from_lazy_package == []  # inside the package itself: its own business


def test_one_plugin_loader_reads_the_entry_points():
    """Plugins are found in one place (``autotune/plugins.py``); an engine model of a plugin
    that is installed but not loaded (an allow-list, autoloading off under tests) is read
    through that registry too."""
    readers = sorted(str(p.relative_to(REPO)) for p in CORE.rglob("*.py") if "entry_points(" in p.read_text())
    assert readers == ["autotune/plugins.py"]
    from autotune import plugins

    assert {"llama.cpp", "exllamav2", "exllamav3"} <= set(plugins.installed_engine_models())
