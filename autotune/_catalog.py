"""Reading the catalogs shipped as package data (``autotune/data/*.toml``)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from importlib import resources
from typing import Any, Callable, TypeVar

import tomllib

from autotune.errors import ConfigError

T = TypeVar("T")


def read_catalog(
    filename: str, build: Callable[[str, Mapping[str, Any], str], T], skip: tuple[str, ...] = ()
) -> Mapping[str, T]:
    """Parse ``autotune/data/<filename>``: one table per key, each turned into a spec by ``build``;
    the tables named in ``skip`` are another reader's (:func:`read_table`).

    Raises:
        ConfigError: The shipped file is malformed (a packaging bug), naming the file.
    """
    where = f"autotune/data/{filename}"
    text = resources.files("autotune").joinpath("data", filename).read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return types.MappingProxyType({key: build(key, table, where) for key, table in data.items() if key not in skip})


def read_table(filename: str, name: str) -> tuple[Mapping[str, Any], str]:
    """One top-level table of ``autotune/data/<filename>`` (empty when absent), and where it is."""
    where = f"autotune/data/{filename}"
    text = resources.files("autotune").joinpath("data", filename).read_text(encoding="utf-8")
    try:
        return tomllib.loads(text).get(name, {}), where
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
