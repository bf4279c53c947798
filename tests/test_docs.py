"""The documentation keeps up with the code: every hook is documented with its signature."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from autotune import hookspecs

REPO = Path(__file__).resolve().parents[1]
PLUGINS_DOC = REPO / "docs" / "plugins.md"


def hookspecs_by_name() -> dict[str, object]:
    return {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, "autotune_spec")}


def signature(fn) -> str:
    """``register_backends(register)``: the hook's name and its argument names."""
    return f"{fn.__name__}({', '.join(inspect.signature(fn).parameters)})"


def headings(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


@pytest.mark.parametrize("name", sorted(hookspecs_by_name()))
def test_hook_documented_with_its_signature(name):
    wanted = signature(hookspecs_by_name()[name])
    assert any(wanted in h for h in headings(PLUGINS_DOC)), f"{PLUGINS_DOC}: no heading with `{wanted}`"


def test_there_are_hooks_to_document():
    assert hookspecs_by_name()


def test_plugin_environment_variables_documented():
    source = (REPO / "autotune" / "plugins.py").read_text(encoding="utf-8")
    names = set(re.findall(r"AUTOTUNE_[A-Z_]+", source))
    assert {"AUTOTUNE_LOAD_PLUGINS", "AUTOTUNE_TRACE_PLUGINS"} <= names
    doc = PLUGINS_DOC.read_text(encoding="utf-8")
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"{PLUGINS_DOC}: undocumented environment variables: {', '.join(missing)}"


def test_paths_named_in_plugin_docs_exist():
    doc = PLUGINS_DOC.read_text(encoding="utf-8")
    paths = set(re.findall(r"`((?:autotune|plugins|examples|tests|docs|studies)/[\w./-]*)`", doc))
    assert paths, "the plugin docs name no files of the repository"
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"{PLUGINS_DOC} names files that do not exist: {', '.join(missing)}"


def test_readme_mentions_autotune_study():
    readme = REPO / "README.md"
    if not readme.exists():
        pytest.skip("README.md does not exist yet")
    assert "autotune study" in readme.read_text(encoding="utf-8")
