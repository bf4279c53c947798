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


# The guide and the reference pages it sends readers to.
GUIDE_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The set-up commands new users and CI type: .ci/run runs the test command as the README writes it.
FIRST_STUDY = "pip install -e . && autotune study"
TEST_COMMAND = "pip install -e '.[test]' && autotune engine build llama.cpp --cpu --python && pytest -q"


def test_readme_keeps_the_set_up_commands_ci_runs():
    readme = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert FIRST_STUDY in readme and TEST_COMMAND in readme, "README.md: a set-up command changed"
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert TEST_COMMAND in ci, ".ci/run no longer runs the README's test command as written"


def test_readme_is_a_guide():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: the reference belongs in docs/"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _outside_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("page", GUIDE_PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    """Every relative link and image of the README and docs/ names a file of the repository,
    and every #anchor a heading of the page it points into."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _outside_code(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in {_anchor(h) for h in headings(file)}:
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: links to nothing: {', '.join(broken)}"


@pytest.mark.parametrize("study", sorted((REPO / "studies").glob("*.toml")), ids=lambda p: p.name)
def test_study_files_cite_files_that_exist(study):
    comments = "\n".join(
        line.split("#", 1)[1] for line in study.read_text(encoding="utf-8").splitlines() if "#" in line
    )
    cited = set(re.findall(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.-]+\.(?:md|toml|py))\b", comments))
    missing = sorted(c for c in cited if not (REPO / c).exists())
    assert not missing, f"{study.relative_to(REPO)} cites files that are not in the repository: {', '.join(missing)}"
