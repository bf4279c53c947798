"""Reading a TOML document field by field: every problem at once, each naming the file, the table,
the field, the value given and what would be accepted (the study file's reader, ``config.py``)."""

from __future__ import annotations

import math
import tomllib
from typing import Any, Callable, Mapping

from autotune.errors import ConfigError


class FieldReader:
    """Reads fields of a TOML document, collecting errors instead of stopping at the first."""

    def __init__(self, source: str, doc: Mapping[str, Any]):
        self.source = source
        self.doc = doc
        self.errors: list[str] = []
        # TOML reads inf and nan as numbers and no field means either: each one that got
        # through was a traceback or a silent wrong result far from the file. All of them, in
        # every table (those read below and those a backend reads later), are reported here
        # once; ``get`` then skips them.
        self.not_finite: set[tuple[str, str]] = set()
        self._find_not_finite("", doc)

    def _find_not_finite(self, section: str, table: Mapping[str, Any]) -> None:
        for key, value in table.items():
            inner = f"{section}.{key}" if section else key
            if isinstance(value, dict):
                self._find_not_finite(inner, value)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                for i, each in enumerate(value):
                    self._find_not_finite(f"{inner}.{i}", each)
            elif _not_finite(value):
                self.not_finite.add((section, key))
                self.error(section, key, value, "must be a finite number (inf and nan are not accepted)")

    def error(self, section: str, key: str, value: Any, message: str) -> None:
        where = f"[{section}] {key}" if section else key
        shown = "(missing)" if value is MISSING else show(value)
        self.errors.append(f"{self.source}: {where} = {shown}: {message}")

    def table(self, name: str, required: bool = False) -> Mapping[str, Any]:
        value = self.doc.get(name, MISSING)
        if value is MISSING:
            if required:
                self.errors.append(f"{self.source}: [{name}] is missing: this table is required")
            return {}
        if not isinstance(value, dict):
            self.errors.append(f"{self.source}: {name} must be a table ([{name}]), got {show(value)}")
            return {}
        return value

    def get(
        self,
        section: str,
        table: Mapping[str, Any],
        key: str,
        kind: type | tuple[type, ...],
        default: Any = None,
        *,
        required: bool = False,
        check: Callable[[Any], str | None] | None = None,
        accepted: str = "",
    ) -> Any:
        value = table.get(key, MISSING)
        if (section, key) in self.not_finite:
            return default
        if value is MISSING:
            if required:
                self.error(section, key, value, f"required{'; ' + accepted if accepted else ''}")
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            names = type_names(kinds)
            self.error(section, key, value, f"must be {names}{'; ' + accepted if accepted else ''}")
            return default
        if check:
            problem = check(value)
            if problem:
                self.error(section, key, value, problem)
                return default
        return value

    def unknown_keys(self, section: str, table: Mapping[str, Any], known: set[str]) -> None:
        for key in table:
            if key not in known:
                self.errors.append(
                    f"{self.source}: [{section}] {key}: unknown field (known: {', '.join(sorted(known))})"
                )


class _Missing:
    def __repr__(self) -> str:  # pragma: no cover
        return "(missing)"


MISSING: Any = _Missing()
_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    list: "a list",
    dict: "a table",
}


def type_names(kinds: tuple[type, ...]) -> str:
    """The accepted Python types in the words of a TOML file ("an integer", "a table")."""
    if float in kinds:  # an int is a number too
        kinds = tuple(k for k in kinds if k is not int)
    return " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)


def _not_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, list) and any(_not_finite(v) for v in value)


def show_long(text: str) -> str:
    """A typed value quoted, cut where it is longer than a line."""
    return repr(text) if len(text) <= 60 else f"{text[:40]!r}... ({len(text)} characters)"


def show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def at_least(n: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= n else f"must be >= {n}"


def between(low: int, high: int) -> Callable[[Any], str | None]:
    return lambda v: None if low <= v <= high else f"must be {low}..{high}"


def one_of(options: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda v: None if v in options else f"must be one of {', '.join(options)}"


def settings_given(given: tuple[str, ...]) -> dict[str, object]:
    """``--setting NAME=VALUE`` as a [backends.NAME] table: VALUE read as TOML (``true``, ``4``,
    ``"x"``), else as the plain word (``batched``)."""
    out: dict[str, object] = {}
    for item in given:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--setting {item!r}: write NAME=VALUE, e.g. unpaged_parallel=batched")
        try:
            out[name.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[name.strip()] = value
    return out
